//! How long a prompt-lookup draft should be, from what this cluster has
//! measured: what a step of n rows costs, and what drafts of each length
//! would have brought on its own recent answers.
//!
//! A draft of k tokens makes the step k rows longer and brings 1 + a tokens
//! (a: the drafts taken) instead of 1. Whether that pays depends on the
//! machine (where rows are nearly free, long drafts pay even when half is
//! rejected; where a row costs nearly what a step does, only drafts that are
//! nearly always taken) and on the text (a verbatim copy in progress is
//! taken until its edit; a short coincidence rarely). A model of the chance
//! of each draft token (what this tuner was until 2026-11-29) misses what
//! matters most in a copy: that a draft taken whole makes the next match
//! agree longer and its draft longer, until the copy's end. So the length
//! comes from a *rule* (draft only from a match agreeing on at least
//! `min_agree` tokens, `per_agree` draft tokens per token of agreement), and
//! the rule is chosen by replaying the cluster's recently ended answers:
//! for greedy decoding what any draft would have brought at any point of a
//! finished answer is known exactly (the tokens that followed), so each
//! candidate rule's steps, tokens and time (by the measured step costs) are
//! counted as if it had drafted that answer, and the fastest rule drafts
//! the next steps. Sampled answers are one draw of what could have followed;
//! they are replayed the same way, as an estimate.
//!
//! Step costs are learnt from decode steps' round trips (every row wanting
//! logits, as a draft's rows do), per power-of-two bucket of rows; a size
//! not yet measured is estimated from the nearest measured ones,
//! optimistically beyond the largest (rows cheap), so that a rule with long
//! drafts is tried and then judged by what its steps cost. Until an answer
//! has been replayed, the draft is as long as the agreement.

use super::{lookup, Recent};

/// Row-count buckets: 1, 2, 3-4, 5-8, ... 65-128, 129+.
const COST_BUCKETS: usize = 9;
/// Weight of a new measurement in a bucket's running mean.
const EWMA: f64 = 0.2;
/// Beyond the largest measured step, a row is assumed to cost this
/// fraction of a one-row step (optimistic: a draft that long is then tried
/// and measured).
const OPTIMISTIC_ROW: f64 = 0.02;
/// The candidate rules' thresholds (0: any match `SpecParams::ngram`
/// allows; usize::MAX: no drafts) and draft tokens per token of agreement
/// (agreement is counted up to 64 tokens).
const MIN_AGREE: [usize; 11] = [usize::MAX, 64, 48, 32, 24, 16, 12, 8, 6, 4, 0];
const PER_AGREE: [f64; 3] = [0.5, 1.0, 2.0];
/// The rules' scores count the last tokens replayed most: a token's
/// weight halves with every this many replayed after it.
const HALF_LIFE: f64 = 1024.0;
/// Drafting changes rule only on this much replayed evidence (tokens, as
/// weighed), and for a rule this much faster than its own: one short
/// answer says little of the next.
const MIN_EVIDENCE: f64 = 256.0;
const MARGIN: f64 = 0.05;
/// Most positions of one answer replayed (its last ones).
const MAX_REPLAY: usize = 512;

#[derive(Clone, Copy, Debug, Default)]
struct Mean {
    rows: f64,
    ms: f64,
    n: u64,
}

/// When a prompt-lookup match drafts, and how many tokens.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rule {
    /// Draft only from a match that agrees on at least this many tokens.
    pub min_agree: usize,
    /// Draft tokens per token of agreement (at least one).
    pub per_agree: f64,
}

impl Rule {
    /// As long as the agreement (`--draft-length agreement`).
    pub const AGREEMENT: Rule = Rule {
        min_agree: 0,
        per_agree: 1.0,
    };

    /// Draft tokens to send of `avail` found with agreement `agree`.
    pub fn len(&self, agree: usize, avail: usize) -> usize {
        if agree < self.min_agree || avail == 0 {
            return 0;
        }
        ((agree as f64 * self.per_agree).ceil() as usize).clamp(1, avail)
    }
}

impl std::fmt::Display for Rule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.min_agree == usize::MAX {
            return write!(f, "no drafts");
        }
        write!(f, "{}x the agreement", self.per_agree)?;
        if self.min_agree > 0 {
            write!(f, " from {} tokens of agreement", self.min_agree)?;
        }
        Ok(())
    }
}

/// What drafting has learnt of one cluster (one model, one pipeline).
#[derive(Clone, Debug)]
pub struct Tuner {
    cost: [Mean; COST_BUCKETS],
    /// Each candidate rule's replayed (tokens, ms), earlier answers fading.
    scores: Vec<(Rule, f64, f64)>,
    rule: Rule,
}

impl Default for Tuner {
    fn default() -> Self {
        let mut scores = Vec::new();
        for min_agree in MIN_AGREE {
            for per_agree in PER_AGREE {
                scores.push((
                    Rule {
                        min_agree,
                        per_agree,
                    },
                    0.0,
                    0.0,
                ));
                if min_agree == usize::MAX {
                    break;
                }
            }
        }
        Tuner {
            cost: [Mean::default(); COST_BUCKETS],
            scores,
            rule: Rule::AGREEMENT,
        }
    }
}

fn cost_bucket(rows: usize) -> usize {
    (rows.max(1).next_power_of_two().trailing_zeros() as usize).min(COST_BUCKETS - 1)
}

impl Tuner {
    /// A step of `rows` rows took `ms` from sending to its answer.
    pub fn record_step(&mut self, rows: usize, ms: f64) {
        if rows == 0 || !ms.is_finite() || ms <= 0.0 {
            return;
        }
        let m = &mut self.cost[cost_bucket(rows)];
        if m.n == 0 {
            (m.rows, m.ms) = (rows as f64, ms);
        } else {
            m.rows += EWMA * (rows as f64 - m.rows);
            m.ms += EWMA * (ms - m.ms);
        }
        m.n += 1;
    }

    /// What a step of `rows` rows is expected to cost (ms); None before
    /// any step was measured.
    pub fn cost(&self, rows: usize) -> Option<f64> {
        let r = rows.max(1) as f64;
        let known = || self.cost.iter().filter(|m| m.n > 0);
        let first = known().next()?;
        let b = &self.cost[cost_bucket(rows)];
        if b.n > 0 {
            // Within a bucket, the step's cost scales with its rows
            // around the bucket's mean.
            let slope = self.slope_near(b);
            return Some((b.ms + slope * (r - b.rows)).max(b.ms * 0.5));
        }
        let below = known().rfind(|m| m.rows <= r);
        let above = known().find(|m| m.rows > r);
        Some(match (below, above) {
            (Some(lo), Some(hi)) => {
                lo.ms + (hi.ms - lo.ms) * (r - lo.rows) / (hi.rows - lo.rows).max(1e-9)
            }
            (None, Some(hi)) => hi.ms * (r / hi.rows).max(0.5),
            (Some(lo), None) => {
                let one = if first.rows <= 1.0 {
                    first.ms
                } else {
                    lo.ms / lo.rows
                };
                lo.ms + (r - lo.rows) * (self.slope_near(lo)).max(OPTIMISTIC_ROW * one)
            }
            (None, None) => unreachable!("some bucket is known"),
        })
    }

    /// Cost per row between `m` and the measured bucket below it (0 when
    /// there is none).
    fn slope_near(&self, m: &Mean) -> f64 {
        self.cost
            .iter()
            .rfind(|o| o.n > 0 && o.rows < m.rows - 0.5)
            .map_or(0.0, |lo| ((m.ms - lo.ms) / (m.rows - lo.rows)).max(0.0))
    }

    /// The rule drafting follows now.
    pub fn rule(&self) -> Rule {
        self.rule
    }

    /// How many of `avail` draft tokens (found with agreement `agree`) to
    /// send: the current rule's length (0: decode alone).
    pub fn choose(&self, agree: usize, avail: usize) -> usize {
        self.rule.len(agree, avail)
    }

    /// An answer ended: `tokens` its prompt and answer (the answer from
    /// `prompt_len`), `recent` the other sequences drafts looked in, as
    /// the sequence drafted (`ngram`, `n_max`). Replays every candidate
    /// rule over it and drafts from now on by the fastest so far. Nothing
    /// is replayed before a step was measured. Returns the rule, if it
    /// changed.
    pub fn replay(
        &mut self,
        tokens: &[u32],
        prompt_len: usize,
        recent: Option<&Recent>,
        ngram: usize,
        n_max: usize,
    ) -> Option<Rule> {
        let first = (prompt_len + 1).max(tokens.len().saturating_sub(MAX_REPLAY));
        if first >= tokens.len() || n_max == 0 || self.cost(1).is_none() {
            return None;
        }
        // At each point of the answer: the match's agreement, its draft's
        // length and how many of its tokens are what followed.
        let found: Vec<(usize, usize, usize)> = (first..tokens.len())
            .map(|p| {
                let Some((d, agree)) = lookup(&tokens[..p], recent, ngram, n_max) else {
                    return (0, 0, 0);
                };
                let next = &tokens[p..];
                let avail = d.len().min(next.len());
                let right = d.iter().zip(next).take_while(|(a, b)| a == b).count();
                (agree, avail, right)
            })
            .collect();
        let longest = found.iter().map(|f| f.1).max().unwrap_or(0);
        let step: Vec<f64> = (0..=longest)
            .map(|k| self.cost(1 + k).expect("measured above"))
            .collect();
        let fade = 0.5f64.powf(found.len() as f64 / HALF_LIFE);
        for (rule, tok, ms) in self.scores.iter_mut() {
            let (mut t, mut m, mut i) = (0.0, 0.0, 0);
            while i < found.len() {
                let (agree, avail, right) = found[i];
                let k = rule.len(agree, avail);
                let gain = k.min(right) + 1;
                t += gain as f64;
                m += step[k];
                i += gain;
            }
            *tok = *tok * fade + t;
            *ms = *ms * fade + m;
        }
        let rate = |&(_, t, m): &(Rule, f64, f64)| if m > 0.0 { t / m } else { 0.0 };
        let now = self
            .scores
            .iter()
            .find(|s| s.0 == self.rule)
            .expect("a candidate");
        // The first of equals: candidates go from no drafts to the most
        // drafts, so a tie keeps the rows.
        let best = self
            .scores
            .iter()
            .fold(now, |b, s| if rate(s) > rate(b) { s } else { b });
        if now.1 < MIN_EVIDENCE || rate(best) <= rate(now) * (1.0 + MARGIN) {
            return None;
        }
        self.rule = best.0;
        Some(self.rule)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tuner that has measured steps of these (rows, ms).
    fn measured(costs: &[(usize, f64)]) -> Tuner {
        let mut t = Tuner::default();
        for &(rows, ms) in costs {
            t.record_step(rows, ms);
        }
        t
    }

    /// `n` tokens that rarely repeat a 3-gram (a xorshift over 5000 ids).
    fn text(seed: u64, n: usize) -> Vec<u32> {
        let mut x = seed | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x % 5000) as u32
            })
            .collect()
    }

    /// A code rewrite: a prompt holding a function, the answer the
    /// function again with one token changed in its middle.
    fn rewrite(seed: u64) -> (Vec<u32>, usize) {
        let code = text(seed, 200);
        let mut tokens = text(seed + 1, 20);
        tokens.extend(&code);
        tokens.extend(text(seed + 2, 10));
        let prompt = tokens.len();
        let mut answer = code.clone();
        answer[100] = 9999;
        tokens.extend(answer);
        (tokens, prompt)
    }

    /// Prose that echoes its prompt now and then: a few words of it, then
    /// its own way.
    fn echoes(seed: u64) -> (Vec<u32>, usize) {
        let mut tokens = text(seed, 100);
        let prompt = tokens.len();
        for i in 0..20 {
            let from = (i * 37) % 90;
            let quote: Vec<u32> = tokens[from..from + 4].to_vec();
            tokens.extend(quote);
            tokens.extend(text(seed + 10 + i as u64, 8));
        }
        (tokens, prompt)
    }

    #[test]
    fn buckets() {
        assert_eq!(
            [1, 2, 3, 4, 5, 8, 9, 65, 1000].map(cost_bucket),
            [0, 1, 2, 2, 3, 3, 4, 7, 8]
        );
    }

    #[test]
    fn a_rule_sizes_drafts() {
        let r = Rule::AGREEMENT;
        assert_eq!([r.len(3, 64), r.len(40, 16), r.len(5, 0)], [3, 16, 0]);
        let r = Rule {
            min_agree: 8,
            per_agree: 0.5,
        };
        assert_eq!([r.len(7, 64), r.len(8, 64), r.len(9, 64)], [0, 4, 5]);
        assert_eq!(
            r.to_string(),
            "0.5x the agreement from 8 tokens of agreement"
        );
        let off = Rule {
            min_agree: usize::MAX,
            per_agree: 1.0,
        };
        assert_eq!((off.len(64, 64), off.to_string()), (0, "no drafts".into()));
    }

    /// Until a step is measured nothing is replayed, and drafts are as
    /// long as their agreement.
    #[test]
    fn drafts_as_long_as_the_agreement_until_measured() {
        let mut t = Tuner::default();
        let (tokens, prompt) = rewrite(1);
        assert_eq!(t.replay(&tokens, prompt, None, 3, 64), None);
        assert_eq!((t.choose(8, 16), t.choose(40, 16)), (8, 16));
    }

    /// One short answer is not evidence enough to change the rule.
    #[test]
    fn one_short_answer_changes_nothing() {
        let mut t = measured(&[(1, 20.0), (65, 1300.0)]);
        let (tokens, prompt) = echoes(3);
        let short = &tokens[..prompt + 40];
        assert_eq!(t.replay(short, prompt, None, 3, 64), None);
        assert_eq!(t.rule(), Rule::AGREEMENT);
    }

    /// Where every row costs what a step does (deterministic mode computes
    /// each row alone), no draft can pay: a wrong one costs its rows for
    /// nothing. Replayed answers turn drafting off.
    #[test]
    fn rows_as_dear_as_steps_turn_drafting_off() {
        let mut t = measured(&[(1, 20.0), (2, 40.0), (17, 340.0), (65, 1300.0)]);
        for seed in 0..4 {
            let (tokens, prompt) = echoes(100 * seed);
            t.replay(&tokens, prompt, None, 3, 64);
        }
        assert_eq!(t.rule().min_agree, usize::MAX, "{}", t.rule());
        assert_eq!(t.choose(64, 64), 0);
    }

    /// Where rows are cheap beside a step, a rewrite keeps drafting: the
    /// copy's drafts are taken until the edit, and long.
    #[test]
    fn cheap_rows_keep_a_copy_drafting_long() {
        let mut t = measured(&[(1, 20.0), (2, 22.0), (17, 30.0), (65, 60.0)]);
        for seed in 0..4 {
            let (tokens, prompt) = rewrite(100 * seed);
            t.replay(&tokens, prompt, None, 3, 64);
        }
        assert!(t.rule().min_agree <= 8, "{}", t.rule());
        assert!(t.choose(32, 64) >= 32, "{}", t.rule());
    }

    /// A size not measured yet is estimated between its neighbours, and
    /// optimistically beyond the largest.
    #[test]
    fn costs_between_and_beyond() {
        let mut t = Tuner::default();
        t.record_step(1, 20.0);
        t.record_step(8, 90.0);
        let c4 = t.cost(4).unwrap();
        assert!((c4 - 50.0).abs() < 1e-6, "{c4}");
        let c64 = t.cost(64).unwrap();
        assert!(c64 > 90.0 && c64 <= 90.0 + 56.0 * 10.0 + 1e-6, "{c64}");
        // A single measured size: beyond it, rows cost 2% of it each.
        let mut t = Tuner::default();
        t.record_step(1, 20.0);
        assert!((t.cost(11).unwrap() - 24.0).abs() < 1e-6);
    }
}
