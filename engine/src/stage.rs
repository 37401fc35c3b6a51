//! A stage runs one layer range of a model: optionally the embedding, the
//! layers `a..b` with their KV cache, optionally the head (final norm and
//! output projection). A whole model is the range `0..n` with both ends.
//! Stages hand each other a [`Hidden`] state, which serializes to bytes so a
//! split across processes computes exactly what one process computes.

use std::cmp::Reverse;
use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::sync::Arc;

use crate::device::Device;
use crate::error::EngineError;
use crate::experts::{ExpertBatch, ExpertExec};
use crate::ffi::device as ggml_device;
use crate::ffi::ggml::{
    self, Buffer, BufferType, Ctx, Executor, Tensor, TensorStore, TYPE_F16, TYPE_F32, TYPE_I32,
    TYPE_I64,
};
use crate::kv::{KvCache, KvConfig, KvLayers};
use crate::model::layers::{finish_moe, Activation, LayerCx};
use crate::model::moe::{moe_experts, Routing};
use crate::model::{ModelFile, WeightOp};

/// Which part of the model a stage runs.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct LayerRange {
    pub embed: bool,
    pub layers: Range<u32>,
    pub head: bool,
}

impl LayerRange {
    pub fn whole(n_layer: u32) -> LayerRange {
        LayerRange {
            embed: true,
            layers: 0..n_layer,
            head: true,
        }
    }

    /// Splits `0..n_layer` into contiguous ranges of the given sizes; the
    /// first gets the embedding, the last the head.
    pub fn split(n_layer: u32, sizes: &[u32]) -> Result<Vec<LayerRange>, EngineError> {
        if sizes.is_empty() || sizes.iter().sum::<u32>() != n_layer {
            return Err(EngineError::Config(format!(
                "layer split {sizes:?} does not add up to the model's {n_layer} layers"
            )));
        }
        let mut start = 0;
        let n = sizes.len();
        Ok(sizes
            .iter()
            .enumerate()
            .map(|(i, &s)| {
                let r = LayerRange {
                    embed: i == 0,
                    layers: start..start + s,
                    head: i == n - 1,
                };
                start += s;
                r
            })
            .collect())
    }

    fn validate(&self, n_layer: u32) -> Result<(), EngineError> {
        if self.layers.start > self.layers.end || self.layers.end > n_layer {
            return Err(EngineError::Config(format!(
                "layers {}-{} are outside the model's layers 0-{}",
                self.layers.start,
                self.layers.end.saturating_sub(1),
                n_layer.saturating_sub(1)
            )));
        }
        if self.layers.is_empty() && !self.embed && !self.head {
            return Err(EngineError::Config(
                "an empty layer range with neither embedding nor head does nothing".into(),
            ));
        }
        Ok(())
    }
}

impl std::fmt::Display for LayerRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let layers = match self.layers.len() {
            0 => String::new(),
            1 => format!("layer {}", crate::fmt_layers(&self.layers)),
            _ => format!("layers {}", crate::fmt_layers(&self.layers)),
        };
        let parts: Vec<&str> = [
            self.embed.then_some("embed"),
            Some(layers.as_str()),
            self.head.then_some("head"),
        ]
        .into_iter()
        .flatten()
        .filter(|p| !p.is_empty())
        .collect();
        write!(f, "{}", parts.join(" + "))
    }
}

/// One step's worth of tokens, possibly from several sequences.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Batch {
    /// Token ids (needed by the stage that runs the embedding).
    pub tokens: Vec<u32>,
    pub pos: Vec<i32>,
    pub seq: Vec<u32>,
    /// Whether the logits of each token are wanted.
    pub logits: Vec<bool>,
    /// The KV cell of each token, when the caller places them (a replay
    /// that must lay a sequence's cache out as before); empty: the stage
    /// allocates free cells.
    pub cells: Vec<i64>,
}

impl Batch {
    pub fn len(&self) -> usize {
        self.pos.len()
    }
    pub fn is_empty(&self) -> bool {
        self.pos.is_empty()
    }
    pub fn push(&mut self, token: u32, pos: i32, seq: u32, logits: bool) {
        self.tokens.push(token);
        self.pos.push(pos);
        self.seq.push(seq);
        self.logits.push(logits);
    }
    fn validate(&self, need_tokens: bool) -> Result<(), EngineError> {
        let n = self.pos.len();
        if n == 0 {
            return Err(EngineError::Config("empty batch".into()));
        }
        if self.seq.len() != n
            || self.logits.len() != n
            || (need_tokens && self.tokens.len() != n)
            || (!self.cells.is_empty() && self.cells.len() != n)
        {
            return Err(EngineError::Config(format!(
                "inconsistent batch: {} tokens, {} positions, {} sequence ids, {} logit flags, {} cells",
                self.tokens.len(),
                n,
                self.seq.len(),
                self.logits.len(),
                self.cells.len()
            )));
        }
        Ok(())
    }
}

/// The hidden state passed between stages: `[n_tokens, n_embd]`, row-major, f32.
#[derive(Clone, Debug, PartialEq)]
pub struct Hidden {
    pub n_tokens: usize,
    pub n_embd: usize,
    pub data: Vec<f32>,
}

/// Element type of a serialized hidden state. F32 is the default because it
/// makes a split bit-identical to one process; F16 halves the bytes moved.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum HiddenDtype {
    F32,
    F16,
}

const HIDDEN_MAGIC: &[u8; 4] = b"OMHS";

impl Hidden {
    /// `OMHS`, dtype (u8: 0 f32, 1 f16), 3 zero bytes, n_tokens u32, n_embd u32, then the values, little-endian.
    pub fn to_bytes(&self, dtype: HiddenDtype) -> Vec<u8> {
        let elem = if dtype == HiddenDtype::F32 { 4 } else { 2 };
        let mut out = Vec::with_capacity(16 + self.data.len() * elem);
        out.extend_from_slice(HIDDEN_MAGIC);
        out.extend_from_slice(&[u8::from(dtype == HiddenDtype::F16), 0, 0, 0]);
        out.extend_from_slice(&(self.n_tokens as u32).to_le_bytes());
        out.extend_from_slice(&(self.n_embd as u32).to_le_bytes());
        match dtype {
            HiddenDtype::F32 => self
                .data
                .iter()
                .for_each(|v| out.extend_from_slice(&v.to_le_bytes())),
            HiddenDtype::F16 => {
                let mut h = Vec::new();
                ggml::f32_to_f16(&self.data, &mut h);
                h.iter()
                    .for_each(|v| out.extend_from_slice(&v.to_le_bytes()));
            }
        }
        out
    }

    pub fn from_bytes(b: &[u8]) -> Result<Hidden, EngineError> {
        let bad = |why: String| EngineError::BadHidden(why);
        if b.len() < 16 || &b[..4] != HIDDEN_MAGIC {
            return Err(bad(format!(
                "not a serialized hidden state ({} bytes, magic {:?})",
                b.len(),
                b.get(..4)
            )));
        }
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]) as usize;
        let (n_tokens, n_embd) = (u32_at(8), u32_at(12));
        let elem = match b[4] {
            0 => 4,
            1 => 2,
            d => return Err(bad(format!("unknown dtype {d}"))),
        };
        let n = n_tokens
            .checked_mul(n_embd)
            .ok_or_else(|| bad("size overflows".into()))?;
        if b.len() - 16 != n * elem {
            return Err(bad(format!(
                "{n_tokens} x {n_embd} values need {} bytes, got {}",
                n * elem,
                b.len() - 16
            )));
        }
        let body = &b[16..];
        let data = if elem == 4 {
            body.chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect()
        } else {
            body.chunks_exact(2)
                .map(|c| f16_to_f32(u16::from_le_bytes([c[0], c[1]])))
                .collect()
        };
        Ok(Hidden {
            n_tokens,
            n_embd,
            data,
        })
    }
}

/// IEEE half to single (exact; every f16 is an f32).
fn f16_to_f32(h: u16) -> f32 {
    let sign = ((h >> 15) as u32) << 31;
    let exp = ((h >> 10) & 0x1f) as u32;
    let man = (h & 0x3ff) as u32;
    let bits = match (exp, man) {
        (0, 0) => sign,
        (0, m) => {
            // Subnormal: normalise.
            let shift = m.leading_zeros() - 21;
            sign | ((127 - 15 + 1 - shift) << 23) | (((m << shift) & 0x3ff) << 13)
        }
        (31, 0) => sign | 0x7f80_0000,
        (31, m) => sign | 0x7f80_0000 | (m << 13),
        (e, m) => sign | ((e + 127 - 15) << 23) | (m << 13),
    };
    f32::from_bits(bits)
}

/// Logits of the tokens that asked for them, in batch order.
#[derive(Clone, Debug, PartialEq)]
pub struct Logits {
    pub n_vocab: usize,
    /// Batch index of each row.
    pub rows: Vec<usize>,
    pub data: Vec<f32>,
}

impl Logits {
    pub fn row(&self, i: usize) -> &[f32] {
        &self.data[i * self.n_vocab..(i + 1) * self.n_vocab]
    }
    /// The row of batch index `b`, if it was requested.
    pub fn for_batch_index(&self, b: usize) -> Option<&[f32]> {
        self.rows.iter().position(|&r| r == b).map(|i| self.row(i))
    }
}

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
        }
    }
}

/// Where a weight lives: the memory map (zero-copy) or a repacked copy.
#[derive(Clone, Copy, Debug)]
enum Slot {
    Mapped(usize),
    Repacked(usize),
}

/// The weights of one stage.
pub struct Weights {
    mapped: TensorStore,
    repacked: TensorStore,
    by_name: HashMap<String, Slot>,
    _buffers: Vec<Buffer>,
    /// Bytes copied out of the map: into repacked buffers, or on a GPU
    /// stage into GPU memory.
    pub repacked_bytes: u64,
    /// The copies are in GPU memory (a stage on a GPU).
    pub on_device: bool,
    /// Bytes used straight from the memory map.
    pub mapped_bytes: u64,
}

impl Weights {
    pub(crate) fn get(&self, name: &str) -> Option<Tensor<'_>> {
        self.by_name.get(name).map(|s| match *s {
            Slot::Mapped(i) => self.mapped.get(i),
            Slot::Repacked(i) => self.repacked.get(i),
        })
    }

    /// Whether this stage holds the weight `name`, and if so whether it was
    /// repacked (`Some(true)`) or is used from the memory map (`Some(false)`).
    pub fn is_repacked(&self, name: &str) -> Option<bool> {
        self.by_name
            .get(name)
            .map(|s| matches!(s, Slot::Repacked(_)))
    }

    pub(crate) fn layer(&self, il: u32, name: &str) -> Option<Tensor<'_>> {
        self.get(&format!("blk.{il}.{name}"))
    }

    /// The weights of `range`, less the routed experts of the `offloaded` layers.
    fn load(
        model: &ModelFile,
        range: &LayerRange,
        offloaded: &[u32],
        repack: bool,
        device: Option<BufferType>,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Weights, EngineError> {
        let g = &model.gguf;
        let hp = &model.hparams;
        // Names this range uses, and the op each feeds (only matmul weights
        // may be repacked: the repacked layout cannot get_rows).
        let mut wanted: Vec<(String, WeightOp)> = Vec::new();
        for il in range.layers.clone() {
            let elsewhere = offloaded.contains(&il);
            for s in &hp.arch.layer_tensors(hp, il) {
                if elsewhere && s.op == WeightOp::MulMatId {
                    continue;
                }
                let name = format!("blk.{il}.{}", s.name);
                if g.tensor(&name).is_some() {
                    wanted.push((name, s.op));
                }
            }
        }
        // On a GPU the embedding stays in host memory (a row lookup per
        // token, as llama.cpp keeps its input layer on the CPU), and a head
        // tied to it gets its own copy in GPU memory, as `output.weight`.
        let head_copy = device.is_some() && range.head && hp.tied_embeddings;
        if range.embed || (range.head && hp.tied_embeddings && !head_copy) {
            wanted.push(("token_embd.weight".into(), WeightOp::Other));
        }
        if range.head {
            wanted.push(("output_norm.weight".into(), WeightOp::Other));
            if !hp.tied_embeddings || head_copy {
                wanted.push(("output.weight".into(), WeightOp::MulMat));
            }
        }
        Self::load_named(model, &wanted, repack, device, progress)
    }

    /// Maps the named tensors of `model` (each with the op that reads it),
    /// copying into the CPU's repacked layout those that llama.cpp's loader
    /// would repack, or with a `device` (a GPU's buffer type) uploading all
    /// but the token embedding there. `output.weight` in a file without
    /// one is the token embedding (a tied head's copy).
    pub(crate) fn load_named(
        model: &ModelFile,
        wanted: &[(String, WeightOp)],
        repack: bool,
        device: Option<BufferType>,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Weights, EngineError> {
        let g = &model.gguf;
        let hp = &model.hparams;
        let extra = if repack && device.is_none() {
            ggml::cpu_extra_buffer_types().map_err(EngineError::CpuBackend)?
        } else {
            Vec::new()
        };
        // Where copied weights go: the GPU, or the CPU's repacked layout.
        let repack_buft: Option<BufferType> = device.or(extra.first().copied());
        let mut mapped = TensorStore::new(wanted.len());
        let mut repacked = TensorStore::new(wanted.len());
        let mut by_name = HashMap::new();
        let mut to_copy = Vec::new();
        let mut placed = Vec::new();
        let (mut mapped_bytes, mut repacked_bytes) = (0u64, 0u64);
        let n_used = hp.moe.as_ref().map_or(1, |m| m.n_expert_used as i64);
        for (name, op) in wanted {
            let info = g
                .tensor(name)
                .or_else(|| (name == "output.weight").then(|| g.tensor("token_embd.weight"))?)
                .expect("listed from the tensor table");
            let ne: Vec<i64> = info.dims.iter().map(|&d| d as i64).collect();
            let ty = info.ggml_type.id();
            let idx = mapped.add(ty, &ne, name);
            // Asked per op the way llama.cpp's loader asks, so the same
            // weights end up repacked (and the same kernels run).
            let use_repack = repack_buft.is_some_and(|b| match op {
                _ if device.is_some() => name != "token_embd.weight",
                WeightOp::MulMat => ggml::buft_supports_mul_mat(b, mapped.get(idx)),
                WeightOp::MulMatId => ggml::buft_supports_mul_mat_id(b, mapped.get(idx), n_used),
                WeightOp::Other => false,
            });
            if use_repack {
                let r = repacked.add(ty, &ne, name);
                by_name.insert(name.clone(), Slot::Repacked(r));
                to_copy.push((r, info.clone()));
                repacked_bytes += info.size;
            } else {
                by_name.insert(name.clone(), Slot::Mapped(idx));
                placed.push((idx, info.clone()));
                mapped_bytes += info.size;
            }
        }
        let bytes = g.bytes();
        let mut buffers = Vec::new();
        // SAFETY (contract of from_host_ptr): the map lives in `model`, which
        // every stage holds through an Arc for as long as its weights exist.
        let map_buf = unsafe { Buffer::from_host_ptr(bytes.as_ptr(), bytes.len()) }
            .map_err(EngineError::CpuBackend)?;
        for (idx, info) in &placed {
            // SAFETY: the GGUF reader checked offset + size <= file length.
            unsafe { map_buf.place(mapped.get(*idx), bytes.as_ptr(), info.offset as usize) }
                .map_err(EngineError::Ggml)?;
        }
        buffers.push(map_buf);
        let total = to_copy.len();
        if let (Some(buft), false) = (repack_buft, to_copy.is_empty()) {
            let buf = Buffer::alloc_ctx(repacked.ctx(), buft).ok_or(EngineError::OutOfMemory {
                what: if device.is_some() {
                    format!("weights in GPU memory ({})", buft.name())
                } else {
                    "repacked weights".into()
                },
                bytes: repacked_bytes,
            })?;
            for (i, (r, info)) in to_copy.iter().enumerate() {
                repacked.get(*r).write_bytes(g.tensor_data(info));
                progress(i + 1, total);
            }
            buffers.push(buf);
        }
        Ok(Weights {
            mapped,
            repacked,
            by_name,
            _buffers: buffers,
            repacked_bytes,
            mapped_bytes,
            on_device: device.is_some(),
        })
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
    // Reused scratch for the masks.
    mask: Vec<u16>,
    mask_swa: Vec<u16>,
    /// The KV cells the last step's tokens went into.
    last_cells: Vec<i64>,
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
        let gpu = match cfg.device {
            Device::Cpu => None,
            Device::Cuda(i) => Some(ggml_device::cuda_device(i).map_err(EngineError::Gpu)?),
        };
        let exec = Executor::new(gpu, cfg.n_threads).map_err(if cfg.device.is_gpu() {
            EngineError::Gpu
        } else {
            EngineError::CpuBackend
        })?;
        let device = exec.on_gpu().then(|| exec.buffer_type());
        let weights = Weights::load(&model, &range, &offloaded, cfg.repack, device, progress)?;
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
            last_cells: Vec::new(),
        };
        stage.reserve()?;
        Ok(stage)
    }

    pub fn range(&self) -> &LayerRange {
        &self.range
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

    /// Makes this stage run `range` instead, keeping its sequences: as
    /// [`Stage::rerange_offloaded`] with the offloaded layers that stay in
    /// the range (and their kept experts).
    pub fn rerange(
        &mut self,
        range: LayerRange,
        incoming: Option<&KvLayers>,
    ) -> Result<(), EngineError> {
        let offloaded: Vec<u32> = self
            .offloaded
            .iter()
            .copied()
            .filter(|l| range.layers.contains(l))
            .collect();
        self.rerange_offloaded(range, &offloaded, incoming)
    }

    /// Makes this stage run `range` (with these `offloaded` layers) at a
    /// step boundary, keeping every sequence: [`Stage::load_offloaded`] a
    /// new stage for `range` with the same configuration, then
    /// [`Stage::take_over`] this one with `incoming` (the
    /// [`Stage::export_kv`] of the neighbour that gave up the layers this
    /// stage did not run), and only then replace this stage.
    ///
    /// On any error this stage is left exactly as it was (rollback) and
    /// still runs its old range. Memory: the new stage is complete before
    /// the old one is dropped, so the peak is both stages at once (repacked
    /// weights, KV cache and compute buffer of each; mapped weights are
    /// shared through the model's memory map), plus one layer's used KV
    /// rows in transit.
    pub fn rerange_offloaded(
        &mut self,
        range: LayerRange,
        offloaded: &[u32],
        incoming: Option<&KvLayers>,
    ) -> Result<(), EngineError> {
        let incoming: Vec<&KvLayers> = incoming.into_iter().collect();
        check_takeover(Some(self), &range, &incoming)?;
        let mut new =
            Stage::load_offloaded(self.model.clone(), range, self.cfg.clone(), offloaded)?;
        new.take_over(Some(self), &incoming)?;
        *self = new;
        Ok(())
    }

    /// Makes this freshly loaded stage (no step run yet) the successor of
    /// `old` at a step boundary: copies the KV cache of the layers both
    /// run from `old`, imports `incoming` (the other layers' exports, from
    /// the stages that ran them; all with `old`'s cell table, or any one
    /// table when `old` is None or runs no layer), and carries over the
    /// routing statistics and kept experts of the offloaded layers both
    /// have. `old` is not changed, so on error the caller still has it
    /// (and this stage is to be dropped); no step may run on `old` between
    /// this and replacing it.
    pub fn take_over(
        &mut self,
        old: Option<&Stage>,
        incoming: &[&KvLayers],
    ) -> Result<(), EngineError> {
        check_takeover(old, &self.range, incoming)?;
        let from = old.map_or_else(String::new, |o| format!("{} ", o.range));
        let in_move =
            |e: EngineError| EngineError::Config(format!("moving {from}to {}: {e}", self.range));
        if let Some(old) = old {
            let (a, b) = (old.range.layers.clone(), self.range.layers.clone());
            // One layer at a time, so only one layer's rows are in transit.
            for il in a.start.max(b.start)..a.end.min(b.end) {
                let one = old.kv.export(il..il + 1)?;
                self.kv.import(&one).map_err(in_move)?;
            }
        }
        for kv in incoming {
            self.kv.import(kv).map_err(in_move)?;
        }
        if let Some(old) = old {
            for il in self.offloaded.clone() {
                if let Some(counts) = old.expert_counts.get(&il) {
                    self.expert_counts.insert(il, counts.clone());
                }
                if let Some(d) = old.device.get(&il) {
                    self.set_device_experts(il, &d.ids)?;
                }
            }
        }
        Ok(())
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

    /// Frees the KV cells of `seq` (all of them, or from position `from` on).
    pub fn remove_seq(&mut self, seq: u32, from: Option<i32>) {
        self.kv.remove_seq(seq, from);
    }

    /// Frees every KV cell (a recovery starts the cache over).
    pub fn clear_kv(&mut self) {
        for seq in 0..self.kv.config().n_seq as u32 {
            self.kv.remove_seq(seq, None);
        }
    }

    /// The KV cell of each token of the last step that ran (empty if the
    /// stage has no layers).
    pub fn last_cells(&self) -> &[i64] {
        &self.last_cells
    }

    /// Sizes the compute buffer once, for a full micro-batch over a full
    /// cache (with offloaded experts: for the largest of the graphs a step runs).
    fn reserve(&mut self) -> Result<(), EngineError> {
        let n = self.cfg.n_ubatch.min(self.kv.config().n_cells());
        let parts = GraphParts {
            model: &self.model,
            range: &self.range,
            weights: &self.weights,
            kv: &self.kv,
            device: &self.device,
        };
        let oom = |e: String| EngineError::OutOfMemory {
            what: format!("compute buffer: {e}"),
            bytes: 0,
        };
        let n_cells = self.kv.config().n_cells();
        let n_used = self
            .model
            .hparams
            .moe
            .as_ref()
            .map_or(0, |m| m.n_expert_used as usize);
        if self.offloaded.is_empty() {
            let ctx = Ctx::new(ggml::GRAPH_NODES, true);
            let (graph, _) = parts.build(&ctx, n, n_cells, n);
            return self.exec.reserve(&graph).map_err(oom);
        }
        for seg in self.segments(n) {
            let ctx = Ctx::new(ggml::GRAPH_NODES, true);
            let (graph, _) = parts.build_segment(&ctx, n, n_cells, n, &seg);
            self.exec.reserve(&graph).map_err(oom)?;
            if let Some(r) = seg.resume.filter(|r| r.side) {
                let ctx = Ctx::new(ggml::GRAPH_NODES, true);
                let (graph, _) = parts.build_side(&ctx, r.layer, n, n_used);
                self.exec.reserve(&graph).map_err(oom)?;
            }
        }
        Ok(())
    }

    /// The segments of a step: cut at each offloaded block, each resuming
    /// the block the previous one cut (with `n_cut` tokens).
    fn segments(&self, n_cut: usize) -> Vec<Segment> {
        let hp = &self.model.hparams;
        let mut out = Vec::with_capacity(self.offloaded.len() + 1);
        let (mut resume, mut from) = (None, self.range.layers.start);
        for &il in &self.offloaded {
            out.push(Segment {
                resume,
                layers: (from, il),
                cut: Some(il),
            });
            resume = Some(Resume {
                layer: il,
                n_tokens: n_cut,
                side: hp.arch.has_shared_experts(hp, il) || self.device.contains_key(&il),
            });
            from = il + 1;
        }
        out.push(Segment {
            resume,
            layers: (from, self.range.layers.end),
            cut: None,
        });
        out
    }
}

/// The parts of a stage a graph reads (borrowed apart from the mutable runtime).
struct GraphParts<'a> {
    model: &'a ModelFile,
    range: &'a LayerRange,
    weights: &'a Weights,
    kv: &'a KvCache,
    device: &'a BTreeMap<u32, DeviceExperts>,
}

/// A piece of one step's graph between offloaded expert blocks. The whole
/// range is one segment: no resume, all its layers, no cut.
#[derive(Clone, Copy, Debug)]
struct Segment {
    /// Starts by finishing an offloaded block from host inputs instead of
    /// taking the range's input.
    resume: Option<Resume>,
    /// Layers run whole.
    layers: (u32, u32),
    /// Ends at this layer's routed experts (their input and routing)
    /// instead of the range's output.
    cut: Option<u32>,
}

/// An offloaded block to finish: its layer, tokens, and whether the stage
/// computed a side result for it (its shared experts and/or the routed
/// experts kept on the stage), given as the input `inp_shared`.
#[derive(Clone, Copy, Debug)]
struct Resume {
    layer: u32,
    n_tokens: usize,
    side: bool,
}

/// What a segment's graph ends with.
enum SegmentOut<'g> {
    /// The range's output: the hidden state or the logits.
    Range(Tensor<'g>),
    /// An offloaded block's expert inputs: the normed input, the selected
    /// ids and their weights (both made contiguous), and the residual.
    Cut {
        cur: Tensor<'g>,
        ids: Tensor<'g>,
        weights: Tensor<'g>,
        ffn_inp: Tensor<'g>,
    },
}

impl GraphParts<'_> {
    /// Builds the graph of one step. Returns the graph and its output tensor.
    fn build<'g>(
        &'g self,
        ctx: &'g Ctx,
        n_tokens: usize,
        n_kv: usize,
        n_out: usize,
    ) -> (ggml::Graph<'g>, Tensor<'g>) {
        let whole = Segment {
            resume: None,
            layers: (self.range.layers.start, self.range.layers.end),
            cut: None,
        };
        match self.build_segment(ctx, n_tokens, n_kv, n_out, &whole) {
            (graph, SegmentOut::Range(out)) => (graph, out),
            (_, SegmentOut::Cut { .. }) => unreachable!("a segment without a cut ends the range"),
        }
    }

    /// Builds the graph of one segment of a step.
    fn build_segment<'g>(
        &'g self,
        ctx: &'g Ctx,
        n_tokens: usize,
        n_kv: usize,
        n_out: usize,
        seg: &Segment,
    ) -> (ggml::Graph<'g>, SegmentOut<'g>) {
        let hp = &self.model.hparams;
        let (nt, e) = (n_tokens as i64, hp.n_embd as i64);
        let mut graph = ctx.new_graph();
        let mut x = if let Some(r) = seg.resume {
            let rt = r.n_tokens as i64;
            let routed = ctx.input(TYPE_F32, &[e, rt], "inp_routed");
            let shared = r.side.then(|| ctx.input(TYPE_F32, &[e, rt], "inp_shared"));
            let ffn_inp = ctx.input(TYPE_F32, &[e, rt], "inp_ffn_inp");
            finish_moe(ctx, routed, shared, ffn_inp)
        } else if self.range.embed {
            let tokens = ctx.input(TYPE_I32, &[nt], "inp_tokens");
            let emb = self.weights.get("token_embd.weight").expect("loaded");
            let x = ctx.get_rows(emb, tokens);
            match hp.embed_scale {
                Some(s) => ctx.scale(x, s),
                None => x,
            }
        } else {
            ctx.input(TYPE_F32, &[e, nt], "inp_hidden")
        };
        let want_out_ids = self.range.head && n_out < n_tokens;
        let out_ids = want_out_ids.then(|| ctx.input(TYPE_I32, &[n_out as i64], "inp_out_ids"));
        let mut cut = None;
        if seg.layers.0 < seg.layers.1 || seg.cut.is_some() {
            let pos = ctx.input(TYPE_I32, &[nt], "inp_pos");
            let kv_idx = ctx.input(TYPE_I64, &[nt], "inp_kv_idx");
            let mask = ctx.input(TYPE_F16, &[n_kv as i64, nt], "inp_mask");
            let mask_swa = hp
                .swa
                .is_some()
                .then(|| ctx.input(TYPE_F16, &[n_kv as i64, nt], "inp_mask_swa"));
            let mut cx = LayerCx {
                g: ctx,
                graph: &mut graph,
                hp,
                weights: self.weights,
                kv: self.kv,
                pos,
                kv_idx,
                mask,
                mask_swa,
                n_kv: n_kv as i64,
                n_tokens: nt,
                out_ids: None,
            };
            for il in seg.layers.0..seg.layers.1 {
                if il + 1 == hp.n_layer {
                    cx.out_ids = out_ids;
                }
                x = hp.arch.build_layer(&mut cx, il, x);
            }
            if let Some(il) = seg.cut {
                if il + 1 == hp.n_layer {
                    cx.out_ids = out_ids;
                }
                let inp = hp.arch.build_moe_input(&mut cx, il, x);
                let moe = hp.moe.as_ref().expect("a layer with experts");
                let r = cx.moe_route(
                    inp.cur,
                    cx.w(il, "ffn_gate_inp.weight"),
                    cx.w_opt(il, "exp_probs_b.bias"),
                    moe,
                );
                // Copies, so that the host reads plain contiguous outputs.
                let ids = ctx.cont(r.selected);
                let weights = ctx.cont(r.weights);
                for t in [inp.cur, ids, weights, inp.ffn_inp] {
                    t.set_output();
                    cx.graph.expand(t);
                }
                cut = Some(SegmentOut::Cut {
                    cur: inp.cur,
                    ids,
                    weights,
                    ffn_inp: inp.ffn_inp,
                });
            }
        }
        if let Some(c) = cut {
            return (graph, c);
        }
        if self.range.head {
            let last_layer_here =
                !self.range.layers.is_empty() && self.range.layers.end == hp.n_layer;
            if let (Some(ids), false) = (out_ids, last_layer_here) {
                x = ctx.get_rows(x, ids);
            }
            let norm = ctx.rms_norm(x, hp.rms_eps);
            x = ctx.mul(
                norm,
                self.weights.get("output_norm.weight").expect("loaded"),
            );
            // A tied head reads the embedding (on a GPU, its copy there).
            let out_w = self
                .weights
                .get("output.weight")
                .or_else(|| self.weights.get("token_embd.weight"))
                .expect("loaded");
            x = ctx.mul_mat(out_w, x);
            if let Some(cap) = hp.final_logit_softcap {
                x = ctx.scale(ctx.tanh(ctx.scale(x, 1.0 / cap)), cap);
            }
        }
        x.set_output();
        graph.expand(x);
        (graph, SegmentOut::Range(x))
    }

    /// What the stage computes of offloaded block `il` while the executor
    /// works, on the input `inp_moe_cur` (`[n_embd, n_tokens]`), as a graph
    /// of its own: the shared experts, plus (`dev_width` > 0) the routed
    /// experts kept on the stage (`set_device_experts`) with local ids
    /// `inp_dev_ids` and weights `inp_dev_weights` (`[dev_width, n_tokens]`).
    fn build_side<'g>(
        &'g self,
        ctx: &'g Ctx,
        il: u32,
        n_tokens: usize,
        dev_width: usize,
    ) -> (ggml::Graph<'g>, Tensor<'g>) {
        let hp = &self.model.hparams;
        let nt = n_tokens as i64;
        let mut graph = ctx.new_graph();
        let cur = ctx.input(TYPE_F32, &[hp.n_embd as i64, nt], "inp_moe_cur");
        let shared = hp.arch.has_shared_experts(hp, il).then(|| {
            // The layer context's other inputs are never read (so never allocated).
            let cx = LayerCx {
                g: ctx,
                graph: &mut graph,
                hp,
                weights: self.weights,
                kv: self.kv,
                pos: ctx.input(TYPE_I32, &[nt], "inp_pos"),
                kv_idx: ctx.input(TYPE_I64, &[nt], "inp_kv_idx"),
                mask: ctx.input(TYPE_F16, &[1, nt], "inp_mask"),
                mask_swa: None,
                n_kv: 1,
                n_tokens: nt,
                out_ids: None,
            };
            hp.arch
                .build_shared_experts(&cx, il, cur)
                .expect("has shared experts")
        });
        let device = self.device.get(&il).filter(|_| dev_width > 0);
        let routed = device.map(|d| {
            let k = dev_width as i64;
            let selected = ctx.input(TYPE_I32, &[k, nt], "inp_dev_ids");
            let weights = ctx.input(TYPE_F32, &[1, k, nt], "inp_dev_weights");
            // Every supported MoE architecture gates its experts with SiLU.
            moe_experts(
                ctx,
                &mut graph,
                cur,
                &Routing { selected, weights },
                d.weights(),
                Activation::Silu,
            )
        });
        let out = match (shared, routed) {
            (Some(s), Some(r)) => ctx.add(s, r),
            (Some(t), None) | (None, Some(t)) => t,
            (None, None) => unreachable!("built only for blocks with shared or device experts"),
        };
        out.set_output();
        graph.expand(out);
        (graph, out)
    }
}

impl Stage {
    /// Runs one step. `input` is the previous stage's hidden state (absent
    /// on the stage that runs the embedding). Returns the hidden state for
    /// the next stage, or the logits of the tokens that asked for them.
    ///
    /// A stage with offloaded experts needs [`Stage::forward_with`].
    pub fn forward(
        &mut self,
        batch: &Batch,
        input: Option<&Hidden>,
    ) -> Result<StageOutput, EngineError> {
        if !self.offloaded.is_empty() {
            return Err(EngineError::Config(format!(
                "the routed experts of layers {:?} are not in this stage: run it with an expert executor (forward_with)",
                self.offloaded
            )));
        }
        self.forward_inner(batch, input, None)
    }

    /// As [`Stage::forward`], with the routed experts of the offloaded
    /// layers computed by `experts`. The step runs as one graph per
    /// segment between offloaded blocks; at each block it submits the
    /// block's input, ids and weights, computes the shared experts, waits
    /// for the routed result and goes on. Without offloaded layers this is
    /// `forward` and `experts` is never called.
    ///
    /// A block with experts kept here (`set_device_experts`) computes them
    /// beside the shared experts and submits only the tokens that selected
    /// an expert elsewhere, with only those selections (see
    /// [`ExpertBatch`]); when no token did, the executor is not called for
    /// that block. Weight-0 stand-ins add exactly 0, so this changes only
    /// the order of the sum.
    pub fn forward_with(
        &mut self,
        batch: &Batch,
        input: Option<&Hidden>,
        experts: &mut dyn ExpertExec,
    ) -> Result<StageOutput, EngineError> {
        self.forward_inner(batch, input, Some(experts))
    }

    fn forward_inner(
        &mut self,
        batch: &Batch,
        input: Option<&Hidden>,
        experts: Option<&mut dyn ExpertExec>,
    ) -> Result<StageOutput, EngineError> {
        let hp = &self.model.hparams;
        batch.validate(self.range.embed)?;
        let n = batch.len();
        if n > self.cfg.n_ubatch {
            return Err(EngineError::Config(format!(
                "batch of {n} tokens exceeds n_ubatch {}",
                self.cfg.n_ubatch
            )));
        }
        if self.range.embed {
            if let Some(&bad) = batch.tokens.iter().find(|&&t| t >= hp.n_vocab) {
                return Err(EngineError::Config(format!(
                    "token id {bad} is outside the vocabulary of {} tokens",
                    hp.n_vocab
                )));
            }
        } else {
            let h = input.ok_or_else(|| {
                EngineError::Config("this stage needs the previous stage's hidden state".into())
            })?;
            if h.n_tokens != n || h.n_embd != hp.n_embd as usize || h.data.len() != n * h.n_embd {
                return Err(EngineError::BadHidden(format!(
                    "hidden state is {} x {} but the step has {n} tokens of width {}",
                    h.n_tokens, h.n_embd, hp.n_embd
                )));
            }
        }
        let has_layers = !self.range.layers.is_empty();
        let kv_idx = match (has_layers, batch.cells.is_empty()) {
            (false, _) => Vec::new(),
            (true, true) => self.kv.allocate(&batch.seq, &batch.pos)?,
            (true, false) => {
                self.kv.place(&batch.seq, &batch.pos, &batch.cells)?;
                batch.cells.clone()
            }
        };
        self.last_cells.clone_from(&kv_idx);
        let result = self.run(batch, input, &kv_idx, experts);
        if result.is_err() && has_layers {
            self.kv.release(&kv_idx);
        }
        result
    }

    fn run(
        &mut self,
        batch: &Batch,
        input: Option<&Hidden>,
        kv_idx: &[i64],
        mut experts: Option<&mut dyn ExpertExec>,
    ) -> Result<StageOutput, EngineError> {
        let hp = &self.model.hparams;
        let n = batch.len();
        let out_rows: Vec<usize> = if self.range.head {
            (0..n).filter(|&i| batch.logits[i]).collect()
        } else {
            (0..n).collect()
        };
        let n_kv = self.kv.n_kv();
        let has_layers = !self.range.layers.is_empty();
        if has_layers {
            self.kv
                .mask(&batch.seq, &batch.pos, n_kv, None, &mut self.mask);
            if let Some(swa) = &hp.swa {
                self.kv.mask(
                    &batch.seq,
                    &batch.pos,
                    n_kv,
                    Some(swa.window),
                    &mut self.mask_swa,
                );
            }
        }
        // Without offloaded layers: one segment, the whole range's graph.
        let segments = self.segments(n);
        // The finished-elsewhere block the next segment resumes.
        let mut carry: Option<Carry> = None;
        for mut seg in segments {
            if let (Some(r), Some(c)) = (seg.resume.as_mut(), carry.as_ref()) {
                r.n_tokens = c.n_tokens;
                r.side = c.shared.is_some();
            }
            let ctx = Ctx::new(ggml::GRAPH_NODES, true);
            // Split the borrows: graph building reads weights/kv, compute needs the backend mutably.
            let parts = GraphParts {
                model: &self.model,
                range: &self.range,
                weights: &self.weights,
                kv: &self.kv,
                device: &self.device,
            };
            let (graph, out) = parts.build_segment(&ctx, n, n_kv, out_rows.len(), &seg);
            self.exec.alloc(&graph).map_err(EngineError::Ggml)?;
            let set = |name: &str, f: &dyn Fn(Tensor<'_>)| {
                // Inputs no node reads (a range with no global layer has no use for
                // the global mask) get no memory from the allocator.
                if let Some(t) = ctx.get_tensor(name).filter(|t| t.is_allocated()) {
                    f(t)
                }
            };
            set("inp_tokens", &|t| {
                t.write(&batch.tokens.iter().map(|&x| x as i32).collect::<Vec<_>>())
            });
            set("inp_hidden", &|t| {
                t.write(&input.expect("checked in forward").data)
            });
            set("inp_pos", &|t| t.write(&batch.pos));
            set("inp_kv_idx", &|t| t.write(kv_idx));
            set("inp_mask", &|t| t.write(&self.mask));
            set("inp_mask_swa", &|t| t.write(&self.mask_swa));
            set("inp_out_ids", &|t| {
                t.write(&out_rows.iter().map(|&x| x as i32).collect::<Vec<_>>())
            });
            if let Some(c) = carry.take() {
                set("inp_routed", &|t| t.write(&c.routed));
                set("inp_ffn_inp", &|t| t.write(&c.ffn_inp));
                if let Some(sh) = &c.shared {
                    set("inp_shared", &|t| t.write(sh));
                }
            }
            self.exec.compute(&graph).map_err(EngineError::Ggml)?;
            let (cur, ids, weights, ffn_inp) = match out {
                SegmentOut::Range(out) => {
                    let mut data = Vec::new();
                    out.read_f32(&mut data);
                    return Ok(if self.range.head {
                        StageOutput::Logits(Logits {
                            n_vocab: hp.n_vocab as usize,
                            rows: out_rows,
                            data,
                        })
                    } else {
                        StageOutput::Hidden(Hidden {
                            n_tokens: n,
                            n_embd: hp.n_embd as usize,
                            data,
                        })
                    });
                }
                SegmentOut::Cut {
                    cur,
                    ids,
                    weights,
                    ffn_inp,
                } => (cur, ids, weights, ffn_inp),
            };
            let layer = seg.cut.expect("a cut segment names its layer");
            let n_cut = cur.ne()[1] as usize;
            let mut c = Carry {
                n_tokens: n_cut,
                routed: Vec::new(),
                shared: None,
                ffn_inp: Vec::new(),
            };
            let mut x = Vec::new();
            cur.read_f32(&mut x);
            ffn_inp.read_f32(&mut c.ffn_inp);
            let (mut id_vals, mut w_vals) = (Vec::new(), Vec::new());
            ids.read_i32(&mut id_vals);
            weights.read_f32(&mut w_vals);
            // This segment's graph and context are done with.
            drop(ctx);
            if let Some(counts) = self.expert_counts.get_mut(&layer) {
                for &id in &id_vals {
                    if let Some(n) = usize::try_from(id).ok().and_then(|i| counts.get_mut(i)) {
                        *n += 1;
                    }
                }
            }
            let e = hp.n_embd as usize;
            let n_used = id_vals.len() / n_cut.max(1);
            let split = self
                .device
                .get(&layer)
                .map(|d| split_work(&d.ids, n_used, &id_vals, &w_vals));
            let dev_width = split.as_ref().map_or(0, |s| s.dev_width);
            let has_side = hp.arch.has_shared_experts(hp, layer) || dev_width > 0;
            // The side graph takes its input before the routed experts'
            // input moves to the executor.
            let side_ctx = Ctx::new(ggml::GRAPH_NODES, true);
            let parts = GraphParts {
                model: &self.model,
                range: &self.range,
                weights: &self.weights,
                kv: &self.kv,
                device: &self.device,
            };
            let side_graph = if has_side {
                let (g, out) = parts.build_side(&side_ctx, layer, n_cut, dev_width);
                self.exec.alloc(&g).map_err(EngineError::Ggml)?;
                let input = |name: &str| side_ctx.get_tensor(name).expect("declared");
                input("inp_moe_cur").write(&x);
                if let Some(s) = split.as_ref().filter(|_| dev_width > 0) {
                    input("inp_dev_ids").write(&s.dev_ids);
                    input("inp_dev_weights").write(&s.dev_weights);
                }
                Some((g, out))
            } else {
                None
            };
            // The executor's share: every token, or with device experts
            // only the tokens that selected an expert elsewhere (`rows`).
            let (rows, batch) = match split {
                None => (
                    None,
                    Some(ExpertBatch {
                        layer,
                        n_tokens: n_cut,
                        x,
                        ids: id_vals,
                        weights: w_vals,
                    }),
                ),
                Some(s) if s.rows.is_empty() => (None, None),
                Some(s) => {
                    let x = if s.rows.len() == n_cut {
                        x
                    } else {
                        s.rows
                            .iter()
                            .flat_map(|&t| &x[t * e..(t + 1) * e])
                            .copied()
                            .collect()
                    };
                    let batch = ExpertBatch {
                        layer,
                        n_tokens: s.rows.len(),
                        x,
                        ids: s.ids,
                        weights: s.weights,
                    };
                    (Some(s.rows), Some(batch))
                }
            };
            let mut remote = None;
            if let Some(batch) = batch {
                let exec = experts.as_deref_mut().ok_or_else(|| {
                    EngineError::Config(format!(
                        "layer {layer}'s routed experts are elsewhere but no expert executor was given"
                    ))
                })?;
                let n_sent = batch.n_tokens;
                exec.submit(batch)?;
                remote = Some((exec, n_sent));
            }
            // Overlaps with the executor's work; wait even if it fails, so
            // that the executor is left with nothing pending.
            let side = side_graph.map(|(g, out)| {
                self.exec.compute(&g).map(|()| {
                    let mut v = Vec::new();
                    out.read_f32(&mut v);
                    v
                })
            });
            let routed = remote.map(|(exec, n_sent)| (exec.wait(), n_sent));
            c.shared = side.transpose().map_err(EngineError::Ggml)?;
            c.routed = match routed {
                // Nothing elsewhere: the side graph computed every selected expert.
                None => vec![0.0; n_cut * e],
                Some((got, n_sent)) => {
                    let got = got?;
                    if got.len() != n_sent * e {
                        return Err(EngineError::Experts(format!(
                            "layer {layer}: the executor returned {} values for {n_sent} tokens of width {e} ({})",
                            got.len(),
                            n_sent * e
                        )));
                    }
                    match rows {
                        None => got,
                        Some(rows) => {
                            // Tokens not sent had nothing elsewhere: 0.
                            let mut all = vec![0.0; n_cut * e];
                            for (i, &t) in rows.iter().enumerate() {
                                all[t * e..(t + 1) * e].copy_from_slice(&got[i * e..(i + 1) * e]);
                            }
                            all
                        }
                    }
                }
            };
            carry = Some(c);
        }
        unreachable!("the last segment ends the range")
    }
}

/// The routed experts of one offloaded layer that a stage keeps after
/// all (`Stage::set_device_experts`): `ffn_{up,gate,down}_exps`, in that
/// order, cut down to those experts (`[.., .., K]`), each in its own
/// buffer: repacked where llama.cpp's loader would repack the whole tensor
/// (so the stage runs the executor's kernels), else plain.
struct DeviceExperts {
    /// The experts held, ascending: local expert `i` is `ids[i]`.
    ids: Vec<u32>,
    tensors: Vec<(TensorStore, Buffer)>,
    bytes: u64,
}

impl DeviceExperts {
    /// Copies the slices of experts `ids` of layer `il` out of the file.
    fn load(
        model: &ModelFile,
        il: u32,
        ids: Vec<u32>,
        buft: BufferType,
        repack: bool,
    ) -> Result<DeviceExperts, EngineError> {
        let g = &model.gguf;
        let n_used = model
            .hparams
            .moe
            .as_ref()
            .map_or(1, |m| m.n_expert_used as i64);
        let repack_buft = if repack {
            ggml::cpu_extra_buffer_types()
                .map_err(EngineError::CpuBackend)?
                .first()
                .copied()
        } else {
            None
        };
        let mut tensors = Vec::with_capacity(3);
        let mut bytes = 0;
        for name in ["ffn_up_exps", "ffn_gate_exps", "ffn_down_exps"] {
            let name = format!("blk.{il}.{name}.weight");
            let info = g.tensor(&name).ok_or_else(|| EngineError::MissingTensor {
                name: name.clone(),
                arch: model.hparams.arch.name(),
            })?;
            // Experts are the outermost dimension: each one's bytes are
            // one contiguous slice (whole quantization blocks).
            let n_expert = info.dims[2] as usize;
            let per = info.size as usize / n_expert;
            let src = g.tensor_data(info);
            let mut data = Vec::with_capacity(per * ids.len());
            for &id in &ids {
                data.extend_from_slice(&src[id as usize * per..(id as usize + 1) * per]);
            }
            let mut store = TensorStore::new(1);
            let ne = [info.dims[0] as i64, info.dims[1] as i64, ids.len() as i64];
            store.add(info.ggml_type.id(), &ne, &name);
            // Asked of the whole tensor, as the executor's loader asks, and
            // of the subset, which is what the kernel gets.
            let mut whole = TensorStore::new(1);
            let dims: Vec<i64> = info.dims.iter().map(|&d| d as i64).collect();
            whole.add(info.ggml_type.id(), &dims, &name);
            let target = repack_buft
                .filter(|&b| {
                    ggml::buft_supports_mul_mat_id(b, whole.get(0), n_used)
                        && ggml::buft_supports_mul_mat_id(b, store.get(0), n_used)
                })
                .unwrap_or(buft);
            let buffer =
                Buffer::alloc_ctx(store.ctx(), target).ok_or(EngineError::OutOfMemory {
                    what: format!("layer {il}'s {} device experts", ids.len()),
                    bytes: data.len() as u64,
                })?;
            store.get(0).write_bytes(&data);
            bytes += data.len() as u64;
            tensors.push((store, buffer));
        }
        Ok(DeviceExperts {
            ids,
            tensors,
            bytes,
        })
    }

    /// `ffn_up_exps`, `ffn_gate_exps`, `ffn_down_exps` of the experts held.
    fn weights(&self) -> [Tensor<'_>; 3] {
        [0, 1, 2].map(|i| self.tensors[i].0.get(0))
    }
}

/// One offloaded block's selections split between the experts kept on the
/// stage and the executor. Each side gets, per token, its own selections
/// in selection order, padded to the side's width (the most any token has
/// there) with weight-0 stand-ins, which add exactly 0. `mul_mat_id` needs
/// the same count for every token, and ggml's repacked CPU kernel needs
/// distinct ids within a token (it keeps at most one row per expert and
/// token), so the stand-ins are experts that side computes for another
/// token of the batch anyway: no expert's weights are read for nothing.
#[derive(Debug, PartialEq)]
struct SplitWork {
    /// The stage's part, for every token: local ids into the device subset
    /// and weights, `[n_tokens][dev_width]`; width 0 when no token selected
    /// an expert kept here.
    dev_width: usize,
    dev_ids: Vec<i32>,
    dev_weights: Vec<f32>,
    /// The executor's part: the tokens with an expert elsewhere, ascending,
    /// and their ids and weights, `[rows.len()][width]`.
    rows: Vec<usize>,
    width: usize,
    ids: Vec<i32>,
    weights: Vec<f32>,
}

/// Splits `ids` and `weights` (`[n_tokens][n_used]`) between the experts
/// `device` (ascending) and the rest.
fn split_work(device: &[u32], n_used: usize, ids: &[i32], weights: &[f32]) -> SplitWork {
    let local = |id: i32| {
        u32::try_from(id)
            .ok()
            .and_then(|id| device.binary_search(&id).ok())
    };
    // Per token, its selections on each side: (id, weight), local ids on the stage's.
    let mut here: Vec<Vec<(i32, f32)>> = Vec::new();
    let mut there: Vec<(usize, Vec<(i32, f32)>)> = Vec::new();
    for (t, (row, wrow)) in ids
        .chunks_exact(n_used)
        .zip(weights.chunks_exact(n_used))
        .enumerate()
    {
        let (mut h, mut r) = (Vec::new(), Vec::new());
        for (&id, &w) in row.iter().zip(wrow) {
            match local(id) {
                Some(l) => h.push((l as i32, w)),
                None => r.push((id, w)),
            }
        }
        here.push(h);
        if !r.is_empty() {
            there.push((t, r));
        }
    }
    let (dev_width, dev_ids, dev_weights) = pad(here.iter().map(|h| &h[..]));
    let (width, ids, weights) = pad(there.iter().map(|(_, r)| &r[..]));
    SplitWork {
        dev_width,
        dev_ids,
        dev_weights,
        rows: there.iter().map(|(t, _)| *t).collect(),
        width,
        ids,
        weights,
    }
}

/// Lays out one side's rows as `[n_rows][width]` ids and weights, `width`
/// the longest row, filling each shorter row with ids of other rows it
/// does not hold (there are always enough: the longest row alone has
/// `width` of them), weight 0.
fn pad<'a>(rows: impl Iterator<Item = &'a [(i32, f32)]> + Clone) -> (usize, Vec<i32>, Vec<f32>) {
    let width = rows.clone().map(<[_]>::len).max().unwrap_or(0);
    let mut pool: Vec<i32> = Vec::new();
    for &(id, _) in rows.clone().flatten() {
        if !pool.contains(&id) {
            pool.push(id);
        }
    }
    let (mut ids, mut weights) = (Vec::new(), Vec::new());
    for row in rows {
        ids.extend(row.iter().map(|&(id, _)| id));
        weights.extend(row.iter().map(|&(_, w)| w));
        let stand_ins = pool
            .iter()
            .filter(|&&p| !row.iter().any(|&(id, _)| id == p))
            .take(width - row.len());
        for &p in stand_ins {
            ids.push(p);
            weights.push(0.0);
        }
    }
    (width, ids, weights)
}

/// An offloaded block's results on the host, for the segment that finishes it.
struct Carry {
    n_tokens: usize,
    routed: Vec<f32>,
    shared: Option<Vec<f32>>,
    ffn_inp: Vec<f32>,
}

/// [`Stage::take_over`]'s checks, before anything is loaded or written:
/// every layer of `range` that `old` does not run is in `incoming`, once,
/// and (when `old` runs layers) every incoming cell table is `old`'s.
fn check_takeover(
    old: Option<&Stage>,
    range: &LayerRange,
    incoming: &[&KvLayers],
) -> Result<(), EngineError> {
    let had = old.map_or(0..0, |o| o.range.layers.clone());
    let bad = |why: String| {
        Err(EngineError::Config(match old {
            Some(o) => format!("moving {} to {range}: {why}", o.range),
            None => format!("taking over {range}: {why}"),
        }))
    };
    let carried = |l: u32| {
        incoming
            .iter()
            .flat_map(|kv| kv.layers.iter())
            .filter(|x| x.layer == l)
            .count()
    };
    let missing: Vec<u32> = range
        .layers
        .clone()
        .filter(|&l| !had.contains(&l) && carried(l) == 0)
        .collect();
    if !missing.is_empty() {
        return bad(format!(
            "the KV cache of layers {missing:?} is not in the incoming export"
        ));
    }
    if let Some(l) = range.layers.clone().find(|&l| carried(l) > 1) {
        return bad(format!("the KV cache of layer {l} comes more than once"));
    }
    if let Some(o) = old.filter(|o| !o.range.layers.is_empty()) {
        for kv in incoming {
            o.kv.check_table(&kv.cells, false)
                .or_else(|e| bad(e.to_string()))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_round_trip_is_exact_for_halves() {
        let vals = [
            0.0f32,
            -0.0,
            1.0,
            -2.5,
            65504.0,
            6.1035156e-5,
            5.9604645e-8,
            f32::INFINITY,
            f32::NEG_INFINITY,
        ];
        let mut h = Vec::new();
        ggml::f32_to_f16(&vals, &mut h);
        for (v, h) in vals.iter().zip(&h) {
            assert_eq!(f16_to_f32(*h), *v, "{v}");
        }
    }

    #[test]
    fn hidden_serialization_round_trips_and_rejects_garbage() {
        let h = Hidden {
            n_tokens: 2,
            n_embd: 3,
            data: vec![1.0, -2.0, 3.5, 0.25, 1e-3, -7.0],
        };
        assert_eq!(
            Hidden::from_bytes(&h.to_bytes(HiddenDtype::F32)).unwrap(),
            h
        );
        let h16 = Hidden::from_bytes(&h.to_bytes(HiddenDtype::F16)).unwrap();
        assert!(h16
            .data
            .iter()
            .zip(&h.data)
            .all(|(a, b)| (a - b).abs() <= b.abs() * 1e-3));
        let mut b = h.to_bytes(HiddenDtype::F32);
        b.pop();
        assert!(Hidden::from_bytes(&b)
            .unwrap_err()
            .to_string()
            .contains("need"));
        assert!(Hidden::from_bytes(b"nope").is_err());
    }

    #[test]
    fn split_work_gives_each_side_its_experts_and_distinct_weight_0_stand_ins() {
        // Two experts per token; experts 2 and 5 (local 0 and 1) are kept on the stage.
        let ids = [5, 1, 3, 7, 2, 5, 0, 2];
        let w = [0.6, 0.4, 0.7, 0.3, 0.8, 0.2, 0.9, 0.1];
        let s = split_work(&[2, 5], 2, &ids, &w);
        assert_eq!(s.dev_width, 2);
        assert_eq!(s.dev_ids, [1, 0, 1, 0, 0, 1, 0, 1]);
        assert_eq!(s.dev_weights, [0.6, 0.0, 0.0, 0.0, 0.8, 0.2, 0.1, 0.0]);
        // Token 2 has nothing elsewhere.
        assert_eq!((s.rows, s.width), (vec![0, 1, 3], 2));
        assert_eq!(s.ids, [1, 3, 3, 7, 0, 1]);
        assert_eq!(s.weights, [0.4, 0.0, 0.7, 0.3, 0.9, 0.0]);
        // One token (a decode step): no stand-ins at all.
        let s = split_work(&[2, 5], 2, &ids[..2], &w[..2]);
        assert_eq!(
            (s.dev_width, s.dev_ids, s.dev_weights),
            (1, vec![1], vec![0.6])
        );
        assert_eq!((s.width, s.ids, s.weights), (1, vec![1], vec![0.4]));
        let none = split_work(&[], 2, &ids, &w);
        assert_eq!(none.dev_width, 0);
        assert_eq!(
            (none.rows, none.ids, none.weights),
            (vec![0, 1, 2, 3], ids.to_vec(), w.to_vec())
        );
        let all = split_work(&[0, 1, 2, 3, 5, 7], 2, &ids, &w);
        assert!(all.rows.is_empty() && all.width == 0 && all.dev_weights == w);
    }

    #[test]
    fn split_work_keeps_every_selection_once_and_ids_distinct() {
        let (n_expert, n_used, n) = (16u32, 4, 40);
        // Top-k style rows: distinct ids, positive weights.
        let mut ids = Vec::new();
        for t in 0..n {
            let mut row: Vec<i32> = Vec::new();
            let mut k = t * 7 + 3;
            while row.len() < n_used {
                k = (k * 13 + 5) % n_expert as usize;
                if !row.contains(&(k as i32)) {
                    row.push(k as i32);
                }
            }
            ids.extend(row);
        }
        let w: Vec<f32> = (0..ids.len())
            .map(|i| 0.05 + (i % 5) as f32 * 0.1)
            .collect();
        for device in [vec![0], vec![3, 9], vec![1, 4, 6, 10, 11, 12, 13, 14, 15]] {
            let s = split_work(&device, n_used, &ids, &w);
            assert!(s.dev_width <= n_used && s.width <= n_used);
            let mut seen = vec![Vec::new(); n];
            for (t, (row, wrow)) in s
                .dev_ids
                .chunks(s.dev_width.max(1))
                .zip(s.dev_weights.chunks(s.dev_width.max(1)))
                .enumerate()
                .take(if s.dev_width == 0 { 0 } else { n })
            {
                let mut d = row.to_vec();
                d.sort_unstable();
                d.dedup();
                assert_eq!(d.len(), row.len(), "{device:?}: {row:?}");
                for (&l, &wt) in row.iter().zip(wrow) {
                    if wt != 0.0 {
                        seen[t].push((device[l as usize] as i32, wt.to_bits()));
                    }
                }
            }
            for (i, &t) in s.rows.iter().enumerate() {
                let row = &s.ids[i * s.width..(i + 1) * s.width];
                let mut d = row.to_vec();
                d.sort_unstable();
                d.dedup();
                assert_eq!(d.len(), row.len(), "{device:?}: {row:?}");
                assert!(row.iter().all(|&id| !device.contains(&(id as u32))));
                for (&id, &wt) in row.iter().zip(&s.weights[i * s.width..]) {
                    if wt != 0.0 {
                        seen[t].push((id, wt.to_bits()));
                    }
                }
            }
            for (t, mut got) in seen.into_iter().enumerate() {
                let mut want: Vec<(i32, u32)> = (0..n_used)
                    .map(|j| (ids[t * n_used + j], w[t * n_used + j].to_bits()))
                    .collect();
                got.sort_unstable();
                want.sort_unstable();
                assert_eq!(got, want, "{device:?} token {t}");
            }
        }
    }

    #[test]
    fn split_covers_all_layers() {
        let r = LayerRange::split(18, &[6, 6, 6]).unwrap();
        assert_eq!(
            r[0],
            LayerRange {
                embed: true,
                layers: 0..6,
                head: false
            }
        );
        assert_eq!(
            r[2],
            LayerRange {
                embed: false,
                layers: 12..18,
                head: true
            }
        );
        assert!(LayerRange::split(18, &[6, 6])
            .unwrap_err()
            .to_string()
            .contains("18"));
    }
}
