//! What stages hand each other: the tokens of a step ([`Batch`]), the hidden
//! state between stages ([`Hidden`], and its byte form, so a split across
//! processes computes exactly what one process computes) and the logits.

use crate::error::EngineError;
use crate::ffi::ggml;

/// One step's worth of tokens, possibly from several sequences.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Batch {
    /// Token ids (needed by the stage that runs the embedding).
    pub tokens: Vec<u32>,
    pub pos: Vec<i32>,
    pub seq: Vec<u32>,
    /// Whether the logits of each token are wanted.
    pub logits: Vec<bool>,
    /// The KV cell of each token, when the caller places them (a replay
    /// that must lay a sequence's cache out as before); empty: the stage
    /// allocates free cells.
    pub cells: Vec<i64>,
    /// Compute every token as it would be computed alone: batch-invariant
    /// kernels (`CpuBackend::set_batch_invariant`) and attention over each
    /// token's cells in position order, so a sequence's logits do not
    /// depend on what shares its step, on prefill chunking or on where its
    /// cells sit. Needs a stage loaded with `StageConfig::deterministic`.
    pub invariant: bool,
}

impl Batch {
    pub fn len(&self) -> usize {
        self.pos.len()
    }
    pub fn is_empty(&self) -> bool {
        self.pos.is_empty()
    }
    pub fn push(&mut self, token: u32, pos: i32, seq: u32, logits: bool) {
        self.tokens.push(token);
        self.pos.push(pos);
        self.seq.push(seq);
        self.logits.push(logits);
    }
    /// The tokens `r` of the batch, as a batch of their own.
    pub(super) fn range(&self, r: std::ops::Range<usize>) -> Batch {
        let part = |v: &[u32]| v.get(r.clone()).map_or(Vec::new(), <[u32]>::to_vec);
        Batch {
            tokens: part(&self.tokens),
            pos: self.pos[r.clone()].to_vec(),
            seq: self.seq[r.clone()].to_vec(),
            logits: self.logits[r.clone()].to_vec(),
            cells: self.cells.get(r).map_or(Vec::new(), <[i64]>::to_vec),
            invariant: self.invariant,
        }
    }

    pub(super) fn validate(&self, need_tokens: bool) -> Result<(), EngineError> {
        let n = self.pos.len();
        if n == 0 {
            return Err(EngineError::Config("empty batch".into()));
        }
        if self.seq.len() != n
            || self.logits.len() != n
            || (need_tokens && self.tokens.len() != n)
            || (!self.cells.is_empty() && self.cells.len() != n)
        {
            return Err(EngineError::Config(format!(
                "inconsistent batch: {} tokens, {} positions, {} sequence ids, {} logit flags, {} cells",
                self.tokens.len(),
                n,
                self.seq.len(),
                self.logits.len(),
                self.cells.len()
            )));
        }
        Ok(())
    }
}

/// The hidden state passed between stages: `[n_tokens, n_embd]`, row-major, f32.
#[derive(Clone, Debug, PartialEq)]
pub struct Hidden {
    pub n_tokens: usize,
    pub n_embd: usize,
    pub data: Vec<f32>,
}

/// Element type of a serialized hidden state. F32 is the default because it
/// makes a split bit-identical to one process; F16 halves the bytes moved.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum HiddenDtype {
    F32,
    F16,
}

pub(super) const HIDDEN_MAGIC: &[u8; 4] = b"OMHS";

impl Hidden {
    /// Rows `r` (tokens) of a state `n_embd` wide.
    pub(super) fn rows(&self, r: std::ops::Range<usize>, n_embd: usize) -> Hidden {
        Hidden {
            n_tokens: r.len(),
            n_embd,
            data: self.data[r.start * n_embd..r.end * n_embd].to_vec(),
        }
    }

    /// `OMHS`, dtype (u8: 0 f32, 1 f16), 3 zero bytes, n_tokens u32, n_embd u32, then the values, little-endian.
    pub fn to_bytes(&self, dtype: HiddenDtype) -> Vec<u8> {
        let elem = if dtype == HiddenDtype::F32 { 4 } else { 2 };
        let mut out = Vec::with_capacity(16 + self.data.len() * elem);
        out.extend_from_slice(HIDDEN_MAGIC);
        out.extend_from_slice(&[u8::from(dtype == HiddenDtype::F16), 0, 0, 0]);
        out.extend_from_slice(&(self.n_tokens as u32).to_le_bytes());
        out.extend_from_slice(&(self.n_embd as u32).to_le_bytes());
        match dtype {
            HiddenDtype::F32 => self
                .data
                .iter()
                .for_each(|v| out.extend_from_slice(&v.to_le_bytes())),
            HiddenDtype::F16 => {
                let mut h = Vec::new();
                ggml::f32_to_f16(&self.data, &mut h);
                h.iter()
                    .for_each(|v| out.extend_from_slice(&v.to_le_bytes()));
            }
        }
        out
    }

    pub fn from_bytes(b: &[u8]) -> Result<Hidden, EngineError> {
        let bad = |why: String| EngineError::BadHidden(why);
        if b.len() < 16 || &b[..4] != HIDDEN_MAGIC {
            return Err(bad(format!(
                "not a serialized hidden state ({} bytes, magic {:?})",
                b.len(),
                b.get(..4)
            )));
        }
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]) as usize;
        let (n_tokens, n_embd) = (u32_at(8), u32_at(12));
        let elem = match b[4] {
            0 => 4,
            1 => 2,
            d => return Err(bad(format!("unknown dtype {d}"))),
        };
        let n = n_tokens
            .checked_mul(n_embd)
            .ok_or_else(|| bad("size overflows".into()))?;
        if b.len() - 16 != n * elem {
            return Err(bad(format!(
                "{n_tokens} x {n_embd} values need {} bytes, got {}",
                n * elem,
                b.len() - 16
            )));
        }
        let body = &b[16..];
        let data = if elem == 4 {
            body.chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect()
        } else {
            body.chunks_exact(2)
                .map(|c| ggml::f16_to_f32(u16::from_le_bytes([c[0], c[1]])))
                .collect()
        };
        Ok(Hidden {
            n_tokens,
            n_embd,
            data,
        })
    }
}

/// Logits of the tokens that asked for them, in batch order.
#[derive(Clone, Debug, PartialEq)]
pub struct Logits {
    pub n_vocab: usize,
    /// Batch index of each row.
    pub rows: Vec<usize>,
    pub data: Vec<f32>,
}

impl Logits {
    pub fn row(&self, i: usize) -> &[f32] {
        &self.data[i * self.n_vocab..(i + 1) * self.n_vocab]
    }
    /// The row of batch index `b`, if it was requested.
    pub fn for_batch_index(&self, b: usize) -> Option<&[f32]> {
        self.rows.iter().position(|&r| r == b).map(|i| self.row(i))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_round_trip_is_exact_for_halves() {
        let vals = [
            0.0f32,
            -0.0,
            1.0,
            -2.5,
            65504.0,
            6.1035156e-5,
            5.9604645e-8,
            f32::INFINITY,
            f32::NEG_INFINITY,
        ];
        let mut h = Vec::new();
        ggml::f32_to_f16(&vals, &mut h);
        for (v, h) in vals.iter().zip(&h) {
            assert_eq!(ggml::f16_to_f32(*h), *v, "{v}");
        }
    }

    #[test]
    fn hidden_serialization_round_trips_and_rejects_garbage() {
        let h = Hidden {
            n_tokens: 2,
            n_embd: 3,
            data: vec![1.0, -2.0, 3.5, 0.25, 1e-3, -7.0],
        };
        assert_eq!(
            Hidden::from_bytes(&h.to_bytes(HiddenDtype::F32)).unwrap(),
            h
        );
        let h16 = Hidden::from_bytes(&h.to_bytes(HiddenDtype::F16)).unwrap();
        assert!(h16
            .data
            .iter()
            .zip(&h.data)
            .all(|(a, b)| (a - b).abs() <= b.abs() * 1e-3));
        let mut b = h.to_bytes(HiddenDtype::F32);
        b.pop();
        assert!(Hidden::from_bytes(&b)
            .unwrap_err()
            .to_string()
            .contains("need"));
        assert!(Hidden::from_bytes(b"nope").is_err());
    }
}
