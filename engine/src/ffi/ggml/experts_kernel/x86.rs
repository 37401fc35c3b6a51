//! The kernel's AVX-512 VNNI inner loops (run only where
//! [`super::available`] found the features).

use super::{
    Kind, ACT_BLOCK, ACT_D, ACT_SUMS, Q4_KX8_BLOCK, Q4_K_BLOCK, Q6_K_BLOCK, TILE, X8_TOKENS,
};
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

/// How far ahead of the block being computed its row is prefetched, in
/// bytes: about one row of R1's width (4032 bytes of Q4_K), so the
/// next row is on its way while this one is computed. A core's own
/// hardware prefetcher left a kernel that computes between its loads
/// at half of what a plain read loop moves on that core (7 against
/// 14.5 GB/s on an Emerald Rapids VM, ggml's kernels alike); with this,
/// 9.4-10.1 GB/s a core (2 048 to 8 192 bytes all did as well).
pub(super) const AHEAD: usize = 4096;

/// Asks for the cache lines of the `len` bytes [`AHEAD`] past `blk` (a
/// prefetch past the end of a buffer reads nothing).
#[inline]
fn prefetch_ahead(blk: *const u8, len: usize) {
    let ahead = blk.wrapping_add(AHEAD);
    for l in 0..len.div_ceil(64) {
        // SAFETY: SSE, which the prefetch needs, is in every x86-64; a
        // prefetch faults on no address.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(64 * l) as *const i8) };
    }
}

/// ggml's unpacking of a Q4_K block's 12 bytes of 6-bit scales and mins
/// (`s`) into the eight sub-blocks' scales and mins, a byte each.
///
/// # Safety
/// `s` holds 12 bytes.
#[inline]
pub(super) unsafe fn scales_mins(s: *const u8) -> ([u32; 2], [u32; 2]) {
    // SAFETY: the caller's contract.
    let u: [u32; 3] =
        std::array::from_fn(|i| unsafe { (s.add(4 * i) as *const u32).read_unaligned() });
    let (k1, k2, k3) = (0x3f3f3f3fu32, 0x0f0f0f0fu32, 0x03030303u32);
    (
        [u[0] & k1, (u[2] & k2) | (((u[0] >> 6) & k3) << 4)],
        [u[1] & k1, ((u[2] >> 4) & k2) | (((u[1] >> 6) & k3) << 4)],
    )
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
            prefetch_ahead(blk, Q4_K_BLOCK);
            let dm = _mm_cvtph_ps(_mm_cvtsi32_si128((blk as *const i32).read_unaligned()));
            let (scales, mins) = scales_mins(blk.add(4));
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
        // Each scale in both 16-bit halves of its lane, for `vpdpwssd`.
        let sc = _mm512_cvtepu8_epi32(sm);
        let sc = _mm512_or_si512(sc, _mm512_slli_epi32(sc, 16));
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
                // Pairs of products in 16 bits (at most 2·15·128), then
                // each pair times its sub-block's scale into 32 bits:
                // the same exact sums as one `vpdpbusd` per four and a
                // multiply, in half the instructions. Two chains, so
                // the four steps do not wait on each other.
                let p0 = _mm512_maddubs_epi16(l0, _mm512_loadu_si512(y as *const _));
                let p1 = _mm512_maddubs_epi16(h0, _mm512_loadu_si512(y.add(64) as *const _));
                let p2 = _mm512_maddubs_epi16(l1, _mm512_loadu_si512(y.add(128) as *const _));
                let p3 = _mm512_maddubs_epi16(h1, _mm512_loadu_si512(y.add(192) as *const _));
                let isum = _mm512_add_epi32(
                    _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(zero, p0, s_l0), p1, s_h0),
                    _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(zero, p2, s_l1), p3, s_h1),
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
            prefetch_ahead(blk, Q6_K_BLOCK);
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
        // Each (signed) scale in both 16-bit halves of its lane, for
        // `vpdpwssd`.
        let sc = _mm512_cvtepi8_epi32(sc8);
        let sc = _mm512_or_si512(
            _mm512_and_si512(sc, _mm512_set1_epi32(0xFFFF)),
            _mm512_slli_epi32(sc, 16),
        );
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
                // Pairs of products in 16 bits (at most 2·63·128), then
                // each pair times its group's scale into the same 32-bit
                // lanes one `vpdpbusd` and a multiply gave; two chains.
                let mut chain = [zero; 2];
                for j in 0..4 {
                    let p =
                        _mm512_maddubs_epi16(qv[j], _mm512_loadu_si512(y.add(64 * j) as *const _));
                    chain[j % 2] = _mm512_dpwssd_epi32(chain[j % 2], p, s[j]);
                }
                let isum = _mm512_add_epi32(chain[0], chain[1]);
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

/// Dot products of eight rows of a Q4_K matrix in ggml's repacked layout
/// (`block_q4_Kx8`: each block of 256 values of eight rows together) with
/// `acts.len()` (at most [`X8_TOKENS`]) activation rows in the values'
/// order, into `out[token][row]`.
///
/// # Safety
/// As [`dots`]; `group` holds `nblk` blocks of `block_q4_Kx8`.
pub(super) unsafe fn dots_x8(
    group: *const u8,
    nblk: usize,
    acts: &[*const u8],
    out: &mut [[f32; 8]; X8_TOKENS],
) {
    // SAFETY: the caller's contract.
    unsafe {
        match acts.len() {
            1 => q4_kx8::<1>(group, nblk, acts, out),
            2 => q4_kx8::<2>(group, nblk, acts, out),
            _ => q4_kx8::<3>(group, nblk, acts, out),
        }
    }
}

/// ggml's repacked Q4_K gemv (`ggml_gemv_q4_K_8x8_q8_K`), which llama.cpp
/// runs for a step of fewer than four rows, in its order: per block, each
/// row's two exact integer totals (the scaled sums, the mins' terms), one
/// FMA each into the row's two accumulators, their difference at the end.
/// A block holds the eight rows' `d` and `dmin` (F16), for each of the
/// eight 32-value sub-blocks the eight rows' 6-bit scales and mins packed
/// as a Q4_K packs a row's, and the nibbles in runs of 8 bytes, row after
/// row: bytes `8g..8g+8` of the eight rows' `qs` at `64g`.
///
/// # Safety
/// As [`dots_x8`], with `acts.len() == M`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")]
unsafe fn q4_kx8<const M: usize>(
    group: *const u8,
    nblk: usize,
    acts: &[*const u8],
    out: &mut [[f32; 8]; X8_TOKENS],
) {
    let nib = _mm512_set1_epi8(0x0F);
    // A row's byte twice: the two 32-bit lanes of its 8 bytes of nibbles.
    let twice = _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    let zero = _mm512_setzero_si512();
    let mut acc = [_mm256_setzero_ps(); M];
    let mut acc_min = [_mm256_setzero_ps(); M];
    for b in 0..nblk {
        // SAFETY: block b of the group and of each activation row (the
        // caller's contract); a prefetch past the end reads nothing.
        unsafe {
            let blk = group.add(b * Q4_KX8_BLOCK);
            prefetch_ahead(blk, Q4_KX8_BLOCK);
            let d = _mm256_cvtph_ps(_mm_loadu_si128(blk as *const _));
            let dmin = _mm256_cvtph_ps(_mm_loadu_si128(blk.add(16) as *const _));
            // Sub-block j's scales (a byte a row) as 32-bit lanes 2r and
            // 2r + 1 for row r, and its mins.
            let mut scales = [zero; 8];
            let mut mins = [0i64; 8];
            // A sub-block's eight bytes as one 64-bit lane.
            let eight = |v: [u32; 2]| (v[0] as u64 | (v[1] as u64) << 32) as i64;
            for j in 0..8 {
                let (sc, mn) = scales_mins(blk.add(32 + 12 * j));
                scales[j] =
                    _mm512_cvtepu8_epi32(_mm_shuffle_epi8(_mm_set1_epi64x(eight(sc)), twice));
                mins[j] = eight(mn);
            }
            // Rows' mins of sub-blocks 2p and 2p + 1 side by side (16 bits).
            let min_pairs: [__m256i; 4] = std::array::from_fn(|p| {
                _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(
                    _mm_set1_epi64x(mins[2 * p]),
                    _mm_set1_epi64x(mins[2 * p + 1]),
                ))
            });
            let mut isum = [zero; M];
            for half in 0..4 {
                // Sub-blocks 2·half (low nibbles) and 2·half + 1 (high).
                let q = blk.add(128 + 256 * half);
                let z: [__m512i; 4] =
                    std::array::from_fn(|k| _mm512_loadu_si512(q.add(64 * k) as *const _));
                let lo = z.map(|z| _mm512_and_si512(z, nib));
                let hi = z.map(|z| _mm512_and_si512(_mm512_srli_epi16(z, 4), nib));
                for m in 0..M {
                    let y = acts[m].add(b * ACT_BLOCK + 64 * half);
                    let (mut pl, mut ph) = (zero, zero);
                    for k in 0..4 {
                        let al = _mm512_set1_epi64((y.add(8 * k) as *const i64).read_unaligned());
                        let ah =
                            _mm512_set1_epi64((y.add(32 + 8 * k) as *const i64).read_unaligned());
                        pl = _mm512_dpbusd_epi32(pl, lo[k], al);
                        ph = _mm512_dpbusd_epi32(ph, hi[k], ah);
                    }
                    isum[m] = _mm512_add_epi32(
                        isum[m],
                        _mm512_add_epi32(
                            _mm512_mullo_epi32(pl, scales[2 * half]),
                            _mm512_mullo_epi32(ph, scales[2 * half + 1]),
                        ),
                    );
                }
            }
            for m in 0..M {
                let y = acts[m].add(b * ACT_BLOCK);
                // Each row's two lanes added, exact: its block total.
                let totals = _mm512_cvtepi64_epi32(_mm512_add_epi32(
                    isum[m],
                    _mm512_srli_epi64(isum[m], 32),
                ));
                // The activations' sums per 32 values, two a 32-bit lane.
                let sums32 = _mm256_madd_epi16(
                    _mm256_loadu_si256(y.add(ACT_SUMS) as *const _),
                    _mm256_set1_epi16(1),
                );
                let pairs = _mm_packs_epi32(
                    _mm256_castsi256_si128(sums32),
                    _mm256_extracti128_si256(sums32, 1),
                );
                let pair = [
                    _mm256_broadcastd_epi32(pairs),
                    _mm256_broadcastd_epi32(_mm_shuffle_epi32(pairs, 0x55)),
                    _mm256_broadcastd_epi32(_mm_shuffle_epi32(pairs, 0xAA)),
                    _mm256_broadcastd_epi32(_mm_shuffle_epi32(pairs, 0xFF)),
                ];
                let mut imin = _mm256_setzero_si256();
                for p in 0..4 {
                    imin = _mm256_add_epi32(imin, _mm256_madd_epi16(min_pairs[p], pair[p]));
                }
                let dy = _mm256_set1_ps((y.add(ACT_D) as *const f32).read_unaligned());
                acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(totals), _mm256_mul_ps(d, dy), acc[m]);
                acc_min[m] = _mm256_fmadd_ps(
                    _mm256_cvtepi32_ps(imin),
                    _mm256_mul_ps(dmin, dy),
                    acc_min[m],
                );
            }
        }
    }
    for m in 0..M {
        // SAFETY: out[m] holds eight floats.
        unsafe { _mm256_storeu_ps(out[m].as_mut_ptr(), _mm256_sub_ps(acc[m], acc_min[m])) };
    }
}
