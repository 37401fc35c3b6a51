//! Token sampling: turns one step's logits into the next token id.
//!
//! The chain mirrors llama.cpp's common sampler so that results are comparable with it:
//! logit bias -> repetition / presence / frequency penalties -> (greedy if temperature is 0) ->
//! top-k -> top-p -> min-p -> temperature -> softmax -> one seeded draw.
//! Also here: log-probability helpers for the API's `logprobs`, and [`StopMatcher`], which cuts
//! streamed text at stop strings without ever emitting part of one.

use rand_chacha::ChaCha8Rng;
use rand_core::{RngCore, SeedableRng};
use serde::{Deserialize, Serialize};
use std::cmp::Ordering;

/// Sampling settings of one request. `Default` is greedy decoding with every filter off.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    /// 0 (or below 1e-6) means greedy argmax.
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens; 0 = off.
    pub top_k: u32,
    /// Nucleus sampling: keep the smallest prefix whose probability reaches `top_p`; 1 = off.
    pub top_p: f32,
    /// Drop tokens whose probability is below `min_p` times the best one's; 0 = off.
    pub min_p: f32,
    /// CTRL-style repetition penalty; 1 = off.
    pub repeat_penalty: f32,
    /// How many of the most recent history tokens the penalties look at; 0 = off.
    pub repeat_last_n: usize,
    /// OpenAI-style: subtracted once from every token seen in the window.
    pub presence_penalty: f32,
    /// OpenAI-style: subtracted once per occurrence in the window.
    pub frequency_penalty: f32,
    /// Added to the logit of the token id before anything else.
    pub logit_bias: Vec<(u32, f32)>,
    /// RNG seed; `None` picks a fresh one per sampler.
    pub seed: Option<u64>,
    /// Only tokens that keep the output a prefix of a document this grammar
    /// accepts are sampled (see `constraint`, which compiles it against the
    /// model's vocabulary).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub grammar: Option<Grammar>,
}

/// Whitespace between two JSON tokens in constrained output (llguidance's
/// `x-guidance.whitespace_pattern`): spaces, or one line break and an
/// indentation of 24 spaces or tabs at most. llguidance's default allows any
/// run of it, and a model that would rather not go on fills the answer with
/// blank lines to the token limit (seen on Qwen2.5-Coder 0.5B with a tool
/// call's schema).
pub const JSON_WHITESPACE: &str = r"[\x20\x09]{1,24}|\x0D?\x0A[\x20\x09]{0,24}";

/// What a request constrains its output to. Plain data: it travels with the
/// sampling settings to the stage that samples.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Grammar {
    /// Any JSON object (OpenAI's `response_format: {"type": "json_object"}`).
    JsonObject,
    /// A document valid against this JSON schema.
    JsonSchema { schema: serde_json::Value },
    /// A grammar in llguidance's Lark syntax (a superset of Lark's).
    Lark { grammar: String },
    /// Nothing is constrained until `token` is generated; from the token
    /// after it on, `grammar` is (a tool call once the model opens one).
    Triggered { token: u32, grammar: Box<Grammar> },
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logit_bias: Vec::new(),
            seed: None,
            grammar: None,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SamplingError {
    #[error("invalid sampling parameter {field} = {value}: allowed {allowed}")]
    InvalidParam {
        field: &'static str,
        value: String,
        allowed: String,
    },
}

fn invalid(field: &'static str, value: impl ToString, allowed: impl ToString) -> SamplingError {
    SamplingError::InvalidParam {
        field,
        value: value.to_string(),
        allowed: allowed.to_string(),
    }
}

impl SamplingParams {
    /// Rejects values outside the ranges the API accepts (OpenAI's where it has one); nothing is
    /// clamped, so a client learns about its mistake instead of getting silently different output.
    pub fn validate(&self, n_vocab: usize) -> Result<(), SamplingError> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(invalid(
                "temperature",
                self.temperature,
                "a finite value >= 0",
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(invalid("top_p", self.top_p, "(0, 1]"));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(invalid("min_p", self.min_p, "[0, 1]"));
        }
        if !(self.repeat_penalty.is_finite() && self.repeat_penalty > 0.0) {
            return Err(invalid(
                "repeat_penalty",
                self.repeat_penalty,
                "a finite value > 0",
            ));
        }
        if !(-2.0..=2.0).contains(&self.presence_penalty) {
            return Err(invalid(
                "presence_penalty",
                self.presence_penalty,
                "[-2, 2]",
            ));
        }
        if !(-2.0..=2.0).contains(&self.frequency_penalty) {
            return Err(invalid(
                "frequency_penalty",
                self.frequency_penalty,
                "[-2, 2]",
            ));
        }
        for &(token, bias) in &self.logit_bias {
            if token as usize >= n_vocab {
                let allowed = format!("token ids < {n_vocab}");
                return Err(invalid("logit_bias", format!("token {token}"), allowed));
            }
            if !(-100.0..=100.0).contains(&bias) {
                let value = format!("{bias} for token {token}");
                return Err(invalid("logit_bias", value, "biases in [-100, 100]"));
            }
        }
        Ok(())
    }
}

/// Samples tokens for one sequence. Owns its RNG, so the same seed and the same sequence of
/// `sample` calls always give the same tokens.
#[derive(Clone, Debug)]
pub struct Sampler {
    params: SamplingParams,
    rng: ChaCha8Rng,
    /// Scratch reused across calls so a step costs one full-vocab copy and no allocation.
    logits: Vec<f32>,
    candidates: Vec<(u32, f32)>,
    window: Vec<u32>,
}

/// Where a [`Sampler`] is: its settings and the exact position of its
/// random stream, so a sequence's sampling can move to another process
/// (when the last stage moves) and draw the same numbers it would have.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SamplerState {
    pub params: SamplingParams,
    pub seed: [u8; 32],
    pub stream: u64,
    /// ChaCha's word position, as a decimal string (JSON numbers lose u128s).
    pub word_pos: String,
}

impl Sampler {
    /// The settings it samples with.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// The settings and random-stream position (see [`SamplerState`]).
    pub fn state(&self) -> SamplerState {
        SamplerState {
            params: self.params.clone(),
            seed: self.rng.get_seed(),
            stream: self.rng.get_stream(),
            word_pos: self.rng.get_word_pos().to_string(),
        }
    }

    /// A sampler that goes on exactly where `state` was taken.
    pub fn restore(state: SamplerState) -> Result<Sampler, String> {
        let pos: u128 = state
            .word_pos
            .parse()
            .map_err(|e| format!("bad sampler word position {:?}: {e}", state.word_pos))?;
        let mut rng = ChaCha8Rng::from_seed(state.seed);
        rng.set_stream(state.stream);
        rng.set_word_pos(pos);
        Ok(Sampler {
            params: state.params,
            rng,
            logits: Vec::new(),
            candidates: Vec::new(),
            window: Vec::new(),
        })
    }
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Sampler {
        let seed = params.seed.unwrap_or_else(fresh_seed);
        Sampler {
            params,
            rng: ChaCha8Rng::seed_from_u64(seed),
            logits: Vec::new(),
            candidates: Vec::new(),
            window: Vec::new(),
        }
    }

    /// Moves the random stream past `n` draws, as if `n` tokens had been sampled (a sampled
    /// token takes one draw): how a resumed request's sampler goes on where the one that
    /// generated its first tokens was. Greedy sampling draws nothing, so it skips nothing.
    pub fn skip_draws(&mut self, n: u64) {
        if self.params.temperature >= 1e-6 {
            // One draw is one u64: two 32-bit words of ChaCha's stream.
            let pos = self.rng.get_word_pos() + 2 * u128::from(n);
            self.rng.set_word_pos(pos);
        }
    }

    /// The logits after logit bias and penalties (NaN read as -inf): what the filters and the
    /// greedy pick see. `history` is every token of the sequence so far, prompt included.
    pub fn adjusted_logits(&mut self, logits: &[f32], history: &[u32]) -> &[f32] {
        self.adjust(logits, history);
        &self.logits
    }

    /// Picks the next token. Greedy (temperature 0) takes the argmax, ties to the lowest id,
    /// and draws nothing from the RNG.
    pub fn sample(&mut self, logits: &[f32], history: &[u32]) -> u32 {
        self.adjust(logits, history);
        let p = &self.params;
        if p.temperature < 1e-6 {
            return greedy(&self.logits);
        }
        let c = &mut self.candidates;
        c.clear();
        c.extend(
            self.logits
                .iter()
                .enumerate()
                .filter(|(_, l)| **l > f32::NEG_INFINITY)
                .map(|(i, &l)| (i as u32, l)),
        );
        if c.is_empty() {
            return 0;
        }
        let k = p.top_k as usize;
        if k > 0 && k < c.len() {
            c.select_nth_unstable_by(k - 1, by_logit_desc);
            c.truncate(k);
        }
        // Sort only when top-p needs the order: min-p and the draw work on any fixed order.
        if p.top_p < 1.0 {
            c.sort_unstable_by(by_logit_desc);
            let max = c[0].1;
            let total: f64 = c
                .iter()
                .map(|&(_, l)| (f64::from(l) - f64::from(max)).exp())
                .sum();
            let target = f64::from(p.top_p) * total;
            let mut cum = 0.0;
            let keep = c
                .iter()
                .position(|&(_, l)| {
                    cum += (f64::from(l) - f64::from(max)).exp();
                    cum >= target
                })
                .map_or(c.len(), |i| i + 1);
            c.truncate(keep);
        }
        let max = c.iter().map(|&(_, l)| l).fold(f32::NEG_INFINITY, f32::max);
        if max == f32::INFINITY {
            // exp(inf - inf) is NaN; an infinite logit simply wins.
            return c
                .iter()
                .min_by(|a, b| by_logit_desc(a, b))
                .map_or(0, |&(id, _)| id);
        }
        if p.min_p > 0.0 {
            // p_i >= min_p * p_max  <=>  l_i >= l_max + ln(min_p)
            let threshold = f64::from(max) + f64::from(p.min_p).ln();
            c.retain(|&(_, l)| f64::from(l) >= threshold);
        }
        let inv_t = 1.0 / f64::from(p.temperature);
        let weight = |l: f32| ((f64::from(l) - f64::from(max)) * inv_t).exp();
        let total: f64 = c.iter().map(|&(_, l)| weight(l)).sum();
        // 53 random bits -> uniform in [0, 1).
        let mut r = (self.rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64 * total;
        for &(id, l) in c.iter() {
            r -= weight(l);
            if r < 0.0 {
                return id;
            }
        }
        c[c.len() - 1].0 // rounding left r a hair above the last weight
    }

    fn adjust(&mut self, logits: &[f32], history: &[u32]) {
        let p = &self.params;
        self.logits.clear();
        self.logits
            .extend(logits.iter().copied().map(nan_to_neg_inf));
        for &(token, bias) in &p.logit_bias {
            if let Some(l) = self.logits.get_mut(token as usize) {
                *l += bias;
            }
        }
        let penalize =
            p.repeat_penalty != 1.0 || p.presence_penalty != 0.0 || p.frequency_penalty != 0.0;
        if !penalize || p.repeat_last_n == 0 {
            return;
        }
        // Count occurrences in the window by sorting a copy of it: no per-call hash map.
        self.window.clear();
        self.window
            .extend_from_slice(&history[history.len().saturating_sub(p.repeat_last_n)..]);
        self.window.sort_unstable();
        for run in self.window.chunk_by(|a, b| a == b) {
            let Some(l) = self.logits.get_mut(run[0] as usize) else {
                continue;
            };
            // llama.cpp / CTRL: shrink toward "less likely" whatever the sign.
            if *l > 0.0 {
                *l /= p.repeat_penalty;
            } else {
                *l *= p.repeat_penalty;
            }
            *l -= run.len() as f32 * p.frequency_penalty + p.presence_penalty;
        }
    }
}

/// Seed for samplers without one: the std hasher's per-process random keys mixed with the clock,
/// so two samplers created in the same instant still differ.
/// A random seed (a fresh one each call).
pub fn fresh_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    h.write_u128(now.as_nanos());
    h.finish()
}

/// Higher logit first, then lower id: the order llama.cpp's references use.
fn by_logit_desc(a: &(u32, f32), b: &(u32, f32)) -> Ordering {
    b.1.total_cmp(&a.1).then(a.0.cmp(&b.0))
}

fn nan_to_neg_inf(l: f32) -> f32 {
    if l.is_nan() {
        f32::NEG_INFINITY
    } else {
        l
    }
}

/// Argmax; ties go to the lowest id and NaN never wins. Empty input gives 0.
pub fn greedy(logits: &[f32]) -> u32 {
    let mut best = (0, f32::NEG_INFINITY);
    for (i, &l) in logits.iter().enumerate() {
        if l > best.1 {
            best = (i as u32, l);
        }
    }
    best.0
}

/// The `n` largest of `pairs` by (value desc, id asc), sorted.
fn top_n(mut pairs: Vec<(u32, f32)>, n: usize) -> Vec<(u32, f32)> {
    if n < pairs.len() && n > 0 {
        pairs.select_nth_unstable_by(n - 1, by_logit_desc);
    }
    pairs.truncate(n);
    pairs.sort_unstable_by(by_logit_desc);
    pairs
}

/// The `n` largest raw logits, sorted by (logit desc, id asc); NaN ranks as -inf.
pub fn top_k_logits(logits: &[f32], k: usize) -> Vec<(u32, f32)> {
    let pairs = logits
        .iter()
        .enumerate()
        .map(|(i, &l)| (i as u32, nan_to_neg_inf(l)))
        .collect();
    top_n(pairs, k)
}

/// log(sum(exp(logits))), accumulated in f64 around the max so large logits cannot overflow.
fn log_sum_exp(logits: &[f32]) -> f64 {
    let max = logits
        .iter()
        .copied()
        .map(nan_to_neg_inf)
        .fold(f32::NEG_INFINITY, f32::max);
    if !max.is_finite() {
        return f64::from(max);
    }
    let sum: f64 = logits
        .iter()
        .map(|&l| (f64::from(nan_to_neg_inf(l)) - f64::from(max)).exp())
        .sum();
    f64::from(max) + sum.ln()
}

/// The `n` most likely tokens with their log-softmax values, by (logprob desc, id asc).
pub fn top_logprobs(logits: &[f32], n: usize) -> Vec<(u32, f32)> {
    let lse = log_sum_exp(logits);
    let mut top = top_k_logits(logits, n);
    for (_, l) in &mut top {
        *l = (f64::from(*l) - lse) as f32;
    }
    top
}

/// Log-softmax value of one token; -inf for an id outside `logits`.
pub fn logprob_of(logits: &[f32], token: u32) -> f32 {
    match logits.get(token as usize) {
        Some(&l) => (f64::from(nan_to_neg_inf(l)) - log_sum_exp(logits)) as f32,
        None => f32::NEG_INFINITY,
    }
}

/// What [`StopMatcher::push`] lets through.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StopOutput {
    /// Text that can be emitted now: it cannot be part of a stop string.
    pub text: String,
    /// A stop string was found; `text` ends right before it and nothing more will come.
    pub stopped: bool,
}

/// Cuts streamed text at the first stop string. Text that might be the start of a stop string is
/// held back until the next piece decides it, so no part of a stop string is ever emitted.
#[derive(Clone, Debug, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    pending: String,
    stopped: bool,
}

impl StopMatcher {
    pub fn new(stops: Vec<String>) -> Self {
        let stops = stops.into_iter().filter(|s| !s.is_empty()).collect();
        Self {
            stops,
            pending: String::new(),
            stopped: false,
        }
    }

    pub fn push(&mut self, piece: &str) -> StopOutput {
        if self.stopped {
            return StopOutput::default();
        }
        self.pending.push_str(piece);
        if let Some(at) = self
            .stops
            .iter()
            .filter_map(|s| self.pending.find(s.as_str()))
            .min()
        {
            self.pending.truncate(at);
            self.stopped = true;
            return StopOutput {
                text: std::mem::take(&mut self.pending),
                stopped: true,
            };
        }
        // Hold back the longest suffix that some stop string starts with. Only char boundaries
        // are tried, so a multi-byte character is never split.
        let hold_from = self
            .pending
            .char_indices()
            .map(|(i, _)| i)
            .find(|&i| self.stops.iter().any(|s| s.starts_with(&self.pending[i..])))
            .unwrap_or(self.pending.len());
        let held = self.pending.split_off(hold_from);
        StopOutput {
            text: std::mem::replace(&mut self.pending, held),
            stopped: false,
        }
    }

    /// End of generation without a stop: releases whatever was held back.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}
