//! The stage loop: one thread owns the loaded layer range and runs every
//! frame that reaches the inbox, in arrival order, then hands the result to
//! the next stage (hidden state) or back to the coordinator (sampled tokens).

mod handover;

use crate::experts::RemoteExperts;
use omni_engine::constraint::Constraint;
use omni_engine::kv::KvLayers;
use omni_engine::model::ModelFile;
use omni_engine::sampling::{logprob_of, top_logprobs, Sampler, SamplerState, SamplingParams};
use omni_engine::speculative::draft::{DraftModel, Want};
use omni_engine::stage::{Batch, Hidden, HiddenDtype, Stage, StageOutput};
use omni_proto::worker::v1::{ExpertUse, Proposal, Sampled, StageTime, Step, TopLogprob};
use omni_transport::{BellSender, Frame, InboxReader, Next, Outbox};
use prost::Message;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Counters the worker reports (Status and metrics).
#[derive(Debug, Default)]
pub struct ExecStats {
    pub steps: AtomicU64,
    pub tokens: AtomicU64,
    /// Compute time of the last step, in microseconds.
    pub last_step_us: AtomicU64,
    pub total_step_us: AtomicU64,
    /// Where the stage thread's time goes (Status, metrics).
    pub timeline: Timeline,
    pub kv_cells_used: AtomicU64,
    /// Cells the prefix cache keeps, and the bytes they hold here.
    pub kv_cells_cached: AtomicU64,
    pub kv_cached_bytes: AtomicU64,
    pub errors: AtomicU64,
    /// Time steps spent waiting for expert workers, in microseconds.
    pub expert_wait_us: AtomicU64,
    /// Expert calls' round trips and the workers' compute, every link's
    /// since the worker started (links are made anew at each wiring).
    pub expert_calls: Arc<omni_transport::experts::CallTiming>,
    /// Steps run as two micro-batch groups beside the expert workers
    /// (`--expert-overlap`).
    pub overlapped_steps: AtomicU64,
    /// Steps that computed their routed experts on this GPU, streaming
    /// them from host memory (`--stream-experts`).
    pub streamed_expert_steps: AtomicU64,
    /// Offloaded layers' routing statistics and device experts, as of the
    /// last refresh (every `ExpertPolicy::every` steps).
    pub experts: Mutex<Vec<ExpertUse>>,
    /// Bytes of the experts kept on this device (`--gpu-experts`).
    pub device_expert_bytes: AtomicU64,
    /// Times the set of device experts changed.
    pub expert_moves: AtomicU64,
    /// Bytes the stage (and, during a move, the old one) holds.
    pub held_bytes: AtomicU64,
    /// Time the draft model took guessing, in microseconds.
    pub draft_us: AtomicU64,
}

/// What the stage thread is doing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Waiting for the next frame (idle: the stages before it, or the
    /// coordinator, are the slower part).
    Waiting = 0,
    /// Running a frame: the step's compute (and on the last stage sampling).
    Computing = 1,
    /// Sending the result on (a full ring or a slow gRPC stream shows here).
    Sending = 2,
    /// Control work for moves (not counted).
    Control = 3,
}

/// The stage thread's time per [`Phase`], readable at any moment: the phase
/// it is in counts up to the reading, so two readings a short while apart
/// add up to the wall time between them (counting a phase only when it
/// ends would put an idle stretch that began before the first reading
/// after it).
#[derive(Debug, Default)]
pub struct Timeline {
    us: [AtomicU64; 4],
    /// The current phase in the top 8 bits, the microsecond (of [`now_us`])
    /// it began in the rest; 0 before the thread starts.
    current: AtomicU64,
}

/// Microseconds since the first call in this process.
fn now_us() -> u64 {
    static EPOCH: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    // +1 so that a phase entered at once is never the "not started" 0.
    EPOCH.get_or_init(Instant::now).elapsed().as_micros() as u64 + 1
}

impl Timeline {
    /// The thread enters `phase` now; the one it leaves is counted.
    pub fn enter(&self, phase: Phase) {
        let now = now_us();
        let was = self
            .current
            .swap(((phase as u64) << 56) | now, Ordering::Relaxed);
        if was != 0 {
            let (p, since) = ((was >> 56) as usize, was & ((1 << 56) - 1));
            self.us[p].fetch_add(now.saturating_sub(since), Ordering::Relaxed);
        }
    }

    /// Seconds spent in `phase` so far, the current stretch included.
    pub fn seconds(&self, phase: Phase) -> f64 {
        let cur = self.current.load(Ordering::Relaxed);
        let mut us = self.us[phase as usize].load(Ordering::Relaxed);
        if cur != 0 && (cur >> 56) as usize == phase as usize {
            us += now_us().saturating_sub(cur & ((1 << 56) - 1));
        }
        us as f64 / 1e6
    }
}

/// How the stage picks the experts it keeps of its offloaded layers.
#[derive(Clone, Copy, Debug)]
pub struct DeviceExperts {
    /// Keep this many of each offloaded layer's most used experts (0: none).
    pub k: usize,
    /// Re-read the routing statistics every this many steps.
    pub every: u64,
}

/// The sampling state of one sequence on the last stage.
struct SeqSampler {
    sampler: Sampler,
    /// Every token of the sequence so far (the penalties look at it).
    history: Vec<u32>,
    logprobs: bool,
    top_logprobs: usize,
    /// Tokens of the prompt; the grammar sees the ones after.
    prompt_len: usize,
    /// The sequence's place in its grammar, if it has one: it has taken
    /// every generated token that came back in as input, so it is a
    /// function of the history and comes back exactly in a move (fed the
    /// history again) or a crash replay (fed the replayed steps).
    constraint: Option<Constrained>,
}

enum Constrained {
    Live(Box<Constraint>),
    /// The grammar could not be compiled or refused a token: the sequence
    /// ends at its next sample (with the end token) rather than going on
    /// unconstrained.
    Broken {
        end: u32,
    },
}

impl SeqSampler {
    /// A sequence's sampling from its settings (`sampler`: a fresh one, or
    /// one restored where a move took it) and the history so far, which a
    /// grammar is fed again.
    fn new(
        sampler: Sampler,
        start: SamplerStart,
        history: Vec<u32>,
        grammars: &mut Grammars,
        model: &ModelFile,
    ) -> SeqSampler {
        let constraint = sampler
            .params()
            .grammar
            .as_ref()
            .map(|g| grammars.compile(g, model));
        let mut s = SeqSampler {
            sampler,
            history: Vec::with_capacity(history.len()),
            logprobs: start.logprobs,
            top_logprobs: start.top_logprobs,
            prompt_len: start.prompt_len,
            constraint,
        };
        for (pos, t) in history.into_iter().enumerate() {
            s.push(t, pos);
        }
        s
    }

    /// Records a token that entered the sequence at `pos`.
    fn push(&mut self, token: u32, pos: usize) {
        self.history.push(token);
        if pos < self.prompt_len {
            return;
        }
        if let Some(Constrained::Live(c)) = &mut self.constraint {
            if let Err(e) = c.accept(token) {
                let end = c.end_token();
                tracing::error!("a constrained sequence took token {token} at {pos}: {e}");
                self.constraint = Some(Constrained::Broken { end });
            }
        }
    }

    /// The next token from one row of logits, masked by the grammar first.
    fn sample(&mut self, logits: &[f32], scratch: &mut Vec<f32>) -> u32 {
        match &mut self.constraint {
            None => self.sampler.sample(logits, &self.history),
            Some(Constrained::Broken { end, .. }) => *end,
            Some(Constrained::Live(c)) => {
                scratch.clear();
                scratch.extend_from_slice(logits);
                if let Err(e) = c.mask(scratch) {
                    let end = c.end_token();
                    tracing::error!("cannot mask a constrained sequence: {e}");
                    self.constraint = Some(Constrained::Broken { end });
                    return end;
                }
                self.sampler.sample(scratch, &self.history)
            }
        }
    }
}

/// The grammar engine's view of the vocabulary, built when the first
/// constrained sequence reaches this stage (the tokenizer is read from the
/// stage's model file; it walks the whole vocabulary once).
#[derive(Default)]
struct Grammars {
    built: Option<Result<omni_engine::constraint::Grammars, String>>,
}

impl Grammars {
    fn compile(&mut self, g: &omni_engine::sampling::Grammar, model: &ModelFile) -> Constrained {
        let compiled = match self.load(&model.path) {
            Ok(gs) => gs.compile(g).map_err(|e| (e.to_string(), gs.end_token())),
            // (The coordinator compiled the same grammar over the same
            // vocabulary; this is a file that cannot be read again.) The
            // GGUF's EOS ends the sequence.
            Err(e) => Err((
                e.clone(),
                model
                    .gguf
                    .get_u32("tokenizer.ggml.eos_token_id")
                    .unwrap_or(0),
            )),
        };
        match compiled {
            Ok(c) => Constrained::Live(Box::new(c)),
            Err((why, end)) => {
                tracing::error!("cannot constrain a sequence: {why}");
                Constrained::Broken { end }
            }
        }
    }

    /// The vocabulary's view, built at the first call.
    fn load(
        &mut self,
        model: &std::path::Path,
    ) -> &Result<omni_engine::constraint::Grammars, String> {
        self.built.get_or_insert_with(|| {
            let t = Instant::now();
            let built = omni_engine::tokenizer::Tokenizer::load(model)
                .map_err(|e| e.to_string())
                .and_then(|tok| {
                    omni_engine::constraint::Grammars::new(&tok).map_err(|e| e.to_string())
                });
            match &built {
                Ok(_) => tracing::info!(
                    "grammar engine ready for {} in {:.0} ms",
                    model.display(),
                    t.elapsed().as_secs_f64() * 1e3
                ),
                Err(e) => tracing::error!("no grammar engine for {}: {e}", model.display()),
            }
            built
        })
    }
}

/// What a sequence's start says about its sampling besides the settings.
struct SamplerStart {
    logprobs: bool,
    top_logprobs: usize,
    prompt_len: usize,
}

/// Work for the stage thread between frames (live migration).
type Control = Box<dyn FnOnce(&mut StageRun) + Send>;

pub struct Exec {
    stop: Arc<AtomicBool>,
    control: BellSender<Control>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// The sequences' state a stage hands on when its layers move: which
/// request each slot serves and, from the stage with the head, how each
/// sequence samples (settings, random stream, history).
#[derive(Debug, Default, Serialize, Deserialize)]
pub struct SeqState {
    pub slots: Vec<SlotState>,
    pub samplers: Vec<SamplerEntry>,
}

#[derive(Debug, Serialize, Deserialize)]
pub struct SlotState {
    pub slot: u32,
    pub request_id: String,
    pub traceparent: String,
}

#[derive(Debug, Serialize, Deserialize)]
pub struct SamplerEntry {
    pub slot: u32,
    pub state: SamplerState,
    pub history: Vec<u32>,
    pub logprobs: bool,
    pub top_logprobs: usize,
    /// Tokens of the prompt (a grammar takes the history after them).
    #[serde(default)]
    pub prompt_len: usize,
}

/// The stage a switch replaced, kept until the move commits or rolls back,
/// and the sequences' state the switch added.
struct Previous {
    stage: Option<Stage>,
    index: u32,
    added_slots: Vec<u32>,
    added_samplers: Vec<u32>,
}

/// Where a stage's frames come from and go, and its expert workers (set
/// by `Wire`, after the stage is loaded).
pub struct Links {
    pub inbox: InboxReader,
    pub outbox: Arc<Mutex<Option<Outbox>>>,
    pub experts: Arc<Mutex<Option<RemoteExperts>>>,
}

impl Exec {
    pub fn start(
        stage: Stage,
        stage_index: u32,
        hidden_dtype: HiddenDtype,
        links: Links,
        device_experts: DeviceExperts,
        drafter: Option<DraftModel>,
        stats: Arc<ExecStats>,
    ) -> Exec {
        let Links {
            inbox,
            outbox,
            experts,
        } = links;
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let (control, control_rx) = inbox.bell().channel::<Control>();
        stats
            .held_bytes
            .store(stage.held_bytes(), Ordering::Relaxed);
        let thread = std::thread::Builder::new()
            .name(format!("stage-{stage_index}"))
            .spawn(move || {
                let mut run = StageRun {
                    slots: HashMap::new(),
                    stage: Some(stage),
                    previous: None,
                    index: stage_index,
                    dtype: hidden_dtype,
                    samplers: HashMap::new(),
                    grammars: Grammars::default(),
                    scratch: Vec::new(),
                    experts,
                    device_experts,
                    drafter,
                    stats,
                    fence: 0,
                };
                let timeline = run.stats.clone();
                let enter = |p| timeline.timeline.enter(p);
                enter(Phase::Waiting);
                // When the stage last finished a frame: a step's spans say
                // how long it sat idle before that step's input came.
                let mut idle_since = Instant::now();
                while !s.load(Ordering::Relaxed) {
                    // The stage thread waits on the inbox's ring itself;
                    // control calls ring the same doorbell.
                    let frame = match inbox.next(Duration::from_millis(100), &mut || {
                        !control_rx.is_empty()
                    }) {
                        Next::Frame(f) => f,
                        Next::Woken => {
                            while let Ok(c) = control_rx.try_recv() {
                                enter(Phase::Control);
                                c(&mut run);
                                enter(Phase::Waiting);
                            }
                            continue;
                        }
                        Next::TimedOut => continue,
                    };
                    enter(Phase::Computing);
                    let idle = idle_since.elapsed();
                    let out = run.frame(frame, idle);
                    let Some((out, spans)) = out else {
                        enter(Phase::Waiting);
                        idle_since = Instant::now();
                        continue;
                    };
                    enter(Phase::Sending);
                    let sending = Instant::now();
                    let index = run.index;
                    let mut guard = outbox.lock().unwrap();
                    match guard.as_mut() {
                        Some(o) => {
                            if let Err(e) = o.send(out) {
                                tracing::error!("stage {index}: cannot send downstream: {e}");
                            }
                        }
                        None => tracing::error!(
                            "stage {index}: a frame arrived before Wire said where output goes; dropped"
                        ),
                    }
                    drop(guard);
                    enter(Phase::Waiting);
                    idle_since = Instant::now();
                    let send_ms = (idle_since - sending).as_secs_f64() * 1e3;
                    for span in &spans {
                        span.record("send_ms", send_ms);
                    }
                }
            })
            .expect("spawning the stage thread");
        Exec {
            stop,
            control,
            thread: Some(thread),
        }
    }

    /// Runs `f` on the stage thread between two frames and returns its
    /// result (blocking: call it from a blocking context).
    fn call<R: Send + 'static>(
        &self,
        f: impl FnOnce(&mut StageRun) -> R + Send + 'static,
    ) -> Result<R, String> {
        let (tx, rx) = crossbeam_channel::bounded(1);
        self.control
            .send(Box::new(move |run: &mut StageRun| {
                let _ = tx.send(f(run));
            }))
            .map_err(|_| "the stage thread has stopped".to_string())?;
        rx.recv()
            .map_err(|_| "the stage thread stopped before answering".to_string())
    }

    /// The KV cache of `layers` (empty: none) and the sequences' state, from
    /// the stage that ran before a pending switch if there is one (no step
    /// has run since, so it is current).
    pub fn export(&self, layers: Range<u32>) -> Result<(Option<KvLayers>, SeqState), String> {
        self.call(move |run| run.export(layers))?
    }

    /// Switches to `new` (None: no stage, the worker is drained) at this
    /// step boundary, keeping the current stage for [`Exec::finish`].
    /// `drafter`: a draft model loaded for a stage that takes the head.
    pub fn switch(
        &self,
        new: Option<Stage>,
        index: u32,
        incoming: Vec<KvLayers>,
        seqs: Vec<SeqState>,
        drafter: Option<DraftModel>,
    ) -> Result<(), String> {
        self.call(move |run| {
            if drafter.is_some() {
                run.drafter = drafter;
            }
            run.switch(new, index, incoming, seqs)
        })?
    }

    /// Commits a switch (drops the old stage) or rolls it back (the old
    /// stage runs again); nothing pending: nothing to do. Returns the
    /// range now run, if any.
    pub fn finish(&self, commit: bool) -> Result<Option<omni_engine::stage::LayerRange>, String> {
        self.call(move |run| run.finish(commit))
    }

    /// Forgets every sequence and drops frames of steps before `fence`
    /// (recovery); a pending switch is rolled back first. Returns the
    /// range now run, if any.
    pub fn reset(&self, fence: u64) -> Result<Option<omni_engine::stage::LayerRange>, String> {
        self.call(move |run| run.reset(fence))
    }
}

impl Drop for Exec {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Which request a slot serves (from the step that started it), so every
/// step's spans name the requests it carries, across processes.
struct SlotInfo {
    request_id: String,
    traceparent: String,
    /// The request's trace context (None: traces are off).
    trace: Option<omni_telemetry::Remote>,
}

struct StageRun {
    slots: HashMap<u32, SlotInfo>,
    /// None once the worker is drained.
    stage: Option<Stage>,
    previous: Option<Previous>,
    index: u32,
    dtype: HiddenDtype,
    samplers: HashMap<u32, SeqSampler>,
    grammars: Grammars,
    /// One row of masked logits (constrained sequences).
    scratch: Vec<f32>,
    experts: Arc<Mutex<Option<RemoteExperts>>>,
    device_experts: DeviceExperts,
    /// The draft model, on the worker that runs the head (`--model-draft`).
    drafter: Option<DraftModel>,
    stats: Arc<ExecStats>,
    /// Frames of steps with a smaller id are dropped unrun: they belong to
    /// a pipeline that broke before the last recovery.
    fence: u64,
}

impl StageRun {
    /// Runs one frame and returns the frame to send on. Errors travel in the
    /// step header so the coordinator learns of them; nothing is dropped.
    /// Runs one frame; `idle` is how long the stage waited for it. Returns
    /// the frame to send on and the traced requests' spans, which stay open
    /// until it is sent.
    fn frame(&mut self, frame: Frame, idle: Duration) -> Option<(Frame, Vec<tracing::Span>)> {
        let mut step = match Step::decode(frame.meta.as_slice()) {
            Ok(s) if s.id < self.fence => {
                tracing::debug!(
                    step = s.id,
                    "dropped a step of the pipeline before the reset"
                );
                return None;
            }
            Ok(s) => s,
            Err(e) => Step {
                error: format!("stage {}: undecodable step header: {e}", self.index),
                ..Default::default()
            },
        };
        let mut spans = Vec::new();
        let payload = if step.error.is_empty() {
            match self.step(&mut step, &frame.payload, idle, &mut spans) {
                Ok(p) => p,
                Err(e) => {
                    self.stats.errors.fetch_add(1, Ordering::Relaxed);
                    step.error = format!("stage {}: {e}", self.index);
                    Vec::new()
                }
            }
        } else {
            Vec::new()
        };
        self.publish_kv();
        Some((
            Frame {
                meta: step.encode_to_vec(),
                payload,
            },
            spans,
        ))
    }

    /// Publishes the KV cache's cell counts (Status, metrics).
    fn publish_kv(&self) {
        let kv = self.stage.as_ref().map(|s| s.kv());
        let (used, cached, cached_bytes) = kv.map_or((0, 0, 0), |kv| {
            let cached = kv.cached() as u64;
            (kv.used() as u64, cached, cached * kv.cell_bytes())
        });
        self.stats.kv_cells_used.store(used, Ordering::Relaxed);
        self.stats.kv_cells_cached.store(cached, Ordering::Relaxed);
        self.stats
            .kv_cached_bytes
            .store(cached_bytes, Ordering::Relaxed);
    }

    /// Runs a step; the traced requests' spans go into `spans`.
    fn step(
        &mut self,
        step: &mut Step,
        payload: &[u8],
        idle: Duration,
        spans: &mut Vec<tracing::Span>,
    ) -> Result<Vec<u8>, String> {
        for r in &step.requests {
            self.slots.insert(
                r.slot,
                SlotInfo {
                    request_id: r.request_id.clone(),
                    traceparent: r.traceparent.clone(),
                    trace: omni_telemetry::Remote::parse(&r.traceparent),
                },
            );
        }
        let mut carried: Vec<&str> = step
            .seqs
            .iter()
            .filter_map(|s| self.slots.get(s).map(|i| i.request_id.as_str()))
            .collect();
        carried.dedup();
        let span = tracing::debug_span!(
            "step",
            id = step.id,
            stage = self.index,
            tokens = step.positions.len(),
            requests = %carried.join(",")
        );
        let _enter = span.enter();
        *spans = self.request_spans(step, idle);
        let index = self.index;
        let stage = self.stage.as_mut().ok_or_else(|| {
            format!("a step reached stage {index}, which holds no layers (its worker was drained)")
        })?;
        // The prefix cache's part, in the order the coordinator counts on:
        // keep, free the removed slots, give up, then let new sequences
        // see their cached prefixes (control steps carry these too).
        stage.retain_kv(&step.retain).map_err(|e| e.to_string())?;
        for &slot in &step.remove {
            self.slots.remove(&slot);
            stage.remove_seq(slot, None);
            self.samplers.remove(&slot);
            if let Some(d) = self.drafter.as_mut() {
                d.forget(slot);
            }
            tracing::debug!(slot, step = step.id, "freed the KV cache of a sequence");
        }
        stage.evict_kv(&step.evict).map_err(|e| e.to_string())?;
        // Draft tokens the last stage did not take in an earlier step.
        for t in &step.truncate {
            stage.remove_seq(t.slot, Some(t.from));
        }
        for s in &step.starts {
            stage
                .share_kv(s.slot, &s.prefix_cells)
                .map_err(|e| format!("slot {}: {e}", s.slot))?;
        }
        let head = stage.range().head;
        if head {
            for s in &step.starts {
                let params = omni_proto::sampling::params(s.sampling.as_ref())
                    .map_err(|e| format!("bad sampling settings for slot {}: {e}", s.slot))?;
                let start = SamplerStart {
                    logprobs: s.logprobs,
                    top_logprobs: s.top_logprobs as usize,
                    prompt_len: s.prompt_len as usize,
                };
                let mut sampler = Sampler::new(params);
                sampler.skip_draws(s.draws);
                let model = stage.model();
                let history = s.prefix_tokens.clone();
                let seq = SeqSampler::new(sampler, start, history, &mut self.grammars, model);
                self.samplers.insert(s.slot, seq);
            }
        }
        let n = step.positions.len();
        if n == 0 {
            return Ok(Vec::new());
        }
        let draft = if head { draft_rows(step)? } else { Vec::new() };
        let batch = Batch {
            tokens: step.tokens.clone(),
            pos: step.positions.clone(),
            seq: step.seqs.clone(),
            logits: step.logits.clone(),
            cells: step.cells.clone(),
            invariant: step.invariant,
        };
        let input = if stage.range().embed {
            None
        } else {
            Some(Hidden::from_bytes(payload).map_err(|e| e.to_string())?)
        };
        let t = Instant::now();
        let mut waited = Duration::ZERO;
        let out = if stage.offloaded_layers().is_empty() {
            stage.forward(&batch, input.as_ref())
        } else {
            let mut guard = self.experts.lock().unwrap();
            let experts = guard.as_mut().ok_or_else(|| {
                format!(
                    "the experts of layers {:?} run on an expert worker, but none was wired",
                    stage.offloaded_layers()
                )
            })?;
            let before = (stage.overlapped_steps(), stage.local_expert_steps());
            let r = stage.forward_with(&batch, input.as_ref(), experts);
            waited = experts.take_waited();
            self.stats
                .overlapped_steps
                .fetch_add(stage.overlapped_steps() - before.0, Ordering::Relaxed);
            self.stats
                .streamed_expert_steps
                .fetch_add(stage.local_expert_steps() - before.1, Ordering::Relaxed);
            r
        }
        .map_err(|e| e.to_string())?;
        // The first stage to run the step says where its tokens' cells
        // are; every later stage puts them in the same ones.
        if step.cells.is_empty() {
            step.cells = stage.last_cells().to_vec();
        }
        // Sampling is part of the last stage's compute time.
        let payload = match out {
            StageOutput::Hidden(h) => h.to_bytes(self.dtype),
            StageOutput::Logits(l) => {
                self.sample(step, &batch, &l, &draft);
                self.propose(step)?;
                Vec::new()
            }
        };
        let us = t.elapsed().as_micros() as u64;
        step.times.push(StageTime {
            stage: self.index,
            compute_ms: us as f32 / 1e3,
            expert_wait_ms: waited.as_secs_f32() * 1e3,
        });
        self.stats
            .expert_wait_us
            .fetch_add(waited.as_micros() as u64, Ordering::Relaxed);
        self.stats.steps.fetch_add(1, Ordering::Relaxed);
        self.refresh_experts();
        self.stats.tokens.fetch_add(n as u64, Ordering::Relaxed);
        self.stats.last_step_us.store(us, Ordering::Relaxed);
        self.stats.total_step_us.fetch_add(us, Ordering::Relaxed);
        Ok(payload)
    }

    /// One span per traced request in the step, each a child of that
    /// request's trace; they end when the step's output is sent. Besides
    /// the compute they cover, they say how long the stage sat idle before
    /// the step's input came (`idle_before_ms`: a bubble when the pipeline
    /// is busy) and how long the send took (`send_ms`, recorded after it).
    fn request_spans(&self, step: &Step, idle: Duration) -> Vec<tracing::Span> {
        let mut tokens: Vec<(u32, usize)> = Vec::new();
        for &slot in &step.seqs {
            match tokens.iter_mut().find(|(s, _)| *s == slot) {
                Some((_, n)) => *n += 1,
                None => tokens.push((slot, 1)),
            }
        }
        tokens
            .into_iter()
            .filter_map(|(slot, n)| {
                let info = self.slots.get(&slot)?;
                let trace = info.trace.as_ref()?;
                let span = tracing::info_span!(
                    "stage_step",
                    otel.name = %format!("stage {} step", self.index),
                    stage = self.index,
                    step = step.id,
                    request = %info.request_id,
                    tokens = n,
                    batch_tokens = step.positions.len(),
                    idle_before_ms = idle.as_secs_f64() * 1e3,
                    send_ms = tracing::field::Empty,
                );
                trace.adopt(&span);
                Some(span)
            })
            .collect()
    }

    /// Samples every row whose logits were wanted, after recording the
    /// step's tokens in each sequence's history. A draft's rows
    /// (`Step.drafts`) are verified in order: each draft token enters the
    /// history once the row before it sampled that very token, and the
    /// slot's rows after the first disagreement are not sampled.
    fn sample(
        &mut self,
        step: &mut Step,
        batch: &Batch,
        logits: &omni_engine::stage::Logits,
        draft: &[bool],
    ) {
        for i in 0..batch.len() {
            let slot = batch.seq[i];
            let s = self.samplers.entry(slot).or_insert_with(|| {
                tracing::warn!("slot {slot} has no sampling settings; sampling greedily");
                SeqSampler {
                    sampler: Sampler::new(SamplingParams::default()),
                    history: Vec::new(),
                    logprobs: false,
                    top_logprobs: 0,
                    prompt_len: 0,
                    constraint: None,
                }
            });
            if draft.get(i) != Some(&true) {
                s.push(batch.tokens[i], batch.pos[i] as usize);
            }
        }
        let mut rejected: Vec<u32> = Vec::new();
        for (row, &bi) in logits.rows.iter().enumerate() {
            let slot = batch.seq[bi];
            if rejected.contains(&slot) {
                continue;
            }
            let l = logits.row(row);
            let s = self.samplers.get_mut(&slot).expect("inserted above");
            let token = s.sample(l, &mut self.scratch);
            let logprob = (s.logprobs || s.top_logprobs > 0).then(|| logprob_of(l, token));
            let top = if s.top_logprobs > 0 {
                top_logprobs(l, s.top_logprobs)
                    .into_iter()
                    .map(|(token, logprob)| TopLogprob {
                        token,
                        logprob,
                        piece: String::new(),
                    })
                    .collect()
            } else {
                Vec::new()
            };
            // The next row is this slot's next draft token: taken if it
            // is what was just sampled, and then its row is sampled too.
            let next = bi + 1;
            if draft.get(next) == Some(&true) && batch.seq[next] == slot {
                if batch.tokens[next] == token {
                    s.push(token, batch.pos[next] as usize);
                } else {
                    rejected.push(slot);
                }
            }
            step.sampled.push(Sampled {
                slot,
                token,
                logprob,
                top,
            });
        }
    }
}

impl StageRun {
    /// The draft model's guesses for the sequences the step asks them of
    /// (`Step.propose`), each from its tokens so far and the token just
    /// sampled. Without a draft model, none (the coordinator then sends
    /// no draft: the answer is the same, only slower).
    fn propose(&mut self, step: &mut Step) -> Result<(), String> {
        let Some(drafter) = self.drafter.as_mut() else {
            return Ok(());
        };
        if step.propose.is_empty() {
            return Ok(());
        }
        let t = Instant::now();
        let mut contexts = Vec::with_capacity(step.propose.len());
        for p in &step.propose {
            let last = step.sampled.iter().rev().find(|s| s.slot == p.slot);
            let (Some(s), Some(last)) = (self.samplers.get(&p.slot), last) else {
                continue;
            };
            let mut tokens = Vec::with_capacity(s.history.len() + 1);
            tokens.extend_from_slice(&s.history);
            tokens.push(last.token);
            contexts.push((p, tokens));
        }
        let wants: Vec<Want> = contexts
            .iter()
            .map(|(p, tokens)| Want {
                slot: p.slot,
                tokens,
                n_max: p.n_max as usize,
                p_min: p.p_min,
            })
            .collect();
        let guesses = drafter
            .propose(&wants)
            .map_err(|e| format!("the draft model: {e}"))?;
        for (w, tokens) in wants.iter().zip(guesses) {
            if !tokens.is_empty() {
                step.proposals.push(Proposal {
                    slot: w.slot,
                    tokens,
                });
            }
        }
        self.stats
            .draft_us
            .fetch_add(t.elapsed().as_micros() as u64, Ordering::Relaxed);
        Ok(())
    }
}

/// Which rows of a step are draft tokens: each drafted slot's last `n`,
/// each of them and the row before it wanting logits (the coordinator
/// sends them so; anything else is refused by name). Empty when the step
/// has no draft.
fn draft_rows(step: &Step) -> Result<Vec<bool>, String> {
    if step.drafts.is_empty() {
        return Ok(Vec::new());
    }
    let mut rows = vec![false; step.seqs.len()];
    for d in &step.drafts {
        let mut left = d.n;
        for (i, &s) in step.seqs.iter().enumerate().rev() {
            if left == 0 {
                break;
            }
            if s != d.slot {
                continue;
            }
            let before = i.checked_sub(1).filter(|&b| step.seqs[b] == d.slot);
            let wanted = step.logits.get(i) == Some(&true)
                && before.is_some_and(|b| step.logits.get(b) == Some(&true));
            if !wanted {
                return Err(format!(
                    "slot {}'s draft of {} tokens: every draft row and the row before it must want logits",
                    d.slot, d.n
                ));
            }
            rows[i] = true;
            left -= 1;
        }
        if left > 0 {
            return Err(format!(
                "slot {} has a draft of {} tokens but fewer rows in the step",
                d.slot, d.n
            ));
        }
    }
    Ok(rows)
}
