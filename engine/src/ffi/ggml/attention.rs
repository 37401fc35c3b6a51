//! Attention whose result for a token does not depend on what else is in
//! its step: ours, run by ggml's CPU backend as a custom op, for steps that
//! must be batch-invariant (`Batch::invariant`, `--deterministic`).
//!
//! ggml's own flash attention has three paths with different arithmetic,
//! chosen by the step's shape (one query row: V summed in F16, or split
//! over the threads once 512 cells are attended; 64 rows or more: tiled,
//! in F32), and it visits cells in the order they sit in the cache, which
//! depends on where other sequences' cells went. So one token's output
//! changes with the batch around it. This op computes each (token, head)
//! the same way every time:
//! - it visits exactly the cells the token sees, in position order (each
//!   token's list comes in the `order` input, built by
//!   `KvCache::order`), so neither other sequences nor the cell layout
//!   enter the sum;
//! - it accumulates in F32 (Q in F32, K and V widened from F16 exactly);
//! - it runs an online softmax over fixed chunks of [`CHUNK`] cells of
//!   that list and merges the chunks in order, so the arithmetic is the
//!   same whether the row is computed in a prefill or in a decode step, and
//!   a later split of one row over threads can keep it;
//! - one thread computes one (token, head) whole, so the thread count does
//!   not enter either.
//!
//! Written here rather than taken from ggml because no ggml path has these
//! properties; the dot products use AVX2/FMA/F16C where the CPU has them,
//! chosen at run time (never compiled for the building machine).

use super::{f16_to_f32, sys, Ctx, Tensor, TYPE_F32};
use std::ffi::{c_int, c_void};

/// Cells per chunk of the online softmax.
pub const CHUNK: usize = 256;

/// The layout of the `order` input: `[hi, lo, lo_swa]` per token (indices
/// into the cell list that follows the header: the token sees
/// `list[lo..hi]`, or `list[lo_swa..hi]` in a sliding-window layer), then
/// the cell list.
pub const ORDER_HEADER: usize = 3;

impl Ctx {
    /// Attention of `q` (`[dk, n_head, n_tokens]`, F32) over the F16 cache
    /// rows `k` (`[dk, n_head_kv, n_cells]`) and `v` (`[dv, n_head_kv,
    /// n_cells]`, may be a view into `k`), each token over the cells `order`
    /// lists for it (I32, see [`ORDER_HEADER`]); `swa` picks the sliding-window
    /// range. Returns `[dv, n_head, n_tokens]`, F32.
    pub fn attention_in_order<'a>(
        &'a self,
        q: Tensor<'_>,
        k: Tensor<'_>,
        v: Tensor<'_>,
        order: Tensor<'_>,
        scale: f32,
        swa: bool,
    ) -> Tensor<'a> {
        let [dk, n_head, n_tokens, _] = q.ne();
        let [dk_cache, n_head_kv, ..] = k.ne();
        let dv = v.ne()[0];
        assert!(
            dk == dk_cache && n_head_kv > 0 && n_head % n_head_kv == 0 && v.ne()[1] == n_head_kv,
            "attention shapes: q {:?}, k {:?}, v {:?}",
            q.ne(),
            k.ne(),
            v.ne()
        );
        assert_eq!(q.ty(), TYPE_F32, "attention wants F32 queries");
        assert!(
            k.ty() == super::TYPE_F16 && v.ty() == super::TYPE_F16,
            "attention reads an F16 cache"
        );
        let mut args = [
            q.raw.as_ptr(),
            k.raw.as_ptr(),
            v.raw.as_ptr(),
            order.raw.as_ptr(),
        ];
        let fun: sys::ggml_custom_op_t = Some(if swa { attend::<true> } else { attend::<false> });
        // The scale rides in the userdata pointer itself: nothing to keep
        // alive until the graph has run.
        let userdata = scale.to_bits() as usize as *mut c_void;
        // SAFETY: four valid source tensors; the callback reads them only
        // as the shapes checked above describe.
        self.wrap(unsafe {
            sys::ggml_custom_4d(
                self.raw.as_ptr(),
                TYPE_F32,
                dv,
                n_head,
                n_tokens,
                1,
                args.as_mut_ptr(),
                args.len() as c_int,
                fun,
                -1,
                userdata,
            )
        })
    }
}

/// The op's body, on every graph thread (`ith` of `nth`): thread `ith`
/// computes the (token, head) pairs `ith`, `ith + nth`, ...
///
/// # Safety
/// Called by ggml with a node built by [`Ctx::attention_in_order`].
unsafe extern "C" fn attend<const SWA: bool>(
    dst: *mut sys::ggml_tensor,
    ith: c_int,
    nth: c_int,
    userdata: *mut c_void,
) {
    let scale = f32::from_bits(userdata as usize as u32);
    // SAFETY: ggml passes the node, whose sources are the four tensors the
    // builder gave, all allocated by the time the node runs.
    let (dst, q, k, v, order) = unsafe {
        let d = &*dst;
        (d, &*d.src[0], &*d.src[1], &*d.src[2], &*d.src[3])
    };
    let dk = q.ne[0] as usize;
    let n_head = q.ne[1] as usize;
    let n_tokens = q.ne[2] as usize;
    let dv = v.ne[0] as usize;
    let group = n_head / k.ne[1] as usize;
    let kern = Kernels::get();
    let header = order.data as *const i32;
    // SAFETY: the header has ORDER_HEADER entries per token.
    let list = unsafe { header.add(ORDER_HEADER * n_tokens) };
    let mut acc = vec![0f32; dv];
    let mut part = vec![0f32; dv];
    let mut task = ith.max(0) as usize;
    while task < n_tokens * n_head {
        let (t, h) = (task / n_head, task % n_head);
        let hk = h / group;
        // SAFETY: in the header; values written by `KvCache::order`, which
        // keeps them inside the list.
        let (hi, lo) = unsafe {
            let at = header.add(ORDER_HEADER * t);
            (*at as usize, *at.add(if SWA { 2 } else { 1 }) as usize)
        };
        // SAFETY: row (h, t) of q, `dk` F32 values (q's rows are contiguous).
        let qrow = unsafe { (q.data as *const u8).add(h * q.nb[1] + t * q.nb[2]) as *const f32 };
        let (mut m_all, mut s_all) = (f32::NEG_INFINITY, 0f32);
        acc.fill(0.0);
        let mut from = lo;
        while from < hi {
            let to = (from + CHUNK).min(hi);
            let (mut m, mut s) = (f32::NEG_INFINITY, 0f32);
            part.fill(0.0);
            for i in from..to {
                // SAFETY: `i` < hi, inside the list; the cell is one of the
                // cache's rows, which `k` and `v` span.
                let (krow, vrow) = unsafe {
                    let c = *list.add(i) as usize;
                    (
                        (k.data as *const u8).add(hk * k.nb[1] + c * k.nb[2]) as *const u16,
                        (v.data as *const u8).add(hk * v.nb[1] + c * v.nb[2]) as *const u16,
                    )
                };
                // SAFETY: `dk` values in each row.
                let score = unsafe { (kern.dot)(qrow, krow, dk) } * scale;
                let w = if score > m {
                    let r = (m - score).exp();
                    // SAFETY: `part` holds dv values.
                    unsafe { (kern.scale)(part.as_mut_ptr(), r, dv) };
                    s *= r;
                    m = score;
                    1.0
                } else {
                    (score - m).exp()
                };
                // SAFETY: `dv` values in `part` and in the V row.
                unsafe { (kern.axpy)(part.as_mut_ptr(), w, vrow, dv) };
                s += w;
            }
            // Merge the chunk into the row's total.
            if m > m_all {
                let r = (m_all - m).exp();
                // SAFETY: `acc` holds dv values.
                unsafe { (kern.scale)(acc.as_mut_ptr(), r, dv) };
                for (a, p) in acc.iter_mut().zip(&part) {
                    *a += p;
                }
                s_all = s_all * r + s;
                m_all = m;
            } else {
                let r = (m - m_all).exp();
                for (a, p) in acc.iter_mut().zip(&part) {
                    *a += p * r;
                }
                s_all += s * r;
            }
            from = to;
        }
        let inv = if s_all > 0.0 { 1.0 / s_all } else { 0.0 };
        // SAFETY: dst is `[dv, n_head, n_tokens]`, contiguous F32.
        let out = unsafe {
            std::slice::from_raw_parts_mut(
                (dst.data as *mut u8).add(h * dst.nb[1] + t * dst.nb[2]) as *mut f32,
                dv,
            )
        };
        for (o, a) in out.iter_mut().zip(&acc) {
            *o = a * inv;
        }
        task += nth.max(1) as usize;
    }
}

/// The inner loops, chosen once per process for this CPU.
#[derive(Clone, Copy)]
struct Kernels {
    /// `Σ q[i]·k[i]` over `n` values, `k` in F16.
    dot: unsafe fn(*const f32, *const u16, usize) -> f32,
    /// `acc[i] += w·v[i]`, `v` in F16.
    axpy: unsafe fn(*mut f32, f32, *const u16, usize),
    /// `acc[i] *= r`.
    scale: unsafe fn(*mut f32, f32, usize),
}

impl Kernels {
    fn get() -> Kernels {
        static CHOSEN: std::sync::OnceLock<Kernels> = std::sync::OnceLock::new();
        *CHOSEN.get_or_init(|| {
            #[cfg(target_arch = "x86_64")]
            if std::is_x86_feature_detected!("avx2")
                && std::is_x86_feature_detected!("fma")
                && std::is_x86_feature_detected!("f16c")
            {
                return Kernels {
                    dot: x86::dot,
                    axpy: x86::axpy,
                    scale: x86::scale,
                };
            }
            Kernels {
                dot: plain::dot,
                axpy: plain::axpy,
                scale: plain::scale,
            }
        })
    }
}

/// Portable loops: one accumulator, in index order.
mod plain {
    use super::f16_to_f32;

    /// # Safety
    /// `q` and `k` point at `n` values each.
    pub(super) unsafe fn dot(q: *const f32, k: *const u16, n: usize) -> f32 {
        // SAFETY: the caller's contract.
        let (q, k) = unsafe {
            (
                std::slice::from_raw_parts(q, n),
                std::slice::from_raw_parts(k, n),
            )
        };
        q.iter().zip(k).map(|(&a, &b)| a * f16_to_f32(b)).sum()
    }

    /// # Safety
    /// `acc` and `v` point at `n` values each.
    pub(super) unsafe fn axpy(acc: *mut f32, w: f32, v: *const u16, n: usize) {
        // SAFETY: the caller's contract.
        let (acc, v) = unsafe {
            (
                std::slice::from_raw_parts_mut(acc, n),
                std::slice::from_raw_parts(v, n),
            )
        };
        for (a, &b) in acc.iter_mut().zip(v) {
            *a += w * f16_to_f32(b);
        }
    }

    /// # Safety
    /// `acc` points at `n` values.
    pub(super) unsafe fn scale(acc: *mut f32, r: f32, n: usize) {
        // SAFETY: the caller's contract.
        for a in unsafe { std::slice::from_raw_parts_mut(acc, n) } {
            *a *= r;
        }
    }
}

/// AVX2 + FMA + F16C loops, called only after the CPU was found to have
/// them. The order of every sum is fixed by the code: four 8-lane
/// accumulators over 32 values at a time, then 8 at a time into the
/// first, added in a fixed order, then the scalar tail.
#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::f16_to_f32;
    use std::arch::x86_64::*;

    /// # Safety
    /// `q` and `k` point at `n` values each; the CPU has AVX2, FMA and F16C.
    pub(super) unsafe fn dot(q: *const f32, k: *const u16, n: usize) -> f32 {
        // SAFETY: the caller's contract.
        unsafe { dot_impl(q, k, n) }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot_impl(q: *const f32, k: *const u16, n: usize) -> f32 {
        // SAFETY: every load reads inside the first `n` values.
        unsafe {
            let mut a = [_mm256_setzero_ps(); 4];
            let mut i = 0;
            while i + 32 <= n {
                for (j, acc) in a.iter_mut().enumerate() {
                    let kv = _mm256_cvtph_ps(_mm_loadu_si128(k.add(i + 8 * j) as *const __m128i));
                    *acc = _mm256_fmadd_ps(_mm256_loadu_ps(q.add(i + 8 * j)), kv, *acc);
                }
                i += 32;
            }
            while i + 8 <= n {
                let kv = _mm256_cvtph_ps(_mm_loadu_si128(k.add(i) as *const __m128i));
                a[0] = _mm256_fmadd_ps(_mm256_loadu_ps(q.add(i)), kv, a[0]);
                i += 8;
            }
            let sum = _mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3]));
            let half = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
            let quad = _mm_add_ps(half, _mm_movehl_ps(half, half));
            let one = _mm_add_ss(quad, _mm_shuffle_ps(quad, quad, 1));
            let mut total = _mm_cvtss_f32(one);
            while i < n {
                total += *q.add(i) * f16_to_f32(*k.add(i));
                i += 1;
            }
            total
        }
    }

    /// # Safety
    /// `acc` and `v` point at `n` values each; the CPU has AVX2, FMA and F16C.
    pub(super) unsafe fn axpy(acc: *mut f32, w: f32, v: *const u16, n: usize) {
        // SAFETY: the caller's contract.
        unsafe { axpy_impl(acc, w, v, n) }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn axpy_impl(acc: *mut f32, w: f32, v: *const u16, n: usize) {
        // SAFETY: every load and store is inside the first `n` values.
        unsafe {
            let wv = _mm256_set1_ps(w);
            let mut i = 0;
            while i + 8 <= n {
                let vv = _mm256_cvtph_ps(_mm_loadu_si128(v.add(i) as *const __m128i));
                let a = _mm256_loadu_ps(acc.add(i));
                _mm256_storeu_ps(acc.add(i), _mm256_fmadd_ps(wv, vv, a));
                i += 8;
            }
            while i < n {
                *acc.add(i) = w.mul_add(f16_to_f32(*v.add(i)), *acc.add(i));
                i += 1;
            }
        }
    }

    /// # Safety
    /// `acc` points at `n` values; the CPU has AVX2.
    pub(super) unsafe fn scale(acc: *mut f32, r: f32, n: usize) {
        // SAFETY: the caller's contract.
        unsafe { scale_impl(acc, r, n) }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn scale_impl(acc: *mut f32, r: f32, n: usize) {
        // SAFETY: every load and store is inside the first `n` values.
        unsafe {
            let rv = _mm256_set1_ps(r);
            let mut i = 0;
            while i + 8 <= n {
                _mm256_storeu_ps(acc.add(i), _mm256_mul_ps(rv, _mm256_loadu_ps(acc.add(i))));
                i += 8;
            }
            while i < n {
                *acc.add(i) *= r;
                i += 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_to_f32_is_exact_for_every_half() {
        for h in 0..=u16::MAX {
            let mine = f16_to_f32(h);
            let mut theirs = [0f32];
            // SAFETY: one value each.
            unsafe { sys::ggml_fp16_to_fp32_row(&h, theirs.as_mut_ptr(), 1) };
            if mine.is_nan() {
                assert!(theirs[0].is_nan(), "{h:#06x}");
            } else {
                assert_eq!(mine.to_bits(), theirs[0].to_bits(), "{h:#06x}");
            }
        }
    }

    /// Values in [-1, 1), the same for a seed (xorshift).
    fn uniform(seed: u64) -> impl FnMut() -> f32 {
        let mut state = seed;
        move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            ((state >> 11) as f64 / (1u64 << 53) as f64) as f32 * 2.0 - 1.0
        }
    }

    /// Two sequences whose cells are interleaved out of position order in
    /// a cache of 40 cells, GQA (4 query heads over 2), a window for one
    /// check: the op against a plain f64 softmax, and against ggml's flash
    /// attention with the equivalent mask.
    #[test]
    fn the_op_computes_attention_over_each_tokens_cells() {
        use super::super::{row_size, Buffer, CpuBackend, GraphAllocator, TensorStore, TYPE_F16};
        let (dk, dv, n_head, n_kv_head, n_cells) = (64usize, 48usize, 4usize, 2usize, 40usize);
        let mut next = uniform(99);
        // Cell c holds (seq, pos): seq 0 in even cells backwards, seq 1 in odd ones.
        let cell_of = |seq: usize, pos: usize| {
            if seq == 0 {
                2 * (19 - pos)
            } else {
                2 * pos + 1
            }
        };
        let mut kh = Vec::new();
        let mut vh = Vec::new();
        super::super::f32_to_f16(
            &(0..dk * n_kv_head * n_cells)
                .map(|_| next())
                .collect::<Vec<_>>(),
            &mut kh,
        );
        super::super::f32_to_f16(
            &(0..dv * n_kv_head * n_cells)
                .map(|_| next())
                .collect::<Vec<_>>(),
            &mut vh,
        );
        // Tokens: seq 0 at positions 17 and 19, seq 1 at 5.
        let tokens = [(0usize, 17usize), (1, 5), (0, 19)];
        let nt = tokens.len();
        let q: Vec<f32> = (0..dk * n_head * nt).map(|_| next()).collect();
        let scale = 0.125f32;
        for window in [None, Some(6usize)] {
            // Order lists as `KvCache::order` lays them out.
            let mut order = vec![0i32; ORDER_HEADER * nt];
            let mut starts = [0usize; 2];
            for (seq, start) in starts.iter_mut().enumerate() {
                *start = order.len() - ORDER_HEADER * nt;
                order.extend((0..20).map(|p| cell_of(seq, p) as i32));
            }
            let mut mask = vec![f32::NEG_INFINITY; n_cells * nt];
            for (t, &(seq, pos)) in tokens.iter().enumerate() {
                let lo = window.map_or(0, |w| (pos + 1).saturating_sub(w));
                order[ORDER_HEADER * t] = (starts[seq] + pos + 1) as i32;
                order[ORDER_HEADER * t + 1] = starts[seq] as i32;
                order[ORDER_HEADER * t + 2] = (starts[seq] + lo) as i32;
                for p in lo..=pos {
                    mask[t * n_cells + cell_of(seq, p)] = 0.0;
                }
            }
            let mut store = TensorStore::new(2);
            let ki = store.add(TYPE_F16, &[(dk * n_kv_head) as i64, n_cells as i64], "k");
            let vi = store.add(TYPE_F16, &[(dv * n_kv_head) as i64, n_cells as i64], "v");
            let backend = CpuBackend::new(2).unwrap();
            let _buf = Buffer::alloc_ctx(store.ctx(), backend.buffer_type()).unwrap();
            store.get(ki).write(&kh);
            store.get(vi).write(&vh);
            let ctx = Ctx::new(32, true);
            let qt = ctx.input(TYPE_F32, &[dk as i64, n_head as i64, nt as i64], "q");
            let ot = ctx.input(super::super::TYPE_I32, &[order.len() as i64], "order");
            let mt = ctx.input(TYPE_F16, &[n_cells as i64, nt as i64], "mask");
            let kview = ctx.view(
                store.get(ki),
                &[dk as i64, n_kv_head as i64, n_cells as i64],
                &[
                    row_size(TYPE_F16, dk as i64),
                    row_size(TYPE_F16, (dk * n_kv_head) as i64),
                ],
                0,
            );
            let vview = ctx.view(
                store.get(vi),
                &[dv as i64, n_kv_head as i64, n_cells as i64],
                &[
                    row_size(TYPE_F16, dv as i64),
                    row_size(TYPE_F16, (dv * n_kv_head) as i64),
                ],
                0,
            );
            let swa = window.is_some();
            let ours = ctx.attention_in_order(qt, kview, vview, ot, scale, swa);
            let theirs = ctx.flash_attn_ext(
                ctx.permute(qt, [0, 2, 1, 3]),
                ctx.permute(kview, [0, 2, 1, 3]),
                ctx.permute(vview, [0, 2, 1, 3]),
                mt,
                scale,
                0.0,
            );
            let mut graph = ctx.new_graph();
            graph.expand(ours);
            graph.expand(theirs);
            let mut alloc = GraphAllocator::new(backend.buffer_type());
            alloc.alloc(&graph).unwrap();
            qt.write(&q);
            ot.write(&order);
            let mut m16 = Vec::new();
            super::super::f32_to_f16(&mask, &mut m16);
            mt.write(&m16);
            let mut backend = backend;
            backend.compute(&graph).unwrap();
            let (mut a, mut b) = (Vec::new(), Vec::new());
            ours.read_f32(&mut a);
            theirs.read_f32(&mut b);
            for (t, &(seq, pos)) in tokens.iter().enumerate() {
                let lo = window.map_or(0, |w| (pos + 1).saturating_sub(w));
                for h in 0..n_head {
                    let hk = h / (n_head / n_kv_head);
                    let qrow = &q[(t * n_head + h) * dk..][..dk];
                    let scores: Vec<f64> = (lo..=pos)
                        .map(|p| {
                            let c = cell_of(seq, p);
                            (0..dk)
                                .map(|d| {
                                    qrow[d] as f64
                                        * f16_to_f32(kh[c * dk * n_kv_head + hk * dk + d]) as f64
                                })
                                .sum::<f64>()
                                * scale as f64
                        })
                        .collect();
                    let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let z: f64 = scores.iter().map(|s| (s - m).exp()).sum();
                    for d in 0..dv {
                        let want: f64 = (lo..=pos)
                            .zip(&scores)
                            .map(|(p, s)| {
                                let c = cell_of(seq, p);
                                (s - m).exp() / z
                                    * f16_to_f32(vh[c * dv * n_kv_head + hk * dv + d]) as f64
                            })
                            .sum();
                        let i = (t * n_head + h) * dv + d;
                        assert!(
                            (a[i] as f64 - want).abs() < 1e-5,
                            "{window:?} t{t} h{h} d{d}: {} vs {want}",
                            a[i]
                        );
                        assert!(
                            (b[i] as f64 - want).abs() < 5e-3,
                            "ggml {window:?} t{t} h{h} d{d}: {} vs {want}",
                            b[i]
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn the_kernels_agree_with_the_plain_loops() {
        let mut next = uniform(12345);
        let k = Kernels::get();
        for n in [1, 7, 8, 31, 32, 33, 64, 80, 100, 576] {
            let q: Vec<f32> = (0..n).map(|_| next()).collect();
            let mut kv16 = Vec::new();
            super::super::f32_to_f16(&(0..n).map(|_| next()).collect::<Vec<_>>(), &mut kv16);
            let reference: f64 = q
                .iter()
                .zip(&kv16)
                .map(|(&a, &b)| a as f64 * f16_to_f32(b) as f64)
                .sum();
            // SAFETY: n values each.
            let got = unsafe { (k.dot)(q.as_ptr(), kv16.as_ptr(), n) };
            assert!(
                (got as f64 - reference).abs() < 1e-5 * n as f64,
                "dot {n}: {got} vs {reference}"
            );
            let mut acc = q.clone();
            // SAFETY: n values each.
            unsafe { (k.axpy)(acc.as_mut_ptr(), 0.5, kv16.as_ptr(), n) };
            unsafe { (k.scale)(acc.as_mut_ptr(), 2.0, n) };
            for i in 0..n {
                let want = (q[i] as f64 + 0.5 * f16_to_f32(kv16[i]) as f64) * 2.0;
                assert!((acc[i] as f64 - want).abs() < 1e-6, "axpy/scale {n}[{i}]");
            }
        }
    }
}
