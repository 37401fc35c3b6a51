//! Checks of the build against plain Rust: a matmul per type, the weight read rate.

use super::backend::repacked_buft_for;
use super::backend::Buffer;
use super::backend::CpuBackend;
use super::backend::Executor;
use super::backend::GraphAllocator;
use super::backend::TensorStore;
use super::row_size;
use super::Ctx;
use super::TYPE_F32;
use llama_cpp_sys_2 as sys;
use std::ffi::c_void;
use std::ptr;
use sys::ggml_type as RawType;

/// Runs `y = W x` through our ggml build with `W` (`rows x k`, row-major)
/// stored as `ty` (repacked when `repack` and the CPU supports it), and
/// returns `y` (`n x rows`) with the reference `dequant(W) · x` in plain Rust.
/// A build with wrong CPU flags gives garbage here, so a test keeps it honest.
pub fn matmul_check(
    ty: RawType,
    w: &[f32],
    x: &[f32],
    rows: usize,
    k: usize,
    repack: bool,
) -> Result<(Vec<f32>, Vec<f32>), String> {
    let backend = CpuBackend::new(2)?;
    let n = x.len() / k;
    let mut q = vec![0u8; row_size(ty, k as i64) * rows];
    // SAFETY: `w` has rows*k floats; `q` is sized by ggml's own row size.
    unsafe {
        sys::ggml_quantize_chunk(
            ty,
            w.as_ptr(),
            q.as_mut_ptr() as *mut c_void,
            0,
            rows as i64,
            k as i64,
            ptr::null(),
        )
    };
    let mut deq = vec![0f32; rows * k];
    // SAFETY: ggml's traits table has a to_float for every quantized type.
    unsafe {
        let to_float = (*sys::ggml_get_type_traits(ty))
            .to_float
            .expect("type has a dequantizer");
        to_float(
            q.as_ptr() as *const c_void,
            deq.as_mut_ptr(),
            (rows * k) as i64,
        );
    }
    let reference: Vec<f32> = (0..n)
        .flat_map(|j| {
            let deq = &deq;
            (0..rows).map(move |r| {
                (0..k)
                    .map(|i| deq[r * k + i] as f64 * x[j * k + i] as f64)
                    .sum::<f64>() as f32
            })
        })
        .collect();

    let mut store = TensorStore::new(1);
    let wi = store.add(ty, &[k as i64, rows as i64], "w");
    let buft = if repack {
        repacked_buft_for(store.get(wi))?
    } else {
        None
    };
    let _buf = Buffer::alloc_ctx(store.ctx(), buft.unwrap_or(backend.buffer_type()))
        .ok_or("no memory for a small buffer")?;
    store.get(wi).write_bytes(&q);
    let ctx = Ctx::new(8, true);
    let xt = ctx.input(TYPE_F32, &[k as i64, n as i64], "x");
    let y = ctx.mul_mat(store.get(wi), xt);
    let mut graph = ctx.new_graph();
    graph.expand(y);
    let mut alloc = GraphAllocator::new(backend.buffer_type());
    alloc.alloc(&graph)?;
    xt.write(x);
    let mut backend = backend;
    backend.compute(&graph)?;
    let mut out = Vec::new();
    y.read_f32(&mut out);
    Ok((out, reference))
}

/// How fast a stage on this device reads its weights in a decode step: the
/// bytes per second of `y = W x` for one token with `W` (`bytes` of `ty`)
/// where a stage keeps its weights (the GPU's memory, or the CPU's repacked
/// layout), computed by [`Executor`] with `n_threads` CPU threads. A decode
/// step multiplies every weight by one row per sequence, so this rate is
/// what sets a stage's pace; the planner divides each stage's per-token
/// weight bytes by it. The median of the runs that fit in `budget` (at
/// least 5, after one to warm up). The weights are zeros: the kernels do the
/// same work whatever the values.
pub fn weight_read_rate(
    gpu: Option<crate::ffi::device::GpuDevice>,
    n_threads: usize,
    ty: RawType,
    bytes: usize,
    budget: std::time::Duration,
) -> Result<f64, String> {
    use std::time::Instant;
    let mut exec = Executor::new(gpu, n_threads)?;
    let k: i64 = 4096;
    // Rows in eights: the CPU's repacked kernels take them in blocks of 8.
    let mut rows = ((bytes / row_size(ty, k)).max(8) / 8 * 8) as i64;
    let mut store = TensorStore::new(1);
    let mut wi = store.add(ty, &[k, rows], "calibration.weight");
    let buft = if exec.on_gpu() {
        // As large as the device can address in one tensor (ggml-vulkan
        // without 64-bit indexing: maxStorageBufferRange, 128 MiB on
        // lavapipe), halving from the size asked.
        while !super::buft_supports(exec.buffer_type(), store.get(wi), super::WeightRead::MulMat) {
            if rows <= 8 {
                return Err("the device cannot multiply even a small Q4_K matrix".into());
            }
            rows = (rows / 2).max(8) / 8 * 8;
            store = TensorStore::new(1);
            wi = store.add(ty, &[k, rows], "calibration.weight");
        }
        exec.buffer_type()
    } else {
        repacked_buft_for(store.get(wi))?.unwrap_or(exec.buffer_type())
    };
    let w_bytes = store.get(wi).nbytes();
    let buf = Buffer::alloc_ctx(store.ctx(), buft)
        .ok_or_else(|| format!("no memory for {w_bytes} bytes of calibration weights"))?;
    buf.clear(0);
    let ctx = Ctx::new(8, true);
    let x = ctx.input(TYPE_F32, &[k, 1], "calibration.x");
    let y = ctx.mul_mat(store.get(wi), x);
    let mut graph = ctx.new_graph();
    graph.expand(y);
    let input = vec![0.5f32; k as usize];
    let mut run = || -> Result<f64, String> {
        exec.alloc(&graph)?;
        x.write(&input);
        let t = Instant::now();
        exec.compute(&graph)?;
        Ok(t.elapsed().as_secs_f64())
    };
    run()?;
    let start = Instant::now();
    let mut times = Vec::new();
    while times.len() < 5 || (start.elapsed() < budget && times.len() < 200) {
        times.push(run()?);
    }
    times.sort_by(f64::total_cmp);
    let median = times[times.len() / 2].max(1e-9);
    Ok(w_bytes as f64 / median)
}
