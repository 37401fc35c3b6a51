//! Why a plan cannot be made, with every number needed to see why.

use crate::show::layers_phrase;
use crate::show::pct;
use crate::spec::StageBytes;
use omni_engine::range::LayerRange;
use omni_engine::units::fmt_bytes;
use std::fmt;

#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    #[error("no workers to plan for")]
    NoWorkers,
    #[error("{0}")]
    Config(String),
    #[error("{workers} workers but the model has only {n_layer} layers: every worker needs at least one layer")]
    TooManyWorkers { workers: usize, n_layer: u32 },
    #[error("bad split: {0}")]
    Split(String),
    #[error("{0}")]
    DoesNotFit(Box<NoFit>),
    #[error("{0}")]
    SharedDoesNotFit(Box<SharedNoFit>),
    #[error("{0}")]
    ExpertsDoNotFit(Box<ExpertNoFit>),
}

/// The stage that does not fit, with every number needed to see why.
#[derive(Clone, Debug, PartialEq)]
pub struct NoFit {
    pub stage: usize,
    pub worker: String,
    pub device: String,
    pub range: LayerRange,
    pub bytes: StageBytes,
    pub total_bytes: u64,
    pub headroom: f64,
    /// "the best automatic split" or "the manual split 12,12".
    pub split: String,
    /// What all stages together need, and what all workers offer after
    /// headroom (memory that workers share counted once).
    pub all_need: u64,
    pub all_budget: u64,
    /// Workers that share memory, "w0 and w1 share host box1's RAM"; empty if none.
    pub shared: String,
}

impl fmt::Display for NoFit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = &self.bytes;
        write!(
            f,
            "model needs {} on stage {} (worker {}, {}) but it has {} free ({} total, {}% headroom: {} usable): weights {}, KV {}, compute {}; stage {} runs {} in {}",
            fmt_bytes(b.total),
            self.stage,
            self.worker,
            self.device,
            fmt_bytes(b.free),
            fmt_bytes(self.total_bytes),
            pct(self.headroom),
            fmt_bytes(b.budget),
            fmt_bytes(b.weights),
            fmt_bytes(b.kv),
            fmt_bytes(b.compute),
            self.stage,
            self.range,
            self.split,
        )?;
        if self.all_need > self.all_budget {
            write!(
                f,
                "; in all the model needs {} but the workers offer {} after headroom",
                fmt_bytes(self.all_need),
                fmt_bytes(self.all_budget)
            )?;
            if !self.shared.is_empty() {
                write!(f, " (memory they share counted once: {})", self.shared)?;
            }
        }
        write!(
            f,
            "; lower the context, sequences or micro-batch, or add memory or workers"
        )
    }
}

/// Stages that each fit their worker's own offer but not, together, the
/// memory those workers share (one host's RAM, one GPU).
#[derive(Clone, Debug, PartialEq)]
pub struct SharedNoFit {
    /// "host box1's RAM".
    pub memory: String,
    /// "w0 and w1".
    pub workers: String,
    /// The stages on it: index, range and total bytes.
    pub stages: Vec<(usize, LayerRange, u64)>,
    /// What those stages need together, in parts and in all.
    pub weights: u64,
    pub kv: u64,
    pub compute: u64,
    pub need: u64,
    /// The largest offer among the workers on it, and that after headroom.
    pub free: u64,
    pub budget: u64,
    pub headroom: f64,
    /// "the best automatic split (layers 12,12)" or "the manual split 12,12".
    pub split: String,
}

impl fmt::Display for SharedNoFit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let stages: Vec<String> = self
            .stages
            .iter()
            .map(|(i, r, b)| format!("stage {i} {} for {r}", fmt_bytes(*b)))
            .collect();
        write!(
            f,
            "model needs {} on {} together ({}; weights {}, KV {}, compute {}) in {}, but they share {}, which has {} free ({}% headroom: {} usable): each worker offers what that memory has free, so it is counted once, not once per worker; lower the context, sequences or micro-batch, or add workers with memory of their own (another host or GPU)",
            fmt_bytes(self.need),
            self.workers,
            stages.join(", "),
            fmt_bytes(self.weights),
            fmt_bytes(self.kv),
            fmt_bytes(self.compute),
            self.split,
            self.memory,
            fmt_bytes(self.free),
            pct(self.headroom),
            fmt_bytes(self.budget),
        )
    }
}

/// Offloaded experts that no expert worker has room for.
#[derive(Clone, Debug, PartialEq)]
pub struct ExpertNoFit {
    /// The first layer whose experts found no room, and their bytes.
    pub layer: u32,
    pub layer_bytes: u64,
    /// Every offloaded layer left without an expert worker.
    pub left: Vec<u32>,
    /// The last expert worker, what it holds (`layers`, `bytes.weights`) and offers.
    pub worker: String,
    pub device: String,
    pub layers: Vec<u32>,
    pub bytes: StageBytes,
    pub total_bytes: u64,
    pub headroom: f64,
    /// All offloaded experts, and what all expert workers offer for experts
    /// (budget less compute buffer; of memory shared with stages, what
    /// they leave).
    pub all_need: u64,
    pub all_budget: u64,
    /// "c0 shares host box1's RAM with w0 and w1, whose stages hold 1.2 GiB
    /// of it", when the last expert worker shares memory; empty if not.
    pub shared: String,
}

impl fmt::Display for ExpertNoFit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = &self.bytes;
        write!(
            f,
            "the routed experts of layer {} need {} but no expert worker has room for them: the last, {} ({}), has {} free ({} total, {}% headroom: {} usable, {} of it for its compute buffer) and holds ",
            self.layer,
            fmt_bytes(self.layer_bytes),
            self.worker,
            self.device,
            fmt_bytes(b.free),
            fmt_bytes(self.total_bytes),
            pct(self.headroom),
            fmt_bytes(b.budget),
            fmt_bytes(b.compute),
        )?;
        if self.layers.is_empty() {
            write!(f, "no experts")?;
        } else {
            write!(
                f,
                "{} of experts ({})",
                fmt_bytes(b.weights),
                layers_phrase(&self.layers)
            )?;
        }
        write!(
            f,
            "; the experts of {} are left without an expert worker; in all the offloaded experts need {} but the expert workers offer {} after headroom and compute buffers; add memory or expert workers, lower the micro-batch, or give the devices room to keep more experts",
            layers_phrase(&self.left),
            fmt_bytes(self.all_need),
            fmt_bytes(self.all_budget),
        )?;
        if !self.shared.is_empty() {
            write!(f, " ({})", self.shared)?;
        }
        Ok(())
    }
}
