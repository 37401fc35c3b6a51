//! Cells shared between sequences (the prefix cache's `KvCache::share`,
//! `retain`, `evict`): a sequence that starts from another's prompt cells
//! computes the rest exactly as the owner did, bit for bit, when the step
//! has the same shape and cells; shared cells count once; cells the cache
//! keeps outlive their sequences until evicted; and a table with shared and
//! kept cells moves to another stage (export, bytes, import) unchanged.

mod common;

use common::*;
use omni_engine::{Batch, EngineError, KvLayers, Stage};

fn stage() -> Stage {
    gemma_stage(3, 2)
}

/// Every token's logits wanted, so whole steps are compared.
fn batch(seq: u32, tokens: &[u32], from: usize) -> Batch {
    let mut b = Batch::default();
    for (i, &t) in tokens.iter().enumerate() {
        b.push(t, (from + i) as i32, seq, true);
    }
    b
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn config_err(r: Result<(), EngineError>) -> String {
    match r {
        Err(EngineError::Config(m)) => m,
        other => panic!("expected a config error, got {other:?}"),
    }
}

#[test]
fn shared_cells_give_the_same_logits_as_computing_them() {
    let mut s = stage();
    let prefix: Vec<u32> = (0..48).map(|i| 200 + (i * 37) % 5000).collect();
    let rest: Vec<u32> = (0..20).map(|i| 300 + (i * 11) % 4000).collect();
    let k = prefix.len();

    // Sequence 0 computes the prefix, then the rest.
    s.forward(&batch(0, &prefix, 0), None).unwrap();
    let prefix_cells = s.last_cells().to_vec();
    let own = logits_of(s.forward(&batch(0, &rest, k), None).unwrap());
    let rest_cells = s.last_cells().to_vec();

    // Sequence 0 gives its rest back (the cells are free again); sequence
    // 1 starts from the prefix cells and computes the same rest into the
    // same cells: the same step, so the same logits bit for bit.
    s.remove_seq(0, Some(k as i32));
    assert_eq!(s.kv().used(), k);
    s.share_kv(1, &prefix_cells).unwrap();
    assert_eq!(s.kv().used(), k, "shared cells count once");
    let shared = logits_of(s.forward(&batch(1, &rest, k), None).unwrap());
    assert_eq!(s.last_cells(), &rest_cells[..]);
    assert_eq!(bits(&shared), bits(&own), "shared prefix, different logits");

    // A sequence that holds cells cannot take a prefix; free and unknown
    // cells cannot be shared or kept.
    let m = config_err(s.share_kv(1, &prefix_cells[..4]));
    assert!(m.contains("already holds KV cells"), "{m}");
    let m = config_err(s.share_kv(2, &[200]));
    assert!(m.contains("KV cell 200 is free"), "{m}");
    let m = config_err(s.retain_kv(&[1 << 40]));
    assert!(m.contains("out of range"), "{m}");
    let m = config_err(s.share_kv(2, &[prefix_cells[0], prefix_cells[0]]));
    assert!(m.contains("named twice"), "{m}");

    // The cache keeps the prefix; sequence 0 ends. Sequence 1 goes on
    // unchanged, and its next token matches a sequence that never shared.
    s.retain_kv(&prefix_cells).unwrap();
    s.remove_seq(0, None);
    assert_eq!(s.kv().used(), k + rest.len());
    assert_eq!(s.kv().cached(), k);
    let next =
        omni_engine::sampling::greedy(&shared[shared.len() - s.model().hparams.n_vocab as usize..]);
    let decoded = logits_of(s.forward(&batch(1, &[next], k + rest.len()), None).unwrap());

    let mut alone = stage();
    alone.forward(&batch(0, &prefix, 0), None).unwrap();
    alone.forward(&batch(0, &rest, k), None).unwrap();
    let reference = logits_of(
        alone
            .forward(&batch(0, &[next], k + rest.len()), None)
            .unwrap(),
    );
    assert_eq!(bits(&decoded), bits(&reference));

    // The table moves as it is: shared and kept cells, through bytes.
    let n = s.range().layers.clone();
    let kv = s.export_kv(n.clone()).unwrap();
    let kv = KvLayers::from_bytes(&kv.to_bytes()).unwrap();
    assert!(kv.cells[prefix_cells[0] as usize]
        .as_ref()
        .is_some_and(|c| c.cached && c.seqs == vec![1]));
    let mut moved = stage();
    moved.import_kv(&kv).unwrap();
    assert_eq!(moved.kv().used(), s.kv().used());
    assert_eq!(moved.kv().cached(), k);
    let pos = k + rest.len() + 1;
    let a = logits_of(s.forward(&batch(1, &[next], pos), None).unwrap());
    let b = logits_of(moved.forward(&batch(1, &[next], pos), None).unwrap());
    assert_eq!(bits(&a), bits(&b), "the moved table gives other logits");

    // Sequence 1 ends: only the kept cells are left, until evicted. A
    // third sequence can start from them meanwhile.
    s.remove_seq(1, None);
    assert_eq!(s.kv().used(), k);
    s.share_kv(2, &prefix_cells[..16]).unwrap();
    s.evict_kv(&prefix_cells).unwrap();
    assert_eq!(s.kv().used(), 16, "cells a sequence sees stay");
    assert_eq!(s.kv().cached(), 0);
    s.remove_seq(2, None);
    assert_eq!(s.kv().used(), 0);

    // clear_kv (a recovery) frees the cache's cells too.
    s.forward(&batch(0, &prefix, 0), None).unwrap();
    let cells = s.last_cells().to_vec();
    s.retain_kv(&cells).unwrap();
    s.remove_seq(0, None);
    assert_eq!(s.kv().used(), k);
    s.clear_kv();
    assert_eq!(s.kv().used(), 0);
}
