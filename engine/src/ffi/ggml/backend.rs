//! Memory and compute: backend buffers and buffer types (the CPU's repacked ones), the
//! CPU backend, the executor (ggml's backend scheduler), graph allocation, weight storage.

use super::cpu;
use super::cpu_proc;
use super::Ctx;
use super::Graph;
use super::Tensor;
use super::TYPE_F32;
use super::TYPE_I32;
use crate::model::GRAPH_NODES;
use llama_cpp_sys_2 as sys;
use std::ffi::c_void;
use std::ffi::CStr;
use std::marker::PhantomData;
use std::ptr;
use std::ptr::NonNull;
use sys::ggml_type as RawType;

/// A backend buffer (weights, KV cache or compute memory).
pub struct Buffer {
    pub(super) raw: NonNull<sys::ggml_backend_buffer>,
}

// SAFETY: buffers are plain memory owned by us; ggml has no thread affinity for CPU buffers.
unsafe impl Send for Buffer {}
unsafe impl Sync for Buffer {}

impl Buffer {
    /// Wraps existing host memory (the model's mmap) without copying.
    ///
    /// # Safety
    /// `ptr..ptr+len` must stay valid and unmodified for the buffer's lifetime.
    /// ggml never writes to weight tensors, so read-only memory is fine.
    pub unsafe fn from_host_ptr(ptr: *const u8, len: usize) -> Result<Buffer, String> {
        let dev = cpu_device()?;
        // SAFETY: caller's contract; the CPU device wraps host memory as is.
        let raw = unsafe {
            sys::ggml_backend_dev_buffer_from_host_ptr(dev, ptr as *mut c_void, len, len)
        };
        let buf = Buffer {
            raw: NonNull::new(raw)
                .ok_or_else(|| format!("ggml could not wrap {len} bytes of mapped memory"))?,
        };
        // SAFETY: valid buffer.
        unsafe {
            sys::ggml_backend_buffer_set_usage(
                buf.raw.as_ptr(),
                sys::GGML_BACKEND_BUFFER_USAGE_WEIGHTS,
            )
        };
        Ok(buf)
    }

    /// Allocates memory for every tensor of `ctx` from the buffer type `buft`.
    pub fn alloc_ctx(ctx: &Ctx, buft: BufferType) -> Option<Buffer> {
        // SAFETY: valid context; buft comes from ggml.
        let raw = unsafe { sys::ggml_backend_alloc_ctx_tensors_from_buft(ctx.raw(), buft.0) };
        NonNull::new(raw).map(|raw| Buffer { raw })
    }

    /// Places `t` at `base + offset` inside this host-pointer buffer.
    ///
    /// # Safety
    /// `base` must be the pointer this buffer was created from and
    /// `offset + t.nbytes()` must not exceed its length.
    pub unsafe fn place(
        &self,
        t: Tensor<'_>,
        base: *const u8,
        offset: usize,
    ) -> Result<(), String> {
        // SAFETY: caller's contract.
        unsafe { t.alloc_at(self, base.add(offset) as *mut u8) }
    }

    pub fn clear(&self, value: u8) {
        // SAFETY: valid buffer.
        unsafe { sys::ggml_backend_buffer_clear(self.raw.as_ptr(), value) }
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        // SAFETY: we own the buffer.
        unsafe { sys::ggml_backend_buffer_free(self.raw.as_ptr()) }
    }
}

/// A backend buffer type (plain CPU, or the CPU "repack" type that
/// re-lays quantized weights for faster matmuls).
#[derive(Clone, Copy)]
pub struct BufferType(sys::ggml_backend_buffer_type_t);

// SAFETY: buffer types are static singletons inside ggml.
unsafe impl Send for BufferType {}
unsafe impl Sync for BufferType {}

impl BufferType {
    pub fn name(&self) -> String {
        // SAFETY: static string from ggml.
        unsafe { CStr::from_ptr(sys::ggml_backend_buft_name(self.0)) }
            .to_string_lossy()
            .into_owned()
    }
}

pub(super) fn cpu_device() -> Result<sys::ggml_backend_dev_t, String> {
    let reg = cpu()?.reg.0;
    // SAFETY: the CPU backend registers exactly one device.
    let dev = unsafe { sys::ggml_backend_reg_dev_get(reg, 0) };
    if dev.is_null() {
        Err("the CPU backend has no device".into())
    } else {
        Ok(dev)
    }
}

/// The CPU's extra buffer types (repacking), as llama.cpp looks them up.
pub fn cpu_extra_buffer_types() -> Result<Vec<BufferType>, String> {
    let dev = cpu_device()?;
    let f = cpu_proc(c"ggml_backend_dev_get_extra_bufts")?;
    type GetExtra =
        unsafe extern "C" fn(sys::ggml_backend_dev_t) -> *mut sys::ggml_backend_buffer_type_t;
    // SAFETY: ggml documents this proc's signature as `ggml_backend_dev_get_extra_bufts_t`.
    let get: GetExtra = unsafe { std::mem::transmute::<*mut c_void, GetExtra>(f) };
    let mut out = Vec::new();
    // SAFETY: returns a NULL-terminated array of static buffer types.
    unsafe {
        let mut p = get(dev);
        while !p.is_null() && !(*p).is_null() {
            out.push(BufferType(*p));
            p = p.add(1);
        }
    }
    Ok(out)
}

/// How a weight is read: the op llama.cpp's loader asks a buffer type's
/// device about before it puts the weight there.
#[derive(Clone, Copy, Debug)]
pub enum WeightRead {
    /// `mul_mat(weight, x)`, 512 rows of `x`.
    MulMat,
    /// `mul_mat_id(weight, x, ids)` of a 3-D expert tensor, this many experts
    /// per row, 512 rows.
    MulMatId(i64),
    /// Any other op: only the weight itself, as ggml's scheduler asks of
    /// every tensor already in a buffer (a device refuses a tensor larger
    /// than it can address: ggml-vulkan one over `maxStorageBufferRange`
    /// without 64-bit indexing).
    Other,
}

/// Would the device of `buft` (the CPU for its repacked types) run what
/// reads `weight` with `weight` stored in `buft`? Asked the way llama.cpp's
/// loader asks it: a dummy buffer of that type and a fake op; the weight
/// itself is asked too, as ggml's scheduler asks of a tensor already in a
/// buffer (it aborts when the device refuses one).
pub fn buft_supports(buft: BufferType, weight: Tensor<'_>, read: WeightRead) -> bool {
    let ctx = Ctx::new(4, false);
    // SAFETY: zero-sized allocation of a valid buffer type.
    let dummy = unsafe { sys::ggml_backend_buft_alloc_buffer(buft.0, 0) };
    if dummy.is_null() {
        return false;
    }
    let ne = weight.ne();
    let w = ctx.new_tensor(weight.ty(), &ne[..weight.n_dims().max(1) as usize]);
    // SAFETY: `w` is a metadata-only tensor we own; pointing its buffer at the
    // dummy makes the device consult that buffer type's support table.
    unsafe { (*w.raw()).buffer = dummy };
    let op = match read {
        WeightRead::MulMat => Some(ctx.mul_mat(w, ctx.new_tensor(TYPE_F32, &[ne[0], 512]))),
        WeightRead::MulMatId(n_used) => {
            let x = ctx.new_tensor(TYPE_F32, &[ne[0], n_used, 512]);
            let ids = ctx.new_tensor(TYPE_I32, &[n_used, 512]);
            Some(ctx.mul_mat_id(w, x, ids))
        }
        WeightRead::Other => None,
    };
    // SAFETY: a valid buffer type; its device, or none.
    let dev = unsafe { sys::ggml_backend_buft_get_device(buft.0) };
    let dev = if dev.is_null() {
        cpu_device().ok()
    } else {
        Some(dev)
    };
    // SAFETY: valid device and ops; then free the dummy buffer we allocated.
    let ok = dev.is_some_and(|dev| unsafe {
        sys::ggml_backend_dev_supports_op(dev, w.raw())
            && op.is_none_or(|op| sys::ggml_backend_dev_supports_op(dev, op.raw()))
    });
    unsafe {
        (*w.raw()).buffer = ptr::null_mut();
        sys::ggml_backend_buffer_free(dummy);
    }
    ok
}

/// A graph computation's status as a result.
pub(super) fn computed(st: sys::ggml_status) -> Result<(), String> {
    if st == sys::GGML_STATUS_SUCCESS {
        Ok(())
    } else {
        Err(format!("ggml graph compute failed with status {st}"))
    }
}

/// The CPU compute backend with a fixed thread count.
pub struct CpuBackend {
    pub(super) raw: NonNull<sys::ggml_backend>,
    /// `ggml_backend_cpu_set_use_ref`, looked up once (every step sets it),
    /// and what it was last set to.
    set_use_ref: SetUseRef,
    use_ref: bool,
}

type SetUseRef = unsafe extern "C" fn(sys::ggml_backend_t, bool);

// SAFETY: a backend is used by one thread at a time (`&mut self` for compute).
unsafe impl Send for CpuBackend {}

impl CpuBackend {
    pub fn new(n_threads: usize) -> Result<CpuBackend, String> {
        let dev = cpu_device()?;
        // SAFETY: the CPU device's constructor takes no parameters.
        let raw = unsafe { sys::ggml_backend_dev_init(dev, ptr::null()) };
        let f = cpu_proc(c"ggml_backend_cpu_set_use_ref")?;
        // SAFETY: ggml-cpu.h declares `void ggml_backend_cpu_set_use_ref(ggml_backend_t, bool)`.
        let set_use_ref = unsafe { std::mem::transmute::<*mut c_void, SetUseRef>(f) };
        let b = CpuBackend {
            raw: NonNull::new(raw).ok_or("the CPU backend could not start")?,
            set_use_ref,
            use_ref: false,
        };
        type SetThreads = unsafe extern "C" fn(sys::ggml_backend_t, i32);
        let f = cpu_proc(c"ggml_backend_set_n_threads")?;
        // SAFETY: ggml documents this proc's signature as `ggml_backend_set_n_threads_t`.
        let set: SetThreads = unsafe { std::mem::transmute::<*mut c_void, SetThreads>(f) };
        // SAFETY: valid CPU backend.
        unsafe { set(b.raw.as_ptr(), n_threads.max(1) as i32) };
        Ok(b)
    }

    pub fn buffer_type(&self) -> BufferType {
        // SAFETY: valid backend.
        BufferType(unsafe { sys::ggml_backend_get_default_buffer_type(self.raw.as_ptr()) })
    }

    /// Batch-invariant kernels (`on`) or the fastest ones, for the graphs
    /// computed from now on: ggml's reference path (`use_ref`), in which
    /// every matmul element is one `vec_dot` over the whole row, whatever
    /// the number of rows (no tiled K-quant or llamafile kernels, whose
    /// arithmetic differs from `vec_dot` and which take over from 2 or 8
    /// rows), no fused ops, and flash attention's per-row path.
    pub fn set_batch_invariant(&mut self, on: bool) {
        if on != self.use_ref {
            // SAFETY: valid CPU backend; the flag is read when a graph is planned.
            unsafe { (self.set_use_ref)(self.raw.as_ptr(), on) };
            self.use_ref = on;
        }
    }

    pub fn compute(&mut self, graph: &Graph<'_>) -> Result<(), String> {
        // SAFETY: the graph's tensors are all allocated (gallocr or weights).
        computed(unsafe { sys::ggml_backend_graph_compute(self.raw.as_ptr(), graph.raw.as_ptr()) })
    }
}

impl Drop for CpuBackend {
    fn drop(&mut self) {
        // SAFETY: we own the backend.
        unsafe { sys::ggml_backend_free(self.raw.as_ptr()) }
    }
}

/// Runs a stage's graphs: ggml's backend scheduler over the stage's device,
/// the CPU, or a GPU with the CPU beside it (ggml's rule: the CPU comes
/// last) for the ops the GPU lacks and for the step's inputs, as llama.cpp
/// runs its graphs. Weights decide where an op runs (an op on weights in
/// GPU memory runs on the GPU); the scheduler copies what crosses over.
pub struct Executor {
    pub(super) sched: NonNull<sys::ggml_backend_sched>,
    pub(super) gpu: Option<NonNull<sys::ggml_backend>>,
    pub(super) cpu: CpuBackend,
    pub(super) buft: BufferType,
    /// Ops of the graphs reserved so far that the GPU cannot compute, which
    /// ggml's scheduler gave to the CPU (ggml's op names, e.g. `ARGSORT`).
    fallbacks: std::collections::BTreeSet<String>,
    /// Graphs allocated or reserved so far (see [`Executor::allocs`]).
    allocs: u64,
    /// Beside a GPU: its pinned host memory, which outputs are read into
    /// ([`Executor::read_f32`]), and its buffer type.
    pinned: Option<(BufferType, Option<Buffer>)>,
}

// SAFETY: used by one thread at a time (`&mut self` to allocate or compute).
unsafe impl Send for Executor {}

impl Executor {
    /// An executor on `gpu`, or on the CPU alone; the CPU backend runs
    /// `n_threads` threads either way.
    pub fn new(
        gpu: Option<crate::ffi::device::GpuDevice>,
        n_threads: usize,
    ) -> Result<Executor, String> {
        let cpu = CpuBackend::new(n_threads)?;
        let mut backends = Vec::new();
        let mut bufts = Vec::new();
        let mut gpu_backend = None;
        if let Some(dev) = gpu {
            // SAFETY: a device of a loaded backend; no parameters.
            let raw = unsafe { sys::ggml_backend_dev_init(dev.0, ptr::null()) };
            let raw = NonNull::new(raw).ok_or_else(|| {
                format!(
                    "the GPU {} could not start a backend",
                    dev.props().description
                )
            })?;
            backends.push(raw.as_ptr());
            // SAFETY: valid device.
            bufts.push(unsafe { sys::ggml_backend_dev_buffer_type(dev.0) });
            gpu_backend = Some(raw);
        }
        backends.push(cpu.raw.as_ptr());
        // Beside a GPU, inputs and results cross in its pinned host memory.
        // SAFETY: valid device; null when it has none.
        let host = gpu.map_or(ptr::null_mut(), |dev| unsafe {
            sys::ggml_backend_dev_host_buffer_type(dev.0)
        });
        bufts.push(if host.is_null() {
            cpu.buffer_type().0
        } else {
            host
        });
        // The stage's device: the GPU's memory, else the CPU's.
        let buft = BufferType(bufts[0]);
        // SAFETY: `backends` and `bufts` have one entry per backend, CPU last.
        let raw = unsafe {
            sys::ggml_backend_sched_new(
                backends.as_mut_ptr(),
                bufts.as_mut_ptr(),
                backends.len() as i32,
                GRAPH_NODES,
                false,
                gpu.is_some(),
            )
        };
        let Some(sched) = NonNull::new(raw) else {
            if let Some(g) = gpu_backend {
                // SAFETY: we own it and nothing else refers to it.
                unsafe { sys::ggml_backend_free(g.as_ptr()) };
            }
            return Err("ggml could not create a backend scheduler".into());
        };
        Ok(Executor {
            sched,
            gpu: gpu_backend,
            cpu,
            buft,
            fallbacks: Default::default(),
            allocs: 0,
            pinned: (!host.is_null()).then_some((BufferType(host), None)),
        })
    }

    /// Where the stage's own tensors (KV cache, device weights) go.
    pub fn buffer_type(&self) -> BufferType {
        self.buft
    }

    pub fn on_gpu(&self) -> bool {
        self.gpu.is_some()
    }

    /// See [`CpuBackend::set_batch_invariant`] (the CPU backend only).
    pub fn set_batch_invariant(&mut self, on: bool) {
        self.cpu.set_batch_invariant(on)
    }

    /// Sizes the compute buffers for `graph` (they only grow).
    ///
    /// ggml's scheduler rewrites the sources of a graph's nodes when it
    /// splits the graph (each input crossing backends is read from a copy in
    /// the scheduler's own context, which the next split frees), so a graph
    /// is split once: one built afresh serves [`Executor::note_fallbacks`].
    pub fn reserve(&mut self, graph: &Graph<'_>) -> Result<(), String> {
        self.allocs += 1;
        // SAFETY: valid scheduler and graph.
        if !unsafe { sys::ggml_backend_sched_reserve(self.sched.as_ptr(), graph.raw.as_ptr()) } {
            return Err("could not allocate the compute buffer".into());
        }
        Ok(())
    }

    /// Notes the ops of `graph` (built afresh: never split before, see
    /// [`Executor::reserve`]) that the GPU lacks, which ggml's scheduler
    /// gives to the CPU (see [`Executor::fallback_ops`]). Nothing on the
    /// CPU alone.
    pub fn note_fallbacks(&mut self, graph: &Graph<'_>) -> Result<(), String> {
        let Some(gpu) = self.gpu else {
            return Ok(());
        };
        self.allocs += 1;
        // The graph is split, placed in the buffers reserved, read and let
        // go (reserving leaves no assignment behind).
        // SAFETY: valid scheduler and graph; after the allocation each node
        // has a backend; the op names are static strings.
        unsafe {
            let g = graph.raw.as_ptr();
            sys::ggml_backend_sched_reset(self.sched.as_ptr());
            if !sys::ggml_backend_sched_alloc_graph(self.sched.as_ptr(), g) {
                return Err("could not allocate the compute graph".into());
            }
            for i in 0..sys::ggml_graph_n_nodes(g) {
                let node = sys::ggml_graph_node(g, i);
                let on = sys::ggml_backend_sched_get_tensor_backend(self.sched.as_ptr(), node);
                if on == self.cpu.raw.as_ptr() && !sys::ggml_backend_supports_op(gpu.as_ptr(), node)
                {
                    let op = CStr::from_ptr(sys::ggml_op_desc(node));
                    self.fallbacks.insert(op.to_string_lossy().into_owned());
                }
            }
            sys::ggml_backend_sched_reset(self.sched.as_ptr());
        }
        Ok(())
    }

    /// The ops of the reserved graphs that run on the CPU because the GPU's
    /// backend cannot compute them (ggml's scheduler falls back to the CPU
    /// for each, copying its inputs across and its result back); empty on
    /// the CPU alone, and where the GPU computes every op.
    pub fn fallback_ops(&self) -> Vec<String> {
        self.fallbacks.iter().cloned().collect()
    }

    /// Gives `graph`'s tensors memory (the previous graph's is reused), so
    /// that its inputs can be written before [`Executor::compute`].
    pub fn alloc(&mut self, graph: &Graph<'_>) -> Result<(), String> {
        self.allocs += 1;
        // SAFETY: valid scheduler and graph.
        let ok = unsafe {
            sys::ggml_backend_sched_reset(self.sched.as_ptr());
            sys::ggml_backend_sched_alloc_graph(self.sched.as_ptr(), graph.raw.as_ptr())
        };
        if ok {
            Ok(())
        } else {
            Err("could not allocate the compute graph".into())
        }
    }

    /// How many graphs this executor has allocated (or reserved for): a
    /// graph allocated when it was `n` may be computed again, as it is,
    /// while it is still `n` (ggml's scheduler keeps its split and its
    /// tensors' places until the next allocation).
    pub fn allocs(&self) -> u64 {
        self.allocs
    }

    /// Reads the whole of `t` (F32, contiguous, computed) into `out`. A
    /// tensor in a GPU's memory goes through pinned host memory kept for
    /// it: a copy into pageable memory is staged by the driver, and
    /// Gemma 3 270M's logits (1 MiB a token) took 300 µs of a 1.25 ms decode
    /// step that way on an H200.
    pub fn read_f32(&mut self, t: Tensor<'_>, out: &mut Vec<f32>) {
        let raw = t.raw();
        // SAFETY: a valid tensor; its buffer, when it has one, is valid.
        let on_device = unsafe {
            let buf = (*raw).buffer;
            !buf.is_null() && !sys::ggml_backend_buffer_is_host(buf)
        };
        let Some((buft, staging)) = self.pinned.as_mut().filter(|_| on_device) else {
            return t.read_f32(out);
        };
        assert_eq!(t.ty(), super::TYPE_F32);
        let n = t.nbytes();
        // SAFETY: a valid buffer.
        let size = |b: &Buffer| unsafe { sys::ggml_backend_buffer_get_size(b.raw.as_ptr()) };
        if staging.as_ref().is_none_or(|b| size(b) < n) {
            *staging = None;
            // SAFETY: a valid buffer type.
            let raw = unsafe { sys::ggml_backend_buft_alloc_buffer(buft.0, n.next_power_of_two()) };
            match NonNull::new(raw) {
                Some(raw) => *staging = Some(Buffer { raw }),
                // No pinned memory to be had: the driver's staging, slower.
                None => return t.read_f32(out),
            }
        }
        let b = staging.as_ref().expect("allocated above");
        out.resize(n / 4, 0.0);
        // SAFETY: the staging buffer is host memory of at least `n` bytes;
        // `out` holds `n` bytes; the tensor is computed.
        unsafe {
            let base = sys::ggml_backend_buffer_get_base(b.raw.as_ptr());
            sys::ggml_backend_tensor_get(raw, base, 0, n);
            std::ptr::copy_nonoverlapping(base as *const f32, out.as_mut_ptr(), n / 4);
        }
    }

    /// Runs the allocated `graph` to the end (results readable on return).
    pub fn compute(&mut self, graph: &Graph<'_>) -> Result<(), String> {
        // SAFETY: allocated by `alloc`; the call synchronises every backend.
        computed(unsafe {
            sys::ggml_backend_sched_graph_compute(self.sched.as_ptr(), graph.raw.as_ptr())
        })
    }

    /// Bytes of the compute buffers: (the device's, the CPU's). On the CPU
    /// alone the second is 0.
    pub fn buffer_sizes(&self) -> (usize, usize) {
        let size = |b: *mut sys::ggml_backend| {
            // SAFETY: a backend of this scheduler.
            unsafe { sys::ggml_backend_sched_get_buffer_size(self.sched.as_ptr(), b) }
        };
        match self.gpu {
            Some(g) => (size(g.as_ptr()), size(self.cpu.raw.as_ptr())),
            None => (size(self.cpu.raw.as_ptr()), 0),
        }
    }
}

impl Drop for Executor {
    fn drop(&mut self) {
        // The pinned memory goes while its GPU's backend is there.
        self.pinned = None;
        // SAFETY: we own the scheduler and the GPU backend; the scheduler goes
        // first (it refers to the backends); `cpu` drops after this.
        unsafe {
            sys::ggml_backend_sched_free(self.sched.as_ptr());
            if let Some(g) = self.gpu {
                sys::ggml_backend_free(g.as_ptr());
            }
        }
    }
}

/// Compute-buffer allocator for graphs (ggml-alloc), reused across steps.
pub struct GraphAllocator {
    pub(super) raw: NonNull<sys::ggml_gallocr>,
}

// SAFETY: used by one thread at a time.
unsafe impl Send for GraphAllocator {}

impl GraphAllocator {
    pub fn new(buft: BufferType) -> GraphAllocator {
        // SAFETY: valid buffer type.
        let raw = unsafe { sys::ggml_gallocr_new(buft.0) };
        GraphAllocator {
            raw: NonNull::new(raw).expect("ggml_gallocr_new failed"),
        }
    }

    /// Pre-sizes the compute buffer for the worst-case graph.
    pub fn reserve(&mut self, graph: &Graph<'_>) -> Result<(), String> {
        // SAFETY: valid allocator and graph.
        if unsafe { sys::ggml_gallocr_reserve(self.raw.as_ptr(), graph.raw.as_ptr()) } {
            Ok(())
        } else {
            Err("could not allocate the compute buffer".into())
        }
    }

    pub fn alloc(&mut self, graph: &Graph<'_>) -> Result<(), String> {
        // SAFETY: valid allocator and graph.
        if unsafe { sys::ggml_gallocr_alloc_graph(self.raw.as_ptr(), graph.raw.as_ptr()) } {
            Ok(())
        } else {
            Err("could not allocate the compute graph".into())
        }
    }

    pub fn buffer_size(&self) -> usize {
        // SAFETY: valid allocator, buffer 0 always exists.
        unsafe { sys::ggml_gallocr_get_buffer_size(self.raw.as_ptr(), 0) }
    }
}

impl Drop for GraphAllocator {
    fn drop(&mut self) {
        // SAFETY: we own the allocator.
        unsafe { sys::ggml_gallocr_free(self.raw.as_ptr()) }
    }
}

/// Tensor headers that must outlive many graphs (weights, KV cache): a
/// context plus stable indices into it, so owners need no self-references.
pub struct TensorStore {
    pub(super) ctx: Ctx,
    pub(super) tensors: Vec<NonNull<sys::ggml_tensor>>,
}

// SAFETY: the store is only mutated through `&mut self`.
unsafe impl Send for TensorStore {}
unsafe impl Sync for TensorStore {}

impl TensorStore {
    pub fn new(capacity: usize) -> TensorStore {
        TensorStore {
            ctx: Ctx::new(capacity.max(1), false),
            tensors: Vec::with_capacity(capacity),
        }
    }

    /// Declares a tensor (no memory yet) and returns its index.
    pub fn add(&mut self, ty: RawType, ne: &[i64], name: &str) -> usize {
        let t = self.ctx.new_tensor(ty, ne);
        t.set_name(name);
        self.tensors.push(t.raw);
        self.tensors.len() - 1
    }

    pub fn get(&self, i: usize) -> Tensor<'_> {
        Tensor {
            raw: self.tensors[i],
            _ctx: PhantomData,
        }
    }

    pub fn ctx(&self) -> &Ctx {
        &self.ctx
    }

    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }
}

/// The CPU's repacked buffer type that takes `weight`'s matmuls, if this
/// CPU has one for its type and shape.
pub(super) fn repacked_buft_for(weight: Tensor<'_>) -> Result<Option<BufferType>, String> {
    Ok(cpu_extra_buffer_types()?
        .into_iter()
        .find(|b| buft_supports(*b, weight, WeightRead::MulMat)))
}
