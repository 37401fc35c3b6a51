//! The expert link: a device stage asks an expert worker (`omni-cpu-worker`)
//! to compute the routed experts of one block and waits for the answer.
//!
//! Unlike a pipeline hop (one way, many frames in flight) this is a call:
//! one request frame, one reply frame, in order, at most [`MAX_OUTSTANDING`]
//! outstanding per link (an overlapped step's two micro-batch groups). On
//! one host it runs over a pair of shared-memory rings (the caller's
//! ring receives replies, the worker's receives requests; the `OpenShm` RPC
//! swaps their endpoints and the rings' tokens prove both ends share
//! `/dev/shm`), elsewhere over the `Experts.Compute` bidirectional gRPC
//! stream. Either way a worker that dies is noticed while waiting: the ring
//! sees its process gone, the stream ends with an error.
//!
//! The frame layout (an [`ExpertCall`] header; the payload is little-endian
//! f32 input, i32 ids and f32 weights, or the f32 result) is encoded and
//! decoded here for both ends.

use crate::link::{LinkError, LinkStats, TransportChoice};
pub use crate::shm::monotonic_ns;
use crate::shm::{RingBell, RingReceiver, RingSender, ShmError};
use omni_proto::worker::v1::{experts_client::ExpertsClient, Endpoint, ExpertCall, OpenShmRequest};
use prost::Message;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub use omni_proto::worker::v1::Frame;

/// The most calls a link keeps unanswered.
pub const MAX_OUTSTANDING: usize = 2;

/// How long one send may wait for room in a ring.
const SEND_TIMEOUT: Duration = Duration::from_secs(10);

/// How long either end of an expert link spins for the other before it
/// sleeps on its futex, when it has a core of its own (a GPU stage's host
/// thread; a process pinned to its cores): a sleeping thread's wake-up
/// cost 120-160 µs each way on a 2-vCPU VM with the two on cores of their
/// own (`omnictl bench-moe --overlap`), and an R1 decode step on a big CPU
/// answers each of its 58 calls within about a millisecond. Elsewhere the
/// two may share cores, and the ring's default (50 µs) holds.
pub const OWN_CORE_SPIN: Duration = Duration::from_millis(2);

/// The spin for an end that has a core of its own (`own_core`) or not.
pub fn spin_for(own_core: bool) -> Duration {
    if own_core {
        OWN_CORE_SPIN
    } else {
        crate::shm::DEFAULT_SPIN
    }
}

/// Bytes of the ring for one link: `n_ubatch` tokens of input plus ids and
/// weights, twice, and room for the header.
pub fn ring_bytes(n_ubatch: usize, n_embd: usize, n_used: usize) -> usize {
    2 * (4096 + n_ubatch * (n_embd + 2 * n_used) * 4)
}

/// One expert block's work, borrowed: what a request frame carries.
#[derive(Debug, Clone, Copy)]
pub struct ExpertRequest<'a> {
    pub id: u64,
    pub layer: u32,
    pub n_tokens: usize,
    pub n_used: usize,
    pub x: &'a [f32],
    pub ids: &'a [i32],
    pub weights: &'a [f32],
    /// Compute with batch-invariant kernels.
    pub invariant: bool,
}

/// A request as the worker decodes it.
#[derive(Debug, Clone, PartialEq)]
pub struct DecodedRequest {
    pub id: u64,
    pub layer: u32,
    pub n_tokens: usize,
    pub n_used: usize,
    pub x: Vec<f32>,
    pub ids: Vec<i32>,
    pub weights: Vec<f32>,
    pub invariant: bool,
}

fn push_le<T: Copy, const N: usize>(out: &mut Vec<u8>, v: &[T], f: fn(T) -> [u8; N]) {
    out.reserve(v.len() * N);
    for &x in v {
        out.extend_from_slice(&f(x));
    }
}

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
        .collect()
}

impl ExpertRequest<'_> {
    pub fn encode(&self) -> Frame {
        let meta = ExpertCall {
            id: self.id,
            layer: self.layer,
            n_tokens: self.n_tokens as u32,
            n_used: self.n_used as u32,
            error: String::new(),
            invariant: self.invariant,
            ..Default::default()
        };
        let mut payload = Vec::with_capacity((self.x.len() + 2 * self.ids.len()) * 4);
        push_le(&mut payload, self.x, f32::to_le_bytes);
        push_le(&mut payload, self.ids, i32::to_le_bytes);
        push_le(&mut payload, self.weights, f32::to_le_bytes);
        Frame {
            meta: meta.encode_to_vec(),
            payload,
        }
    }
}

/// Decodes a request frame, checking its lengths against `n_embd` (the
/// model's width, which only the worker knows). Errors name what is wrong.
pub fn decode_request(frame: &Frame, n_embd: usize) -> Result<DecodedRequest, String> {
    let call = ExpertCall::decode(frame.meta.as_slice())
        .map_err(|e| format!("undecodable expert call header: {e}"))?;
    let (n, u) = (call.n_tokens as usize, call.n_used as usize);
    let want = 4 * (n * n_embd + 2 * n * u);
    if n == 0 || u == 0 || frame.payload.len() != want {
        return Err(format!(
            "an expert call of {n} tokens with {u} experts each needs {want} payload bytes (width {n_embd}), got {}",
            frame.payload.len()
        ));
    }
    let p = &frame.payload;
    let (x, rest) = p.split_at(4 * n * n_embd);
    let (ids, weights) = rest.split_at(4 * n * u);
    Ok(DecodedRequest {
        id: call.id,
        layer: call.layer,
        n_tokens: n,
        n_used: u,
        x: f32s(x),
        ids: ids
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes(c.try_into().expect("4 bytes")))
            .collect(),
        weights: f32s(weights),
        invariant: call.invariant,
    })
}

/// When the expert worker had a request in hand, began computing it and
/// had its graph ready, and when it was last free ([`monotonic_ns`]); the
/// reply carries them.
#[derive(Debug, Clone, Copy, Default)]
pub struct WorkerStamps {
    pub received_ns: u64,
    pub started_ns: u64,
    pub built_ns: u64,
    /// When the worker had answered its call before this one (0: none).
    pub idle_since_ns: u64,
}

/// The reply to request `id`: the result, or why there is none; and when
/// the worker had it, computed it and answered (the compute ends, and the
/// answer is stamped, here).
pub fn encode_reply(
    id: u64,
    layer: u32,
    result: Result<&[f32], &str>,
    stamps: WorkerStamps,
) -> Frame {
    let computed = monotonic_ns();
    let mut meta = ExpertCall {
        id,
        layer,
        compute_us: computed.saturating_sub(stamps.started_ns) / 1000,
        received_ns: stamps.received_ns,
        started_ns: stamps.started_ns,
        built_ns: stamps.built_ns,
        idle_since_ns: stamps.idle_since_ns,
        ..Default::default()
    };
    let mut payload = Vec::new();
    match result {
        Ok(out) => push_le(&mut payload, out, f32::to_le_bytes),
        Err(e) => meta.error = e.to_string(),
    }
    meta.replied_ns = monotonic_ns();
    Frame {
        meta: meta.encode_to_vec(),
        payload,
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ExpertLinkError {
    #[error("{0}")]
    Link(#[from] LinkError),
    #[error("{0}")]
    Shm(#[from] ShmError),
    #[error("the expert worker {worker} is gone: {why}")]
    Gone { worker: String, why: String },
    #[error("the expert worker {worker} sent no answer within {waited:?}")]
    Timeout { worker: String, waited: Duration },
    #[error("the expert worker {worker} failed: {why}")]
    Remote { worker: String, why: String },
    #[error("the expert worker {worker} answered out of order or malformed: {why}")]
    Protocol { worker: String, why: String },
}

enum Kind {
    Shm {
        tx: RingSender,
        rx: RingReceiver,
        /// Rung after each request: the worker sleeps on its doorbell,
        /// not on our request ring.
        bell: RingBell,
    },
    Grpc {
        tx: tokio::sync::mpsc::Sender<Frame>,
        rx: crossbeam_channel::Receiver<Result<Frame, String>>,
    },
}

/// The caller's end of an expert link.
pub struct ExpertLink {
    /// "c0 at 127.0.0.1:7001", for errors.
    worker: String,
    kind: Kind,
    next_id: u64,
    /// The calls sent and not yet answered, oldest first.
    pending: std::collections::VecDeque<Pending>,
    pub stats: Arc<LinkStats>,
    pub timing: Arc<CallTiming>,
}

/// A call sent and not yet answered.
struct Pending {
    id: u64,
    layer: u32,
    n_tokens: usize,
    /// Before its encoding.
    started: Instant,
    /// Once sent ([`monotonic_ns`]).
    sent_ns: u64,
    /// Encoding and sending it.
    send: Duration,
}

/// Where the time of a link's calls went, in µs since it opened:
/// `round_trip = send + transit + handoff + compute`.
#[derive(Debug, Default)]
pub struct CallTiming {
    /// From each request's start (before its encoding) to its answer read.
    pub round_trip_us: AtomicU64,
    /// What the worker said it computed (its graph included).
    pub compute_us: AtomicU64,
    /// Encoding and sending the requests.
    pub send_us: AtomicU64,
    /// The rest of the round trips, between the processes: the frames'
    /// way both ways (a ring and a wake-up, or the network and gRPC), and
    /// with two calls out (an overlapped step) a request queued behind the
    /// other or an answer waiting while the stage computes.
    pub transit_us: AtomicU64,
    /// Shared memory only (one clock on both ends): from each request sent,
    /// or the worker's previous answer if that came later, to the worker
    /// having it in hand: the request's latency, a ring and a wake-up.
    pub pickup_us: AtomicU64,
    /// Shared memory only: from each answer sent, or the stage starting to
    /// wait for it if that came later, to the stage having it.
    pub delivery_us: AtomicU64,
    /// The worker's time between having a request and computing it, and
    /// between the result and its encoded answer.
    pub handoff_us: AtomicU64,
    /// Of `compute_us`, the worker building and allocating the graphs.
    pub graph_us: AtomicU64,
}

/// One answered call as the caller saw it ([`monotonic_ns`] stamps, apart
/// from the two durations).
struct Answered {
    round_trip: Duration,
    send: Duration,
    /// Once the request was sent.
    sent_ns: u64,
    /// When the caller began waiting for the answer.
    waiting_ns: u64,
    /// When it had the answer.
    got_ns: u64,
}

impl CallTiming {
    /// Adds one answered call: the caller's view `a` and the worker's
    /// stamps from the reply. `same_clock`: both ends read one clock
    /// (shared memory), so each way's latency can be told apart.
    fn add(&self, call: &ExpertCall, a: &Answered, same_clock: bool) {
        let us = |d: Duration| d.as_micros() as u64;
        let add = |c: &AtomicU64, v: u64| c.fetch_add(v, Ordering::Relaxed);
        let ns_us = |from: u64, to: u64| to.saturating_sub(from) / 1000;
        let compute = call.compute_us;
        let handoff = ns_us(call.received_ns, call.replied_ns).saturating_sub(compute);
        // A worker that spins can take the request before this end stamps
        // its send (this thread lost its core in between, on a loaded
        // machine): that stretch is the worker's hand-off, so the send ends
        // at the worker's receipt, lest it be counted twice.
        let early = if same_clock && call.received_ns != 0 {
            ns_us(call.received_ns, a.sent_ns)
        } else {
            0
        };
        let send = us(a.send).saturating_sub(early);
        let transit = us(a.round_trip).saturating_sub(send + handoff + compute);
        add(&self.round_trip_us, us(a.round_trip));
        add(&self.compute_us, compute);
        add(&self.send_us, send);
        add(&self.transit_us, transit);
        add(&self.handoff_us, handoff);
        add(&self.graph_us, ns_us(call.started_ns, call.built_ns));
        if same_clock && call.received_ns != 0 {
            // Neither more than the transit: clocks read a few ns apart.
            let pickup = ns_us(a.sent_ns.max(call.idle_since_ns), call.received_ns);
            let delivery = ns_us(call.replied_ns.max(a.waiting_ns), a.got_ns);
            add(&self.pickup_us, pickup.min(transit));
            add(&self.delivery_us, delivery.min(transit));
        }
    }
}

impl ExpertLink {
    /// Opens a link to the expert worker `worker_id` at `grpc_addr`:
    /// shared memory when `choice` allows and the worker can open a ring of
    /// ours (made in `shm_dir`, `ring` bytes), else gRPC. Call it inside the
    /// runtime that will drive the gRPC stream.
    pub async fn connect(
        worker_id: &str,
        grpc_addr: &str,
        choice: TransportChoice,
        shm_dir: &Path,
        client: &str,
        ring: usize,
    ) -> Result<ExpertLink, ExpertLinkError> {
        let worker = format!("{worker_id} at {grpc_addr}");
        let grpc_err = |e: &dyn std::fmt::Display| LinkError::Grpc {
            addr: grpc_addr.to_string(),
            msg: e.to_string(),
        };
        let channel = crate::link::connect_channel(grpc_addr).await?;
        let mut client_rpc = ExpertsClient::new(channel)
            .max_encoding_message_size(256 << 20)
            .max_decoding_message_size(256 << 20);
        if choice != TransportChoice::Grpc {
            match open_shm(&mut client_rpc, shm_dir, client, ring).await {
                Ok((tx, rx, bell)) => {
                    return Ok(ExpertLink::new(worker, Kind::Shm { tx, rx, bell }));
                }
                Err(why) if choice == TransportChoice::Shm => {
                    return Err(LinkError::ShmUnavailable(format!(
                        "the expert worker {worker} is not reachable over shared memory: {why}"
                    ))
                    .into())
                }
                Err(why) => tracing::info!(
                    "shared memory to expert worker {worker} not usable ({why}); using gRPC"
                ),
            }
        }
        let (tx, rx) = tokio::sync::mpsc::channel::<Frame>(4);
        let (res_tx, res_rx) = crossbeam_channel::unbounded();
        let stream = tokio_stream::wrappers::ReceiverStream::new(rx);
        let mut replies = client_rpc
            .compute(stream)
            .await
            .map_err(|s| grpc_err(&format!("{} ({:?})", s.message(), s.code())))?
            .into_inner();
        tokio::spawn(async move {
            loop {
                match replies.message().await {
                    Ok(Some(f)) => {
                        if res_tx.send(Ok(f)).is_err() {
                            return;
                        }
                    }
                    Ok(None) => {
                        let _ = res_tx.send(Err("the stream was closed".into()));
                        return;
                    }
                    Err(s) => {
                        let _ = res_tx.send(Err(format!("{} ({:?})", s.message(), s.code())));
                        return;
                    }
                }
            }
        });
        Ok(ExpertLink::new(worker, Kind::Grpc { tx, rx: res_rx }))
    }

    fn new(worker: String, kind: Kind) -> ExpertLink {
        ExpertLink {
            worker,
            kind,
            next_id: 1,
            pending: Default::default(),
            stats: Arc::default(),
            timing: Arc::default(),
        }
    }

    /// How long a wait for an answer over shared memory spins before it
    /// sleeps ([`spin_for`]).
    pub fn set_spin(&mut self, spin: Duration) {
        if let Kind::Shm { rx, .. } = &mut self.kind {
            rx.set_spin(spin);
        }
    }

    /// "shm" or "grpc".
    pub fn kind(&self) -> &'static str {
        match self.kind {
            Kind::Shm { .. } => "shm",
            Kind::Grpc { .. } => "grpc",
        }
    }

    /// Sends one block's work (`invariant`: of a batch-invariant step).
    /// Blocking; not for async tasks.
    pub fn submit(
        &mut self,
        layer: u32,
        n_tokens: usize,
        x: &[f32],
        ids: &[i32],
        weights: &[f32],
        invariant: bool,
    ) -> Result<(), ExpertLinkError> {
        let protocol = |why: &str| ExpertLinkError::Protocol {
            worker: self.worker.clone(),
            why: why.to_string(),
        };
        if self.pending.len() >= MAX_OUTSTANDING {
            return Err(protocol(&format!(
                "submit with {MAX_OUTSTANDING} calls unanswered"
            )));
        }
        // The round trip starts before the request is encoded and sent:
        // taken after the send, the clock could start late, when waking the
        // worker cost this thread its core (two processes on two cores),
        // and the worker's compute would outlast the round trip around it.
        let started = Instant::now();
        let n_used = ids.len().checked_div(n_tokens).unwrap_or(0);
        let id = self.next_id;
        self.next_id += 1;
        let frame = ExpertRequest {
            id,
            layer,
            n_tokens,
            n_used,
            x,
            ids,
            weights,
            invariant,
        }
        .encode();
        let n = (frame.meta.len() + frame.payload.len()) as u64;
        // Stamped once the request is out of our hands and before the wake-up
        // (which may hand this thread's core to the worker at once): the
        // wake-up is the request's way, not its sending.
        let (sent_ns, send);
        match &mut self.kind {
            Kind::Shm { tx, bell, .. } => {
                tx.send(&frame.meta, &frame.payload, SEND_TIMEOUT)
                    .map_err(|e| match e {
                        ShmError::PeerClosed { .. } => ExpertLinkError::Gone {
                            worker: self.worker.clone(),
                            why: e.to_string(),
                        },
                        e => e.into(),
                    })?;
                (sent_ns, send) = (monotonic_ns(), started.elapsed());
                bell.ring();
            }
            Kind::Grpc { tx, rx } => {
                // Stamped before the hand-over to the stream task, which
                // wakes it: as with the bell above, the wake-up may take
                // this thread's core, and is the request's way.
                (sent_ns, send) = (monotonic_ns(), started.elapsed());
                if let Err(e) = tx.try_send(frame) {
                    // The stream task is gone: say why when it told us.
                    let why = rx
                        .try_recv()
                        .ok()
                        .and_then(Result::err)
                        .unwrap_or_else(|| e.to_string());
                    return Err(ExpertLinkError::Gone {
                        worker: self.worker.clone(),
                        why,
                    });
                }
            }
        }
        self.stats.frames_sent.fetch_add(1, Ordering::Relaxed);
        self.stats.bytes_sent.fetch_add(n, Ordering::Relaxed);
        self.pending.push_back(Pending {
            id,
            layer,
            n_tokens,
            started,
            sent_ns,
            send,
        });
        Ok(())
    }

    /// The answer to the oldest unanswered `submit`: `n_tokens × width`
    /// floats. Gives up after `timeout`, and as soon as the worker is seen
    /// gone.
    pub fn wait(&mut self, timeout: Duration) -> Result<Vec<f32>, ExpertLinkError> {
        let waiting_ns = monotonic_ns();
        let Some(p) = self.pending.pop_front() else {
            return Err(ExpertLinkError::Protocol {
                worker: self.worker.clone(),
                why: "wait without a submitted call".into(),
            });
        };
        let gone = |why: String| ExpertLinkError::Gone {
            worker: self.worker.clone(),
            why,
        };
        let frame = match &mut self.kind {
            Kind::Shm { rx, .. } => match rx.recv(timeout) {
                Ok(Some((meta, payload))) => Frame { meta, payload },
                Ok(None) => {
                    return Err(ExpertLinkError::Timeout {
                        worker: self.worker.clone(),
                        waited: timeout,
                    })
                }
                Err(e @ ShmError::PeerClosed { .. }) => return Err(gone(e.to_string())),
                Err(e) => return Err(e.into()),
            },
            Kind::Grpc { rx, .. } => match rx.recv_timeout(timeout) {
                Ok(Ok(f)) => f,
                Ok(Err(why)) => return Err(gone(why)),
                Err(crossbeam_channel::RecvTimeoutError::Timeout) => {
                    return Err(ExpertLinkError::Timeout {
                        worker: self.worker.clone(),
                        waited: timeout,
                    })
                }
                Err(crossbeam_channel::RecvTimeoutError::Disconnected) => {
                    return Err(gone("the reply stream ended".into()))
                }
            },
        };
        let got_ns = monotonic_ns();
        self.stats.frames_received.fetch_add(1, Ordering::Relaxed);
        self.stats.bytes_received.fetch_add(
            (frame.meta.len() + frame.payload.len()) as u64,
            Ordering::Relaxed,
        );
        let protocol = |why: String| ExpertLinkError::Protocol {
            worker: self.worker.clone(),
            why,
        };
        let call = ExpertCall::decode(frame.meta.as_slice())
            .map_err(|e| protocol(format!("undecodable reply header: {e}")))?;
        let answered = Answered {
            round_trip: p.started.elapsed(),
            send: p.send,
            sent_ns: p.sent_ns,
            waiting_ns,
            got_ns,
        };
        let same_clock = matches!(self.kind, Kind::Shm { .. });
        self.timing.add(&call, &answered, same_clock);
        let (id, layer, n_tokens) = (p.id, p.layer, p.n_tokens);
        if call.id != id || call.layer != layer {
            return Err(protocol(format!(
                "expected the reply to call {id} (layer {layer}), got call {} (layer {})",
                call.id, call.layer
            )));
        }
        if !call.error.is_empty() {
            return Err(ExpertLinkError::Remote {
                worker: self.worker.clone(),
                why: call.error,
            });
        }
        let out = f32s(&frame.payload);
        if n_tokens == 0 || !out.len().is_multiple_of(n_tokens) || frame.payload.len() % 4 != 0 {
            return Err(protocol(format!(
                "a reply of {} bytes is not {n_tokens} rows of f32",
                frame.payload.len()
            )));
        }
        Ok(out)
    }
}

/// Asks the worker to open a shared-memory session: our ring receives its
/// replies, its ring our requests, and its doorbell is rung after each.
async fn open_shm(
    rpc: &mut ExpertsClient<tonic::transport::Channel>,
    dir: &Path,
    client: &str,
    ring: usize,
) -> Result<(RingSender, RingReceiver, RingBell), String> {
    let name = format!(
        "omni-{client}-experts-{}-{}",
        std::process::id(),
        SESSION.fetch_add(1, Ordering::Relaxed)
    );
    let rx = RingReceiver::create(dir, &name, ring).map_err(|e| e.to_string())?;
    let reply = Endpoint {
        shm_path: rx.path().display().to_string(),
        shm_token: rx.token(),
        ..Default::default()
    };
    let r = rpc
        .open_shm(OpenShmRequest {
            client: client.to_string(),
            reply: Some(reply),
        })
        .await
        .map_err(|s| s.message().to_string())?
        .into_inner();
    let ep = r
        .requests
        .ok_or("the worker's answer names no request ring")?;
    let bell = r
        .doorbell
        .ok_or("the worker's answer names no doorbell (an older omni-cpu-worker?)")?;
    let bell =
        RingBell::open(Path::new(&bell.shm_path), bell.shm_token).map_err(|e| e.to_string())?;
    let tx = RingSender::open(Path::new(&ep.shm_path), ep.shm_token).map_err(|e| e.to_string())?;
    Ok((tx, rx, bell))
}

static SESSION: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// The worker's side of `OpenShm`: opens the caller's reply ring (failing,
/// with the reason, when this process cannot see it) and makes a request
/// ring of `capacity` bytes in `dir`. The caller serves the session by
/// reading requests from the receiver and answering on the sender.
pub fn accept_shm(
    reply: &Endpoint,
    dir: &Path,
    name: &str,
    capacity: usize,
) -> Result<(RingReceiver, RingSender, Endpoint), ShmError> {
    let tx = RingSender::open(Path::new(&reply.shm_path), reply.shm_token)?;
    let rx = RingReceiver::create(dir, name, capacity)?;
    let ep = Endpoint {
        shm_path: rx.path().display().to_string(),
        shm_token: rx.token(),
        ..Default::default()
    };
    Ok((rx, tx, ep))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_round_trip_and_bad_lengths_are_named() {
        let (x, ids, w) = (
            vec![1.5f32, -2.0, 3.25, 0.0],
            vec![3i32, 1],
            vec![0.75f32, 0.25],
        );
        let f = ExpertRequest {
            id: 7,
            layer: 2,
            n_tokens: 2,
            n_used: 1,
            x: &x,
            ids: &ids,
            weights: &w,
            invariant: true,
        }
        .encode();
        let d = decode_request(&f, 2).unwrap();
        assert_eq!((d.id, d.layer, d.n_tokens, d.n_used), (7, 2, 2, 1));
        assert!(d.invariant);
        assert_eq!((d.x, d.ids, d.weights), (x, ids, w));
        let e = decode_request(&f, 3).unwrap_err();
        assert!(
            e.contains("needs 40 payload bytes (width 3), got 32"),
            "{e}"
        );
        let bad = Frame {
            meta: vec![0xff, 0xff],
            payload: Vec::new(),
        };
        assert!(decode_request(&bad, 2).unwrap_err().contains("undecodable"));
    }
}
