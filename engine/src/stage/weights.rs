//! A stage's weights: mapped from the file or repacked on the CPU, uploaded
//! to a GPU, looked up by name.

use crate::error::EngineError;
use crate::ffi::ggml;
use crate::ffi::ggml::Buffer;
use crate::ffi::ggml::BufferType;
use crate::ffi::ggml::Tensor;
use crate::ffi::ggml::TensorStore;
use crate::model::ModelFile;
use crate::model::WeightOp;
use crate::range::LayerRange;
use std::collections::HashMap;

/// Which weights go into the CPU's repacked layout (where it takes them).
#[derive(Clone, Copy, Debug)]
pub struct Repack {
    /// Weights of `mul_mat` (attention, dense FFN, shared experts, head).
    pub dense: bool,
    /// Routed experts (`mul_mat_id`).
    pub experts: bool,
}

impl Repack {
    pub fn all(on: bool) -> Repack {
        Repack {
            dense: on,
            experts: on,
        }
    }
}

/// Where a weight lives: the memory map (zero-copy) or a repacked copy.
#[derive(Clone, Copy, Debug)]
pub(super) enum Slot {
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
    /// On a GPU stage: weights its device cannot read where they are used
    /// (too large for it to address, or of a type its kernels lack), kept
    /// in host memory; their ops run on the CPU.
    pub kept_on_host: Vec<String>,
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

    /// The weights of `range`, less the routed experts of the `offloaded`
    /// layers, or with `host_experts` those kept mapped in host memory
    /// (never copied to a device or repacked).
    pub(super) fn load(
        model: &ModelFile,
        range: &LayerRange,
        offloaded: &[u32],
        host_experts: bool,
        repack: Repack,
        device: Option<BufferType>,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Weights, EngineError> {
        let g = &model.gguf;
        let hp = &model.hparams;
        // Names this range uses, and the op each feeds (only matmul weights
        // may be repacked: the repacked layout cannot get_rows).
        let mut wanted: Vec<(String, WeightOp)> = Vec::new();
        let mut host_only = Vec::new();
        for il in range.layers.clone() {
            let elsewhere = offloaded.contains(&il);
            for s in &hp.arch.layer_tensors(hp, il) {
                let name = format!("blk.{il}.{}", s.name);
                if elsewhere && s.op == WeightOp::MulMatId {
                    if host_experts && g.tensor(&name).is_some() {
                        host_only.push(name.clone());
                        wanted.push((name, s.op));
                    }
                    continue;
                }
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
        Self::load_named(model, &wanted, &host_only, repack, device, progress)
    }

    /// Maps the named tensors of `model` (each with the op that reads it),
    /// copying into the CPU's repacked layout those that llama.cpp's loader
    /// would repack, or with a `device` (a GPU's buffer type) uploading all
    /// but the token embedding and the `host_only` names there.
    /// `output.weight` in a file without one is the token embedding (a tied
    /// head's copy).
    pub(crate) fn load_named(
        model: &ModelFile,
        wanted: &[(String, WeightOp)],
        host_only: &[String],
        repack: Repack,
        device: Option<BufferType>,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Weights, EngineError> {
        let g = &model.gguf;
        let hp = &model.hparams;
        let extra = if (repack.dense || repack.experts) && device.is_none() {
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
        let mut kept_on_host = Vec::new();
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
            // weights end up repacked or on the device (and the same
            // kernels run). A weight the device cannot read where it is
            // used stays in host memory, and ggml's scheduler runs its op
            // on the CPU (a fallback the plan's notes name).
            let read = match op {
                WeightOp::MulMat => ggml::WeightRead::MulMat,
                WeightOp::MulMatId => ggml::WeightRead::MulMatId(n_used),
                WeightOp::Other => ggml::WeightRead::Other,
            };
            let use_repack = match device {
                Some(_) if host_only.contains(name) => false,
                Some(d) => {
                    let fits = name != "token_embd.weight"
                        && ggml::buft_supports(d, mapped.get(idx), read);
                    if !fits && name != "token_embd.weight" {
                        kept_on_host.push(name.clone());
                    }
                    fits
                }
                None => repack_buft.is_some_and(|b| match op {
                    WeightOp::MulMat => repack.dense,
                    // Ours takes the experts as the file has them.
                    WeightOp::MulMatId => {
                        repack.experts && !ggml::expert_kernel_takes(ty)
                    }
                    WeightOp::Other => false,
                } && ggml::buft_supports(b, mapped.get(idx), read)),
            };
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
        let mut buffers = Vec::new();
        // One host buffer over each file that holds a tensor used in place:
        // a file of a split model holding none of this stage's is never
        // mapped.
        let mut by_part: std::collections::BTreeMap<usize, Vec<_>> = Default::default();
        for (idx, info) in &placed {
            by_part.entry(info.part).or_default().push((*idx, info));
        }
        for (part, tensors) in by_part {
            let bytes = g.part_bytes(part)?;
            // SAFETY (contract of from_host_ptr): the map lives in `model`, which
            // every stage holds through an Arc for as long as its weights exist.
            let map_buf = unsafe { Buffer::from_host_ptr(bytes.as_ptr(), bytes.len()) }
                .map_err(EngineError::CpuBackend)?;
            for (idx, info) in tensors {
                // SAFETY: the GGUF reader checked offset + size <= file length.
                unsafe { map_buf.place(mapped.get(idx), bytes.as_ptr(), info.offset as usize) }
                    .map_err(EngineError::Ggml)?;
            }
            buffers.push(map_buf);
        }
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
                repacked.get(*r).write_bytes(g.tensor_data(info)?);
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
            kept_on_host,
        })
    }
}
