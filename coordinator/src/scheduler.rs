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

use crate::error::Error;
use crate::metrics::Metrics;
use crossbeam_channel::Receiver;
use omni_engine::sampling::{SamplingParams, StopMatcher};
use omni_engine::tokenizer::{StreamDecoder, Tokenizer};
use omni_proto::coordinator::v1::{Done, FinishReason, GenerateEvent, Token};
use omni_proto::worker::v1::{SeqStart, SlotRequest, Step, TopLogprob};
use omni_transport::{Frame, InboxReader, Next, Outbox};
use prost::Message;
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
    pub n_groups: usize,
    /// A step with no answer for this long means the pipeline is stuck.
    pub step_timeout: Duration,
    /// Most requests waiting for a slot; beyond it new ones are refused
    /// (UNAVAILABLE, which the router answers with 503 and Retry-After).
    pub max_queue: usize,
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

    /// Answers a pause once no step is in flight.
    fn check_pause(&mut self) {
        if self.pausing.is_some()
            && self.groups.iter().all(Option::is_none)
            && self.control_in_flight == 0
        {
            let reply = self.pausing.take().unwrap();
            self.paused = reply.send(Ok(())).is_ok();
        }
    }

    /// The pipeline broke: drop what is in flight, send nothing more, and
    /// ask for a recovery (without a recovery task: fail everything).
    fn begin_recovery(&mut self, why: String) {
        if self.failed.is_some() {
            return;
        }
        if let Some(now) = &self.recovering {
            tracing::warn!("{why} (while recovering from: {now})");
            return;
        }
        let Some(recover) = &self.recover else {
            self.fail_all(why);
            return;
        };
        tracing::error!(
            "{why}; recovering ({} wait, {} in flight)",
            omni_engine::count(self.seqs.len() as u64, "sequence"),
            omni_engine::count(
                self.groups.iter().filter(|g| g.is_some()).count() as u64,
                "step"
            )
        );
        if recover
            .send(RecoveryNeeded {
                fence: self.next_step,
                why: why.clone(),
            })
            .is_err()
        {
            self.fail_all(why);
            return;
        }
        self.in_flight_at_loss = self
            .groups
            .iter()
            .flatten()
            .flat_map(|f| f.flight.entries.iter().map(|e| e.seq))
            .collect();
        // A replay cut short is replayed again from where it got: its steps
        // in flight and still to send go back to the log, in order.
        for g in 0..self.groups.len() {
            let cut = self.groups[g].take().filter(|f| f.flight.replay);
            let rest = std::mem::take(&mut self.replay[g]);
            self.logs[g].extend(cut.map(|f| f.flight.entries).into_iter().chain(rest));
        }
        self.control_in_flight = 0;
        if let Some(p) = self.pausing.take() {
            let _ = p.send(Err(format!("the cluster is recovering: {why}")));
        }
        self.paused = false;
        self.metrics.recoveries.inc();
        self.recovering = Some(why);
    }

    /// The stages were reset (no sequence, every cell free) and wired
    /// again: every group replays its log, every sequence goes on from
    /// where its last step that came back left it.
    fn recovered(&mut self, outbox: Option<Outbox>, fence: u64) {
        if let Some(o) = outbox {
            self.outbox = o;
        }
        self.fence = fence;
        self.next_step = self.next_step.max(fence);
        let why = self.recovering.take().unwrap_or_default();
        let in_flight = std::mem::take(&mut self.in_flight_at_loss);
        let death = self.death.take();
        self.gave_up = None;
        let mut stopped = Vec::new();
        for (id, s) in self.seqs.iter_mut() {
            let done = self
                .logs
                .iter()
                .flatten()
                .flatten()
                .filter(|e| e.seq == *id)
                .map(|e| e.from + e.n)
                .max()
                .unwrap_or(0);
            s.fed = done;
            // The replay's first step carries the start again.
            s.started = done > 0;
            s.recoveries += 1;
            if death.is_some() && in_flight.contains(id) {
                s.crashes += 1;
            }
            if s.recoveries > MAX_RECOVERIES {
                stopped.push(*id);
            }
        }
        for id in stopped {
            if let Some(s) = self.seqs.get(&id) {
                // A request that was running every time a worker died is
                // likely what kills it: say so, and how the worker died.
                let msg = match &death {
                    Some(d) if s.crashes == s.recoveries => format!(
                        "the request was stopped because it crashed a worker {} times \
                         (the last time {d} running this request)",
                        s.crashes
                    ),
                    _ => format!(
                        "the request was stopped after {MAX_RECOVERIES} recoveries, the last because {why}"
                    ),
                };
                s.new.fail(Error::Stopped(msg).into());
            }
            self.drop_seq(id);
        }
        for (g, log) in self.logs.iter_mut().enumerate() {
            self.replay[g] = std::mem::take(log);
        }
        // Every stage forgot every sequence: all slots not held are free.
        self.pending_remove.clear();
        let held: Vec<u32> = self.seqs.values().map(|s| s.slot).collect();
        self.free_slots = (0..self.cfg.n_seq as u32)
            .rev()
            .filter(|s| !held.contains(s))
            .collect();
        let steps: usize = self.replay.iter().map(VecDeque::len).sum();
        tracing::info!(
            "recovered; replaying {} of {}",
            omni_engine::count(steps as u64, "step"),
            omni_engine::count(self.seqs.len() as u64, "sequence")
        );
    }

    /// Whether replayed steps are still to send or on their way (nothing
    /// else is sent meanwhile: a new token's cell could be one a replayed
    /// token must go back into).
    fn replaying(&self) -> bool {
        self.replay.iter().any(|r| !r.is_empty())
            || self.groups.iter().flatten().any(|f| f.flight.replay)
    }

    /// Stops everything in flight with `why` (the client gets the error).
    fn fail_all(&mut self, why: String) {
        if self.failed.is_none() {
            tracing::error!("{why}; failing every request");
        }
        self.stop_every_request(&why);
        if let Some(p) = self.pausing.take() {
            let _ = p.send(Err(why.clone()));
        }
        self.failed = Some(why);
    }

    /// Ends every running and queued request with `why` (their slots are
    /// free again once the stages are reset, or never used again).
    fn stop_every_request(&mut self, why: &str) {
        let status: Status = Error::Stopped(format!("{why}; the request was stopped")).into();
        for (_, s) in self.seqs.drain() {
            s.new.fail(status.clone());
        }
        for s in self.queue.drain(..) {
            s.fail(status.clone());
        }
        self.order.clear();
        self.logs.iter_mut().for_each(VecDeque::clear);
        self.replay.iter_mut().for_each(VecDeque::clear);
    }

    fn drop_seq(&mut self, id: u64) {
        if let Some(s) = self.seqs.remove(&id) {
            self.order.retain(|&o| o != id);
            self.pending_remove.push(s.slot);
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

    /// Admits queued sequences into free slots, then sends a step for every
    /// idle group that has work (or a control step if only removals wait).
    fn schedule(&mut self) {
        if self.failed.is_some()
            || self.recovering.is_some()
            || self.paused
            || self.pausing.is_some()
        {
            return;
        }
        let replaying = self.replaying();
        while !replaying && !self.queue.is_empty() && !self.free_slots.is_empty() {
            let new = self.queue.pop_front().unwrap();
            let slot = self.free_slots.pop().unwrap();
            let group = (0..self.groups.len())
                .min_by_key(|&g| self.seqs.values().filter(|s| s.group == g).count())
                .unwrap_or(0);
            let tokens = new.prompt.clone();
            let stops = StopMatcher::new(new.stop.clone());
            self.order.push(new.id);
            self.seqs.insert(
                new.id,
                Seq {
                    new,
                    slot,
                    group,
                    tokens,
                    fed: 0,
                    generated: 0,
                    started: false,
                    decoder: StreamDecoder::default(),
                    stops,
                    first_token: None,
                    recoveries: 0,
                    crashes: 0,
                },
            );
        }
        for g in 0..self.groups.len() {
            if self.groups[g].is_some() {
                continue;
            }
            let built = match self.replay[g].pop_front() {
                Some(entries) => self.build_replay(g, entries),
                None if replaying => None,
                None => self.build_step(g),
            };
            if let Some((step, flight)) = built {
                self.send(step, Some((g, flight)));
                if self.recovering.is_some() {
                    return;
                }
            }
        }
        if !self.pending_remove.is_empty() {
            let step = Step {
                group: CONTROL_GROUP,
                ..Default::default()
            };
            self.send(step, None);
        }
    }

    fn build_step(&mut self, g: usize) -> Option<(Step, Flight)> {
        let mut budget = self.cfg.n_ubatch;
        let mut step = Step {
            group: g as u32,
            ..Default::default()
        };
        let mut owners = HashMap::new();
        let mut entries = Vec::new();
        // Decode tokens first (one each), then prompt chunks: bounded by
        // `prefill_chunk` when the step decodes, so a long prompt does not
        // hold the generating streams up for all of its tokens at once.
        let ids: Vec<u64> = self.order.clone();
        let mut prompt_tokens = 0;
        for decode_pass in [true, false] {
            let decoded = self.cfg.n_ubatch - budget;
            if !decode_pass && decoded > 0 && self.cfg.prefill_chunk > 0 {
                budget = budget.min(self.cfg.prefill_chunk);
            }
            for id in &ids {
                let s = self.seqs.get_mut(id).unwrap();
                let remaining = s.tokens.len() - s.fed;
                let decoding = s.fed >= s.new.prompt.len();
                if s.group != g || remaining == 0 || decoding != decode_pass || budget == 0 {
                    continue;
                }
                let take = remaining.min(budget);
                entries.push(Entry {
                    seq: *id,
                    from: s.fed,
                    n: take,
                    logits: s.fed + take == s.tokens.len(),
                    cells: Vec::new(),
                });
                for p in s.fed..s.fed + take {
                    step.tokens.push(s.tokens[p]);
                    step.positions.push(p as i32);
                    step.seqs.push(s.slot);
                    step.logits.push(p + 1 == s.tokens.len());
                }
                if !s.started {
                    s.started = true;
                    step.starts.push(seq_start(s));
                    step.requests.push(SlotRequest {
                        slot: s.slot,
                        request_id: s.new.request_id.clone(),
                        traceparent: s.new.traceparent.clone().unwrap_or_default(),
                    });
                }
                s.fed += take;
                budget -= take;
                if !decode_pass {
                    prompt_tokens += take;
                }
                owners.insert(s.slot, *id);
            }
        }
        if step.tokens.is_empty() {
            None
        } else {
            if prompt_tokens > 0 && prompt_tokens < step.tokens.len() {
                self.metrics
                    .mixed_step_prompt_tokens
                    .observe(prompt_tokens as f64);
            }
            Some((
                step,
                Flight {
                    owners,
                    entries,
                    replay: false,
                },
            ))
        }
    }

    /// A logged step again, after a recovery: the same tokens of the same
    /// (still live) sequences, into the same cells, with the starts of
    /// sequences whose first tokens it carries.
    fn build_replay(&mut self, g: usize, entries: Vec<Entry>) -> Option<(Step, Flight)> {
        let mut step = Step {
            group: g as u32,
            ..Default::default()
        };
        let mut owners = HashMap::new();
        let mut placed = true;
        // Only live sequences' parts (the entries name the step's tokens).
        let entries: Vec<Entry> = entries
            .into_iter()
            .filter(|e| self.seqs.contains_key(&e.seq))
            .collect();
        for e in &entries {
            let s = &self.seqs[&e.seq];
            for p in e.from..e.from + e.n {
                step.tokens.push(s.tokens[p]);
                step.positions.push(p as i32);
                step.seqs.push(s.slot);
                step.logits.push(e.logits && p + 1 == e.from + e.n);
            }
            placed &= e.cells.len() == e.n;
            step.cells.extend_from_slice(&e.cells);
            if e.from == 0 {
                step.starts.push(seq_start(s));
                step.requests.push(SlotRequest {
                    slot: s.slot,
                    request_id: s.new.request_id.clone(),
                    traceparent: s.new.traceparent.clone().unwrap_or_default(),
                });
            }
            owners.insert(s.slot, e.seq);
        }
        if step.tokens.is_empty() {
            return None;
        }
        if !placed {
            step.cells.clear();
        }
        Some((
            step,
            Flight {
                owners,
                entries,
                replay: true,
            },
        ))
    }

    /// Sends a step; a group's step records the owner of each of its slots.
    fn send(&mut self, mut step: Step, group: Option<(usize, Flight)>) {
        step.id = self.next_step;
        self.next_step += 1;
        // Removals ride on whatever step goes first; the slots are free
        // for reuse once it is on its way.
        step.remove = std::mem::take(&mut self.pending_remove);
        let freed = step.remove.clone();
        let n_tokens = step.tokens.len() as u64;
        let frame = Frame {
            meta: step.encode_to_vec(),
            payload: Vec::new(),
        };
        if let Err(e) = self.outbox.send(frame) {
            self.begin_recovery(format!("cannot reach the first stage: {e}"));
            return;
        }
        self.free_slots.extend(freed);
        self.metrics.steps.inc();
        self.metrics.tokens_in.inc_by(n_tokens);
        match group {
            Some((g, f)) => {
                self.groups[g] = Some(InFlight {
                    id: step.id,
                    sent: Instant::now(),
                    flight: f,
                })
            }
            None => self.control_in_flight += 1,
        }
    }

    fn on_frame(&mut self, frame: Frame) {
        let step = match Step::decode(frame.meta.as_slice()) {
            Ok(s) => s,
            Err(e) => {
                self.begin_recovery(format!("the last stage sent an undecodable frame: {e}"));
                return;
            }
        };
        if step.id < self.fence || self.recovering.is_some() {
            tracing::debug!(step = step.id, "ignored a result of the broken pipeline");
            return;
        }
        if step.group == CONTROL_GROUP {
            self.control_in_flight = self.control_in_flight.saturating_sub(1);
            return;
        }
        let g = step.group as usize;
        let Some(inflight) = self.groups.get_mut(g).and_then(|f| f.take()) else {
            tracing::warn!(
                "result for step {} of group {g}, which has none in flight",
                step.id
            );
            return;
        };
        if inflight.id != step.id {
            self.begin_recovery(format!(
                "the pipeline returned step {} but step {} was expected",
                step.id, inflight.id
            ));
            return;
        }
        let mut compute_us = 0.0;
        let mut expert_wait_ms = None;
        for t in &step.times {
            self.metrics.record_stage(t.stage, t.compute_ms as f64);
            compute_us += t.compute_ms as f64 * 1e3;
            if t.expert_wait_ms > 0.0 {
                self.metrics
                    .record_expert_wait(t.stage, t.expert_wait_ms as f64);
                *expert_wait_ms.get_or_insert(0.0) += t.expert_wait_ms as f64;
            }
        }
        if let Some(ms) = expert_wait_ms {
            self.metrics.record_step_expert_wait(ms);
        }
        if !step.times.is_empty() {
            let rtt_us = inflight.sent.elapsed().as_secs_f64() * 1e6;
            let hops = (step.times.len() + 1) as f64;
            self.metrics
                .record_hop((rtt_us - compute_us).max(0.0) / hops);
        }
        self.metrics
            .step_latency_us
            .set(inflight.sent.elapsed().as_micros() as i64);
        if !step.error.is_empty() {
            // Its sequences' cache is now unknown somewhere along the
            // pipeline (and a dead expert worker shows up here first).
            self.begin_recovery(format!("step {} failed: {}", step.id, step.error));
            return;
        }
        let f = &inflight.flight;
        self.log_step(g, &f.entries, &step.cells);
        if f.replay {
            self.check_replayed(&f.entries, &f.owners, &step.sampled);
            return;
        }
        for sampled in &step.sampled {
            let Some(&id) = f.owners.get(&sampled.slot) else {
                continue;
            };
            self.on_token(id, sampled);
        }
    }

    /// Keeps a step that came back in its group's log, with the cells its
    /// tokens went into (in token order, as the first stage reported them).
    fn log_step(&mut self, g: usize, entries: &[Entry], cells: &[i64]) {
        let mut at = 0;
        let mut logged = Vec::new();
        for e in entries {
            let mine = cells.get(at..at + e.n).unwrap_or_default();
            at += e.n;
            if self.seqs.contains_key(&e.seq) {
                logged.push(Entry {
                    cells: mine.to_vec(),
                    ..e.clone()
                });
            }
        }
        if !logged.is_empty() {
            self.logs[g].push_back(logged);
        }
    }

    /// A replayed step's samples repeat tokens the clients already have;
    /// they are dropped, and checked: with the same cache and the same
    /// sampler state they are the same tokens.
    fn check_replayed(
        &mut self,
        entries: &[Entry],
        owners: &HashMap<u32, u64>,
        sampled: &[omni_proto::worker::v1::Sampled],
    ) {
        for x in sampled {
            let Some(&id) = owners.get(&x.slot) else {
                continue;
            };
            let Some(s) = self.seqs.get(&id) else {
                continue;
            };
            let Some(e) = entries.iter().find(|e| e.seq == id && e.logits) else {
                continue;
            };
            let at = e.from + e.n;
            match s.tokens.get(at) {
                Some(&t) if t == x.token => {}
                Some(&t) => {
                    self.metrics.replay_mismatches.inc();
                    tracing::warn!(
                        seq = id,
                        "the replay sampled token {} at position {at} where {t} was sent; the stream goes on with {t}",
                        x.token
                    );
                }
                None => tracing::warn!(seq = id, "a replayed step sampled past the sequence's log"),
            }
        }
    }

    fn on_token(&mut self, id: u64, sampled: &omni_proto::worker::v1::Sampled) {
        let Some(s) = self.seqs.get_mut(&id) else {
            return; // cancelled while its step was in flight
        };
        let tok = sampled.token;
        s.tokens.push(tok);
        s.generated += 1;
        self.metrics.tokens_out.inc();
        let first = s.first_token.is_none();
        if first {
            s.first_token = Some(Instant::now());
            self.metrics
                .record_ttft(s.new.arrived.elapsed().as_secs_f64() * 1e3);
        }
        let mut ev = GenerateEvent {
            prompt_ids: if first {
                s.new.prompt.clone()
            } else {
                Vec::new()
            },
            tokens: vec![Token {
                id: tok,
                logprob: sampled.logprob,
                top: sampled
                    .top
                    .iter()
                    .map(|t| TopLogprob {
                        piece: self.tokenizer.text_of(t.token),
                        ..t.clone()
                    })
                    .collect(),
                piece: self.tokenizer.text_of(tok),
            }],
            ..Default::default()
        };
        let mut finish = None;
        if self.tokenizer.is_eog(tok) && !s.new.ignore_eos {
            finish = Some(FinishReason::Stop);
        } else {
            let text = s.decoder.push(&self.tokenizer.piece(tok));
            let out = s.stops.push(&text);
            ev.text = out.text;
            if out.stopped {
                finish = Some(FinishReason::Stop);
            }
        }
        if finish.is_none() && (s.generated >= s.new.max_tokens || s.tokens.len() >= self.cfg.n_ctx)
        {
            finish = Some(FinishReason::Length);
        }
        if let Some(reason) = finish {
            if reason == FinishReason::Length {
                let rest = s.stops.push(&s.decoder.finish());
                ev.text.push_str(&rest.text);
                ev.text.push_str(&s.stops.finish());
            }
            let now = Instant::now();
            let ttft_ms = s
                .first_token
                .map_or(0.0, |t| (t - s.new.arrived).as_secs_f64() * 1e3);
            s.new.span.record("completion_tokens", s.generated);
            s.new.span.record("finish_reason", reason.as_str_name());
            s.new.span.record("ttft_ms", ttft_ms);
            ev.done = Some(Done {
                finish_reason: reason as i32,
                prompt_tokens: s.new.prompt.len() as u32,
                completion_tokens: s.generated as u32,
                time_to_first_token_ms: ttft_ms,
                total_ms: (now - s.new.arrived).as_secs_f64() * 1e3,
            });
        }
        let gone = s.new.events.send(Ok(ev)).is_err();
        if finish.is_some() || gone {
            self.drop_seq(id);
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
    }
}
