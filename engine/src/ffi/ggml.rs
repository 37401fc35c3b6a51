//! The one door to ggml: a small safe layer over the C API that
//! `llama-cpp-sys-2` exposes. This is the only module of the engine with
//! `unsafe`.
//!
//! Ownership model: a [`Ctx`] owns tensor *metadata*; [`Tensor`] is a copyable
//! handle that borrows its context, so it cannot outlive it. Tensor *data*
//! lives in backend buffers ([`Buffer`]) or in the model's memory map.
//! Graph-building ops are thin wrappers; ggml checks shapes with `GGML_ASSERT`,
//! which aborts, so callers validate everything that comes from a file
//! (tensor shapes, hyper-parameters) *before* building a graph.

use std::ffi::{c_void, CStr, CString};
use std::marker::PhantomData;
use std::ptr::{self, NonNull};
use std::sync::Once;

use super::cpu_variant;

use llama_cpp_sys_2 as sys;

pub use sys::ggml_type as RawType;

pub const TYPE_F32: RawType = sys::GGML_TYPE_F32;
pub const TYPE_F16: RawType = sys::GGML_TYPE_F16;
pub const TYPE_I32: RawType = sys::GGML_TYPE_I32;
pub const TYPE_I64: RawType = sys::GGML_TYPE_I64;

pub use crate::model::{RopeParams, GRAPH_NODES};

static INIT: Once = Once::new();

/// Routes ggml's and llama.cpp's logging away from stderr unless
/// `OMNI_GGML_LOG=1`: their load chatter would drown our own progress lines.
pub fn init_logging() {
    INIT.call_once(|| {
        let verbose = std::env::var("OMNI_GGML_LOG").is_ok_and(|v| v == "1");
        if !verbose {
            // SAFETY: installing a process-wide callback that ignores its
            // arguments; it is valid for the whole process lifetime.
            unsafe {
                sys::ggml_log_set(Some(quiet_log), ptr::null_mut());
                sys::llama_log_set(Some(quiet_log), ptr::null_mut());
            }
        }
    });
}

unsafe extern "C" fn quiet_log(
    level: sys::ggml_log_level,
    text: *const std::ffi::c_char,
    _: *mut c_void,
) {
    if level == sys::GGML_LOG_LEVEL_ERROR && !text.is_null() {
        // SAFETY: ggml passes a NUL-terminated string valid for this call.
        let msg = unsafe { CStr::from_ptr(text) }.to_string_lossy();
        eprint!("ggml: {msg}");
    }
}

/// The CPU backend this process computes with (loaded on first use: the
/// variant `OMNI_CPU_VARIANT` names, or the best for this CPU).
pub fn cpu() -> Result<&'static cpu_variant::CpuBackendInfo, String> {
    cpu_variant::load(None)
}

/// A function the CPU backend exports through its registry.
fn cpu_proc(name: &CStr) -> Result<*mut c_void, String> {
    cpu_variant::proc_address(cpu()?.reg.0, name)
        .ok_or_else(|| format!("the CPU backend does not export {}", name.to_string_lossy()))
}

/// Bytes of one row of `n` elements of `ty`.
pub fn row_size(ty: RawType, n: i64) -> usize {
    // SAFETY: pure arithmetic on a type id ggml knows (ids come from our GGUF validation).
    unsafe { sys::ggml_row_size(ty, n) }
}

/// Converts f32 to IEEE half with ggml's own rounding (so masks are bit-identical to llama.cpp's).
pub fn f32_to_f16(src: &[f32], dst: &mut Vec<u16>) {
    dst.resize(src.len(), 0);
    // SAFETY: both slices have `src.len()` elements; ggml_fp16_t is u16.
    unsafe { sys::ggml_fp32_to_fp16_row(src.as_ptr(), dst.as_mut_ptr(), src.len() as i64) };
}

/// A ggml context: an arena for tensor metadata (never data: always `no_alloc`).
pub struct Ctx {
    raw: NonNull<sys::ggml_context>,
}

// SAFETY: a context is only used from one thread at a time (we never share
// `&Ctx` across threads while building); moving it between threads is fine.
unsafe impl Send for Ctx {}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tensor<'a> {
    raw: NonNull<sys::ggml_tensor>,
    _ctx: PhantomData<&'a Ctx>,
}

// SAFETY: see `Ctx`; tensors in weight contexts are immutable after load.
unsafe impl Send for Tensor<'_> {}
unsafe impl Sync for Tensor<'_> {}

impl Ctx {
    /// A context with room for `n_tensors` tensor headers (and one graph of
    /// [`GRAPH_NODES`] nodes when `with_graph`).
    pub fn new(n_tensors: usize, with_graph: bool) -> Ctx {
        init_logging();
        // SAFETY: pure size queries.
        let mut size = n_tensors * unsafe { sys::ggml_tensor_overhead() };
        if with_graph {
            size += unsafe { sys::ggml_graph_overhead_custom(GRAPH_NODES, false) };
        }
        let params = sys::ggml_init_params {
            mem_size: size,
            mem_buffer: ptr::null_mut(),
            no_alloc: true,
        };
        // SAFETY: ggml allocates the arena itself (mem_buffer null).
        let raw = unsafe { sys::ggml_init(params) };
        Ctx {
            raw: NonNull::new(raw).expect("ggml_init: out of memory"),
        }
    }

    fn wrap(&self, raw: *mut sys::ggml_tensor) -> Tensor<'_> {
        // ggml returns null only when the arena is full, a sizing bug of ours.
        Tensor {
            raw: NonNull::new(raw).expect("ggml context out of tensor slots"),
            _ctx: PhantomData,
        }
    }

    pub fn new_tensor(&self, ty: RawType, ne: &[i64]) -> Tensor<'_> {
        assert!((1..=4).contains(&ne.len()));
        // SAFETY: valid context, `ne` has ne.len() elements.
        self.wrap(unsafe {
            sys::ggml_new_tensor(self.raw.as_ptr(), ty, ne.len() as i32, ne.as_ptr())
        })
    }

    /// A new input tensor (marked so the allocator never reuses its memory mid-graph).
    pub fn input(&self, ty: RawType, ne: &[i64], name: &str) -> Tensor<'_> {
        let t = self.new_tensor(ty, ne);
        t.set_name(name);
        // SAFETY: valid tensor.
        unsafe { sys::ggml_set_input(t.raw.as_ptr()) };
        t
    }

    pub fn get_tensor(&self, name: &str) -> Option<Tensor<'_>> {
        let c = CString::new(name).ok()?;
        // SAFETY: valid context and NUL-terminated name.
        let raw = unsafe { sys::ggml_get_tensor(self.raw.as_ptr(), c.as_ptr()) };
        NonNull::new(raw).map(|raw| Tensor {
            raw,
            _ctx: PhantomData,
        })
    }

    pub fn new_graph(&self) -> Graph<'_> {
        // SAFETY: the context was sized with room for one graph.
        let raw = unsafe { sys::ggml_new_graph_custom(self.raw.as_ptr(), GRAPH_NODES, false) };
        Graph {
            raw: NonNull::new(raw).expect("ggml context out of graph space"),
            _ctx: PhantomData,
        }
    }

    pub(crate) fn raw(&self) -> *mut sys::ggml_context {
        self.raw.as_ptr()
    }
}

impl Drop for Ctx {
    fn drop(&mut self) {
        // SAFETY: we own the context; tensors borrowing it are gone (lifetimes).
        unsafe { sys::ggml_free(self.raw.as_ptr()) }
    }
}

/// Graph-building operations. Each returns a new tensor in `ctx`.
/// Shapes are the ggml convention: `ne[0]` is the innermost dimension.
macro_rules! unary {
    ($($name:ident => $f:ident),* $(,)?) => {$(
        pub fn $name<'a>(&'a self, a: Tensor<'_>) -> Tensor<'a> {
            // SAFETY: valid context and tensor handles.
            self.wrap(unsafe { sys::$f(self.raw.as_ptr(), a.raw.as_ptr()) })
        }
    )*};
}
macro_rules! binary {
    ($($name:ident => $f:ident),* $(,)?) => {$(
        pub fn $name<'a>(&'a self, a: Tensor<'_>, b: Tensor<'_>) -> Tensor<'a> {
            // SAFETY: valid context and tensor handles.
            self.wrap(unsafe { sys::$f(self.raw.as_ptr(), a.raw.as_ptr(), b.raw.as_ptr()) })
        }
    )*};
}

impl Ctx {
    unary!(tanh => ggml_tanh, sigmoid => ggml_sigmoid, soft_max => ggml_soft_max,
           sum_rows => ggml_sum_rows, cont => ggml_cont);
    binary!(mul_mat => ggml_mul_mat, add => ggml_add, mul => ggml_mul, div => ggml_div,
            get_rows => ggml_get_rows,
            geglu_split => ggml_geglu_split, swiglu_split => ggml_swiglu_split);

    pub fn clamp<'a>(&'a self, a: Tensor<'_>, min: f32, max: f32) -> Tensor<'a> {
        // SAFETY: valid handles.
        self.wrap(unsafe { sys::ggml_clamp(self.raw.as_ptr(), a.raw.as_ptr(), min, max) })
    }

    /// `a` and `b` joined along `dim` (ggml asserts the other dims agree).
    pub fn concat<'a>(&'a self, a: Tensor<'_>, b: Tensor<'_>, dim: i32) -> Tensor<'a> {
        // SAFETY: valid handles.
        self.wrap(unsafe {
            sys::ggml_concat(self.raw.as_ptr(), a.raw.as_ptr(), b.raw.as_ptr(), dim)
        })
    }

    /// `a` tiled to the shape `ne` (each dim a multiple of `a`'s).
    pub fn repeat_4d<'a>(&'a self, a: Tensor<'_>, ne: [i64; 4]) -> Tensor<'a> {
        // SAFETY: valid handles.
        self.wrap(unsafe {
            sys::ggml_repeat_4d(
                self.raw.as_ptr(),
                a.raw.as_ptr(),
                ne[0],
                ne[1],
                ne[2],
                ne[3],
            )
        })
    }

    /// A new tensor of `a`'s shape with every element `c`.
    pub fn fill<'a>(&'a self, a: Tensor<'_>, c: f32) -> Tensor<'a> {
        // SAFETY: valid handles.
        self.wrap(unsafe { sys::ggml_fill(self.raw.as_ptr(), a.raw.as_ptr(), c) })
    }

    /// Indices (I32) of the `k` largest values of each row, largest first:
    /// a descending argsort and a view of its first `k` columns (so the
    /// result is not contiguous). ggml asserts `k <= a.ne[0]`.
    pub fn argsort_top_k<'a>(&'a self, a: Tensor<'_>, k: i64) -> Tensor<'a> {
        let k = i32::try_from(k).expect("top-k count fits in i32");
        // SAFETY: valid handles.
        self.wrap(unsafe { sys::ggml_argsort_top_k(self.raw.as_ptr(), a.raw.as_ptr(), k) })
    }

    /// One matmul per (row, id): `as` holds one `[k, m]` matrix per expert
    /// (`[k, m, n_expert]`), `b` is `[k, n_b, n_tokens]` and `ids` (I32
    /// `[n_used, n_tokens]`) picks the experts; the result is `[m, n_used, n_tokens]`.
    pub fn mul_mat_id<'a>(&'a self, as_: Tensor<'_>, b: Tensor<'_>, ids: Tensor<'_>) -> Tensor<'a> {
        // SAFETY: valid handles.
        self.wrap(unsafe {
            sys::ggml_mul_mat_id(
                self.raw.as_ptr(),
                as_.raw.as_ptr(),
                b.raw.as_ptr(),
                ids.raw.as_ptr(),
            )
        })
    }

    pub fn scale<'a>(&'a self, a: Tensor<'_>, s: f32) -> Tensor<'a> {
        // SAFETY: valid handles.
        self.wrap(unsafe { sys::ggml_scale(self.raw.as_ptr(), a.raw.as_ptr(), s) })
    }

    pub fn rms_norm<'a>(&'a self, a: Tensor<'_>, eps: f32) -> Tensor<'a> {
        // SAFETY: valid handles.
        self.wrap(unsafe { sys::ggml_rms_norm(self.raw.as_ptr(), a.raw.as_ptr(), eps) })
    }

    pub fn reshape<'a>(&'a self, a: Tensor<'_>, ne: &[i64]) -> Tensor<'a> {
        let c = self.raw.as_ptr();
        let t = a.raw.as_ptr();
        // SAFETY: valid handles; ggml checks the element count.
        self.wrap(unsafe {
            match *ne {
                [a0] => sys::ggml_reshape_1d(c, t, a0),
                [a0, a1] => sys::ggml_reshape_2d(c, t, a0, a1),
                [a0, a1, a2] => sys::ggml_reshape_3d(c, t, a0, a1, a2),
                [a0, a1, a2, a3] => sys::ggml_reshape_4d(c, t, a0, a1, a2, a3),
                _ => panic!("reshape to {} dims", ne.len()),
            }
        })
    }

    /// A view of `a` with shape `ne`, strides `nb` (bytes, for dims 1..) and byte `offset`.
    pub fn view<'a>(
        &'a self,
        a: Tensor<'_>,
        ne: &[i64],
        nb: &[usize],
        offset: usize,
    ) -> Tensor<'a> {
        let c = self.raw.as_ptr();
        let t = a.raw.as_ptr();
        // SAFETY: valid handles; ggml checks the view stays inside `a`.
        self.wrap(unsafe {
            match (ne, nb) {
                ([a0], []) => sys::ggml_view_1d(c, t, *a0, offset),
                ([a0, a1], [b1]) => sys::ggml_view_2d(c, t, *a0, *a1, *b1, offset),
                ([a0, a1, a2], [b1, b2]) => {
                    sys::ggml_view_3d(c, t, *a0, *a1, *a2, *b1, *b2, offset)
                }
                ([a0, a1, a2, a3], [b1, b2, b3]) => {
                    sys::ggml_view_4d(c, t, *a0, *a1, *a2, *a3, *b1, *b2, *b3, offset)
                }
                _ => panic!("view: {} dims with {} strides", ne.len(), nb.len()),
            }
        })
    }

    pub fn permute<'a>(&'a self, a: Tensor<'_>, axes: [i32; 4]) -> Tensor<'a> {
        // SAFETY: valid handles; axes are a permutation (ggml asserts).
        self.wrap(unsafe {
            sys::ggml_permute(
                self.raw.as_ptr(),
                a.raw.as_ptr(),
                axes[0],
                axes[1],
                axes[2],
                axes[3],
            )
        })
    }

    /// Writes the rows of `src` into `dst` at row indices `idx` (I64); returns the updated `dst` view.
    pub fn set_rows<'a>(&'a self, dst: Tensor<'_>, src: Tensor<'_>, idx: Tensor<'_>) -> Tensor<'a> {
        // SAFETY: valid handles.
        self.wrap(unsafe {
            sys::ggml_set_rows(
                self.raw.as_ptr(),
                dst.raw.as_ptr(),
                src.raw.as_ptr(),
                idx.raw.as_ptr(),
            )
        })
    }

    #[allow(clippy::too_many_arguments)]
    pub fn rope_ext<'a>(
        &'a self,
        a: Tensor<'_>,
        pos: Tensor<'_>,
        freq_factors: Option<Tensor<'_>>,
        p: &RopeParams,
    ) -> Tensor<'a> {
        let ff = freq_factors.map_or(ptr::null_mut(), |t| t.raw.as_ptr());
        // SAFETY: valid handles.
        self.wrap(unsafe {
            sys::ggml_rope_ext(
                self.raw.as_ptr(),
                a.raw.as_ptr(),
                pos.raw.as_ptr(),
                ff,
                p.n_dims,
                p.mode,
                p.n_ctx_orig,
                p.freq_base,
                p.freq_scale,
                p.ext_factor,
                p.attn_factor,
                p.beta_fast,
                p.beta_slow,
            )
        })
    }

    /// [`Ctx::rope_ext`] on the `p.n_dims` elements of each row that start
    /// at `offset`; the others are copied (llama.cpp's `ggml_rope_set_offset`).
    pub fn rope_ext_at<'a>(
        &'a self,
        a: Tensor<'_>,
        pos: Tensor<'_>,
        p: &RopeParams,
        offset: i32,
    ) -> Tensor<'a> {
        let t = self.rope_ext(a, pos, None, p);
        // SAFETY: `t` is the rope node just built and `offset` is not negative
        // (ggml asserts both; callers pass a head width).
        unsafe { sys::ggml_rope_set_offset(t.raw.as_ptr(), offset.max(0)) };
        t
    }

    /// Flash attention with an F16 mask, F32 accumulation (as llama.cpp sets it).
    pub fn flash_attn_ext<'a>(
        &'a self,
        q: Tensor<'_>,
        k: Tensor<'_>,
        v: Tensor<'_>,
        mask: Tensor<'_>,
        scale: f32,
        softcap: f32,
    ) -> Tensor<'a> {
        // SAFETY: valid handles.
        let t = self.wrap(unsafe {
            sys::ggml_flash_attn_ext(
                self.raw.as_ptr(),
                q.raw.as_ptr(),
                k.raw.as_ptr(),
                v.raw.as_ptr(),
                mask.raw.as_ptr(),
                scale,
                0.0,
                softcap,
            )
        });
        // SAFETY: `t` is a flash-attention node.
        unsafe {
            sys::ggml_prec_set_acc(t.raw.as_ptr(), sys::GGML_PREC_F32);
        }
        t
    }
}

impl<'a> Tensor<'a> {
    pub fn ne(&self) -> [i64; 4] {
        // SAFETY: the handle is valid for 'a.
        unsafe { (*self.raw.as_ptr()).ne }
    }
    pub fn nb(&self) -> [usize; 4] {
        // SAFETY: as above.
        unsafe { (*self.raw.as_ptr()).nb }
    }
    pub fn ty(&self) -> RawType {
        // SAFETY: as above.
        unsafe { (*self.raw.as_ptr()).type_ }
    }
    pub fn nbytes(&self) -> usize {
        // SAFETY: as above.
        unsafe { sys::ggml_nbytes(self.raw.as_ptr()) }
    }
    pub fn n_dims(&self) -> i32 {
        // SAFETY: as above.
        unsafe { sys::ggml_n_dims(self.raw.as_ptr()) }
    }
    pub fn set_name(&self, name: &str) {
        let c = CString::new(name).unwrap_or_default();
        // SAFETY: ggml copies at most 63 bytes of the name.
        unsafe { sys::ggml_set_name(self.raw.as_ptr(), c.as_ptr()) };
    }
    pub fn set_output(&self) {
        // SAFETY: valid handle.
        unsafe { sys::ggml_set_output(self.raw.as_ptr()) };
    }
    /// True once the tensor has memory (a buffer or a data pointer).
    pub fn is_allocated(&self) -> bool {
        // SAFETY: valid handle.
        unsafe { !(*self.raw.as_ptr()).data.is_null() }
    }

    /// Copies `data` into the tensor, which must be allocated and exactly that many bytes.
    pub fn write<T: Copy>(&self, data: &[T]) {
        let bytes = std::mem::size_of_val(data);
        assert!(
            self.is_allocated() && bytes == self.nbytes(),
            "tensor write of {bytes} bytes into {} bytes",
            self.nbytes()
        );
        // SAFETY: sizes checked above; the tensor's buffer is a host buffer.
        unsafe {
            sys::ggml_backend_tensor_set(
                self.raw.as_ptr(),
                data.as_ptr() as *const c_void,
                0,
                bytes,
            )
        };
    }

    /// Copies `bytes` from the raw source into the tensor (repacking if its buffer does that).
    pub fn write_bytes(&self, data: &[u8]) {
        assert!(self.is_allocated() && data.len() == self.nbytes());
        // SAFETY: sizes checked above.
        unsafe {
            sys::ggml_backend_tensor_set(
                self.raw.as_ptr(),
                data.as_ptr() as *const c_void,
                0,
                data.len(),
            )
        };
    }

    /// Fills `out` from the tensor's first `out.len()` bytes (moving KV rows).
    pub fn read_front(&self, out: &mut [u8]) {
        assert!(self.is_allocated() && out.len() <= self.nbytes());
        if out.is_empty() {
            return;
        }
        // SAFETY: an allocated host tensor of at least `out.len()` bytes
        // (checked above); `out` is that long.
        unsafe {
            sys::ggml_backend_tensor_get(
                self.raw.as_ptr(),
                out.as_mut_ptr() as *mut c_void,
                0,
                out.len(),
            )
        };
    }

    /// Copies `data` into the tensor's first bytes and zeroes the rest.
    pub fn write_front(&self, data: &[u8]) {
        let n = self.nbytes();
        assert!(self.is_allocated() && data.len() <= n);
        // SAFETY: an allocated host tensor of `n` bytes; both ranges lie inside it.
        unsafe {
            if !data.is_empty() {
                sys::ggml_backend_tensor_set(
                    self.raw.as_ptr(),
                    data.as_ptr() as *const c_void,
                    0,
                    data.len(),
                );
            }
            if data.len() < n {
                sys::ggml_backend_tensor_memset(self.raw.as_ptr(), 0, data.len(), n - data.len());
            }
        }
    }

    /// Reads the whole tensor as f32 (it must be F32).
    pub fn read_f32(&self, out: &mut Vec<f32>) {
        assert_eq!(self.ty(), TYPE_F32);
        let n = self.nbytes() / 4;
        out.resize(n, 0.0);
        // SAFETY: `out` holds exactly nbytes; the tensor is allocated on a host buffer.
        unsafe {
            sys::ggml_backend_tensor_get(
                self.raw.as_ptr(),
                out.as_mut_ptr() as *mut c_void,
                0,
                n * 4,
            )
        };
    }

    /// Reads the whole tensor as i32 (it must be I32 and contiguous).
    pub fn read_i32(&self, out: &mut Vec<i32>) {
        assert_eq!(self.ty(), TYPE_I32);
        let n = self.nbytes() / 4;
        out.resize(n, 0);
        // SAFETY: `out` holds exactly nbytes; the tensor is allocated on a host buffer.
        unsafe {
            sys::ggml_backend_tensor_get(
                self.raw.as_ptr(),
                out.as_mut_ptr() as *mut c_void,
                0,
                n * 4,
            )
        };
    }

    /// Points this (unallocated) tensor at `addr` inside `buf`.
    ///
    /// # Safety
    /// `addr` must point inside `buf` with at least `nbytes()` bytes left.
    unsafe fn alloc_at(&self, buf: &Buffer, addr: *mut u8) -> Result<(), String> {
        // SAFETY: caller's contract.
        let st = unsafe {
            sys::ggml_backend_tensor_alloc(buf.raw.as_ptr(), self.raw.as_ptr(), addr as *mut c_void)
        };
        if st == sys::GGML_STATUS_SUCCESS {
            Ok(())
        } else {
            Err(format!("ggml_backend_tensor_alloc failed with status {st}"))
        }
    }

    pub(crate) fn raw(&self) -> *mut sys::ggml_tensor {
        self.raw.as_ptr()
    }
}

/// A computation graph built in a [`Ctx`].
pub struct Graph<'a> {
    raw: NonNull<sys::ggml_cgraph>,
    _ctx: PhantomData<&'a Ctx>,
}

impl Graph<'_> {
    pub fn expand(&mut self, t: Tensor<'_>) {
        // SAFETY: valid graph and tensor from compatible contexts.
        unsafe { sys::ggml_build_forward_expand(self.raw.as_ptr(), t.raw.as_ptr()) }
    }
}

/// A backend buffer (weights, KV cache or compute memory).
pub struct Buffer {
    raw: NonNull<sys::ggml_backend_buffer>,
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

fn cpu_device() -> Result<sys::ggml_backend_dev_t, String> {
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

/// Would a `mul_mat(weight, x)` with `weight` stored in `buft` run on the CPU?
/// Asked the way llama.cpp asks it: a dummy buffer of that type and a fake op.
pub fn buft_supports_mul_mat(buft: BufferType, weight: Tensor<'_>) -> bool {
    let ctx = Ctx::new(4, false);
    // SAFETY: zero-sized allocation of a valid buffer type.
    let dummy = unsafe { sys::ggml_backend_buft_alloc_buffer(buft.0, 0) };
    if dummy.is_null() {
        return false;
    }
    let ne = weight.ne();
    let w = ctx.new_tensor(weight.ty(), &ne[..weight.n_dims().max(1) as usize]);
    // SAFETY: `w` is a metadata-only tensor we own; pointing its buffer at the
    // dummy makes the CPU device consult that buffer type's support table.
    unsafe { (*w.raw()).buffer = dummy };
    let x = ctx.new_tensor(TYPE_F32, &[ne[0], 512]);
    let op = ctx.mul_mat(w, x);
    // SAFETY: valid device and op; then free the dummy buffer we allocated.
    let ok =
        cpu_device().is_ok_and(|dev| unsafe { sys::ggml_backend_dev_supports_op(dev, op.raw()) });
    unsafe {
        (*w.raw()).buffer = ptr::null_mut();
        sys::ggml_backend_buffer_free(dummy);
    }
    ok
}

/// Would a `mul_mat_id(weight, x, ids)` with the 3-D expert `weight` stored
/// in `buft` run on the CPU? Asked as llama.cpp's loader asks it (a dummy
/// buffer, `n_used` experts per row, 512 rows).
pub fn buft_supports_mul_mat_id(buft: BufferType, weight: Tensor<'_>, n_used: i64) -> bool {
    let ctx = Ctx::new(4, false);
    // SAFETY: zero-sized allocation of a valid buffer type.
    let dummy = unsafe { sys::ggml_backend_buft_alloc_buffer(buft.0, 0) };
    if dummy.is_null() {
        return false;
    }
    let ne = weight.ne();
    let w = ctx.new_tensor(weight.ty(), &ne[..weight.n_dims().max(1) as usize]);
    // SAFETY: as in `buft_supports_mul_mat`.
    unsafe { (*w.raw()).buffer = dummy };
    let x = ctx.new_tensor(TYPE_F32, &[ne[0], n_used, 512]);
    let ids = ctx.new_tensor(TYPE_I32, &[n_used, 512]);
    let op = ctx.mul_mat_id(w, x, ids);
    // SAFETY: valid device and op; then free the dummy buffer we allocated.
    let ok =
        cpu_device().is_ok_and(|dev| unsafe { sys::ggml_backend_dev_supports_op(dev, op.raw()) });
    unsafe {
        (*w.raw()).buffer = ptr::null_mut();
        sys::ggml_backend_buffer_free(dummy);
    }
    ok
}

/// A graph computation's status as a result.
fn computed(st: sys::ggml_status) -> Result<(), String> {
    if st == sys::GGML_STATUS_SUCCESS {
        Ok(())
    } else {
        Err(format!("ggml graph compute failed with status {st}"))
    }
}

/// The CPU compute backend with a fixed thread count.
pub struct CpuBackend {
    raw: NonNull<sys::ggml_backend>,
}

// SAFETY: a backend is used by one thread at a time (`&mut self` for compute).
unsafe impl Send for CpuBackend {}

impl CpuBackend {
    pub fn new(n_threads: usize) -> Result<CpuBackend, String> {
        let dev = cpu_device()?;
        // SAFETY: the CPU device's constructor takes no parameters.
        let raw = unsafe { sys::ggml_backend_dev_init(dev, ptr::null()) };
        let b = CpuBackend {
            raw: NonNull::new(raw).ok_or("the CPU backend could not start")?,
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
    sched: NonNull<sys::ggml_backend_sched>,
    gpu: Option<NonNull<sys::ggml_backend>>,
    cpu: CpuBackend,
    buft: BufferType,
}

// SAFETY: used by one thread at a time (`&mut self` to allocate or compute).
unsafe impl Send for Executor {}

impl Executor {
    /// An executor on `gpu`, or on the CPU alone; the CPU backend runs
    /// `n_threads` threads either way.
    pub fn new(
        gpu: Option<super::device::GpuDevice>,
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
        })
    }

    /// Where the stage's own tensors (KV cache, device weights) go.
    pub fn buffer_type(&self) -> BufferType {
        self.buft
    }

    pub fn on_gpu(&self) -> bool {
        self.gpu.is_some()
    }

    /// Sizes the compute buffers for `graph` (they only grow).
    pub fn reserve(&mut self, graph: &Graph<'_>) -> Result<(), String> {
        // SAFETY: valid scheduler and graph.
        if unsafe { sys::ggml_backend_sched_reserve(self.sched.as_ptr(), graph.raw.as_ptr()) } {
            Ok(())
        } else {
            Err("could not allocate the compute buffer".into())
        }
    }

    /// Gives `graph`'s tensors memory (the previous graph's is reused), so
    /// that its inputs can be written before [`Executor::compute`].
    pub fn alloc(&mut self, graph: &Graph<'_>) -> Result<(), String> {
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
    raw: NonNull<sys::ggml_gallocr>,
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
    ctx: Ctx,
    tensors: Vec<NonNull<sys::ggml_tensor>>,
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
fn repacked_buft_for(weight: Tensor<'_>) -> Result<Option<BufferType>, String> {
    Ok(cpu_extra_buffer_types()?
        .into_iter()
        .find(|b| buft_supports_mul_mat(*b, weight)))
}

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
    gpu: Option<super::device::GpuDevice>,
    n_threads: usize,
    ty: RawType,
    bytes: usize,
    budget: std::time::Duration,
) -> Result<f64, String> {
    use std::time::Instant;
    let mut exec = Executor::new(gpu, n_threads)?;
    let k: i64 = 4096;
    // Rows in eights: the CPU's repacked kernels take them in blocks of 8.
    let rows = ((bytes / row_size(ty, k)).max(8) / 8 * 8) as i64;
    let mut store = TensorStore::new(1);
    let wi = store.add(ty, &[k, rows], "calibration.weight");
    let buft = if exec.on_gpu() {
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
