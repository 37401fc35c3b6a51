//! The operator's experience (issue 24), as a user meets it: one notation
//! for layers and counts, one meaning for `-n 0`, a port in use named
//! before anything starts, the admin token kept in one place (never on a
//! command line), `top` without a terminal, addresses as URLs, and errors
//! that say which port is which.

use omni_tests::fixtures::{model, GEMMA};
use omni_tests::{free_port, target_bin, Supervised};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

fn omnictl(args: &[&str]) -> Command {
    let mut c = Command::new(target_bin("omnictl"));
    c.args(args)
        .env_remove("OMNI_ADMIN")
        .env_remove("OMNI_ADMIN_TOKEN")
        .env_remove("OMNI_ADMIN_TOKEN_FILE");
    c
}

fn run(mut c: Command) -> (bool, String, String) {
    let Output {
        status,
        stdout,
        stderr,
    } = c.output().expect("omnictl runs");
    (
        status.success(),
        String::from_utf8_lossy(&stdout).into_owned(),
        String::from_utf8_lossy(&stderr).into_owned(),
    )
}

/// Every address `up` listens on is checked before anything starts: one in
/// use fails at once, naming the flag that set it.
#[test]
fn up_names_the_flag_of_a_port_in_use_before_starting_anything() {
    let gemma = model(GEMMA);
    let gemma = gemma.to_str().unwrap();
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let busy = taken.local_addr().unwrap().to_string();
    let port = taken.local_addr().unwrap().port().to_string();
    let free = || format!("127.0.0.1:{}", free_port());
    for (flag, value) in [
        ("--listen", busy.clone()),
        ("--admin-listen", busy.clone()),
        ("--metrics", busy.clone()),
        ("--port", port.clone()),
    ] {
        let mut args = vec![
            "up".to_string(),
            "--model".into(),
            gemma.into(),
            "--listen".into(),
            free(),
            "--admin-listen".into(),
            free(),
            "--port".into(),
            free_port().to_string(),
        ];
        // The flag under test replaces its default.
        match args.iter().position(|a| a == flag) {
            Some(i) => args[i + 1] = value.clone(),
            None => args.extend([flag.to_string(), value.clone()]),
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let t0 = Instant::now();
        let (ok, _, err) = run(omnictl(&args));
        let took = t0.elapsed();
        assert!(!ok, "{flag} {value} in use: up must fail");
        assert!(
            err.contains(&format!(
                "{flag} {}",
                if flag == "--port" {
                    format!("127.0.0.1:{port}")
                } else {
                    value.clone()
                }
            )) && err.contains("in use"),
            "{flag}: {err}"
        );
        assert!(
            took < Duration::from_secs(2),
            "{flag}: failed after {took:?}, not at once"
        );
        assert!(!err.contains("[coordinator]"), "nothing started: {err}");
    }
}

/// `-n 0` means one thing on every path: refused, saying at least 1 (as the
/// API refuses `max_tokens: 0`); `--layers` where counts are meant points to
/// `--counts`; typos get clap's suggestion; flags a path ignores are refused.
#[test]
fn one_meaning_one_notation_and_errors_that_say_what_to_type() {
    let gemma = model(GEMMA);
    let gemma = gemma.to_str().unwrap();
    for args in [
        vec!["generate", "--model", gemma, "-p", "Hi", "-n", "0"],
        vec![
            "generate",
            "--coordinator",
            "127.0.0.1:1",
            "-p",
            "Hi",
            "-n",
            "0",
        ],
    ] {
        let (ok, _, err) = run(omnictl(&args));
        assert!(!ok && err.contains("at least 1"), "{args:?}: {err}");
    }
    let (ok, _, err) = run(omnictl(&["up", "--model", gemma, "--layers", "12,6"]));
    assert!(!ok && err.contains("--counts 12,6"), "{err}");
    let (ok, _, err) = run(omnictl(&[
        "plan",
        "--model",
        gemma,
        "--devices",
        "cpu:1GiB,cpu:1GiB",
        "--layers",
        "9,9",
    ]));
    assert!(!ok && err.contains("--counts 9,9"), "{err}");
    // Counts are --counts in plan as in rebalance, and a space after a
    // comma is not part of a device's name.
    let (ok, out, err) = run(omnictl(&[
        "plan",
        "--model",
        gemma,
        "--devices",
        "cpu:2GiB, cpu:2GiB",
        "--counts",
        "9,9",
        "--ctx",
        "512",
    ]));
    assert!(ok, "{err}");
    assert!(
        out.contains("embed + layers 0-8") && out.contains("layers 9-17 + head"),
        "one range notation in the plan: {out}"
    );
    let (ok, _, err) = run(omnictl(&["up", "--model", gemma, "--stage", "2"]));
    assert!(!ok && err.contains("--stages"), "a suggestion: {err}");
    let (ok, _, err) = run(omnictl(&[
        "generate",
        "--model",
        gemma,
        "--coordinator",
        "127.0.0.1:1",
        "-p",
        "Hi",
    ]));
    assert!(
        !ok && err.contains("--model"),
        "an ignored flag is refused: {err}"
    );
    // Secrets are refused on the command line, with what to do instead.
    let (ok, _, err) = run(omnictl(&["up", "--model", gemma, "--api-key", "sk-1"]));
    assert!(!ok && err.contains("--api-key-file"), "{err}");
    let (ok, _, err) = run(omnictl(&["workers", "--token", "t"]));
    assert!(!ok && err.contains("--token-file"), "{err}");
}

/// `omnictl up` with no token given makes one, in a file only the user can
/// read, that every admin verb finds; no process's command line shows it.
/// `top` without a terminal prints a frame; addresses may be URLs; the
/// wrong port is named as what it is.
#[test]
fn up_keeps_the_admin_token_in_one_place_and_the_admin_verbs_find_it() {
    let c = Supervised::start(
        &model(GEMMA),
        &[
            "--stages",
            "2",
            "--threads",
            "1",
            "--ctx",
            "256",
            "--seqs",
            "1",
        ],
        &[],
    );
    let state = c.state_dir().to_path_buf();
    let name: String = c
        .admin_addr
        .chars()
        .map(|ch| {
            if ch.is_ascii_alphanumeric() || ch == '.' {
                ch
            } else {
                '_'
            }
        })
        .collect();
    let file = state.join("omni").join(format!("admin-token-{name}"));
    let token = std::fs::read_to_string(&file)
        .unwrap_or_else(|e| panic!("{}: {e}\n{}", file.display(), c.proc.log_text()));
    let token = token.trim();
    assert_eq!(token.len(), 64, "a 256-bit token in hex");
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&file).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "only the user reads the token");
    // Said once the cluster is ready (a moment after the coordinator is).
    let said = |log: &str| log.contains(&file.display().to_string());
    let deadline = Instant::now() + Duration::from_secs(10);
    while !said(&c.proc.log_text()) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        said(&c.proc.log_text()),
        "up says where the token is:\n{}",
        c.proc.log_text()
    );
    // No process of the cluster has the token on its command line.
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        if let Ok(cmdline) = std::fs::read(e.path().join("cmdline")) {
            assert!(
                !String::from_utf8_lossy(&cmdline).contains(token),
                "the token is in the command line of pid {:?}",
                e.file_name()
            );
        }
    }

    let admin = |args: &[&str]| {
        let mut cmd = omnictl(args);
        cmd.env("XDG_STATE_HOME", &state);
        run(cmd)
    };
    // Found by address, as host:port or as a URL.
    let (ok, out, err) = admin(&["workers", "--admin", &c.admin_addr]);
    assert!(ok && out.contains("w1"), "{err}");
    let url = format!("http://{}/", c.admin_addr);
    let (ok, _, err) = admin(&["workers", "--admin", &url]);
    assert!(ok, "a URL: {err}");
    // `plan` with no model asks the cluster at OMNI_ADMIN, as workers does.
    let mut cmd = omnictl(&["plan"]);
    cmd.env("XDG_STATE_HOME", &state)
        .env("OMNI_ADMIN", &c.admin_addr);
    let (ok, out, err) = run(cmd);
    assert!(ok && out.contains("embed + layers 0-"), "{err}{out}");
    // Without the file: which variable or flag to set.
    let (ok, _, err) = run(omnictl(&["workers", "--admin", &c.admin_addr]));
    assert!(
        !ok && err.contains("OMNI_ADMIN_TOKEN") && err.contains("--token-file"),
        "{err}"
    );

    // `top` whose output is not a terminal prints one frame and exits 0.
    let (ok, out, err) = admin(&["top", "--admin", &c.admin_addr, "--interval", "0.2"]);
    assert!(ok, "top without a terminal: {err}");
    assert!(out.contains("worker") && out.contains("w0"), "{out}");
    assert!(
        !out.contains('\u{1b}'),
        "no escape codes in a pipe: {out:?}"
    );

    // The wrong port for the verb is named as what it is.
    let (ok, _, err) = admin(&["workers", "--admin", &c.addr]);
    assert!(
        !ok && err.contains("Inference") && err.contains("--admin-listen"),
        "{err}"
    );
    let (ok, _, err) = run(omnictl(&[
        "generate",
        "--coordinator",
        &c.admin_addr,
        "-p",
        "Hi",
        "-n",
        "2",
    ]));
    assert!(!ok && err.contains("admin API"), "{err}");
    let url = format!("http://{}", c.addr);
    let (ok, out, err) = run(omnictl(&[
        "generate",
        "--coordinator",
        &url,
        "-p",
        "Hi",
        "-n",
        "2",
    ]));
    assert!(
        ok && !out.trim().is_empty(),
        "a URL for --coordinator: {err}"
    );
    // The coordinator itself refuses max_tokens 0 as the router and
    // omnictl do (absent: until the context is full).
    let mut req = omni_tests::greedy(&[2, 9259], 1);
    req.max_tokens = Some(0);
    let refused = c.rt.block_on(async {
        use omni_proto::coordinator::v1::inference_client::InferenceClient;
        let mut client = InferenceClient::connect(format!("http://{}", c.addr))
            .await
            .unwrap();
        client.generate(req).await.err()
    });
    let refused = refused.expect("max_tokens 0 is refused");
    assert!(refused.message().contains("at least 1"), "{refused:?}");
}
