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

/// A weight of `ty` and shape `ne` (index 0 of the store) in a buffer:
/// with `repack`, the layout llama.cpp's loader gives a weight read by
/// `read` (repacked where ggml's CPU backend has kernels for it; the flag
/// returned says whether it did), else plain host memory as a file's map
/// is.
fn weight(
    backend: &CpuBackend,
    ty: RawType,
    ne: &[i64],
    read: super::super::WeightRead,
    repack: bool,
) -> (TensorStore, Buffer, bool) {
    let mut store = TensorStore::new(1);
    let wi = store.add(ty, ne, "w");
    let repacked = repack
        .then(|| super::super::cpu_extra_buffer_types().unwrap())
        .into_iter()
        .flatten()
        .find(|&b| super::super::buft_supports(b, store.get(wi), read));
    let buf = Buffer::alloc_ctx(store.ctx(), repacked.unwrap_or(backend.buffer_type())).unwrap();
    (store, buf, repacked.is_some())
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
    let ne = [k as i64, n as i64, n_expert as i64];
    let read = super::super::WeightRead::MulMatId(n_used as i64);
    let (store, buf, repacked) = weight(backend, ty, &ne, read, !ours);
    assert!(
        ours || ty != sys::GGML_TYPE_Q4_K || repacked,
        "a CPU with AVX-512 repacks Q4_K experts"
    );
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
    let threads = std::env::var("THREADS").ok().and_then(|v| v.parse().ok());
    let mut backend = CpuBackend::new(threads.unwrap_or(2)).unwrap();
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

/// `ours` holds `theirs`' bits, every value, and the values are large
/// enough that a difference in their last bits is a difference.
fn same_bits_as_ggml(theirs: &[f32], ours: &[f32], case: &str) {
    assert_eq!(
        ours.len(),
        theirs.len(),
        "{case}: a result of another shape"
    );
    let scale = theirs.iter().fold(0f32, |m, v| m.max(v.abs()));
    assert!(
        scale > 1.0,
        "{case}: results too small to compare ({scale})"
    );
    let differ = theirs
        .iter()
        .zip(ours)
        .filter(|(a, b)| a.to_bits() != b.to_bits());
    let worst = differ.clone().fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    assert_eq!(
        differ.count(),
        0,
        "{case}: ours differs from ggml's by up to {worst}"
    );
}

/// Ours gives ggml's `mul_mat_id` bit for bit for both types (Q4_K
/// repacked, as llama.cpp runs it), with broadcast or per-slot
/// activations and an expert serving more tokens than a tile; a token's
/// results are the same bits alone as in its batch; and in a step where
/// an expert gets as many rows as ggml tiles, the step gives ggml's
/// bits still (Q6_K there is ggml's op).
#[test]
fn ours_matches_ggml_and_does_not_depend_on_the_batch() {
    if !available() {
        eprintln!("this CPU lacks AVX-512 VNNI: ggml's mul_mat_id runs instead of ours");
        return;
    }
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let (k, n, n_expert, n_used) = (512, 40, 4, 2);
    // Each token's two experts, distinct: seven tokens over four
    // experts (ours for both types), then twelve whose first is expert
    // 0 (twelve rows for it: ggml tiles a Q6_K matrix there).
    type Pick = fn(usize) -> [i32; 2];
    let spread: Pick = |t| {
        let a = (t % 4) as i32;
        [a, (a + 1 + (t as i32 / 4) % 3) % 4]
    };
    let crowded: Pick = |t| [0, 1 + (t % 3) as i32];
    let cases = [(7, spread), (12, crowded)];
    for ty in [sys::GGML_TYPE_Q4_K, sys::GGML_TYPE_Q6_K] {
        let dims = [k, n, n_expert];
        let q = experts(ty, dims, &mut rng);
        for (n_tokens, pick) in cases {
            let ids: Vec<i32> = (0..n_tokens).flat_map(pick).collect();
            for n_b in [1, n_used] {
                let b: Vec<f32> = (0..k * n_b * n_tokens).map(|_| rng.f32() * 3.0).collect();
                let theirs = run(ty, dims, &q, (&b, n_b), (&ids, n_used), false);
                let ours = run(ty, dims, &q, (&b, n_b), (&ids, n_used), true);
                assert_eq!(ours.len(), n * n_used * n_tokens);
                same_bits_as_ggml(
                    &theirs,
                    &ours,
                    &format!("type {ty}, {n_tokens} tokens, n_b {n_b}"),
                );
                if !same_bits(Kind::of(ty).unwrap(), n_tokens as i64) {
                    continue; // ggml's op computed this step, as llama.cpp's would
                }
                let t = 5;
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
}

/// `mul_mat` of a `[k, n]` matrix by `[k, n_tokens]` activations on two
/// threads through [`Ctx::matmul`] (`ours`) or ggml's op, the weights
/// as llama.cpp's loader lays them out.
fn dense(ty: RawType, [k, n]: [usize; 2], q: &[u8], x: &[f32], ours: bool) -> Vec<f32> {
    let mut backend = CpuBackend::new(2).unwrap();
    let read = super::super::WeightRead::MulMat;
    let (store, _buf, _) = weight(&backend, ty, &[k as i64, n as i64], read, true);
    store.get(0).write_bytes(q);
    let ctx = Ctx::new(16, true);
    let xt = ctx.input(TYPE_F32, &[k as i64, (x.len() / k) as i64], "x");
    let y = if ours {
        ctx.matmul(store.get(0), xt, true)
    } else {
        ctx.mul_mat(store.get(0), xt)
    };
    let mut graph = ctx.new_graph();
    graph.expand(y);
    let mut alloc = GraphAllocator::new(backend.buffer_type());
    alloc.alloc(&graph).unwrap();
    xt.write(x);
    backend.compute(&graph).unwrap();
    let mut out = Vec::new();
    y.read_f32(&mut out);
    out
}

/// A matrix through [`Ctx::matmul`] gives ggml's `mul_mat` bit for bit
/// at every step size, across ggml's own size rules (its repacked gemm
/// from 4 rows, its tiled kernel from 8): Q6_K by ours below 8, Q4_K
/// (repacked) by ours below 4.
#[test]
fn a_matrix_gives_ggmls_bits_at_every_step_size() {
    if !available() {
        eprintln!("this CPU lacks AVX-512 VNNI: ggml's mul_mat runs instead of ours");
        return;
    }
    let mut rng = Rng(0x2545_f491_4f6c_dd1d);
    let (k, n) = (768, 72);
    for ty in [sys::GGML_TYPE_Q6_K, sys::GGML_TYPE_Q4_K] {
        let q = experts(ty, [k, n, 1], &mut rng);
        for n_tokens in [1, 2, 3, 4, 5, 7, 8, 9, 16] {
            let x: Vec<f32> = (0..k * n_tokens).map(|_| rng.f32() * 3.0).collect();
            let theirs = dense(ty, [k, n], &q, &x, false);
            let ours = dense(ty, [k, n], &q, &x, true);
            assert_eq!(ours.len(), n * n_tokens);
            same_bits_as_ggml(&theirs, &ours, &format!("type {ty}, {n_tokens} tokens"));
        }
    }
}

/// The unpacking of a Q4_K block's 6-bit scales and mins (both kernels'),
/// against ggml's `get_scale_min_k4` byte by byte: plain integer code, so
/// checked on every x86-64, with or without AVX-512.
#[cfg(target_arch = "x86_64")]
#[test]
fn q4_k_scales_unpack_as_ggmls() {
    let mut rng = Rng(0x5851_f42d_4c95_7f2d);
    for _ in 0..1000 {
        let q: [u8; 12] = std::array::from_fn(|_| rng.next() as u8);
        // SAFETY: `q` holds 12 bytes.
        let (sc, mn) = unsafe { super::x86::scales_mins(q.as_ptr()) };
        let byte = |v: [u32; 2], j: usize| (v[j / 4] >> (8 * (j % 4))) as u8;
        for j in 0..8 {
            let (d, m) = if j < 4 {
                (q[j] & 63, q[j + 4] & 63)
            } else {
                (
                    (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
                    (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
                )
            };
            assert_eq!((byte(sc, j), byte(mn, j)), (d, m), "sub-block {j} of {q:?}");
        }
    }
}

/// Ours beside ggml's op as llama.cpp runs it, on one decode token's
/// experts at R1's shape (8 of 16 experts of 2048 x 7168; `ROWS=n` for
/// fewer rows, in cache), two threads (`THREADS=n` for others): `cargo
/// test --release --workspace --lib expert_speed -- --ignored
/// --nocapture`.
#[test]
#[ignore = "a benchmark: prints figures"]
fn expert_speed() {
    let n = std::env::var("ROWS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2048);
    let n_expert: usize = std::env::var("EXPERTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(16);
    let (k, n_used) = (7168, 8);
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
                        let ids: Vec<i32> = (0..n_used)
                            .map(|i| ((r * n_used + i) % n_expert) as i32)
                            .collect();
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
