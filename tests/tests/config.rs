//! One configuration chain for every service, as an operator meets it:
//! `omni.toml` with a table per service, `OMNI_<SERVICE>_<KEY>` variables
//! over it, flags over both, and `print-config` to see the result (with
//! where each setting came from, secrets masked). The real binaries.

use std::path::Path;
use std::process::Command;

/// `BIN print-config ARGS` with only `env` of the OMNI_ variables set.
fn print_config(name: &str, args: &[&str], env: &[(&str, &str)]) -> (bool, String, String) {
    let mut cmd = Command::new(omni_tests::target_bin(name));
    cmd.arg("print-config").args(args);
    for (k, _) in std::env::vars() {
        if k.starts_with("OMNI_") {
            cmd.env_remove(k);
        }
    }
    cmd.envs(env.iter().copied());
    let out = cmd.output().expect("the service binary runs");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn write(dir: &Path, text: &str) -> String {
    let p = dir.join("omni.toml");
    std::fs::write(&p, text).unwrap();
    p.display().to_string()
}

/// One file for the cluster: each service reads its own table.
const FILE: &str = r#"
[coordinator]
ctx = 2048
seqs = 4
listen = "0.0.0.0:9070"
admin_token = "hunter2"

[worker]
threads = 3
device = "cpu"
listen = "0.0.0.0:50051"

[cpu_worker]
threads = 5
listen = "0.0.0.0:50061"

[router]
listen = "0.0.0.0:8081"

[[router.models]]
name = "gemma"
coordinator = "127.0.0.1:9070"
"#;

#[test]
fn every_service_reads_its_table_then_its_variables_then_its_flags() {
    let dir = tempfile::tempdir().unwrap();
    let file = write(dir.path(), FILE);
    // (binary, table, a setting from the file, one from a variable over
    // the file, one from a flag over both)
    let cases = [
        (
            "omni-coordinator",
            "[coordinator]",
            ("listen", "\"0.0.0.0:9070\""),
            ("OMNI_COORDINATOR_CTX", "ctx", "1024"),
            ("--seqs", "seqs", "2"),
        ),
        (
            "omni-gpu-worker",
            "[worker]",
            ("listen", "\"0.0.0.0:50051\""),
            ("OMNI_WORKER_THREADS", "threads", "2"),
            ("--device", "device", "\"cpu\""),
        ),
        (
            "omni-cpu-worker",
            "[cpu_worker]",
            ("listen", "\"0.0.0.0:50061\""),
            ("OMNI_CPU_WORKER_THREADS", "threads", "4"),
            ("--listen", "listen", "\"127.0.0.1:1\""),
        ),
        (
            "omni-router",
            "[router]",
            ("listen", "\"0.0.0.0:8081\""),
            ("OMNI_ROUTER_MAX_IN_FLIGHT", "max_in_flight", "9"),
            ("--body-limit", "body_limit", "4096"),
        ),
    ];
    for (
        name,
        table,
        (file_key, file_value),
        (var, var_key, var_value),
        (flag, flag_key, flag_value),
    ) in cases
    {
        let raw_flag_value = flag_value.trim_matches('"');
        let (ok, out, err) = print_config(
            name,
            &["--config", &file, flag, raw_flag_value],
            &[(var, var_value)],
        );
        assert!(ok, "{name}: {err}");
        assert!(out.starts_with(&format!("{table}\n")), "{name}: {out}");
        assert!(
            out.contains(&format!("{var_key} = {var_value}  # ${var}")),
            "{name}: {out}"
        );
        assert!(
            out.contains(&format!("{flag_key} = {flag_value}  # flag")),
            "{name}: {out}"
        );
        if file_key != flag_key {
            assert!(
                out.contains(&format!("{file_key} = {file_value}  # {file}")),
                "{name}: {out}"
            );
        }
        // What it prints is the service's table of a config file.
        let back: toml_table::Table = out.parse().unwrap_or_else(|e| panic!("{name}: {e}\n{out}"));
        assert!(back.contains_key(table.trim_matches(['[', ']'])), "{name}");
    }
    // Secrets are masked.
    let (ok, out, _) = print_config("omni-coordinator", &["--config", &file], &[]);
    assert!(ok);
    assert!(out.contains("admin_token = \"***\""), "{out}");
    assert!(!out.contains("hunter2"), "{out}");
    // The router's models come from the file's tables, or from specs that
    // replace them.
    let (ok, out, err) = print_config("omni-router", &["--config", &file], &[]);
    assert!(ok, "{err}");
    assert!(
        out.contains("[[router.models]]") && out.contains("coordinator = \"127.0.0.1:9070\""),
        "{out}"
    );
    let (ok, out, err) = print_config(
        "omni-router",
        &["--config", &file],
        &[("OMNI_ROUTER_MODEL", "qwen=127.0.0.1:7071")],
    );
    assert!(ok, "{err}");
    assert!(
        out.contains("model = \"qwen=127.0.0.1:7071\"  # $OMNI_ROUTER_MODEL")
            && !out.contains("[[router.models]]"),
        "{out}"
    );
}

#[test]
fn an_unknown_key_or_variable_is_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    for (name, table, key, near) in [
        ("omni-coordinator", "coordinator", "ctxx", "ctx"),
        ("omni-gpu-worker", "worker", "thread", "threads"),
        ("omni-cpu-worker", "cpu_worker", "lisen", "listen"),
        ("omni-router", "router", "max_inflight", "max_in_flight"),
    ] {
        let file = write(dir.path(), &format!("[{table}]\n{key} = 1\n"));
        let (ok, _, err) = print_config(name, &["--config", &file], &[]);
        assert!(!ok, "{name} took an unknown key");
        assert!(
            err.contains(&format!(
                "[{table}] has no setting `{key}` (did you mean `{near}`?)"
            )),
            "{name}: {err}"
        );
    }
    let (ok, _, err) = print_config("omni-coordinator", &[], &[("OMNI_COORDINATOR_SEQZ", "2")]);
    assert!(!ok);
    assert!(
        err.contains("OMNI_COORDINATOR_SEQZ is not a setting")
            && err.contains("OMNI_COORDINATOR_SEQS"),
        "{err}"
    );
    // A value the setting cannot take is refused as the flag would be.
    let file = write(dir.path(), "[coordinator]\nctx = \"big\"\n");
    let (ok, _, err) = print_config("omni-coordinator", &["--config", &file], &[]);
    assert!(!ok);
    assert!(err.contains("--ctx") && err.contains("big"), "{err}");
}

/// A TOML table, parsed by hand to keep the test crate's dependencies as
/// they are: `[table]` headers and `key = value` lines are all print-config
/// writes.
mod toml_table {
    pub struct Table(Vec<String>);
    impl Table {
        pub fn contains_key(&self, k: &str) -> bool {
            self.0.iter().any(|t| t == k)
        }
    }
    impl std::str::FromStr for Table {
        type Err = String;
        fn from_str(s: &str) -> Result<Table, String> {
            let mut tables = Vec::new();
            for line in s.lines() {
                let line = line.trim();
                if line.is_empty() || line.starts_with('#') {
                    continue;
                }
                if let Some(t) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
                    tables.push(t.to_string());
                } else if !line.contains(" = ") {
                    return Err(format!("not a TOML line: {line}"));
                }
            }
            Ok(Table(tables))
        }
    }
}
