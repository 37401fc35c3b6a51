use omni_engine::sampling::*;

fn params() -> SamplingParams {
    SamplingParams::default()
}

fn seeded(temperature: f32, seed: u64) -> SamplingParams {
    SamplingParams {
        temperature,
        seed: Some(seed),
        ..params()
    }
}

/// Deterministic pseudo-random logits (an LCG), so runs are comparable without a RNG crate.
fn logits_sequence(steps: usize, n_vocab: usize) -> Vec<Vec<f32>> {
    let mut state: u64 = 0x2545_f491_4f6c_dd1d;
    (0..steps)
        .map(|_| {
            (0..n_vocab)
                .map(|_| {
                    state = state
                        .wrapping_mul(6_364_136_223_846_793_005)
                        .wrapping_add(1_442_695_040_888_963_407);
                    ((state >> 40) as f32 / (1u64 << 24) as f32) * 6.0 - 3.0
                })
                .collect()
        })
        .collect()
}

fn generate(p: SamplingParams, steps: &[Vec<f32>]) -> Vec<u32> {
    let mut sampler = Sampler::new(p);
    let mut history = Vec::new();
    for logits in steps {
        let token = sampler.sample(logits, &history);
        history.push(token);
    }
    history
}

#[test]
fn greedy_ties_go_to_lowest_id() {
    assert_eq!(greedy(&[1.0, 3.0, 2.0, 3.0]), 1);
    assert_eq!(greedy(&[f32::NEG_INFINITY; 4]), 0);
    assert_eq!(
        Sampler::new(params()).sample(&[0.5, 2.0, 2.0, -1.0], &[]),
        1
    );
}

#[test]
fn greedy_ignores_seed() {
    let steps = logits_sequence(20, 32);
    let expected: Vec<u32> = steps.iter().map(|l| greedy(l)).collect();
    assert_eq!(generate(seeded(0.0, 1), &steps), expected);
    assert_eq!(generate(seeded(0.0, 2), &steps), expected);
    assert_eq!(
        generate(
            SamplingParams {
                temperature: 1e-7,
                ..params()
            },
            &steps
        ),
        expected
    );
}

#[test]
fn same_seed_same_tokens_different_seed_different_tokens() {
    let steps = logits_sequence(50, 32);
    let p = |seed| SamplingParams {
        top_k: 20,
        top_p: 0.95,
        min_p: 0.01,
        repeat_penalty: 1.1,
        ..seeded(1.0, seed)
    };
    let a = generate(p(42), &steps);
    assert_eq!(a, generate(p(42), &steps));
    assert_ne!(a, generate(p(43), &steps));
    // Sampling really samples: not just the greedy path.
    assert_ne!(a, generate(seeded(0.0, 42), &steps));
}

#[test]
fn top_k_one_is_argmax() {
    let steps = logits_sequence(30, 64);
    let p = SamplingParams {
        top_k: 1,
        ..seeded(1.5, 7)
    };
    let mut sampler = Sampler::new(p);
    for logits in &steps {
        assert_eq!(sampler.sample(logits, &[]), greedy(logits));
    }
    // A tie at the top keeps the lowest id only.
    assert_eq!(sampler.sample(&[1.0, 4.0, 4.0], &[]), 1);
}

#[test]
fn tiny_top_p_and_full_min_p_are_argmax() {
    let steps = logits_sequence(30, 64);
    let mut by_top_p = Sampler::new(SamplingParams {
        top_p: 1e-6,
        ..seeded(2.0, 3)
    });
    let mut by_min_p = Sampler::new(SamplingParams {
        min_p: 1.0,
        ..seeded(2.0, 3)
    });
    for logits in &steps {
        assert_eq!(by_top_p.sample(logits, &[]), greedy(logits));
        assert_eq!(by_min_p.sample(logits, &[]), greedy(logits));
    }
}

#[test]
fn logit_bias_forces_and_bans() {
    let logits = [5.0, 1.0, 0.0, 2.0];
    let force = SamplingParams {
        logit_bias: vec![(2, 100.0)],
        ..seeded(1.0, 5)
    };
    let mut sampler = Sampler::new(force);
    for _ in 0..100 {
        assert_eq!(sampler.sample(&logits, &[]), 2);
    }
    let ban = SamplingParams {
        logit_bias: vec![(0, -100.0)],
        ..params()
    };
    assert_eq!(Sampler::new(ban).sample(&logits, &[]), 3);
}

#[test]
fn repeat_penalty_divides_positive_and_multiplies_negative() {
    // Values chosen to be exact in binary, so the adjusted logits compare with ==.
    let logits = [2.0, 1.5, -1.0, 0.5];
    let p = SamplingParams {
        repeat_penalty: 2.0,
        ..params()
    };
    let mut sampler = Sampler::new(p);
    assert_eq!(
        sampler.adjusted_logits(&logits, &[0, 0, 2]),
        &[1.0, 1.5, -2.0, 0.5]
    );
    assert_eq!(greedy(&logits), 0);
    assert_eq!(sampler.sample(&logits, &[0, 0, 2]), 1);
}

#[test]
fn frequency_and_presence_penalties_follow_openai() {
    let logits = [2.0, 1.5, -1.0, 0.5];
    // logit -= count * frequency + (count > 0) * presence
    let p = SamplingParams {
        frequency_penalty: 0.25,
        presence_penalty: 0.5,
        ..params()
    };
    let mut sampler = Sampler::new(p);
    assert_eq!(
        sampler.adjusted_logits(&logits, &[0, 2, 0]),
        &[1.0, 1.5, -1.75, 0.5]
    );
    assert_eq!(sampler.sample(&logits, &[0, 2, 0]), 1);

    let only_presence = SamplingParams {
        presence_penalty: 1.0,
        ..params()
    };
    assert_eq!(
        Sampler::new(only_presence).adjusted_logits(&logits, &[0]),
        &[1.0, 1.5, -1.0, 0.5]
    );
}

#[test]
fn penalties_combine_and_respect_window() {
    let logits = [2.0, 1.5, -1.0, 0.5];
    let p = SamplingParams {
        repeat_penalty: 2.0,
        frequency_penalty: 0.25,
        presence_penalty: 0.5,
        ..params()
    };
    // token 0 (twice): 2/2 - 2*0.25 - 0.5 = 0; token 2 (once): -1*2 - 0.25 - 0.5 = -2.75
    assert_eq!(
        Sampler::new(p.clone()).adjusted_logits(&logits, &[0, 0, 2]),
        &[0.0, 1.5, -2.75, 0.5]
    );
    // Only the last 2 tokens count: token 1 once.
    let windowed = SamplingParams {
        repeat_last_n: 2,
        ..p
    };
    assert_eq!(
        Sampler::new(windowed).adjusted_logits(&logits, &[0, 0, 1, 3]),
        &[2.0, 0.0, -1.0, -0.5]
    );
}

#[test]
fn empirical_distribution_matches_softmax() {
    let logits = [0.5f32.ln(), 0.3f32.ln(), 0.2f32.ln()];
    let mut sampler = Sampler::new(seeded(1.0, 1234));
    let mut counts = [0usize; 3];
    let draws = 20_000;
    for _ in 0..draws {
        counts[sampler.sample(&logits, &[]) as usize] += 1;
    }
    for (count, expected) in counts.iter().zip([0.5, 0.3, 0.2]) {
        let freq = *count as f64 / draws as f64;
        assert!((freq - expected).abs() < 0.02, "{counts:?}");
    }
}

#[test]
fn temperature_sharpens_distribution() {
    let logits = [0.5f32.ln(), 0.3f32.ln(), 0.2f32.ln()];
    let mut sampler = Sampler::new(seeded(0.25, 9));
    let top = (0..5000)
        .filter(|_| sampler.sample(&logits, &[]) == 0)
        .count();
    // p0 at T=0.25 is 0.5^4 / (0.5^4 + 0.3^4 + 0.2^4) = 0.8658
    assert!((top as f64 / 5000.0 - 0.8658).abs() < 0.03, "{top}");
}

#[test]
fn logprobs_match_hand_computation() {
    let logits = [1.0, 2.0, 3.0];
    // log-sum-exp = 3 + ln(1 + e^-1 + e^-2) = 3.4076059644...
    let lse = 3.407_605_964_444_38_f64;
    let top = top_logprobs(&logits, 3);
    let expected = [(2, 3.0 - lse), (1, 2.0 - lse), (0, 1.0 - lse)];
    for ((id, lp), (eid, elp)) in top.iter().zip(expected) {
        assert_eq!(*id, eid);
        assert!((f64::from(*lp) - elp).abs() < 1e-6, "{top:?}");
    }
    let total: f32 = top.iter().map(|(_, lp)| lp.exp()).sum();
    assert!(total <= 1.0 + 1e-6 && total > 0.999);
    assert_eq!(top_logprobs(&logits, 2).len(), 2);
    assert!((f64::from(logprob_of(&logits, 1)) - (2.0 - lse)).abs() < 1e-6);
    assert_eq!(logprob_of(&logits, 7), f32::NEG_INFINITY);
}

#[test]
fn logprobs_are_stable_and_ordered() {
    // Huge logits would overflow a naive exp; ties sort by id.
    let logits = [1000.0, 1000.0, 999.0, f32::NAN];
    let top = top_logprobs(&logits, 4);
    assert_eq!(top.iter().map(|t| t.0).collect::<Vec<_>>(), [0, 1, 2, 3]);
    assert!((top[0].1 - top[1].1).abs() < 1e-9 && top[0].1.is_finite());
    let sum: f32 = top.iter().map(|(_, lp)| lp.exp()).sum();
    assert!(sum <= 1.0 + 1e-6 && sum > 0.999);
    assert_eq!(top[3].1, f32::NEG_INFINITY);
}

#[test]
fn top_k_logits_sorted_by_logit_then_id() {
    let logits = [0.5, 2.0, -1.0, 2.0, 1.0, 0.5];
    assert_eq!(
        top_k_logits(&logits, 4),
        [(1, 2.0), (3, 2.0), (4, 1.0), (0, 0.5)]
    );
    assert_eq!(top_k_logits(&logits, 10).len(), 6);
    assert!(top_k_logits(&logits, 0).is_empty());
}

#[test]
fn validate_rejects_each_bad_field() {
    assert!(params().validate(10).is_ok());
    let cases: Vec<(SamplingParams, &str)> = vec![
        (
            SamplingParams {
                temperature: -0.1,
                ..params()
            },
            "temperature",
        ),
        (
            SamplingParams {
                temperature: f32::NAN,
                ..params()
            },
            "temperature",
        ),
        (
            SamplingParams {
                temperature: f32::INFINITY,
                ..params()
            },
            "temperature",
        ),
        (
            SamplingParams {
                top_p: 0.0,
                ..params()
            },
            "top_p",
        ),
        (
            SamplingParams {
                top_p: 1.5,
                ..params()
            },
            "top_p",
        ),
        (
            SamplingParams {
                min_p: -0.1,
                ..params()
            },
            "min_p",
        ),
        (
            SamplingParams {
                min_p: 1.1,
                ..params()
            },
            "min_p",
        ),
        (
            SamplingParams {
                repeat_penalty: 0.0,
                ..params()
            },
            "repeat_penalty",
        ),
        (
            SamplingParams {
                presence_penalty: 2.5,
                ..params()
            },
            "presence_penalty",
        ),
        (
            SamplingParams {
                frequency_penalty: -2.5,
                ..params()
            },
            "frequency_penalty",
        ),
        (
            SamplingParams {
                logit_bias: vec![(10, 1.0)],
                ..params()
            },
            "logit_bias",
        ),
        (
            SamplingParams {
                logit_bias: vec![(1, f32::NAN)],
                ..params()
            },
            "logit_bias",
        ),
        (
            SamplingParams {
                logit_bias: vec![(1, 100.5)],
                ..params()
            },
            "logit_bias",
        ),
    ];
    for (p, field) in cases {
        let err = p.validate(10).expect_err(field).to_string();
        assert!(err.contains(field), "{err}");
    }
    let err = SamplingParams {
        top_p: 1.5,
        ..params()
    }
    .validate(10)
    .unwrap_err()
    .to_string();
    assert!(err.contains("1.5") && err.contains("(0, 1]"), "{err}");
    let ok = SamplingParams {
        top_k: u32::MAX,
        logit_bias: vec![(9, -100.0), (0, 100.0)],
        ..params()
    };
    assert!(ok.validate(10).is_ok());
}

#[test]
fn params_default_and_serde() {
    let p: SamplingParams = serde_json::from_str(r#"{"temperature": 0.7, "seed": 3}"#).unwrap();
    assert_eq!(
        p,
        SamplingParams {
            temperature: 0.7,
            seed: Some(3),
            ..params()
        }
    );
    assert_eq!(params().temperature, 0.0);
    assert_eq!(params().repeat_last_n, 64);
}

#[test]
fn nan_logits_do_not_panic() {
    let logits = [f32::NAN, 1.0, f32::NAN, 0.5];
    assert_eq!(greedy(&logits), 1);
    assert_eq!(Sampler::new(params()).sample(&logits, &[]), 1);
    let mut sampler = Sampler::new(SamplingParams {
        top_k: 3,
        top_p: 0.9,
        min_p: 0.05,
        ..seeded(1.0, 1)
    });
    for _ in 0..50 {
        assert!([1, 3].contains(&sampler.sample(&logits, &[1, 1])));
    }
    assert_eq!(sampler.sample(&[f32::NAN; 3], &[]), 0);
    let _ = (
        top_logprobs(&[f32::NAN; 3], 2),
        top_k_logits(&[f32::NAN; 3], 2),
        logprob_of(&[f32::NAN], 0),
    );
}

fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
    let mut m = StopMatcher::new(stops.iter().map(|s| s.to_string()).collect());
    let mut out = String::new();
    for piece in pieces {
        let o = m.push(piece);
        out += &o.text;
        if o.stopped {
            return (out, true);
        }
    }
    out += &m.finish();
    (out, false)
}

#[test]
fn stop_split_across_three_pieces_never_leaks() {
    let mut m = StopMatcher::new(vec!["<|end|>".into()]);
    assert_eq!(
        m.push("Hello <|"),
        StopOutput {
            text: "Hello ".into(),
            stopped: false
        }
    );
    assert_eq!(
        m.push("en"),
        StopOutput {
            text: "".into(),
            stopped: false
        }
    );
    assert_eq!(
        m.push("d|> trailing"),
        StopOutput {
            text: "".into(),
            stopped: true
        }
    );
    assert_eq!(m.push("more"), StopOutput::default());
    assert_eq!(m.finish(), "");
}

#[test]
fn partial_match_that_is_not_a_stop_is_emitted_in_full() {
    let mut m = StopMatcher::new(vec!["STOP".into()]);
    assert_eq!(m.push("a ST").text, "a ");
    assert_eq!(m.push("OR").text, "STOR");
    assert_eq!(m.push("e S").text, "e ");
    assert_eq!(m.finish(), "S");
    assert_eq!(
        run(&["STOP"], &["x S", "TO", "p"]),
        ("x STOp".into(), false)
    );
}

#[test]
fn multiple_stops_earliest_wins() {
    assert_eq!(
        run(
            &["\n\n", "User:", ""],
            &["Answer", " 42.\nUs", "er: hi\n\n"]
        ),
        ("Answer 42.\n".into(), true)
    );
    assert_eq!(run(&["abc", "b"], &["xab", "c"]), ("xa".into(), true));
    // Empty stop strings are ignored rather than stopping at once.
    assert_eq!(run(&[""], &["a", "b"]), ("ab".into(), false));
}

#[test]
fn multibyte_stop_and_char_boundaries() {
    let mut m = StopMatcher::new(vec!["é!".into()]);
    assert_eq!(m.push("caf").text, "caf");
    assert_eq!(m.push("é").text, "");
    assert_eq!(
        m.push("!"),
        StopOutput {
            text: "".into(),
            stopped: true
        }
    );
    assert_eq!(run(&["é!"], &["caf", "é", "?"]), ("café?".into(), false));
    // Stop "éa" shares its first byte (0xC3) with "è": the "è" must not be held or split.
    assert_eq!(StopMatcher::new(vec!["éa".into()]).push("tè").text, "tè");
}

#[test]
fn finish_flushes_held_text() {
    let mut m = StopMatcher::new(vec!["</s>".into()]);
    assert_eq!(m.push("end </").text, "end ");
    assert_eq!(m.finish(), "</");
    assert_eq!(run(&[], &["no ", "stops"]), ("no stops".into(), false));
}

#[test]
fn a_restored_sampler_draws_what_the_original_would_have() {
    let params = SamplingParams {
        temperature: 0.9,
        seed: Some(7),
        ..Default::default()
    };
    let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
    let mut a = Sampler::new(params);
    for _ in 0..5 {
        a.sample(&logits, &[]);
    }
    let json = serde_json::to_string(&a.state()).unwrap();
    let mut b = Sampler::restore(serde_json::from_str(&json).unwrap()).unwrap();
    let from_a: Vec<u32> = (0..20).map(|_| a.sample(&logits, &[])).collect();
    let from_b: Vec<u32> = (0..20).map(|_| b.sample(&logits, &[])).collect();
    assert_eq!(from_a, from_b);
    assert!(from_a.iter().any(|&t| t != from_a[0]), "the draws vary");
}

#[test]
fn a_sampler_that_skips_the_draws_of_earlier_tokens_goes_on_as_the_one_that_drew_them() {
    // A resumed request: its first tokens were sampled by another process;
    // the new sampler, told how many, draws what the first would have next.
    let steps = logits_sequence(48, 64);
    for temperature in [0.0, 0.7, 1.3] {
        let p = seeded(temperature, 1234);
        let whole = generate(p.clone(), &steps);
        for split in [1, 17, 47] {
            let mut s = Sampler::new(p.clone());
            s.skip_draws(split as u64);
            let mut history: Vec<u32> = whole[..split].to_vec();
            let rest: Vec<u32> = steps[split..]
                .iter()
                .map(|l| {
                    let t = s.sample(l, &history);
                    history.push(t);
                    t
                })
                .collect();
            assert_eq!(
                rest,
                whole[split..],
                "temperature {temperature}, {split} tokens skipped"
            );
        }
    }
}
