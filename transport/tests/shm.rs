//! The shared-memory ring, exercised the way a pipeline stage uses it: real
//! files in /dev/shm, real threads, and real child processes (this test binary
//! re-run with a role in `OMNI_SHM_TEST_ROLE`).

use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use omni_transport::shm::{RingReceiver, RingSender, ShmError, ShmFrame, HEADER_BYTES};

const ROLE: &str = "OMNI_SHM_TEST_ROLE";
const LONG: Duration = Duration::from_secs(20);

fn dir() -> &'static Path {
    Path::new("/dev/shm")
}

fn unique(tag: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    format!(
        "omni-shm-test-{}-{tag}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// splitmix64: deterministic, so sender and receiver agree on every frame
/// without sharing anything but the index.
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

fn bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(len + 8);
    let mut s = seed;
    while out.len() < len {
        s = mix(s);
        out.extend_from_slice(&s.to_le_bytes());
    }
    out.truncate(len);
    out
}

/// Frame `i` for a ring of `capacity` bytes: empty parts, odd sizes, sizes
/// that wrap often, and frames that fill the ring exactly.
fn frame(i: u64, capacity: usize) -> (Vec<u8>, Vec<u8>) {
    let r = mix(i ^ 0x5eed);
    let (meta_len, payload_len) = match r % 20 {
        0 => (0, 0),
        1 => (0, (r >> 8) as usize % 64),
        2 => ((r >> 8) as usize % 64, 0),
        3 => {
            // 8-byte record header + meta + payload == capacity: the whole ring.
            let m = (r >> 8) as usize % 200;
            (m, capacity - 8 - m)
        }
        4 => (7, capacity - 8 - 7 - (r >> 8) as usize % 100),
        5..=9 => ((r >> 8) as usize % 300, (r >> 20) as usize % (capacity / 2)),
        _ => ((r >> 8) as usize % 150, (r >> 20) as usize % 5000),
    };
    (bytes(i * 2 + 1, meta_len), bytes(i * 2 + 2, payload_len))
}

fn send_frames(tx: &mut RingSender, range: std::ops::Range<u64>) {
    let cap = tx.capacity();
    for i in range {
        let (m, p) = frame(i, cap);
        tx.send(&m, &p, LONG)
            .unwrap_or_else(|e| panic!("send of frame {i}: {e}"));
    }
}

fn recv_frames(rx: &mut RingReceiver, range: std::ops::Range<u64>) {
    let cap = rx.capacity();
    for i in range {
        let got = rx
            .recv(LONG)
            .unwrap_or_else(|e| panic!("recv of frame {i}: {e}"))
            .unwrap_or_else(|| panic!("frame {i} did not arrive within {LONG:?}"));
        let (m, p) = frame(i, cap);
        assert_eq!(got.0.len(), m.len(), "meta length of frame {i}");
        assert_eq!(got.1.len(), p.len(), "payload length of frame {i}");
        assert!(got.0 == m, "meta bytes of frame {i} differ");
        assert!(got.1 == p, "payload bytes of frame {i} differ");
    }
}

fn is_peer_closed(r: &Result<Option<ShmFrame>, ShmError>) -> bool {
    matches!(r, Err(ShmError::PeerClosed { .. }))
}

/// Runs this test binary again as a child in `role`; see `child_process_entry`.
fn spawn_child(role: &str) -> std::process::Child {
    Command::new(std::env::current_exe().unwrap())
        .args([
            "child_process_entry",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(ROLE, role)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Does nothing in a normal run; in a child process it plays the role its
/// parent test asked for.
#[test]
fn child_process_entry() {
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    let parts: Vec<&str> = role.split('|').collect();
    match parts[..] {
        ["send", path, token, n] => {
            let mut tx = RingSender::open(Path::new(path), token.parse().unwrap()).unwrap();
            send_frames(&mut tx, 0..n.parse().unwrap());
        }
        ["send-then-die", path, token, n] => {
            let mut tx = RingSender::open(Path::new(path), token.parse().unwrap()).unwrap();
            send_frames(&mut tx, 0..n.parse().unwrap());
            // Exit without dropping the sender, as a crash would.
            std::process::exit(0);
        }
        ["own", dir, name] => {
            let rx = RingReceiver::create(Path::new(dir), name, 4096).unwrap();
            println!("RING|{}|{}", rx.path().display(), rx.token());
            std::io::stdout().flush().unwrap();
            std::thread::sleep(Duration::from_secs(60));
        }
        _ => panic!("unknown role {role:?}"),
    }
}

#[test]
fn types_are_send() {
    fn send<T: Send>() {}
    send::<RingReceiver>();
    send::<RingSender>();
}

#[test]
fn many_sizes_arrive_intact_and_in_order_across_threads() {
    // One run where both sides spin, one where they always sleep on the
    // futex: the second hammers the doorbell protocol (a lost wakeup would
    // stall a frame for the full 20 s timeout and fail the test).
    for spin in [None, Some(Duration::ZERO)] {
        let mut rx = RingReceiver::create(dir(), &unique("many"), 64 << 10).unwrap();
        let mut tx = RingSender::open(rx.path(), rx.token()).unwrap();
        if let Some(s) = spin {
            rx.set_spin(s);
            tx.set_spin(s);
        }
        const N: u64 = 20_000;
        let sender = std::thread::spawn(move || send_frames(&mut tx, 0..N));
        recv_frames(&mut rx, 0..N);
        sender.join().unwrap();
        assert!(is_peer_closed(&rx.recv(LONG)));
    }
}

#[test]
fn frame_filling_the_ring_exactly_arrives_after_a_wrap() {
    let mut rx = RingReceiver::create(dir(), &unique("exact"), 4096).unwrap();
    let mut tx = RingSender::open(rx.path(), rx.token()).unwrap();
    let full = (bytes(1, 13), bytes(2, 4096 - 8 - 13));
    // A full-ring frame at a non-zero offset needs the receiver to pass the
    // wrap marker first, so it must be reading concurrently.
    let sender = std::thread::spawn(move || {
        for _ in 0..50 {
            tx.send(b"x", b"yz", LONG).unwrap();
            tx.send(&bytes(1, 13), &bytes(2, 4096 - 8 - 13), LONG)
                .unwrap();
        }
    });
    for _ in 0..50 {
        assert_eq!(
            rx.recv(LONG).unwrap().unwrap(),
            (b"x".to_vec(), b"yz".to_vec())
        );
        assert!(rx.recv(LONG).unwrap().unwrap() == full);
    }
    sender.join().unwrap();
}

#[test]
fn frames_cross_two_processes() {
    let mut rx = RingReceiver::create(dir(), &unique("xproc"), 256 << 10).unwrap();
    const N: u64 = 5_000;
    let mut child = spawn_child(&format!("send|{}|{}|{N}", rx.path().display(), rx.token()));
    recv_frames(&mut rx, 0..N);
    assert!(is_peer_closed(&rx.recv(LONG)));
    assert!(child.wait().unwrap().success());
}

#[test]
fn sender_process_that_dies_without_closing_is_noticed() {
    let mut rx = RingReceiver::create(dir(), &unique("diesend"), 256 << 10).unwrap();
    let mut child = spawn_child(&format!(
        "send-then-die|{}|{}|5",
        rx.path().display(),
        rx.token()
    ));
    // Reap it, or its pid would still exist as a zombie.
    assert!(child.wait().unwrap().success());
    recv_frames(&mut rx, 0..5);
    let t = Instant::now();
    let r = rx.recv(Duration::from_secs(5));
    assert!(is_peer_closed(&r), "{r:?}");
    assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
}

#[test]
fn receiver_process_that_dies_is_noticed_and_its_file_replaced() {
    let name = unique("dierecv");
    let mut child = spawn_child(&format!("own|{}|{name}", dir().display()));
    // libtest may print "test child_process_entry ... " on the same line.
    let mut line = String::new();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    while !line.contains("RING|") {
        line.clear();
        assert!(out.read_line(&mut line).unwrap() > 0, "child exited early");
    }
    let at = line.find("RING|").unwrap();
    let parts: Vec<&str> = line[at..].trim().split('|').collect();
    let path = PathBuf::from(parts[1]);
    let mut tx = RingSender::open(&path, parts[2].parse().unwrap()).unwrap();
    while tx.send(b"", &[7; 1000], Duration::ZERO).is_ok() {}
    child.kill().unwrap();
    child.wait().unwrap();

    let t = Instant::now();
    let e = tx
        .send(b"", &[7; 1000], Duration::from_secs(5))
        .unwrap_err();
    assert!(matches!(e, ShmError::PeerClosed { .. }), "{e}");
    assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());

    // The killed owner could not unlink its file; a new owner takes the name.
    assert!(path.exists());
    let rx = RingReceiver::create(dir(), &name, 4096).unwrap();
    assert_eq!(rx.path(), path);
}

#[test]
fn recv_times_out_with_none() {
    let mut rx = RingReceiver::create(dir(), &unique("idle"), 4096).unwrap();
    let _tx = RingSender::open(rx.path(), rx.token()).unwrap();
    let t = Instant::now();
    assert!(rx.recv(Duration::from_millis(50)).unwrap().is_none());
    let waited = t.elapsed();
    assert!(waited >= Duration::from_millis(50), "{waited:?}");
    assert!(waited < Duration::from_millis(500), "{waited:?}");
    assert!(rx.recv(Duration::ZERO).unwrap().is_none());
}

#[test]
fn dropping_the_sender_closes_the_ring_after_its_frames_are_read() {
    let mut rx = RingReceiver::create(dir(), &unique("sdrop"), 4096).unwrap();
    let mut tx = RingSender::open(rx.path(), rx.token()).unwrap();
    for i in 0..3u8 {
        tx.send(&[i], &[i; 100], LONG).unwrap();
    }
    drop(tx);
    for i in 0..3u8 {
        assert_eq!(rx.recv(LONG).unwrap().unwrap(), (vec![i], vec![i; 100]));
    }
    let t = Instant::now();
    assert!(is_peer_closed(&rx.recv(LONG)));
    assert!(t.elapsed() < Duration::from_millis(100));

    // A receiver asleep in recv wakes when the sender drops.
    let mut rx = RingReceiver::create(dir(), &unique("sdrop2"), 4096).unwrap();
    let tx = RingSender::open(rx.path(), rx.token()).unwrap();
    let waiter = std::thread::spawn(move || {
        let t = Instant::now();
        (rx.recv(LONG), t.elapsed())
    });
    std::thread::sleep(Duration::from_millis(100));
    drop(tx);
    let (r, waited) = waiter.join().unwrap();
    assert!(is_peer_closed(&r), "{r:?}");
    assert!(waited < Duration::from_secs(1), "{waited:?}");
}

#[test]
fn dropping_the_receiver_fails_a_blocked_sender_and_removes_the_file() {
    let rx = RingReceiver::create(dir(), &unique("rdrop"), 4096).unwrap();
    let path = rx.path().to_path_buf();
    assert!(path.exists());
    let mut tx = RingSender::open(&path, rx.token()).unwrap();
    while tx.send(b"m", &[1; 500], Duration::ZERO).is_ok() {}
    let blocked = std::thread::spawn(move || {
        let t = Instant::now();
        let r = tx.send(b"m", &[1; 500], LONG);
        (r, t.elapsed(), tx)
    });
    std::thread::sleep(Duration::from_millis(100));
    drop(rx);
    assert!(!path.exists(), "{} still exists", path.display());
    let (r, waited, mut tx) = blocked.join().unwrap();
    assert!(matches!(r, Err(ShmError::PeerClosed { .. })), "{r:?}");
    assert!(waited < Duration::from_secs(1), "{waited:?}");
    // Later sends fail at once, even though there is no need to wait.
    let e = tx.send(b"", b"", LONG).unwrap_err();
    assert!(matches!(e, ShmError::PeerClosed { .. }), "{e}");
    assert!(e.to_string().contains(&*path.to_string_lossy()), "{e}");
}

#[test]
fn full_ring_without_a_reader_times_out_at_the_deadline() {
    let rx = RingReceiver::create(dir(), &unique("full"), 4096).unwrap();
    let mut tx = RingSender::open(rx.path(), rx.token()).unwrap();
    let mut sent = 0;
    while tx.send(b"", &[0; 1000], Duration::ZERO).is_ok() {
        sent += 1;
    }
    assert_eq!(sent, 4, "1008-byte frames in a 4096-byte ring");
    let t = Instant::now();
    let e = tx
        .send(b"", &[0; 1000], Duration::from_millis(200))
        .unwrap_err();
    let waited = t.elapsed();
    assert!(matches!(e, ShmError::Timeout { .. }), "{e}");
    assert!(waited >= Duration::from_millis(200), "{waited:?}");
    assert!(waited < Duration::from_millis(700), "{waited:?}");
    assert!(e.to_string().contains(&*rx.path().to_string_lossy()), "{e}");
}

#[test]
fn frame_too_large_for_the_ring_is_refused_and_the_ring_still_works() {
    let mut rx = RingReceiver::create(dir(), &unique("large"), 4096).unwrap();
    let mut tx = RingSender::open(rx.path(), rx.token()).unwrap();
    let e = tx.send(b"", &vec![0; 5 << 20], LONG).unwrap_err();
    assert!(matches!(e, ShmError::FrameTooLarge { .. }), "{e}");
    let msg = e.to_string();
    assert!(msg.contains("cannot fit"), "{msg}");
    assert!(msg.contains(&*rx.path().to_string_lossy()), "{msg}");
    assert!(msg.contains("of 4096 bytes"), "{msg}");
    // One byte over the ring (8-byte record header + 4089) is refused at once...
    let t = Instant::now();
    let e = tx.send(b"", &[0; 4089], LONG).unwrap_err();
    assert!(matches!(e, ShmError::FrameTooLarge { .. }), "{e}");
    assert!(t.elapsed() < Duration::from_millis(100));
    // ...and exactly the ring fits.
    tx.send(b"", &[9; 4088], LONG).unwrap();
    assert_eq!(rx.recv(LONG).unwrap().unwrap().1, vec![9; 4088]);
}

#[test]
fn open_explains_what_is_wrong() {
    let rx = RingReceiver::create(dir(), &unique("open"), 4096).unwrap();
    let path = rx.path().to_path_buf();
    let shown = path.to_string_lossy().into_owned();

    let e = RingSender::open(&path, rx.token() ^ 1).err().unwrap();
    assert!(matches!(e, ShmError::TokenMismatch { .. }), "{e}");
    assert!(e.to_string().contains(&shown), "{e}");

    let missing = dir().join(unique("missing"));
    let e = RingSender::open(&missing, 1).err().unwrap();
    match &e {
        ShmError::Io { source, .. } => assert_eq!(source.kind(), std::io::ErrorKind::NotFound),
        other => panic!("expected an I/O error, got {other}"),
    }
    assert!(e.to_string().contains(&*missing.to_string_lossy()), "{e}");

    let garbage = dir().join(unique("garbage"));
    std::fs::write(&garbage, vec![0xab; 2 * HEADER_BYTES]).unwrap();
    let e = RingSender::open(&garbage, 1).err().unwrap();
    assert!(matches!(e, ShmError::NotARing { .. }), "{e}");
    assert!(
        e.to_string().contains("not an omni shared-memory ring"),
        "{e}"
    );
    std::fs::write(&garbage, b"short").unwrap();
    let e = RingSender::open(&garbage, 1).err().unwrap();
    assert!(matches!(e, ShmError::NotARing { .. }), "{e}");
    std::fs::remove_file(&garbage).unwrap();

    let _first = RingSender::open(&path, rx.token()).unwrap();
    let e = RingSender::open(&path, rx.token()).err().unwrap();
    assert!(matches!(e, ShmError::AlreadyAttached { .. }), "{e}");

    // A live owner's name is not taken over.
    let name = path.file_name().unwrap().to_str().unwrap();
    let e = RingReceiver::create(dir(), name, 4096).err().unwrap();
    assert!(matches!(e, ShmError::Io { .. }), "{e}");
    let e = RingReceiver::create(dir(), "a/b", 4096).err().unwrap();
    assert!(matches!(e, ShmError::Invalid { .. }), "{e}");
    let e = RingReceiver::create(dir(), &unique("tiny"), 8)
        .err()
        .unwrap();
    assert!(matches!(e, ShmError::Invalid { .. }), "{e}");

    let other = RingReceiver::create(dir(), &unique("other"), 4096).unwrap();
    assert_ne!(other.token(), rx.token());
}

#[test]
fn corrupt_frame_lengths_are_an_error_not_a_crash() {
    let mut rx = RingReceiver::create(dir(), &unique("corrupt"), 4096).unwrap();
    let mut tx = RingSender::open(rx.path(), rx.token()).unwrap();
    tx.send(b"meta", b"payload", LONG).unwrap();
    // Another process scribbles over the record header: meta_len = 2^31.
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(rx.path())
        .unwrap();
    f.write_all_at(&0x8000_0000u32.to_le_bytes(), HEADER_BYTES as u64)
        .unwrap();
    let r = rx.recv(LONG);
    assert!(matches!(r, Err(ShmError::Corrupt { .. })), "{r:?}");
}

#[test]
fn receiver_drop_removes_the_file() {
    let rx = RingReceiver::create(dir(), &unique("unlink"), 1 << 20).unwrap();
    let path = rx.path().to_path_buf();
    assert_eq!(
        std::fs::metadata(&path).unwrap().len(),
        (HEADER_BYTES + (1 << 20)) as u64
    );
    drop(rx);
    assert!(!path.exists());
}

/// One thread reading several rings sleeps on a doorbell ring of its own
/// (which carries no frames): senders on the other rings, each in a thread
/// of its own with a bell opened by the doorbell's path and token, ring it
/// after every frame, and the reader wakes for each and reads every ring in
/// order; `ready` tells a ring with a frame (or a closed sender) from one
/// without. A bell with the wrong token is refused as a sender would be.
#[test]
fn a_doorbell_wakes_one_reader_of_several_rings() {
    use omni_transport::shm::{Received, RingBell};
    let mut doorbell = RingReceiver::create(dir(), &unique("doorbell"), 64).unwrap();
    let e = RingBell::open(doorbell.path(), doorbell.token() ^ 1)
        .err()
        .unwrap();
    assert!(matches!(e, ShmError::TokenMismatch { .. }), "{e}");
    const SENDERS: usize = 3;
    const FRAMES: u64 = 200;
    const CAP: usize = 1 << 16;
    let mut rings: Vec<RingReceiver> = (0..SENDERS)
        .map(|i| RingReceiver::create(dir(), &unique(&format!("session{i}")), CAP).unwrap())
        .collect();
    assert!(rings.iter().all(|r| !r.ready()));
    let senders: Vec<_> = rings
        .iter()
        .map(|r| {
            let mut tx = RingSender::open(r.path(), r.token()).unwrap();
            let bell = RingBell::open(doorbell.path(), doorbell.token()).unwrap();
            std::thread::spawn(move || {
                for i in 0..FRAMES {
                    let (meta, payload) = frame(i, CAP);
                    tx.send(&meta, &payload, LONG).unwrap();
                    bell.ring();
                    // Now and then long enough for the reader to fall asleep.
                    if i % 50 == 0 {
                        std::thread::sleep(Duration::from_millis(5));
                    }
                }
            })
        })
        .collect();
    let mut next = [0u64; SENDERS];
    let (mut meta, mut payload) = (Vec::new(), Vec::new());
    let deadline = Instant::now() + LONG;
    while next.iter().any(|&n| n < FRAMES) {
        assert!(Instant::now() < deadline, "frames stopped at {next:?}");
        for (i, rx) in rings.iter_mut().enumerate() {
            // Ready may be a wrap marker whose frame is not yet written.
            if next[i] < FRAMES
                && rx.ready()
                && rx
                    .recv_into(&mut meta, &mut payload, Duration::ZERO)
                    .unwrap()
            {
                assert_eq!((meta.clone(), payload.clone()), frame(next[i], CAP));
                next[i] += 1;
            }
        }
        let mut any = || rings.iter().any(|r| r.ready());
        let r = doorbell
            .recv_unless(&mut meta, &mut payload, LONG, &mut any)
            .unwrap();
        assert_ne!(r, Received::Frame, "nothing sends on the doorbell itself");
    }
    for s in senders {
        s.join().unwrap();
    }
    // Each sender has dropped its end: its ring is ready, and reads closed.
    for rx in &mut rings {
        assert!(rx.ready());
        let r = rx.recv(Duration::ZERO);
        assert!(is_peer_closed(&r), "{r:?}");
    }
}
