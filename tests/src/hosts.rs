//! Hosts for the tests that cross a network (issue 41): two network
//! namespaces joined by a veth link, each with a `/dev/shm` of its own
//! that its processes share (so the transport's automatic choice takes
//! shared memory within a host and gRPC between them, as between real
//! machines);
//! the test process (and a router) stay in the root namespace, linked to
//! host A.
//!
//! ```text
//!   root ns (tests, router) ── 10.N.1.0/24 ── host A ── 10.N.2.0/24 ── host B
//! ```
//!
//! Needs root and iproute2 (`ip`, `tc`); `Hosts::make` says which is missing.
//! The link can be limited (`tc tbf`) and cut without a word to either end
//! (`tc`'s blackhole: no FIN, no RST, as a pulled cable).

use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

/// Two hosts, A and B, and the root namespace linked to A.
pub struct Hosts {
    pub a: String,
    pub b: String,
    n: u32,
}

/// Runs `ip`/`tc` with `args`, panicking with its output when it fails.
fn run(args: &[&str]) {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", args[0]));
    assert!(
        out.status.success(),
        "{} failed: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `ip netns exec NS ARGS`.
fn in_ns(ns: &str, args: &[&str]) {
    let mut v = vec!["ip", "netns", "exec", ns];
    v.extend_from_slice(args);
    run(&v);
}

impl Hosts {
    /// Makes the namespaces and links. Panics naming what is missing when
    /// this machine cannot (not root, no iproute2).
    pub fn make() -> Hosts {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let root = std::fs::read_to_string("/proc/self/status")
            .unwrap_or_default()
            .lines()
            .any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(2) == Some("0"));
        assert!(
            root,
            "the multi-host tests make network namespaces, which needs root"
        );
        sweep_stale();
        let k = NEXT.fetch_add(1, Ordering::Relaxed);
        let pid = std::process::id();
        // A subnet of its own per Hosts of this run.
        let n = 100 + (pid + k * 7) % 150;
        let (a, b) = (format!("omnit-{pid}-{k}-a"), format!("omnit-{pid}-{k}-b"));
        for ns in [&a, &b] {
            run(&["ip", "netns", "add", ns]);
            std::fs::create_dir_all(Self::shm(ns)).expect("a host's /dev/shm");
        }
        let hosts = Hosts {
            a: a.clone(),
            b: b.clone(),
            n,
        };
        let root_if = format!("omr{}x{k}", pid % 100_000);
        run(&[
            "ip", "link", "add", &root_if, "type", "veth", "peer", "name", "up0", "netns", &a,
        ]);
        run(&[
            "ip", "link", "add", "name", "ab0", "netns", &a, "type", "veth", "peer", "name", "ba0",
            "netns", &b,
        ]);
        run(&[
            "ip",
            "addr",
            "add",
            &format!("10.{n}.1.1/24"),
            "dev",
            &root_if,
        ]);
        run(&["ip", "link", "set", &root_if, "up"]);
        for (ns, ifs) in [
            (&a, vec![("up0", 1, 2), ("ab0", 2, 1)]),
            (&b, vec![("ba0", 2, 2)]),
        ] {
            in_ns(ns, &["ip", "link", "set", "lo", "up"]);
            for (dev, net, host) in ifs {
                in_ns(
                    ns,
                    &[
                        "ip",
                        "addr",
                        "add",
                        &format!("10.{n}.{net}.{host}/24"),
                        "dev",
                        dev,
                    ],
                );
                in_ns(ns, &["ip", "link", "set", dev, "up"]);
            }
        }
        hosts
    }

    /// Host A's address on the link to the root namespace (the router's and
    /// the tests' way in).
    pub fn a_from_root(&self) -> String {
        format!("10.{}.1.2", self.n)
    }

    /// Host A's address on the A-B link.
    pub fn a_addr(&self) -> String {
        format!("10.{}.2.1", self.n)
    }

    /// Host B's address on the A-B link.
    pub fn b_addr(&self) -> String {
        format!("10.{}.2.2", self.n)
    }

    /// The folder host `ns`'s processes see as `/dev/shm`.
    fn shm(ns: &str) -> std::path::PathBuf {
        std::env::temp_dir().join(format!("{ns}-shm"))
    }

    /// `bin ARGS...` as a process of host `ns`, seeing the host's own
    /// `/dev/shm`. Its pid is the program's (every wrapper execs).
    pub fn command(&self, ns: &str, bin: &std::path::Path) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", ns, "unshare", "--mount", "sh", "-c"])
            .arg(r#"mount --bind "$0" /dev/shm && exec "$@""#)
            .arg(Self::shm(ns))
            .arg(bin);
        c
    }

    /// Limits the A-B link to `rate` (tc's units, e.g. `1gbit`) each way.
    pub fn limit(&self, rate: &str) {
        for (ns, dev) in [(&self.a, "ab0"), (&self.b, "ba0")] {
            in_ns(
                ns,
                &[
                    "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst",
                    "1mb", "latency", "100ms",
                ],
            );
        }
    }

    /// Cuts the A-B link silently: every packet either way is dropped
    /// (as a pulled cable: neither end hears a word). The `blackhole`
    /// qdisc on both ends (netem and prio are missing from this kernel).
    pub fn cut(&self) {
        for (ns, dev) in [(&self.a, "ab0"), (&self.b, "ba0")] {
            in_ns(
                ns,
                &["tc", "qdisc", "replace", "dev", dev, "root", "blackhole"],
            );
        }
    }
}

/// A TCP proxy inside a host that holds every byte, each way, for a fixed
/// delay before passing it on: the link's latency, which `tc netem` would
/// add but this kernel lacks. Order is kept; the bandwidth is the link's.
/// Stops (and drops its connections) when dropped.
pub struct DelayProxy {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Hosts {
    /// A [`DelayProxy`] in host `ns`, listening on `listen` (ADDR:PORT) and
    /// passing each connection on to `target`, `one_way` late each way.
    pub fn delay_proxy(
        &self,
        ns: &str,
        listen: &str,
        target: &str,
        one_way: Duration,
    ) -> DelayProxy {
        let (stop, stopped) = tokio::sync::oneshot::channel();
        let (ready_tx, ready) = std::sync::mpsc::channel();
        let (ns_path, listen, target) = (
            format!("/var/run/netns/{ns}"),
            listen.to_string(),
            target.to_string(),
        );
        let thread = std::thread::spawn(move || {
            // This thread (and only it) moves into the host's network
            // namespace, so the sockets it opens are the host's.
            let ns = std::fs::File::open(&ns_path).unwrap_or_else(|e| panic!("{ns_path}: {e}"));
            // SAFETY: setns on an open namespace file; it changes this
            // thread's network namespace and nothing else.
            let r =
                unsafe { libc::setns(std::os::fd::AsRawFd::as_raw_fd(&ns), libc::CLONE_NEWNET) };
            assert_eq!(r, 0, "setns {ns_path}: {}", std::io::Error::last_os_error());
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a runtime");
            rt.block_on(async move {
                let l = tokio::net::TcpListener::bind(&listen)
                    .await
                    .unwrap_or_else(|e| panic!("the delay proxy cannot listen on {listen}: {e}"));
                let _ = ready_tx.send(());
                let accept = async {
                    while let Ok((inbound, _)) = l.accept().await {
                        let target = target.clone();
                        tokio::spawn(async move {
                            let Ok(outbound) = tokio::net::TcpStream::connect(&target).await else {
                                return;
                            };
                            for s in [&inbound, &outbound] {
                                let _ = s.set_nodelay(true);
                            }
                            let (ir, iw) = inbound.into_split();
                            let (or, ow) = outbound.into_split();
                            tokio::join!(late(ir, ow, one_way), late(or, iw, one_way));
                        });
                    }
                };
                tokio::select! {
                    _ = accept => {}
                    _ = stopped => {}
                }
            });
        });
        ready
            .recv_timeout(Duration::from_secs(10))
            .expect("the delay proxy did not start");
        DelayProxy {
            stop: Some(stop),
            thread: Some(thread),
        }
    }
}

/// Copies `from` to `to`, each chunk `delay` after it arrived (a reader
/// stamps chunks, a writer waits for each stamp: reading never waits).
async fn late(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    delay: Duration,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(tokio::time::Instant, Vec<u8>)>();
    let read = async move {
        let mut buf = vec![0u8; 64 * 1024];
        while let Ok(n @ 1..) = from.read(&mut buf).await {
            if tx
                .send((tokio::time::Instant::now() + delay, buf[..n].to_vec()))
                .is_err()
            {
                break;
            }
        }
    };
    let write = async move {
        while let Some((at, bytes)) = rx.recv().await {
            tokio::time::sleep_until(at).await;
            if to.write_all(&bytes).await.is_err() {
                return;
            }
        }
        let _ = to.shutdown().await;
    };
    tokio::join!(read, write);
}

impl Drop for DelayProxy {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Hosts {
    /// Deleting a namespace deletes its links, and with them their root ends.
    fn drop(&mut self) {
        for ns in [&self.a, &self.b] {
            let _ = Command::new("ip").args(["netns", "del", ns]).output();
            let _ = std::fs::remove_dir_all(Self::shm(ns));
        }
    }
}

/// Removes the namespaces of test runs that died without cleaning up.
fn sweep_stale() {
    let Ok(out) = Command::new("ip").args(["netns", "list"]).output() else {
        return;
    };
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let name = line.split_whitespace().next().unwrap_or("");
        let Some(rest) = name.strip_prefix("omnit-") else {
            continue;
        };
        let pid: i32 = rest
            .split('-')
            .next()
            .and_then(|p| p.parse().ok())
            .unwrap_or(0);
        if pid > 0 && !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            let _ = Command::new("ip").args(["netns", "del", name]).output();
            let _ = std::fs::remove_dir_all(Hosts::shm(name));
        }
    }
}
