//! Our ggml build computes real matmuls correctly: quantized weights through
//! the same kernels the models use (repacked and plain), against a plain
//! Rust reference on random data, with the CPU variant chosen for this
//! machine and with every other variant it runs. A variant built with a
//! wrong flag, or chosen for a CPU that lacks its instructions, fails here.

mod common;

use omni_engine::GgmlType;

fn random(n: usize, seed: &mut u64) -> Vec<f32> {
    (0..n)
        .map(|_| {
            *seed ^= *seed << 13;
            *seed ^= *seed >> 7;
            *seed ^= *seed << 17;
            (*seed % 20001) as f32 / 10000.0 - 1.0
        })
        .collect()
}

fn check(ty: GgmlType, repack: bool, n: usize) {
    let (rows, k) = (64, 512);
    let mut seed = 0x1234_5678_9abc_def0 ^ ty.id() as u64;
    let w = random(rows * k, &mut seed);
    let x = random(n * k, &mut seed);
    let (ours, reference) =
        omni_engine::ggml_matmul_check(ty, &w, &x, rows, k, repack).expect("CPU backend");
    assert_eq!(ours.len(), reference.len());
    let rms = (reference.iter().map(|v| v * v).sum::<f32>() / reference.len() as f32).sqrt();
    let worst = ours
        .iter()
        .zip(&reference)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    // Activations are quantized to 8 bits inside the kernel: ~1% of the output scale.
    assert!(
        worst < 0.03 * rms,
        "{ty:?} (repack {repack}, {n} rows): max error {worst} vs output rms {rms}"
    );
}

#[test]
fn quantized_matmuls_match_a_plain_reference() {
    let cpu = omni_engine::cpu_backend(None).expect("a CPU backend");
    eprintln!("CPU backend: {cpu}");
    assert!(
        !cpu.features.iter().any(|f| f.starts_with("AMX")) || cpu.forced,
        "AMX was chosen by itself: {cpu}"
    );
    for ty in [
        GgmlType::F16,
        GgmlType::Q8_0,
        GgmlType::Q5_0,
        GgmlType::Q4_0,
        GgmlType::Q4_K,
        GgmlType::Q6_K,
    ] {
        for repack in [false, true] {
            for n in [1, 7, 32] {
                check(ty, repack, n);
            }
        }
    }
}

/// The automatic choice is the best variant this CPU runs, never one with
/// AMX (llama.cpp #20824); every variant it runs computes correctly, and
/// forcing an AMX one is refused with a message, never a crash.
#[test]
fn every_cpu_variant_this_machine_runs_matches_the_reference() {
    let cpu = omni_engine::cpu_backend(None).expect("a CPU backend");
    for amx in cpu
        .candidates
        .iter()
        .filter(|c| c.score > 0 && c.uses_amx())
    {
        let (ok, text) =
            common::run_with_variant(&amx.name, &["quantized_matmuls_match_a_plain_reference"]);
        assert!(
            !ok && text.contains("computes with AMX") && text.contains("choose one of"),
            "variant {}:\n{text}",
            amx.name
        );
    }
    let runnable: Vec<_> = cpu
        .candidates
        .iter()
        .filter(|c| c.score > 0 && !c.uses_amx())
        .collect();
    assert!(!runnable.is_empty(), "{cpu:?}");
    if !cpu.forced {
        let best = runnable.iter().max_by_key(|c| c.score).unwrap();
        assert_eq!(
            cpu.variant, best.name,
            "the best variant without AMX: {cpu:?}"
        );
    }
    for name in runnable.iter().map(|c| c.name.as_str()) {
        let (ok, text) =
            common::run_with_variant(name, &["quantized_matmuls_match_a_plain_reference"]);
        assert!(
            ok && text.contains(&format!("CPU backend: {name}, forced")),
            "variant {name}:\n{text}"
        );
        eprintln!("{name}: matmuls match");
    }
}
