//! Where a prompt is cut into steps.
//!
//! ggml's CPU kernels compute a token's row differently by the size of the
//! batch it is in: K-quant matmuls take the tiled kernel from 8 rows and
//! `vec_dot` below, repacked Q4_K weights a 4-row gemm on whole blocks of 4
//! and a gemv on the rest, flash attention a tiled kernel from 64 query
//! rows. They round differently, so the same prompt cut into other steps
//! gives other logits: by up to 0.2 in a log-probability on Gemma 3 270M and
//! 0.02 on Qwen2.5-Coder-0.5B (measured on an AVX2 Zen 3, haswell kernels).
//! Matching llama.cpp to 0.01 therefore means cutting prompts where it does.
//!
//! llama.cpp's own decode (`llama_decode`, what llama-cpp-python and the
//! fixtures run) takes `n_ubatch` tokens at a time from the first. So does
//! llama-server, except for models with sliding-window layers (Gemma 3):
//! there it keeps a small sliding-window cache and, to be able to roll it
//! back, saves "context checkpoints" 4 and 4 + `n_ubatch` tokens before the
//! end of each prompt, which it does by ending a batch there (llama.cpp
//! PR 20288; `--ctx-checkpoints 0` or `--swa-full` turn it off). Its first
//! answer to a Gemma prompt thus differs from llama_decode's, and from its
//! own answer to the same prompt asked again with the cache on.

use std::fmt;
use std::str::FromStr;

use crate::model::Hparams;

/// How a prompt is cut into steps besides every `n_ubatch` tokens.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PromptCuts {
    /// `n_ubatch` tokens at a time from the first: llama.cpp's
    /// `llama_decode`, and llama-server for models without sliding-window
    /// layers (or with `--swa-full` / `--ctx-checkpoints 0`).
    Ubatch,
    /// Also where llama-server cuts by default: 4 and 4 + `n_ubatch` tokens
    /// before the end of the prompt, for models with sliding-window layers
    /// (the same as `Ubatch` for the others). The default: what a user of
    /// llama.cpp's server gets from it (issue 45), at the price of one more
    /// step for a sliding-window model's prompt.
    #[default]
    LlamaServer,
}

/// llama-server's checkpoints are this many tokens before a prompt's end
/// (and this many plus `n_ubatch`).
const CHECKPOINT_TAIL: usize = 4;

impl PromptCuts {
    /// The cuts as they fall on the model `hp`: llama-server cuts only the
    /// prompts of models with sliding-window layers, so for the others
    /// `LlamaServer` is `Ubatch`.
    pub fn for_model(self, hp: &Hparams) -> PromptCuts {
        if hp.swa.is_some() {
            self
        } else {
            PromptCuts::Ubatch
        }
    }

    /// How many prompt tokens the next step takes from position `fed` of a
    /// prompt of `n_prompt` tokens, given room for `budget`: as many as fit,
    /// but no step crosses a cut (see [`Self::for_model`]).
    pub fn take(self, fed: usize, n_prompt: usize, budget: usize, n_ubatch: usize) -> usize {
        let mut take = n_prompt.saturating_sub(fed).min(budget);
        if self == PromptCuts::LlamaServer {
            for back in [CHECKPOINT_TAIL + n_ubatch, CHECKPOINT_TAIL] {
                // llama-server ends a batch there only after adding a token
                // to it: a cut at `fed` itself is none.
                if let Some(cut) = n_prompt.checked_sub(back).filter(|&c| c > fed) {
                    take = take.min(cut - fed);
                }
            }
        }
        take
    }

    /// How many of a prompt's last tokens a prefix-cache hit leaves to
    /// compute: with llama-server's cuts the last piece (its 4 tokens), so
    /// that a prompt asked again is computed in the same last step as the
    /// first time and gets the same answer (a hit up to the last token
    /// would compute that token alone, rounded by another kernel than in
    /// its 4-token step); otherwise the last token.
    pub fn cache_tail(self) -> usize {
        match self {
            PromptCuts::Ubatch => 1,
            PromptCuts::LlamaServer => CHECKPOINT_TAIL,
        }
    }

    /// The steps a prompt of `n` tokens is prefilled in, alone, as lengths.
    pub fn pieces(self, n: usize, n_ubatch: usize) -> Vec<usize> {
        let mut out = Vec::new();
        let mut fed = 0;
        while fed < n {
            let k = self.take(fed, n, n_ubatch, n_ubatch);
            out.push(k);
            fed += k;
        }
        out
    }
}

impl FromStr for PromptCuts {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "ubatch" => Ok(PromptCuts::Ubatch),
            "llama-server" => Ok(PromptCuts::LlamaServer),
            _ => Err(format!(
                "'{s}' is not a way to cut prompts: ubatch (llama.cpp's llama_decode) or llama-server (its default for sliding-window models)"
            )),
        }
    }
}

impl fmt::Display for PromptCuts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            PromptCuts::Ubatch => "ubatch",
            PromptCuts::LlamaServer => "llama-server",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::PromptCuts::{LlamaServer, Ubatch};

    #[test]
    fn llama_server_cuts_sliding_window_prompts_before_their_end() {
        // As llama-server's batches for one prompt, n_ubatch 512.
        assert_eq!(LlamaServer.pieces(8, 512), [4, 4]);
        assert_eq!(LlamaServer.pieces(5, 512), [1, 4]);
        assert_eq!(LlamaServer.pieces(4, 512), [4]);
        assert_eq!(LlamaServer.pieces(400, 512), [396, 4]);
        assert_eq!(LlamaServer.pieces(516, 512), [512, 4]);
        assert_eq!(LlamaServer.pieces(517, 512), [1, 512, 4]);
        assert_eq!(LlamaServer.pieces(1300, 512), [512, 272, 512, 4]);
        // llama_decode's way.
        assert_eq!(Ubatch.pieces(1300, 512), [512, 512, 276]);
        assert_eq!(Ubatch.pieces(8, 512), [8]);
    }

    #[test]
    fn a_step_shared_with_others_stops_at_a_cut_too() {
        // 100 of 400 fed, room for 50: 50; room for 500: up to the cut at 396.
        assert_eq!(LlamaServer.take(100, 400, 50, 512), 50);
        assert_eq!(LlamaServer.take(100, 400, 500, 512), 296);
        assert_eq!(LlamaServer.take(396, 400, 500, 512), 4);
        assert_eq!(LlamaServer.take(400, 400, 500, 512), 0);
    }

    #[test]
    fn names_parse_and_print() {
        for c in [Ubatch, LlamaServer] {
            assert_eq!(c.to_string().parse::<super::PromptCuts>(), Ok(c));
        }
        assert!("whole"
            .parse::<super::PromptCuts>()
            .unwrap_err()
            .contains("llama-server"));
    }
}
