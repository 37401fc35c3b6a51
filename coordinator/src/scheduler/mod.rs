//! The pipeline driver: continuous batching over the stages.
//!
//! One thread owns every sequence's token log and decides what each step
//! carries. Sequences join at step boundaries; prompts are fed in chunks of
//! at most `n_ubatch` tokens, decode tokens first; many sequences share a
//! step. With several stages that compute on their own hardware the active
//! sequences are dealt into as many micro-batch groups, each with at most
//! one step in flight, so every stage has work while the others compute
//! (stages that share cores take turns instead: one group per compute
//! site, see `pipeline.rs`). The last stage samples and returns
//! only tokens; this thread turns them into text (stream-safe UTF-8, stop
//! strings that never leak) and events for the client.
//!
//! Freeing a sequence: its slot goes into the `remove` list of the next step
//! sent (every stage frees the slot's KV cells before that step), and only
//! then can a new sequence take the slot. Frames travel one FIFO path, so a
//! step sent before the removal can never see the new owner's tokens.
//!
//! Prefix cache (`prefix.rs`): a new sequence starts from the longest
//! cached prefix of its prompt (whole blocks, then the first tokens of
//! one); every stage lets its slot see those cells (shared, not copied)
//! and it prefills only the rest. Blocks of fed tokens are registered once
//! their step came back; a sequence's blocks, and its last tokens, are
//! kept when it ends and evicted least recently used first when a step
//! needs their cells. The cache lives in the KV pool the planner
//! sized, so it never takes cells a running sequence needs.
//!
//! Recovery: when a worker is lost (its health, a broken link, a failed or
//! stuck step), nothing is failed at once. The scheduler drops what was in
//! flight, asks the recovery task (`recover.rs`) to bring the pipeline
//! back, and queues new requests meanwhile. Every step that came back is
//! kept in its group's log with the KV cell of each token (the first stage
//! reports them); once the stages are reset or reloaded, each group's log
//! is replayed in order: the same tokens in the same steps, into the same
//! cells, sampled at the same places (so samplers' random streams and
//! penalty histories come out as before, and their draws are checked
//! against the tokens already sent). Then the sequences go on where they
//! were; the client sees a pause. Frames of steps sent before the recovery
//! are told apart by their id (the fence) and ignored, here and on every
//! stage.

pub mod prefix;
mod recovery;
mod step;

use crate::error::Error;
use crate::metrics::Metrics;
use crossbeam_channel::Receiver;
use omni_engine::sampling::{SamplingParams, StopMatcher};
use omni_engine::tokenizer::{StreamDecoder, Tokenizer};
use omni_proto::coordinator::v1::GenerateEvent;
use omni_proto::worker::v1::SeqStart;
use omni_transport::{InboxReader, Next, Outbox};
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc::UnboundedSender;
use tonic::Status;

/// A step that only carries removals belongs to no group.
const CONTROL_GROUP: u32 = u32::MAX;

/// A sequence caught in more recoveries than this is stopped with the
/// error (a step that fails every time it runs must not loop forever).
const MAX_RECOVERIES: u32 = 3;

/// What the scheduler asks of the recovery task.
#[derive(Debug)]
pub struct RecoveryNeeded {
    /// Steps with a smaller id belong to the broken pipeline.
    pub fence: u64,
    pub why: String,
}

pub type EventTx = UnboundedSender<Result<GenerateEvent, Status>>;

/// A validated request, ready to run.
pub struct NewSeq {
    pub id: u64,
    pub request_id: String,
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub params: SamplingParams,
    pub stop: Vec<String>,
    pub ignore_eos: bool,
    pub logprobs: bool,
    pub top_logprobs: u32,
    pub events: EventTx,
    pub arrived: Instant,
    /// The request's trace span; it ends when the sequence is dropped.
    pub span: tracing::Span,
    /// What the stages' spans hang under (None: traces are off).
    pub traceparent: Option<String>,
    /// Whether the prompt may use the prefix cache and leave blocks in it.
    pub cache_prompt: bool,
    /// Every step carrying it is batch-invariant (the request asked, or
    /// the cluster makes every step so).
    pub deterministic: bool,
}

impl NewSeq {
    /// Ends the request with an error: the client gets `status`, the trace
    /// records it.
    fn fail(&self, status: Status) {
        self.span.record("otel.status_code", "error");
        self.span.record("error", status.message());
        let _ = self.events.send(Err(status));
    }
}

pub enum Event {
    New(Box<NewSeq>),
    /// The client went away.
    Cancel(u64),
    /// A worker failed its health check or its link broke, or it came back
    /// after it died (`death`: how, "died of SIGILL (illegal instruction)").
    WorkerLost {
        worker: String,
        why: String,
        death: Option<String>,
    },
    /// Stop at a step boundary: send nothing more and answer once nothing
    /// is in flight (the pipeline is empty), or with why it cannot.
    Pause(crossbeam_channel::Sender<Result<(), String>>),
    /// Go on after a pause, sending to a new first stage if given.
    Resume(Option<Outbox>),
    /// The pipeline is back (every stage reset or reloaded and wired, with
    /// frames of steps before `fence` dropped): replay and go on.
    Recovered {
        outbox: Option<Outbox>,
        fence: u64,
    },
    /// Recovery cannot finish soon: stop the sequences with `why`, refuse
    /// new requests, and keep waiting for `Recovered`.
    RecoveryFailed(String),
}

pub struct SchedulerConfig {
    pub n_ctx: usize,
    pub n_seq: usize,
    pub n_ubatch: usize,
    /// Most prompt tokens in a step that carries decode tokens (0: no
    /// bound but `n_ubatch`).
    pub prefill_chunk: usize,
    /// Where prompts are cut into steps besides the budget (as they fall
    /// on this model: `PromptCuts::for_model`).
    pub prompt_cuts: omni_engine::PromptCuts,
    pub n_groups: usize,
    /// A step with no answer for this long means the pipeline is stuck.
    pub step_timeout: Duration,
    /// Most requests waiting for a slot; beyond it new ones are refused
    /// (UNAVAILABLE, which the router answers with 503 and Retry-After).
    pub max_queue: usize,
    /// The prefix cache, if on: the most KV cells it keeps that no running
    /// sequence uses.
    pub prefix_cache: Option<usize>,
}

struct Seq {
    new: NewSeq,
    slot: u32,
    group: usize,
    /// Prompt and generated tokens.
    tokens: Vec<u32>,
    /// How many of `tokens` have been sent to the pipeline.
    fed: usize,
    generated: usize,
    started: bool,
    decoder: StreamDecoder,
    stops: StopMatcher,
    first_token: Option<Instant>,
    /// Recoveries this sequence went through.
    recoveries: u32,
    /// Of those, how many began with a worker that died while a step of
    /// this sequence was in flight.
    crashes: u32,
    /// Prompt tokens it started from the prefix cache with (positions
    /// `0..prefix`, whose cells, `cells[..prefix]`, other sequences may
    /// see too).
    prefix: usize,
    /// The cell of each fed token whose step came back (prefix first).
    cells: Vec<i64>,
    /// Its blocks in the prefix cache.
    chain: prefix::Chain,
    /// Reported in `Done` (a recovery can set it back to 0).
    cached_tokens: usize,
}

/// One sequence's part of a step: tokens `from..from + n` of its log,
/// logits wanted for the last one or not, and (once the step came back)
/// the KV cell each token went into.
#[derive(Clone, Debug)]
struct Entry {
    seq: u64,
    from: usize,
    n: usize,
    logits: bool,
    cells: Vec<i64>,
}

struct InFlight {
    id: u64,
    sent: Instant,
    /// Who owned each slot, what the step carries, whether it is a replay.
    flight: Flight,
}

pub struct Scheduler {
    cfg: SchedulerConfig,
    tokenizer: Arc<Tokenizer>,
    outbox: Outbox,
    metrics: Arc<Metrics>,
    seqs: HashMap<u64, Seq>,
    /// Admission order, for fair step building.
    order: Vec<u64>,
    queue: VecDeque<NewSeq>,
    free_slots: Vec<u32>,
    pending_remove: Vec<u32>,
    groups: Vec<Option<InFlight>>,
    next_step: u64,
    /// Once set the cluster serves nothing more (recovery is a later issue).
    failed: Option<String>,
    /// Who waits for a pause to take hold, and whether it has.
    pausing: Option<crossbeam_channel::Sender<Result<(), String>>>,
    paused: bool,
    /// Control steps (removals only) sent and not yet back.
    control_in_flight: usize,
    /// Every group's steps that came back, oldest first (entries of live
    /// sequences only): what a recovery replays.
    logs: Vec<VecDeque<Vec<Entry>>>,
    /// Steps each group still has to replay after a recovery.
    replay: Vec<VecDeque<Vec<Entry>>>,
    /// Why the pipeline is being recovered (nothing is sent meanwhile).
    recovering: Option<String>,
    /// The sequences with a step in flight when the pipeline broke.
    in_flight_at_loss: Vec<u64>,
    /// How the worker lost in this recovery died, once it says so
    /// ("w1 (10.0.0.3:7071) died of SIGILL (illegal instruction)").
    death: Option<String>,
    /// Set when recovery gave up on the sequences: new requests are refused.
    gave_up: Option<String>,
    /// Results of steps before this id belong to a broken pipeline.
    fence: u64,
    recover: Option<tokio::sync::mpsc::UnboundedSender<RecoveryNeeded>>,
    /// None when the prefix cache is off.
    prefix: Option<prefix::PrefixCache>,
}

impl Scheduler {
    /// `recover` is where recovery requests go; without it a lost worker
    /// stops every request (the way a cluster without recovery behaves).
    pub fn new(
        cfg: SchedulerConfig,
        tokenizer: Arc<Tokenizer>,
        outbox: Outbox,
        metrics: Arc<Metrics>,
        recover: Option<tokio::sync::mpsc::UnboundedSender<RecoveryNeeded>>,
    ) -> Scheduler {
        let n_groups = cfg.n_groups.max(1);
        Scheduler {
            prefix: cfg.prefix_cache.map(prefix::PrefixCache::new),
            free_slots: (0..cfg.n_seq as u32).rev().collect(),
            groups: (0..n_groups).map(|_| None).collect(),
            logs: (0..n_groups).map(|_| VecDeque::new()).collect(),
            replay: (0..n_groups).map(|_| VecDeque::new()).collect(),
            recovering: None,
            in_flight_at_loss: Vec::new(),
            death: None,
            gave_up: None,
            fence: 0,
            recover,
            cfg,
            tokenizer,
            outbox,
            metrics,
            seqs: HashMap::new(),
            order: Vec::new(),
            queue: VecDeque::new(),
            pending_remove: Vec::new(),
            next_step: 1,
            failed: None,
            pausing: None,
            paused: false,
            control_in_flight: 0,
        }
    }

    /// Runs until the events channel closes.
    pub fn run(mut self, events: Receiver<Event>, frames: InboxReader) {
        let tick = Duration::from_millis(200);
        loop {
            // Frames first (they finish steps); events ring the inbox's
            // doorbell, so one wait covers both.
            match frames.next(tick, &mut || !events.is_empty()) {
                Next::Frame(f) => self.on_frame(f),
                Next::Woken | Next::TimedOut => {}
            }
            // Take whatever else is already waiting before building steps,
            // so a burst of requests shares the first step.
            loop {
                match events.try_recv() {
                    Ok(ev) => self.on_event(ev),
                    Err(crossbeam_channel::TryRecvError::Empty) => break,
                    Err(crossbeam_channel::TryRecvError::Disconnected) => return,
                }
            }
            self.check_timeouts();
            self.schedule();
            self.check_pause();
            self.metrics.queue_depth.set(self.queue.len() as i64);
            self.metrics.active_sequences.set(self.seqs.len() as i64);
        }
    }

    fn on_event(&mut self, ev: Event) {
        match ev {
            Event::New(s) => {
                if let Some(why) = self.failed.as_ref().or(self.gave_up.as_ref()) {
                    s.fail(Error::Stopped(format!("the cluster cannot serve: {why}")).into());
                    return;
                }
                if self.queue.len() >= self.cfg.max_queue {
                    let state = match &self.recovering {
                        Some(why) => format!("the cluster is recovering ({why}) and "),
                        None => String::new(),
                    };
                    s.fail(
                        Error::Busy(format!(
                            "{state}{} requests are already waiting, the most this coordinator queues; retry later",
                            self.queue.len()
                        ))
                        .into(),
                    );
                    return;
                }
                self.queue.push_back(*s);
            }
            Event::Cancel(id) => {
                if let Some(pos) = self.queue.iter().position(|s| s.id == id) {
                    self.queue.remove(pos);
                } else if self.seqs.contains_key(&id) {
                    tracing::info!(seq = id, "client went away; freeing the sequence");
                    self.drop_seq(id);
                }
            }
            Event::WorkerLost { worker, why, death } => {
                if let Some(d) = death {
                    self.death = Some(format!("{worker} {d}"));
                }
                self.begin_recovery(format!("worker {worker} is gone: {why}"));
            }
            Event::Recovered { outbox, fence } => self.recovered(outbox, fence),
            Event::RecoveryFailed(why) => {
                if self.gave_up.is_none() {
                    tracing::error!("{why}; stopping every request");
                }
                self.stop_every_request(&why);
                self.gave_up = Some(why);
            }
            Event::Pause(reply) => match self.failed.as_ref().or(self.recovering.as_ref()) {
                Some(why) => {
                    let _ = reply.send(Err(format!("the cluster cannot serve: {why}")));
                }
                None if self.paused || self.pausing.is_some() => {
                    let _ = reply.send(Err("the pipeline is already paused".into()));
                }
                None => self.pausing = Some(reply),
            },
            Event::Resume(outbox) => {
                if let Some(o) = outbox {
                    self.outbox = o;
                }
                self.paused = false;
                self.pausing = None;
            }
        }
    }

    fn drop_seq(&mut self, id: u64) {
        if let Some(s) = self.seqs.remove(&id) {
            self.order.retain(|&o| o != id);
            self.pending_remove.push(s.slot);
            if let Some(pc) = self.prefix.as_mut() {
                let fed = s.new.cache_prompt.then_some((&s.tokens[..], &s.cells[..]));
                pc.release(s.chain, fed);
                self.metrics.prefix.evicted("bound", pc.enforce_bound());
                self.metrics.prefix.cells.set(pc.retained_cells() as i64);
            }
            for log in self.logs.iter_mut().chain(self.replay.iter_mut()) {
                for step in log.iter_mut() {
                    step.retain(|e| e.seq != id);
                }
                log.retain(|step| !step.is_empty());
            }
        }
    }

    fn check_timeouts(&mut self) {
        if self.failed.is_some() || self.recovering.is_some() {
            return;
        }
        for (g, f) in self.groups.iter().enumerate() {
            if let Some(f) = f {
                if f.sent.elapsed() > self.cfg.step_timeout {
                    let why = format!(
                        "the pipeline has not answered step {} (group {g}) for {:.0}s",
                        f.id,
                        self.cfg.step_timeout.as_secs_f64()
                    );
                    self.begin_recovery(why);
                    return;
                }
            }
        }
    }
}

/// What a group's step in flight needs on its way back.
struct Flight {
    owners: HashMap<u32, u64>,
    entries: Vec<Entry>,
    replay: bool,
}

/// How the last stage samples `s` (the step that starts it carries it).
fn seq_start(s: &Seq) -> SeqStart {
    SeqStart {
        slot: s.slot,
        sampling: Some(omni_proto::sampling::sampling(&s.new.params)),
        top_logprobs: s.new.top_logprobs,
        logprobs: s.new.logprobs,
        prompt_len: s.new.prompt.len() as u32,
        prefix_cells: s.cells[..s.prefix].to_vec(),
        prefix_tokens: s.tokens[..s.prefix].to_vec(),
    }
}
