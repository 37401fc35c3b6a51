//! A stage runs one layer range of a model: optionally the embedding, the
//! layers `a..b` with their KV cache, optionally the head (final norm and
//! output projection). A whole model is the range `0..n` with both ends.
//! Stages hand each other a [`Hidden`] state, which serializes to bytes so a
//! split across processes computes exactly what one process computes.

mod device_experts;
mod graph;
mod handover;
mod local_experts;
mod run;
mod weights;
mod wire;

pub use crate::range::LayerRange;
pub use weights::{Repack, Weights};
pub use wire::{Batch, Hidden, HiddenDtype, Logits};

use self::device_experts::DeviceExperts;
use crate::device::Device;
use crate::error::EngineError;
use crate::ffi::device as ggml_device;
use crate::ffi::ggml::Executor;
use crate::ffi::ggml::GraphArena;
use crate::kv::KvCache;
use crate::kv::KvConfig;
use crate::kv::KvLayers;
use crate::model::ModelFile;
use std::cmp::Reverse;
use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::Arc;

#[derive(Clone, Debug, PartialEq)]
pub enum StageOutput {
    Hidden(Hidden),
    Logits(Logits),
}

/// Runtime settings of a stage.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct StageConfig {
    pub kv: KvConfig,
    /// Most tokens in one step (llama.cpp's `n_ubatch`).
    pub n_ubatch: usize,
    pub n_threads: usize,
    /// Where the stage computes: the CPU, or a GPU (weights, KV cache and
    /// compute buffer in its memory).
    #[serde(default)]
    pub device: Device,
    /// Re-lay quantized matmul weights for the CPU's fastest kernels
    /// (llama.cpp's default "extra buffer types"). Costs a copy of those weights.
    pub repack: bool,
    /// Loaded for batch-invariant steps ([`Batch::invariant`]): dense
    /// matmul weights stay in the file's layout, because ggml's repacked
    /// Q4_K kernel computes rows four at a time one way and the rest
    /// another, so a row's result would depend on its batch (routed experts
    /// are still repacked: that kernel takes their rows one at a time).
    /// CPU only.
    #[serde(default)]
    pub deterministic: bool,
    /// With offloaded experts and two or more sequences in a step, run the
    /// step as two micro-batch groups: the stage computes one group's
    /// layers while the expert executor computes the other's experts (a
    /// GPU stage beside a CPU expert worker, or CPU workers on cores of
    /// their own). A batch-invariant step computes exactly what the whole
    /// batch would; otherwise a row moves in its last bits as batching
    /// moves it (see `run.rs`'s `group_split`).
    #[serde(default)]
    pub expert_overlap: bool,
    /// With offloaded experts: compute the shared experts (and the routed
    /// experts kept here) while the expert executor computes the rest,
    /// rather than before handing them over, even where the executor
    /// computes on this host's cores (`ExpertExec::on_this_host`; one on
    /// another host is always overlapped). It pays where the stage's
    /// compute does not take the executor's cores (a GPU stage; CPU workers
    /// on cores of their own); on shared cores the two processes' spinning
    /// thread teams slow each other (measured on a 2-core Zen 3 with an
    /// R1-shaped slice: the stage's own time per decode token 264 ms
    /// concurrent, 217 ms taking turns).
    #[serde(default)]
    pub shared_overlap: bool,
    /// On a GPU stage with offloaded experts: when a step is big enough,
    /// compute its routed experts on the GPU, streaming their weights from
    /// host memory (llama.cpp's op offload), instead of sending its tokens
    /// to the expert executor. Ignored on the CPU.
    #[serde(default)]
    pub local_experts: LocalExperts,
}

/// When a GPU stage computes the routed experts of its offloaded layers
/// itself, streaming their weights from host memory to the device for the
/// step (ggml's scheduler copies a host-resident weight to the GPU for an
/// op whose batch reaches the backend's offload threshold:
/// `GGML_OP_OFFLOAD_MIN_BATCH`, 32 by default). Streaming a layer's experts
/// costs the same for any batch, while the expert executor's time grows
/// with the tokens sent, so it pays from some batch size up: prompt steps,
/// not decoding.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum LocalExperts {
    /// Always the executor.
    #[default]
    Off,
    /// From the batch size where streaming is measured to cost less than
    /// the executor: the stage times a host-to-device copy at load and the
    /// executor's calls as they come (time per token of its calls of at
    /// least the offload threshold's size); until it has timed one, the
    /// executor.
    Auto,
    /// From this many tokens in a step (at least ggml's offload threshold).
    From(usize),
}

impl std::str::FromStr for LocalExperts {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "off" => Ok(LocalExperts::Off),
            "auto" => Ok(LocalExperts::Auto),
            n => match n.parse::<usize>() {
                Ok(n) if n > 0 => Ok(LocalExperts::From(n)),
                _ => Err(format!(
                    "'{s}' is not off, auto or a number of tokens of at least 1"
                )),
            },
        }
    }
}

impl std::fmt::Display for LocalExperts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LocalExperts::Off => f.write_str("off"),
            LocalExperts::Auto => f.write_str("auto"),
            LocalExperts::From(n) => write!(f, "{n}"),
        }
    }
}

impl Default for StageConfig {
    fn default() -> Self {
        StageConfig {
            kv: KvConfig {
                n_ctx: 4096,
                n_seq: 1,
            },
            n_ubatch: 512,
            n_threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
            device: Device::Cpu,
            repack: true,
            deterministic: false,
            expert_overlap: false,
            shared_overlap: false,
            local_experts: LocalExperts::Off,
        }
    }
}

/// A loaded layer range, ready to run steps.
pub struct Stage {
    model: Arc<ModelFile>,
    range: LayerRange,
    cfg: StageConfig,
    weights: Weights,
    /// Layers whose routed experts are computed elsewhere, ascending.
    offloaded: Vec<u32>,
    /// How often each expert of each offloaded layer was selected since load.
    expert_counts: BTreeMap<u32, Vec<u64>>,
    /// Routed experts of offloaded layers kept here after all.
    device: BTreeMap<u32, DeviceExperts>,
    kv: KvCache,
    exec: Executor,
    // Reused scratch for the masks, and for the order lists that take
    // their place in a batch-invariant step.
    mask: Vec<u16>,
    mask_swa: Vec<u16>,
    order: Vec<i32>,
    /// The KV cells the last step's tokens went into.
    last_cells: Vec<i64>,
    /// Where each step's graphs are built, the same memory every step (so
    /// that a GPU replays an unchanged step as one CUDA graph); the side
    /// graph of an offloaded block has its own.
    arena: GraphArena,
    side_arena: GraphArena,
    /// Steps run as two interleaved groups (`StageConfig::expert_overlap`).
    overlapped_steps: u64,
    /// Where the host's time of each step's segments went.
    times: StepTimes,
    /// A step of the last step's shape computes the last step's graph
    /// again (`arena`'s kept graph); `OMNI_GRAPH_REUSE_DISABLE` set (to
    /// anything) builds every step's graph afresh, as llama.cpp's
    /// `LLAMA_GRAPH_REUSE_DISABLE` does.
    reuse_graphs: bool,
    /// On a GPU stage with offloaded experts and `StageConfig::local_experts`
    /// on: which steps compute their routed experts here.
    local: Option<local_experts::LocalRule>,
}

/// The wall time of a stage's segments by phase, summed over its steps:
/// what the host does around the device's work (on a GPU, decoding a small
/// model is bound by it). Each phase is timed with `Instant`, which costs
/// tens of nanoseconds: always on.
#[derive(Clone, Debug, Default)]
pub struct StepTimes {
    /// Segments run (one per step without offloaded experts).
    pub segments: u64,
    /// Of those, steps that computed the last step's graph again (no
    /// build, no allocation; see [`Stage::set_graph_reuse`]).
    pub reused: u64,
    /// Building the graph: ggml's tensor headers and nodes.
    pub build: std::time::Duration,
    /// ggml's scheduler splitting the graph between backends and placing
    /// its tensors in the compute buffer.
    pub alloc: std::time::Duration,
    /// Writing the inputs (ids, positions, masks) into their tensors.
    pub inputs: std::time::Duration,
    /// The graph's computation, until its results are there (on a GPU:
    /// the launch or CUDA graph replay and the device's work).
    pub compute: std::time::Duration,
    /// Reading the output (logits or hidden state) back to the host.
    pub output: std::time::Duration,
}

impl StepTimes {
    /// Each phase's mean per segment, in microseconds, as one line.
    pub fn per_segment(&self) -> String {
        let n = self.segments.max(1) as f64;
        let us = |d: std::time::Duration| d.as_secs_f64() * 1e6 / n;
        format!(
            "build {:.0} µs, alloc {:.0} µs, inputs {:.0} µs, compute {:.0} µs, output {:.0} µs (mean of {} segments, {} of them the last step's graph again)",
            us(self.build),
            us(self.alloc),
            us(self.inputs),
            us(self.compute),
            us(self.output),
            self.segments,
            self.reused
        )
    }
}

impl Stage {
    /// Loads `range` of `model`: maps its weights, repacks what benefits,
    /// allocates the KV cache and sizes the compute buffer for `n_ubatch`.
    pub fn load(
        model: Arc<ModelFile>,
        range: LayerRange,
        cfg: StageConfig,
    ) -> Result<Stage, EngineError> {
        Self::load_with_progress(model, range, cfg, &mut |_, _| {})
    }

    pub fn load_with_progress(
        model: Arc<ModelFile>,
        range: LayerRange,
        cfg: StageConfig,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Stage, EngineError> {
        Self::load_offloaded_with_progress(model, range, cfg, &[], progress)
    }

    /// As [`Stage::load`], leaving out the routed experts
    /// (`ffn_{gate,up,down}_exps`) of the `offloaded` layers: steps then run
    /// through [`Stage::forward_with`], which hands those blocks to an
    /// [`ExpertExec`]. Everything else of those layers (attention, router,
    /// selection bias, shared experts) stays here.
    pub fn load_offloaded(
        model: Arc<ModelFile>,
        range: LayerRange,
        cfg: StageConfig,
        offloaded: &[u32],
    ) -> Result<Stage, EngineError> {
        Self::load_offloaded_with_progress(model, range, cfg, offloaded, &mut |_, _| {})
    }

    pub fn load_offloaded_with_progress(
        model: Arc<ModelFile>,
        range: LayerRange,
        cfg: StageConfig,
        offloaded: &[u32],
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Stage, EngineError> {
        let hp = &model.hparams;
        range.validate(hp.n_layer)?;
        let mut offloaded = offloaded.to_vec();
        offloaded.sort_unstable();
        offloaded.dedup();
        for &il in &offloaded {
            if !range.layers.contains(&il) {
                return Err(EngineError::Config(format!(
                    "layer {il}'s experts cannot be offloaded from a stage of {range}"
                )));
            }
            crate::experts::expert_layer_tensors(&model, il)?;
        }
        if cfg.n_ubatch == 0 {
            return Err(EngineError::Config("n_ubatch must be at least 1".into()));
        }
        if cfg.kv.n_ctx > hp.n_ctx_train as usize {
            return Err(EngineError::Config(format!(
                "context {} exceeds the model's trained context of {} tokens",
                cfg.kv.n_ctx, hp.n_ctx_train
            )));
        }
        if cfg.deterministic && cfg.device.is_gpu() {
            return Err(EngineError::Config(format!(
                "deterministic (batch-invariant) steps run on the CPU backend only; this stage is on {}",
                cfg.device
            )));
        }
        let gpu = match cfg.device.gpu() {
            None => None,
            Some((backend, i)) => {
                Some(ggml_device::gpu_device(backend, i).map_err(EngineError::Gpu)?)
            }
        };
        let exec = Executor::new(gpu, cfg.n_threads).map_err(if cfg.device.is_gpu() {
            EngineError::Gpu
        } else {
            EngineError::CpuBackend
        })?;
        let device = exec.on_gpu().then(|| exec.buffer_type());
        let repack = Repack {
            dense: cfg.repack && !cfg.deterministic,
            experts: cfg.repack,
        };
        // A GPU stage that may compute its offloaded experts itself keeps
        // them mapped in host memory (streamed to the device when used).
        let local_setting = match cfg.local_experts {
            LocalExperts::Off => None,
            s => (device.is_some() && !offloaded.is_empty()).then_some(s),
        };
        let weights = Weights::load(
            &model,
            &range,
            &offloaded,
            local_setting.is_some(),
            repack,
            device,
            progress,
        )?;
        let local = match (local_setting, device) {
            (Some(setting), Some(buft)) => {
                let layer_bytes = offloaded
                    .iter()
                    .map(|&il| model.expert_weight_bytes(il))
                    .max()
                    .unwrap_or(0);
                Some(local_experts::LocalRule::new(setting, buft, layer_bytes)?)
            }
            _ => None,
        };
        let kv = KvCache::new(hp, range.layers.clone(), cfg.kv, exec.buffer_type())?;
        let n_expert = hp.moe.as_ref().map_or(0, |m| m.n_expert as usize);
        let expert_counts = offloaded
            .iter()
            .map(|&il| (il, vec![0; n_expert]))
            .collect();
        let mut stage = Stage {
            model,
            range,
            cfg,
            weights,
            offloaded,
            expert_counts,
            device: BTreeMap::new(),
            kv,
            exec,
            mask: Vec::new(),
            mask_swa: Vec::new(),
            order: Vec::new(),
            last_cells: Vec::new(),
            arena: GraphArena::default(),
            side_arena: GraphArena::default(),
            overlapped_steps: 0,
            times: StepTimes::default(),
            reuse_graphs: std::env::var_os("OMNI_GRAPH_REUSE_DISABLE").is_none(),
            local,
        };
        stage.reserve()?;
        Ok(stage)
    }

    pub fn range(&self) -> &LayerRange {
        &self.range
    }

    /// Steps this stage ran as two interleaved micro-batch groups, its
    /// layers for one beside the expert executor's work for the other
    /// (`StageConfig::expert_overlap`).
    pub fn overlapped_steps(&self) -> u64 {
        self.overlapped_steps
    }

    /// Where the time of this stage's segments went since load or the last
    /// [`Stage::reset_step_times`].
    pub fn step_times(&self) -> &StepTimes {
        &self.times
    }

    pub fn reset_step_times(&mut self) {
        self.times = StepTimes::default();
    }

    /// Whether a step of the last step's shape computes the last step's
    /// graph again (the default, unless `OMNI_GRAPH_REUSE_DISABLE` is set
    /// at load) or builds its graph afresh. Either way the same numbers.
    pub fn set_graph_reuse(&mut self, on: bool) {
        self.reuse_graphs = on;
    }

    pub fn model(&self) -> &Arc<ModelFile> {
        &self.model
    }

    pub fn config(&self) -> &StageConfig {
        &self.cfg
    }

    pub fn weights(&self) -> &Weights {
        &self.weights
    }

    pub fn kv(&self) -> &KvCache {
        &self.kv
    }

    /// Bytes of the compute buffers (sized for the worst-case step).
    pub fn compute_bytes(&self) -> usize {
        let (device, host) = self.exec.buffer_sizes();
        device + host
    }

    /// The compute buffers apart: (the stage's device's, the host's beside
    /// a GPU; 0 on the CPU).
    pub fn compute_bytes_split(&self) -> (usize, usize) {
        self.exec.buffer_sizes()
    }

    /// The ops of this stage's graphs that its GPU's backend cannot compute
    /// and ggml's scheduler runs on the CPU instead (ggml's op names); empty
    /// on the CPU.
    pub fn fallback_ops(&self) -> Vec<String> {
        self.exec.fallback_ops()
    }

    /// The device this stage computes on.
    pub fn device(&self) -> Device {
        self.cfg.device
    }

    /// Layers whose routed experts this stage leaves to an [`ExpertExec`].
    pub fn offloaded_layers(&self) -> &[u32] {
        &self.offloaded
    }

    /// Per offloaded layer, how many times each expert was selected
    /// (`counts[expert]`, one per token and selected expert) by the steps
    /// since load. Only the tokens a block computes count: on the model's
    /// last layer, those whose logits were asked for.
    pub fn expert_counts(&self) -> &BTreeMap<u32, Vec<u64>> {
        &self.expert_counts
    }

    /// The `k` most selected experts of offloaded layer `layer` (ties go
    /// to the lower id), ascending; empty for a layer that is not offloaded.
    pub fn hot_experts(&self, layer: u32, k: usize) -> Vec<u32> {
        let Some(counts) = self.expert_counts.get(&layer) else {
            return Vec::new();
        };
        let mut order: Vec<u32> = (0..counts.len() as u32).collect();
        order.sort_by_key(|&e| (Reverse(counts[e as usize]), e));
        order.truncate(k);
        order.sort_unstable();
        order
    }

    /// Keeps the routed experts `experts` of offloaded layer `layer` on
    /// this stage (`--gpu-experts`): their slices of `ffn_{up,gate,down}_exps`
    /// are copied out of the file into tensors holding only them (repacked
    /// as the whole tensors would be, with `repack`). Steps then
    /// compute those experts here, beside the shared experts, and send the
    /// executor only the tokens that selected an expert elsewhere. An empty
    /// list gives them back; a new list replaces the old one.
    pub fn set_device_experts(&mut self, layer: u32, experts: &[u32]) -> Result<(), EngineError> {
        let bad = |why: String| Err(EngineError::Experts(why));
        if !self.offloaded.contains(&layer) {
            return bad(format!(
                "layer {layer}'s routed experts are not offloaded from this stage (offloaded layers: {:?}), so none can be kept on it",
                self.offloaded
            ));
        }
        let n_expert = self.model.hparams.moe.as_ref().map_or(0, |m| m.n_expert);
        let mut ids = experts.to_vec();
        ids.sort_unstable();
        if let Some(&id) = ids.iter().find(|&&e| e >= n_expert) {
            return bad(format!(
                "expert id {id} is outside layer {layer}'s {n_expert} experts"
            ));
        }
        if let Some(w) = ids.windows(2).find(|w| w[0] == w[1]) {
            return bad(format!("expert {} is listed twice for layer {layer}", w[0]));
        }
        // The old subset goes first, so that its memory is free for the new one.
        self.device.remove(&layer);
        if ids.is_empty() {
            return Ok(());
        }
        let d = DeviceExperts::load(
            &self.model,
            layer,
            ids,
            self.exec.buffer_type(),
            self.cfg.repack && !self.exec.on_gpu(),
        )?;
        self.device.insert(layer, d);
        // This block's side graph grew.
        self.reserve()
    }

    /// The experts of `layer` kept on this stage, ascending.
    pub fn device_experts(&self, layer: u32) -> &[u32] {
        self.device.get(&layer).map_or(&[], |d| &d.ids)
    }

    /// Bytes of the routed-expert subsets kept on this stage.
    pub fn device_expert_bytes(&self) -> u64 {
        self.device.values().map(|d| d.bytes).sum()
    }

    /// The KV cache of `layers` (inside this stage's range) for every
    /// sequence, to hand to the stage that takes those layers over; see
    /// [`KvCache::export`]. The stage is unchanged.
    pub fn export_kv(&self, layers: Range<u32>) -> Result<KvLayers, EngineError> {
        self.kv.export(layers)
    }

    /// Puts exported layers into this stage's KV cache ([`KvCache::import`]).
    pub fn import_kv(&mut self, kv: &KvLayers) -> Result<(), EngineError> {
        self.kv.import(kv)
    }

    /// Bytes this stage holds: weights (mapped and repacked), KV cache,
    /// compute buffer and kept experts.
    pub fn held_bytes(&self) -> u64 {
        self.weights.mapped_bytes
            + self.weights.repacked_bytes
            + self.kv.allocated_bytes()
            + self.compute_bytes() as u64
            + self.device_expert_bytes()
    }

    /// Bytes this stage holds in its GPU's memory: the weights uploaded
    /// there, the KV cache, the device's part of the compute buffer and the
    /// experts kept there; 0 on the CPU.
    pub fn device_bytes(&self) -> u64 {
        if !self.exec.on_gpu() {
            return 0;
        }
        self.weights.repacked_bytes
            + self.kv.allocated_bytes()
            + self.compute_bytes_split().0 as u64
            + self.device_expert_bytes()
    }

    /// Frees the KV cells of `seq` (all of them, or from position `from` on).
    pub fn remove_seq(&mut self, seq: u32, from: Option<i32>) {
        self.kv.remove_seq(seq, from);
    }

    /// Frees every KV cell, the prefix cache's too (a recovery starts the
    /// cache over).
    pub fn clear_kv(&mut self) {
        self.kv.clear();
    }

    /// Lets `seq` see cells other sequences computed ([`KvCache::share`]).
    /// A stage without layers keeps no cells, so has nothing to do.
    pub fn share_kv(&mut self, seq: u32, cells: &[i64]) -> Result<(), EngineError> {
        if self.range.layers.is_empty() {
            return Ok(());
        }
        self.kv.share(seq, cells)
    }

    /// Keeps cells for the prefix cache ([`KvCache::retain`]).
    pub fn retain_kv(&mut self, cells: &[i64]) -> Result<(), EngineError> {
        if self.range.layers.is_empty() {
            return Ok(());
        }
        self.kv.retain(cells)
    }

    /// Gives cells up from the prefix cache ([`KvCache::evict`]).
    pub fn evict_kv(&mut self, cells: &[i64]) -> Result<(), EngineError> {
        if self.range.layers.is_empty() {
            return Ok(());
        }
        self.kv.evict(cells)
    }

    /// The KV cell of each token of the last step that ran (empty if the
    /// stage has no layers).
    pub fn last_cells(&self) -> &[i64] {
        &self.last_cells
    }
}
