//! Building blocks shared by the architectures, written after llama.cpp's
//! `llm_graph_context` helpers so the graphs (and so the numerics) match.

use crate::ffi::ggml::{Ctx, Graph, Tensor, TYPE_F16};
use crate::kv::KvCache;
use crate::model::Hparams;
use crate::stage::Weights;

/// What a layer graph needs: the graph being built, the weights, the KV
/// cache and this step's inputs.
pub(crate) struct LayerCx<'g, 's> {
    pub g: &'g Ctx,
    pub graph: &'s mut Graph<'g>,
    pub hp: &'g Hparams,
    pub weights: &'g Weights,
    pub kv: &'g KvCache,
    /// Token positions, I32 `[n_tokens]`.
    pub pos: Tensor<'g>,
    /// KV cell of each token, I64 `[n_tokens]`.
    pub kv_idx: Tensor<'g>,
    /// Which cells each token sees.
    pub attn: AttnInput<'g>,
    pub n_kv: i64,
    pub n_tokens: i64,
    /// Rows to keep after the last layer's attention (the tokens whose logits
    /// are wanted), as llama.cpp does: set only for the model's last layer
    /// when this stage also runs the head.
    pub out_ids: Option<Tensor<'g>>,
}

impl<'g> LayerCx<'g, '_> {
    /// Layer tensor `blk.{il}.{name}`; the loader guarantees required ones exist.
    pub fn w(&self, il: u32, name: &str) -> Tensor<'g> {
        self.w_opt(il, name)
            .unwrap_or_else(|| panic!("blk.{il}.{name} was validated at load"))
    }

    pub fn w_opt(&self, il: u32, name: &str) -> Option<Tensor<'g>> {
        self.weights.layer(il, name)
    }

    /// RMS norm followed by the weight (`build_norm(.., LLM_NORM_RMS)`).
    pub fn rms_norm(&self, x: Tensor<'g>, w: Tensor<'g>) -> Tensor<'g> {
        let n = self.g.rms_norm(x, self.hp.rms_eps);
        self.g.mul(n, w)
    }

    /// `mul_mat(w, x)` of a layer's matrix: omni's kernel where it gives
    /// ggml's bits and the stage computes on the CPU ([`Ctx::matmul`]).
    pub fn mm(&self, w: Tensor<'g>, x: Tensor<'g>) -> Tensor<'g> {
        self.g.matmul(w, x, !self.weights.on_device)
    }

    /// `x @ W (+ b)`.
    pub fn linear(&self, x: Tensor<'g>, w: Tensor<'g>, b: Option<Tensor<'g>>) -> Tensor<'g> {
        let y = self.mm(w, x);
        match b {
            Some(b) => self.g.add(y, b),
            None => y,
        }
    }

    /// Q, K, V projections (with optional biases), shaped `[head_dim, heads, n_tokens]`.
    pub fn qkv(&self, il: u32, x: Tensor<'g>) -> (Tensor<'g>, Tensor<'g>, Tensor<'g>) {
        let hp = self.hp;
        let q = self.linear(
            x,
            self.w(il, "attn_q.weight"),
            self.w_opt(il, "attn_q.bias"),
        );
        let k = self.linear(
            x,
            self.w(il, "attn_k.weight"),
            self.w_opt(il, "attn_k.bias"),
        );
        let v = self.linear(
            x,
            self.w(il, "attn_v.weight"),
            self.w_opt(il, "attn_v.bias"),
        );
        let q = self
            .g
            .reshape(q, &[hp.head_dim_k as i64, hp.n_head as i64, self.n_tokens]);
        let k = self.g.reshape(
            k,
            &[hp.head_dim_k as i64, hp.n_head_kv as i64, self.n_tokens],
        );
        let v = self.g.reshape(
            v,
            &[hp.head_dim_v as i64, hp.n_head_kv as i64, self.n_tokens],
        );
        (q, k, v)
    }

    pub fn rope(&self, il: u32, x: Tensor<'g>) -> Tensor<'g> {
        self.g
            .rope_ext(x, self.pos, None, &self.hp.rope_for_layer(il))
    }

    /// Self-attention over the KV cache: stores this step's K and V in their
    /// cells, then attends over them (see [`Self::attend`]).
    /// Returns `[head_dim_v * n_head, n_tokens]` (before the output projection).
    pub fn attention(
        &mut self,
        il: u32,
        q: Tensor<'g>,
        k: Tensor<'g>,
        v: Tensor<'g>,
        scale: f32,
    ) -> Tensor<'g> {
        let hp = self.hp;
        let g = self.g;
        let (kc, vc) = self.kv.layer(il);
        let k_rows = g.reshape(k, &[hp.n_embd_k_gqa() as i64, self.n_tokens]);
        let v_rows = g.reshape(v, &[hp.n_embd_v_gqa() as i64, self.n_tokens]);
        // Expand Q and V before the K store, in llama.cpp's order, so that
        // the node order (and so the thread partitioning) is the same.
        self.graph.expand(q);
        self.graph.expand(v);
        self.graph.expand(k);
        let ks = g.set_rows(kc, k_rows, self.kv_idx);
        self.graph.expand(ks);
        let vs = g.set_rows(vc, v_rows, self.kv_idx);
        self.graph.expand(vs);

        let ty = kc.ty();
        let kview = g.view(
            kc,
            &[hp.head_dim_k as i64, hp.n_head_kv as i64, self.n_kv],
            &[
                crate::ffi::ggml::row_size(ty, hp.head_dim_k as i64),
                crate::ffi::ggml::row_size(ty, hp.n_embd_k_gqa() as i64),
            ],
            0,
        );
        let vview = g.view(
            vc,
            &[hp.head_dim_v as i64, hp.n_head_kv as i64, self.n_kv],
            &[
                crate::ffi::ggml::row_size(ty, hp.head_dim_v as i64),
                crate::ffi::ggml::row_size(ty, hp.n_embd_v_gqa() as i64),
            ],
            0,
        );
        debug_assert_eq!(ty, TYPE_F16);
        let out = self.attend(il, q, kview, vview, scale);
        let out = g.reshape(out, &[(hp.head_dim_v * hp.n_head) as i64, self.n_tokens]);
        self.graph.expand(out);
        out
    }

    /// Attention of `q` (`[dk, n_head, n_tokens]`) over the cache rows
    /// `k` (`[dk, n_head_kv, n_kv]`) and `v` (`[dv, n_head_kv, n_kv]`):
    /// ggml's flash attention with the mask, as llama.cpp runs it, or, in a
    /// batch-invariant step, ours over each token's cells in position
    /// order. Returns `[dv, n_head, n_tokens]`.
    pub fn attend(
        &self,
        il: u32,
        q: Tensor<'g>,
        k: Tensor<'g>,
        v: Tensor<'g>,
        scale: f32,
    ) -> Tensor<'g> {
        let g = self.g;
        let swa = self.hp.is_swa(il);
        match self.attn {
            AttnInput::Mask {
                full,
                swa: swa_mask,
            } => {
                let mask = if swa { swa_mask.unwrap_or(full) } else { full };
                let q = g.permute(q, [0, 2, 1, 3]);
                let kp = g.permute(k, [0, 2, 1, 3]);
                let vp = g.permute(v, [0, 2, 1, 3]);
                g.flash_attn_ext(q, kp, vp, mask, scale, 0.0)
            }
            AttnInput::InOrder(order) => {
                let window = swa && self.hp.swa.is_some();
                g.attention_in_order(q, k, v, order, scale, window)
            }
        }
    }

    /// Keeps only the `out_ids` rows of each tensor when this is the place to do it.
    pub fn select_outputs(&self, ts: [Tensor<'g>; 2]) -> [Tensor<'g>; 2] {
        match self.out_ids {
            Some(ids) => ts.map(|t| self.g.get_rows(t, ids)),
            None => ts,
        }
    }

    /// Gated feed-forward `down(act(gate(x)) * up(x))`.
    pub fn ffn_gated(&self, il: u32, x: Tensor<'g>, act: Activation) -> Tensor<'g> {
        self.ffn_gated_named(
            il,
            x,
            act,
            ["ffn_up.weight", "ffn_gate.weight", "ffn_down.weight"],
        )
    }

    /// [`Self::ffn_gated`] with the weights `[up, gate, down]` of layer `il`
    /// under other names (DeepSeek's shared experts: `ffn_*_shexp`).
    pub fn ffn_gated_named(
        &self,
        il: u32,
        x: Tensor<'g>,
        act: Activation,
        [up, gate, down]: [&str; 3],
    ) -> Tensor<'g> {
        let up = self.mm(self.w(il, up), x);
        let gate = self.mm(self.w(il, gate), x);
        let h = match act {
            Activation::Silu => self.g.swiglu_split(gate, up),
            Activation::GeluTanh => self.g.geglu_split(gate, up),
        };
        self.mm(self.w(il, down), h)
    }
}

/// The end of a MoE block: routed experts, plus the shared ones where the
/// architecture has them (in that order, as llama.cpp adds them), plus the
/// residual.
pub(crate) fn finish_moe<'g>(
    g: &'g Ctx,
    routed: Tensor<'g>,
    shared: Option<Tensor<'g>>,
    ffn_inp: Tensor<'g>,
) -> Tensor<'g> {
    let out = match shared {
        Some(s) => g.add(routed, s),
        None => routed,
    };
    g.add(out, ffn_inp)
}

/// What tells attention which cells each token sees.
#[derive(Clone, Copy)]
pub(crate) enum AttnInput<'g> {
    /// F16 masks `[n_kv, n_tokens]` for ggml's flash attention (causal, and
    /// the sliding-window one where the model has it).
    Mask {
        full: Tensor<'g>,
        swa: Option<Tensor<'g>>,
    },
    /// Each token's cells in position order (`KvCache::order`), for the
    /// batch-invariant attention.
    InOrder(Tensor<'g>),
}

#[derive(Clone, Copy, Debug)]
pub(crate) enum Activation {
    Silu,
    /// GELU with the tanh approximation (ggml's `gelu`, HF's `gelu_pytorch_tanh`).
    GeluTanh,
}
