//! Split models: cutting a file into parts (`split::plan`, `split::write`),
//! reading the parts as one model, and joining them back byte for byte.

use super::*;
use omni_engine::gguf::split::{self, SplitBy};
use std::path::{Path, PathBuf};

/// The sample file with every value type, padded at the end as real
/// writers (ggml's and gguf-py's) pad every tensor, written to `dir`.
fn sample_on_disk(dir: &Path, alignment: Option<u32>) -> (PathBuf, Vec<u8>) {
    let mut b = all_values()
        .into_iter()
        .fold(Builder::new(3), |b, (k, v)| b.kv(k, v));
    if let Some(a) = alignment {
        b = b.kv("general.alignment", Value::U32(a));
    }
    let mut bytes = sample_tensors(b).build();
    let a = u64::from(alignment.unwrap_or(32));
    bytes.resize((bytes.len() as u64).next_multiple_of(a) as usize, 0);
    let path = dir.join("sample.gguf");
    std::fs::write(&path, &bytes).unwrap();
    (path, bytes)
}

fn write_parts(g: &Gguf, by: SplitBy, prefix: &Path) -> Vec<PathBuf> {
    let parts = split::plan(g, by).unwrap();
    let outs: Vec<PathBuf> = (0..parts.len())
        .map(|i| split::part_path(prefix, i, parts.len()))
        .collect();
    split::write(g, &parts, &outs, &mut |_, _| {}).unwrap();
    outs
}

#[test]
fn parts_read_as_the_whole_file_and_merge_back_byte_for_byte() {
    for alignment in [None, Some(64)] {
        let dir = tempfile::tempdir().unwrap();
        let (path, bytes) = sample_on_disk(dir.path(), alignment);
        let whole = Gguf::open(&path).unwrap();
        for (by, n) in [
            (SplitBy::MaxTensors(1), 4),
            (SplitBy::Parts(2), 2),
            (SplitBy::MaxBytes(160), 3),
        ] {
            let outs = write_parts(&whole, by, &dir.path().join(format!("s{n}")));
            assert_eq!(outs.len(), n, "{by:?}");
            // Opened from any part, the model is the whole file's.
            for from in &outs {
                let g = Gguf::open(from).unwrap();
                assert_eq!(g.n_parts(), n);
                assert_eq!(g.tensors().len(), whole.tensors().len());
                for (t, w) in g.tensors().iter().zip(whole.tensors()) {
                    assert_eq!((&t.name, &t.dims, t.size), (&w.name, &w.dims, w.size));
                    assert_eq!(g.tensor_data(t).unwrap(), whole.tensor_data(w).unwrap());
                }
                for (k, v) in whole.metadata() {
                    assert_eq!(g.get(k), Some(v), "{k}");
                }
                assert_eq!(g.get_u64("split.count").unwrap(), n as u64);
            }
            // Joined again: the original bytes.
            let g = Gguf::open(&outs[n - 1]).unwrap();
            let merged = dir.path().join(format!("merged{n}.gguf"));
            let all: Vec<usize> = (0..g.tensors().len()).collect();
            split::write(&g, &[all], std::slice::from_ref(&merged), &mut |_, _| {}).unwrap();
            assert!(
                std::fs::read(&merged).unwrap() == bytes,
                "{by:?}: merge differs"
            );
        }
    }
}

#[test]
fn parts_are_mapped_only_when_their_tensors_are_read() {
    let dir = tempfile::tempdir().unwrap();
    let (path, _) = sample_on_disk(dir.path(), None);
    let outs = write_parts(
        &Gguf::open(&path).unwrap(),
        SplitBy::MaxTensors(1),
        &dir.path().join("m"),
    );
    let g = Gguf::open(&outs[0]).unwrap();
    assert!((0..4).all(|i| !g.is_mapped(i)), "nothing is mapped at open");
    let t = g.tensor("blk.1.ffn_up.weight").unwrap();
    assert_eq!(t.part, 2);
    g.tensor_data(t).unwrap();
    assert_eq!(
        (0..4).map(|i| g.is_mapped(i)).collect::<Vec<_>>(),
        [false, false, true, false]
    );
}

#[test]
fn the_cut_balances_bytes_and_bad_requests_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (path, _) = sample_on_disk(dir.path(), None);
    let g = Gguf::open(&path).unwrap();
    // Tensors of 48, 136, 144 and 10 bytes: two parts of about 170 each.
    assert_eq!(
        split::plan(&g, SplitBy::Parts(2)).unwrap(),
        [vec![0, 1], vec![2, 3]]
    );
    // As many parts as tensors: one each, even where bytes would say otherwise.
    assert_eq!(
        split::plan(&g, SplitBy::Parts(4)).unwrap(),
        [vec![0], vec![1], vec![2], vec![3]]
    );
    assert_eq!(
        split::plan(&g, SplitBy::MaxTensors(3)).unwrap(),
        [vec![0, 1, 2], vec![3]]
    );
    // A tensor larger than the bound is a part alone.
    assert_eq!(
        split::plan(&g, SplitBy::MaxBytes(100)).unwrap(),
        [vec![0], vec![1], vec![2], vec![3]]
    );
    let e = split::plan(&g, SplitBy::Parts(5)).unwrap_err();
    assert!(e.contains("cannot make 5 parts of 4 tensors"), "{e}");
    assert!(split::plan(&g, SplitBy::Parts(0)).is_err());
    assert!(split::plan(&g, SplitBy::MaxTensors(0)).is_err());
}
