//! The inbox as a stage uses it: one thread reads the frames of the
//! shared-memory ring and of the gRPC sink (a real server on a real socket),
//! and waits on the ring's doorbell itself, which everything else that
//! should wake it rings too.

use std::path::Path;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use omni_transport::{Frame, Inbox, Next, Outbox, TransportChoice};

/// Far longer than any wake-up: a reader that returns well before it was
/// woken; one that was not would sit out the whole of it.
const LONG: Duration = Duration::from_secs(60);
const SOON: Duration = Duration::from_secs(20);

fn unique(tag: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    format!(
        "omni-inbox-test-{}-{tag}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

fn frame(i: u32) -> Frame {
    Frame {
        meta: i.to_le_bytes().to_vec(),
        payload: vec![i as u8; 1000 + i as usize],
    }
}

/// An inbox with a ring, its gRPC sink served on a local port, and the
/// runtime that serves it.
struct Served {
    inbox: Inbox,
    addr: String,
    rt: tokio::runtime::Runtime,
}

fn served(ring: bool) -> Served {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let mut inbox = Inbox::new();
    if ring {
        inbox
            .add_ring(Path::new("/dev/shm"), &unique("ring"), 1 << 16)
            .unwrap();
    }
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    rt.spawn(
        tonic::transport::Server::builder()
            .add_service(inbox.sink_service())
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    Served { inbox, addr, rt }
}

impl Served {
    fn outbox(&self, choice: TransportChoice) -> Outbox {
        let ep = self.inbox.endpoint(&self.addr, &omni_transport::host_id());
        let _guard = self.rt.enter();
        self.rt.block_on(Outbox::connect(&ep, choice)).unwrap()
    }
}

#[test]
fn one_reader_gets_the_frames_of_the_ring_and_of_grpc_each_in_order() {
    let s = served(true);
    let mut shm = s.outbox(TransportChoice::Shm);
    let mut grpc = s.outbox(TransportChoice::Grpc);
    assert_eq!((shm.kind(), grpc.kind()), ("shm", "grpc"));
    let reader = s.inbox.reader();
    let got = std::thread::spawn(move || {
        (0..100)
            .map(|_| reader.recv(SOON).expect("every frame arrives"))
            .collect::<Vec<_>>()
    });
    for i in 0..50 {
        shm.send(frame(i)).unwrap();
        grpc.send(frame(1000 + i)).unwrap();
    }
    let got = got.join().unwrap();
    let ids: Vec<u32> = got
        .iter()
        .map(|f| u32::from_le_bytes(f.meta[..4].try_into().unwrap()))
        .collect();
    let over = |lo: u32| {
        ids.iter()
            .copied()
            .filter(move |&i| (lo..lo + 50).contains(&i))
    };
    assert!(over(0).eq(0..50), "ring frames out of order: {ids:?}");
    assert!(
        over(1000).eq(1000..1050),
        "gRPC frames out of order: {ids:?}"
    );
    for (f, &i) in got.iter().zip(&ids) {
        assert_eq!(*f, frame(i), "frame {i} changed on the way");
    }
    assert_eq!(s.inbox.stats.frames_received.load(Ordering::Relaxed), 100);
}

/// Starts a reader waiting for `LONG` with `woken` as its other work, runs
/// `wake` once it waits, and returns what it got and how long it waited.
fn wait_then(
    s: &Served,
    wake: impl FnOnce(),
    woken: impl FnMut() -> bool + Send + 'static,
) -> (&'static str, Duration) {
    let reader = s.inbox.reader();
    let t = std::thread::spawn(move || {
        let mut woken = woken;
        let start = Instant::now();
        let what = match reader.next(LONG, &mut woken) {
            Next::Frame(_) => "frame",
            Next::Woken => "woken",
            Next::TimedOut => "timed out",
        };
        (what, start.elapsed())
    });
    // Long enough that the reader is asleep on the futex, past its spin.
    std::thread::sleep(Duration::from_millis(200));
    wake();
    t.join().unwrap()
}

#[test]
fn a_bell_channel_wakes_a_reader_asleep_on_the_ring_or_without_one() {
    for ring in [true, false] {
        let s = served(ring);
        let (tx, rx) = s.inbox.bell().channel::<u32>();
        let (what, waited) = wait_then(&s, || tx.send(7).unwrap(), move || !rx.is_empty());
        assert_eq!(what, "woken", "ring: {ring}");
        assert!(waited < SOON, "ring: {ring}: woken only after {waited:?}");
    }
}

#[test]
fn a_grpc_frame_wakes_a_reader_asleep_on_the_ring() {
    let s = served(true);
    let mut grpc = s.outbox(TransportChoice::Grpc);
    let (what, waited) = wait_then(&s, || grpc.send(frame(1)).unwrap(), || false);
    assert_eq!(what, "frame");
    assert!(waited < SOON, "the frame came after {waited:?}");
}

#[test]
fn a_ring_added_while_the_reader_waits_on_the_old_one_is_read() {
    let mut s = served(true);
    let reader = s.inbox.reader();
    let t = std::thread::spawn(move || reader.recv(LONG));
    std::thread::sleep(Duration::from_millis(200));
    let started = Instant::now();
    s.inbox
        .add_ring(Path::new("/dev/shm"), &unique("again"), 1 << 16)
        .unwrap();
    let mut shm = s.outbox(TransportChoice::Shm);
    shm.send(frame(5)).unwrap();
    assert_eq!(t.join().unwrap(), Some(frame(5)));
    assert!(started.elapsed() < SOON);
}

#[test]
fn dropping_the_inbox_removes_its_ring() {
    let s = served(true);
    let path = s.inbox.endpoint("x", "y").shm_path;
    assert!(Path::new(&path).exists());
    let reader = s.inbox.reader();
    drop(s);
    assert!(!Path::new(&path).exists(), "{path} is still there");
    assert!(reader.recv(Duration::from_millis(50)).is_none());
}
