//! DeepSeek V2/V3 (`deepseek2`): multi-head latent attention (MLA) with
//! YaRN rope on a separate roped part of each head, leading dense blocks,
//! then mixture-of-experts blocks with sigmoid (or softmax) gating, a
//! selection bias, group-limited routing and shared experts.
//! Reference: llama.cpp `src/models/deepseek2.cpp`, op for op.
//!
//! Two GGUF layouts of the same weights:
//! - current (`attn_k_b`/`attn_v_b`, `attention.key_length_mla`): the
//!   latent `kv_lora_rank + rope` row of each token is all the KV cache
//!   keeps (one KV "head"; values are its first `kv_lora_rank` elements),
//!   `attn_k_b` is absorbed into the queries and `attn_v_b` applied to the
//!   attention output, as llama.cpp's MLA path does;
//! - legacy (one `attn_kv_b`, early-2025 files): K and V are decompressed
//!   for every head and cached as in plain multi-head attention.

#[cfg(feature = "ggml")]
use super::layers::{Activation, LayerCx};
#[cfg(feature = "ggml")]
use super::MoeInput;
use super::{
    at_most, key, opt, req, req_exps, ExpertGating, Hparams, MlaHparams, TensorSpec, MAX_HEAD_DIM,
};
use crate::error::EngineError;
#[cfg(feature = "ggml")]
use crate::ffi::ggml::{row_size, Tensor};
use crate::gguf::Gguf;

pub(crate) fn adjust_hparams(g: &Gguf, hp: &mut Hparams) -> Result<(), EngineError> {
    let arch = hp.arch;
    let k = |s: &str| key(arch, s);
    let bad = |key: String, why: String| Err(EngineError::BadHparam { key, why });

    let kv_lora_rank = g.get_u32(&k("attention.kv_lora_rank"))?;
    if kv_lora_rank == 0 {
        return bad(k("attention.kv_lora_rank"), "must be positive".into());
    }
    at_most(k("attention.kv_lora_rank"), kv_lora_rank, MAX_HEAD_DIM)?;
    // Without the key (DeepSeek-V2-Lite style files), a plain `attn_q`.
    let q_lora_rank = g.opt_u32(&k("attention.q_lora_rank"))?.unwrap_or(0);
    let key_mla = g.opt_u32(&k("attention.key_length_mla"))?.unwrap_or(0);
    let value_mla = g.opt_u32(&k("attention.value_length_mla"))?.unwrap_or(0);
    at_most(k("attention.key_length_mla"), key_mla, MAX_HEAD_DIM)?;
    at_most(k("attention.value_length_mla"), value_mla, MAX_HEAD_DIM)?;
    if (key_mla == 0) != (value_mla == 0) {
        return bad(
            k("attention.key_length_mla"),
            format!("key_length_mla {key_mla} and value_length_mla {value_mla} must both be set (current MLA layout) or both absent (legacy attn_kv_b layout)"),
        );
    }
    let absorbed = key_mla != 0;
    // The head sizes once decompressed: the `_mla` keys in the current
    // layout, the plain ones in the legacy layout.
    let (head_k, head_v) = if absorbed {
        (key_mla, value_mla)
    } else {
        (hp.head_dim_k, hp.head_dim_v)
    };
    let n_rot = hp.rope.n_dims as u32;
    if n_rot == 0 || n_rot >= head_k {
        return bad(
            k("rope.dimension_count"),
            format!(
                "{n_rot} roped dimensions leave no unroped part of the {head_k}-wide key heads"
            ),
        );
    }
    if absorbed {
        // One KV "head": the latent plus the roped part, whose first
        // `kv_lora_rank` elements are the values.
        let want = [
            ("attention.head_count_kv", hp.n_head_kv, 1),
            ("attention.key_length", hp.head_dim_k, kv_lora_rank + n_rot),
            ("attention.value_length", hp.head_dim_v, kv_lora_rank),
        ];
        for (name, got, need) in want {
            if got != need {
                return bad(
                    k(name),
                    format!("{got}, but the MLA layout (key_length_mla set) needs {need} (kv_lora_rank {kv_lora_rank}, {n_rot} roped dimensions)"),
                );
            }
        }
    } else if hp.n_head_kv != hp.n_head {
        return bad(
            k("attention.head_count_kv"),
            format!(
                "{}, but the legacy attn_kv_b layout decompresses K and V for all {} heads",
                hp.n_head_kv, hp.n_head
            ),
        );
    }
    // llama.cpp counts multi-token-prediction blocks in block_count and
    // runs only the others; running them as ordinary blocks would be wrong.
    if let Some(n) = g.opt_u32(&k("nextn_predict_layers"))? {
        if n != 0 {
            return bad(
                k("nextn_predict_layers"),
                format!("{n} multi-token-prediction blocks are not supported"),
            );
        }
    }
    if let Some(s) = g.opt_f32(&k("attention.temperature_scale"))? {
        if s != 0.0 {
            return bad(
                k("attention.temperature_scale"),
                "attention temperature tuning is not supported".into(),
            );
        }
    }

    let n_layer_dense_lead = g.opt_u32(&k("leading_dense_block_count"))?.unwrap_or(0);
    if n_layer_dense_lead > hp.n_layer {
        return bad(
            k("leading_dense_block_count"),
            format!(
                "{n_layer_dense_lead} dense blocks but the model has {} blocks",
                hp.n_layer
            ),
        );
    }
    if n_layer_dense_lead > 0 && hp.n_ff == 0 {
        return bad(
            k("feed_forward_length"),
            "the leading dense blocks need a positive FFN width".into(),
        );
    }
    let n_expert_shared = if n_layer_dense_lead < hp.n_layer {
        read_experts(g, hp)?
    } else {
        0
    };
    yarn(g, hp, head_k)?;

    hp.mla = Some(MlaHparams {
        q_lora_rank,
        kv_lora_rank,
        n_embd_head_qk_nope: head_k - n_rot,
        n_embd_head_qk_rope: n_rot,
        n_embd_head_v: head_v,
        absorbed,
        n_layer_dense_lead,
        n_expert_shared,
    });
    Ok(())
}

/// The routed and shared experts of the MoE blocks; the shared experts' count.
fn read_experts(g: &Gguf, hp: &mut Hparams) -> Result<u32, EngineError> {
    let arch = hp.arch;
    let k = |s: &str| key(arch, s);
    let bad = |key: String, why: String| Err(EngineError::BadHparam { key, why });
    let mut moe = super::hparams::read_moe_hparams(g, arch, hp.n_layer, hp.n_ff)?;
    let n_expert_shared = g.get_u32(&k("expert_shared_count"))?;
    if n_expert_shared == 0 {
        return bad(
            k("expert_shared_count"),
            "deepseek2 MoE blocks need at least one shared expert".into(),
        );
    }
    // The shared experts are one FFN `n_expert_shared` experts wide.
    if moe.n_ff_exp.checked_mul(n_expert_shared).is_none() {
        return bad(
            k("expert_shared_count"),
            format!(
                "{n_expert_shared} shared experts of width {} overflow a u32",
                moe.n_ff_exp
            ),
        );
    }
    // llama.cpp's default scale 0 means none, as our 1.
    if let Some(s) = g.opt_f32(&k("expert_weights_scale"))? {
        moe.weights_scale = if s == 0.0 { 1.0 } else { s };
    }
    moe.norm_weights = g.opt_bool(&k("expert_weights_norm"))?.unwrap_or(false);
    moe.gating = match g.opt_u32(&k("expert_gating_func"))?.unwrap_or(0) {
        // No key: DeepSeek V2/V2.5 files are softmax; llama.cpp makes an
        // exception for GLM 4.7 Lite, known by its shape.
        0 if matches!(hp.n_layer, 47 | 48) && hp.n_vocab == 154_880 => ExpertGating::Sigmoid,
        0 | 1 => ExpertGating::Softmax,
        2 => ExpertGating::Sigmoid,
        other => {
            return bad(
                k("expert_gating_func"),
                format!("gating function {other} is not supported (1: softmax, 2: sigmoid)"),
            )
        }
    };
    hp.moe = Some(moe);
    Ok(n_expert_shared)
}

/// YaRN as llama.cpp does it for deepseek2: the rope's attention factor and
/// the attention scale.
fn yarn(g: &Gguf, hp: &mut Hparams, head_k: u32) -> Result<(), EngineError> {
    let k = |s: &str| key(hp.arch, s);
    // YaRN as llama.cpp does it for deepseek2 (llama-context.cpp and
    // models/deepseek2.cpp, [TAG_DEEPSEEK2_YARN_LOG_MUL_FIX]): the converter
    // writes 0.1 * mscale_all_dim as the log multiplier; the rope's own
    // attention factor is cancelled, and the mscale goes into the kq scale.
    let log_mul = g
        .opt_f32(&k("rope.scaling.yarn_log_multiplier"))?
        .map_or(0.0, |m| m / 0.1);
    let freq_scale = hp.rope.freq_scale;
    let mut attn_factor = 1.0f32;
    if hp.rope.ext_factor != 0.0 {
        let get_mscale = |scale: f32, m: f32| {
            if scale <= 1.0 {
                1.0
            } else {
                0.1 * m * scale.ln() + 1.0
            }
        };
        let factor = 1.0 / freq_scale;
        attn_factor = if log_mul != 0.0 {
            let mscale = if log_mul != 1.0 { log_mul } else { 1.0 };
            get_mscale(factor, mscale) / get_mscale(factor, log_mul)
        } else {
            get_mscale(factor, 1.0)
        };
        attn_factor *= 1.0 / (1.0 + 0.1 * factor.ln());
    }
    attn_factor *= g.opt_f32(&k("rope.scaling.attn_factor"))?.unwrap_or(1.0);
    hp.rope.attn_factor = attn_factor;
    let attn_factor_org = attn_factor * (1.0 + 0.1 * (1.0 / freq_scale).ln());
    let mscale = attn_factor_org * (1.0 + 0.1 * log_mul * (1.0 / freq_scale).ln());
    hp.attn_scale = mscale * mscale / (head_k as f32).sqrt();
    Ok(())
}

fn mla(hp: &Hparams) -> &MlaHparams {
    hp.mla
        .as_ref()
        .expect("deepseek2 hyper-parameters have MLA")
}

pub(crate) fn layer_tensors(hp: &Hparams, il: u32) -> Vec<TensorSpec> {
    let m = mla(hp);
    let (e, h) = (hp.n_embd, hp.n_head);
    let (nope, rope, v) = (
        m.n_embd_head_qk_nope,
        m.n_embd_head_qk_rope,
        m.n_embd_head_v,
    );
    let (q_lora, kv_lora) = (m.q_lora_rank, m.kv_lora_rank);
    let mut t = vec![req("attn_norm.weight", &[e])];
    if q_lora > 0 {
        t.extend([
            req("attn_q_a.weight", &[e, q_lora]),
            req("attn_q_a_norm.weight", &[q_lora]),
            req("attn_q_b.weight", &[q_lora, h * (nope + rope)]),
        ]);
    } else {
        t.push(req("attn_q.weight", &[e, h * (nope + rope)]));
    }
    t.extend([
        req("attn_kv_a_mqa.weight", &[e, kv_lora + rope]),
        req("attn_kv_a_norm.weight", &[kv_lora]),
    ]);
    if m.absorbed {
        // 3-D, one matrix per head: read by a batched mul_mat, never repacked.
        t.extend([
            req("attn_k_b.weight", &[nope, kv_lora, h]),
            req("attn_v_b.weight", &[kv_lora, v, h]),
        ]);
    } else {
        t.push(req("attn_kv_b.weight", &[kv_lora, h * (nope + v)]));
    }
    t.extend([
        req("attn_output.weight", &[h * v, e]),
        req("ffn_norm.weight", &[e]),
    ]);
    if il < m.n_layer_dense_lead {
        t.extend([
            req("ffn_gate.weight", &[e, hp.n_ff]),
            req("ffn_down.weight", &[hp.n_ff, e]),
            req("ffn_up.weight", &[e, hp.n_ff]),
        ]);
    } else {
        let moe = hp
            .moe
            .as_ref()
            .expect("deepseek2 with MoE blocks has experts");
        let (f, n) = (moe.n_ff_exp, moe.n_expert);
        let fs = f * m.n_expert_shared;
        t.extend([
            req("ffn_gate_inp.weight", &[e, n]),
            opt("exp_probs_b.bias", &[n]),
            req_exps("ffn_gate_exps.weight", &[e, f, n]),
            req_exps("ffn_down_exps.weight", &[f, e, n]),
            req_exps("ffn_up_exps.weight", &[e, f, n]),
            req("ffn_gate_shexp.weight", &[e, fs]),
            req("ffn_down_shexp.weight", &[fs, e]),
            req("ffn_up_shexp.weight", &[e, fs]),
        ]);
    }
    t
}

#[cfg(feature = "ggml")]
pub(crate) fn build_layer<'g>(cx: &mut LayerCx<'g, '_>, il: u32, x: Tensor<'g>) -> Tensor<'g> {
    let inp = moe_input(cx, il, x);
    if il < mla(cx.hp).n_layer_dense_lead {
        let out = cx.ffn_gated(il, inp.cur, Activation::Silu);
        return cx.g.add(out, inp.ffn_inp);
    }
    let moe = cx.hp.moe.as_ref().expect("validated at open");
    let w = cx.moe_weights(il);
    let routed = cx.moe_ffn(inp.cur, &w, moe, Activation::Silu);
    let shared = shared_experts(cx, il, inp.cur);
    super::layers::finish_moe(cx.g, routed, Some(shared), inp.ffn_inp)
}

/// The shared experts of a MoE block: one gated FFN every token goes through.
#[cfg(feature = "ggml")]
pub(crate) fn shared_experts<'g>(cx: &LayerCx<'g, '_>, il: u32, cur: Tensor<'g>) -> Tensor<'g> {
    cx.ffn_gated_named(
        il,
        cur,
        Activation::Silu,
        [
            "ffn_up_shexp.weight",
            "ffn_gate_shexp.weight",
            "ffn_down_shexp.weight",
        ],
    )
}

/// The block up to its FFN (dense or experts): attention, residual, FFN norm.
#[cfg(feature = "ggml")]
pub(crate) fn moe_input<'g>(cx: &mut LayerCx<'g, '_>, il: u32, x: Tensor<'g>) -> MoeInput<'g> {
    let (g, hp) = (cx.g, cx.hp);
    let m = mla(hp);
    let nt = cx.n_tokens;
    let n_head = hp.n_head as i64;
    let (nope, rope) = (m.n_embd_head_qk_nope as i64, m.n_embd_head_qk_rope as i64);
    let (kv_lora, v_dim) = (m.kv_lora_rank as i64, m.n_embd_head_v as i64);

    let cur = cx.rms_norm(x, cx.w(il, "attn_norm.weight"));
    let q = if m.q_lora_rank > 0 {
        let q = cx.mm(cx.w(il, "attn_q_a.weight"), cur);
        let q = cx.rms_norm(q, cx.w(il, "attn_q_a_norm.weight"));
        cx.mm(cx.w(il, "attn_q_b.weight"), q)
    } else {
        cx.mm(cx.w(il, "attn_q.weight"), cur)
    };
    let q = g.reshape(q, &[nope + rope, n_head, nt]);

    // The latent `[kv_lora_rank, n_tokens]` and the shared roped key part
    // `[rope, 1, n_tokens]`, both views of one projection.
    let kv_cmpr_pe = cx.mm(cx.w(il, "attn_kv_a_mqa.weight"), cur);
    let ty = kv_cmpr_pe.ty();
    let row = row_size(ty, kv_lora + rope);
    let kv_cmpr = g.view(kv_cmpr_pe, &[kv_lora, nt], &[row], 0);
    let k_pe = g.view(
        kv_cmpr_pe,
        &[rope, 1, nt],
        &[row, row],
        row_size(ty, kv_lora),
    );
    let k_pe = cx.rope(il, k_pe);
    let kv_cmpr = cx.rms_norm(kv_cmpr, cx.w(il, "attn_kv_a_norm.weight"));

    let attn = if m.absorbed {
        let qnb = q.nb();
        let q_nope = g.view(q, &[nope, n_head, nt], &[qnb[1], qnb[2]], 0);
        let q_pe = g.view(
            q,
            &[rope, n_head, nt],
            &[qnb[1], qnb[2]],
            row_size(q.ty(), nope),
        );
        let q_pe = cx.rope(il, q_pe);
        // Absorb attn_k_b: per head, [nope] -> [kv_lora_rank].
        let q_nope = g.permute(q_nope, [0, 2, 1, 3]); // [nope, n_tokens, n_head]
        let q_abs = g.mul_mat(cx.w(il, "attn_k_b.weight"), q_nope); // [kv_lora, n_tokens, n_head]
        let q_abs = g.permute(q_abs, [0, 2, 1, 3]); // [kv_lora, n_head, n_tokens]
        let q_cur = g.concat(q_abs, q_pe, 0); // [kv_lora + rope, n_head, n_tokens]
        let kv_cmpr = g.reshape(kv_cmpr, &[kv_lora, 1, nt]);
        let k_cur = g.concat(kv_cmpr, k_pe, 0); // [kv_lora + rope, 1, n_tokens]
        attention_absorbed(cx, il, q_cur, k_cur, kv_cmpr)
    } else {
        let kv = cx.mm(cx.w(il, "attn_kv_b.weight"), kv_cmpr); // [n_head * (nope + v), n_tokens]
        let kty = kv.ty();
        let row = row_size(kty, nope + v_dim);
        let k_nope = g.view(kv, &[nope, n_head, nt], &[row, row * n_head as usize], 0);
        let v_cur = g.view(
            kv,
            &[v_dim, n_head, nt],
            &[row, row * n_head as usize],
            row_size(kty, nope),
        );
        let v_cur = g.cont(v_cur);
        // Rope on the trailing `rope` dims of each query head only.
        let q_cur = g.rope_ext_at(q, cx.pos, &hp.rope_for_layer(il), nope as i32);
        let k_pe = g.repeat_4d(k_pe, [rope, n_head, nt, 1]);
        let k_cur = g.concat(k_nope, k_pe, 0); // [nope + rope, n_head, n_tokens]
        cx.attention(il, q_cur, k_cur, v_cur, hp.attn_scale)
    };
    let attn = cx.mm(cx.w(il, "attn_output.weight"), attn);
    let [attn, x] = cx.select_outputs([attn, x]);
    let ffn_inp = g.add(attn, x);

    let cur = cx.rms_norm(ffn_inp, cx.w(il, "ffn_norm.weight"));
    MoeInput { ffn_inp, cur }
}

/// llama.cpp's `build_attn` for a K-only cache with `v_mla`: stores the
/// token's latent row `k` (`[kv_lora + rope, 1, n_tokens]`), attends with
/// the absorbed queries over the cached rows, whose first `kv_lora_rank`
/// elements serve as the values (`v` gives that width), then decompresses
/// each head's output through `attn_v_b`. Returns `[n_head * v_dim, n_tokens]`.
#[cfg(feature = "ggml")]
fn attention_absorbed<'g>(
    cx: &mut LayerCx<'g, '_>,
    il: u32,
    q: Tensor<'g>,
    k: Tensor<'g>,
    v: Tensor<'g>,
) -> Tensor<'g> {
    let (g, hp) = (cx.g, cx.hp);
    let nt = cx.n_tokens;
    let k_width = hp.n_embd_k_gqa() as i64;
    cx.graph.expand(q);
    cx.graph.expand(v);
    cx.graph.expand(k);
    let kc = cx.kv.k(il);
    let k_rows = g.view(k, &[k_width, nt], &[k.nb()[2]], 0);
    let stored = g.set_rows(kc, k_rows, cx.kv_idx);
    cx.graph.expand(stored);

    let row = row_size(kc.ty(), k_width);
    let kview = g.view(kc, &[k_width, 1, cx.n_kv], &[row, row], 0);
    let vview = g.view(kview, &[v.ne()[0], 1, cx.n_kv], &[row, row], 0);
    let out = cx.attend(il, q, kview, vview, hp.attn_scale); // [kv_lora, n_head, n_tokens]

    let out = g.permute(out, [0, 2, 1, 3]); // [kv_lora, n_tokens, n_head]
    let out = g.mul_mat(cx.w(il, "attn_v_b.weight"), out); // [v_dim, n_tokens, n_head]
    let out = g.permute(out, [0, 2, 1, 3]);
    let out = g.cont(out);
    let [v_dim, n_head, ..] = out.ne();
    g.reshape(out, &[v_dim * n_head, nt])
}
