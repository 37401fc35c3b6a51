//! The KV cache of one stage: preallocated K and V tensors for each of its
//! layers, and a table of cells saying which sequence and position each
//! cell holds. Sequences share one pool of cells (llama.cpp's "unified"
//! cache), so a batch of several sequences is one attention op per layer,
//! with a mask that keeps each token to its own sequence's past.

use crate::error::EngineError;
use crate::ffi::ggml::{f32_to_f16, Buffer, CpuBackend, Tensor, TensorStore, TYPE_F16};
use crate::model::Hparams;

/// llama.cpp pads the attended cell count to 256; masked cells cost a
/// little compute and change nothing numerically.
const N_KV_PAD: usize = 256;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Cell {
    seq: u32,
    pos: i32,
}

/// Sizing of a KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct KvConfig {
    /// Context length of one sequence (positions 0..n_ctx).
    pub n_ctx: usize,
    /// Sequences that can be resident at once.
    pub n_seq: usize,
}

impl KvConfig {
    pub fn n_cells(&self) -> usize {
        self.n_ctx * self.n_seq
    }

    /// Bytes for `n_layers` layers of this model (F16 K and V; K only for
    /// absorbed MLA, see [`Hparams::n_embd_v_cache`]).
    pub fn bytes(&self, hp: &Hparams, n_layers: usize) -> u64 {
        hp.kv_bytes_per_token_layer() * self.n_cells() as u64 * n_layers as u64
    }
}

pub struct KvCache {
    cfg: KvConfig,
    /// Whether each layer has a V tensor after its K (not for absorbed MLA).
    has_v: bool,
    first_layer: u32,
    /// Layers the store holds tensors for.
    store_layers: usize,
    store: TensorStore,
    _buffer: Option<Buffer>,
    cells: Vec<Option<Cell>>,
    /// Highest used cell + 1 (cells beyond are all free).
    used_end: usize,
    /// Cells in use (kept, not counted: workers report it every step).
    n_used: usize,
}

impl KvCache {
    pub fn new(
        hp: &Hparams,
        layers: std::ops::Range<u32>,
        cfg: KvConfig,
        backend: &CpuBackend,
    ) -> Result<KvCache, EngineError> {
        if cfg.n_ctx == 0 || cfg.n_seq == 0 {
            return Err(EngineError::Config(format!(
                "KV cache needs n_ctx > 0 and n_seq > 0 (got {} x {})",
                cfg.n_ctx, cfg.n_seq
            )));
        }
        let has_v = hp.n_embd_v_cache() > 0;
        let mut store = TensorStore::new(2 * layers.len());
        for il in layers.clone() {
            store.add(
                TYPE_F16,
                &[hp.n_embd_k_gqa() as i64, cfg.n_cells() as i64],
                &format!("cache_k_l{il}"),
            );
            if has_v {
                store.add(
                    TYPE_F16,
                    &[hp.n_embd_v_cache() as i64, cfg.n_cells() as i64],
                    &format!("cache_v_l{il}"),
                );
            }
        }
        let buffer = if store.is_empty() {
            None
        } else {
            let want = cfg.bytes(hp, layers.len());
            let buf = Buffer::alloc_ctx(store.ctx(), backend.buffer_type()).ok_or(
                EngineError::OutOfMemory {
                    what: "KV cache".into(),
                    bytes: want,
                },
            )?;
            buf.clear(0);
            Some(buf)
        };
        Ok(KvCache {
            cfg,
            has_v,
            first_layer: layers.start,
            store_layers: layers.len(),
            store,
            _buffer: buffer,
            cells: vec![None; cfg.n_cells()],
            used_end: 0,
            n_used: 0,
        })
    }

    pub fn config(&self) -> KvConfig {
        self.cfg
    }

    /// K and V tensors of layer `il` (`[n_embd_gqa, n_cells]`). Panics for
    /// a cache without V (absorbed MLA reads its values from [`Self::k`]).
    pub fn layer(&self, il: u32) -> (Tensor<'_>, Tensor<'_>) {
        assert!(self.has_v, "this KV cache holds no V tensors");
        let i = 2 * (il - self.first_layer) as usize;
        (self.store.get(i), self.store.get(i + 1))
    }

    /// The K tensor of layer `il` (`[n_embd_k_gqa, n_cells]`).
    pub fn k(&self, il: u32) -> Tensor<'_> {
        let per_layer = if self.has_v { 2 } else { 1 };
        self.store.get(per_layer * (il - self.first_layer) as usize)
    }

    /// Bytes of the K and V tensors this cache allocated.
    pub fn allocated_bytes(&self) -> u64 {
        let per_layer = if self.has_v { 2 } else { 1 };
        (0..self.store_layers * per_layer)
            .map(|i| self.store.get(i).nbytes() as u64)
            .sum()
    }

    /// Cells in use.
    pub fn used(&self) -> usize {
        self.n_used
    }

    /// Assigns a free cell to each (seq, pos). All or nothing: on error no cell is taken.
    pub fn allocate(&mut self, seqs: &[u32], pos: &[i32]) -> Result<Vec<i64>, EngineError> {
        for (&s, &p) in seqs.iter().zip(pos) {
            if s as usize >= self.cfg.n_seq {
                return Err(EngineError::Config(format!(
                    "sequence id {s} is out of range: the KV cache holds {} sequences",
                    self.cfg.n_seq
                )));
            }
            if p < 0 || p as usize >= self.cfg.n_ctx {
                return Err(EngineError::ContextFull {
                    pos: p.max(0) as usize,
                    n_ctx: self.cfg.n_ctx,
                });
            }
        }
        let free = self.cells.len() - self.used();
        if free < seqs.len() {
            return Err(EngineError::KvFull {
                needed: seqs.len(),
                free,
                cells: self.cells.len(),
            });
        }
        let mut out = Vec::with_capacity(seqs.len());
        let mut next = 0;
        for (&seq, &pos) in seqs.iter().zip(pos) {
            while self.cells[next].is_some() {
                next += 1;
            }
            self.cells[next] = Some(Cell { seq, pos });
            self.n_used += 1;
            out.push(next as i64);
            self.used_end = self.used_end.max(next + 1);
        }
        Ok(out)
    }

    /// Frees the given cells (a step that failed after `allocate`).
    pub fn release(&mut self, idx: &[i64]) {
        for &i in idx {
            if self.cells[i as usize].take().is_some() {
                self.n_used -= 1;
            }
        }
        self.shrink();
    }

    /// Frees every cell of `seq`; with `from`, only positions `>= from`.
    pub fn remove_seq(&mut self, seq: u32, from: Option<i32>) {
        for c in &mut self.cells {
            if matches!(c, Some(cell) if cell.seq == seq && from.is_none_or(|f| cell.pos >= f)) {
                *c = None;
                self.n_used -= 1;
            }
        }
        self.shrink();
    }

    fn shrink(&mut self) {
        while self.used_end > 0 && self.cells[self.used_end - 1].is_none() {
            self.used_end -= 1;
        }
    }

    /// How many cells the next step attends over.
    pub fn n_kv(&self) -> usize {
        self.used_end
            .div_ceil(N_KV_PAD)
            .max(1)
            .saturating_mul(N_KV_PAD)
            .min(self.cells.len())
    }

    /// The F16 mask `[n_kv, n_tokens]` for this step: 0 where token `t` may
    /// see cell `c` (same sequence, not in the future, within `window` if
    /// set), -inf elsewhere.
    pub fn mask(
        &self,
        seqs: &[u32],
        pos: &[i32],
        n_kv: usize,
        window: Option<u32>,
        out: &mut Vec<u16>,
    ) {
        let mut row = vec![f32::NEG_INFINITY; n_kv * seqs.len()];
        for (t, (&s, &p)) in seqs.iter().zip(pos).enumerate() {
            let r = &mut row[t * n_kv..(t + 1) * n_kv];
            for (c, cell) in self.cells[..n_kv].iter().enumerate() {
                if let Some(cell) = cell {
                    let visible = cell.seq == s
                        && cell.pos <= p
                        && window.is_none_or(|w| p - cell.pos < w as i32);
                    if visible {
                        r[c] = 0.0;
                    }
                }
            }
        }
        f32_to_f16(&row, out);
    }
}
