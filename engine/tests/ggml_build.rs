//! Our ggml build (CPU flags chosen in .cargo/config.toml) computes real
//! matmuls correctly: quantized weights through the same kernels the models
//! use (repacked and plain), against a plain Rust reference on random data.
//! A wrong SIMD flag (or AMX sneaking back in) fails here at once.

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
    let (ours, reference) = omni_engine::ggml_matmul_check(ty, &w, &x, rows, k, repack);
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
