//! GPU workers on a machine without a usable GPU (CI's, this project's):
//! asking for one is refused before the worker registers, with the reason a
//! user can act on, and never a crash. The GPU itself is checked by
//! `scripts/gpu-check` on a GPU machine.

use std::process::Command;
use std::time::{Duration, Instant};

use omni_tests::{free_port, target_bin};

/// Runs `omni-gpu-worker` with `args` against a coordinator address where
/// nothing listens; returns (exit code, stderr).
fn worker(args: &[&str]) -> (Option<i32>, String) {
    let t = Instant::now();
    let out = Command::new(target_bin("omni-gpu-worker"))
        .args(["--coordinator", &format!("127.0.0.1:{}", free_port())])
        .args(["--register-timeout", "5"])
        .args(args)
        .env("OMNI_LOG", "info")
        .output()
        .expect("the worker binary runs");
    assert!(
        t.elapsed() < Duration::from_secs(30),
        "a refusal is immediate"
    );
    (
        out.status.code(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

fn nvidia_driver_here() -> bool {
    [
        "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1",
        "/usr/lib64/libnvidia-ml.so.1",
    ]
    .iter()
    .any(|p| std::path::Path::new(p).exists())
}

#[test]
fn a_gpu_worker_without_a_gpu_says_why_and_exits() {
    let (code, log) = worker(&["--device", "cuda:0"]);
    assert_eq!(code, Some(1), "an error exit, not a signal: {log}");
    assert!(log.contains("device cuda:0"), "{log}");
    if nvidia_driver_here() {
        eprintln!("an NVIDIA driver is installed here; the reason is the driver's: {log}");
    } else {
        assert!(
            log.contains("NVML is not available") && log.contains("NVIDIA driver"),
            "{log}"
        );
    }
    assert!(!log.contains("panicked"), "{log}");
    // It never got as far as registering.
    assert!(!log.contains("registered"), "{log}");
}

#[test]
fn a_bad_device_name_is_refused_with_the_forms_that_work() {
    for bad in ["gpu", "cuda", "cuda:one", "cuda:-1"] {
        let (code, log) = worker(&["--device", bad]);
        assert_eq!(code, Some(1), "{bad}: {log}");
        assert!(
            log.contains("expected cpu, cuda:N or vulkan:N"),
            "{bad}: {log}"
        );
    }
}

/// The engine names what is missing for a GPU stage: without
/// `libggml-cuda.so` beside the binaries (CI's build) that the build has no
/// CUDA backend and how to build one; with it but no driver, the driver.
#[test]
fn a_stage_on_a_gpu_names_what_is_missing() {
    if nvidia_driver_here() {
        eprintln!("an NVIDIA driver is installed here: scripts/gpu-check is the check");
        return;
    }
    let lib = target_bin("omni-gpu-worker").with_file_name(omni_engine::GpuBackend::Cuda.library());
    let e = omni_engine::device::gpu_props(omni_engine::Device::Cuda(0))
        .unwrap_err()
        .to_string();
    if lib.exists() {
        assert!(
            e.contains("cannot load") && e.contains("NVIDIA driver"),
            "{e}"
        );
    } else {
        assert!(
            e.contains("no CUDA backend") && e.contains("scripts/build-cuda"),
            "{e}"
        );
    }
}
