//! `omnictl` as a user runs it: the real binary, the real Gemma file.

use std::path::PathBuf;
use std::process::Command;

fn models_dir() -> PathBuf {
    std::env::var_os("OMNI_MODELS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap()).join(".cache/omni/models")
        })
}

fn gemma() -> PathBuf {
    let p = models_dir().join("gemma3-270m-q4_k_m.gguf");
    assert!(
        p.exists(),
        "{} missing: run `omnictl fetch gemma3-270m`",
        p.display()
    );
    p
}

fn omnictl(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_omnictl"))
        .args(args)
        .output()
        .expect("omnictl runs");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn generated_ids(json: &str) -> Vec<u64> {
    let v: serde_json::Value =
        serde_json::from_str(json).unwrap_or_else(|e| panic!("not JSON ({e}): {json}"));
    v["generated_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect()
}

#[test]
fn generate_json_gives_llama_cpp_tokens_whole_and_split() {
    // gemma3_270m_visible_00 from ../shared/fixtures: llama.cpp's first greedy tokens.
    let want = [506u64, 5279, 529, 506, 2891, 529, 7001, 236761];
    let model = gemma();
    let model = model.to_str().unwrap();
    for extra in [&[][..], &["--split", "6,6,6"][..]] {
        let mut args = vec![
            "generate",
            "--model",
            model,
            "--prompt",
            "The capital of France is",
            "-n",
            "8",
            "--ignore-eos",
            "--json",
            "-t",
            "2",
        ];
        args.extend_from_slice(extra);
        let (ok, out, err) = omnictl(&args);
        assert!(ok, "omnictl failed: {err}");
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(
            v["prompt_ids"],
            serde_json::json!([2, 818, 5279, 529, 7001, 563]),
            "{out}"
        );
        assert_eq!(generated_ids(&out), want, "split {extra:?}: {out}");
        assert!(v["text"].as_str().unwrap().contains("capital"), "{out}");
        assert!(v["timings"]["gen_tok_s"].as_f64().unwrap() > 0.0);
    }
}

#[test]
fn generate_streams_text_and_same_seed_gives_same_text() {
    let model = gemma();
    let args = [
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--prompt",
        "Once upon a time",
        "-n",
        "12",
        "--temperature",
        "0.9",
        "--seed",
        "7",
        "-t",
        "2",
    ];
    let (ok1, out1, err1) = omnictl(&args);
    let (ok2, out2, _) = omnictl(&args);
    assert!(ok1 && ok2, "{err1}");
    assert!(!out1.trim().is_empty());
    assert_eq!(out1, out2, "same seed must give the same text");
}

#[test]
fn bad_input_is_a_clear_error() {
    let (ok, _, err) = omnictl(&[
        "generate",
        "--model",
        "/no/such/model.gguf",
        "--prompt",
        "hi",
    ]);
    assert!(
        !ok && err.contains("/no/such/model.gguf")
            && err.contains("neither a file nor a known model"),
        "{err}"
    );
    let (ok, _, err) = omnictl(&["fetch", "llama-9000"]);
    assert!(
        !ok && err.contains("unknown model 'llama-9000'") && err.contains("gemma3-270m"),
        "{err}"
    );
    let model = gemma();
    let (ok, _, err) = omnictl(&[
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--prompt",
        "hi",
        "--top-p",
        "0",
    ]);
    assert!(!ok && err.contains("top_p"), "{err}");
}

#[test]
fn bench_prints_prefill_and_decode_rates() {
    let model = gemma();
    let (ok, out, err) = omnictl(&[
        "bench",
        "--model",
        model.to_str().unwrap(),
        "--pp",
        "32",
        "--tg",
        "4",
        "--runs",
        "1",
        "-t",
        "2",
        "--json",
    ]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    // The run-time chosen CPU variant, in the text and the JSON.
    let variant = v["cpu_variant"].as_str().unwrap();
    assert!(
        err.contains(&format!("ggml CPU backend: {variant} ("))
            && !v["cpu_features"].as_array().unwrap().is_empty(),
        "{err}\n{out}"
    );
    let tests: Vec<&str> = v["results"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["test"].as_str().unwrap())
        .collect();
    assert_eq!(tests, ["pp32", "tg4"]);
    assert!(v["results"]
        .as_array()
        .unwrap()
        .iter()
        .all(|r| r["omni_tok_s"].as_f64().unwrap() > 0.0));
}
