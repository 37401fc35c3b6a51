//! The stage's side of offloaded experts: an [`ExpertExec`] that sends each
//! offloaded block's work to the expert worker holding that layer and
//! waits for the answer (over shared memory or gRPC, see
//! `omni_transport::experts`), timing the wait.

use omni_engine::{EngineError, ExpertBatch, ExpertExec};
use omni_transport::ExpertLink;
use std::time::{Duration, Instant};

/// Links to the expert workers of one stage, by layer.
pub struct RemoteExperts {
    routes: Vec<Route>,
    /// The route of each call submitted and not yet waited for, oldest first.
    pending: std::collections::VecDeque<usize>,
    timeout: Duration,
    /// Time spent in `wait` since the counter was last taken.
    waited: Duration,
}

pub struct Route {
    pub worker: String,
    pub layers: Vec<u32>,
    pub link: ExpertLink,
}

impl RemoteExperts {
    /// `timeout` bounds each wait: an expert worker that neither answers
    /// nor dies (stopped, wedged) fails the step instead of hanging it.
    pub fn new(routes: Vec<Route>, timeout: Duration) -> RemoteExperts {
        RemoteExperts {
            routes,
            pending: Default::default(),
            timeout,
            waited: Duration::ZERO,
        }
    }

    pub fn routes(&self) -> &[Route] {
        &self.routes
    }

    /// Time spent waiting since the last call, and resets it.
    pub fn take_waited(&mut self) -> Duration {
        std::mem::take(&mut self.waited)
    }
}

impl ExpertExec for RemoteExperts {
    fn submit(&mut self, b: ExpertBatch) -> Result<(), EngineError> {
        let i = self
            .routes
            .iter()
            .position(|r| r.layers.contains(&b.layer))
            .ok_or_else(|| {
                EngineError::Experts(format!("no expert worker was wired for layer {}", b.layer))
            })?;
        self.routes[i]
            .link
            .submit(b.layer, b.n_tokens, &b.x, &b.ids, &b.weights, b.invariant)
            .map_err(|e| EngineError::Experts(e.to_string()))?;
        self.pending.push_back(i);
        Ok(())
    }

    /// A ring is on this host; a gRPC link is taken to cross to another
    /// (on one host it may not, and the stage then computes at the same time).
    fn on_this_host(&self, layer: u32) -> bool {
        self.routes
            .iter()
            .find(|r| r.layers.contains(&layer))
            .is_none_or(|r| r.link.kind() == "shm")
    }

    fn wait(&mut self) -> Result<Vec<f32>, EngineError> {
        let i = self
            .pending
            .pop_front()
            .ok_or_else(|| EngineError::Experts("wait without a submitted batch".into()))?;
        let t = Instant::now();
        let r = self.routes[i].link.wait(self.timeout);
        self.waited += t.elapsed();
        r.map_err(|e| EngineError::Experts(e.to_string()))
    }
}
