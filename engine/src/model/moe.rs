//! The mixture-of-experts feed-forward block, written after llama.cpp's
//! `llm_graph_context::build_moe_ffn` (src/llama-graph.cpp) op for op
//! (the expert hyper-parameters are read in `hparams.rs`).
//!
//! Softmax or sigmoid gating, DeepSeek V3's selection bias and
//! group-limited routing, weight renormalisation and scale.

use super::layers::{Activation, LayerCx};
use super::{ExpertGating, MoeHparams};
use crate::ffi::ggml::{Ctx, Graph, Tensor};

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
            !self.weights.on_device,
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
/// both run the same nodes in the same order; `on_cpu`: the graph runs on
/// the CPU (see [`Ctx::expert_matmuls`]).
pub(crate) fn moe_experts<'g>(
    g: &'g Ctx,
    graph: &mut Graph<'g>,
    x: Tensor<'g>,
    r: &Routing<'g>,
    [up_exps, gate_exps, down_exps]: [Tensor<'_>; 3],
    act: Activation,
    on_cpu: bool,
) -> Tensor<'g> {
    let [n_embd, n_tokens, ..] = x.ne();
    let n_used = r.selected.ne()[0];
    let selected = r.selected;
    let cur = g.reshape(x, &[n_embd, 1, n_tokens]);
    // [n_ff_exp, n_used, n_tokens] each; ours where it takes the weights
    // (`experts_kernel`), ggml's `mul_mat_id` otherwise.
    let [up, gate] = g.expert_matmuls([up_exps, gate_exps], cur, selected, on_cpu);
    let h = match act {
        Activation::Silu => g.swiglu_split(gate, up),
        Activation::GeluTanh => g.geglu_split(gate, up),
    };
    let [experts] = g.expert_matmuls([down_exps], h, selected, on_cpu); // [n_embd, n_used, n_tokens]
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
