//! The routed experts' matmul on the CPU, ours: `mul_mat_id` of Q4_K and
//! Q6_K expert weights (what a Q4_K_M file's experts are) with AVX-512
//! VNNI, run by ggml's CPU backend as custom ops; and, in a CPU stage's
//! decoding steps, its own Q6_K and (repacked) Q4_K matrices
//! ([`Ctx::matmul`]), for the speed of the prefetch below.
//!
//! Written here rather than taken from ggml for what ggml's op cannot do:
//! read Q4_K experts where the file maps them (its fast Q4_K kernel wants
//! a repacked copy: for R1, hundreds of GB copied at every start), and
//! multiply a row by every token that chose its expert while the row is in
//! cache (its op reads the row once per token). ggml's kernels for these
//! types on x86 are AVX2 (`ggml_gemv_q4_K_8x8_q8_K`,
//! `ggml_vec_dot_q6_K_q8_K`); here `vpmaddubsw` multiplies 64 weights by
//! 64 activations and `vpdpwssd` adds each pair, times its scale, into
//! 32-bit sums, and each row is prefetched a row ahead ([`x86::AHEAD`]):
//! for one decode token ours reads its experts 1.4-1.6x as fast as ggml's
//! on an Emerald Rapids VM, where both had been bound alike by what one
//! core's hardware prefetcher fetched (docs/benchmarks.md).
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
/// Bytes of ggml's `block_q4_Kx8`: a block of eight rows of a Q4_K matrix
/// that its loader repacked for its AVX2 kernels.
const Q4_KX8_BLOCK: usize = 1152;
/// Tokens a step has at most for ours on a repacked Q4_K matrix: from 4,
/// ggml runs its repacked gemm, which ours does not follow.
const X8_TOKENS: usize = 3;

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

    /// The kind as an op's user data (read back by [`Kind::from_userdata`]).
    fn userdata(self) -> *mut c_void {
        self as usize as *mut c_void
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

/// Whether ggml's CPU backend computes a K-quant matmul of `rows` rows
/// (a matrix's activation rows, or the rows routed to one expert) on a
/// matrix in the file's layout with its tiled kernel (`ggml-cpu/tiled`:
/// from 8 rows, unless `GGML_CPU_TILED_MM=0`; at any size with
/// `GGML_CPU_TILED_MM_FORCE=1`), whose sums run in another order than the
/// dot product ours follows. Below it ggml takes one row and token at a
/// time (`ggml_vec_dot_q6_K_q8_K`), and so does ours.
fn ggml_tiles(rows: i64) -> bool {
    static ENV: std::sync::OnceLock<(bool, bool)> = std::sync::OnceLock::new();
    let (enabled, forced) = *ENV.get_or_init(|| {
        let flag = |name: &str| std::env::var(name).ok().map(|v| v.trim().parse::<i64>());
        (
            !matches!(flag("GGML_CPU_TILED_MM"), Some(Ok(0))),
            matches!(flag("GGML_CPU_TILED_MM_FORCE"), Some(Ok(1))),
        )
    });
    enabled && (rows >= 8 || forced)
}

/// Whether ours gives ggml's bits for weights of `kind` in a step of
/// `n_tokens` tokens: a Q4_K matrix is repacked by llama.cpp's loader and
/// multiplied by ggml's repacked gemv one token at a time in every
/// `mul_mat_id`, which ours follows; a Q6_K matrix stays as the file has it
/// and ggml tiles it from some step size on ([`ggml_tiles`]; no expert
/// gets more rows than the step has tokens).
fn same_bits(kind: Kind, n_tokens: i64) -> bool {
    kind == Kind::Q4K || !ggml_tiles(n_tokens)
}

/// Whether ours computes `mul_mat_id` of expert weights of type `ty` kept
/// as the file has them (so a loader need not repack them).
pub fn takes_type(ty: RawType) -> bool {
    available() && Kind::of(ty).is_some()
}

/// Whether `w` is a Q4_K matrix that ggml's CPU loader repacked into
/// `block_q4_Kx8` (its `CPU_REPACK` buffer; on x86 the only layout it
/// repacks Q4_K into), on a CPU that runs ours.
fn repacked_q4k(w: Tensor<'_>) -> bool {
    if w.ty() != sys::GGML_TYPE_Q4_K || !available() {
        return false;
    }
    let raw = w.raw();
    // SAFETY: a valid tensor handle; `buffer` and `extra` are plain fields.
    let (buffer, extra) = unsafe { ((*raw).buffer, (*raw).extra) };
    if buffer.is_null() || extra.is_null() {
        return false;
    }
    // SAFETY: a non-null buffer of an allocated tensor; its type's name is
    // a static C string.
    let name = unsafe {
        std::ffi::CStr::from_ptr(sys::ggml_backend_buft_name(
            sys::ggml_backend_buffer_get_type(buffer),
        ))
    };
    let [k, n, n_mat, _] = w.ne();
    name.to_bytes() == b"CPU_REPACK" && k % QK as i64 == 0 && n % 8 == 0 && n_mat == 1
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
        let n_tokens = ids.ne()[1];
        ws.map(
            |w| match takes(w).filter(|&k| on_cpu && same_bits(k, n_tokens)) {
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
            },
        )
    }

    /// `mul_mat(w, x)` of a matrix `w` (`[k, n]`) and activations `x`
    /// (`[k, n_tokens]`, F32), ours where it gives ggml's bits, in a graph
    /// that runs on the CPU (`on_cpu`) and a step of a few tokens
    /// (decoding): a Q4_K matrix in ggml's repacked layout (most of a
    /// Q4_K_M file's attention and dense layers) below four tokens, where
    /// ggml runs its repacked gemv and not yet its gemm; a Q6_K matrix as
    /// the file has it (the head: R1's 0.76 GB a token) in a step ggml
    /// would not tile ([`ggml_tiles`]). Ours reads a decoding token's rows
    /// faster for the same reason as an expert's: a prefetch ahead.
    pub fn matmul<'a>(&'a self, w: Tensor<'_>, x: Tensor<'_>, on_cpu: bool) -> Tensor<'a> {
        let [k, n, n_mat, _] = w.ne();
        let [_, n_tokens, rest @ ..] = x.ne();
        // Ours reshapes `x`, so it takes only contiguous rows.
        let plain = x.ty() == TYPE_F32
            && x.nb()[0] == 4
            && x.nb()[1] == 4 * k as usize
            && rest == [1, 1]
            && n_mat == 1;
        let x8 = n_tokens <= X8_TOKENS as i64 && repacked_q4k(w);
        let q6 = takes(w) == Some(Kind::Q6K) && same_bits(Kind::Q6K, n_tokens);
        if !(on_cpu && plain && (x8 || q6)) {
            return self.mul_mat(w, x);
        }
        // Both read the activations in the values' order: the Q6_K layout.
        let q = self.quantize_for(self.reshape(x, &[k, 1, n_tokens]), Kind::Q6K);
        if x8 {
            // The matrix goes as the op's user data, not as a source: ggml's
            // scheduler gives a node with a source in a repacked buffer only
            // to that buffer's own ops (matmuls), and would place this one
            // nowhere. A weight outlives every graph that reads it.
            // SAFETY: a matrix in ggml's repacked layout (checked above) that
            // outlives the graph; `matmul_x8` reads it and its one source as
            // their shapes say.
            unsafe {
                self.custom(
                    TYPE_F32,
                    [n, n_tokens, 1],
                    &[q],
                    matmul_x8,
                    w.raw() as *mut c_void,
                )
            }
        } else {
            // SAFETY: `matmul` reads its two sources as their shapes say
            // (no ids: every token against the one matrix).
            let y = unsafe {
                self.custom(
                    TYPE_F32,
                    [n, 1, n_tokens],
                    &[w, q],
                    matmul,
                    Kind::Q6K.userdata(),
                )
            };
            self.reshape(y, &[n, n_tokens])
        }
    }

    /// `b` (`[k, n_b, n_tokens]`, F32) quantized for weights of `kind`:
    /// `[k / 256 * ACT_BLOCK, n_b, n_tokens]` bytes.
    fn quantize_for<'a>(&'a self, b: Tensor<'_>, kind: Kind) -> Tensor<'a> {
        let [k, n_b, n_tokens, _] = b.ne();
        // SAFETY: `quantize` reads its one source as its shape says.
        unsafe {
            self.custom(
                sys::GGML_TYPE_I8,
                [k / QK as i64 * ACT_BLOCK as i64, n_b, n_tokens],
                &[b],
                quantize,
                kind.userdata(),
            )
        }
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
        // SAFETY: `matmul` reads its three sources as their shapes say
        // (checked above).
        unsafe {
            self.custom(
                TYPE_F32,
                [n, n_used, n_tokens],
                &[w, q, ids],
                matmul,
                kind.userdata(),
            )
        }
    }

    /// A node of `ty` and shape `ne` computed by `op` (on all the graph's
    /// threads) from `srcs`, with `userdata` passed to it.
    ///
    /// # Safety
    /// `op` must read its sources and `userdata`, and write the node, only
    /// as their shapes and types say, and `userdata` must outlive the graph.
    unsafe fn custom<'a>(
        &'a self,
        ty: RawType,
        ne: [i64; 3],
        srcs: &[Tensor<'_>],
        op: unsafe extern "C" fn(*mut sys::ggml_tensor, c_int, c_int, *mut c_void),
        userdata: *mut c_void,
    ) -> Tensor<'a> {
        let mut args: Vec<_> = srcs.iter().map(|t| t.raw()).collect();
        // SAFETY: valid sources of this context; the caller vouches for `op`.
        self.wrap(unsafe {
            sys::ggml_custom_4d(
                self.raw(),
                ty,
                ne[0],
                ne[1],
                ne[2],
                1,
                args.as_mut_ptr(),
                args.len() as c_int,
                Some(op),
                -1,
                userdata,
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
/// (slot, token) that chose the expert, [`TILE`] at a time. Without ids (a
/// node of [`Ctx::matmul`]) every token uses the one matrix.
///
/// # Safety
/// Called by ggml with a node built by [`Ctx::matmul_q8`] or [`Ctx::matmul`].
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
        (d, &*d.src[0], &*d.src[1], d.src[2].as_ref())
    };
    let (n, n_expert) = (w.ne[1] as usize, w.ne[2] as usize);
    let nblk = w.ne[0] as usize / QK;
    let n_tokens = q.ne[2] as usize;
    let n_used = ids.map_or(1, |ids| ids.ne[0] as usize);
    let n_b = q.ne[1] as usize;
    let (ith, nth) = (ith.max(0) as usize, nth.max(1) as usize);
    let (r0, r1) = (n * ith / nth, n * (ith + 1) / nth);
    // Who chose which expert, grouped by expert.
    let mut pairs: Vec<(usize, usize, usize)> = Vec::with_capacity(n_used * n_tokens);
    for t in 0..n_tokens {
        for i in 0..n_used {
            let e = match ids {
                // SAFETY: (i, t) is inside ids.
                Some(ids) => unsafe {
                    *((ids.data as *const u8).add(i * ids.nb[0] + t * ids.nb[1]) as *const i32)
                },
                None => 0,
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

/// The op of a repacked Q4_K matrix ([`Ctx::matmul`]): its groups of eight
/// rows split over the threads, each group against every token.
///
/// # Safety
/// Called by ggml with a node built by [`Ctx::matmul`]: `userdata` the
/// matrix, one that [`repacked_q4k`] took; the source the activations
/// quantized in the values' order (the Q6_K layout), at most
/// [`X8_TOKENS`] of them.
unsafe extern "C" fn matmul_x8(
    dst: *mut sys::ggml_tensor,
    ith: c_int,
    nth: c_int,
    userdata: *mut c_void,
) {
    // SAFETY: the node, its source and the matrix, allocated by the time it
    // runs.
    let (d, w, q) = unsafe {
        let d = &*dst;
        (d, &*(userdata as *const sys::ggml_tensor), &*d.src[0])
    };
    let nblk = w.ne[0] as usize / QK;
    let groups = w.ne[1] as usize / 8;
    let n_tokens = q.ne[2] as usize;
    let (ith, nth) = (ith.max(0) as usize, nth.max(1) as usize);
    // SAFETY: row t of q holds nblk blocks of activations.
    let acts: Vec<*const u8> = (0..n_tokens)
        .map(|t| unsafe { (q.data as *const u8).add(t * q.nb[2]) })
        .collect();
    let mut out = [[0f32; 8]; X8_TOKENS];
    for g in groups * ith / nth..groups * (ith + 1) / nth {
        // SAFETY: group g of the repacked matrix holds nblk blocks of
        // `block_q4_Kx8` (the builder checked the layout); this CPU has the
        // features `available` asked.
        unsafe {
            let group = (w.data as *const u8).add(g * nblk * Q4_KX8_BLOCK);
            x86::dots_x8(group, nblk, &acts, &mut out);
        }
        for (t, rows) in out.iter().take(n_tokens).enumerate() {
            for (c, &v) in rows.iter().enumerate() {
                // SAFETY: (8g + c, t) is inside dst (`[n, n_tokens]`).
                unsafe { out_at(d, 8 * g + c, t, 0).write(v) };
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
mod x86;

#[cfg(not(target_arch = "x86_64"))]
mod x86 {
    use super::{Kind, TILE, X8_TOKENS};
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
    /// Never called, as [`dots`].
    pub(super) unsafe fn dots_x8(
        _: *const u8,
        _: usize,
        _: &[*const u8],
        _: &mut [[f32; 8]; X8_TOKENS],
    ) {
        unreachable!("the expert kernel runs only on x86-64")
    }
}

#[cfg(test)]
mod tests;
