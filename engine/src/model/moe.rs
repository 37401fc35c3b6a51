//! The mixture-of-experts feed-forward block, written after llama.cpp's
//! `llm_graph_context::build_moe_ffn` (src/llama-graph.cpp) op for op, and
//! the expert hyper-parameters every MoE architecture reads the same way.
//!
//! Softmax or sigmoid gating, DeepSeek V3's selection bias and
//! group-limited routing, weight renormalisation and scale.

use super::layers::{Activation, LayerCx};
use super::{key, uniform_u32, Arch, ExpertGating, MoeHparams};
use crate::error::EngineError;
use crate::ffi::ggml::{Ctx, Graph, Tensor};
use crate::gguf::Gguf;

/// llama.cpp's `LLAMA_MAX_EXPERTS`: it refuses files with more.
const MAX_EXPERTS: u32 = 1024;

/// The expert keys every MoE architecture shares. Routing options that
/// differ per architecture (gating, normalisation, scale) start at the
/// plain defaults (softmax, no renormalisation, no scale) for the
/// architecture to adjust.
pub(crate) fn read_hparams(
    g: &Gguf,
    arch: Arch,
    n_layer: u32,
    n_ff: u32,
) -> Result<MoeHparams, EngineError> {
    let k = |s: &str| key(arch, s);
    let bad = |key: String, why: String| EngineError::BadHparam { key, why };
    let n_expert = g.opt_u32(&k("expert_count"))?.unwrap_or(0);
    if n_expert == 0 || n_expert > MAX_EXPERTS {
        return Err(bad(
            k("expert_count"),
            format!(
                "{n_expert} experts; a {} file needs 1 to {MAX_EXPERTS}",
                arch.name()
            ),
        ));
    }
    let n_expert_used = uniform_u32(g, &k("expert_used_count"), n_layer)?.unwrap_or(0);
    if n_expert_used == 0 || n_expert_used > n_expert {
        return Err(bad(
            k("expert_used_count"),
            format!(
                "{n_expert_used} experts per token, but it must be 1 to the {n_expert} experts"
            ),
        ));
    }
    // As llama.cpp: without the key, the dense width shared by the used experts.
    let n_ff_exp = match uniform_u32(g, &k("expert_feed_forward_length"), n_layer)? {
        Some(n) => n,
        None => n_ff / n_expert_used,
    };
    if n_ff_exp == 0 {
        return Err(bad(
            k("expert_feed_forward_length"),
            "an expert's hidden width must be positive".into(),
        ));
    }
    // llama.cpp reads the groups for every architecture and asserts these.
    let n_expert_groups = g.opt_u32(&k("expert_group_count"))?.unwrap_or(0);
    let n_group_used = g.opt_u32(&k("expert_group_used_count"))?.unwrap_or(0);
    if n_expert_groups >= n_expert {
        return Err(bad(
            k("expert_group_count"),
            format!("{n_expert_groups} groups for {n_expert} experts: group-limited routing needs fewer groups than experts"),
        ));
    }
    if n_expert_groups > 1 {
        // Each group is scored by its two best experts (ggml asserts the top-2 fits).
        if n_expert % n_expert_groups != 0 || n_expert / n_expert_groups < 2 {
            return Err(bad(
                k("expert_group_count"),
                format!("group-limited routing needs {n_expert} experts split into groups of at least 2, not {n_expert_groups} groups"),
            ));
        }
        if n_group_used == 0 || n_group_used >= n_expert_groups {
            return Err(bad(
                k("expert_group_used_count"),
                format!("{n_group_used} groups used: group-limited routing over {n_expert_groups} groups needs 1 to {}", n_expert_groups - 1),
            ));
        }
    }
    Ok(MoeHparams {
        n_expert,
        n_expert_used,
        n_ff_exp,
        gating: ExpertGating::Softmax,
        norm_weights: false,
        weights_scale: 1.0,
        n_expert_groups,
        n_group_used,
    })
}

/// The weights of one layer's routed experts.
pub(crate) struct MoeWeights<'g> {
    /// Router, `[n_embd, n_expert]`.
    pub gate_inp: Tensor<'g>,
    /// `[n_embd, n_ff_exp, n_expert]`, `[n_embd, n_ff_exp, n_expert]`, `[n_ff_exp, n_embd, n_expert]`.
    pub up_exps: Tensor<'g>,
    pub gate_exps: Tensor<'g>,
    pub down_exps: Tensor<'g>,
    /// Bias added to the probabilities for choosing experts only, not to
    /// their weights (DeepSeek V3's `exp_probs_b`), `[n_expert]`.
    pub exp_probs_b: Option<Tensor<'g>>,
}

impl<'g> LayerCx<'g, '_> {
    /// Layer `il`'s experts under their usual GGUF names.
    pub fn moe_weights(&self, il: u32) -> MoeWeights<'g> {
        MoeWeights {
            gate_inp: self.w(il, "ffn_gate_inp.weight"),
            up_exps: self.w(il, "ffn_up_exps.weight"),
            gate_exps: self.w(il, "ffn_gate_exps.weight"),
            down_exps: self.w(il, "ffn_down_exps.weight"),
            exp_probs_b: self.w_opt(il, "exp_probs_b.bias"),
        }
    }

    /// Routed experts on `x` (`[n_embd, n_tokens]`): router logits, gating,
    /// top-k, the selected experts' weights (renormalised and scaled as `p`
    /// says), each selected expert's gated FFN through `mul_mat_id`, and the
    /// weighted sum. Node order is `build_moe_ffn`'s, so the numbers are too.
    pub fn moe_ffn(
        &mut self,
        x: Tensor<'g>,
        w: &MoeWeights<'g>,
        p: &MoeHparams,
        act: Activation,
    ) -> Tensor<'g> {
        let r = self.moe_route(x, w.gate_inp, w.exp_probs_b, p);
        moe_experts(
            self.g,
            self.graph,
            x,
            &r,
            [w.up_exps, w.gate_exps, w.down_exps],
            act,
        )
    }

    /// The router half of [`Self::moe_ffn`]: which experts each token uses
    /// and the weights their outputs are multiplied by.
    pub fn moe_route(
        &mut self,
        x: Tensor<'g>,
        gate_inp: Tensor<'g>,
        exp_probs_b: Option<Tensor<'g>>,
        p: &MoeHparams,
    ) -> Routing<'g> {
        let g = self.g;
        let n_tokens = x.ne()[1];
        let (n_expert, n_used) = (p.n_expert as i64, p.n_expert_used as i64);

        let logits = g.mul_mat(gate_inp, x); // [n_expert, n_tokens]
        let probs = match p.gating {
            ExpertGating::Softmax => g.soft_max(logits),
            ExpertGating::Sigmoid => g.sigmoid(logits),
        };
        let mut selection_probs = match exp_probs_b {
            Some(b) => g.add(probs, b),
            None => probs,
        };
        if p.n_expert_groups > 1 {
            // Group-limited routing: each group's score is the sum of its two
            // best selection scores; the experts outside the `n_group_used`
            // best groups are masked to -inf before the top-k.
            let n_groups = p.n_expert_groups as i64;
            let per_group = n_expert / n_groups;
            let groups = g.reshape(selection_probs, &[per_group, n_groups, n_tokens]);
            let best2 = g.argsort_top_k(groups, 2); // [2, n_groups, n_tokens]
            let scores = g.get_rows(
                g.reshape(groups, &[1, per_group, n_groups, n_tokens]),
                best2,
            );
            let scores = g.sum_rows(g.reshape(scores, &[2, n_groups, n_tokens])); // [1, n_groups, n_tokens]
            let scores = g.reshape(scores, &[n_groups, n_tokens]);
            let kept = g.argsort_top_k(scores, p.n_group_used as i64); // [n_group_used, n_tokens]
            let kept_probs = g.get_rows(groups, kept); // [per_group, n_group_used, n_tokens]
            let masked = g.set_rows(g.fill(groups, f32::NEG_INFINITY), kept_probs, kept);
            selection_probs = g.reshape(masked, &[n_expert, n_tokens]);
        }
        let selected = g.argsort_top_k(selection_probs, n_used); // [n_used, n_tokens]

        let probs = g.reshape(probs, &[1, n_expert, n_tokens]);
        let mut weights = g.get_rows(probs, selected); // [1, n_used, n_tokens]
        if p.norm_weights {
            let w2 = g.reshape(weights, &[n_used, n_tokens]);
            let sum = g.sum_rows(w2); // [1, n_tokens]
                                      // Never divide by zero: the smallest normal F16, as llama.cpp clamps.
            let sum = g.clamp(sum, 6.103_515_6e-5, f32::INFINITY);
            let w2 = g.div(w2, sum);
            weights = g.reshape(w2, &[1, n_used, n_tokens]);
        }
        if p.weights_scale != 0.0 && p.weights_scale != 1.0 {
            weights = g.scale(weights, p.weights_scale);
        }
        self.graph.expand(weights);
        Routing { selected, weights }
    }
}

/// The selected experts of one MoE block: ids (I32 `[n_used, n_tokens]`,
/// a view of the sorted router scores) and their final weights
/// (`[1, n_used, n_tokens]`, after renormalisation and scale).
pub(crate) struct Routing<'g> {
    pub selected: Tensor<'g>,
    pub weights: Tensor<'g>,
}

/// The expert half of `build_moe_ffn`: each selected expert's gated FFN
/// on `x` (`[n_embd, n_tokens]`) through `mul_mat_id` with the `[up, gate,
/// down]` expert weights, scaled by its weight, summed over the experts.
/// Shared by the in-graph block and [`crate::experts::ExpertStage`], so
/// both run the same nodes in the same order.
pub(crate) fn moe_experts<'g>(
    g: &'g Ctx,
    graph: &mut Graph<'g>,
    x: Tensor<'g>,
    r: &Routing<'g>,
    [up_exps, gate_exps, down_exps]: [Tensor<'g>; 3],
    act: Activation,
) -> Tensor<'g> {
    let [n_embd, n_tokens, ..] = x.ne();
    let n_used = r.selected.ne()[0];
    let selected = r.selected;
    let cur = g.reshape(x, &[n_embd, 1, n_tokens]);
    let up = g.mul_mat_id(up_exps, cur, selected); // [n_ff_exp, n_used, n_tokens]
    let gate = g.mul_mat_id(gate_exps, cur, selected);
    let h = match act {
        Activation::Silu => g.swiglu_split(gate, up),
        Activation::GeluTanh => g.geglu_split(gate, up),
    };
    let experts = g.mul_mat_id(down_exps, h, selected); // [n_embd, n_used, n_tokens]
    let experts = g.mul(experts, r.weights);
    graph.expand(experts);

    // Sum the experts as views added one by one, the views first.
    let nb = experts.nb();
    let views: Vec<Tensor<'g>> = (0..n_used as usize)
        .map(|i| {
            let v = g.view(experts, &[n_embd, n_tokens], &[nb[2]], i * nb[1]);
            graph.expand(v);
            v
        })
        .collect();
    let mut out = views[0];
    for &v in &views[1..] {
        out = g.add(out, v);
        graph.expand(out);
    }
    if n_used == 1 {
        out = g.cont(out);
    }
    out
}
