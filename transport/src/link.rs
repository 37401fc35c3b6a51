//! One hop of the pipeline, from either end.
//!
//! A receiving process (a worker, or the coordinator for the sampled tokens)
//! owns an [`Inbox`]: frames reach it through its shared-memory ring, when it
//! offers one, and through the gRPC `Sink.Push` stream, which always works.
//! Both feed the same channel, so the process reads one ordered queue per
//! sender. A sending process opens an [`Outbox`] to the next receiver's
//! [`Endpoint`]: shared memory when the ring is reachable (same host, same
//! `/dev/shm`, proven by the ring's token), gRPC otherwise.

use crate::shm::{LocalBell, Received, RingBell, RingReceiver, RingSender, ShmError};
use crossbeam_channel::{Receiver, Sender};
use omni_proto::worker::v1::{sink_client::SinkClient, sink_server, Endpoint, PushReply};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio_stream::StreamExt;

pub use omni_proto::worker::v1::Frame;

/// How long a sender waits for room in a full ring, or a gRPC send for the
/// stream to accept a frame, before it calls the receiver stuck.
pub const SEND_TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    #[error("shared memory: {0}")]
    Shm(#[from] ShmError),
    #[error("gRPC link to {addr}: {msg}")]
    Grpc { addr: String, msg: String },
    #[error("shared memory was requested but {0}")]
    ShmUnavailable(String),
}

/// Which transport a sender should use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum TransportChoice {
    /// Shared memory when the receiver's ring can be opened, else gRPC.
    #[default]
    Auto,
    Shm,
    Grpc,
}

impl From<TransportChoice> for omni_proto::worker::v1::Transport {
    fn from(c: TransportChoice) -> Self {
        match c {
            TransportChoice::Auto => Self::Auto,
            TransportChoice::Shm => Self::Shm,
            TransportChoice::Grpc => Self::Grpc,
        }
    }
}

impl From<omni_proto::worker::v1::Transport> for TransportChoice {
    fn from(t: omni_proto::worker::v1::Transport) -> Self {
        use omni_proto::worker::v1::Transport;
        match t {
            Transport::Auto => Self::Auto,
            Transport::Shm => Self::Shm,
            Transport::Grpc => Self::Grpc,
        }
    }
}

impl std::str::FromStr for TransportChoice {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Self::Auto),
            "shm" => Ok(Self::Shm),
            "grpc" => Ok(Self::Grpc),
            other => Err(format!(
                "unknown transport '{other}': expected auto, shm or grpc"
            )),
        }
    }
}

/// Counters a process exports as metrics.
#[derive(Debug, Default)]
pub struct LinkStats {
    pub frames_sent: AtomicU64,
    pub bytes_sent: AtomicU64,
    pub frames_received: AtomicU64,
    pub bytes_received: AtomicU64,
}

/// The receiving end: frames come through the shared-memory ring (when
/// there is one) and through the gRPC sink, and one thread reads both with an
/// [`InboxReader`]. That thread waits on the ring's doorbell itself: a frame
/// over shared memory costs no extra thread, channel or wake-up between the
/// ring and the stage. The gRPC sink and the reader's other event sources
/// ([`Bell::channel`]) ring the same doorbell.
pub struct Inbox {
    shared: Arc<Shared>,
    ring: Option<(PathBuf, u64)>,
    pub stats: Arc<LinkStats>,
}

struct Shared {
    /// Frames that came over gRPC.
    tx: Sender<Frame>,
    rx: Receiver<Frame>,
    /// The ring; the reading thread holds the lock while it waits on it.
    ring: Mutex<Option<RingReceiver>>,
    /// Bumped before and after the ring is replaced (odd while it is), so
    /// a reader waiting on the old ring lets go of the lock and one that
    /// comes during the change waits for it to end.
    ring_gen: AtomicU64,
    /// The inbox was dropped: the sink refuses further frames.
    closed: AtomicBool,
    bell: Bell,
    stats: Arc<LinkStats>,
}

/// Wakes the thread reading an [`Inbox`]: rings the ring's doorbell when
/// there is a ring, else a doorbell inside this process.
#[derive(Clone, Default)]
pub struct Bell(Arc<BellInner>);

#[derive(Default)]
struct BellInner {
    local: LocalBell,
    ring: Mutex<Option<RingBell>>,
}

impl Bell {
    /// Wakes the reader; make the reason visible first (a frame queued, a
    /// message sent).
    pub fn ring(&self) {
        self.0.local.ring();
        if let Some(r) = self.0.ring.lock().unwrap().as_ref() {
            r.ring();
        }
    }

    /// A channel whose sends wake the reader: for the reading thread's other
    /// event sources, checked in [`InboxReader::next`]'s `woken`.
    pub fn channel<T>(&self) -> (BellSender<T>, Receiver<T>) {
        let (tx, rx) = crossbeam_channel::unbounded();
        (
            BellSender {
                tx,
                bell: self.clone(),
            },
            rx,
        )
    }
}

/// The sending half of [`Bell::channel`].
pub struct BellSender<T> {
    tx: Sender<T>,
    bell: Bell,
}

impl<T> Clone for BellSender<T> {
    fn clone(&self) -> Self {
        BellSender {
            tx: self.tx.clone(),
            bell: self.bell.clone(),
        }
    }
}

impl<T> BellSender<T> {
    /// Sends and wakes the reader; fails (giving the message back) when the
    /// receiving half is gone.
    pub fn send(&self, msg: T) -> Result<(), crossbeam_channel::SendError<T>> {
        self.tx.send(msg)?;
        self.bell.ring();
        Ok(())
    }
}

/// What [`InboxReader::next`] found.
pub enum Next {
    Frame(Frame),
    /// The reader's `woken` condition became true.
    Woken,
    TimedOut,
}

/// How long an inbox reader spins before it sleeps (as a ring's receiver).
const READER_SPIN: Duration = crate::shm::DEFAULT_SPIN;
/// How long a reader waits before it tries a ring that failed again.
const RING_RETRY: Duration = Duration::from_millis(100);

impl Inbox {
    /// An inbox reachable over gRPC (add a ring with [`Inbox::add_ring`]).
    pub fn new() -> Inbox {
        let (tx, rx) = crossbeam_channel::unbounded();
        let stats = Arc::<LinkStats>::default();
        Inbox {
            shared: Arc::new(Shared {
                tx,
                rx,
                ring: Mutex::new(None),
                ring_gen: AtomicU64::new(0),
                closed: AtomicBool::new(false),
                bell: Bell::default(),
                stats: stats.clone(),
            }),
            ring: None,
            stats,
        }
    }

    /// Offers (or replaces) a shared-memory ring `dir/name` of `capacity`
    /// bytes next to gRPC. If it cannot be created (no /dev/shm, no room),
    /// the inbox keeps working over gRPC and the caller logs the error.
    pub fn add_ring(&mut self, dir: &Path, name: &str, capacity: usize) -> Result<(), ShmError> {
        self.set_ring(None);
        sweep_stale_rings(dir);
        let ring = RingReceiver::create(dir, name, capacity)?;
        self.set_ring(Some(ring));
        Ok(())
    }

    /// Puts `ring` in place of the current one (dropping it, which unlinks
    /// its file), taking the lock from a reader that may be waiting on it.
    fn set_ring(&mut self, ring: Option<RingReceiver>) {
        self.ring = ring.as_ref().map(|r| (r.path().to_path_buf(), r.token()));
        let sh = &self.shared;
        sh.ring_gen.fetch_add(1, Ordering::SeqCst);
        sh.bell.ring();
        let mut slot = sh.ring.lock().unwrap();
        *sh.bell.0.ring.lock().unwrap() = ring.as_ref().map(RingReceiver::bell);
        let old = std::mem::replace(&mut *slot, ring);
        sh.ring_gen.fetch_add(1, Ordering::SeqCst);
        drop(slot);
        sh.bell.ring();
        drop(old);
    }

    /// Where senders reach this inbox.
    pub fn endpoint(&self, grpc_addr: &str, host_id: &str) -> Endpoint {
        let (shm_path, shm_token) = match &self.ring {
            Some((p, t)) => (p.display().to_string(), *t),
            None => (String::new(), 0),
        };
        Endpoint {
            grpc_addr: grpc_addr.to_string(),
            shm_path,
            shm_token,
            host_id: host_id.to_string(),
        }
    }

    /// The gRPC service that feeds this inbox.
    pub fn sink_service(&self) -> sink_server::SinkServer<GrpcSink> {
        sink_server::SinkServer::new(GrpcSink {
            shared: self.shared.clone(),
        })
        .max_decoding_message_size(256 << 20)
    }

    /// A reader of this inbox, for the one thread that consumes its frames
    /// (a later reader takes over from an earlier one; two at once take
    /// turns on the ring).
    pub fn reader(&self) -> InboxReader {
        InboxReader {
            shared: self.shared.clone(),
        }
    }

    /// The doorbell of this inbox's reader.
    pub fn bell(&self) -> Bell {
        self.shared.bell.clone()
    }
}

impl Default for Inbox {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for Inbox {
    fn drop(&mut self) {
        self.shared.closed.store(true, Ordering::Relaxed);
        self.set_ring(None);
    }
}

/// The consuming end of an [`Inbox`].
pub struct InboxReader {
    shared: Arc<Shared>,
}

impl InboxReader {
    /// The next frame, or `None` after `timeout`.
    pub fn recv(&self, timeout: Duration) -> Option<Frame> {
        match self.next(timeout, &mut || false) {
            Next::Frame(f) => Some(f),
            Next::Woken | Next::TimedOut => None,
        }
    }

    /// The doorbell that wakes this reader.
    pub fn bell(&self) -> Bell {
        self.shared.bell.clone()
    }

    /// The next frame, or [`Next::Woken`] as soon as `woken()` is true (the
    /// thread's other work: whoever makes it true rings [`Self::bell`], as a
    /// [`BellSender`] does), or [`Next::TimedOut`] after `timeout`. Frames
    /// waiting in the inbox come first.
    pub fn next(&self, timeout: Duration, woken: &mut dyn FnMut() -> bool) -> Next {
        let sh = &*self.shared;
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok(f) = sh.rx.try_recv() {
                return Next::Frame(f);
            }
            if woken() {
                return Next::Woken;
            }
            let now = Instant::now();
            if now >= deadline {
                return Next::TimedOut;
            }
            // The whole wait: frames over gRPC, a replaced ring and the
            // caller's events all ring the doorbell.
            let left = deadline - now;
            let gen = sh.ring_gen.load(Ordering::SeqCst);
            let mut other =
                || !sh.rx.is_empty() || sh.ring_gen.load(Ordering::SeqCst) != gen || woken();
            if gen % 2 == 1 {
                // The ring is being replaced: wait for that to end.
                sh.bell.0.local.wait(left, READER_SPIN, other);
                continue;
            }
            let mut slot = sh.ring.lock().unwrap();
            let Some(ring) = slot.as_mut() else {
                drop(slot);
                sh.bell.0.local.wait(left, READER_SPIN, other);
                continue;
            };
            let (mut meta, mut payload) = (Vec::new(), Vec::new());
            match ring.recv_unless(&mut meta, &mut payload, left, &mut other) {
                Ok(Received::Frame) => {
                    drop(slot);
                    sh.stats.frames_received.fetch_add(1, Ordering::Relaxed);
                    sh.stats
                        .bytes_received
                        .fetch_add((meta.len() + payload.len()) as u64, Ordering::Relaxed);
                    return Next::Frame(Frame { meta, payload });
                }
                Ok(Received::Woken | Received::TimedOut) => {}
                // A sender went away; a new one may open a new ring later
                // (a re-plan), and gRPC frames still come: wait on those.
                Err(e) => {
                    drop(slot);
                    let pause = if matches!(e, ShmError::PeerClosed { .. }) {
                        Duration::from_millis(5)
                    } else {
                        tracing::error!("shared-memory ring failed: {e}");
                        RING_RETRY
                    };
                    sh.bell.0.local.wait(left.min(pause), Duration::ZERO, other);
                }
            }
        }
    }
}

/// `Sink.Push`: frames of one client stream go into the inbox in order.
pub struct GrpcSink {
    shared: Arc<Shared>,
}

#[tonic::async_trait]
impl sink_server::Sink for GrpcSink {
    async fn push(
        &self,
        request: tonic::Request<tonic::Streaming<Frame>>,
    ) -> Result<tonic::Response<PushReply>, tonic::Status> {
        let mut stream = request.into_inner();
        while let Some(frame) = stream.next().await {
            let frame = frame?;
            let sh = &self.shared;
            sh.stats.frames_received.fetch_add(1, Ordering::Relaxed);
            sh.stats.bytes_received.fetch_add(
                (frame.meta.len() + frame.payload.len()) as u64,
                Ordering::Relaxed,
            );
            if sh.closed.load(Ordering::Relaxed) || sh.tx.send(frame).is_err() {
                return Err(tonic::Status::unavailable("receiver is shutting down"));
            }
            sh.bell.ring();
        }
        Ok(tonic::Response::new(PushReply {}))
    }
}

/// The sending end of a hop.
pub struct Outbox {
    kind: OutboxKind,
    pub stats: Arc<LinkStats>,
}

enum OutboxKind {
    Shm(RingSender),
    Grpc(GrpcSender),
}

struct GrpcSender {
    addr: String,
    tx: tokio::sync::mpsc::Sender<Frame>,
    /// Why the stream ended, once it has.
    failed: Arc<Mutex<Option<String>>>,
}

impl Outbox {
    /// Opens a link to `to`. Call it inside the runtime that will drive the
    /// gRPC stream when that is chosen.
    pub async fn connect(to: &Endpoint, choice: TransportChoice) -> Result<Outbox, LinkError> {
        let stats = Arc::<LinkStats>::default();
        if choice != TransportChoice::Grpc {
            let shm = if to.shm_path.is_empty() {
                Err("the receiver offers no shared-memory ring".to_string())
            } else {
                RingSender::open(Path::new(&to.shm_path), to.shm_token).map_err(|e| e.to_string())
            };
            match shm {
                Ok(s) => {
                    return Ok(Outbox {
                        kind: OutboxKind::Shm(s),
                        stats,
                    })
                }
                Err(why) if choice == TransportChoice::Shm => {
                    return Err(LinkError::ShmUnavailable(format!(
                        "{} ({}) is not reachable: {why}",
                        to.grpc_addr, to.shm_path
                    )))
                }
                Err(why) => tracing::info!(
                    "shared memory to {} not usable ({why}); using gRPC",
                    to.grpc_addr
                ),
            }
        }
        let addr = to.grpc_addr.clone();
        let channel = connect_channel(&addr).await?;
        let (tx, rx) = tokio::sync::mpsc::channel::<Frame>(64);
        let failed = Arc::new(Mutex::new(None));
        let f = failed.clone();
        let a = addr.clone();
        tokio::spawn(async move {
            let mut client = SinkClient::new(channel).max_encoding_message_size(256 << 20);
            let stream = tokio_stream::wrappers::ReceiverStream::new(rx);
            let why = match client.push(stream).await {
                Ok(_) => "the stream was closed".to_string(),
                Err(s) => format!("{} ({:?})", s.message(), s.code()),
            };
            tracing::debug!("gRPC link to {a} ended: {why}");
            *f.lock().unwrap() = Some(why);
        });
        Ok(Outbox {
            kind: OutboxKind::Grpc(GrpcSender { addr, tx, failed }),
            stats,
        })
    }

    /// "shm" or "grpc".
    pub fn kind(&self) -> &'static str {
        match self.kind {
            OutboxKind::Shm(_) => "shm",
            OutboxKind::Grpc(_) => "grpc",
        }
    }

    /// Sends one frame; blocks while the receiver is behind (up to
    /// [`SEND_TIMEOUT`]). Must not be called from an async task.
    pub fn send(&mut self, frame: Frame) -> Result<(), LinkError> {
        let n = (frame.meta.len() + frame.payload.len()) as u64;
        match &mut self.kind {
            OutboxKind::Shm(s) => s.send(&frame.meta, &frame.payload, SEND_TIMEOUT)?,
            OutboxKind::Grpc(g) => {
                let gone = |g: &GrpcSender| LinkError::Grpc {
                    addr: g.addr.clone(),
                    msg: g
                        .failed
                        .lock()
                        .unwrap()
                        .clone()
                        .unwrap_or_else(|| "the stream ended".into()),
                };
                if g.failed.lock().unwrap().is_some() {
                    return Err(gone(g));
                }
                match g.tx.try_send(frame) {
                    Ok(()) => {}
                    Err(tokio::sync::mpsc::error::TrySendError::Full(frame)) => {
                        let deadline = std::time::Instant::now() + SEND_TIMEOUT;
                        let mut frame = frame;
                        loop {
                            std::thread::sleep(Duration::from_micros(200));
                            match g.tx.try_send(frame) {
                                Ok(()) => break,
                                Err(tokio::sync::mpsc::error::TrySendError::Full(f)) => {
                                    if std::time::Instant::now() > deadline {
                                        return Err(LinkError::Grpc {
                                            addr: g.addr.clone(),
                                            msg: format!(
                                                "the receiver took no frame for {SEND_TIMEOUT:?}"
                                            ),
                                        });
                                    }
                                    frame = f;
                                }
                                Err(_) => return Err(gone(g)),
                            }
                        }
                    }
                    Err(_) => return Err(gone(g)),
                }
            }
        }
        self.stats.frames_sent.fetch_add(1, Ordering::Relaxed);
        self.stats.bytes_sent.fetch_add(n, Ordering::Relaxed);
        Ok(())
    }
}

/// A gRPC channel to `addr` (5 s to connect; TLS, keepalive and no Nagle
/// delay from [`crate::tls::endpoint`]).
pub(crate) async fn connect_channel(addr: &str) -> Result<tonic::transport::Channel, LinkError> {
    let grpc_err = |e: &tonic::transport::Error| LinkError::Grpc {
        addr: addr.to_string(),
        msg: crate::tls::describe(e),
    };
    crate::tls::endpoint(addr)
        .map_err(|e| grpc_err(&e))?
        .connect_timeout(Duration::from_secs(5))
        .connect()
        .await
        .map_err(|e| grpc_err(&e))
}

/// Removes rings left by omni processes that died without cleaning up
/// (`kill -9`, OOM). Only files named `omni-*` that are rings whose owner,
/// in our pid namespace, no longer exists; nothing else is touched.
fn sweep_stale_rings(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.filter_map(Result::ok) {
        let name = e.file_name();
        if name.to_string_lossy().starts_with("omni-") && crate::shm::looks_stale(&e.path()) {
            tracing::info!("removing stale shared-memory ring {}", e.path().display());
            let _ = std::fs::remove_file(e.path());
        }
    }
}

/// Identifies this host (and its container namespace): two processes may use
/// shared memory with each other only if these match *and* the ring opens.
pub fn host_id() -> String {
    let read = |p: &str| {
        std::fs::read_to_string(p)
            .unwrap_or_default()
            .trim()
            .to_string()
    };
    let host = read("/proc/sys/kernel/hostname");
    format!(
        "{}/{}/{}",
        read("/etc/machine-id"),
        read("/proc/sys/kernel/random/boot_id"),
        host
    )
}
