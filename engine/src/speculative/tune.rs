//! How long a prompt-lookup draft should be, from what this cluster has
//! measured: what a step of n rows costs, and how often drafts found with
//! an agreement of L tokens are taken.
//!
//! A draft of k tokens makes the step k rows longer and brings 1 + a tokens
//! (a: the drafts taken) instead of 1. Whether that pays depends on the
//! machine: where a step reads its weights once and rows are nearly free
//! (a GPU, a CPU with many cores and little bandwidth), long drafts pay even
//! when half is rejected; where rows cost nearly what the weights do (a
//! small model on a few fast cores: a 17-row step measured at 6x a 1-row
//! one), only a draft that is nearly certain pays, and then best a long
//! one. So the length is chosen to maximise the expected tokens per unit
//! of step time: with `h(j)` the measured chance that a draft's j-th token
//! is taken given the ones before it were (per agreement length, as a copy
//! in progress agrees long and is taken far more often than a short
//! coincidence, and per position, as a draft is mostly taken whole or lost
//! at its first tokens: once a copy's first tokens are right, the rest
//! nearly always are), a draft of k brings `1 + Σ_{j≤k} Π_{i≤j} h(i)`
//! tokens in a step costing `C(rows + 1 + k)`.
//!
//! Step costs are learnt from the steps' round trips, per power-of-two
//! bucket of rows; a size not yet measured is estimated from the nearest
//! measured ones, optimistically beyond the largest (rows cheap), so that
//! long drafts are tried once and then judged by what they cost. Until the
//! first steps are measured, the draft is as long as the agreement.

/// Row-count buckets: 1, 2, 3-4, 5-8, ... 65-128, 129+.
const COST_BUCKETS: usize = 9;
/// Agreement buckets: 1-3, 4-7, 8-15, 16-31, 32-63, 64.
const AGREE_BUCKETS: usize = 6;
/// Position buckets within a draft: 1, 2, 3-4, 5-8, 9-16, 17-32, 33-64.
const POS_BUCKETS: usize = 7;
/// Weight of a new measurement in a bucket's running mean.
const EWMA: f64 = 0.2;
/// Beyond the largest measured step, a row is assumed to cost this
/// fraction of a one-row step (optimistic: a draft that long is then tried
/// and measured).
const OPTIMISTIC_ROW: f64 = 0.02;
/// The prior of a draft's first token: taken 4 times in 5, worth 10
/// drafts. A later position's prior is the estimate of the one before it
/// (a copy right so far is as likely to go on), worth as much.
const PRIOR_TAKEN: f64 = 8.0;
const PRIOR_MISSED: f64 = 2.0;
/// Evidence is kept to this weight (older outcomes fade).
const MAX_WEIGHT: f64 = 400.0;

#[derive(Clone, Copy, Debug, Default)]
struct Mean {
    rows: f64,
    ms: f64,
    n: u64,
}

/// What drafting has learnt of one cluster (one model, one pipeline).
#[derive(Clone, Debug)]
pub struct Tuner {
    cost: [Mean; COST_BUCKETS],
    /// (taken, missed) draft tokens per agreement bucket and position
    /// bucket, as seen: a token counts where it was reached (its draft's
    /// tokens before it were taken).
    taken: [[(f64, f64); POS_BUCKETS]; AGREE_BUCKETS],
}

impl Default for Tuner {
    fn default() -> Self {
        Tuner {
            cost: [Mean::default(); COST_BUCKETS],
            taken: [[(0.0, 0.0); POS_BUCKETS]; AGREE_BUCKETS],
        }
    }
}

/// The position bucket of a draft's `j`-th token (from 1).
fn pos_bucket(j: usize) -> usize {
    ((j.max(1) - 1).checked_ilog2().map_or(0, |l| l as usize + 1)).min(POS_BUCKETS - 1)
}

fn cost_bucket(rows: usize) -> usize {
    (rows.max(1).next_power_of_two().trailing_zeros() as usize).min(COST_BUCKETS - 1)
}

fn agree_bucket(agree: usize) -> usize {
    let log2 = (usize::BITS - 1 - agree.max(1).leading_zeros()) as usize;
    log2.saturating_sub(1).min(AGREE_BUCKETS - 1)
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

    /// A draft of `k` tokens found with an agreement of `agree` had
    /// `taken` of them taken (the one after, if any, was not).
    pub fn record_draft(&mut self, agree: usize, k: usize, taken: usize) {
        let row = &mut self.taken[agree_bucket(agree)];
        for j in 1..=k.min(taken + 1) {
            let (t, m) = &mut row[pos_bucket(j)];
            if j <= taken {
                *t += 1.0;
            } else {
                *m += 1.0;
            }
            let w = *t + *m;
            if w > MAX_WEIGHT {
                *t *= MAX_WEIGHT / w;
                *m *= MAX_WEIGHT / w;
            }
        }
    }

    /// The chance that the `j`-th token (from 1) of a draft found with
    /// agreement `agree` is taken once the ones before it were.
    pub fn alpha(&self, agree: usize, j: usize) -> f64 {
        self.alphas(agree)[pos_bucket(j)]
    }

    /// [`Tuner::alpha`] for each position bucket.
    fn alphas(&self, agree: usize) -> [f64; POS_BUCKETS] {
        let w = PRIOR_TAKEN + PRIOR_MISSED;
        let mut prior = PRIOR_TAKEN / w;
        let mut out = [0.0; POS_BUCKETS];
        for (a, (t, m)) in out.iter_mut().zip(self.taken[agree_bucket(agree)]) {
            *a = (t + w * prior) / (t + m + w);
            prior = *a;
        }
        out
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

    /// How many of `avail` draft tokens (found with agreement `agree`) to
    /// send, in a step that already has `rows` rows before this sequence's
    /// token: the length with the most expected tokens per unit of step
    /// time (0: decoding alone is better). None until steps are measured.
    pub fn choose(&self, agree: usize, avail: usize, rows: usize) -> Option<usize> {
        let base = self.cost(rows + 1)?;
        let mut best = (0, 1.0 / base);
        let mut k = 1;
        let mut candidates = Vec::new();
        while k < avail {
            candidates.push(k);
            k *= 2;
        }
        if avail > 0 {
            candidates.push(avail);
        }
        // expected[k]: 1 + the chance of reaching and taking each token up
        // to the k-th.
        let alphas = self.alphas(agree);
        let mut expected = Vec::with_capacity(avail + 1);
        let (mut sum, mut reach) = (1.0, 1.0);
        expected.push(sum);
        for j in 1..=avail {
            reach *= alphas[pos_bucket(j)];
            sum += reach;
            expected.push(sum);
        }
        for k in candidates {
            let rate = expected[k] / self.cost(rows + 1 + k)?;
            if rate > best.1 {
                best = (k, rate);
            }
        }
        Some(best.0)
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

    #[test]
    fn buckets() {
        assert_eq!(
            [1, 2, 3, 4, 5, 8, 9, 65, 1000].map(cost_bucket),
            [0, 1, 2, 2, 3, 3, 4, 7, 8]
        );
        assert_eq!(
            [1, 2, 3, 4, 7, 8, 16, 31, 32, 64].map(agree_bucket),
            [0, 0, 0, 1, 1, 2, 3, 3, 4, 5]
        );
        assert_eq!(
            [1, 2, 3, 4, 5, 8, 9, 16, 17, 33, 64, 99].map(pos_bucket),
            [0, 1, 2, 2, 3, 3, 4, 4, 5, 6, 6, 6]
        );
    }

    #[test]
    fn nothing_measured_nothing_chosen() {
        assert_eq!(Tuner::default().choose(8, 16, 0), None);
    }

    /// Rows nearly free: draft long even when unsure (a draft token taken
    /// 4 times in 5 is worth sending up to the length where the expected
    /// tokens level off).
    #[test]
    fn cheap_rows_draft_long() {
        let mut t = measured(&[(1, 20.0), (2, 20.5), (17, 22.0), (65, 26.0)]);
        for _ in 0..25 {
            t.record_draft(3, 8, 8);
            t.record_draft(3, 8, 0);
        }
        assert!(t.alpha(3, 1) < 0.6 && t.alpha(3, 5) > 0.9);
        assert!(t.choose(3, 64, 0).unwrap() >= 16);
    }

    /// Drafts lost at the same place every time are cut there.
    #[test]
    fn a_draft_is_cut_where_drafts_are_lost() {
        let mut t = measured(&[(1, 20.0), (2, 20.5), (17, 22.0), (65, 26.0)]);
        for _ in 0..50 {
            t.record_draft(3, 8, 4);
        }
        assert!(t.alpha(3, 4) > 0.9 && t.alpha(3, 5) < 0.2);
        assert!(t.choose(3, 64, 0).unwrap() <= 8);
    }

    /// Where the first extra row costs a whole step and the next ones
    /// little (ggml's gemv for one row, tiled kernels from two: Qwen 0.5B,
    /// 2 threads on a Zen 5), a draft that is taken whole half the time and
    /// lost at its first token otherwise is worth sending whole: taken per
    /// token on average it would not be (1 + α + α² ... with α one half).
    #[test]
    fn all_or_nothing_drafts_are_sent_whole() {
        let mut t = measured(&[
            (1, 16.0),
            (2, 32.0),
            (4, 38.0),
            (8, 50.0),
            (17, 68.0),
            (33, 116.0),
            (65, 203.0),
        ]);
        for _ in 0..40 {
            t.record_draft(3, 16, 16);
            t.record_draft(3, 16, 0);
        }
        assert_eq!(t.choose(3, 16, 0), Some(16));
    }

    /// Rows as dear as this machine's (Qwen 0.5B, 2 threads: 1 row 20.6
    /// ms, 17 rows 132): an unsure short match is not worth a row, a copy
    /// that is nearly always taken is worth a long draft.
    #[test]
    fn dear_rows_draft_only_when_sure() {
        let mut t = measured(&[
            (1, 20.6),
            (2, 34.0),
            (4, 47.0),
            (8, 84.0),
            (17, 132.0),
            (33, 222.0),
            (65, 277.0),
        ]);
        for _ in 0..40 {
            t.record_draft(3, 3, 0);
            t.record_draft(40, 16, 16);
        }
        assert_eq!(t.choose(3, 16, 0), Some(0));
        assert_eq!(t.choose(40, 64, 0), Some(64));
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
