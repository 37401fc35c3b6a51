//! The expert worker's compute thread: it owns the loaded experts and every
//! stage's shared-memory session, reads each session's request ring itself
//! and answers on its reply ring, and takes the gRPC sessions' calls from a
//! channel.
//!
//! One thread does all of it, for two reasons. ggml's OpenMP team belongs
//! to the thread that starts it, so one computing thread keeps one team,
//! whose threads are still spinning when the next call comes during a busy
//! decode. And a call over shared memory reaches the math with no relay in
//! between: with nothing to do the thread sleeps on one doorbell (a ring of
//! its own that carries no frames), which every stage rings after it sends
//! a request; a relay thread per session and a channel to this one cost
//! two more wake-ups a call (50-80 µs on a 2-vCPU VM, measured with
//! `omnictl bench-moe`'s breakdown).

use crate::service::Stats;
use omni_engine::ExpertStage;
use omni_proto::worker::v1::{Endpoint, Frame};
use omni_transport::experts::{decode_request, encode_reply, monotonic_ns, WorkerStamps};
use omni_transport::shm::{LocalBell, Received, RingBell, RingReceiver, RingSender, ShmError};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// How long the thread sleeps before it looks whether a session's stage
/// died without closing its ring (a crash), and whether to stop.
const IDLE_CHECK: Duration = Duration::from_millis(100);

/// How long an answer may wait for room in a stage's reply ring (it holds
/// two answers; a stage reads each before it sends more).
const REPLY_TIMEOUT: Duration = Duration::from_secs(10);

/// A gRPC session's call and where its answer goes.
pub struct Job {
    pub frame: Frame,
    /// When the frame was in hand ([`monotonic_ns`]).
    pub received_ns: u64,
    pub reply: Box<dyn FnOnce(Frame) + Send>,
}

/// A stage's shared-memory session: its requests come in on `rx`, the
/// answers go out on `tx`.
pub struct Session {
    pub client: String,
    pub name: String,
    pub rx: RingReceiver,
    pub tx: RingSender,
}

enum Control {
    /// Compute with these experts from now on (`None`: hold none), and say
    /// when the old ones are gone.
    Experts(Option<ExpertStage>, crossbeam_channel::Sender<()>),
    Session(Session),
}

/// Wakes the compute thread from this process.
#[derive(Clone)]
enum Waker {
    Ring(RingBell),
    Local(Arc<LocalBell>),
}

impl Waker {
    fn ring(&self) {
        match self {
            Waker::Ring(b) => b.ring(),
            Waker::Local(b) => b.ring(),
        }
    }
}

/// The other threads' handle on the compute thread.
pub struct Computer {
    control: crossbeam_channel::Sender<Control>,
    jobs: crossbeam_channel::Sender<Job>,
    waker: Waker,
    /// The doorbell stages ring after each request, or why there is none
    /// (then no shared-memory session can be served).
    doorbell: Result<Endpoint, String>,
}

impl Computer {
    /// Starts the compute thread of worker `id`, its doorbell a ring named
    /// `doorbell` in `shm_dir`; with nothing to do it spins for `spin`,
    /// then sleeps. It runs until `stop` is set.
    pub fn start(
        id: &str,
        shm_dir: &Path,
        doorbell: &str,
        spin: Duration,
        stats: Arc<Stats>,
        stop: Arc<AtomicBool>,
    ) -> std::io::Result<Computer> {
        let (ring, endpoint) = match RingReceiver::create(shm_dir, doorbell, 64) {
            Ok(mut r) => {
                r.set_spin(spin);
                let ep = Endpoint {
                    shm_path: r.path().display().to_string(),
                    shm_token: r.token(),
                    ..Default::default()
                };
                (Some(r), Ok(ep))
            }
            Err(e) => {
                tracing::warn!(
                    "no shared-memory doorbell, so stages reach this worker over gRPC only: {e}"
                );
                (None, Err(e.to_string()))
            }
        };
        let local = Arc::new(LocalBell::default());
        let waker = ring
            .as_ref()
            .map_or(Waker::Local(local.clone()), |r| Waker::Ring(r.bell()));
        let (control, control_rx) = crossbeam_channel::unbounded();
        let (jobs, jobs_rx) = crossbeam_channel::unbounded();
        let mut thread = Thread {
            id: id.to_string(),
            experts: None,
            stats,
            sessions: Vec::new(),
            control: control_rx,
            jobs: jobs_rx,
            stop,
            idle_since_ns: 0,
            spin,
        };
        std::thread::Builder::new()
            .name("experts".into())
            .spawn(move || thread.run(ring, &local))?;
        Ok(Computer {
            control,
            jobs,
            waker,
            doorbell: endpoint,
        })
    }

    /// Replaces the experts computed with (`None`: drops them), returning
    /// once the old ones are gone. Blocking.
    pub fn set_experts(&self, experts: Option<ExpertStage>) {
        let (done, wait) = crossbeam_channel::bounded(1);
        if self.control.send(Control::Experts(experts, done)).is_ok() {
            self.waker.ring();
            let _ = wait.recv();
        }
    }

    /// The doorbell a shared-memory session's stage rings, or why this
    /// worker has none.
    pub fn doorbell(&self) -> Result<Endpoint, String> {
        self.doorbell.clone()
    }

    /// Serves a stage's shared-memory session from now on.
    pub fn add_session(&self, s: Session) {
        if self.control.send(Control::Session(s)).is_ok() {
            self.waker.ring();
        }
    }

    /// Computes a gRPC session's call; `reply` gets the answer.
    pub fn call(&self, frame: Frame, reply: Box<dyn FnOnce(Frame) + Send>) {
        let job = Job {
            frame,
            received_ns: monotonic_ns(),
            reply,
        };
        match self.jobs.send(job) {
            Ok(()) => self.waker.ring(),
            Err(e) => {
                let job = e.into_inner();
                (job.reply)(encode_reply(
                    0,
                    0,
                    Err("the expert worker is stopping"),
                    WorkerStamps::default(),
                ));
            }
        }
    }
}

/// The compute thread's own state.
struct Thread {
    id: String,
    experts: Option<ExpertStage>,
    stats: Arc<Stats>,
    sessions: Vec<Session>,
    control: crossbeam_channel::Receiver<Control>,
    jobs: crossbeam_channel::Receiver<Job>,
    stop: Arc<AtomicBool>,
    /// When the last call was answered ([`monotonic_ns`]; 0: none yet):
    /// a request that came earlier waited for the thread, not for a
    /// wake-up.
    idle_since_ns: u64,
    /// How long it spins before it sleeps.
    spin: Duration,
}

impl Thread {
    fn run(&mut self, mut doorbell: Option<RingReceiver>, local: &LocalBell) {
        let mut frame = Frame::default();
        let (mut meta, mut payload) = (Vec::new(), Vec::new());
        while !self.stop.load(Ordering::Relaxed) {
            let mut busy = false;
            while let Ok(c) = self.control.try_recv() {
                busy = true;
                match c {
                    Control::Experts(e, done) => {
                        self.experts = e;
                        let _ = done.send(());
                    }
                    Control::Session(s) => self.sessions.push(s),
                }
            }
            // One call from each session that has one, in turn, then the
            // gRPC sessions' calls.
            let mut i = 0;
            while i < self.sessions.len() {
                if self.sessions[i].rx.ready() {
                    busy = true;
                    if !self.serve(i, &mut frame) {
                        continue;
                    }
                }
                i += 1;
            }
            while let Ok(job) = self.jobs.try_recv() {
                busy = true;
                let out = self.compute(&job.frame, job.received_ns);
                (job.reply)(out);
                self.idle_since_ns = monotonic_ns();
            }
            if busy {
                continue;
            }
            let (control, jobs, sessions) = (&self.control, &self.jobs, &self.sessions);
            let mut ready =
                || !control.is_empty() || !jobs.is_empty() || sessions.iter().any(|s| s.rx.ready());
            let woken = match doorbell.as_mut() {
                Some(ring) => {
                    match ring.recv_unless(&mut meta, &mut payload, IDLE_CHECK, &mut ready) {
                        Ok(Received::TimedOut) => false,
                        Ok(_) => true,
                        Err(e) => {
                            // Nothing writes to the doorbell, so this is someone
                            // else's doing: go on with the local bell.
                            tracing::error!("the expert worker's doorbell failed ({e}); stages' calls may wait up to {IDLE_CHECK:?}");
                            doorbell = None;
                            true
                        }
                    }
                }
                None => local.wait(IDLE_CHECK, self.spin, ready),
            };
            if !woken {
                // A quiet spell: a stage that crashed never closes its ring,
                // so ask each ring whether its sender's process is there.
                let mut i = 0;
                while i < self.sessions.len() {
                    if self.serve(i, &mut frame) {
                        i += 1;
                    }
                }
            }
        }
    }

    /// Takes session `i`'s next call, if any, and answers it. Returns false
    /// (and drops the session) once its stage is gone.
    fn serve(&mut self, i: usize, frame: &mut Frame) -> bool {
        let s = &mut self.sessions[i];
        let why = match s
            .rx
            .recv_into(&mut frame.meta, &mut frame.payload, Duration::ZERO)
        {
            Ok(false) => return true,
            Ok(true) => {
                let out = self.compute(frame, monotonic_ns());
                let s = &mut self.sessions[i];
                let sent = s.tx.send(&out.meta, &out.payload, REPLY_TIMEOUT);
                self.idle_since_ns = monotonic_ns();
                match sent {
                    Ok(()) => return true,
                    Err(e) => format!("cannot answer: {e}"),
                }
            }
            Err(ShmError::PeerClosed { .. }) => String::new(),
            Err(e) => e.to_string(),
        };
        let s = self.sessions.swap_remove(i);
        if why.is_empty() {
            tracing::info!("expert session of {} ended ({})", s.client, s.name);
        } else {
            tracing::warn!("expert session of {} ({}): {why}", s.client, s.name);
        }
        false
    }

    fn compute(&mut self, frame: &Frame, received_ns: u64) -> Frame {
        let stamps = WorkerStamps {
            received_ns,
            idle_since_ns: self.idle_since_ns,
            ..Default::default()
        };
        compute(&self.id, &mut self.experts, &self.stats, frame, stamps)
    }
}

/// One call (`stamps`: when it was in hand and the thread last free):
/// decodes it, computes it with `experts`, and encodes the answer (or why
/// there is none), counting it in `stats`.
fn compute(
    id: &str,
    experts: &mut Option<ExpertStage>,
    stats: &Stats,
    frame: &Frame,
    mut stamps: WorkerStamps,
) -> Frame {
    stats.bytes_in.fetch_add(
        (frame.meta.len() + frame.payload.len()) as u64,
        Ordering::Relaxed,
    );
    let (out, ok) = match experts.as_mut() {
        None => (
            encode_reply(
                0,
                0,
                Err(&format!("expert worker {id} has no experts loaded")),
                stamps,
            ),
            false,
        ),
        Some(stage) => {
            let n_embd = stage.model().hparams.n_embd as usize;
            match decode_request(frame, n_embd) {
                Ok(req) => {
                    stats
                        .tokens
                        .fetch_add(req.n_tokens as u64, Ordering::Relaxed);
                    stage.set_batch_invariant(req.invariant);
                    stamps.started_ns = monotonic_ns();
                    let r = stage.run(req.layer, &req.x, &req.ids, &req.weights);
                    stamps.built_ns = stamps.started_ns + stage.graph_time().as_nanos() as u64;
                    match r {
                        Ok(v) => (encode_reply(req.id, req.layer, Ok(&v), stamps), true),
                        Err(e) => (
                            encode_reply(req.id, req.layer, Err(&e.to_string()), stamps),
                            false,
                        ),
                    }
                }
                Err(e) => (encode_reply(0, 0, Err(&e), stamps), false),
            }
        }
    };
    let counter = if ok { &stats.calls } else { &stats.errors };
    counter.fetch_add(1, Ordering::Relaxed);
    let computed = monotonic_ns().saturating_sub(stamps.started_ns.max(stamps.received_ns));
    stats
        .compute_us
        .fetch_add(computed / 1000, Ordering::Relaxed);
    stats.bytes_out.fetch_add(
        (out.meta.len() + out.payload.len()) as u64,
        Ordering::Relaxed,
    );
    out
}
