//! The coordinator's Prometheus metrics: tokens in and out, steps, queue
//! depth, active sequences, time to first token, and each stage's step time
//! as reported in the step headers.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use std::collections::VecDeque;
use std::sync::atomic::AtomicU64;
use std::sync::Mutex;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StageLabel {
    pub stage: u32,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    pub reason: String,
}

/// The prefix cache's counters (the same on every stage by construction;
/// each worker reports the bytes it holds for the cache).
#[derive(Default)]
pub struct PrefixMetrics {
    /// Requests that looked their prompt up.
    pub lookups: Counter<u64, AtomicU64>,
    /// Prompt tokens taken from the cache, and computed by requests that looked up.
    pub hit_tokens: Counter<u64, AtomicU64>,
    pub miss_tokens: Counter<u64, AtomicU64>,
    /// Blocks evicted, by why ("need": a step needed the cells; "bound":
    /// over --prefix-cache-size).
    pub evictions: Family<ReasonLabel, Counter<u64, AtomicU64>>,
    /// Cells the cache holds on every stage.
    pub cells: Gauge<i64>,
    /// Recoveries that dropped the cache.
    pub dropped: Counter<u64, AtomicU64>,
}

impl PrefixMetrics {
    pub fn evicted(&self, reason: &str, blocks: usize) {
        if blocks > 0 {
            self.evictions
                .get_or_create(&ReasonLabel {
                    reason: reason.into(),
                })
                .inc_by(blocks as u64);
        }
    }

    fn register(&self, r: &mut Registry) {
        r.register(
            "prefix_cache_lookups",
            "Requests that looked their prompt up in the prefix cache",
            self.lookups.clone(),
        );
        r.register(
            "prefix_cache_hit_tokens",
            "Prompt tokens taken from the prefix cache",
            self.hit_tokens.clone(),
        );
        r.register(
            "prefix_cache_miss_tokens",
            "Prompt tokens computed by requests that looked up",
            self.miss_tokens.clone(),
        );
        r.register(
            "prefix_cache_evictions",
            "Prefix cache blocks evicted (reason: need, bound)",
            self.evictions.clone(),
        );
        r.register(
            "prefix_cache_cells",
            "KV cells the prefix cache holds on every stage",
            self.cells.clone(),
        );
        r.register(
            "prefix_cache_dropped",
            "Recoveries that dropped the prefix cache",
            self.dropped.clone(),
        );
    }
}

pub struct Metrics {
    pub steps: Counter<u64, AtomicU64>,
    /// Steps sent batch-invariant (`--deterministic`).
    pub invariant_steps: Counter<u64, AtomicU64>,
    pub tokens_in: Counter<u64, AtomicU64>,
    pub tokens_out: Counter<u64, AtomicU64>,
    /// Speculative decoding: draft tokens sent, and those the model took.
    pub draft_tokens: Counter<u64, AtomicU64>,
    pub draft_accepted: Counter<u64, AtomicU64>,
    pub queue_depth: Gauge<i64>,
    pub active_sequences: Gauge<i64>,
    pub step_latency_us: Gauge<i64>,
    /// Recoveries begun (a worker lost, a step failed or stuck).
    pub recoveries: Counter<u64, AtomicU64>,
    /// Replayed samples that differed from the token sent before.
    pub replay_mismatches: Counter<u64, AtomicU64>,
    ttft: Histogram,
    stage_ms: Family<StageLabel, Histogram, fn() -> Histogram>,
    pub registry: Registry,
    /// Per-hop latency samples (µs).
    hops: Samples,
    /// Per-step time the stages waited for expert workers (ms), for steps
    /// that called any.
    expert_waits: Samples,
    expert_wait_ms: Family<StageLabel, Histogram, fn() -> Histogram>,
    /// Prompt tokens of each step that also decoded (see `--prefill-chunk`).
    pub mixed_step_prompt_tokens: Histogram,
    pub prefix: PrefixMetrics,
}

/// The most recent `SAMPLES` values of something.
#[derive(Default)]
pub struct Samples(Mutex<VecDeque<f64>>);

const SAMPLES: usize = 4096;

impl Samples {
    pub fn push(&self, x: f64) {
        let mut h = self.0.lock().unwrap();
        if h.len() == SAMPLES {
            h.pop_front();
        }
        h.push_back(x);
    }

    /// (p50, p99, mean, samples); zeros without samples.
    pub fn summary(&self) -> (f64, f64, f64, usize) {
        let mut v: Vec<f64> = self.0.lock().unwrap().iter().copied().collect();
        if v.is_empty() {
            return (0.0, 0.0, 0.0, 0);
        }
        v.sort_by(f64::total_cmp);
        let at = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize];
        let mean = v.iter().sum::<f64>() / v.len() as f64;
        (at(0.50), at(0.99), mean, v.len())
    }
}

fn ms_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.25, 2.0, 18))
}

impl Metrics {
    pub fn new() -> Metrics {
        let (steps, tokens_in, tokens_out) =
            (Counter::default(), Counter::default(), Counter::default());
        let (queue_depth, active_sequences, step_latency_us) =
            (Gauge::default(), Gauge::default(), Gauge::default());
        let (recoveries, replay_mismatches) = (Counter::default(), Counter::default());
        let ttft = ms_histogram();
        let stage_ms = Family::<StageLabel, Histogram>::new_with_constructor(
            ms_histogram as fn() -> Histogram,
        );
        let expert_wait_ms = Family::<StageLabel, Histogram>::new_with_constructor(
            ms_histogram as fn() -> Histogram,
        );
        let mixed_step_prompt_tokens = Histogram::new(exponential_buckets(1.0, 2.0, 14));
        let mut r = Registry::with_prefix("omni_coordinator");
        r.register("steps", "Pipeline steps sent", steps.clone());
        let invariant_steps = Counter::default();
        r.register(
            "invariant_steps",
            "Pipeline steps sent batch-invariant (deterministic requests)",
            invariant_steps.clone(),
        );
        r.register(
            "tokens_in",
            "Tokens fed to the pipeline (prompt and generated)",
            tokens_in.clone(),
        );
        r.register("tokens_out", "Tokens sampled", tokens_out.clone());
        let (draft_tokens, draft_accepted) = (Counter::default(), Counter::default());
        r.register(
            "draft_tokens",
            "Speculative decoding: draft tokens sent to be verified",
            draft_tokens.clone(),
        );
        r.register(
            "draft_accepted_tokens",
            "Speculative decoding: draft tokens the model took",
            draft_accepted.clone(),
        );
        r.register(
            "queue_depth",
            "Requests waiting for a sequence slot",
            queue_depth.clone(),
        );
        r.register(
            "active_sequences",
            "Sequences being generated",
            active_sequences.clone(),
        );
        r.register(
            "step_round_trip_us",
            "Round trip of the last step through every stage, microseconds",
            step_latency_us.clone(),
        );
        r.register(
            "recoveries",
            "Recoveries begun: a worker was lost, or a step failed or got no answer",
            recoveries.clone(),
        );
        r.register(
            "replay_mismatches",
            "Tokens a recovery's replay sampled differently from the ones sent before",
            replay_mismatches.clone(),
        );
        r.register(
            "time_to_first_token_ms",
            "Arrival to first token, milliseconds",
            ttft.clone(),
        );
        r.register(
            "stage_step_ms",
            "Compute time of one step on each stage, milliseconds",
            stage_ms.clone(),
        );
        r.register(
            "mixed_step_prompt_tokens",
            "Prompt tokens in each step that carried both prompt and decode tokens (at most --prefill-chunk)",
            mixed_step_prompt_tokens.clone(),
        );
        r.register(
            "stage_expert_wait_ms",
            "Time one step of each stage waited for expert workers, milliseconds",
            expert_wait_ms.clone(),
        );
        let prefix = PrefixMetrics::default();
        prefix.register(&mut r);
        Metrics {
            prefix,
            steps,
            invariant_steps,
            tokens_in,
            tokens_out,
            draft_tokens,
            draft_accepted,
            queue_depth,
            active_sequences,
            step_latency_us,
            recoveries,
            replay_mismatches,
            ttft,
            stage_ms,
            registry: r,
            hops: Samples::default(),
            expert_waits: Samples::default(),
            expert_wait_ms,
            mixed_step_prompt_tokens,
        }
    }

    pub fn record_stage(&self, stage: u32, ms: f64) {
        self.stage_ms
            .get_or_create(&StageLabel { stage })
            .observe(ms);
    }

    /// One step's time outside compute, spread over its hops.
    pub fn record_hop(&self, us: f64) {
        self.hops.push(us);
    }

    /// (p50, p99, samples) of the per-hop latency in µs.
    pub fn hop_percentiles(&self) -> (f64, f64, usize) {
        let (p50, p99, _, n) = self.hops.summary();
        (p50, p99, n)
    }

    /// How long one stage's step waited for expert workers.
    pub fn record_expert_wait(&self, stage: u32, ms: f64) {
        self.expert_wait_ms
            .get_or_create(&StageLabel { stage })
            .observe(ms);
    }

    /// One step's total wait for expert workers, over all stages.
    pub fn record_step_expert_wait(&self, ms: f64) {
        self.expert_waits.push(ms);
    }

    /// (p50, mean, samples) of the per-step expert wait in ms.
    pub fn expert_wait(&self) -> (f64, f64, usize) {
        let (p50, _, mean, n) = self.expert_waits.summary();
        (p50, mean, n)
    }

    pub fn record_ttft(&self, ms: f64) {
        self.ttft.observe(ms);
    }

    /// The text exposition format.
    pub fn render(&self) -> String {
        let mut s = String::new();
        prometheus_client::encoding::text::encode(&mut s, &self.registry)
            .expect("writing to a String");
        s
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}
