//! Split models (llama.cpp's gguf-split layout), as a user meets them: a
//! real model cut into 3 parts by `omnictl split` gives the same tokens as
//! the whole file, in one process and in a 2-stage cluster; each worker
//! maps only the parts that hold its tensors; a missing, truncated or
//! foreign part is refused naming it before anything loads; an expert
//! worker slices its experts out of the parts that hold them; and
//! `omnictl merge` gives back the original bytes.

use omni_engine::ModelFile;
use omni_tests::fixtures::{self, fixtures_dir, json, model, GEMMA, QWEN};
use omni_tests::{engine_tokens, greedy, ids, short_prompts, target_bin, Cluster, ClusterSpec};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

const N_GEN: usize = 16;

/// Splits `file` into `n` parts under `dir` with `omnictl split`; the parts.
fn split_n(file: &Path, dir: &Path, name: &str, n: usize) -> Vec<PathBuf> {
    let prefix = dir.join(name);
    omnictl(&[
        "split",
        file.to_str().unwrap(),
        prefix.to_str().unwrap(),
        "--parts",
        &n.to_string(),
    ]);
    (1..=n)
        .map(|i| dir.join(format!("{name}-{i:05}-of-{n:05}.gguf")))
        .collect()
}

/// `omnictl ARGS`; panics with its output unless it succeeds.
fn omnictl(args: &[&str]) -> String {
    let out = Command::new(target_bin("omnictl"))
        .args(args)
        .output()
        .expect("omnictl runs");
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "omnictl {args:?}: {text}");
    text
}

fn split3(file: &Path, dir: &Path, name: &str) -> Vec<PathBuf> {
    split_n(file, dir, name, 3)
}

/// The parts (0-based) a process has mapped, from its /proc/PID/maps.
fn mapped_parts(pid: u32, parts: &[PathBuf]) -> BTreeSet<usize> {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
    parts
        .iter()
        .enumerate()
        .filter(|(_, p)| {
            let p = p.canonicalize().unwrap();
            maps.lines().any(|l| l.ends_with(p.to_str().unwrap()))
        })
        .map(|(i, _)| i)
        .collect()
}

/// The parts holding the tensors a stage with `layers`, the embedding
/// (`embed`) and the head (`head`) uses, read from each part alone.
fn parts_holding(
    parts: &[PathBuf],
    layers: std::ops::Range<u32>,
    embed: bool,
    head: bool,
) -> BTreeSet<usize> {
    let mut out = BTreeSet::new();
    let whole = omni_engine::gguf::Gguf::open(&parts[0]).unwrap();
    let tied = whole.tensor("output.weight").is_none();
    for t in whole.tensors() {
        let used = match t.layer() {
            Some(l) => layers.contains(&l),
            None => match t.name.as_str() {
                "token_embd.weight" => embed || (head && tied),
                "output.weight" | "output_norm.weight" => head,
                _ => false,
            },
        };
        if used {
            out.insert(t.part);
        }
    }
    out
}

#[test]
fn a_split_model_gives_the_whole_files_tokens_in_one_process_and_a_cluster() {
    let dir = tempfile::tempdir().unwrap();
    let whole = model(QWEN);
    let parts = split3(&whole, dir.path(), "qwen");
    for p in &parts {
        assert!(p.is_file(), "{} was not written", p.display());
    }

    // merge gives back the original bytes.
    let merged = dir.path().join("merged.gguf");
    omnictl(&[
        "merge",
        parts[2].to_str().unwrap(),
        merged.to_str().unwrap(),
    ]);
    assert!(
        std::fs::read(&merged).unwrap() == std::fs::read(&whole).unwrap(),
        "omnictl merge did not give back the original file"
    );
    std::fs::remove_file(&merged).unwrap();

    // One process, opened from a part that is not the first.
    let prompts = short_prompts("real_qwen2_5_coder_0_5b.json", 2);
    let want = engine_tokens(&whole, &prompts, N_GEN);
    let m = ModelFile::open(&parts[1]).unwrap();
    assert_eq!(m.path, parts[0], "a split model is known by its first part");
    assert_eq!(m.gguf.n_parts(), 3);
    assert_eq!(
        m.gguf.file_size(),
        parts
            .iter()
            .map(|p| p.metadata().unwrap().len())
            .sum::<u64>()
    );
    assert_eq!(
        engine_tokens(&parts[1], &prompts, N_GEN),
        want,
        "one process, split model"
    );

    // A 2-stage cluster: the same tokens, and each worker maps only the
    // parts that hold its tensors.
    let n_layer = ModelFile::open(&whole).unwrap().hparams.n_layer;
    let half = n_layer / 2;
    let mut spec = ClusterSpec::new(2, "shm");
    spec.coordinator_args = vec!["--counts".into(), format!("{half},{}", n_layer - half)];
    let cluster = Cluster::start(&parts[0], &spec);
    let info = cluster.info().unwrap();
    assert!(
        info.stages[0]
            .range
            .contains(&format!("layers 0-{}", half - 1)),
        "{:?}",
        info.stages[0].range
    );
    for (p, w) in prompts.iter().zip(&want) {
        let ev = cluster
            .generate(greedy(p, N_GEN))
            .unwrap_or_else(|e| panic!("{e}\n{}", cluster.logs()));
        assert_eq!(&ids(&ev), w, "2-stage cluster on the split model");
    }
    let expect = [
        parts_holding(&parts, 0..half, true, false),
        parts_holding(&parts, half..n_layer, false, true),
    ];
    for (i, want_parts) in expect.iter().enumerate() {
        let got = mapped_parts(cluster.workers[i].child.id(), &parts);
        assert_eq!(
            &got, want_parts,
            "worker w{i} maps parts {got:?}; its tensors are in {want_parts:?}"
        );
    }
    assert!(
        expect.iter().any(|e| e.len() < parts.len()),
        "the split should leave some worker a part it does not need: {expect:?}"
    );
}

#[test]
fn missing_truncated_and_foreign_parts_are_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let parts = split3(&model(QWEN), dir.path(), "qwen");
    let err = |p: &Path| ModelFile::open(p).unwrap_err().to_string();

    // Missing: named, from whichever part the model is opened.
    let gone = dir.path().join("gone.gguf");
    std::fs::rename(&parts[2], &gone).unwrap();
    let e = err(&parts[0]);
    assert!(
        e.contains(parts[2].to_str().unwrap())
            && e.contains("part 3 of 3")
            && e.contains("missing"),
        "{e}"
    );
    std::fs::rename(&gone, &parts[2]).unwrap();

    // Truncated: named, with what is cut off.
    let bytes = std::fs::read(&parts[2]).unwrap();
    std::fs::write(&parts[2], &bytes[..bytes.len() / 2]).unwrap();
    let e = err(&parts[1]);
    assert!(
        e.contains(parts[2].to_str().unwrap()) && e.contains("past the end of the file"),
        "{e}"
    );
    std::fs::write(&parts[2], &bytes).unwrap();

    // Foreign: another model's part 2 of 3 in this one's place.
    let other = split3(&model(GEMMA), dir.path(), "gemma");
    std::fs::copy(&parts[1], dir.path().join("keep.gguf")).unwrap();
    std::fs::copy(&other[1], &parts[1]).unwrap();
    let e = err(&parts[0]);
    assert!(
        e.contains(parts[1].to_str().unwrap()) && e.contains("not part 2 of 3 of this model"),
        "{e}"
    );
    std::fs::copy(dir.path().join("keep.gguf"), &parts[1]).unwrap();

    // A part renamed out of its place in the set.
    let odd = dir.path().join("qwen-part.gguf");
    std::fs::copy(&parts[1], &odd).unwrap();
    let e = err(&odd);
    assert!(
        e.contains("qwen-part.gguf") && e.contains("-00002-of-00003.gguf"),
        "{e}"
    );

    // Whole again: it opens.
    ModelFile::open(&parts[0]).unwrap();
}

/// A MoE model split in 4, its routed experts on an expert worker: the
/// tokens are llama.cpp's for the whole file, and the expert worker maps
/// only the parts that hold expert tensors.
#[test]
fn an_expert_worker_slices_experts_out_of_a_split_models_parts() {
    let name = "deepseek2-mla-q4_k_m";
    let whole = fixtures_dir().join(format!("synthetic/tiny-{name}.gguf"));
    let dir = tempfile::tempdir().unwrap();
    let parts = split_n(&whole, dir.path(), "moe", 4);
    let mut spec = ClusterSpec::new(2, "shm");
    spec.cpu_workers = 1;
    spec.coordinator_args = vec!["--experts".into(), "cpu".into()];
    let c = Cluster::start(&parts[0], &spec);
    let fx = json(&format!("synthetic/ref_tiny-{name}.json"));
    for g in fx["generations"].as_array().unwrap() {
        let prompt = fixtures::ids(&g["prompt_ids"]);
        let want = fixtures::greedy_ids_here(&whole, &prompt, fixtures::ids(&g["generated_ids"]));
        let ev = c
            .generate(greedy(&prompt, want.len()))
            .unwrap_or_else(|e| panic!("{e}\n{}", c.logs()));
        assert_eq!(ids(&ev), want, "{name} split in 4, experts on c0");
    }
    let g = omni_engine::gguf::Gguf::open(&parts[0]).unwrap();
    let experts: BTreeSet<usize> = g
        .tensors()
        .iter()
        .filter(|t| t.name.ends_with("_exps.weight"))
        .map(|t| t.part)
        .collect();
    let got = mapped_parts(c.cpu_workers[0].child.id(), &parts);
    assert_eq!(
        got, experts,
        "the expert worker maps the parts of the experts"
    );
}
