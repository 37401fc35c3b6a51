//! End-to-end (issue 42): a rolling restart of every process of a cluster
//! under a steady load of streams, as an upgrade does it (docs/operating.md,
//! "Upgrading"), fails no request. `omnictl up` with its router, Gemma 3
//! 270M in 2 stages; three clients stream completions back to back
//! (retrying only what never reached the router, as the OpenAI SDKs do)
//! while each worker is drained, restarted (SIGTERM; `up` starts it again)
//! and undrained, then the coordinator is restarted (its requests resumed),
//! then the router (it finishes its streams first). Prints the longest
//! pause a stream saw in each step.

use omni_tests::fixtures::{model, GEMMA};
use omni_tests::{http, omnictl_admin, short_prompts, sse_completion, Supervised, NOT_CONNECTED};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const TOKEN: &str = "upgrade-test-admin-token";
const CLIENTS: usize = 3;

/// What the clients saw: every chunk's time, and the requests that failed.
#[derive(Default)]
struct Seen {
    times: Vec<Vec<Instant>>,
    failed: Vec<String>,
    done: usize,
}

/// One client: completions back to back until `stop`.
fn client(router: String, prompt: Vec<u32>, stop: Arc<AtomicBool>, seen: Arc<Mutex<Seen>>) {
    let body = format!(
        r#"{{"model": "default", "prompt": {prompt:?}, "max_tokens": 24, "ignore_eos": true, "temperature": 0, "stream": true}}"#
    );
    while !stop.load(Ordering::Relaxed) {
        let mut tries = 0;
        let r = loop {
            match sse_completion(&router, &body) {
                Err(e) if e.starts_with(NOT_CONNECTED) && tries < 100 => {
                    tries += 1;
                    std::thread::sleep(Duration::from_millis(100));
                }
                r => break r,
            }
        };
        let mut s = seen.lock().unwrap();
        match r {
            Ok(a) => {
                s.times.push(a.times);
                s.done += 1;
            }
            Err(e) => s.failed.push(e),
        }
    }
}

/// Waits until `ok()` holds (panics with `what` and the log after 120 s).
fn wait(up: &Supervised, what: &str, ok: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(120);
    while !ok() {
        assert!(Instant::now() < deadline, "{what}\n{}", up.proc.log_text());
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn signal(pid: i32, sig: &str) {
    assert!(std::process::Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .is_ok_and(|s| s.success()));
}

#[test]
fn a_rolling_restart_of_every_process_under_load_fails_no_request() {
    let up = Supervised::serving(
        &model(GEMMA),
        &[
            "--stages",
            "2",
            "--transport",
            "shm",
            "--ctx",
            "512",
            "--threads",
            "1",
        ],
        &[("OMNI_ADMIN_TOKEN", TOKEN)],
    );
    let router = up.router.clone().unwrap();
    let prompts = short_prompts("real_gemma3_270m.json", CLIENTS);
    let stop = Arc::new(AtomicBool::new(false));
    let seen = Arc::new(Mutex::new(Seen::default()));
    let clients: Vec<_> = prompts
        .into_iter()
        .map(|p| {
            let (r, stop, seen) = (router.clone(), stop.clone(), seen.clone());
            std::thread::spawn(move || client(r, p, stop, seen))
        })
        .collect();
    let admin = |args: &[&str]| {
        let (ok, out, err) = omnictl_admin(&up.admin_addr, Some(TOKEN), args);
        assert!(ok, "omnictl {args:?}: {out}{err}\n{}", up.proc.log_text());
    };
    let loaded = || up.statuses().iter().all(|s| s.loaded) && up.info().is_ok_and(|i| i.ready);
    let mut steps: Vec<(String, Instant, Instant)> = Vec::new();
    wait(&up, "the clients got no answer", || {
        seen.lock().unwrap().done >= CLIENTS
    });

    for w in ["w0", "w1"] {
        let t = Instant::now();
        admin(&["drain", w]);
        let old = up.signal(w, "-TERM");
        wait(&up, &format!("{w} was not started again"), || {
            up.pid_of(w).is_some_and(|p| p != old)
        });
        // Back in once the supervisor's new process has registered.
        let last = std::cell::RefCell::new(String::new());
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let (ok, out, err) = omnictl_admin(&up.admin_addr, Some(TOKEN), &["undrain", w]);
            if ok {
                break;
            }
            *last.borrow_mut() = format!("{out}{err}");
            assert!(
                Instant::now() < deadline,
                "{w} could not be undrained: {}\n{}",
                last.borrow(),
                up.proc.log_text()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        wait(&up, "the cluster did not serve after the undrain", loaded);
        steps.push((format!("{w}: drain, restart, undrain"), t, Instant::now()));
    }

    let t = Instant::now();
    let before = up.info().expect("info").instance;
    let pid = up.child_pid("omni-coordinator").expect("the coordinator");
    signal(pid, "-TERM");
    wait(&up, "no new coordinator served", || {
        up.info().is_ok_and(|i| i.ready && i.instance != before)
    });
    steps.push(("coordinator: restart".into(), t, Instant::now()));
    // A stream or two more on the new coordinator before the router goes.
    let n = seen.lock().unwrap().done;
    wait(&up, "no answer after the coordinator's restart", || {
        seen.lock().unwrap().done >= n + CLIENTS
    });

    let t = Instant::now();
    let pid = up.child_pid("omni-router").expect("the router");
    signal(pid, "-TERM");
    wait(&up, "the router was not started again", || {
        // The new router's process may not listen yet: refused until it does.
        up.child_pid("omni-router").is_some_and(|p| p != pid)
            && std::net::TcpStream::connect(&router).is_ok()
            && http(&router, "GET", "/ready", &[], b"").0 == 200
    });
    steps.push(("router: restart".into(), t, Instant::now()));
    let n = seen.lock().unwrap().done;
    wait(&up, "no answer after the router's restart", || {
        seen.lock().unwrap().done >= n + CLIENTS
    });

    stop.store(true, Ordering::Relaxed);
    for c in clients {
        c.join().unwrap();
    }
    let seen = seen.lock().unwrap();
    assert!(
        seen.failed.is_empty(),
        "{} of {} requests failed in the rolling restart: {:?}\n{}",
        seen.failed.len(),
        seen.failed.len() + seen.done,
        seen.failed,
        up.proc.log_text()
    );
    println!(
        "rolling restart under load: {} requests, none failed",
        seen.done
    );
    for (what, from, to) in &steps {
        // The longest wait between two chunks of a stream that overlaps the step.
        let pause = seen
            .times
            .iter()
            .flat_map(|t| t.windows(2))
            .filter(|w| w[1] > *from && w[0] < *to)
            .map(|w| w[1] - w[0])
            .max()
            .unwrap_or_default();
        println!(
            "  {what}: took {:.1} s, longest pause a stream saw {:.2} s",
            (*to - *from).as_secs_f64(),
            pause.as_secs_f64()
        );
    }
}
