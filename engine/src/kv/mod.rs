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

/// The cache of some layers, as [`KvCache::export`] takes it out: the cell
/// table up to the last used cell (`used_end`; every cell past it is free,
/// so nothing past it is carried), and per layer the F16 rows of those
/// cells, exactly the bytes the cache holds.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct KvLayers {
    /// `(sequence, position)` of each cell in order, `None` for a free one.
    pub cells: Vec<Option<(u32, i32)>>,
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
/// The `seq` of a free cell in the byte form.
const FREE_SEQ: u32 = u32::MAX;

impl KvLayers {
    /// Bytes of K and V rows carried.
    pub fn data_bytes(&self) -> usize {
        self.layers.iter().map(|l| l.k.len() + l.v.len()).sum()
    }

    /// The byte form, little-endian: `OMKV`, version u32 (1), n_cells u32,
    /// n_layers u32; per cell seq u32 and pos i32 (a free cell is seq
    /// `u32::MAX`, pos 0); per layer: layer u32, k_len u64, v_len u64, then
    /// the K bytes and the V bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(
            16 + 8 * self.cells.len() + 20 * self.layers.len() + self.data_bytes(),
        );
        out.extend_from_slice(KV_MAGIC);
        out.extend_from_slice(&1u32.to_le_bytes());
        out.extend_from_slice(&(self.cells.len() as u32).to_le_bytes());
        out.extend_from_slice(&(self.layers.len() as u32).to_le_bytes());
        for c in &self.cells {
            let (seq, pos) = c.unwrap_or((FREE_SEQ, 0));
            out.extend_from_slice(&seq.to_le_bytes());
            out.extend_from_slice(&pos.to_le_bytes());
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
        if version != 1 {
            return Err(bad_bytes(format!(
                "unknown version {version} (this build reads 1)"
            )));
        }
        let (n_cells, n_layers) = (r.u32()? as usize, r.u32()? as usize);
        if n_cells.saturating_mul(8) > b.len() - 16 {
            return Err(bad_bytes(format!(
                "{n_cells} cells need {} bytes, only {} follow the header",
                n_cells.saturating_mul(8),
                b.len() - 16
            )));
        }
        let mut cells = Vec::with_capacity(n_cells);
        for _ in 0..n_cells {
            let (seq, pos) = (r.u32()?, r.u32()? as i32);
            cells.push((seq != FREE_SEQ).then_some((seq, pos)));
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
