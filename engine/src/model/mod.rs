//! Model description: architecture, hyper-parameters read from the GGUF,
//! and the tensors each architecture expects. One file per architecture
//! holds its hyper-parameter quirks, its tensor list and its layer graph.

mod deepseek2;
mod gemma3;
mod hparams;
#[cfg(feature = "ggml")]
pub(crate) mod layers;
mod llama;
#[cfg(feature = "ggml")]
pub(crate) mod moe;
mod qwen2;
mod qwen3;
mod qwen3moe;

use std::path::Path;
use std::sync::Arc;

use crate::error::EngineError;
use crate::gguf::Gguf;

pub(crate) use hparams::{at_most, key, read_hparams, MAX_HEAD_DIM};
pub use hparams::{
    ExpertGating, Hparams, MlaHparams, MoeHparams, RopeParams, SlidingWindow, GRAPH_NODES,
    ROPE_NEOX, ROPE_NORM,
};

/// Architectures this engine can run (the GGUF's `general.architecture`).
pub use crate::gguf::SUPPORTED_ARCHITECTURES;

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Arch {
    Llama,
    Qwen2,
    Gemma3,
    Qwen3,
    Qwen3Moe,
    Deepseek2,
}

impl Arch {
    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Gemma3 => "gemma3",
            Arch::Qwen3 => "qwen3",
            Arch::Qwen3Moe => "qwen3moe",
            Arch::Deepseek2 => "deepseek2",
        }
    }

    fn from_name(name: &str) -> Option<Arch> {
        Some(match name {
            "llama" => Arch::Llama,
            "qwen2" => Arch::Qwen2,
            "gemma3" => Arch::Gemma3,
            "qwen3" => Arch::Qwen3,
            "qwen3moe" => Arch::Qwen3Moe,
            "deepseek2" => Arch::Deepseek2,
            _ => return None,
        })
    }

    /// The tensors of layer `il` this architecture reads, with their shapes.
    pub(crate) fn layer_tensors(self, hp: &Hparams, il: u32) -> Vec<TensorSpec> {
        match self {
            Arch::Llama => llama::layer_tensors(hp),
            Arch::Qwen2 => qwen2::layer_tensors(hp),
            Arch::Gemma3 => gemma3::layer_tensors(hp),
            Arch::Qwen3 => qwen3::layer_tensors(hp),
            Arch::Qwen3Moe => qwen3moe::layer_tensors(hp),
            Arch::Deepseek2 => deepseek2::layer_tensors(hp, il),
        }
    }

    #[cfg(feature = "ggml")]
    pub(crate) fn build_layer<'g>(
        self,
        cx: &mut layers::LayerCx<'g, '_>,
        il: u32,
        x: crate::ffi::ggml::Tensor<'g>,
    ) -> crate::ffi::ggml::Tensor<'g> {
        match self {
            Arch::Llama => llama::build_layer(cx, il, x),
            Arch::Qwen2 => qwen2::build_layer(cx, il, x),
            Arch::Gemma3 => gemma3::build_layer(cx, il, x),
            Arch::Qwen3 => qwen3::build_layer(cx, il, x),
            Arch::Qwen3Moe => qwen3moe::build_layer(cx, il, x),
            Arch::Deepseek2 => deepseek2::build_layer(cx, il, x),
        }
    }
}

/// A block with routed experts, built up to them: the residual and the
/// normed input of the experts (`[n_embd, n_tokens]` each).
#[cfg(feature = "ggml")]
pub(crate) struct MoeInput<'g> {
    pub ffn_inp: crate::ffi::ggml::Tensor<'g>,
    pub cur: crate::ffi::ggml::Tensor<'g>,
}

impl Arch {
    /// The routed-expert weights of layer `il` (`ffn_*_exps`, read by
    /// `mul_mat_id`); empty for a layer without routed experts.
    pub(crate) fn expert_tensors(self, hp: &Hparams, il: u32) -> Vec<TensorSpec> {
        self.layer_tensors(hp, il)
            .into_iter()
            .filter(|s| s.op == WeightOp::MulMatId)
            .collect()
    }

    /// Whether layer `il` has shared experts (run next to the routed ones).
    #[cfg(feature = "ggml")]
    pub(crate) fn has_shared_experts(self, hp: &Hparams, il: u32) -> bool {
        self == Arch::Deepseek2 && !self.expert_tensors(hp, il).is_empty()
    }

    /// Layer `il` (one with routed experts) up to its experts.
    #[cfg(feature = "ggml")]
    pub(crate) fn build_moe_input<'g>(
        self,
        cx: &mut layers::LayerCx<'g, '_>,
        il: u32,
        x: crate::ffi::ggml::Tensor<'g>,
    ) -> MoeInput<'g> {
        match self {
            Arch::Qwen3Moe => qwen3moe::moe_input(cx, il, x),
            Arch::Deepseek2 => deepseek2::moe_input(cx, il, x),
            _ => unreachable!("{} has no routed experts", self.name()),
        }
    }

    /// The shared experts of layer `il` on its normed input `cur`.
    #[cfg(feature = "ggml")]
    pub(crate) fn build_shared_experts<'g>(
        self,
        cx: &layers::LayerCx<'g, '_>,
        il: u32,
        cur: crate::ffi::ggml::Tensor<'g>,
    ) -> Option<crate::ffi::ggml::Tensor<'g>> {
        self.has_shared_experts(cx.hp, il)
            .then(|| deepseek2::shared_experts(cx, il, cur))
    }
}

/// A tensor an architecture expects: its GGUF name suffix (after `blk.N.`),
/// its shape in ggml order (`ne[0]` innermost), whether it must exist, and
/// the op that reads it (which decides whether it may be repacked).
#[derive(Clone, Debug)]
pub(crate) struct TensorSpec {
    pub name: &'static str,
    pub shape: Vec<u64>,
    pub required: bool,
    pub op: WeightOp,
}

/// The op a weight feeds, as llama.cpp's tensor table records it: only
/// matmul weights may live in the CPU's repacked layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum WeightOp {
    /// Norm weights, biases: read element-wise.
    Other,
    /// `mul_mat(w, x)` with a 2-D `w`.
    MulMat,
    /// `mul_mat_id(w, x, ids)` with a 3-D `w`, one matrix per expert.
    MulMatId,
}

pub(crate) fn req(name: &'static str, shape: &[u32]) -> TensorSpec {
    TensorSpec {
        name,
        shape: shape.iter().map(|&d| d as u64).collect(),
        required: true,
        op: if shape.len() == 2 && name.ends_with(".weight") {
            WeightOp::MulMat
        } else {
            WeightOp::Other
        },
    }
}

/// A required 3-D expert weight (`ffn_*_exps`), read by `mul_mat_id`.
pub(crate) fn req_exps(name: &'static str, shape: &[u32; 3]) -> TensorSpec {
    TensorSpec {
        op: WeightOp::MulMatId,
        ..req(name, shape)
    }
}

pub(crate) fn opt(name: &'static str, shape: &[u32]) -> TensorSpec {
    TensorSpec {
        required: false,
        ..req(name, shape)
    }
}

/// A GGUF model opened and validated: the file or a split model's files
/// (memory-mapped when their tensors are read), its architecture and
/// hyper-parameters. Shared by every stage that runs a part of it.
pub struct ModelFile {
    pub gguf: Gguf,
    pub hparams: Hparams,
    pub path: std::path::PathBuf,
}

impl std::fmt::Debug for ModelFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelFile")
            .field("path", &self.path)
            .field("hparams", &self.hparams)
            .finish()
    }
}

impl ModelFile {
    /// Opens and validates `path`: GGUF structure, supported architecture,
    /// required keys, and the shape of every tensor the architecture uses.
    /// Nothing is computed and no weight is read.
    /// A split model is opened from any of its parts; `path` is then its
    /// first part (the one llama.cpp's loader wants).
    pub fn open(path: impl AsRef<Path>) -> Result<Arc<ModelFile>, EngineError> {
        let gguf = Gguf::open(path.as_ref())?;
        let path = gguf
            .paths()
            .first()
            .copied()
            .flatten()
            .unwrap_or(path.as_ref())
            .to_path_buf();
        Self::from_gguf(gguf, &path)
    }

    /// [`ModelFile::open`]'s checks on a GGUF already parsed (e.g. from
    /// memory with [`Gguf::from_bytes`]); `path` is only what it is called.
    pub fn from_gguf(gguf: Gguf, path: &Path) -> Result<Arc<ModelFile>, EngineError> {
        let arch_name = gguf
            .check_architecture(SUPPORTED_ARCHITECTURES)?
            .to_string();
        let arch = Arch::from_name(&arch_name).expect("checked against SUPPORTED_ARCHITECTURES");
        let hparams = read_hparams(&gguf, arch)?;
        let model = ModelFile {
            gguf,
            hparams,
            path: path.to_path_buf(),
        };
        model.validate_tensors()?;
        Ok(Arc::new(model))
    }

    /// The chat template: the file's `tokenizer.chat_template`, or for a
    /// file without one (base models), the family's template (gemma3) or ChatML.
    pub fn chat_template(&self) -> Result<crate::chat::ChatTemplate, EngineError> {
        let g = &self.gguf;
        let token_text = |key: &str| -> Result<String, EngineError> {
            let Some(id) = g.opt_u32(key)? else {
                return Ok(String::new());
            };
            let tokens = g.get_str_array("tokenizer.ggml.tokens")?;
            Ok(tokens
                .get(id as usize)
                .map(|s| s.to_string())
                .unwrap_or_default())
        };
        let (bos, eos) = (
            token_text("tokenizer.ggml.bos_token_id")?,
            token_text("tokenizer.ggml.eos_token_id")?,
        );
        let source = match (g.opt_str("tokenizer.chat_template")?, self.hparams.arch) {
            (Some(t), _) => t,
            (None, Arch::Gemma3) => include_str!("../../templates/gemma3.jinja"),
            (None, _) => return Ok(crate::chat::ChatTemplate::chatml()),
        };
        Ok(crate::chat::ChatTemplate::new(source, &bos, &eos)?)
    }

    /// Non-layer tensors by role.
    pub(crate) fn global_tensors(&self) -> Vec<TensorSpec> {
        let hp = &self.hparams;
        let mut v = vec![
            req("token_embd.weight", &[hp.n_embd, hp.n_vocab]),
            req("output_norm.weight", &[hp.n_embd]),
        ];
        if !hp.tied_embeddings {
            v.push(req("output.weight", &[hp.n_embd, hp.n_vocab]));
        }
        v
    }

    fn validate_tensors(&self) -> Result<(), EngineError> {
        let hp = &self.hparams;
        let check = |name: &str, spec: &TensorSpec| -> Result<(), EngineError> {
            match self.gguf.tensor(name) {
                None if spec.required => Err(EngineError::MissingTensor {
                    name: name.to_string(),
                    arch: hp.arch.name(),
                }),
                None => Ok(()),
                Some(t) if t.dims != spec.shape => Err(EngineError::TensorShape {
                    name: name.to_string(),
                    expected: spec.shape.clone(),
                    found: t.dims.clone(),
                }),
                Some(_) => Ok(()),
            }
        };
        for spec in self.global_tensors() {
            check(spec.name, &spec)?;
        }
        for il in 0..hp.n_layer {
            for spec in &hp.arch.layer_tensors(hp, il) {
                check(&format!("blk.{il}.{}", spec.name), spec)?;
            }
        }
        Ok(())
    }

    /// Bytes of the weights a range needs, from the file's tensor table.
    pub fn range_weight_bytes(&self, range: &crate::range::LayerRange) -> u64 {
        let mut total: u64 = self
            .gguf
            .tensors()
            .iter()
            .filter(|t| t.layer().is_some_and(|l| range.layers.contains(&l)))
            .map(|t| t.size)
            .sum();
        let global = |n: &str| self.gguf.tensor(n).map_or(0, |t| t.size);
        if range.embed {
            total += global("token_embd.weight");
        }
        if range.head {
            total += global("output_norm.weight");
            total += if self.hparams.tied_embeddings && !range.embed {
                global("token_embd.weight")
            } else {
                global("output.weight")
            };
        }
        total
    }

    /// Bytes of layer `il`'s routed-expert tensors (`ffn_{gate,up,down}_exps`,
    /// the `mul_mat_id` weights an expert worker can hold instead of the
    /// layer's stage), from the tensor table; 0 for a dense layer or a layer
    /// past the last.
    pub fn expert_weight_bytes(&self, il: u32) -> u64 {
        let hp = &self.hparams;
        if il >= hp.n_layer {
            return 0;
        }
        hp.arch
            .expert_tensors(hp, il)
            .iter()
            .filter_map(|s| self.gguf.tensor(&format!("blk.{il}.{}", s.name)))
            .map(|t| t.size)
            .sum()
    }

    /// The layers with routed experts, ascending (empty for a dense model).
    pub fn expert_layers(&self) -> Vec<u32> {
        let hp = &self.hparams;
        (0..hp.n_layer)
            .filter(|&il| !hp.arch.expert_tensors(hp, il).is_empty())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::range::LayerRange;

    /// A synthetic fixture from `../shared/fixtures` beside the checkout (or `OMNI_FIXTURES_DIR`).
    fn synthetic(file: &str) -> Arc<ModelFile> {
        let manifest = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"));
        let dir = match std::env::var_os("OMNI_FIXTURES_DIR") {
            Some(d) => std::path::PathBuf::from(d),
            None => [
                manifest.join("../../shared/fixtures"),
                manifest.join("../shared/fixtures"),
            ]
            .into_iter()
            .find(|d| d.join("README.md").exists())
            .expect("fixtures: ../shared/fixtures beside the checkout, or OMNI_FIXTURES_DIR"),
        };
        ModelFile::open(dir.join("synthetic").join(file)).unwrap()
    }

    /// A model parsed from memory is the model opened from its file, and is
    /// refused for the same reasons.
    #[test]
    fn from_gguf_in_memory_matches_open() {
        let opened = synthetic("tiny-qwen3moe-q4_k_m.gguf");
        let bytes = std::fs::read(&opened.path).unwrap();
        let g = Gguf::from_bytes(bytes.clone()).unwrap();
        let m = ModelFile::from_gguf(g, Path::new("in memory")).unwrap();
        assert_eq!(m.hparams, opened.hparams);
        assert_eq!(m.path, Path::new("in memory"));

        // Renamed so that the architecture is one nobody runs.
        let at = bytes.windows(8).position(|w| w == b"qwen3moe").unwrap();
        let mut other = bytes;
        other[at..at + 8].copy_from_slice(b"qwen9moe");
        let err = ModelFile::from_gguf(Gguf::from_bytes(other).unwrap(), Path::new("x"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("'qwen9moe' is not supported"), "{err}");
    }

    /// The error opening `file` with the u32 metadata values `patches` put in.
    fn open_patched(file: &str, patches: &[(&str, u32)]) -> String {
        let mut bytes = std::fs::read(&synthetic(file).path).unwrap();
        for (key, v) in patches {
            // The key's length, the key, the type (4: u32), then the value.
            let mut entry = (key.len() as u64).to_le_bytes().to_vec();
            entry.extend(key.as_bytes());
            entry.extend(4u32.to_le_bytes());
            let at = bytes.windows(entry.len()).position(|w| w == entry);
            let at = at.unwrap_or_else(|| panic!("{file} has no u32 {key}")) + entry.len();
            bytes[at..at + 4].copy_from_slice(&v.to_le_bytes());
        }
        let g = Gguf::from_bytes(bytes).unwrap();
        ModelFile::from_gguf(g, Path::new(file))
            .unwrap_err()
            .to_string()
    }

    /// Head counts and sizes whose products overflow a u32 are refused by
    /// name (they overflowed computing the tensor shapes; found by fuzzing).
    #[test]
    fn huge_head_sizes_are_refused() {
        let refused = |file: &str, patches: &[(&str, u32)], want: &str| {
            let err = open_patched(file, patches);
            assert!(err.contains(want), "{file} {patches:?}: {err}");
        };
        let (moe, mla, legacy) = (
            "tiny-qwen3moe-q4_k_m.gguf",
            "tiny-deepseek2-mla-q4_k_m.gguf",
            "tiny-deepseek2-legacy-q4_k_m.gguf",
        );
        refused(
            moe,
            &[
                ("qwen3moe.attention.key_length", 1 << 31),
                ("qwen3moe.attention.value_length", 1 << 31),
            ],
            "'qwen3moe.attention.key_length': 2147483648 is more than the 65536",
        );
        refused(
            moe,
            &[
                ("qwen3moe.attention.head_count", 1 << 30),
                ("qwen3moe.attention.head_count_kv", 1 << 30),
            ],
            "'qwen3moe.attention.head_count': 1073741824 is more than the 4096",
        );
        refused(
            mla,
            &[("deepseek2.attention.kv_lora_rank", u32::MAX)],
            "'deepseek2.attention.kv_lora_rank': 4294967295 is more than the 65536",
        );
        refused(
            legacy,
            &[("deepseek2.expert_shared_count", 1 << 30)],
            "'deepseek2.expert_shared_count': 1073741824 shared experts of width 128 overflow",
        );
    }

    /// Expert bytes are exactly the three `ffn_*_exps` tensors of each MoE
    /// layer; dense layers (deepseek2's leading one) and layers past the
    /// last have none.
    #[test]
    fn expert_bytes_are_the_exps_tensors_of_moe_layers() {
        for (file, want_layers) in [
            ("tiny-qwen3moe-f32.gguf", vec![0, 1, 2, 3]),
            ("tiny-qwen3moe-q4_k_m.gguf", vec![0, 1, 2, 3]),
            ("tiny-deepseek2-mla-f32.gguf", vec![1, 2, 3]),
            ("tiny-deepseek2-legacy-q8_0.gguf", vec![1, 2, 3]),
        ] {
            let m = synthetic(file);
            assert_eq!(m.expert_layers(), want_layers, "{file}");
            let n_expert = u64::from(m.hparams.moe.as_ref().unwrap().n_expert);
            for il in 0..m.hparams.n_layer {
                let exps: u64 = ["gate", "up", "down"]
                    .iter()
                    .filter_map(|p| m.gguf.tensor(&format!("blk.{il}.ffn_{p}_exps.weight")))
                    .map(|t| t.size)
                    .sum();
                let got = m.expert_weight_bytes(il);
                assert_eq!(got, exps, "{file} layer {il}");
                assert_eq!(got > 0, want_layers.contains(&il), "{file} layer {il}");
                assert_eq!(got % n_expert, 0, "{file}: every expert the same size");
                let layer = m.range_weight_bytes(&LayerRange {
                    embed: false,
                    layers: il..il + 1,
                    head: false,
                });
                assert!(
                    got < layer,
                    "{file} layer {il}: the layer holds more than its experts"
                );
            }
            assert_eq!(m.expert_weight_bytes(m.hparams.n_layer), 0);
        }
    }
}
