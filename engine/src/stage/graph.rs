//! One step's graph: reserved once for the worst step, cut into segments
//! at the layers whose experts run elsewhere.

use super::device_experts::DeviceExperts;
use super::weights::Weights;
use super::Stage;
use crate::error::EngineError;
use crate::ffi::ggml;
use crate::ffi::ggml::Ctx;
use crate::ffi::ggml::Tensor;
use crate::ffi::ggml::TYPE_F16;
use crate::ffi::ggml::TYPE_F32;
use crate::ffi::ggml::TYPE_I32;
use crate::ffi::ggml::TYPE_I64;
use crate::kv::KvCache;
use crate::model::layers::finish_moe;
use crate::model::layers::Activation;
use crate::model::layers::AttnInput;
use crate::model::layers::LayerCx;
use crate::model::moe::moe_experts;
use crate::model::moe::Routing;
use crate::model::ModelFile;
use crate::range::LayerRange;
use std::collections::BTreeMap;

impl Stage {
    /// Sizes the compute buffer once, for a full micro-batch over a full
    /// cache (with offloaded experts: for the largest of the graphs a step runs).
    /// On the CPU, also for a batch-invariant step (its attention reads
    /// order lists instead of masks).
    pub(super) fn reserve(&mut self) -> Result<(), EngineError> {
        let kv = self.kv.config();
        let n = self.cfg.n_ubatch.min(kv.n_cells());
        // Each token's header, and each sequence's cells (at most n_ctx).
        let order_len = ggml::ORDER_HEADER * n + n.min(kv.n_seq) * kv.n_ctx;
        let modes: &[Option<usize>] = if self.exec.on_gpu() {
            &[None]
        } else {
            &[None, Some(order_len)]
        };
        let oom = |e: String| EngineError::OutOfMemory {
            what: format!("compute buffer: {e}"),
            bytes: 0,
        };
        let n_used = self
            .model
            .hparams
            .moe
            .as_ref()
            .map_or(0, |m| m.n_expert_used as usize);
        let mut segments = self.segments(n, false);
        if self.range.head && !self.offloaded.is_empty() {
            // An overlapped step's head, for both groups' rows at once.
            segments.push(self.head_segment());
        }
        if self.experts_may_be_here(n) {
            // A full step's experts streamed to the device: one whole graph,
            // holding the copies of a layer's experts.
            segments.extend(self.segments(n, true));
        }
        for &in_order in modes {
            let parts = GraphParts {
                model: &self.model,
                range: &self.range,
                weights: &self.weights,
                kv: &self.kv,
                device: &self.device,
                in_order,
            };
            for seg in &segments {
                // Each graph built twice: ggml's scheduler splits a graph once
                // (see `Executor::reserve`).
                for pass in [Pass::Reserve, Pass::Fallbacks] {
                    if pass == Pass::Fallbacks && !self.exec.on_gpu() {
                        continue;
                    }
                    let ctx = Ctx::new(ggml::GRAPH_NODES, true);
                    let (graph, _) = parts.build_segment(&ctx, n, kv.n_cells(), n, seg);
                    pass.run(&mut self.exec, &graph).map_err(oom)?;
                    if let Some(r) = seg.resume.filter(|r| r.side && in_order.is_none()) {
                        let ctx = Ctx::new(ggml::GRAPH_NODES, true);
                        let (graph, _) = parts.build_side(&ctx, r.layer, n, n_used);
                        pass.run(&mut self.exec, &graph).map_err(oom)?;
                    }
                }
            }
        }
        Ok(())
    }

    /// The segments of a step: cut at each offloaded block, each resuming
    /// the block the previous one cut (with `n_cut` tokens). With
    /// `experts_here` (the stage computes the offloaded layers' routed
    /// experts itself: [`Stage::experts_here`]) only the model's last
    /// layer is cut, where a head stage keeps just the rows whose logits
    /// are wanted (one per prompt): too few to be worth streaming a layer
    /// (ggml would compute them on the CPU here, and the layer's rest and
    /// the head beside them).
    pub(super) fn segments(&self, n_cut: usize, experts_here: bool) -> Vec<Segment> {
        let hp = &self.model.hparams;
        let mut out = Vec::with_capacity(self.offloaded.len() + 1);
        let (mut resume, mut from) = (None, self.range.layers.start);
        let last_here = |il: u32| il + 1 == hp.n_layer && self.range.head;
        for il in self
            .offloaded
            .iter()
            .copied()
            .filter(|&il| !experts_here || last_here(il))
        {
            out.push(Segment {
                resume,
                layers: (from, il),
                cut: Some(il),
                head: false,
                hidden_in: false,
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
            head: self.range.head,
            hidden_in: false,
        });
        out
    }

    /// The head alone, on hidden rows already through the range's layers:
    /// an overlapped step's two groups stop before it (their last
    /// segments' `head` unset) and compute it once for both groups' rows,
    /// reading the output matrix once a step instead of once a group (on
    /// R1 it is 0.76 GB of the stage's ~2 GB a token). The same rows in
    /// the same order as the whole batch's head: the same logits.
    pub(super) fn head_segment(&self) -> Segment {
        Segment {
            resume: None,
            layers: (self.range.layers.end, self.range.layers.end),
            cut: None,
            head: true,
            hidden_in: true,
        }
    }
}

/// What [`Stage::reserve`] does with a graph it built.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Pass {
    /// Size the compute buffers for it.
    Reserve,
    /// Note the ops of it the GPU leaves to the CPU.
    Fallbacks,
}

impl Pass {
    fn run(self, exec: &mut ggml::Executor, graph: &ggml::Graph<'_>) -> Result<(), String> {
        match self {
            Pass::Reserve => exec.reserve(graph),
            Pass::Fallbacks => exec.note_fallbacks(graph),
        }
    }
}

/// The parts of a stage a graph reads (borrowed apart from the mutable runtime).
pub(super) struct GraphParts<'a> {
    pub(super) model: &'a ModelFile,
    pub(super) range: &'a LayerRange,
    pub(super) weights: &'a Weights,
    pub(super) kv: &'a KvCache,
    pub(super) device: &'a BTreeMap<u32, DeviceExperts>,
    /// A batch-invariant step: attention reads each token's cells from an
    /// order list of this length (`KvCache::order`) instead of masks.
    pub(super) in_order: Option<usize>,
}

/// A piece of one step's graph between offloaded expert blocks. The whole
/// range is one segment: no resume, all its layers, no cut, the range's head.
#[derive(Clone, Copy, Debug)]
pub(super) struct Segment {
    /// Starts by finishing an offloaded block from host inputs instead of
    /// taking the range's input.
    pub(super) resume: Option<Resume>,
    /// Layers run whole.
    pub(super) layers: (u32, u32),
    /// Ends at this layer's routed experts (their input and routing)
    /// instead of the range's output.
    pub(super) cut: Option<u32>,
    /// Ends with the head (a head range's last segment, unless its step
    /// computes the head apart: [`Stage::head_segment`]); without it a head
    /// range's last segment outputs the hidden rows whose logits are wanted.
    pub(super) head: bool,
    /// Takes hidden rows (`inp_hidden`) even in a range with the embedding.
    pub(super) hidden_in: bool,
}

/// An offloaded block to finish: its layer, tokens, and whether the stage
/// computed a side result for it (its shared experts and/or the routed
/// experts kept on the stage), given as the input `inp_shared`.
#[derive(Clone, Copy, Debug)]
pub(super) struct Resume {
    pub(super) layer: u32,
    pub(super) n_tokens: usize,
    pub(super) side: bool,
}

/// What a segment's graph ends with.
pub(super) enum SegmentOut<'g> {
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
    /// Builds the graph of one segment of a step.
    pub(super) fn build_segment<'g>(
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
        } else if self.range.embed && !seg.hidden_in {
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
            let attn = match self.in_order {
                Some(len) => AttnInput::InOrder(ctx.input(TYPE_I32, &[len as i64], "inp_kv_order")),
                None => AttnInput::Mask {
                    full: ctx.input(TYPE_F16, &[n_kv as i64, nt], "inp_mask"),
                    swa: hp
                        .swa
                        .is_some()
                        .then(|| ctx.input(TYPE_F16, &[n_kv as i64, nt], "inp_mask_swa")),
                },
            };
            let mut cx = LayerCx {
                g: ctx,
                graph: &mut graph,
                hp,
                weights: self.weights,
                kv: self.kv,
                pos,
                kv_idx,
                attn,
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
        let last_layer_here = !self.range.layers.is_empty() && self.range.layers.end == hp.n_layer;
        if let (Some(ids), false) = (out_ids, last_layer_here) {
            x = ctx.get_rows(x, ids);
        }
        if seg.head {
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
            // Omni's kernel where it gives ggml's bits on the CPU (a
            // Q4_K_M file's Q6_K head: R1's 0.76 GB a token).
            x = ctx.matmul(out_w, x, !self.weights.on_device);
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
    pub(super) fn build_side<'g>(
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
                attn: AttnInput::Mask {
                    full: ctx.input(TYPE_F16, &[1, nt], "inp_mask"),
                    swa: None,
                },
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
                // The device's own copies: ggml's op.
                false,
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
