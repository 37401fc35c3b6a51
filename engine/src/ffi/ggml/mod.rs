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

mod attention;
mod backend;
mod check;
mod experts_kernel;

use super::cpu_variant;
pub use attention::ORDER_HEADER;
pub use backend::{
    buft_supports, cpu_extra_buffer_types, Buffer, BufferType, CpuBackend, Executor,
    GraphAllocator, TensorStore, WeightRead,
};
pub use check::{matmul_check, weight_read_rate};
pub use experts_kernel::{available as expert_kernel_available, takes_type as expert_kernel_takes};
use llama_cpp_sys_2 as sys;
use std::cell::Cell;
use std::ffi::{c_void, CStr, CString};
use std::marker::PhantomData;
use std::ptr::{self, NonNull};
use std::sync::Once;
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

/// IEEE half to single, exactly (every f16 is an f32: subnormals,
/// infinities and NaN included).
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = ((h >> 15) as u32) << 31;
    let exp = ((h >> 10) & 0x1f) as u32;
    let man = (h & 0x3ff) as u32;
    let bits = match (exp, man) {
        (0, 0) => sign,
        (0, m) => {
            // Subnormal: normalise.
            let shift = m.leading_zeros() - 21;
            sign | ((127 - 15 + 1 - shift) << 23) | (((m << shift) & 0x3ff) << 13)
        }
        (31, m) => sign | 0x7f80_0000 | (m << 13),
        (e, m) => sign | ((e + 127 - 15) << 23) | (m << 13),
    };
    f32::from_bits(bits)
}

/// A ggml context: an arena for tensor metadata (never data: always `no_alloc`).
pub struct Ctx {
    raw: NonNull<sys::ggml_context>,
    /// Nodes of the graph it has room for.
    graph_nodes: usize,
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
        let nodes = if with_graph { GRAPH_NODES } else { 0 };
        // SAFETY: ggml allocates the arena itself (mem_buffer null).
        unsafe { Self::init(ptr::null_mut(), Self::size(n_tensors, nodes), nodes) }
    }

    /// A context for one small graph of at most `nodes` nodes (and as many
    /// tensors). Cheaper to make than `Ctx::new(GRAPH_NODES, true)`, and an
    /// allocator that reserves for its graph clears a table sized by it on
    /// every allocation (~400 KB for [`GRAPH_NODES`]): for graphs made per
    /// call, such as an expert worker's.
    pub fn for_graph(nodes: usize) -> Ctx {
        // SAFETY: ggml allocates the arena itself (mem_buffer null).
        unsafe { Self::init(ptr::null_mut(), Self::size(nodes, nodes), nodes) }
    }

    /// Bytes of metadata a context of `n_tensors` tensors (and a graph of
    /// `nodes` nodes, if any) needs.
    fn size(n_tensors: usize, nodes: usize) -> usize {
        // SAFETY: pure size queries.
        let mut size = n_tensors * unsafe { sys::ggml_tensor_overhead() };
        if nodes > 0 {
            size += unsafe { sys::ggml_graph_overhead_custom(nodes, false) };
        }
        size
    }

    /// # Safety
    /// `mem` is null (ggml allocates `size` bytes itself), or `size` bytes,
    /// 16-aligned, that nothing else uses while the context lives; `size`
    /// has room for a graph of `graph_nodes` nodes.
    unsafe fn init(mem: *mut c_void, size: usize, graph_nodes: usize) -> Ctx {
        init_logging();
        let params = sys::ggml_init_params {
            mem_size: size,
            mem_buffer: mem,
            no_alloc: true,
        };
        // SAFETY: the caller's contract.
        let raw = unsafe { sys::ggml_init(params) };
        Ctx {
            raw: NonNull::new(raw).expect("ggml_init: out of memory"),
            graph_nodes,
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
        assert!(
            self.graph_nodes > 0,
            "a context made without room for a graph"
        );
        // SAFETY: the context was sized with room for one graph of this size.
        let raw = unsafe { sys::ggml_new_graph_custom(self.raw.as_ptr(), self.graph_nodes, false) };
        Graph {
            raw: NonNull::new(raw).expect("ggml context out of graph space"),
            _ctx: PhantomData,
        }
    }

    pub(crate) fn raw(&self) -> *mut sys::ggml_context {
        self.raw.as_ptr()
    }
}

/// Memory for a stage's step graphs, kept from one step to the next.
///
/// ggml's CUDA backend replays a graph it has seen as one CUDA graph (one
/// launch for the whole step instead of one per kernel; on a fast GPU the
/// launches are most of a small model's decode time) only when every node
/// matches the last time's, the addresses of its tensor headers included.
/// A context in fresh heap memory every step puts them elsewhere; built in
/// the same memory, the same step is the same graph. Written for this,
/// because the point is the addresses: no allocator crate promises them.
///
/// The arena also keeps its last graph for the next step of the same shape
/// ([`GraphArena::kept`]), as llama.cpp reuses its graph: such a step
/// skips building the graph and ggml's scheduler splitting and placing it,
/// and only writes its inputs.
pub struct GraphArena {
    /// The context in `mem`, from the last [`GraphArena::reset`] on.
    ctx: Option<Ctx>,
    /// The graph last built here, kept for the next step of its shape.
    kept: Cell<Option<Kept>>,
    mem: Box<[ArenaBlock]>,
}

/// A graph built in an arena and allocated by an executor: what a step of
/// the same `shape` computes again.
#[derive(Clone, Copy)]
struct Kept {
    shape: [usize; 4],
    graph: NonNull<sys::ggml_cgraph>,
    out: NonNull<sys::ggml_tensor>,
    /// [`Executor::allocs`] right after its allocation: any later
    /// allocation of the executor may have put other tensors where its
    /// tensors were.
    allocs: u64,
}

// SAFETY: the kept pointers point into the arena's own memory (the context's
// objects), used only through `&self` borrows of the arena.
unsafe impl Send for GraphArena {}

#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct ArenaBlock([u8; 64]);

impl Default for GraphArena {
    fn default() -> Self {
        let blocks =
            Ctx::size(GRAPH_NODES, GRAPH_NODES).div_ceil(std::mem::size_of::<ArenaBlock>());
        GraphArena {
            ctx: None,
            kept: Cell::new(None),
            mem: vec![ArenaBlock([0; 64]); blocks].into_boxed_slice(),
        }
    }
}

impl GraphArena {
    /// Starts a new context of [`GRAPH_NODES`] tensors and a graph, as
    /// `Ctx::new(GRAPH_NODES, true)`, in this memory ([`GraphArena::ctx`]);
    /// the last one's tensors and the kept graph are gone.
    pub fn reset(&mut self) {
        self.kept.set(None);
        // The old context goes first: the new one takes over its memory.
        self.ctx = None;
        let size = std::mem::size_of_val(&*self.mem);
        // SAFETY: `size` bytes, 64-aligned, owned by the arena for as long as
        // the context lives (it drops before `mem`, and before any reset).
        self.ctx =
            Some(unsafe { Ctx::init(self.mem.as_mut_ptr() as *mut c_void, size, GRAPH_NODES) });
    }

    /// The context of the last [`GraphArena::reset`].
    pub fn ctx(&self) -> &Ctx {
        self.ctx.as_ref().expect("GraphArena::reset first")
    }

    /// Keeps `graph` (built in this arena's context and allocated by an
    /// executor whose [`Executor::allocs`] is now `allocs`), with its output
    /// `out`, for the next step of the same `shape`.
    pub fn keep(&self, shape: [usize; 4], graph: &Graph<'_>, out: Tensor<'_>, allocs: u64) {
        self.kept.set(Some(Kept {
            shape,
            graph: graph.raw,
            out: out.raw,
            allocs,
        }));
    }

    /// Whether the kept graph serves a step of `shape` (its executor having
    /// allocated nothing since: its [`Executor::allocs`] is still `allocs`);
    /// if not, [`GraphArena::reset`] for a graph built afresh.
    pub fn reuse_or_reset(&mut self, shape: [usize; 4], allocs: u64) -> bool {
        let reuse = self.kept(shape, allocs).is_some();
        if !reuse {
            self.reset();
        }
        reuse
    }

    /// The kept graph and its output, when it has `shape` and its executor
    /// allocated nothing since (its [`Executor::allocs`] is still `allocs`):
    /// its tensors are where they were, and only its inputs need writing.
    pub fn kept(&self, shape: [usize; 4], allocs: u64) -> Option<(Graph<'_>, Tensor<'_>)> {
        let k = self.kept.get()?;
        (k.shape == shape && k.allocs == allocs).then_some((
            Graph {
                raw: k.graph,
                _ctx: PhantomData,
            },
            Tensor {
                raw: k.out,
                _ctx: PhantomData,
            },
        ))
    }
}

/// A graph built once in a context of its own and kept with it, for a
/// caller that computes the same graph again with new inputs (an expert
/// worker's calls: one graph per layer and call size). Its allocator must
/// not have moved its tensors since it was allocated: the caller checks.
pub struct OwnedGraph {
    graph: NonNull<sys::ggml_cgraph>,
    out: NonNull<sys::ggml_tensor>,
    ctx: Ctx,
}

// SAFETY: the pointers point into `ctx`'s own memory, which moves with it;
// used by one thread at a time, as a `Ctx`.
unsafe impl Send for OwnedGraph {}

impl OwnedGraph {
    /// Builds in `ctx` the graph `build` returns, with its output.
    pub fn build(ctx: Ctx, build: impl for<'c> FnOnce(&'c Ctx) -> (Graph<'c>, Tensor<'c>)) -> Self {
        let (graph, out) = build(&ctx);
        let (graph, out) = (graph.raw, out.raw);
        OwnedGraph { graph, out, ctx }
    }

    pub fn ctx(&self) -> &Ctx {
        &self.ctx
    }

    pub fn graph(&self) -> Graph<'_> {
        Graph {
            raw: self.graph,
            _ctx: PhantomData,
        }
    }

    pub fn out(&self) -> Tensor<'_> {
        Tensor {
            raw: self.out,
            _ctx: PhantomData,
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The same step built twice in a [`GraphArena`] puts every tensor
    /// header at the same address, as ggml-cuda's CUDA-graph reuse needs,
    /// and a context there holds thousands of nodes.
    #[test]
    fn an_arena_builds_the_same_graph_at_the_same_addresses() {
        let build = |arena: &mut GraphArena| -> Vec<usize> {
            arena.reset();
            let ctx = arena.ctx();
            let mut graph = ctx.new_graph();
            let mut x = ctx.new_tensor(TYPE_F32, &[8]);
            let mut addrs = vec![x.raw.as_ptr() as usize];
            for _ in 0..4000 {
                x = ctx.scale(x, 0.5);
                addrs.push(x.raw.as_ptr() as usize);
            }
            graph.expand(x);
            addrs
        };
        let mut arena = GraphArena::default();
        let first = build(&mut arena);
        // Heap allocations in between must not move the next step's graph.
        let noise: Vec<Vec<u8>> = (0..64).map(|i| vec![0u8; 4096 << (i % 8)]).collect();
        assert_eq!(build(&mut arena), first);
        drop(noise);
    }
}
