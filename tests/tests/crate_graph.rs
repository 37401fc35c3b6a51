//! The crate graph keeps its shape: services (the crates with a binary) use
//! libraries, never each other, and the router and the planner build without
//! llama.cpp (the planner is what `omnictl plan` and the coordinator share;
//! linking the scheduler or ggml into it is what this test exists to stop).

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::Command;

fn workspace() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ is in the workspace")
        .to_path_buf()
}

fn cargo(args: &[&str]) -> String {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(&cargo)
        .args(args)
        .current_dir(workspace())
        .output()
        .unwrap_or_else(|e| panic!("{cargo} {args:?}: {e}"));
    assert!(
        out.status.success(),
        "{cargo} {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("cargo prints UTF-8")
}

/// Per workspace member: whether it has a binary, and the workspace members
/// it depends on for its own build (normal and build dependencies; tests and
/// benchmarks may use anything).
fn members() -> BTreeMap<String, (bool, BTreeSet<String>)> {
    let meta: serde_json::Value = serde_json::from_str(&cargo(&[
        "metadata",
        "--format-version",
        "1",
        "--no-deps",
        "--locked",
    ]))
    .expect("cargo metadata is JSON");
    let packages = meta["packages"].as_array().expect("packages");
    let names: BTreeSet<String> = packages
        .iter()
        .map(|p| p["name"].as_str().expect("name").to_string())
        .collect();
    packages
        .iter()
        .map(|p| {
            let has_bin = p["targets"].as_array().expect("targets").iter().any(|t| {
                t["kind"]
                    .as_array()
                    .expect("kind")
                    .iter()
                    .any(|k| k == "bin")
            });
            let deps = p["dependencies"]
                .as_array()
                .expect("dependencies")
                .iter()
                .filter(|d| d["kind"] != "dev")
                .map(|d| d["name"].as_str().expect("dependency name").to_string())
                .filter(|d| names.contains(d))
                .collect();
            (
                p["name"].as_str().expect("name").to_string(),
                (has_bin, deps),
            )
        })
        .collect()
}

/// The packages `cargo build -p krate` would build: `cargo tree` resolves
/// features for the one package, as that build would (cargo metadata only
/// gives the whole workspace's union, where the engine always has ggml).
fn builds_of(krate: &str) -> BTreeSet<String> {
    cargo(&[
        "tree",
        "--locked",
        "-p",
        krate,
        "-e",
        "normal,build",
        "--prefix",
        "none",
        "-f",
        "{p}",
    ])
    .lines()
    .filter_map(|l| l.split_whitespace().next())
    .map(str::to_string)
    .collect()
}

#[test]
fn no_service_crate_depends_on_another() {
    let members = members();
    let services: BTreeSet<&String> = members
        .iter()
        .filter(|(_, (bin, _))| *bin)
        .map(|(n, _)| n)
        .collect();
    for expected in [
        "omni-coordinator",
        "omni-gpu-worker",
        "omni-cpu-worker",
        "omni-router",
        "omnictl",
    ] {
        assert!(
            services.iter().any(|s| *s == expected),
            "{expected} has no binary? services: {services:?}"
        );
    }
    let mut wrong = Vec::new();
    for s in &services {
        for d in &members[*s].1 {
            if services.contains(d) {
                wrong.push(format!("{s} depends on {d}"));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "services must share code through library crates (the planner, the engine, proto, transport, telemetry), not depend on each other: {}",
        wrong.join("; ")
    );
}

#[test]
fn the_router_and_the_planner_do_not_link_llama_cpp() {
    for krate in ["omni-router", "omni-planner"] {
        let built = builds_of(krate);
        assert!(built.contains(krate), "cargo tree -p {krate}: {built:?}");
        assert!(
            !built.contains("llama-cpp-sys-2"),
            "{krate} builds llama-cpp-sys-2: {built:?}"
        );
    }
    // The check can fail: omnictl runs models in-process, so it does link it.
    assert!(builds_of("omnictl").contains("llama-cpp-sys-2"));
}

#[test]
fn omnictl_uses_the_planner_not_the_coordinator() {
    let members = members();
    let omnictl = &members["omnictl"].1;
    assert!(omnictl.contains("omni-planner"), "{omnictl:?}");
    assert!(!omnictl.contains("omni-coordinator"), "{omnictl:?}");
}

/// Every file with `unsafe` code is one ARCHITECTURE.md names, and each block
/// says why it is sound.
#[test]
fn unsafe_lives_only_where_architecture_md_says() {
    const ALLOWED: &[&str] = &[
        "engine/src/ffi/",
        "engine/src/gguf/mod.rs",
        "engine/src/stage/weights.rs",
        "transport/src/shm/",
        "cpu-worker/src/numa.rs",
        "telemetry/src/crash.rs",
        "omnictl/src/main.rs",
        "proto/build.rs",
        "tests/src/hosts.rs",
    ];
    let root = workspace();
    let arch = std::fs::read_to_string(root.join("ARCHITECTURE.md")).unwrap();
    for a in ALLOWED {
        assert!(
            arch.contains(a.trim_end_matches('/')),
            "ARCHITECTURE.md does not name {a}"
        );
    }
    let files = rust_files(&root);
    assert!(files.len() > 50, "found only {} Rust files", files.len());
    let mut wrong = Vec::new();
    for f in files {
        let rel = f
            .strip_prefix(&root)
            .unwrap()
            .to_string_lossy()
            .replace('\\', "/");
        let text = std::fs::read_to_string(&f).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        for (i, line) in lines.iter().enumerate() {
            let code = line.split("//").next().unwrap_or("");
            let is_unsafe = ["unsafe {", "unsafe fn", "unsafe impl", "unsafe extern"]
                .iter()
                .any(|k| code.contains(k));
            if !is_unsafe || rel == "tests/tests/crate_graph.rs" {
                continue;
            }
            if !ALLOWED.iter().any(|a| rel.starts_with(a)) {
                wrong.push(format!("{rel}:{}", i + 1));
            }
            // A block says why (an `unsafe fn`/`impl` may say it in its docs).
            let said = lines[i.saturating_sub(8)..=i]
                .iter()
                .any(|l| l.contains("SAFETY") || l.contains("# Safety"));
            if code.contains("unsafe {") && !said {
                wrong.push(format!("{rel}:{} has no SAFETY line", i + 1));
            }
        }
    }
    assert!(wrong.is_empty(), "unsafe outside its places: {wrong:?}");
}

/// Every Rust file of the workspace (not `target/`, not `fuzz/`).
fn rust_files(root: &std::path::Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    let mut dirs = vec![root.to_path_buf()];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            let name = e.file_name().to_string_lossy().to_string();
            if p.is_dir() {
                if !name.starts_with('.') && name != "target" && name != "fuzz" {
                    dirs.push(p);
                }
            } else if name.ends_with(".rs") {
                files.push(p);
            }
        }
    }
    files
}

/// Every gRPC channel and listener of the services and omnictl is made by
/// `omni_transport::tls` (issue 41): one that dials or serves on its own
/// would be plaintext in a cluster that requires mutual TLS.
#[test]
fn every_grpc_connection_goes_through_omni_transport_tls() {
    const SERVICES: &[&str] = &[
        "coordinator/src/",
        "gpu-worker/src/",
        "cpu-worker/src/",
        "router/src/",
        "runtime/src/",
        "omnictl/src/",
        "transport/src/",
    ];
    let root = workspace();
    let mut wrong = Vec::new();
    for f in rust_files(&root) {
        let rel = f
            .strip_prefix(&root)
            .unwrap()
            .to_string_lossy()
            .replace('\\', "/");
        if !SERVICES.iter().any(|s| rel.starts_with(s)) || rel == "transport/src/tls.rs" {
            continue;
        }
        let text = std::fs::read_to_string(&f).unwrap();
        for (i, line) in text.lines().enumerate() {
            let code = line.split("//").next().unwrap_or("");
            if [
                "Endpoint::from",
                "Server::builder(",
                "Client::connect(",
                "TcpListenerStream",
            ]
            .iter()
            .any(|k| code.contains(k))
            {
                wrong.push(format!("{rel}:{}: {}", i + 1, line.trim()));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "gRPC connections made outside omni_transport::tls: {wrong:#?}"
    );
}
