//! The cache itself: preallocated K and V tensors per layer and the cell table.

use std::ops::Range;

use super::{KvConfig, KvLayer, KvLayers};
use crate::error::EngineError;
use crate::ffi::ggml::{f32_to_f16, Buffer, BufferType, Tensor, TensorStore, TYPE_F16};
use crate::model::Hparams;

/// llama.cpp pads the attended cell count to 256; masked cells cost a
/// little compute and change nothing numerically.
const N_KV_PAD: usize = 256;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Cell {
    seq: u32,
    pos: i32,
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
        buft: BufferType,
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
            let buf = Buffer::alloc_ctx(store.ctx(), buft).ok_or(EngineError::OutOfMemory {
                what: "KV cache".into(),
                bytes: want,
            })?;
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

    /// The layers this cache holds.
    pub fn layers(&self) -> Range<u32> {
        self.first_layer..self.first_layer + self.store_layers as u32
    }

    /// Whether each layer caches V (not for absorbed MLA).
    pub fn has_v(&self) -> bool {
        self.has_v
    }

    /// Cells in use.
    pub fn used(&self) -> usize {
        self.n_used
    }

    /// Assigns a free cell to each (seq, pos). All or nothing: on error no cell is taken.
    pub fn allocate(&mut self, seqs: &[u32], pos: &[i32]) -> Result<Vec<i64>, EngineError> {
        self.check_tokens(seqs, pos)?;
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

    /// Every sequence id within the cache's sequences, every position
    /// within its context.
    fn check_tokens(&self, seqs: &[u32], pos: &[i32]) -> Result<(), EngineError> {
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
        Ok(())
    }

    /// Puts each (seq, pos) into the given cell, as `allocate` would have
    /// chosen it earlier (a replay laying a sequence's cache out as before).
    /// All or nothing: every cell must be in range, free and named once.
    pub fn place(&mut self, seqs: &[u32], pos: &[i32], cells: &[i64]) -> Result<(), EngineError> {
        self.check_tokens(seqs, pos)?;
        for (i, &c) in cells.iter().enumerate() {
            let taken = usize::try_from(c)
                .ok()
                .and_then(|c| self.cells.get(c))
                .map(Option::is_some);
            match taken {
                None => {
                    return Err(EngineError::Config(format!(
                        "KV cell {c} is out of range: the cache has {} cells",
                        self.cells.len()
                    )))
                }
                Some(true) => return Err(EngineError::Config(format!("KV cell {c} is in use"))),
                Some(false) if cells[..i].contains(&c) => {
                    return Err(EngineError::Config(format!(
                        "KV cell {c} is named twice in one step"
                    )))
                }
                Some(false) => {}
            }
        }
        for ((&seq, &pos), &c) in seqs.iter().zip(pos).zip(cells) {
            self.cells[c as usize] = Some(Cell { seq, pos });
            self.n_used += 1;
            self.used_end = self.used_end.max(c as usize + 1);
        }
        Ok(())
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

    /// Takes out the cache of `layers` (all inside this cache's range): the
    /// cell table and each layer's K (and V) rows up to the last used cell.
    /// The cache itself is unchanged.
    pub fn export(&self, layers: Range<u32>) -> Result<KvLayers, EngineError> {
        let mine = self.layers();
        if layers.start > layers.end || layers.start < mine.start || layers.end > mine.end {
            return Err(EngineError::Config(format!(
                "cannot export the KV cache of layers {}-{}: this cache holds layers {}",
                layers.start,
                layers.end.saturating_sub(1),
                crate::fmt_layers(&mine)
            )));
        }
        let rows = self.used_end;
        Ok(KvLayers {
            cells: self.cells[..rows]
                .iter()
                .map(|c| c.map(|c| (c.seq, c.pos)))
                .collect(),
            layers: layers
                .map(|il| {
                    let k = read_rows(self.k(il), rows);
                    let v = if self.has_v {
                        read_rows(self.layer(il).1, rows)
                    } else {
                        Vec::new()
                    };
                    KvLayer { layer: il, k, v }
                })
                .collect(),
        })
    }

    /// Puts exported layers into this cache. Their cell table must be this
    /// cache's (the same sequence and position in every cell up to the last
    /// used one), or this cache must hold no cell and then takes it. Every
    /// layer must be in this cache's range, once, with rows of this cache's
    /// sizes. All or nothing: every check runs before anything is written.
    /// A layer's cells past the carried table are zeroed (they are free).
    pub fn import(&mut self, kv: &KvLayers) -> Result<(), EngineError> {
        let bad = |why: String| Err(EngineError::Config(format!("KV import: {why}")));
        if self.store_layers == 0 && kv.layers.is_empty() {
            // No layers here, so no table to keep (such a stage never takes cells).
            return Ok(());
        }
        let take_table = self.n_used == 0;
        self.check_table(&kv.cells, take_table)?;
        let n = kv.cells.len();
        let mine = self.layers();
        let (k_row, v_row) = self.row_bytes();
        for (i, l) in kv.layers.iter().enumerate() {
            if !mine.contains(&l.layer) {
                return bad(format!(
                    "layer {} is outside this cache's layers {}",
                    l.layer,
                    crate::fmt_layers(&mine)
                ));
            }
            if kv.layers[..i].iter().any(|o| o.layer == l.layer) {
                return bad(format!("layer {} comes twice", l.layer));
            }
            for (what, got, row) in [("K", l.k.len(), k_row), ("V", l.v.len(), v_row)] {
                if got != n * row {
                    return bad(format!(
                        "layer {}'s {what} is {got} bytes but {n} cells of {row} bytes are {}",
                        l.layer,
                        n * row
                    ));
                }
            }
        }
        for l in &kv.layers {
            write_rows(self.k(l.layer), &l.k);
            if self.has_v {
                write_rows(self.layer(l.layer).1, &l.v);
            }
        }
        if take_table {
            self.cells.fill(None);
            for (c, k) in self.cells.iter_mut().zip(&kv.cells) {
                *c = k.map(|(seq, pos)| Cell { seq, pos });
            }
            self.n_used = kv.cells.iter().flatten().count();
            self.used_end = n;
            self.shrink();
        }
        Ok(())
    }

    /// Checks an exported cell table against this cache: with `take`, that
    /// it fits (cells, sequences, positions); else that it is this cache's.
    pub(crate) fn check_table(
        &self,
        cells: &[Option<(u32, i32)>],
        take: bool,
    ) -> Result<(), EngineError> {
        let bad = |why: String| Err(EngineError::Config(format!("KV import: {why}")));
        let n = cells.len();
        if n > self.cells.len() {
            return bad(format!(
                "the import carries {n} cells but this cache has {}",
                self.cells.len()
            ));
        }
        if take {
            for (i, c) in cells.iter().enumerate() {
                if let Some((s, p)) = *c {
                    if s as usize >= self.cfg.n_seq || p < 0 || p as usize >= self.cfg.n_ctx {
                        return bad(format!(
                            "cell {i} holds sequence {s} position {p}, outside this cache's {} sequences of {} positions",
                            self.cfg.n_seq, self.cfg.n_ctx
                        ));
                    }
                }
            }
        } else {
            let show = |c: Option<(u32, i32)>| match c {
                Some((s, p)) => format!("sequence {s} position {p}"),
                None => "a free cell".into(),
            };
            for i in 0..n.max(self.used_end) {
                let here = self.cells[i].map(|c| (c.seq, c.pos));
                let there = cells.get(i).copied().flatten();
                if here != there {
                    return bad(format!(
                        "cell tables differ at cell {i}: this cache has {}, the import {}",
                        show(here),
                        show(there)
                    ));
                }
            }
        }
        Ok(())
    }

    /// Bytes of one cell's K row and V row (0 without V).
    fn row_bytes(&self) -> (usize, usize) {
        if self.store_layers == 0 {
            return (0, 0);
        }
        let k = self.k(self.first_layer).nb()[1];
        let v = if self.has_v {
            self.layer(self.first_layer).1.nb()[1]
        } else {
            0
        };
        (k, v)
    }
}

/// The first `rows` rows of a cache tensor (rows are cells, contiguous).
fn read_rows(t: Tensor<'_>, rows: usize) -> Vec<u8> {
    let mut out = vec![0u8; rows * t.nb()[1]];
    t.read_front(&mut out);
    out
}

/// Sets the first rows of a cache tensor to `data` and zeroes the rest.
fn write_rows(t: Tensor<'_>, data: &[u8]) {
    t.write_front(data);
}
