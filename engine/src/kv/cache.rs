//! The cache itself: preallocated K and V tensors per layer and the cell table.

use std::ops::Range;

use super::{KvCell, KvConfig, KvLayer, KvLayers};
use crate::error::EngineError;
use crate::ffi::ggml::{f32_to_f16, Buffer, BufferType, Tensor, TensorStore, TYPE_F16};
use crate::model::Hparams;

/// llama.cpp pads the attended cell count to 256; masked cells cost a
/// little compute and change nothing numerically.
const N_KV_PAD: usize = 256;

/// The position of a free cell (no sequence sees it, the cache does not keep it).
const FREE: i32 = -1;

pub struct KvCache {
    cfg: KvConfig,
    /// Whether each layer has a V tensor after its K (not for absorbed MLA).
    has_v: bool,
    first_layer: u32,
    /// Layers the store holds tensors for.
    store_layers: usize,
    store: TensorStore,
    _buffer: Option<Buffer>,
    /// Position of each cell's token, [`FREE`] for a free cell.
    pos: Vec<i32>,
    /// The sequences that see each cell: `words` bits per cell, flat (the
    /// mask reads them for every token and cell). Several sequences share a
    /// cell when one took another's prompt prefix (as llama.cpp's
    /// `seq_cp` within one stream: metadata only, no copy).
    seq_bits: Vec<u64>,
    words: usize,
    /// Cells the prefix cache keeps after their sequences are gone. A cell
    /// is in use while a sequence sees it or the cache keeps it.
    cached: Vec<bool>,
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
            pos: vec![FREE; cfg.n_cells()],
            seq_bits: vec![0; cfg.n_cells() * cfg.n_seq.div_ceil(64)],
            words: cfg.n_seq.div_ceil(64),
            cached: vec![false; cfg.n_cells()],
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
        let free = self.n_cells() - self.used();
        if free < seqs.len() {
            return Err(EngineError::KvFull {
                needed: seqs.len(),
                free,
                cells: self.n_cells(),
            });
        }
        let mut out = Vec::with_capacity(seqs.len());
        let mut next = 0;
        for (&seq, &pos) in seqs.iter().zip(pos) {
            while self.in_use(next) {
                next += 1;
            }
            self.take(next, seq, pos);
            out.push(next as i64);
        }
        Ok(out)
    }

    fn n_cells(&self) -> usize {
        self.pos.len()
    }

    /// Whether a sequence sees cell `c` or the cache keeps it.
    fn in_use(&self, c: usize) -> bool {
        self.pos[c] != FREE
    }

    fn bits(&self, c: usize) -> &[u64] {
        &self.seq_bits[c * self.words..(c + 1) * self.words]
    }

    fn has_seq(&self, c: usize, seq: u32) -> bool {
        self.seq_bits[c * self.words + seq as usize / 64] & (1 << (seq % 64)) != 0
    }

    fn set_seq(&mut self, c: usize, seq: u32, on: bool) {
        let w = &mut self.seq_bits[c * self.words + seq as usize / 64];
        if on {
            *w |= 1 << (seq % 64);
        } else {
            *w &= !(1 << (seq % 64));
        }
    }

    /// Puts `seq`'s token at `pos` into the free cell `c`.
    fn take(&mut self, c: usize, seq: u32, pos: i32) {
        self.pos[c] = pos;
        self.set_seq(c, seq, true);
        self.n_used += 1;
        self.used_end = self.used_end.max(c + 1);
    }

    /// Frees cell `c` if no sequence sees it and the cache does not keep it.
    fn free_if_unused(&mut self, c: usize) {
        if self.pos[c] != FREE && !self.cached[c] && self.bits(c).iter().all(|&w| w == 0) {
            self.pos[c] = FREE;
            self.n_used -= 1;
        }
    }

    /// Checks that every cell is in range and named once, and (with
    /// `used`) in use. Names the first bad one.
    fn check_cells(&self, cells: &[i64], used: bool, what: &str) -> Result<(), EngineError> {
        // Every step calls this, mostly with nothing to check.
        if cells.is_empty() {
            return Ok(());
        }
        // A shared prefix names thousands of cells: mark them, do not search.
        let mut seen = vec![false; self.n_cells()];
        for &c in cells {
            let Some(c) = usize::try_from(c).ok().filter(|&c| c < self.n_cells()) else {
                return Err(EngineError::Config(format!(
                    "{what}: KV cell {c} is out of range: the cache has {} cells",
                    self.n_cells()
                )));
            };
            if used && !self.in_use(c) {
                return Err(EngineError::Config(format!("{what}: KV cell {c} is free")));
            }
            if std::mem::replace(&mut seen[c], true) {
                return Err(EngineError::Config(format!(
                    "{what}: KV cell {c} is named twice"
                )));
            }
        }
        Ok(())
    }

    /// Lets `seq` see the given cells as its own (a prompt prefix another
    /// sequence computed, or the prefix cache kept). `seq` must hold no
    /// cell yet, and every cell must be in use. All or nothing.
    pub fn share(&mut self, seq: u32, cells: &[i64]) -> Result<(), EngineError> {
        if seq as usize >= self.cfg.n_seq {
            return Err(EngineError::Config(format!(
                "sequence id {seq} is out of range: the KV cache holds {} sequences",
                self.cfg.n_seq
            )));
        }
        self.check_cells(cells, true, "sharing a prefix")?;
        if (0..self.used_end).any(|c| self.has_seq(c, seq)) {
            return Err(EngineError::Config(format!(
                "sharing a prefix: sequence {seq} already holds KV cells"
            )));
        }
        for &c in cells {
            self.set_seq(c as usize, seq, true);
        }
        Ok(())
    }

    /// Marks cells as kept by the prefix cache: they stay in use after
    /// every sequence that sees them is gone. All or nothing.
    pub fn retain(&mut self, cells: &[i64]) -> Result<(), EngineError> {
        self.check_cells(cells, true, "keeping cells in the prefix cache")?;
        for &c in cells {
            self.cached[c as usize] = true;
        }
        Ok(())
    }

    /// Lets the prefix cache give cells up: each is freed unless a
    /// sequence still sees it. All or nothing.
    pub fn evict(&mut self, cells: &[i64]) -> Result<(), EngineError> {
        self.check_cells(cells, false, "evicting cells from the prefix cache")?;
        for &c in cells {
            self.cached[c as usize] = false;
            self.free_if_unused(c as usize);
        }
        self.shrink();
        Ok(())
    }

    /// Frees every cell, the prefix cache's too.
    pub fn clear(&mut self) {
        self.pos.fill(FREE);
        self.seq_bits.fill(0);
        self.cached.fill(false);
        self.n_used = 0;
        self.used_end = 0;
    }

    /// Cells the prefix cache keeps.
    pub fn cached(&self) -> usize {
        self.cached[..self.used_end].iter().filter(|&&c| c).count()
    }

    /// Bytes of K and V one cell holds over this cache's layers.
    pub fn cell_bytes(&self) -> u64 {
        let (k, v) = self.row_bytes();
        ((k + v) * self.store_layers) as u64
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
        self.check_cells(cells, false, "placing a step")?;
        if let Some(&c) = cells.iter().find(|&&c| self.in_use(c as usize)) {
            return Err(EngineError::Config(format!("KV cell {c} is in use")));
        }
        for ((&seq, &pos), &c) in seqs.iter().zip(pos).zip(cells) {
            self.take(c as usize, seq, pos);
        }
        Ok(())
    }

    /// Frees the given cells (a step that failed after `allocate`).
    pub fn release(&mut self, idx: &[i64]) {
        for &i in idx {
            let c = i as usize;
            if self.in_use(c) {
                self.pos[c] = FREE;
                self.seq_bits[c * self.words..(c + 1) * self.words].fill(0);
                self.cached[c] = false;
                self.n_used -= 1;
            }
        }
        self.shrink();
    }

    /// Takes `seq` out of every cell it sees; with `from`, only positions
    /// `>= from`. A cell no other sequence sees and the prefix cache does
    /// not keep is freed.
    pub fn remove_seq(&mut self, seq: u32, from: Option<i32>) {
        if seq as usize >= self.cfg.n_seq {
            return;
        }
        for c in 0..self.used_end {
            if self.has_seq(c, seq) && from.is_none_or(|f| self.pos[c] >= f) {
                self.set_seq(c, seq, false);
                self.free_if_unused(c);
            }
        }
        self.shrink();
    }

    fn shrink(&mut self) {
        while self.used_end > 0 && !self.in_use(self.used_end - 1) {
            self.used_end -= 1;
        }
    }

    /// How many cells the next step attends over.
    pub fn n_kv(&self) -> usize {
        self.used_end
            .div_ceil(N_KV_PAD)
            .max(1)
            .saturating_mul(N_KV_PAD)
            .min(self.n_cells())
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
            let (word, bit) = (s as usize / 64, 1u64 << (s % 64));
            for (c, out) in r.iter_mut().enumerate() {
                let cp = self.pos[c];
                let visible = cp != FREE
                    && self.seq_bits[c * self.words + word] & bit != 0
                    && cp <= p
                    && window.is_none_or(|w| p - cp < w as i32);
                if visible {
                    *out = 0.0;
                }
            }
        }
        f32_to_f16(&row, out);
    }

    /// Each token's cells in position order, for the batch-invariant
    /// attention (`Ctx::attention_in_order`): `[hi, lo, lo_swa]` per token,
    /// indices into the list that follows (the cells of each sequence of
    /// the step, sorted by position), so that token `t` sees `list[lo..hi]`
    /// (the cells of its sequence up to its position), or `list[lo_swa..hi]`
    /// within `window`. The mask's rule, as lists.
    pub fn order(&self, seqs: &[u32], pos: &[i32], window: Option<u32>, out: &mut Vec<i32>) {
        use crate::ffi::ggml::ORDER_HEADER;
        out.clear();
        out.resize(ORDER_HEADER * seqs.len(), 0);
        // Each sequence's (position, cell), sorted, and where its list starts.
        struct List {
            seq: u32,
            start: usize,
            cells: Vec<(i32, i32)>,
        }
        let mut lists: Vec<List> = Vec::new();
        let mut at = 0;
        for &s in seqs {
            if lists.iter().any(|l| l.seq == s) {
                continue;
            }
            let mut mine: Vec<(i32, i32)> = (0..self.used_end)
                .filter(|&c| self.pos[c] != FREE && self.has_seq(c, s))
                .map(|c| (self.pos[c], c as i32))
                .collect();
            mine.sort_unstable();
            let len = mine.len();
            lists.push(List {
                seq: s,
                start: at,
                cells: mine,
            });
            at += len;
        }
        for (t, (&s, &p)) in seqs.iter().zip(pos).enumerate() {
            let l = lists.iter().find(|l| l.seq == s).expect("listed above");
            let hi = l.cells.partition_point(|&(cp, _)| cp <= p);
            let lo_swa = window.map_or(0, |w| {
                l.cells.partition_point(|&(cp, _)| p - cp >= w as i32)
            });
            let h = &mut out[ORDER_HEADER * t..ORDER_HEADER * (t + 1)];
            h[0] = (l.start + hi) as i32;
            h[1] = l.start as i32;
            h[2] = (l.start + lo_swa.min(hi)) as i32;
        }
        for l in &lists {
            out.extend(l.cells.iter().map(|&(_, c)| c));
        }
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
            cells: (0..rows).map(|c| self.cell(c)).collect(),
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
            self.clear();
            for (c, k) in kv.cells.iter().enumerate() {
                if let Some(k) = k {
                    self.pos[c] = k.pos;
                    self.cached[c] = k.cached;
                    for &s in &k.seqs {
                        self.set_seq(c, s, true);
                    }
                    self.n_used += 1;
                }
            }
            self.used_end = n;
            self.shrink();
        }
        Ok(())
    }

    /// Checks an exported cell table against this cache: with `take`, that
    /// it fits (cells, sequences, positions); else that it is this cache's.
    pub(crate) fn check_table(
        &self,
        cells: &[Option<KvCell>],
        take: bool,
    ) -> Result<(), EngineError> {
        let bad = |why: String| Err(EngineError::Config(format!("KV import: {why}")));
        let n = cells.len();
        if n > self.n_cells() {
            return bad(format!(
                "the import carries {n} cells but this cache has {}",
                self.n_cells()
            ));
        }
        if take {
            for (i, c) in cells.iter().enumerate() {
                let Some(c) = c else { continue };
                let p = c.pos;
                if let Some(&s) = c.seqs.iter().find(|&&s| s as usize >= self.cfg.n_seq) {
                    return bad(format!(
                        "cell {i} holds sequence {s}, outside this cache's {} sequences",
                        self.cfg.n_seq
                    ));
                }
                if p < 0 || p as usize >= self.cfg.n_ctx {
                    return bad(format!(
                        "cell {i} holds position {p}, outside this cache's {} positions",
                        self.cfg.n_ctx
                    ));
                }
                if c.seqs.is_empty() && !c.cached {
                    return bad(format!(
                        "cell {i} is marked used but no sequence sees it and the cache does not keep it"
                    ));
                }
            }
        } else {
            let show = |c: Option<&KvCell>| match c {
                Some(c) => c.to_string(),
                None => "a free cell".into(),
            };
            for i in 0..n.max(self.used_end) {
                let here = self.cell(i);
                let there = cells.get(i).cloned().flatten();
                if here != there {
                    return bad(format!(
                        "cell tables differ at cell {i}: this cache has {}, the import {}",
                        show(here.as_ref()),
                        show(there.as_ref())
                    ));
                }
            }
        }
        Ok(())
    }

    /// Cell `c` as the byte form carries it.
    fn cell(&self, c: usize) -> Option<KvCell> {
        self.in_use(c).then(|| KvCell {
            pos: self.pos[c],
            seqs: (0..self.cfg.n_seq as u32)
                .filter(|&s| self.has_seq(c, s))
                .collect(),
            cached: self.cached[c],
        })
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
