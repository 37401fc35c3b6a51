//! Live migration: moving layers between stage workers while the cluster
//! serves (the admin API's Rebalance, Drain and Undrain).
//!
//! A move is a new layout (which workers serve, in pipeline order, and how
//! many layers each runs) carried out in phases:
//!
//! 1. Check it with the planner, on the same worker specs as at start-up
//!    (refused with the planner's numbers if it does not fit), and check
//!    that every worker that changes can hold its old and new stage at
//!    once (the switch keeps both until it commits).
//! 2. Prepare: every worker whose range changes loads its new range beside
//!    the running one. Serving goes on meanwhile.
//! 3. Pause the scheduler at a step boundary (nothing in flight), stream
//!    the KV cache of the layers that change hands (and the sequences'
//!    sampling state, when the head moves) from the workers that ran them
//!    into the ones that take them, and switch every changed worker to its
//!    new stage. Rewire the pipeline where a worker left or joined it.
//! 4. Commit (the old stages are dropped, their memory freed) and resume;
//!    or, if anything failed, roll every worker back to its old stage (it
//!    was kept, and no step ran since) and resume as before.

mod apply;
mod handover;

use crate::error::Error;
use crate::plan::{self, Plan, PlanConfig, Split, WorkerSpec};
use crate::scheduler::Event;
use crate::Registered;
use omni_engine::stage::LayerRange;
use omni_engine::ModelFile;
use omni_proto::admin::v1::{MoveReply, PlanReply};
use omni_proto::coordinator::v1::{ExpertWorkerInfo, StageInfo};
use omni_proto::worker::v1::{worker_client::WorkerClient, ExpertRoute};
use omni_transport::{Inbox, TransportChoice};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tonic::Status;

/// What one worker was given by the plan.
#[derive(Clone, Debug)]
pub struct Placement {
    pub worker: Registered,
    /// Pipeline position (stages only).
    pub stage: u32,
    pub layers: String,
    pub offloaded: String,
    /// Weights, KV cache and compute buffer, as loaded.
    pub planned_bytes: u64,
    /// Stages: the layer range; expert workers: the layers of their experts.
    pub range: std::ops::Range<u32>,
    pub expert_layers: Vec<u32>,
    /// Registered but out of the pipeline.
    pub drained: bool,
}

/// The cluster as the coordinator made it: what the admin API shows.
pub struct ClusterView {
    pub model: Arc<ModelFile>,
    pub config: PlanConfig,
    pub stages: Vec<WorkerSpec>,
    pub expert_workers: Vec<WorkerSpec>,
    pub plan: Plan,
    pub placements: Vec<Placement>,
}

/// One stage worker as the coordinator knows it.
pub struct LiveWorker {
    pub reg: Registered,
    pub spec: WorkerSpec,
    /// Bytes of its stage (weights, KV cache, compute), as it reported them.
    pub stage_bytes: (u64, u64, u64),
    /// How its output and expert calls travel ("shm"/"grpc").
    pub transport: String,
    pub expert_transports: Vec<String>,
}

/// What a cluster's moves need to know of the coordinator.
pub struct Setup {
    pub model: Arc<ModelFile>,
    pub pcfg: PlanConfig,
    pub transport: TransportChoice,
    pub advertise: String,
    pub shm_dir: std::path::PathBuf,
    pub events: omni_transport::BellSender<Event>,
    /// How long a pause may wait for the steps in flight.
    pub step_timeout: Duration,
    /// What every stage's Load carries besides its range (a recovery
    /// loads a restarted worker with it).
    pub load: omni_proto::worker::v1::LoadRequest,
}

/// The running cluster, as moves need it.
pub struct Live {
    pub setup: Setup,
    /// Every stage worker, in pipeline order (by id).
    pub workers: Vec<LiveWorker>,
    pub expert_workers: Vec<(Registered, WorkerSpec, ExpertWorkerInfo)>,
    /// Which workers serve, in pipeline order: `plan.stages[i]` runs on
    /// `workers[serving[i]]`.
    pub serving: Vec<usize>,
    pub plan: Plan,
    /// The coordinator's results inbox (the last stage sends to it).
    pub results: Arc<Mutex<Inbox>>,
    pub(crate) rings: u32,
    /// The pipeline's links as wired now: (sender, receiver), None being
    /// the coordinator.
    pub(crate) links: Vec<(Option<usize>, Option<usize>)>,
    /// The offloaded layers each worker's expert routes were wired for.
    pub(crate) wired: Vec<(usize, Vec<u32>)>,
}

/// What a move does to one worker.
struct Change {
    worker: usize,
    old: Option<(LayerRange, Vec<u32>)>,
    new: Option<(LayerRange, Vec<u32>)>,
    /// Pipeline position once moved.
    stage: u32,
}

impl Live {
    pub fn new(
        setup: Setup,
        workers: Vec<LiveWorker>,
        expert_workers: Vec<(Registered, WorkerSpec, ExpertWorkerInfo)>,
        plan: Plan,
        results: Arc<Mutex<Inbox>>,
    ) -> Live {
        let serving: Vec<usize> = (0..workers.len()).collect();
        let links = pipeline_links(&serving);
        let wired = serving
            .iter()
            .map(|&w| (w, plan.stages[w].offloaded.clone()))
            .collect();
        Live {
            links,
            wired,
            setup,
            workers,
            expert_workers,
            serving,
            plan,
            results,
            rings: 0,
        }
    }

    /// What the admin API shows: every stage worker (serving ones in
    /// pipeline order, then drained ones) and every expert worker.
    pub fn view(&self) -> ClusterView {
        let mut placements = Vec::new();
        for (i, st) in self.plan.stages.iter().enumerate() {
            let w = &self.workers[self.serving[i]];
            let (a, b, c) = w.stage_bytes;
            placements.push(Placement {
                worker: w.reg.clone(),
                stage: i as u32,
                layers: st.range.to_string(),
                offloaded: plan::fmt_layers(&st.offloaded),
                planned_bytes: a + b + c,
                range: st.range.layers.clone(),
                expert_layers: Vec::new(),
                drained: false,
            });
        }
        for (i, w) in self.workers.iter().enumerate() {
            if !self.serving.contains(&i) {
                placements.push(Placement {
                    worker: w.reg.clone(),
                    stage: 0,
                    layers: "drained".into(),
                    offloaded: String::new(),
                    planned_bytes: 0,
                    range: 0..0,
                    expert_layers: Vec::new(),
                    drained: true,
                });
            }
        }
        for (reg, _, e) in &self.expert_workers {
            placements.push(Placement {
                worker: reg.clone(),
                stage: 0,
                layers: e.layers.clone(),
                offloaded: String::new(),
                planned_bytes: e.weight_bytes + e.compute_bytes,
                range: 0..0,
                expert_layers: self
                    .plan
                    .experts
                    .iter()
                    .find(|p| p.worker == reg.id)
                    .map(|p| p.layers.clone())
                    .unwrap_or_default(),
                drained: false,
            });
        }
        ClusterView {
            model: self.setup.model.clone(),
            config: self.setup.pcfg.clone(),
            stages: self.serving_specs(&self.serving),
            expert_workers: self.expert_workers.iter().map(|e| e.1.clone()).collect(),
            plan: self.plan.clone(),
            placements,
        }
    }

    /// The coordinator's Info stages (serving workers, pipeline order).
    pub fn stage_infos(&self) -> Vec<StageInfo> {
        self.plan
            .stages
            .iter()
            .zip(&self.serving)
            .map(|(st, &wi)| {
                let w = &self.workers[wi];
                StageInfo {
                    worker_id: w.reg.id.clone(),
                    device: w.reg.inventory.device.clone(),
                    range: st.range.to_string(),
                    transport: w.transport.clone(),
                    weight_bytes: w.stage_bytes.0,
                    kv_bytes: w.stage_bytes.1,
                    compute_bytes: w.stage_bytes.2,
                    worker_addr: w.reg.addr.clone(),
                    offloaded: if st.offloaded.is_empty() {
                        String::new()
                    } else {
                        plan::fmt_layers(&st.offloaded)
                    },
                    expert_transports: w.expert_transports.clone(),
                }
            })
            .collect()
    }

    fn serving_specs(&self, serving: &[usize]) -> Vec<WorkerSpec> {
        serving
            .iter()
            .map(|&i| self.workers[i].spec.clone())
            .collect()
    }

    fn index_of(&self, id: &str) -> Result<usize, Status> {
        self.workers
            .iter()
            .position(|w| w.reg.id == id)
            .ok_or_else(|| {
                let ids: Vec<&str> = self.workers.iter().map(|w| w.reg.id.as_str()).collect();
                Status::from(Error::not_found(format!(
                    "no stage worker '{id}' (the stage workers are {})",
                    ids.join(", ")
                )))
            })
    }

    /// The counts of a split over the serving workers that moves `moved`
    /// to worker `to` (see [`counts_for_move`]).
    pub fn counts_moving(&self, moved: std::ops::Range<u32>, to: &str) -> Result<Vec<u32>, Status> {
        let wi = self.index_of(to)?;
        let t = self.serving.iter().position(|&s| s == wi).ok_or_else(|| {
            Status::from(Error::refused(format!(
                "worker {to} is drained; undrain it before moving layers to it"
            )))
        })?;
        let ranges: Vec<std::ops::Range<u32>> = self
            .plan
            .stages
            .iter()
            .map(|s| s.range.layers.clone())
            .collect();
        let ids: Vec<&str> = self
            .serving
            .iter()
            .map(|&i| self.workers[i].reg.id.as_str())
            .collect();
        counts_for_move(&ranges, &ids, moved, t).map_err(|e| Status::from(Error::refused(e)))
    }

    /// Layer counts by proportion (`--split 3,1`) over the serving workers.
    pub fn counts_for(&self, split: Split) -> Result<Vec<u32>, Status> {
        self.plan_for(&self.serving, Some(split))
            .map(|p| counts_of(&p))
    }

    /// Rebalance to `counts` over the serving workers.
    pub async fn rebalance(&mut self, counts: Vec<u32>) -> Result<MoveReply, Status> {
        let serving = self.serving.clone();
        self.apply(serving, Some(counts)).await
    }

    /// Takes `id` out of the pipeline; the others take the automatic split.
    pub async fn drain(&mut self, id: &str) -> Result<MoveReply, Status> {
        let wi = self.index_of(id)?;
        if !self.serving.contains(&wi) {
            return Err(Status::from(Error::refused(format!(
                "worker {id} is already drained"
            ))));
        }
        let serving: Vec<usize> = self.serving.iter().copied().filter(|&i| i != wi).collect();
        if serving.is_empty() {
            return Err(Status::from(Error::refused(format!(
                "worker {id} is the only serving worker; draining it would leave nothing to serve"
            ))));
        }
        self.apply(serving, None).await
    }

    /// Puts a drained `id` back at its place, with the automatic split.
    pub async fn undrain(&mut self, id: &str) -> Result<MoveReply, Status> {
        let wi = self.index_of(id)?;
        if self.serving.contains(&wi) {
            return Err(Status::from(Error::refused(format!(
                "worker {id} is serving, not drained"
            ))));
        }
        let mut serving = self.serving.clone();
        serving.push(wi);
        serving.sort_unstable();
        self.apply(serving, None).await
    }

    pub(crate) fn plan_for(&self, serving: &[usize], split: Option<Split>) -> Result<Plan, Status> {
        let mut cfg = self.setup.pcfg.clone();
        cfg.split = split;
        let experts: Vec<WorkerSpec> = self.expert_workers.iter().map(|e| e.1.clone()).collect();
        plan::plan_with_experts(
            &self.setup.model,
            &self.serving_specs(serving),
            &experts,
            &cfg,
        )
        .map_err(|e| Status::from(Error::refused(e.to_string())))
    }

    /// A stage worker that registered again from `addr` (it restarted
    /// while drained: nothing to recover, but moves must reach it there).
    pub(crate) fn set_addr(&mut self, id: &str, addr: &str) {
        if let Some(w) = self.workers.iter_mut().find(|w| w.reg.id == id) {
            w.reg.addr = addr.to_string();
        }
    }

    pub(crate) fn addr(&self, wi: usize) -> (String, String) {
        let r = &self.workers[wi].reg;
        (r.id.clone(), r.addr.clone())
    }
}

/// The expert routes of a stage whose `offloaded` layers' experts run on
/// the expert workers `plan` gives them to.
pub fn routes_for(
    offloaded: &[u32],
    plan: &Plan,
    addr_of: impl Fn(&str) -> String,
) -> Vec<ExpertRoute> {
    let mut routes: Vec<ExpertRoute> = Vec::new();
    for &il in offloaded {
        let ep = plan
            .experts
            .iter()
            .find(|e| e.layers.contains(&il))
            .expect("every offloaded layer has an expert worker");
        match routes.iter_mut().find(|r| r.worker_id == ep.worker) {
            Some(r) => r.layers.push(il),
            None => routes.push(ExpertRoute {
                worker_id: ep.worker.clone(),
                grpc_addr: addr_of(&ep.worker),
                layers: vec![il],
            }),
        }
    }
    routes
}

/// Who sends to whom along `serving` (None: the coordinator).
fn pipeline_links(serving: &[usize]) -> Vec<(Option<usize>, Option<usize>)> {
    let mut v = Vec::new();
    let mut prev = None;
    for &w in serving {
        v.push((prev, Some(w)));
        prev = Some(w);
    }
    v.push((prev, None));
    v
}

/// The layers whose routed experts run on expert workers, ascending.
pub(crate) fn offloaded_layers(p: &Plan) -> Vec<u32> {
    let mut v: Vec<u32> = p.stages.iter().flat_map(|s| s.offloaded.clone()).collect();
    v.sort_unstable();
    v
}

fn counts_of(p: &Plan) -> Vec<u32> {
    p.stages
        .iter()
        .map(|s| s.range.layers.len() as u32)
        .collect()
}

pub(crate) fn plan_reply(p: &Plan) -> Result<PlanReply, Status> {
    Ok(PlanReply {
        text: p.to_string(),
        json: serde_json::to_string_pretty(p)
            .map_err(|e| Status::from(Error::internal(e.to_string())))?,
    })
}

/// The layer counts after moving layers `moved` to stage `to`, given the
/// serving stages' `ranges` (contiguous, in order) and their `ids`: `to`
/// grows to cover `moved` (which must touch its range), every other stage
/// gives up the part of `moved` it ran (which must be at its edge, and
/// must not be all it runs).
pub fn counts_for_move(
    ranges: &[std::ops::Range<u32>],
    ids: &[&str],
    moved: std::ops::Range<u32>,
    to: usize,
) -> Result<Vec<u32>, String> {
    let n_layer = ranges.last().map_or(0, |r| r.end);
    if moved.is_empty() || moved.end > n_layer {
        return Err(format!(
            "layers {}-{} are not a layer range of this model (layers 0-{})",
            moved.start,
            moved.end.saturating_sub(1),
            n_layer.saturating_sub(1)
        ));
    }
    let show = omni_engine::fmt_layers;
    let t = &ranges[to];
    if moved.end < t.start || moved.start > t.end {
        return Err(format!(
            "layers {} are not next to {}'s layers {}: a worker can take only layers adjacent to its own",
            show(&moved),
            ids[to],
            show(t)
        ));
    }
    let mut new: Vec<std::ops::Range<u32>> = Vec::new();
    for (i, r) in ranges.iter().enumerate() {
        if i == to {
            new.push(r.start.min(moved.start)..r.end.max(moved.end));
            continue;
        }
        let keep: Vec<u32> = r.clone().filter(|l| !moved.contains(l)).collect();
        if keep.is_empty() {
            return Err(format!(
                "{} would keep none of its layers {}; drain it instead",
                ids[i],
                show(r)
            ));
        }
        let kept = keep[0]..keep[keep.len() - 1] + 1;
        if kept.len() != keep.len() {
            return Err(format!(
                "layers {} are inside {}'s layers {}, which would be cut in two",
                show(&moved),
                ids[i],
                show(r)
            ));
        }
        new.push(kept);
    }
    // The ranges must still tile the model in pipeline order.
    let mut next = 0;
    for (i, r) in new.iter().enumerate() {
        if r.start != next {
            return Err(format!(
                "moving layers {} to {} would leave the pipeline out of order at {} (layers {}); move them in steps through the workers between",
                show(&moved),
                ids[to],
                ids[i],
                show(r)
            ));
        }
        next = r.end;
    }
    Ok(new.iter().map(|r| r.len() as u32).collect())
}

/// How long a worker may take to load its new range (a DeepSeek-sized
/// range is many GiB read from disk).
pub(crate) const PREPARE_TIMEOUT: Duration = Duration::from_secs(1800);
/// Every other call of a move (export, switch, commit, rewiring).
pub(crate) const CALL_TIMEOUT: Duration = Duration::from_secs(120);

/// A client of the worker at `addr` whose calls fail after `timeout`.
pub(crate) async fn client(
    addr: &str,
    timeout: Duration,
) -> Result<WorkerClient<tonic::transport::Channel>, String> {
    let ch = omni_transport::tls::endpoint(addr)
        .map_err(|e| e.to_string())?
        .connect_timeout(Duration::from_secs(5))
        .timeout(timeout)
        .tcp_nodelay(true)
        .connect()
        .await
        .map_err(|e| {
            format!(
                "cannot reach worker at {addr}: {}",
                omni_transport::tls::describe(&e)
            )
        })?;
    Ok(WorkerClient::new(ch)
        .max_decoding_message_size(64 << 20)
        .max_encoding_message_size(64 << 20))
}

#[cfg(test)]
mod tests {
    use super::counts_for_move;

    const IDS: [&str; 3] = ["w0", "w1", "w2"];

    #[test]
    fn a_move_grows_the_taker_and_shrinks_the_givers() {
        let r = [0..4, 4..8, 8..12];
        assert_eq!(counts_for_move(&r, &IDS, 8..10, 1), Ok(vec![4, 6, 2]));
        assert_eq!(counts_for_move(&r, &IDS, 2..4, 1), Ok(vec![2, 6, 4]));
        assert_eq!(counts_for_move(&r, &IDS, 4..6, 0), Ok(vec![6, 2, 4]));
        // Already there: nothing changes.
        assert_eq!(counts_for_move(&r, &IDS, 5..7, 1), Ok(vec![4, 4, 4]));
    }

    #[test]
    fn impossible_moves_say_why() {
        let r = [0..4, 4..8, 8..12];
        let e = |m, t| counts_for_move(&r, &IDS, m, t).unwrap_err();
        assert!(e(9..11, 0).contains("not next to w0"), "{}", e(9..11, 0));
        assert!(e(4..8, 0).contains("w1 would keep none"), "{}", e(4..8, 0));
        assert!(e(5..6, 0).contains("not next to"), "{}", e(5..6, 0));
        assert!(e(9..10, 1).contains("not next to w1"), "{}", e(9..10, 1));
        assert!(
            e(10..14, 1).contains("not a layer range"),
            "{}",
            e(10..14, 1)
        );
    }
}
