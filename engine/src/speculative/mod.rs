//! Speculative decoding's drafts: tokens guessed ahead for the model to
//! verify in one step.
//!
//! **Prompt lookup (n-gram)**: the sequence's last few tokens are looked
//! for earlier in the sequence (its prompt or what it generated), and the
//! tokens that followed them there are the draft. A model rewriting code it
//! was given, or quoting its input, takes most of them. It is llama.cpp's
//! `ngram-simple` with its draft sized by the evidence: the earlier place
//! whose tokens agree longest with the sequence's end (at least `ngram`),
//! and as many of the tokens that followed it as the agreement is long (up
//! to `n_max`). A verbatim copy in progress drafts long, as llama.cpp's
//! `ngram-mod` does with its 24-token keys; a short coincidence drafts a
//! few tokens, which cost little when they are wrong.
//!
//! Verifying keeps the output exact: the last stage samples each drafted
//! row as it would have sampled that token alone and takes the draft only
//! while they agree. For a draft that is one token per place (this one),
//! that is the rejection-sampling rule (take draft token d with probability
//! p(d), else sample from p without d), and it draws the sampler's random
//! numbers exactly as decoding without a draft does.

#[cfg(feature = "ggml")]
pub mod draft;
pub mod tune;

/// How a sequence drafts (llama-server's `speculative.n_max`, `n_min` and
/// `p_min`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SpecParams {
    /// Most draft tokens a step verifies; 0: no speculation.
    pub n_max: usize,
    /// A shorter draft is not verified (the step decodes one token).
    pub n_min: usize,
    /// The fewest tokens a match must agree on before it drafts.
    pub ngram: usize,
    /// Where drafts come from.
    pub source: DraftSource,
    /// A draft model's guesses stop at one it gives less probability.
    pub p_min: f32,
}

/// Where a sequence's drafts come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DraftSource {
    /// Prompt lookup, in the coordinator.
    Lookup,
    /// A draft model beside the last stage ([`draft::DraftModel`]).
    Model,
}

/// llama-server's former default for `--draft-p-min`: a draft model's
/// guess below it is more often wrong than right.
pub const DEFAULT_P_MIN: f32 = 0.75;

impl SpecParams {
    /// No speculation.
    pub const OFF: SpecParams = SpecParams {
        n_max: 0,
        n_min: 0,
        ngram: DEFAULT_NGRAM,
        source: DraftSource::Lookup,
        p_min: DEFAULT_P_MIN,
    };

    pub fn is_on(&self) -> bool {
        self.n_max > 0
    }

    /// The draft for a sequence whose tokens so far are `tokens` (its last
    /// one the token just sampled, not yet computed), at most `room` tokens
    /// (what the step, the context and `max_tokens` leave); empty when
    /// there is none worth verifying. `recent`: ended sequences of the
    /// same model to look in as well. `tuner`: what the cluster measured;
    /// its rule sizes the draft ([`tune`]); without it the draft is as
    /// long as the agreement. Returns the draft and the agreement it was
    /// found with.
    pub fn draft(
        &self,
        tokens: &[u32],
        recent: Option<&Recent>,
        room: usize,
        tuner: Option<&tune::Tuner>,
    ) -> (Vec<u32>, usize) {
        let n_max = self.n_max.min(room);
        if n_max == 0 {
            return (Vec::new(), 0);
        }
        let Some((mut d, agree)) = lookup(tokens, recent, self.ngram, n_max) else {
            return (Vec::new(), 0);
        };
        let k = tuner.map_or(agree, |t| t.choose(agree, d.len()));
        d.truncate(k);
        if d.len() < self.n_min.max(1) {
            return (Vec::new(), agree);
        }
        (d, agree)
    }
}

/// The shortest match drafted from, by default: long enough that a match
/// means the text repeats, short enough to find one after a one-token edit.
pub const DEFAULT_NGRAM: usize = 3;

/// How far back a match is measured (and so the longest draft it earns).
const MAX_MATCH: usize = 64;

/// Prompt lookup: the place earlier in `tokens` whose preceding tokens
/// agree longest with the end of `tokens` (the latest such place on a tie;
/// at least `ngram` tokens of agreement), and what followed it there. The
/// draft is as long as the agreement (at most `n_max`): a long verbatim run
/// (code being copied) earns a long draft, a short coincidence a short one,
/// so a wrong guess costs few rows.
pub fn ngram_draft(tokens: &[u32], ngram: usize, n_max: usize) -> Vec<u32> {
    lookup_draft(tokens, None, ngram, n_max)
}

/// As [`ngram_draft`], looking also in `recent` sequences (ended ones of
/// the same model): a match there wins only by agreeing longer than the
/// best in the sequence itself.
pub fn lookup_draft(
    tokens: &[u32],
    recent: Option<&Recent>,
    ngram: usize,
    n_max: usize,
) -> Vec<u32> {
    lookup(tokens, recent, ngram, n_max).map_or_else(Vec::new, |(mut d, agree)| {
        d.truncate(agree);
        d
    })
}

/// The match [`lookup_draft`] drafts from: up to `n_max` of the tokens
/// that followed it, and its agreement.
pub fn lookup(
    tokens: &[u32],
    recent: Option<&Recent>,
    ngram: usize,
    n_max: usize,
) -> Option<(Vec<u32>, usize)> {
    let len = tokens.len();
    let ngram = ngram.max(1);
    if len == 0 || n_max == 0 {
        return None;
    }
    let mut best = best_match(tokens, true, tokens, None);
    for hay in recent.into_iter().flat_map(|r| r.seqs.iter().rev()) {
        best = best_match(hay, false, tokens, best);
    }
    let (hay, at, agree) = best?;
    if agree < ngram {
        return None;
    }
    let from = at + 1;
    let to = (from + n_max).min(hay.len());
    Some((hay[from..to].to_vec(), agree))
}

/// The place in `hay` where a token equal to `tokens`' last is preceded by
/// the longest agreement with `tokens`' end (the latest on a tie, capped
/// at [`MAX_MATCH`]), if it agrees longer than `best`, as `(hay, place,
/// agreement)`; else `best`. Only places with a token after them count.
/// `own`: `hay` is `tokens` itself (its places before the last token).
fn best_match<'a>(
    hay: &'a [u32],
    own: bool,
    tokens: &[u32],
    best: Option<(&'a [u32], usize, usize)>,
) -> Option<(&'a [u32], usize, usize)> {
    let len = tokens.len();
    let last = tokens[len - 1];
    let mut best = best;
    let mut best_len = best.map_or(0, |b| b.2);
    if best_len >= MAX_MATCH {
        return best;
    }
    let end = if own {
        len - 1
    } else {
        hay.len().saturating_sub(1)
    };
    for j in (0..end).rev() {
        if hay[j] != last {
            continue;
        }
        let mut l = 1;
        while l < MAX_MATCH && l <= j && l < len && hay[j - l] == tokens[len - 1 - l] {
            l += 1;
        }
        if l > best_len {
            (best, best_len) = (Some((hay, j, l)), l);
            if l == MAX_MATCH {
                break;
            }
        }
    }
    best
}

/// The tokens (prompt and answer) of a model's recently ended sequences,
/// newest last, up to a budget of tokens: drafts come from them as well as
/// from the sequence itself, so a request that repeats or revises an
/// earlier answer (an agent rewriting the same file again) drafts it from
/// its first token on. Like llama.cpp's `ngram-mod`, whose table all
/// sequences share. The model still verifies every token: what an earlier
/// sequence said changes no answer, only how many steps it takes.
#[derive(Debug, Default)]
pub struct Recent {
    seqs: std::collections::VecDeque<Vec<u32>>,
    tokens: usize,
    budget: usize,
}

impl Recent {
    /// Keeps at most `budget` tokens (0: nothing).
    pub fn new(budget: usize) -> Recent {
        Recent {
            budget,
            ..Default::default()
        }
    }

    /// Adds an ended sequence's tokens (the last `budget` of a longer one),
    /// forgetting the oldest sequences beyond the budget.
    pub fn push(&mut self, tokens: &[u32]) {
        if self.budget == 0 || tokens.len() < 2 {
            return;
        }
        let t = &tokens[tokens.len().saturating_sub(self.budget)..];
        self.tokens += t.len();
        self.seqs.push_back(t.to_vec());
        while self.tokens > self.budget {
            let old = self.seqs.pop_front().expect("over budget means not empty");
            self.tokens -= old.len();
        }
    }

    /// Tokens kept.
    pub fn len(&self) -> usize {
        self.tokens
    }

    pub fn is_empty(&self) -> bool {
        self.tokens == 0
    }
}

/// Most tokens two vocabularies may differ by in size (llama.cpp's
/// `SPEC_VOCAB_MAX_SIZE_DIFFERENCE`): the ids both have must mean the same.
const MAX_VOCAB_DIFFERENCE: usize = 128;

/// Refuses a draft model whose token ids do not mean what the target's do
/// (by its tokenizer: kind, size within [`MAX_VOCAB_DIFFERENCE`], and the
/// text of every id both have), naming the difference.
pub fn check_vocab(
    target: &crate::model::ModelFile,
    draft: &crate::model::ModelFile,
) -> Result<(), crate::error::EngineError> {
    let bad = |why: String| {
        crate::error::EngineError::Config(format!(
            "draft model {} cannot draft for {}: {why}",
            draft.path.display(),
            target.path.display()
        ))
    };
    let kind = |m: &crate::model::ModelFile| {
        m.gguf
            .get_str("tokenizer.ggml.model")
            .map(str::to_string)
            .unwrap_or_default()
    };
    let (kt, kd) = (kind(target), kind(draft));
    if kt != kd {
        return Err(bad(format!("its tokenizer is '{kd}', the target's '{kt}'")));
    }
    fn tokens(m: &crate::model::ModelFile) -> Result<Vec<&str>, String> {
        m.gguf
            .get_str_array("tokenizer.ggml.tokens")
            .map_err(|e| format!("{}: {e}", m.path.display()))
    }
    let (tt, td) = (tokens(target).map_err(bad)?, tokens(draft).map_err(bad)?);
    if tt.len().abs_diff(td.len()) > MAX_VOCAB_DIFFERENCE {
        return Err(bad(format!(
            "its vocabulary has {} tokens, the target's {}",
            td.len(),
            tt.len()
        )));
    }
    if let Some(i) = tt.iter().zip(&td).position(|(a, b)| a != b) {
        return Err(bad(format!(
            "token {i} is {:?} there and {:?} in the target",
            td[i], tt[i]
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drafts_what_followed_the_longest_match_as_long_as_it() {
        // "... 1 2 3 | 4 5 6 7" and the sequence ends "1 2 3": three tokens
        // of agreement earn a draft of three.
        let t = [9, 1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3];
        assert_eq!(ngram_draft(&t, 3, 16), vec![4, 5, 6]);
        // Of two places, the one that agrees longer wins, even if older.
        let t = [5, 1, 2, 3, 6, 8, 0, 8, 1, 2, 3, 7, 5, 1, 2, 3];
        assert_eq!(ngram_draft(&t, 2, 16), vec![6, 8, 0, 8]);
        // On a tie, the latest place.
        let t = [1, 2, 7, 1, 2, 8, 1, 2];
        assert_eq!(ngram_draft(&t, 2, 1), vec![8]);
        // n_max bounds a long agreement's draft.
        let t: Vec<u32> = (0..40).chain(0..30).collect();
        assert_eq!(ngram_draft(&t, 3, 5), vec![30, 31, 32, 33, 34]);
    }

    #[test]
    fn no_match_no_draft() {
        assert!(ngram_draft(&[1, 2, 3, 4], 3, 8).is_empty());
        assert!(ngram_draft(&[1], 3, 8).is_empty());
        assert!(ngram_draft(&[], 3, 8).is_empty());
        // Agreement shorter than ngram: nothing.
        assert!(ngram_draft(&[4, 1, 2, 5, 1, 2], 3, 8).is_empty());
        // A draft reaches at most the end of the sequence.
        assert_eq!(ngram_draft(&[1, 2, 1, 2], 2, 8), vec![1, 2]);
    }

    #[test]
    fn room_and_n_min_bound_the_draft() {
        let t = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4];
        let p = SpecParams {
            n_max: 16,
            n_min: 0,
            ngram: 3,
            ..SpecParams::OFF
        };
        assert_eq!(p.draft(&t, None, 2, None).0, vec![5, 6]);
        assert_eq!(p.draft(&t, None, 16, None).0, vec![5, 6, 7, 8]);
        assert!(p.draft(&t, None, 0, None).0.is_empty());
        let p = SpecParams { n_min: 5, ..p };
        assert!(p.draft(&t, None, 16, None).0.is_empty());
        assert!(SpecParams::OFF.draft(&t, None, 16, None).0.is_empty());
    }

    #[test]
    fn recent_sequences_draft_when_they_agree_longer() {
        // An earlier answer "1 2 3 4 5 6 7 8 9"; the new sequence ends
        // "0 2 3 4" on its own and "1 2 3 4" is nowhere in it.
        let mut r = Recent::new(100);
        r.push(&[1, 2, 3, 4, 5, 6, 7, 8, 9]);
        assert_eq!(lookup_draft(&[7, 2, 3, 4], Some(&r), 3, 16), vec![5, 6, 7]);
        // The sequence's own match wins a tie (it is the latest place).
        let t = [2, 3, 4, 0, 2, 3, 4];
        assert_eq!(lookup_draft(&t, Some(&r), 3, 16), vec![0, 2, 3]);
        // A longer agreement elsewhere wins.
        let t = [7, 1, 2, 3, 4];
        assert_eq!(lookup_draft(&t, Some(&r), 3, 2), vec![5, 6]);
        // A match at the end of an earlier sequence has nothing after it.
        assert!(lookup_draft(&[5, 7, 8, 9], Some(&r), 3, 16).is_empty());
    }

    #[test]
    fn recent_keeps_its_budget() {
        let mut r = Recent::new(10);
        r.push(&[1, 2, 3, 4, 5, 6]);
        r.push(&[7, 8, 9, 10, 11]);
        // 11 tokens: the oldest goes.
        assert_eq!(r.len(), 5);
        // A sequence longer than the budget keeps its end.
        r.push(&(0..25).collect::<Vec<u32>>());
        assert_eq!(r.len(), 10);
        assert_eq!(
            lookup_draft(&[16, 17, 18], Some(&r), 3, 4),
            vec![19, 20, 21]
        );
        assert!(Recent::new(0).is_empty());
    }
}
