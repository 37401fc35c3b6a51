//! The routed experts' matmul on the CPU, ours: `mul_mat_id` of Q4_K and
//! Q6_K expert weights (what a Q4_K_M file's experts are) with AVX-512
//! VNNI, run by ggml's CPU backend as two custom ops.
//!
//! Written here rather than taken from ggml for what ggml's op cannot do:
//! read Q4_K experts where the file maps them (its fast Q4_K kernel wants
//! a repacked copy: for R1, hundreds of GB copied at every start), and
//! multiply a row by every token that chose its expert while the row is in
//! cache (its op reads the row once per token). ggml's kernels for these
//! types on x86 are AVX2 (`ggml_gemv_q4_K_8x8_q8_K`,
//! `ggml_vec_dot_q6_K_q8_K`); here one `vpdpbusd` multiplies 64 weights by
//! 64 activations. For one decode token memory binds both about alike
//! (docs/benchmarks.md).
//!
//! - `quantize` (one op per activation tensor, shared by the matmuls that
//!   read it) turns each F32 row into blocks of 256 `i8` exactly as ggml's
//!   `quantize_row_q8_K_ref` rounds them, laid out for the weight type (for
//!   Q4_K the 32-value sub-blocks reordered so a 64-byte load of weights
//!   meets its activations), with sums of 16 values for the min and offset
//!   terms;
//! - `matmul` splits each used expert's rows over the graph's threads and
//!   computes every (token, slot) that chose the expert against a row while
//!   the row is in cache, four tokens at a time.
//!
//! The same bits as ggml's op as llama.cpp runs it: the integer sums are
//! exact, and the floats are added in the order of the kernel llama.cpp
//! uses (per block, the row's two integer totals and one FMA each for the
//! repacked Q4_K gemv; eight integer lanes, one FMA each per block and
//! ggml's final sum for the Q6_K dot). A row's arithmetic does not depend
//! on what else is in the step, so neither does a token's result.
//! `OMNI_EXPERT_KERNEL=ggml` turns ours off (ggml's `mul_mat_id` on
//! repacked weights), for comparison.

use super::{sys, Ctx, RawType, Tensor, TYPE_F32};
use std::ffi::{c_int, c_void};

/// Values per block (ggml's `QK_K`).
const QK: usize = 256;
/// Bytes of one block of quantized activations: 256 `i8`, 16 `i16` sums of
/// 16 values (in the values' order), the `f32` scale, padding to 64.
const ACT_BLOCK: usize = 320;
const ACT_SUMS: usize = 256;
const ACT_D: usize = 288;
/// Bytes of ggml's `block_q4_K` and `block_q6_K`.
const Q4_K_BLOCK: usize = 144;
const Q6_K_BLOCK: usize = 210;

/// The weight types ours computes, each with its activation layout.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    Q4K = 1,
    Q6K = 2,
}

impl Kind {
    fn of(ty: RawType) -> Option<Kind> {
        match ty {
            sys::GGML_TYPE_Q4_K => Some(Kind::Q4K),
            sys::GGML_TYPE_Q6_K => Some(Kind::Q6K),
            _ => None,
        }
    }

    fn from_userdata(u: *mut c_void) -> Kind {
        if u as usize == Kind::Q4K as usize {
            Kind::Q4K
        } else {
            Kind::Q6K
        }
    }
}

/// Whether this CPU runs ours (AVX-512 F/BW/VL and VNNI), and it is not
/// turned off by `OMNI_EXPERT_KERNEL=ggml`.
pub fn available() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        if std::env::var("OMNI_EXPERT_KERNEL").is_ok_and(|v| v == "ggml") {
            return false;
        }
        #[cfg(target_arch = "x86_64")]
        {
            std::is_x86_feature_detected!("avx512f")
                && std::is_x86_feature_detected!("avx512bw")
                && std::is_x86_feature_detected!("avx512vl")
                && std::is_x86_feature_detected!("avx512vnni")
                && std::is_x86_feature_detected!("f16c")
                && std::is_x86_feature_detected!("fma")
        }
        #[cfg(not(target_arch = "x86_64"))]
        false
    })
}

/// Whether ours computes `mul_mat_id` of expert weights of type `ty` kept
/// as the file has them (so a loader need not repack them).
pub fn takes_type(ty: RawType) -> bool {
    available() && Kind::of(ty).is_some()
}

/// Whether ours computes `mul_mat_id` of this expert weight as it is
/// stored: a type it knows, rows of whole blocks, in host memory and not in
/// a repacked layout.
fn takes(w: Tensor<'_>) -> Option<Kind> {
    let kind = Kind::of(w.ty()).filter(|_| available())?;
    let raw = w.raw();
    // SAFETY: a valid tensor handle; `buffer` and `extra` are plain fields.
    let (buffer, extra) = unsafe { ((*raw).buffer, (*raw).extra) };
    // SAFETY: a non-null buffer of an allocated tensor.
    let host = !buffer.is_null() && unsafe { sys::ggml_backend_buffer_is_host(buffer) };
    (host && extra.is_null() && w.ne()[0] % QK as i64 == 0).then_some(kind)
}

impl Ctx {
    /// `mul_mat_id(w, b, ids)` for each of `ws` (see [`Ctx::mul_mat_id`]):
    /// in a graph that runs on the CPU (`on_cpu`), ours for the weights it
    /// takes, the activations quantized once for all of those of one type;
    /// ggml's for the rest. (A GPU stage's graph keeps ggml's op even on
    /// host weights: its scheduler streams them to the device for a big
    /// step, see `stage/local_experts.rs`.)
    pub fn expert_matmuls<'a, const N: usize>(
        &'a self,
        ws: [Tensor<'_>; N],
        b: Tensor<'_>,
        ids: Tensor<'_>,
        on_cpu: bool,
    ) -> [Tensor<'a>; N] {
        let mut quantized: Vec<(Kind, Tensor<'a>)> = Vec::new();
        ws.map(|w| match takes(w).filter(|_| on_cpu) {
            Some(kind) if b.ty() == TYPE_F32 && b.nb()[0] == 4 => {
                let q = match quantized.iter().find(|(k, _)| *k == kind) {
                    Some(&(_, q)) => q,
                    None => {
                        let q = self.quantize_for(b, kind);
                        quantized.push((kind, q));
                        q
                    }
                };
                self.matmul_q8(w, q, ids, kind)
            }
            _ => self.mul_mat_id(w, b, ids),
        })
    }

    /// `b` (`[k, n_b, n_tokens]`, F32) quantized for weights of `kind`:
    /// `[k / 256 * ACT_BLOCK, n_b, n_tokens]` bytes.
    fn quantize_for<'a>(&'a self, b: Tensor<'_>, kind: Kind) -> Tensor<'a> {
        let [k, n_b, n_tokens, _] = b.ne();
        let mut args = [b.raw()];
        // SAFETY: one valid source; the callback reads it as its shape says.
        self.wrap(unsafe {
            sys::ggml_custom_4d(
                self.raw(),
                sys::GGML_TYPE_I8,
                k / QK as i64 * ACT_BLOCK as i64,
                n_b,
                n_tokens,
                1,
                args.as_mut_ptr(),
                args.len() as c_int,
                Some(quantize),
                -1,
                kind as usize as *mut c_void,
            )
        })
    }

    fn matmul_q8<'a>(
        &'a self,
        w: Tensor<'_>,
        q: Tensor<'_>,
        ids: Tensor<'_>,
        kind: Kind,
    ) -> Tensor<'a> {
        let [k, n, ..] = w.ne();
        let [n_used, n_tokens, ..] = ids.ne();
        assert!(
            q.ne()[0] == k / QK as i64 * ACT_BLOCK as i64
                && q.ne()[2] == n_tokens
                && (q.ne()[1] == 1 || q.ne()[1] == n_used),
            "expert matmul shapes: w {:?}, activations {:?}, ids {:?}",
            w.ne(),
            q.ne(),
            ids.ne()
        );
        let mut args = [w.raw(), q.raw(), ids.raw()];
        // SAFETY: three valid sources, shapes checked above.
        self.wrap(unsafe {
            sys::ggml_custom_4d(
                self.raw(),
                TYPE_F32,
                n,
                n_used,
                n_tokens,
                1,
                args.as_mut_ptr(),
                args.len() as c_int,
                Some(matmul),
                -1,
                kind as usize as *mut c_void,
            )
        })
    }
}

/// The quantize op's body: thread `ith` of `nth` quantizes rows `ith`,
/// `ith + nth`, ...
///
/// # Safety
/// Called by ggml with a node built by [`Ctx::quantize_for`].
unsafe extern "C" fn quantize(
    dst: *mut sys::ggml_tensor,
    ith: c_int,
    nth: c_int,
    userdata: *mut c_void,
) {
    let kind = Kind::from_userdata(userdata);
    // SAFETY: the node and its one source, allocated by the time it runs.
    let (d, b) = unsafe { (&*dst, &*(*dst).src[0]) };
    let k = b.ne[0] as usize;
    let (n_b, n_tokens) = (b.ne[1] as usize, b.ne[2] as usize);
    let mut row = ith.max(0) as usize;
    while row < n_b * n_tokens {
        let (i, t) = (row % n_b, row / n_b);
        // SAFETY: row (i, t) of b holds k F32 values (nb[0] == 4, checked
        // by the builder); row (i, t) of dst holds k / 256 blocks.
        unsafe {
            let x = std::slice::from_raw_parts(
                (b.data as *const u8).add(i * b.nb[1] + t * b.nb[2]) as *const f32,
                k,
            );
            let out = std::slice::from_raw_parts_mut(
                (d.data as *mut u8).add(i * d.nb[1] + t * d.nb[2]),
                k / QK * ACT_BLOCK,
            );
            quantize_row(x, out, kind);
        }
        row += nth.max(1) as usize;
    }
}

/// One row of activations into blocks (see [`ACT_BLOCK`]), rounded as
/// ggml's `quantize_row_q8_K_ref` rounds.
fn quantize_row(x: &[f32], out: &mut [u8], kind: Kind) {
    for (x, blk) in x.chunks_exact(QK).zip(out.chunks_exact_mut(ACT_BLOCK)) {
        let (mut amax, mut max) = (0f32, 0f32);
        for &v in x {
            if v.abs() > amax {
                amax = v.abs();
                max = v;
            }
        }
        // The `i8` values' bits, as the block stores them.
        let mut q = [0u8; QK];
        let d = if amax == 0.0 {
            0.0
        } else {
            let iscale = -127.0 / max;
            for (q, &v) in q.iter_mut().zip(x) {
                *q = ((iscale * v).round_ties_even() as i32).min(127) as i8 as u8;
            }
            1.0 / iscale
        };
        for (g, s) in q.chunks_exact(16).enumerate() {
            let sum: i16 = s.iter().map(|&v| v as i8 as i16).sum();
            blk[ACT_SUMS + 2 * g..ACT_SUMS + 2 * g + 2].copy_from_slice(&sum.to_le_bytes());
        }
        blk[ACT_D..ACT_D + 4].copy_from_slice(&d.to_le_bytes());
        let qs = &mut blk[..QK];
        match kind {
            Kind::Q6K => qs.copy_from_slice(&q),
            // Per 128 values: sub-blocks 0, 2, 1, 3 of 32, the order a
            // 64-byte load of Q4_K nibbles (low: 0 and 2, high: 1 and 3)
            // meets them.
            Kind::Q4K => {
                for half in 0..2 {
                    for (slot, sub) in [0, 2, 1, 3].into_iter().enumerate() {
                        let from = half * 128 + sub * 32;
                        let to = half * 128 + slot * 32;
                        qs[to..to + 32].copy_from_slice(&q[from..from + 32]);
                    }
                }
            }
        }
    }
}

/// Tokens computed against one weight row at a time.
const TILE: usize = 4;

/// The matmul op's body: every used expert's rows split over the threads
/// (thread `ith` takes the `ith`-th share of each), each row against every
/// (slot, token) that chose the expert, [`TILE`] at a time.
///
/// # Safety
/// Called by ggml with a node built by [`Ctx::matmul_q8`].
unsafe extern "C" fn matmul(
    dst: *mut sys::ggml_tensor,
    ith: c_int,
    nth: c_int,
    userdata: *mut c_void,
) {
    let kind = Kind::from_userdata(userdata);
    // SAFETY: the node and its three sources, allocated by the time it runs.
    let (d, w, q, ids) = unsafe {
        let d = &*dst;
        (d, &*d.src[0], &*d.src[1], &*d.src[2])
    };
    let (n, n_expert) = (w.ne[1] as usize, w.ne[2] as usize);
    let nblk = w.ne[0] as usize / QK;
    let (n_used, n_tokens) = (ids.ne[0] as usize, ids.ne[1] as usize);
    let n_b = q.ne[1] as usize;
    let (ith, nth) = (ith.max(0) as usize, nth.max(1) as usize);
    let (r0, r1) = (n * ith / nth, n * (ith + 1) / nth);
    // Who chose which expert, grouped by expert.
    let mut pairs: Vec<(usize, usize, usize)> = Vec::with_capacity(n_used * n_tokens);
    for t in 0..n_tokens {
        for i in 0..n_used {
            // SAFETY: (i, t) is inside ids.
            let e = unsafe {
                *((ids.data as *const u8).add(i * ids.nb[0] + t * ids.nb[1]) as *const i32)
            };
            if (0..n_expert as i32).contains(&e) {
                pairs.push((e as usize, i, t));
            } else {
                // Never from a router; a zero row rather than a read out of bounds.
                for r in r0..r1 {
                    // SAFETY: (r, i, t) is inside dst.
                    unsafe { out_at(d, r, i, t).write(0.0) };
                }
            }
        }
    }
    pairs.sort_unstable_by_key(|p| p.0);
    for group in pairs.chunk_by(|a, b| a.0 == b.0) {
        // SAFETY: the expert is inside w (checked above).
        let matrix = unsafe { (w.data as *const u8).add(group[0].0 * w.nb[2]) };
        let acts: Vec<*const u8> = group
            .iter()
            // SAFETY: row (i % n_b, t) is inside q.
            .map(|&(_, i, t)| unsafe {
                (q.data as *const u8).add((i % n_b) * q.nb[1] + t * q.nb[2])
            })
            .collect();
        for r in r0..r1 {
            // SAFETY: row r of the expert's matrix holds nblk blocks of
            // `kind`; each activation row holds nblk blocks.
            let row = unsafe { matrix.add(r * w.nb[1]) };
            for (tile, who) in acts.chunks(TILE).zip(group.chunks(TILE)) {
                let mut dots = [0f32; TILE];
                // SAFETY: as above; this CPU has the features `available` asked.
                unsafe { x86::dots(kind, row, nblk, tile, &mut dots) };
                for (&(_, i, t), &v) in who.iter().zip(&dots) {
                    // SAFETY: (r, i, t) is inside dst.
                    unsafe { out_at(d, r, i, t).write(v) };
                }
            }
        }
    }
}

/// Where result (r, i, t) goes.
///
/// # Safety
/// (r, i, t) inside `d`, an F32 tensor.
unsafe fn out_at(d: &sys::ggml_tensor, r: usize, i: usize, t: usize) -> *mut f32 {
    // SAFETY: the caller's contract.
    unsafe { (d.data as *mut u8).add(r * d.nb[0] + i * d.nb[1] + t * d.nb[2]) as *mut f32 }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{Kind, ACT_BLOCK, ACT_D, ACT_SUMS, Q4_K_BLOCK, Q6_K_BLOCK, TILE};
    use std::arch::x86_64::*;

    /// Dot products of one weight row (`nblk` blocks of `kind`) with up to
    /// [`TILE`] activation rows, into `out`.
    ///
    /// # Safety
    /// The CPU has AVX-512 F/BW/VL, VNNI, F16C and FMA; `row` and each of
    /// `acts` hold `nblk` blocks.
    pub(super) unsafe fn dots(
        kind: Kind,
        row: *const u8,
        nblk: usize,
        acts: &[*const u8],
        out: &mut [f32; TILE],
    ) {
        macro_rules! tile {
            ($f:ident) => {
                // SAFETY: the caller's contract.
                unsafe {
                    match acts.len() {
                        1 => $f::<1>(row, nblk, acts, out),
                        2 => $f::<2>(row, nblk, acts, out),
                        3 => $f::<3>(row, nblk, acts, out),
                        _ => $f::<4>(row, nblk, acts, out),
                    }
                }
            };
        }
        match kind {
            Kind::Q4K => tile!(q4_k),
            Kind::Q6K => tile!(q6_k),
        }
    }

    /// ggml's `hsum_float_8`, in its order.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")]
    fn hsum256(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
    }

    /// The sum of `a`'s sixteen lanes in lane 0 and of `b`'s eight in lane 1.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")]
    fn totals(a: __m512i, b: __m256i) -> __m128i {
        let a = _mm256_add_epi32(_mm512_castsi512_si256(a), _mm512_extracti64x4_epi64(a, 1));
        let h = _mm256_hadd_epi32(a, b);
        let h = _mm256_hadd_epi32(h, h);
        _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1))
    }

    /// Lanes `[a; 8], [b; 8]` of a permutation index.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn halves(a: i32, b: i32) -> __m512i {
        _mm512_inserti64x4(_mm512_set1_epi32(a), _mm256_set1_epi32(b), 1)
    }

    /// Q4_K: `d·scale_j·q - dmin·min_j` per 32-value sub-block `j`.
    ///
    /// # Safety
    /// As [`dots`], with `acts.len() == M`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")]
    unsafe fn q4_k<const M: usize>(
        row: *const u8,
        nblk: usize,
        acts: &[*const u8],
        out: &mut [f32; TILE],
    ) {
        let nib = _mm512_set1_epi8(0x0F);
        // Which sub-block's scale each lane of a product takes (see the
        // activation layout in `quantize_row`).
        let (idx_l0, idx_h0) = (halves(0, 2), halves(1, 3));
        let (idx_l1, idx_h1) = (halves(4, 6), halves(5, 7));
        // Per token: lane 0 the scaled sums, lane 1 the mins' terms.
        let mut acc = [_mm_setzero_ps(); M];
        for b in 0..nblk {
            // SAFETY: block b of the row (the caller's contract).
            let (dm, sm, q0, q1) = unsafe {
                let blk = row.add(b * Q4_K_BLOCK);
                let dm = _mm_cvtph_ps(_mm_cvtsi32_si128((blk as *const i32).read_unaligned()));
                let s = blk.add(4);
                let u = [
                    (s as *const u32).read_unaligned(),
                    (s.add(4) as *const u32).read_unaligned(),
                    (s.add(8) as *const u32).read_unaligned(),
                ];
                // ggml's unpacking of the 6-bit scales and mins.
                let (k1, k2, k3) = (0x3f3f3f3fu32, 0x0f0f0f0fu32, 0x03030303u32);
                let scales = [u[0] & k1, (u[2] & k2) | (((u[0] >> 6) & k3) << 4)];
                let mins = [u[1] & k1, ((u[2] >> 4) & k2) | (((u[1] >> 6) & k3) << 4)];
                let sm = _mm_setr_epi32(
                    scales[0] as i32,
                    scales[1] as i32,
                    mins[0] as i32,
                    mins[1] as i32,
                );
                (
                    dm,
                    sm,
                    _mm512_loadu_si512(blk.add(16) as *const _),
                    _mm512_loadu_si512(blk.add(80) as *const _),
                )
            };
            let sc = _mm512_cvtepu8_epi32(sm);
            let (s_l0, s_h0) = (
                _mm512_permutexvar_epi32(idx_l0, sc),
                _mm512_permutexvar_epi32(idx_h0, sc),
            );
            let (s_l1, s_h1) = (
                _mm512_permutexvar_epi32(idx_l1, sc),
                _mm512_permutexvar_epi32(idx_h1, sc),
            );
            // Each min twice: the sums come per 16 values.
            let mins = _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(sm, sm));
            let l0 = _mm512_and_si512(q0, nib);
            let h0 = _mm512_and_si512(_mm512_srli_epi16(q0, 4), nib);
            let l1 = _mm512_and_si512(q1, nib);
            let h1 = _mm512_and_si512(_mm512_srli_epi16(q1, 4), nib);
            let zero = _mm512_setzero_si512();
            for m in 0..M {
                // SAFETY: block b of activation row m (the caller's contract).
                unsafe {
                    let y = acts[m].add(b * ACT_BLOCK);
                    let p0 = _mm512_dpbusd_epi32(zero, l0, _mm512_loadu_si512(y as *const _));
                    let p1 =
                        _mm512_dpbusd_epi32(zero, h0, _mm512_loadu_si512(y.add(64) as *const _));
                    let p2 =
                        _mm512_dpbusd_epi32(zero, l1, _mm512_loadu_si512(y.add(128) as *const _));
                    let p3 =
                        _mm512_dpbusd_epi32(zero, h1, _mm512_loadu_si512(y.add(192) as *const _));
                    let isum = _mm512_add_epi32(
                        _mm512_add_epi32(
                            _mm512_mullo_epi32(p0, s_l0),
                            _mm512_mullo_epi32(p1, s_h0),
                        ),
                        _mm512_add_epi32(
                            _mm512_mullo_epi32(p2, s_l1),
                            _mm512_mullo_epi32(p3, s_h1),
                        ),
                    );
                    let dy = (y.add(ACT_D) as *const f32).read_unaligned();
                    let min_terms =
                        _mm256_madd_epi16(mins, _mm256_loadu_si256(y.add(ACT_SUMS) as *const _));
                    // The block's two integer totals, exact, then one FMA
                    // each: ggml's gemv (`ggml_gemv_q4_K_8x8_q8_K`) order.
                    let totals = totals(isum, min_terms);
                    acc[m] = _mm_fmadd_ps(
                        _mm_cvtepi32_ps(totals),
                        _mm_mul_ps(dm, _mm_set1_ps(dy)),
                        acc[m],
                    );
                }
            }
        }
        for m in 0..M {
            out[m] = _mm_cvtss_f32(acc[m]) - _mm_cvtss_f32(_mm_movehdup_ps(acc[m]));
        }
    }

    /// Q6_K: `d·scale_g·(q - 32)` per 16-value group `g`, `q` six bits from
    /// four low (`ql`) and two high (`qh`).
    ///
    /// # Safety
    /// As [`dots`], with `acts.len() == M`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")]
    unsafe fn q6_k<const M: usize>(
        row: *const u8,
        nblk: usize,
        acts: &[*const u8],
        out: &mut [f32; TILE],
    ) {
        let nib = _mm512_set1_epi8(0x0F);
        let bits45 = _mm512_set1_epi8(0x30);
        // The two high bits of each value, moved to bits 4-5: per 128
        // values, the low nibbles take qh's bits 0-1 (first 32 bytes) and
        // 2-3 (next 32), the high nibbles bits 4-5 and 6-7.
        let shl_lo = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
        let shr_hi = _mm512_inserti64x4(_mm512_set1_epi16(0), _mm256_set1_epi16(2), 1);
        let quad = |k: i32| {
            _mm512_setr_epi32(
                k,
                k,
                k,
                k,
                k + 1,
                k + 1,
                k + 1,
                k + 1,
                k + 2,
                k + 2,
                k + 2,
                k + 2,
                k + 3,
                k + 3,
                k + 3,
                k + 3,
            )
        };
        let idx = [quad(0), quad(4), quad(8), quad(12)];
        let mut acc = [_mm256_setzero_ps(); M];
        for b in 0..nblk {
            // SAFETY: block b of the row (the caller's contract).
            let (qv, sc8, d) = unsafe {
                let blk = row.add(b * Q6_K_BLOCK);
                let mut qv = [_mm512_setzero_si512(); 4];
                for half in 0..2 {
                    let ql = _mm512_loadu_si512(blk.add(64 * half) as *const _);
                    let qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(
                        blk.add(128 + 32 * half) as *const _
                    ));
                    qv[2 * half] = _mm512_or_si512(
                        _mm512_and_si512(ql, nib),
                        _mm512_and_si512(_mm512_sllv_epi16(qh, shl_lo), bits45),
                    );
                    qv[2 * half + 1] = _mm512_or_si512(
                        _mm512_and_si512(_mm512_srli_epi16(ql, 4), nib),
                        _mm512_and_si512(_mm512_srlv_epi16(qh, shr_hi), bits45),
                    );
                }
                let sc8 = _mm_loadu_si128(blk.add(192) as *const _);
                let d = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(
                    (blk.add(208) as *const u16).read_unaligned() as i32,
                )));
                (qv, sc8, d)
            };
            let sc = _mm512_cvtepi8_epi32(sc8);
            let s = [
                _mm512_permutexvar_epi32(idx[0], sc),
                _mm512_permutexvar_epi32(idx[1], sc),
                _mm512_permutexvar_epi32(idx[2], sc),
                _mm512_permutexvar_epi32(idx[3], sc),
            ];
            let sc16 = _mm256_cvtepi8_epi16(sc8);
            let zero = _mm512_setzero_si512();
            for m in 0..M {
                // SAFETY: block b of activation row m (the caller's contract).
                unsafe {
                    let y = acts[m].add(b * ACT_BLOCK);
                    let mut isum = zero;
                    for j in 0..4 {
                        let p = _mm512_dpbusd_epi32(
                            zero,
                            qv[j],
                            _mm512_loadu_si512(y.add(64 * j) as *const _),
                        );
                        isum = _mm512_add_epi32(isum, _mm512_mullo_epi32(p, s[j]));
                    }
                    let dy = (y.add(ACT_D) as *const f32).read_unaligned();
                    // ggml's `ggml_vec_dot_q6_K_q8_K` (AVX2) order: eight
                    // exact integer lanes (lane l: bytes 4l..4l+4 of each
                    // 32-byte run, less 32 times groups 2l and 2l+1), one
                    // FMA each per block, summed at the end.
                    let sumi = _mm256_add_epi32(
                        _mm512_castsi512_si256(isum),
                        _mm512_extracti64x4_epi64(isum, 1),
                    );
                    let off = _mm256_slli_epi32(
                        _mm256_madd_epi16(_mm256_loadu_si256(y.add(ACT_SUMS) as *const _), sc16),
                        5,
                    );
                    acc[m] = _mm256_fmadd_ps(
                        _mm256_set1_ps(dy * d),
                        _mm256_cvtepi32_ps(_mm256_sub_epi32(sumi, off)),
                        acc[m],
                    );
                }
            }
        }
        for m in 0..M {
            out[m] = hsum256(acc[m]);
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
mod x86 {
    use super::{Kind, TILE};
    /// Never called: [`super::available`] is false off x86-64.
    pub(super) unsafe fn dots(
        _: Kind,
        _: *const u8,
        _: usize,
        _: &[*const u8],
        _: &mut [f32; TILE],
    ) {
        unreachable!("the expert kernel runs only on x86-64")
    }
}

#[cfg(test)]
mod tests {
    use super::super::backend::{Buffer, CpuBackend, GraphAllocator, TensorStore};
    use super::super::{row_size, TYPE_I32};
    use super::*;
    use std::ptr;

    /// A small random generator (xorshift), so the test needs no crate.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn f32(&mut self) -> f32 {
            (self.next() % 20001) as f32 / 10000.0 - 1.0
        }
    }

    /// Random experts `[k, n, n_expert]` quantized to `ty` by ggml.
    fn experts(ty: RawType, [k, n, n_expert]: [usize; 3], rng: &mut Rng) -> Vec<u8> {
        let w: Vec<f32> = (0..k * n * n_expert).map(|_| rng.f32()).collect();
        let mut q = vec![0u8; row_size(ty, k as i64) * n * n_expert];
        // SAFETY: `w` has that many rows of k floats; `q` is sized by ggml.
        unsafe {
            sys::ggml_quantize_chunk(
                ty,
                w.as_ptr(),
                q.as_mut_ptr() as *mut c_void,
                0,
                (n * n_expert) as i64,
                k as i64,
                ptr::null(),
            )
        };
        q
    }

    /// An expert tensor `[k, n, n_expert]` of `ty` (index 0 of the store)
    /// in a buffer: for ggml's op, the layout llama.cpp's loader gives it
    /// (Q4_K repacked where the CPU has the kernels, Q6_K as it is); for
    /// ours, plain host memory as a file's map is.
    fn weights(
        backend: &CpuBackend,
        ty: RawType,
        [k, n, n_expert]: [usize; 3],
        n_used: usize,
        ours: bool,
    ) -> (TensorStore, Buffer) {
        let mut store = TensorStore::new(1);
        let wi = store.add(ty, &[k as i64, n as i64, n_expert as i64], "w");
        let read = super::super::WeightRead::MulMatId(n_used as i64);
        let repacked = (!ours)
            .then(|| super::super::cpu_extra_buffer_types().unwrap())
            .into_iter()
            .flatten()
            .find(|&b| super::super::buft_supports(b, store.get(wi), read));
        assert!(
            ours || ty != sys::GGML_TYPE_Q4_K || repacked.is_some(),
            "a CPU with AVX-512 repacks Q4_K experts"
        );
        let buf =
            Buffer::alloc_ctx(store.ctx(), repacked.unwrap_or(backend.buffer_type())).unwrap();
        (store, buf)
    }

    /// `mul_mat_id` of an expert tensor of `ty` (`[k, n, n_expert]`, the
    /// bytes `q`, else filler) by activations `[k, n_b, n_tokens]` under
    /// ids (`n_used` a token), ours or ggml's op, on two threads: `go` gets
    /// a function that runs it on given activations and ids and returns
    /// the result and the time the graph took.
    fn with_op<R>(
        (ty, dims, q): (RawType, [usize; 3], Option<&[u8]>),
        [n_b, n_tokens, n_used]: [usize; 3],
        ours: bool,
        go: impl FnOnce(&mut dyn FnMut(&[f32], &[i32]) -> (Vec<f32>, f64)) -> R,
    ) -> R {
        let mut backend = CpuBackend::new(2).unwrap();
        let (store, buf) = weights(&backend, ty, dims, n_used, ours);
        match q {
            Some(q) => store.get(0).write_bytes(q),
            None => buf.clear(0x11),
        }
        let ctx = Ctx::new(16, true);
        let k = dims[0] as i64;
        let bt = ctx.input(TYPE_F32, &[k, n_b as i64, n_tokens as i64], "b");
        let it = ctx.input(TYPE_I32, &[n_used as i64, n_tokens as i64], "ids");
        let [y] = if ours {
            ctx.expert_matmuls([store.get(0)], bt, it, true)
        } else {
            [ctx.mul_mat_id(store.get(0), bt, it)]
        };
        let mut graph = ctx.new_graph();
        graph.expand(y);
        let mut alloc = GraphAllocator::new(backend.buffer_type());
        alloc.alloc(&graph).unwrap();
        go(&mut |b: &[f32], ids: &[i32]| {
            bt.write(b);
            it.write(ids);
            let t = std::time::Instant::now();
            backend.compute(&graph).unwrap();
            let took = t.elapsed().as_secs_f64();
            let mut out = Vec::new();
            y.read_f32(&mut out);
            (out, took)
        })
    }

    /// [`with_op`] run once.
    fn run(
        ty: RawType,
        dims: [usize; 3],
        q: &[u8],
        (b, n_b): (&[f32], usize),
        (ids, n_used): (&[i32], usize),
        ours: bool,
    ) -> Vec<f32> {
        let n_tokens = ids.len() / n_used;
        with_op((ty, dims, Some(q)), [n_b, n_tokens, n_used], ours, |op| {
            op(b, ids).0
        })
    }

    /// Ours gives ggml's `mul_mat_id` bit for bit for both types (Q4_K
    /// repacked, as llama.cpp runs it), with broadcast or per-slot
    /// activations and an expert serving more tokens than a tile; and a
    /// token's results are the same bits alone as in its batch.
    #[test]
    fn ours_matches_ggml_and_does_not_depend_on_the_batch() {
        if !available() {
            eprintln!("this CPU lacks AVX-512 VNNI: ggml's mul_mat_id runs instead of ours");
            return;
        }
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        let (k, n, n_expert, n_used, n_tokens) = (512, 40, 4, 2, 9);
        // Each token's two experts, distinct; nine tokens over four experts.
        let ids: Vec<i32> = (0..n_tokens)
            .flat_map(|t| {
                let a = (t % 4) as i32;
                [a, (a + 1 + (t as i32 / 4) % 3) % 4]
            })
            .collect();
        for ty in [sys::GGML_TYPE_Q4_K, sys::GGML_TYPE_Q6_K] {
            let dims = [k, n, n_expert];
            let q = experts(ty, dims, &mut rng);
            for n_b in [1, n_used] {
                let b: Vec<f32> = (0..k * n_b * n_tokens).map(|_| rng.f32() * 3.0).collect();
                let theirs = run(ty, dims, &q, (&b, n_b), (&ids, n_used), false);
                let ours = run(ty, dims, &q, (&b, n_b), (&ids, n_used), true);
                assert_eq!(ours.len(), n * n_used * n_tokens);
                let scale = theirs.iter().fold(0f32, |m, v| m.max(v.abs()));
                assert!(
                    scale > 1.0,
                    "type {ty}: results too small to compare ({scale})"
                );
                let differ = theirs
                    .iter()
                    .zip(&ours)
                    .filter(|(a, b)| a.to_bits() != b.to_bits());
                let worst = differ.clone().fold(0f32, |m, (a, b)| m.max((a - b).abs()));
                assert_eq!(
                    differ.count(),
                    0,
                    "type {ty}, n_b {n_b}: ours differs from ggml's by up to {worst}"
                );
                let t = 7;
                let alone = run(
                    ty,
                    dims,
                    &q,
                    (&b[t * k * n_b..(t + 1) * k * n_b], n_b),
                    (&ids[t * n_used..(t + 1) * n_used], n_used),
                    true,
                );
                assert_eq!(
                    alone,
                    ours[t * n * n_used..(t + 1) * n * n_used],
                    "type {ty}, n_b {n_b}: token {t} alone differs from its row in the batch"
                );
            }
        }
    }

    /// Ours beside ggml's op as llama.cpp runs it, on one decode token's
    /// experts at R1's shape (8 of 16 experts of 2048 x 7168; `ROWS=n` for
    /// fewer rows, in cache), two threads: `cargo test --release -p
    /// omni-engine --lib expert_speed -- --ignored --nocapture`.
    #[test]
    #[ignore = "a benchmark: prints figures"]
    fn expert_speed() {
        let n = std::env::var("ROWS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(2048);
        let (k, n_expert, n_used) = (7168, 16, 8);
        for ty in [sys::GGML_TYPE_Q4_K, sys::GGML_TYPE_Q6_K] {
            // Each op timed in turns, five rounds of 21 runs: the VM's
            // noise falls on both alike.
            let mut rates = [Vec::new(), Vec::new()];
            for _ in 0..5 {
                for (o, ours) in [false, true].into_iter().enumerate() {
                    let dims = [k, n, n_expert];
                    with_op((ty, dims, None), [1, 1, n_used], ours, |op| {
                        let bytes = (row_size(ty, k as i64) * n * n_used) as f64;
                        for r in 0..21 {
                            let ids: Vec<i32> =
                                (0..n_used as i32).map(|i| (i * 2 + r) % 16).collect();
                            let (_, took) = op(&vec![0.3f32; k], &ids);
                            rates[o].push(bytes / took / 1e9);
                        }
                    });
                }
            }
            let median = |v: &mut Vec<f64>| {
                v.sort_by(f64::total_cmp);
                v[v.len() / 2]
            };
            let (theirs, ours) = (median(&mut rates[0]), median(&mut rates[1]));
            let line = format!(
                "{n} rows of type {ty}: ggml {theirs:.1} GB/s, ours {ours:.1} GB/s ({:.2}x)",
                ours / theirs
            );
            println!("{line}");
        }
    }
}
