//! One hop of the pipeline, from either end.
//!
//! A receiving process (a worker, or the coordinator for the sampled tokens)
//! owns an [`Inbox`]: frames reach it through its shared-memory ring, when it
//! offers one, and through the gRPC `Sink.Push` stream, which always works.
//! Both feed the same channel, so the process reads one ordered queue per
//! sender. A sending process opens an [`Outbox`] to the next receiver's
//! [`Endpoint`]: shared memory when the ring is reachable (same host, same
//! `/dev/shm`, proven by the ring's token), gRPC otherwise.

use crate::shm::{RingReceiver, RingSender, ShmError};
use crossbeam_channel::{Receiver, Sender};
use omni_proto::worker::v1::{sink_client::SinkClient, sink_server, Endpoint, PushReply};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
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

/// The receiving end: a channel fed by the ring reader thread and by the
/// gRPC sink service.
pub struct Inbox {
    tx: Sender<Frame>,
    rx: Receiver<Frame>,
    ring: Option<(PathBuf, u64)>,
    stop: Arc<AtomicBool>,
    reader: Option<std::thread::JoinHandle<()>>,
    pub stats: Arc<LinkStats>,
}

impl Inbox {
    /// An inbox reachable over gRPC (add a ring with [`Inbox::add_ring`]).
    pub fn new() -> Inbox {
        let (tx, rx) = crossbeam_channel::unbounded();
        Inbox {
            tx,
            rx,
            ring: None,
            stop: Arc::new(AtomicBool::new(false)),
            reader: None,
            stats: Arc::default(),
        }
    }

    /// Offers (or replaces) a shared-memory ring `dir/name` of `capacity`
    /// bytes next to gRPC. If it cannot be created (no /dev/shm, no room),
    /// the inbox keeps working over gRPC and the caller logs the error.
    pub fn add_ring(&mut self, dir: &Path, name: &str, capacity: usize) -> Result<(), ShmError> {
        self.stop_ring();
        sweep_stale_rings(dir);
        let ring = RingReceiver::create(dir, name, capacity)?;
        self.ring = Some((ring.path().to_path_buf(), ring.token()));
        self.stop = Arc::new(AtomicBool::new(false));
        let (tx, stop, stats) = (self.tx.clone(), self.stop.clone(), self.stats.clone());
        self.reader = Some(
            std::thread::Builder::new()
                .name("shm-reader".into())
                .spawn(move || read_ring(ring, tx, stop, stats))
                .expect("spawning a thread"),
        );
        Ok(())
    }

    fn stop_ring(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(r) = self.reader.take() {
            let _ = r.join();
        }
        self.ring = None;
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
            tx: self.tx.clone(),
            stats: self.stats.clone(),
        })
        .max_decoding_message_size(256 << 20)
    }

    /// The next frame, or `None` after `timeout`.
    pub fn recv(&self, timeout: Duration) -> Option<Frame> {
        self.rx.recv_timeout(timeout).ok()
    }

    /// The channel itself, for `select!` with other event sources.
    pub fn receiver(&self) -> &Receiver<Frame> {
        &self.rx
    }
}

impl Default for Inbox {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for Inbox {
    fn drop(&mut self) {
        self.stop_ring();
    }
}

fn read_ring(
    mut ring: RingReceiver,
    tx: Sender<Frame>,
    stop: Arc<AtomicBool>,
    stats: Arc<LinkStats>,
) {
    while !stop.load(Ordering::Relaxed) {
        match ring.recv(Duration::from_millis(100)) {
            Ok(Some((meta, payload))) => {
                stats.frames_received.fetch_add(1, Ordering::Relaxed);
                stats
                    .bytes_received
                    .fetch_add((meta.len() + payload.len()) as u64, Ordering::Relaxed);
                if tx.send(Frame { meta, payload }).is_err() {
                    return;
                }
            }
            Ok(None) => {}
            // A sender went away; a new one may open the ring later (a
            // re-plan), so keep reading until the inbox is dropped.
            Err(ShmError::PeerClosed { .. }) => std::thread::sleep(Duration::from_millis(5)),
            Err(e) => {
                tracing::error!("shared-memory ring failed: {e}");
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
}

/// `Sink.Push`: frames of one client stream go into the inbox in order.
pub struct GrpcSink {
    tx: Sender<Frame>,
    stats: Arc<LinkStats>,
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
            self.stats.frames_received.fetch_add(1, Ordering::Relaxed);
            self.stats.bytes_received.fetch_add(
                (frame.meta.len() + frame.payload.len()) as u64,
                Ordering::Relaxed,
            );
            if self.tx.send(frame).is_err() {
                return Err(tonic::Status::unavailable("receiver is shutting down"));
            }
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

/// A gRPC channel to `addr` (5 s to connect, no Nagle delay).
pub(crate) async fn connect_channel(addr: &str) -> Result<tonic::transport::Channel, LinkError> {
    let grpc_err = |e: &dyn std::fmt::Display| LinkError::Grpc {
        addr: addr.to_string(),
        msg: e.to_string(),
    };
    tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .map_err(|e| grpc_err(&e))?
        .connect_timeout(Duration::from_secs(5))
        .tcp_nodelay(true)
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
