//! Replaying a sequence into the KV cells it had (what the coordinator does
//! after a recovery, `Batch::cells`): with the same steps and the same
//! cells, every logit comes out bit for bit as the first time, even though
//! the other sequence that shared the cache then is gone and the prompt is
//! long enough for the tiled attention path (its tiles see the same cells).
//! And the cells a caller names are checked before anything is written.
//! Also: a decode step that computes the last step's graph again (graph
//! reuse) gives the logits a freshly built graph gives, bit for bit.

mod common;

use common::*;
use omni_engine::{Batch, EngineError, Stage};

fn stage() -> Stage {
    gemma_stage(2, 1)
}

fn batch(seq: u32, tokens: &[u32], from: usize, cells: &[i64]) -> Batch {
    let mut b = Batch::default();
    for (i, &t) in tokens.iter().enumerate() {
        b.push(t, (from + i) as i32, seq, i + 1 == tokens.len());
    }
    b.cells = cells.to_vec();
    b
}

#[test]
fn a_sequence_replayed_into_its_cells_gives_the_same_logits_bit_for_bit() {
    let mut s = stage();
    // Sequence 0's steps: a 90-token prompt, then one token at a time.
    let prompt: Vec<u32> = (0..90).map(|i| 200 + (i * 37) % 5000).collect();
    let mut steps: Vec<(Vec<u32>, usize)> = vec![(prompt.clone(), 0)];
    // Sequence 1 shares the cache: its prompt lands between, its decode
    // tokens interleave with sequence 0's, then it is removed.
    let other: Vec<u32> = (0..70).map(|i| 300 + (i * 11) % 4000).collect();
    let mut first = Vec::new();
    let mut cells = Vec::new();
    let mut pos = 0;
    for k in 0..12 {
        let (toks, from) = steps[k].clone();
        first.push(logits_of(
            s.forward(&batch(0, &toks, from, &[]), None).unwrap(),
        ));
        cells.push(s.last_cells().to_vec());
        pos = from + toks.len();
        let next = omni_engine::sampling::greedy(first.last().unwrap());
        steps.push((vec![next], pos));
        match k {
            0 => {
                s.forward(&batch(1, &other, 0, &[]), None).unwrap();
            }
            1..=5 => {
                let p = other.len() + k - 1;
                s.forward(&batch(1, &[7], p, &[]), None).unwrap();
            }
            6 => s.remove_seq(1, None),
            _ => {}
        }
    }
    assert!(pos > 64, "the prompt takes the tiled attention path");

    // The cache starts over; only sequence 0 comes back, into its cells.
    s.clear_kv();
    assert_eq!(s.kv().used(), 0);
    for k in 0..12 {
        let (toks, from) = &steps[k];
        let again = logits_of(s.forward(&batch(0, toks, *from, &cells[k]), None).unwrap());
        assert_eq!(s.last_cells(), &cells[k][..]);
        let same = again
            .iter()
            .zip(&first[k])
            .all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "step {k}'s logits differ on replay");
    }
}

#[test]
fn named_cells_are_checked_before_anything_is_written() {
    let mut s = stage();
    s.forward(&batch(0, &[5, 6, 7], 0, &[]), None).unwrap();
    let taken = s.last_cells().to_vec();
    let used = s.kv().used();
    let err = |b: Batch, s: &mut Stage| match s.forward(&b, None) {
        Err(EngineError::Config(m)) => m,
        Err(e) => panic!("unexpected error {e}"),
        Ok(_) => panic!("accepted {:?}", b.cells),
    };
    let m = err(batch(1, &[8, 9], 0, &[taken[0], 100]), &mut s);
    assert!(
        m.contains(&format!("KV cell {} is in use", taken[0])),
        "{m}"
    );
    let m = err(batch(1, &[8, 9], 0, &[100, 100]), &mut s);
    assert!(m.contains("named twice"), "{m}");
    let m = err(batch(1, &[8, 9], 0, &[100, 1 << 40]), &mut s);
    assert!(m.contains("out of range"), "{m}");
    let m = err(batch(1, &[8, 9], 0, &[100]), &mut s);
    assert!(m.contains("inconsistent batch"), "{m}");
    assert_eq!(s.kv().used(), used, "nothing was written");
    s.forward(&batch(1, &[8, 9], 0, &[100, 101]), None).unwrap();
    assert_eq!(s.last_cells(), &[100, 101]);
}

#[test]
fn a_reused_step_graph_gives_the_logits_of_a_fresh_one_bit_for_bit() {
    let prompt: Vec<u32> = (0..40).map(|i| 200 + (i * 37) % 5000).collect();
    let run = |reuse: bool| {
        let mut s = gemma_stage(3, 1);
        s.set_graph_reuse(reuse);
        let mut out = vec![
            logits_of(s.forward(&batch(0, &prompt, 0, &[]), None).unwrap()),
            logits_of(s.forward(&batch(1, &prompt[..12], 0, &[]), None).unwrap()),
        ];
        let mut t = 7u32;
        for k in 0..20 {
            // Two sequences' decode steps in turn, and a third's prompt in
            // the middle: steps of other shapes between steps of one.
            let seq = (k % 2) as u32;
            if k == 10 {
                out.push(logits_of(
                    s.forward(&batch(2, &prompt[..9], 0, &[]), None).unwrap(),
                ));
            }
            let pos = if seq == 0 { 40 + k / 2 } else { 12 + k / 2 };
            out.push(logits_of(
                s.forward(&batch(seq, &[t], pos, &[]), None).unwrap(),
            ));
            t = (t * 31 + 11) % 5000;
        }
        (out, s.step_times().clone())
    };
    let (fresh, fresh_times) = run(false);
    let (reused, times) = run(true);
    assert_eq!(fresh_times.reused, 0);
    assert!(
        times.reused >= 15,
        "decode steps of one shape should compute the last graph again: {times:?}"
    );
    assert_eq!(fresh.len(), reused.len());
    for (i, (a, b)) in fresh.iter().zip(&reused).enumerate() {
        assert!(
            a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
            "step {i}: a reused graph's logits differ from a fresh one's"
        );
    }
}
