//! The KV cache of one stage: preallocated K and V tensors for each of its
//! layers, and a table of cells saying which sequence and position each
//! cell holds. Sequences share one pool of cells (llama.cpp's "unified"
//! cache), so a batch of several sequences is one attention op per layer,
//! with a mask that keeps each token to its own sequence's past.
//!
//! [`KvCache::export`] and [`KvCache::import`] move the cache of chosen
//! layers between caches (and, through [`KvLayers::to_bytes`], between
//! processes) byte for byte, for moving layers between stages while
//! sequences are live.
//!
//! This module is the cache's sizing and its byte form (no ggml: the planner
//! uses the sizing); `cache.rs` is the cache itself.

use crate::error::EngineError;
use crate::model::Hparams;

#[cfg(feature = "ggml")]
mod cache;
#[cfg(feature = "ggml")]
pub use cache::KvCache;

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

/// A used cell of the table: its position, the sequences that see it,
/// and whether the prefix cache keeps it.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct KvCell {
    pub pos: i32,
    /// Ascending.
    pub seqs: Vec<u32>,
    pub cached: bool,
}

impl KvCell {
    /// A cell one sequence sees.
    pub fn of(seq: u32, pos: i32) -> KvCell {
        KvCell {
            pos,
            seqs: vec![seq],
            cached: false,
        }
    }
}

impl std::fmt::Display for KvCell {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.seqs[..] {
            [] => write!(f, "position {} seen by no sequence", self.pos)?,
            [s] => write!(f, "sequence {s} position {}", self.pos)?,
            seqs => write!(f, "position {} seen by sequences {seqs:?}", self.pos)?,
        }
        if self.cached {
            write!(f, ", kept by the prefix cache")?;
        }
        Ok(())
    }
}

/// The cache of some layers, as [`KvCache::export`] takes it out: the cell
/// table up to the last used cell (`used_end`; every cell past it is free,
/// so nothing past it is carried), and per layer the F16 rows of those
/// cells, exactly the bytes the cache holds.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct KvLayers {
    /// Each cell in order, `None` for a free one.
    pub cells: Vec<Option<KvCell>>,
    pub layers: Vec<KvLayer>,
}

/// One layer's K rows (and V rows) for [`KvLayers::cells`]: row `c` is
/// cell `c`, `n_embd_k_gqa` (`n_embd_v_cache`) F16 values, little-endian.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct KvLayer {
    pub layer: u32,
    pub k: Vec<u8>,
    /// Empty for a cache without V (absorbed MLA).
    pub v: Vec<u8>,
}

const KV_MAGIC: &[u8; 4] = b"OMKV";
/// The `seq` of a free cell in version 1 of the byte form.
const FREE_SEQ: u32 = u32::MAX;
/// Version 2's per-cell flags.
const CELL_USED: u32 = 1;
const CELL_CACHED: u32 = 2;

impl KvLayers {
    /// Bytes of K and V rows carried.
    pub fn data_bytes(&self) -> usize {
        self.layers.iter().map(|l| l.k.len() + l.v.len()).sum()
    }

    /// The byte form, little-endian: `OMKV`, version u32 (2), n_cells u32,
    /// n_layers u32, seq_words u32; per cell pos i32, flags u32 (bit 0
    /// used, bit 1 kept by the prefix cache) and seq_words u64 words of the
    /// sequences that see it (bit `s % 64` of word `s / 64`); per layer:
    /// layer u32, k_len u64, v_len u64, then the K bytes and the V bytes.
    /// Version 1 (per cell one seq u32, `u32::MAX` when free, and pos i32)
    /// is still read.
    pub fn to_bytes(&self) -> Vec<u8> {
        let max_seq = self
            .cells
            .iter()
            .flatten()
            .flat_map(|c| c.seqs.iter())
            .max();
        let words = max_seq.map_or(0, |&s| s as usize / 64 + 1);
        let mut out = Vec::with_capacity(
            20 + (8 + 8 * words) * self.cells.len() + 20 * self.layers.len() + self.data_bytes(),
        );
        out.extend_from_slice(KV_MAGIC);
        out.extend_from_slice(&2u32.to_le_bytes());
        out.extend_from_slice(&(self.cells.len() as u32).to_le_bytes());
        out.extend_from_slice(&(self.layers.len() as u32).to_le_bytes());
        out.extend_from_slice(&(words as u32).to_le_bytes());
        for c in &self.cells {
            let (pos, flags, seqs) = match c {
                Some(c) => (
                    c.pos,
                    CELL_USED | if c.cached { CELL_CACHED } else { 0 },
                    &c.seqs[..],
                ),
                None => (0, 0, &[][..]),
            };
            out.extend_from_slice(&pos.to_le_bytes());
            out.extend_from_slice(&flags.to_le_bytes());
            let mut bits = vec![0u64; words];
            for &s in seqs {
                bits[s as usize / 64] |= 1 << (s % 64);
            }
            for w in bits {
                out.extend_from_slice(&w.to_le_bytes());
            }
        }
        for l in &self.layers {
            out.extend_from_slice(&l.layer.to_le_bytes());
            out.extend_from_slice(&(l.k.len() as u64).to_le_bytes());
            out.extend_from_slice(&(l.v.len() as u64).to_le_bytes());
            out.extend_from_slice(&l.k);
            out.extend_from_slice(&l.v);
        }
        out
    }

    /// Reads [`Self::to_bytes`]'s form; every length is checked against
    /// the bytes left before anything is allocated.
    pub fn from_bytes(b: &[u8]) -> Result<KvLayers, EngineError> {
        if b.len() < 16 || &b[..4] != KV_MAGIC {
            return Err(bad_bytes(format!(
                "not a serialized KV cache ({} bytes, magic {:?})",
                b.len(),
                b.get(..4)
            )));
        }
        let mut r = ByteReader { b, at: 4 };
        let version = r.u32()?;
        if version != 1 && version != 2 {
            return Err(bad_bytes(format!(
                "unknown version {version} (this build reads 1 and 2)"
            )));
        }
        let (n_cells, n_layers) = (r.u32()? as usize, r.u32()? as usize);
        let words = if version == 2 { r.u32()? as usize } else { 0 };
        let per_cell = 8usize.saturating_add(words.saturating_mul(8));
        let left = b.len() - r.at;
        if n_cells.saturating_mul(per_cell) > left {
            return Err(bad_bytes(format!(
                "{n_cells} cells need {} bytes, only {left} follow the header",
                n_cells.saturating_mul(per_cell),
            )));
        }
        let mut cells = Vec::with_capacity(n_cells);
        for i in 0..n_cells {
            if version == 1 {
                let (seq, pos) = (r.u32()?, r.u32()? as i32);
                cells.push((seq != FREE_SEQ).then(|| KvCell::of(seq, pos)));
                continue;
            }
            let (pos, flags) = (r.u32()? as i32, r.u32()?);
            let mut seqs = Vec::new();
            for w in 0..words {
                let bits = r.u64()?;
                seqs.extend(
                    (0..64)
                        .filter(|b| bits & (1 << b) != 0)
                        .map(|b| (w * 64 + b) as u32),
                );
            }
            if flags & !(CELL_USED | CELL_CACHED) != 0 {
                return Err(bad_bytes(format!("cell {i} has unknown flags {flags:#x}")));
            }
            cells.push((flags & CELL_USED != 0).then_some(KvCell {
                pos,
                seqs,
                cached: flags & CELL_CACHED != 0,
            }));
        }
        let mut layers = Vec::new();
        for _ in 0..n_layers {
            let layer = r.u32()?;
            let (k_len, v_len) = (r.u64()?, r.u64()?);
            let k = r.take(k_len)?.to_vec();
            let v = r.take(v_len)?.to_vec();
            layers.push(KvLayer { layer, k, v });
        }
        if r.at != b.len() {
            return Err(bad_bytes(format!(
                "{} bytes left over after the last layer",
                b.len() - r.at
            )));
        }
        Ok(KvLayers { cells, layers })
    }
}

fn bad_bytes(why: String) -> EngineError {
    EngineError::Config(format!("bad serialized KV cache: {why}"))
}

/// Reads [`KvLayers::from_bytes`]'s fields, each checked against the bytes left.
struct ByteReader<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> ByteReader<'a> {
    fn take(&mut self, n: u64) -> Result<&'a [u8], EngineError> {
        let end = usize::try_from(n)
            .ok()
            .and_then(|n| self.at.checked_add(n))
            .filter(|&end| end <= self.b.len())
            .ok_or_else(|| {
                bad_bytes(format!(
                    "truncated: needs {n} bytes at offset {}, has {}",
                    self.at,
                    self.b.len()
                ))
            })?;
        let s = &self.b[self.at..end];
        self.at = end;
        Ok(s)
    }

    fn u32(&mut self) -> Result<u32, EngineError> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }

    fn u64(&mut self) -> Result<u64, EngineError> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layers() -> KvLayers {
        KvLayers {
            cells: vec![
                Some(KvCell {
                    pos: 0,
                    seqs: vec![0, 3, 70],
                    cached: true,
                }),
                None,
                Some(KvCell {
                    pos: 5,
                    seqs: vec![],
                    cached: true,
                }),
                Some(KvCell::of(1, 2)),
            ],
            layers: vec![KvLayer {
                layer: 4,
                k: vec![1; 8],
                v: vec![2; 8],
            }],
        }
    }

    #[test]
    fn shared_and_kept_cells_survive_the_byte_form() {
        let kv = layers();
        assert_eq!(KvLayers::from_bytes(&kv.to_bytes()).unwrap(), kv);
    }

    #[test]
    fn version_1_still_reads() {
        let mut b = Vec::new();
        b.extend_from_slice(KV_MAGIC);
        for v in [1u32, 2, 0] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        for (seq, pos) in [(7u32, 3i32), (FREE_SEQ, 0)] {
            b.extend_from_slice(&seq.to_le_bytes());
            b.extend_from_slice(&pos.to_le_bytes());
        }
        let kv = KvLayers::from_bytes(&b).unwrap();
        assert_eq!(kv.cells, vec![Some(KvCell::of(7, 3)), None]);
    }

    #[test]
    fn unknown_cell_flags_are_refused() {
        let mut b = layers().to_bytes();
        // The first cell's flags follow the 20-byte header and its position.
        b[24] |= 4;
        let e = KvLayers::from_bytes(&b).unwrap_err().to_string();
        assert!(e.contains("cell 0 has unknown flags 0x7"), "{e}");
    }
}
