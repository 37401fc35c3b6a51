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

/// How a sequence drafts (llama-server's `speculative.n_max` and `n_min`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SpecParams {
    /// Most draft tokens a step verifies; 0: no speculation.
    pub n_max: usize,
    /// A shorter draft is not verified (the step decodes one token).
    pub n_min: usize,
    /// The fewest tokens a match must agree on before it drafts.
    pub ngram: usize,
}

impl SpecParams {
    /// No speculation.
    pub const OFF: SpecParams = SpecParams {
        n_max: 0,
        n_min: 0,
        ngram: DEFAULT_NGRAM,
    };

    pub fn is_on(&self) -> bool {
        self.n_max > 0
    }

    /// The draft for a sequence whose tokens so far are `tokens` (its last
    /// one the token just sampled, not yet computed), at most `room` tokens
    /// (what the step, the context and `max_tokens` leave); empty when
    /// there is none worth verifying.
    pub fn draft(&self, tokens: &[u32], room: usize) -> Vec<u32> {
        let n_max = self.n_max.min(room);
        if n_max == 0 {
            return Vec::new();
        }
        let d = ngram_draft(tokens, self.ngram, n_max);
        if d.len() < self.n_min.max(1) {
            return Vec::new();
        }
        d
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
    let len = tokens.len();
    let ngram = ngram.max(1);
    if len <= ngram || n_max == 0 {
        return Vec::new();
    }
    let last = tokens[len - 1];
    let (mut best, mut best_len) = (0, 0);
    for j in (0..len - 1).rev() {
        if tokens[j] != last {
            continue;
        }
        let mut l = 1;
        while l < MAX_MATCH && l <= j && tokens[j - l] == tokens[len - 1 - l] {
            l += 1;
        }
        if l > best_len {
            (best, best_len) = (j, l);
            if l == MAX_MATCH {
                break;
            }
        }
    }
    if best_len < ngram {
        return Vec::new();
    }
    let from = best + 1;
    let to = (from + n_max.min(best_len)).min(len);
    tokens[from..to].to_vec()
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
        };
        assert_eq!(p.draft(&t, 2), vec![5, 6]);
        assert_eq!(p.draft(&t, 16), vec![5, 6, 7, 8]);
        assert!(p.draft(&t, 0).is_empty());
        let p = SpecParams { n_min: 5, ..p };
        assert!(p.draft(&t, 16).is_empty());
        assert!(SpecParams::OFF.draft(&t, 16).is_empty());
    }
}
