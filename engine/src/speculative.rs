//! Speculative decoding's drafts: tokens guessed ahead for the model to
//! verify in one step.
//!
//! **Prompt lookup (n-gram)**: the sequence's last few tokens are looked
//! for earlier in the sequence (its prompt or what it generated), and the
//! tokens that followed them there are the draft. A model rewriting code it
//! was given, or quoting its input, takes most of them. It is llama.cpp's
//! `ngram-simple` with a fall-back to shorter n-grams (as Hugging Face's
//! prompt lookup): the longest n-gram that matches, from `ngram` tokens
//! down to 2, at its latest earlier place.
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
    /// The longest n-gram looked up.
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

/// The n-gram looked up by default: long enough that a match means the
/// text repeats, short enough to find one after a one-token edit.
pub const DEFAULT_NGRAM: usize = 3;

/// Up to `n_max` tokens that followed the latest earlier occurrence of the
/// longest suffix of `tokens` of at most `ngram` (and at least 2) tokens.
pub fn ngram_draft(tokens: &[u32], ngram: usize, n_max: usize) -> Vec<u32> {
    let len = tokens.len();
    for n in (2..=ngram).rev() {
        if len <= n {
            continue;
        }
        let pattern = &tokens[len - n..];
        // Latest first; the suffix itself (at len - n) is not a match.
        let found = (0..len - n).rev().find(|&j| &tokens[j..j + n] == pattern);
        if let Some(j) = found {
            let from = j + n;
            let to = (from + n_max).min(len);
            return tokens[from..to].to_vec();
        }
    }
    Vec::new()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drafts_what_followed_the_latest_match() {
        // "a b c d e ... a b" -> "c d e"
        let t = [1, 2, 3, 4, 5, 9, 9, 1, 2];
        assert_eq!(ngram_draft(&t, 3, 3), vec![3, 4, 5]);
        // The latest earlier place wins.
        let t = [1, 2, 7, 1, 2, 8, 1, 2];
        assert_eq!(ngram_draft(&t, 2, 1), vec![8]);
        // A longer match is preferred to a later shorter one.
        let t = [5, 1, 2, 3, 6, 1, 2, 4, 5, 1, 2];
        assert_eq!(ngram_draft(&t, 3, 2), vec![3, 6]);
    }

    #[test]
    fn no_match_no_draft() {
        assert!(ngram_draft(&[1, 2, 3, 4], 3, 8).is_empty());
        assert!(ngram_draft(&[1], 3, 8).is_empty());
        assert!(ngram_draft(&[], 3, 8).is_empty());
        // A draft reaches at most the end of the sequence.
        assert_eq!(ngram_draft(&[1, 2, 1, 2], 2, 8), vec![1, 2]);
    }

    #[test]
    fn room_and_n_min_bound_the_draft() {
        let t = [1, 2, 3, 4, 5, 6, 1, 2];
        let p = SpecParams {
            n_max: 16,
            n_min: 0,
            ngram: 3,
        };
        assert_eq!(p.draft(&t, 2), vec![3, 4]);
        assert!(p.draft(&t, 0).is_empty());
        let p = SpecParams { n_min: 7, ..p };
        assert!(p.draft(&t, 16).is_empty());
        assert!(SpecParams::OFF.draft(&t, 16).is_empty());
    }
}
