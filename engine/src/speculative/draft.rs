//! Draft-model speculation: a small model with the target's vocabulary
//! guesses the next tokens greedily, and the target verifies them in one
//! step (llama-server's `-md`).
//!
//! The draft model runs whole, beside the target's last stage, with its own
//! KV cells for every slot. For each sequence it remembers which tokens
//! those cells hold; a proposal first brings them level with the sequence
//! (dropping its own guesses the target did not take, feeding what came
//! since: the whole prompt the first time), then guesses one token at a
//! time while its top token is likely enough (`p_min`). Every sequence that
//! wants a proposal is computed in the same batches.
//!
//! What the draft model says changes no token: the target samples every
//! row itself and takes a draft token only when it sampled that very token.

use std::collections::HashMap;
use std::path::Path;

use super::check_vocab;
use crate::error::EngineError;
use crate::model::ModelFile;
use crate::stage::{Batch, LayerRange, Stage, StageConfig, StageOutput};

/// A draft model loaded whole, with KV cells for `n_seq` slots.
pub struct DraftModel {
    stage: Stage,
    /// The tokens each slot's cells hold, in position order.
    fed: HashMap<u32, Vec<u32>>,
    /// Draft tokens must be ids the target has.
    target_vocab: usize,
    path: std::path::PathBuf,
}

/// The top token of a row of logits and its probability.
type Guess = (u32, f32);

/// One sequence's request for a proposal.
pub struct Want<'a> {
    pub slot: u32,
    /// The sequence's tokens so far, its last one just sampled.
    pub tokens: &'a [u32],
    /// Most tokens to propose.
    pub n_max: usize,
    /// Stop at a guess the draft model gives less probability than this.
    pub p_min: f32,
}

impl DraftModel {
    /// Loads `path` whole (`cfg`: the target stage's settings: context,
    /// slots, threads, device) after checking that its vocabulary is the
    /// target's.
    pub fn load(
        path: &Path,
        target: &ModelFile,
        cfg: StageConfig,
    ) -> Result<DraftModel, EngineError> {
        let model = ModelFile::open(path)?;
        check_vocab(target, &model)?;
        let n_layer = model.hparams.n_layer;
        let cfg = StageConfig {
            // Guesses need no batch invariance, and the draft model's
            // cells are its own.
            deterministic: false,
            expert_overlap: false,
            shared_overlap: false,
            ..cfg
        };
        let stage = Stage::load(model, LayerRange::whole(n_layer), cfg)?;
        Ok(DraftModel {
            stage,
            fed: HashMap::new(),
            target_vocab: target.hparams.n_vocab as usize,
            path: path.to_path_buf(),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Bytes the draft model holds (weights, KV cells, compute buffer).
    pub fn held_bytes(&self) -> u64 {
        self.stage.held_bytes()
    }

    /// The slot's sequence ended: its cells are free.
    pub fn forget(&mut self, slot: u32) {
        if self.fed.remove(&slot).is_some() {
            self.stage.remove_seq(slot, None);
        }
    }

    /// Forgets every sequence.
    pub fn clear(&mut self) {
        self.fed.clear();
        self.stage.clear_kv();
    }

    /// A proposal for each want, in order (empty where the draft model's
    /// first guess is already below `p_min`).
    pub fn propose(&mut self, wants: &[Want]) -> Result<Vec<Vec<u32>>, EngineError> {
        let n_ctx = self.stage.config().kv.n_ctx;
        let n_ubatch = self.stage.config().n_ubatch.max(1);
        let mut out: Vec<Vec<u32>> = vec![Vec::new(); wants.len()];
        // Bring each slot's cells level with its sequence: keep what they
        // share, feed the rest (the last token wants logits).
        let mut pending: Vec<(usize, u32, i32)> = Vec::new(); // (want, token, pos)
        let mut active: Vec<usize> = Vec::new();
        for (w, want) in wants.iter().enumerate() {
            let n = want.tokens.len();
            if want.n_max == 0 || n == 0 || n >= n_ctx {
                continue;
            }
            let fed = self.fed.entry(want.slot).or_default();
            let mut keep = fed
                .iter()
                .zip(want.tokens)
                .take_while(|(a, b)| a == b)
                .count();
            // The last token's logits are wanted: feed it again if held.
            keep = keep.min(n - 1);
            if keep < fed.len() {
                self.stage.remove_seq(want.slot, Some(keep as i32));
                fed.truncate(keep);
            }
            for (p, &t) in want.tokens.iter().enumerate().skip(keep) {
                pending.push((w, t, p as i32));
            }
            active.push(w);
        }
        if active.is_empty() {
            return Ok(out);
        }
        // The catch-up, in batches of at most n_ubatch tokens.
        let mut last: HashMap<usize, Guess> = HashMap::new();
        for chunk in pending.chunks(n_ubatch) {
            let mut b = Batch::default();
            for &(w, t, p) in chunk {
                let want = &wants[w];
                b.push(t, p, want.slot, p as usize + 1 == want.tokens.len());
            }
            for (bi, guess) in self.forward(&b)? {
                last.insert(chunk[bi].0, guess);
            }
            for &(w, t, _) in chunk {
                self.fed
                    .get_mut(&wants[w].slot)
                    .expect("entered above")
                    .push(t);
            }
        }
        // Then one guess per sequence per round while they are likely.
        let mut guesses: Vec<(usize, Guess)> = active
            .iter()
            .filter_map(|w| last.get(w).map(|&g| (*w, g)))
            .collect();
        loop {
            let mut b = Batch::default();
            let mut fed_now = Vec::new();
            for &(w, (token, p)) in &guesses {
                let want = &wants[w];
                if p < want.p_min || token as usize >= self.target_vocab {
                    continue;
                }
                out[w].push(token);
                let pos = want.tokens.len() + out[w].len() - 1;
                if out[w].len() >= want.n_max || pos + 1 >= n_ctx {
                    continue;
                }
                b.push(token, pos as i32, want.slot, true);
                fed_now.push((w, token));
            }
            if b.is_empty() {
                break;
            }
            let rows = self.forward(&b)?;
            for &(w, t) in &fed_now {
                self.fed
                    .get_mut(&wants[w].slot)
                    .expect("entered above")
                    .push(t);
            }
            guesses = rows.into_iter().map(|(bi, g)| (fed_now[bi].0, g)).collect();
        }
        Ok(out)
    }

    /// Runs a batch and returns, for each row that wanted logits, its batch
    /// index and the top token with its probability.
    fn forward(&mut self, b: &Batch) -> Result<Vec<(usize, Guess)>, EngineError> {
        let StageOutput::Logits(l) = self.stage.forward(b, None)? else {
            return Err(EngineError::Config(
                "the draft model's stage has no head".into(),
            ));
        };
        Ok(l.rows
            .iter()
            .enumerate()
            .map(|(i, &bi)| (bi, top(l.row(i))))
            .collect())
    }
}

/// The most likely token of a row of logits and its probability.
fn top(logits: &[f32]) -> Guess {
    let (best, max) =
        logits
            .iter()
            .enumerate()
            .fold((0, f32::NEG_INFINITY), |(bi, bm), (i, &x)| {
                if x > bm {
                    (i, x)
                } else {
                    (bi, bm)
                }
            });
    let sum: f32 = logits.iter().map(|&x| (x - max).exp()).sum();
    (best as u32, 1.0 / sum)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_token_and_its_probability() {
        let (t, p) = top(&[0.0, 2.0, 0.0]);
        assert_eq!(t, 1);
        let e2 = 2f32.exp();
        assert!((p - e2 / (e2 + 2.0)).abs() < 1e-6);
        let (t, p) = top(&[1.0; 4]);
        assert_eq!(t, 0);
        assert!((p - 0.25).abs() < 1e-6);
    }
}
