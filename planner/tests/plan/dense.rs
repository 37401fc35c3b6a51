//! Dense splits: automatic, measured, mixed devices, manual, and the errors a user reads.

use super::*;

#[test]
fn automatic_splits_cover_every_layer_once_and_add_up() {
    for file in [GEMMA, QWEN] {
        let m = model(file);
        for free in [
            vec![4 * GIB],
            vec![4 * GIB, 4 * GIB],
            vec![4 * GIB, 4 * GIB, 4 * GIB],
            vec![6 * GIB, 2 * GIB],
            vec![2 * GIB, 6 * GIB],
        ] {
            let ws = workers(&free);
            let c = cfg(None);
            let p = plan(&m, &ws, &c).unwrap_or_else(|e| panic!("{file} {free:?}: {e}"));
            check_plan(&m, &ws, &c, &p);
            eprintln!("{file} {:?} -> {:?}", free, counts(&p));
        }
    }
}

/// The automatic split makes the slowest stage as fast as it can be: the
/// largest per-token work (weight bytes read) is the least of every split
/// that fits, whatever the budgets, as long as the workers are of one kind.
#[test]
fn the_automatic_split_makes_the_slowest_stage_as_fast_as_it_can_be() {
    for file in [GEMMA, QWEN] {
        let m = model(file);
        let n = m.hparams.n_layer;
        let slowest = |p: &Plan| *work_per_token(&m, p).iter().max().unwrap();
        for free in [
            vec![4 * GIB, 4 * GIB],
            vec![6 * GIB, 2 * GIB],
            vec![2 * GIB, 6 * GIB],
            vec![4 * GIB, 4 * GIB, 4 * GIB],
            // Tight: the first worker cannot hold its best share.
            vec![800 * MIB, 4 * GIB],
        ] {
            let ws = workers(&free);
            let auto = plan(&m, &ws, &cfg(None)).unwrap_or_else(|e| panic!("{file} {free:?}: {e}"));
            check_plan(&m, &ws, &cfg(None), &auto);
            let mut best = u64::MAX;
            let mut each = |c: Vec<u32>| {
                if let Ok(p) = plan(&m, &ws, &cfg(Some(Split::Layers(c)))) {
                    best = best.min(slowest(&p));
                }
            };
            for a in 1..n {
                if ws.len() == 2 {
                    each(vec![a, n - a]);
                } else {
                    for b in 1..n - a {
                        each(vec![a, b, n - a - b]);
                    }
                }
            }
            assert_eq!(slowest(&auto), best, "{file} {free:?}\n{auto}");
            assert!(auto
                .notes
                .iter()
                .any(|n| n.contains("the slowest stage as fast as it can be")));
        }
        // Gemma's tied head outweighs all its layers: the last stage gets one.
        if file == GEMMA {
            let p = plan(&m, &workers(&[4 * GIB, 4 * GIB]), &cfg(None)).unwrap();
            assert_eq!(counts(&p), [n - 1, 1], "{p}");
        }
    }
}

/// With the rate each worker measured for its weight reads, the automatic
/// split makes the slowest stage's time per token (its weight reads over
/// its worker's rate) the least of every split that fits: a worker three
/// times as fast gets more layers, a GPU beside a CPU takes all the layers
/// it has room for, and the notes give each stage's time.
#[test]
fn measured_read_rates_balance_time_across_unequal_workers() {
    let rated = |devices: &[&str], free: &[u64], rates: &[u64]| -> Vec<WorkerSpec> {
        let mut ws = specs("w", |i| devices[i].to_string(), free);
        for (w, &r) in ws.iter_mut().zip(rates) {
            w.read_rate = r;
        }
        ws
    };
    const GB: u64 = 1_000_000_000;
    for file in [GEMMA, QWEN] {
        let m = model(file);
        let n = m.hparams.n_layer;
        for (devices, free, rates) in [
            (["cpu", "cpu"], [4 * GIB, 4 * GIB], [10 * GB, 30 * GB]),
            (["cpu", "cpu"], [4 * GIB, 4 * GIB], [30 * GB, 10 * GB]),
            (["cuda:0", "cpu"], [4 * GIB, 4 * GIB], [900 * GB, 40 * GB]),
            (["cpu", "cuda:0"], [4 * GIB, 4 * GIB], [40 * GB, 900 * GB]),
            // The fast GPU is small: it takes what fits, the CPU the rest.
            (["cuda:0", "cpu"], [400 * MIB, 4 * GIB], [900 * GB, 40 * GB]),
        ] {
            let ws = rated(&devices, &free, &rates);
            let time = |p: &Plan| {
                work_per_token(&m, p)
                    .iter()
                    .zip(&rates)
                    .map(|(&w, &r)| w as f64 / r as f64)
                    .fold(0.0, f64::max)
            };
            let what = format!("{file} {devices:?} {free:?} {rates:?}");
            let auto = plan(&m, &ws, &cfg(None)).unwrap_or_else(|e| panic!("{what}: {e}"));
            if !devices.iter().any(|d| d.starts_with("cuda")) {
                // (A GPU stage's bytes are checked in gpu_stages_count_the_embedding_where_it_lives.)
                check_plan(&m, &ws, &cfg(None), &auto);
            }
            let mut best = f64::INFINITY;
            for a in 1..n {
                if let Ok(p) = plan(&m, &ws, &cfg(Some(Split::Layers(vec![a, n - a])))) {
                    best = best.min(time(&p));
                }
            }
            assert_eq!(time(&auto), best, "{what}\n{auto}");
            assert!(
                auto.notes
                    .iter()
                    .any(|n| n.contains("over the rate its worker reads weights at")),
                "{what}: {:?}",
                auto.notes
            );
            assert!(
                auto.notes
                    .iter()
                    .any(|n| n.contains("stage 1 ") && n.contains("GB/s")),
                "{what}: {:?}",
                auto.notes
            );
        }
        // The faster of two CPU workers gets more layers than it does when
        // their speeds are unknown (and count as equal).
        let equal = plan(&m, &workers(&[4 * GIB, 4 * GIB]), &cfg(None)).unwrap();
        let fast_first = rated(&["cpu", "cpu"], &[4 * GIB, 4 * GIB], &[30 * GB, 10 * GB]);
        let p = plan(&m, &fast_first, &cfg(None)).unwrap();
        assert!(counts(&p)[0] >= counts(&equal)[0], "{file}\n{p}\n{equal}");
        let fast_last = rated(&["cpu", "cpu"], &[4 * GIB, 4 * GIB], &[10 * GB, 30 * GB]);
        let p = plan(&m, &fast_last, &cfg(None)).unwrap();
        assert!(counts(&p)[1] > counts(&equal)[1], "{file}\n{p}\n{equal}");
        // A roomy GPU twenty times the CPU's speed leaves the CPU one layer.
        let gpu = rated(
            &["cuda:0", "cpu"],
            &[4 * GIB, 4 * GIB],
            &[900 * GB, 40 * GB],
        );
        let p = plan(&m, &gpu, &cfg(None)).unwrap();
        assert!(counts(&p)[0] >= n - 2, "{file}\n{p}");
        // One worker without a figure: the rates are not used.
        let mut partial = gpu.clone();
        partial[1].read_rate = 0;
        let p = plan(&m, &partial, &cfg(None)).unwrap();
        assert!(p.notes.iter().all(|n| !n.contains("GB/s")), "{file}\n{p}");
    }
}

/// Devices of different kinds (a GPU and a CPU, whose speeds the planner
/// does not know): with room to spare, the automatic split gives layers in
/// proportion to the workers' budgets; when that does not fit it falls back
/// to the split that fills the workers most evenly, which then fits.
#[test]
fn automatic_split_over_mixed_devices_is_proportional_when_it_fits_else_packed() {
    let workers = |free: &[u64]| {
        specs(
            "w",
            |i| {
                if i == 0 {
                    "cuda:0".into()
                } else {
                    "cpu".into()
                }
            },
            free,
        )
    };
    for file in [GEMMA, QWEN] {
        let m = model(file);
        let n = m.hparams.n_layer;
        let equal = plan(&m, &workers(&[4 * GIB, 4 * GIB]), &cfg(None)).unwrap();
        assert_eq!(counts(&equal), vec![n / 2, n - n / 2], "{file}\n{equal}");
        let third = plan(&m, &workers(&[6 * GIB, 2 * GIB]), &cfg(None)).unwrap();
        assert_eq!(
            counts(&third),
            omni_planner::proportions_to_counts(&[6.0, 2.0], &workers(&[6 * GIB, 2 * GIB]), n)
                .unwrap()
        );
        // Equal workers just big enough for the packed split but not for
        // the proportional one (the head's logits buffer makes its stage heavy).
        let huge = workers(&[64 * GIB, 64 * GIB]);
        let packed = omni_planner::min_max_split(&m, &huge, &cfg(None));
        let total_of = |c: &[u32]| {
            let p = plan(&m, &huge, &cfg(Some(Split::Layers(c.to_vec())))).unwrap();
            p.stages.iter().map(|s| s.bytes.total).max().unwrap()
        };
        let (need_packed, need_prop) = (total_of(&packed), total_of(&counts(&equal)));
        assert!(
            need_packed < need_prop,
            "{file}: {packed:?} needs {need_packed}, {need_prop} proportional"
        );
        let free = ((need_packed + need_prop) / 2) as f64 / 0.9;
        let tight = plan(&m, &workers(&[free as u64, free as u64]), &cfg(None)).unwrap();
        assert_eq!(counts(&tight), packed, "{file}\n{tight}");
        assert!(tight.notes.iter().any(|n| n.contains("did not fit")));
    }
}

/// The fallback split is the best contiguous one: no manual split of the
/// same workers leaves every stage at a smaller share of its budget.
#[test]
fn packed_split_is_no_worse_than_any_other() {
    for file in [GEMMA, QWEN] {
        let m = model(file);
        let n = m.hparams.n_layer;
        for free in [vec![6 * GIB, 2 * GIB], vec![3 * GIB, 3 * GIB, 2 * GIB]] {
            let ws = workers(&free);
            let packed = omni_planner::min_max_split(&m, &ws, &cfg(None));
            let auto = plan(&m, &ws, &cfg(Some(Split::Layers(packed)))).unwrap();
            let best = worst(&auto);
            let mut splits: Vec<Vec<u32>> = Vec::new();
            if free.len() == 2 {
                splits.extend((1..n).map(|a| vec![a, n - a]));
            } else {
                for a in 1..n - 1 {
                    splits.extend((1..n - a).map(|b| vec![a, b, n - a - b]));
                }
            }
            for s in splits {
                let c = cfg(Some(Split::Layers(s.clone())));
                let other = plan(&m, &ws, &c).unwrap();
                assert_eq!(counts(&other), s, "a manual split is honoured exactly");
                assert!(
                    best <= worst(&other) * (1.0 + 1e-9),
                    "{file} {free:?}: automatic {:?} uses {best:.4} of a budget, manual {s:?} only {:.4}",
                    counts(&auto),
                    worst(&other)
                );
            }
        }
    }
}

#[test]
fn too_little_memory_fails_naming_the_worker_and_the_numbers() {
    let m = model(QWEN);
    // Nowhere near enough in total.
    let ws = workers(&[300 * MIB, 300 * MIB]);
    let e = plan(&m, &ws, &cfg(None)).unwrap_err();
    let msg = e.to_string();
    let PlanError::DoesNotFit(nf) = &e else {
        panic!("expected DoesNotFit, got {e}")
    };
    assert!(nf.bytes.total > nf.bytes.budget);
    for want in [
        format!(
            "model needs {} on stage {}",
            fmt_bytes(nf.bytes.total),
            nf.stage
        ),
        format!("(worker {}, cpu)", nf.worker),
        "but it has 300.0 MiB free (1.3 GiB total, 10% headroom: 270.0 MiB usable)".to_string(),
        format!("weights {}", fmt_bytes(nf.bytes.weights)),
        format!("KV {}", fmt_bytes(nf.bytes.kv)),
        format!("compute {}", fmt_bytes(nf.bytes.compute)),
        "in all the model needs".to_string(),
        "the workers offer 540.0 MiB after headroom".to_string(),
    ] {
        assert!(msg.contains(&want), "missing '{want}' in: {msg}");
    }

    // Enough in total, but the small worker cannot hold even one layer and the head.
    let ws = workers(&[8 * GIB, 10 * MIB]);
    let e = plan(&m, &ws, &cfg(None)).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("on stage 1 (worker w1, cpu) but it has 10.0 MiB free"),
        "{msg}"
    );
    assert!(
        msg.contains("the best automatic split (layers 23,1)"),
        "{msg}"
    );
    assert!(!msg.contains("in all"), "the total fits: {msg}");
}

#[test]
fn manual_splits_are_honoured_exactly_or_refused() {
    let qwen = model(QWEN);
    let gemma = model(GEMMA);
    let two = workers(&[4 * GIB, 4 * GIB]);
    let three = workers(&[4 * GIB, 4 * GIB, 4 * GIB]);

    let c = cfg(Some(Split::Layers(vec![20, 4])));
    let p = plan(&qwen, &two, &c).unwrap();
    check_plan(&qwen, &two, &c, &p);
    assert_eq!(counts(&p), [20, 4]);

    // llama.cpp's tensor-split rule: stage i ends at ceil(c_i * n_layer).
    for (m, props, want) in [
        (&qwen, vec![3.0, 1.0], vec![18, 6]),
        (&gemma, vec![3.0, 1.0], vec![14, 4]),
        (&gemma, vec![1.0, 1.0, 1.0], vec![6, 6, 6]),
        (&qwen, vec![1.0, 2.0, 1.0], vec![6, 12, 6]),
        (&qwen, vec![0.3, 0.3, 0.4], vec![8, 7, 9]),
    ] {
        let ws = if want.len() == 2 { &two } else { &three };
        let c = cfg(Some(Split::Proportions(props.clone())));
        let p = plan(m, ws, &c).unwrap();
        check_plan(m, ws, &c, &p);
        assert_eq!(counts(&p), want, "--split {props:?}");
        assert!(p.notes.iter().any(|n| n.contains("tensor-split")));
    }

    let refuse = |m: &ModelFile, ws: &[WorkerSpec], split: Split, want: &[&str]| {
        let e = plan(m, ws, &cfg(Some(split.clone()))).unwrap_err();
        assert!(matches!(e, PlanError::Split(_)), "{split:?}: {e}");
        let msg = e.to_string();
        for w in want {
            assert!(msg.contains(w), "{split:?}: missing '{w}' in: {msg}");
        }
    };
    refuse(
        &qwen,
        &two,
        Split::Layers(vec![12, 11]),
        &["12,11", "23", "24"],
    );
    refuse(
        &qwen,
        &two,
        Split::Layers(vec![24, 0]),
        &["stage 1 (worker w1) no layers"],
    );
    refuse(
        &qwen,
        &two,
        Split::Layers(vec![8, 8, 8]),
        &["3 entries", "2 workers"],
    );
    refuse(
        &qwen,
        &two,
        Split::Proportions(vec![1.0]),
        &["1 entries", "2 workers"],
    );
    refuse(&qwen, &two, Split::Proportions(vec![1.0, -1.0]), &["-1"]);
    refuse(
        &qwen,
        &two,
        Split::Proportions(vec![0.0, 0.0]),
        &["no positive entry"],
    );
    refuse(
        &qwen,
        &two,
        Split::Proportions(vec![100.0, 1.0]),
        &["stage 1 (worker w1) no layers", "layers 24,0"],
    );

    // A manual split that does not fit is an error, never quietly rebalanced.
    let ws = workers(&[8 * GIB, 600 * MIB]);
    assert!(plan(&qwen, &ws, &cfg(None)).is_ok());
    let e = plan(&qwen, &ws, &cfg(Some(Split::Layers(vec![1, 23])))).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, PlanError::DoesNotFit(_)), "{msg}");
    assert!(msg.contains("(worker w1, cpu)"), "{msg}");
    assert!(msg.contains("the manual split --counts 1,23"), "{msg}");
}

#[test]
fn more_workers_than_layers_is_an_error() {
    let m = model(GEMMA);
    let ws = workers(&[GIB; 19]);
    let e = plan(&m, &ws, &cfg(None)).unwrap_err();
    assert!(matches!(e, PlanError::TooManyWorkers { .. }));
    let msg = e.to_string();
    assert!(
        msg.contains("19 workers") && msg.contains("18 layers"),
        "{msg}"
    );
    // Exactly one layer each is fine.
    let ws = workers(&[GIB; 18]);
    let p = plan(&m, &ws, &cfg(None)).unwrap();
    assert!(counts(&p).iter().all(|&c| c == 1));
}

#[test]
fn bad_settings_are_refused_before_planning() {
    let m = model(QWEN);
    let ws = workers(&[4 * GIB]);
    let bad = |c: PlanConfig, want: &str| {
        let msg = plan(&m, &ws, &c).unwrap_err().to_string();
        assert!(msg.contains(want), "missing '{want}' in: {msg}");
    };
    bad(
        PlanConfig {
            n_ctx: 65536,
            ..cfg(None)
        },
        "trained context of 32768",
    );
    bad(
        PlanConfig {
            headroom: 1.0,
            ..cfg(None)
        },
        "headroom 1",
    );
    bad(
        PlanConfig {
            n_ubatch: 0,
            ..cfg(None)
        },
        "micro-batch (0)",
    );
    assert!(matches!(
        plan(&m, &[], &cfg(None)),
        Err(PlanError::NoWorkers)
    ));
}

#[test]
fn the_plan_prints_a_table_with_notes_and_round_trips_as_json() {
    let m = model(GEMMA);
    let ws = workers(&[6 * GIB, 2 * GIB]);
    let p = plan(&m, &ws, &cfg(None)).unwrap();
    let text = p.to_string();
    let n_tensors = m.gguf.tensors().len();
    for want in [
        "gemma3, 18 layers",
        "stage  worker  device",
        "w0",
        "w1",
        "embed + layers 0-",
        "+ head",
        "notes:",
        &format!("{n_tensors} tensors"),
        "KV cache: F16 K and V, 2 bytes x (256 + 256) per cell x 4096 ctx x 8 seqs = 32.0 MiB per layer",
        "logits of 512 tokens x 262144 vocab",
        "tied embeddings",
    ] {
        assert!(text.contains(want), "missing '{want}' in:\n{text}");
    }
    let json = serde_json::to_string(&p).unwrap();
    let back: Plan = serde_json::from_str(&json).unwrap();
    assert_eq!(back, p);
}

#[test]
fn sizes_parse_and_print() {
    assert_eq!(parse_size("6GiB").unwrap(), 6 * GIB);
    assert_eq!(parse_size("512MiB").unwrap(), 512 * MIB);
    assert_eq!(parse_size("2G").unwrap(), 2 * GIB);
    assert_eq!(parse_size("1.5GiB").unwrap(), 3 * GIB / 2);
    assert!(parse_size("six").unwrap_err().contains("'six'"));
    assert!(parse_size("6 parsecs").unwrap_err().contains("6 parsecs"));
    assert_eq!(fmt_bytes(3 * GIB / 2), "1.5 GiB");
    assert_eq!(fmt_bytes(300 * MIB), "300.0 MiB");
}
