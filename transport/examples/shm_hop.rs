//! Measures hops through the shared-memory ring between two threads.
//!
//! `cargo run --release -p omni-transport --example shm_hop [frames] [payload_bytes]`
//!
//! * ping-pong: a frame goes to an echo thread and back through a second ring;
//!   one-way latency is reported as round trip / 2. Both sides are spinning,
//!   as in a busy decode loop.
//! * paced one-way: a frame every millisecond, so the receiver has gone to
//!   sleep on the futex before each one; the latency includes the wake-up.
//!   Sender and receiver compare one monotonic clock.
//! * throughput with 4 MiB frames.

use std::path::Path;
use std::time::{Duration, Instant};

use omni_transport::shm::{RingReceiver, RingSender};

const T: Duration = Duration::from_secs(10);

fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * p).round() as usize]
}

fn pair(tag: &str, capacity: usize) -> (RingReceiver, RingSender) {
    let name = format!("omni-shm-hop-{}-{tag}", std::process::id());
    let rx = RingReceiver::create(Path::new("/dev/shm"), &name, capacity).unwrap();
    let tx = RingSender::open(rx.path(), rx.token()).unwrap();
    (rx, tx)
}

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().unwrap())
        .collect();
    let frames = args.first().copied().unwrap_or(20_000);
    let payload_len = args.get(1).copied().unwrap_or(4096);
    let meta = [0u8; 100];
    let payload = vec![1u8; payload_len];

    // Ping-pong.
    let (mut a_rx, mut a_tx) = pair("ping", 1 << 20);
    let (mut b_rx, mut b_tx) = pair("pong", 1 << 20);
    let echo = std::thread::spawn(move || {
        let (mut m, mut p) = (Vec::new(), Vec::new());
        while let Ok(true) = a_rx.recv_into(&mut m, &mut p, T) {
            b_tx.send(&m, &p, T).unwrap();
        }
    });
    let (mut m, mut p) = (Vec::new(), Vec::new());
    let mut hops = Vec::with_capacity(frames);
    for i in 0..frames + 1000 {
        let t = Instant::now();
        a_tx.send(&meta, &payload, T).unwrap();
        assert!(b_rx.recv_into(&mut m, &mut p, T).unwrap());
        if i >= 1000 {
            hops.push(t.elapsed().as_secs_f64() * 1e6 / 2.0);
        }
    }
    drop(a_tx);
    echo.join().unwrap();
    println!(
        "ping-pong, {payload_len} B payload + 100 B meta, {frames} frames: one-way (RTT/2) p50 {:.1} us, p99 {:.1} us",
        pct(&mut hops, 0.5),
        pct(&mut hops, 0.99)
    );

    // Paced one-way: the receiver sleeps on the futex between frames.
    let paced = (frames / 10).clamp(100, 2000);
    let (mut rx, mut tx) = pair("paced", 1 << 20);
    let base = Instant::now();
    let sender = std::thread::spawn(move || {
        let mut meta = [0u8; 100];
        for _ in 0..paced {
            std::thread::sleep(Duration::from_millis(1));
            meta[..16].copy_from_slice(&base.elapsed().as_nanos().to_le_bytes());
            tx.send(&meta, &payload, T).unwrap();
        }
    });
    let mut hops = Vec::with_capacity(paced);
    while let Ok(true) = rx.recv_into(&mut m, &mut p, T) {
        let sent = u128::from_le_bytes(m[..16].try_into().unwrap());
        hops.push((base.elapsed().as_nanos() - sent) as f64 / 1e3);
    }
    sender.join().unwrap();
    println!(
        "paced one-way (1 frame/ms, receiver asleep on the futex), {paced} frames: p50 {:.1} us, p99 {:.1} us",
        pct(&mut hops, 0.5),
        pct(&mut hops, 0.99)
    );

    // Throughput with large frames.
    let big = vec![3u8; 4 << 20];
    let n = 300;
    let (mut rx, mut tx) = pair("big", 16 << 20);
    let t = Instant::now();
    let sender = std::thread::spawn(move || {
        for _ in 0..n {
            tx.send(&meta, &big, T).unwrap();
        }
    });
    let mut got = 0usize;
    while let Ok(true) = rx.recv_into(&mut m, &mut p, T) {
        got += p.len();
    }
    sender.join().unwrap();
    let s = t.elapsed().as_secs_f64();
    println!(
        "throughput, {n} frames of 4 MiB through a 16 MiB ring: {:.2} GB/s ({:.0} us per frame)",
        got as f64 / s / 1e9,
        s * 1e6 / n as f64
    );
}
