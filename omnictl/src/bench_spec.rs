//! `omnictl bench-spec`: speculative decoding's speed on a code-rewrite
//! workload (a function in the prompt, one change asked, the whole function
//! answered: the answer repeats most of its prompt), single stream, side by
//! side in one run: an omni cluster of `--stages` stages without drafts and
//! with n-gram drafts (`speculative.n_max` per request, the same cluster),
//! and llama.cpp's `llama-server` without speculation and with each of its
//! `--spec-type ngram-*` kinds (when given). Decode speed is each server's
//! own `timings` summed over the prompts (tokens over time after the first
//! token); the wall columns are tokens over each request's whole time.
//! Each server's first round sees every prompt for the first time; later
//! rounds repeat them (the median one is reported), which a drafter that
//! remembers earlier answers (llama-server's `ngram-mod` table, omni's
//! recent sequences) drafts whole. omni's acceptance is its
//! `timings.draft_n_accepted` over `draft_n`.

use crate::bench_cluster::free_port;
use crate::bench_serve::{answer, served_model, setup, wait_http, LlamaServer};
use crate::up::{LocalCluster, UpArgs};
use anyhow::Context;
use clap::Args;
use std::path::PathBuf;
use std::time::{Duration, Instant};

#[derive(Args, Debug)]
pub struct BenchSpecArgs {
    /// GGUF path or known model name (default: Qwen2.5-Coder 0.5B).
    #[arg(long, short, default_value = "qwen2.5-coder-0.5b")]
    pub model: String,
    /// llama.cpp's llama-server binary, the reference (built by
    /// `scripts/llama-bench portable server`); without it only omni runs.
    #[arg(long)]
    pub llama_server: Option<PathBuf>,
    /// llama-server's speculative kinds to run (each a server of its own,
    /// its defaults; `ngram-simple` also with omni's n-gram sizes).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "ngram-simple,ngram-map-k,ngram-mod"
    )]
    pub llama_spec_types: Vec<String>,
    /// Stages of the omni cluster.
    #[arg(long, default_value_t = 2)]
    pub stages: usize,
    /// Compute threads of every process (default: every core).
    #[arg(long, short = 't')]
    pub threads: Option<usize>,
    /// Most draft tokens a step verifies (omni's `speculative.n_max`,
    /// llama-server's `--draft-max`).
    #[arg(long, default_value_t = 64)]
    pub draft_max: usize,
    /// A draft model (GGUF path or known name, the model's vocabulary):
    /// omni and llama-server (`-md`, `--spec-type draft-simple`) draft with
    /// it too, each a server of its own.
    #[arg(long)]
    pub model_draft: Option<String>,
    /// Most tokens of each answer.
    #[arg(long, default_value_t = 256)]
    pub tokens: usize,
    /// Rounds over the prompts: the first, and the median of the others.
    #[arg(long, short, default_value_t = 3)]
    pub rounds: usize,
}

/// Code-rewrite requests: the answer is the prompt's function with one change.
const PROMPTS: [&str; 3] = [
    "Here is a Python function:\n\n```python\ndef total_price(items, tax_rate):\n    subtotal = 0\n    for item in items:\n        subtotal += item.price * item.quantity\n    discount = 0\n    if subtotal > 100:\n        discount = subtotal * 0.05\n    tax = (subtotal - discount) * tax_rate\n    return round(subtotal - discount + tax, 2)\n```\n\nRaise the discount threshold from 100 to 250 and change nothing else. Reply with the whole function in a code block.",
    "Here is a Rust function:\n\n```rust\nfn parse_pairs(input: &str) -> Vec<(String, i64)> {\n    let mut out = Vec::new();\n    for line in input.lines() {\n        let line = line.trim();\n        if line.is_empty() || line.starts_with('#') {\n            continue;\n        }\n        if let Some((key, value)) = line.split_once('=') {\n            if let Ok(v) = value.trim().parse::<i64>() {\n                out.push((key.trim().to_string(), v));\n            }\n        }\n    }\n    out\n}\n```\n\nMake it skip lines that start with \"//\" as well as '#'. Reply with the whole function in a code block and nothing else.",
    "Here is a JavaScript function:\n\n```javascript\nfunction summarize(orders) {\n  const totals = {};\n  for (const order of orders) {\n    const key = order.customer.toLowerCase();\n    if (!totals[key]) {\n      totals[key] = { count: 0, amount: 0 };\n    }\n    totals[key].count += 1;\n    totals[key].amount += order.amount;\n  }\n  return Object.entries(totals)\n    .sort((a, b) => b[1].amount - a[1].amount)\n    .map(([customer, t]) => `${customer}: ${t.count} orders, ${t.amount.toFixed(2)}`);\n}\n```\n\nRename the variable `totals` to `byCustomer` everywhere. Reply with the whole function in a code block.",
];

/// One server setting's first round and the median of its repeats.
struct Row {
    name: String,
    first: Round,
    again: Option<Round>,
}

/// One round over the prompts.
struct Round {
    /// Decode tokens per second (the servers' own timings).
    decode: f64,
    /// Tokens over the requests' wall time.
    wall: f64,
    tokens: u64,
    /// (drafted, taken), omni only.
    drafts: Option<(u64, u64)>,
    /// The answers' texts (greedy), to compare omni's with and without drafts.
    texts: Vec<String>,
}

pub fn run(a: BenchSpecArgs) -> anyhow::Result<()> {
    let path = crate::resolve_model(&a.model)?;
    anyhow::ensure!(a.rounds >= 1, "--rounds must be at least 1");
    let (threads, rt, http) = setup(a.threads, Duration::from_secs(900))?;
    let mut rows = Vec::new();

    if let Some(bin) = &a.llama_server {
        let draft = a.draft_max.to_string();
        let mut settings: Vec<(String, Vec<String>)> = vec![("llama-server".into(), Vec::new())];
        for t in &a.llama_spec_types {
            // Each kind with its own defaults (this llama.cpp removed
            // --draft-max for per-kind sizes).
            let flags = vec!["--spec-type".to_string(), t.clone()];
            settings.push((format!("llama-server --spec-type {t}"), flags));
            if t == "ngram-simple" {
                let ours = omni_engine::speculative::DEFAULT_NGRAM.to_string();
                let flags = vec![
                    "--spec-type".into(),
                    t.clone(),
                    "--spec-ngram-simple-size-n".into(),
                    ours.clone(),
                    "--spec-ngram-simple-size-m".into(),
                    draft.clone(),
                ];
                settings.push((
                    format!("llama-server --spec-type {t} (n {ours}, m {draft})"),
                    flags,
                ));
            }
        }
        if let Some(d) = &a.model_draft {
            let draft = crate::resolve_model(d)?;
            settings.push((
                "llama-server --spec-type draft-simple (-md)".into(),
                vec![
                    "--spec-type".into(),
                    "draft-simple".into(),
                    "-md".into(),
                    draft.display().to_string(),
                    "--spec-draft-n-max".into(),
                    a.draft_max.to_string(),
                ],
            ));
        }
        for (name, flags) in settings {
            eprintln!("bench-spec: {name}");
            let port = free_port()?;
            let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
            let mut server = LlamaServer::start(bin, &path, port, threads, 1, &flags)?;
            let base = format!("http://127.0.0.1:{port}");
            let result = server
                .wait_ready(&rt, &http, &base)
                .and_then(|_| rt.block_on(measure(&http, &base, "auto", None, &a)));
            server.stop();
            // A kind this server does not run is reported, not fatal.
            match result {
                Ok(r) => rows.push(Row {
                    name: name.clone(),
                    ..r
                }),
                Err(e) => eprintln!("bench-spec: {name} did not run: {e:#}"),
            }
        }
    }

    let name = format!(
        "omni {} stage{}",
        a.stages,
        if a.stages == 1 { "" } else { "s" }
    );
    // Drafts first: their first round must not find the prompts' answers
    // among the recent sequences.
    let runs = omni(&a, &path, threads, &rt, &http, None, &[a.draft_max, 0])
        .with_context(|| format!("benchmark '{name}'"))?;
    let mut runs = runs.into_iter();
    let (drafted, plain) = (runs.next(), runs.next());
    let (Some(drafted), Some(plain)) = (drafted, plain) else {
        anyhow::bail!("benchmark '{name}' measured nothing");
    };
    rows.push(Row {
        name: format!("{name}, no drafts"),
        ..plain
    });
    rows.push(Row {
        name: format!("{name}, n-gram drafts (n_max {})", a.draft_max),
        ..drafted
    });
    if let Some(d) = &a.model_draft {
        let draft = crate::resolve_model(d)?;
        let by_model = omni(&a, &path, threads, &rt, &http, Some(&draft), &[a.draft_max])
            .with_context(|| format!("benchmark '{name}' with a draft model"))?;
        for r in by_model {
            rows.push(Row {
                name: format!("{name}, draft model (n_max {})", a.draft_max),
                ..r
            });
        }
    }
    print(&a, &path, threads, &rows);
    Ok(())
}

/// An omni cluster of `a.stages` stages (with `draft` as its draft model),
/// measured once per `n_max` (the requests' `speculative.n_max`), in order.
fn omni(
    a: &BenchSpecArgs,
    path: &std::path::Path,
    threads: usize,
    rt: &tokio::runtime::Runtime,
    http: &reqwest::Client,
    draft: Option<&std::path::Path>,
    n_maxes: &[usize],
) -> anyhow::Result<Vec<Row>> {
    eprintln!(
        "bench-spec: omni {} stages{}",
        a.stages,
        draft.map_or(String::new(), |d| format!(", draft model {}", d.display()))
    );
    let listen = format!("127.0.0.1:{}", free_port()?);
    let port = free_port()?;
    let up = UpArgs {
        port,
        ctx: 2048,
        seqs: 1,
        admin_listen: Some(format!("127.0.0.1:{}", free_port()?)),
        model_draft: draft.map(|d| d.display().to_string()),
        ..UpArgs::bench(&a.model, a.stages, "auto", &listen, threads)
    };
    let mut cluster = LocalCluster::start(&up, path, threads, true)?;
    let result = (|| {
        cluster.wait_ready(&listen, Duration::from_secs(180))?;
        let base = format!("http://127.0.0.1:{port}");
        wait_http(
            rt,
            http,
            &format!("{base}/ready"),
            Duration::from_secs(60),
            || match cluster.exited() {
                Some((name, status)) => {
                    anyhow::bail!("{name} {}", omni_telemetry::crash::describe(&status))
                }
                None => Ok(()),
            },
        )?;
        let model = rt.block_on(served_model(http, &base))?;
        n_maxes
            .iter()
            .map(|&n| rt.block_on(measure(http, &base, &model, Some(n), a)))
            .collect::<anyhow::Result<Vec<Row>>>()
    })();
    cluster.stop();
    result
}

/// The first round over the prompts and the median of the others (`n_max`:
/// omni's per-request draft setting; None: the server's own).
async fn measure(
    http: &reqwest::Client,
    base: &str,
    model: &str,
    n_max: Option<usize>,
    a: &BenchSpecArgs,
) -> anyhow::Result<Row> {
    let ask = |prompt: &str| {
        let mut body = serde_json::json!({
            "model": model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": a.tokens,
            "temperature": 0,
            "cache_prompt": false,
        });
        if let Some(n) = n_max {
            body["speculative.n_max"] = n.into();
        }
        http.post(format!("{base}/v1/chat/completions")).json(&body)
    };
    // A warm-up request: the first one pays for page faults and caches.
    answer(ask("Say hello.")).await?;
    let mut rounds = Vec::new();
    for _ in 0..a.rounds {
        let (mut tokens, mut decode_s, mut wall_s) = (0u64, 0.0, 0.0);
        let (mut drafted, mut taken) = (0u64, 0u64);
        let mut texts = Vec::new();
        for p in PROMPTS {
            let t = Instant::now();
            let v = answer(ask(p)).await?;
            wall_s += t.elapsed().as_secs_f64();
            let n = v["usage"]["completion_tokens"]
                .as_u64()
                .with_context(|| format!("no usage.completion_tokens in {v}"))?;
            let tm = &v["timings"];
            let ms = tm["predicted_ms"]
                .as_f64()
                .with_context(|| format!("no timings.predicted_ms in {v}"))?;
            tokens += n;
            // The first token's time is the prompt's in both servers.
            decode_s += ms / 1e3;
            drafted += tm["draft_n"].as_u64().unwrap_or(0);
            taken += tm["draft_n_accepted"].as_u64().unwrap_or(0);
            texts.push(
                v["choices"][0]["message"]["content"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
            );
        }
        rounds.push(Round {
            decode: tokens as f64 / decode_s.max(1e-9),
            wall: tokens as f64 / wall_s.max(1e-9),
            tokens,
            drafts: n_max.is_some().then_some((drafted, taken)),
            texts,
        });
    }
    let first = rounds.remove(0);
    rounds.sort_by(|x, y| x.decode.total_cmp(&y.decode));
    let again = (!rounds.is_empty()).then(|| rounds.swap_remove(rounds.len() / 2));
    Ok(Row {
        name: String::new(),
        first,
        again,
    })
}

fn print(a: &BenchSpecArgs, model: &std::path::Path, threads: usize, rows: &[Row]) {
    let omni_plain = rows.iter().find(|r| r.name.ends_with("no drafts"));
    let best_llama = |f: fn(&Row) -> Option<&Round>| {
        rows.iter()
            .filter(|r| r.name.starts_with("llama-server --spec-type"))
            .filter_map(f)
            .max_by(|x, y| x.decode.total_cmp(&y.decode))
    };
    println!(
        "speculative decoding, code rewrites ({} prompts, up to {} tokens each, greedy, one stream), {} threads per process; first: every prompt new to the server; again: the median of {} repeats",
        PROMPTS.len(),
        a.tokens,
        threads,
        a.rounds - 1
    );
    println!("model: {}", model.display());
    let table = |title: &str, pick: fn(&Row) -> Option<&Round>| {
        let best = best_llama(pick);
        println!("{title}");
        println!(
            "{:<58} {:>9} {:>9} {:>7} {:>10} {:>11} {:>14}",
            "server", "decode/s", "wall/s", "tokens", "vs omni", "vs llama's", "drafts taken"
        );
        for r in rows {
            let Some(x) = pick(r) else { continue };
            let ratio = |base: Option<&Round>| {
                base.map_or("-".to_string(), |b| format!("{:.2}x", x.decode / b.decode))
            };
            let drafts = match x.drafts {
                Some((d, t)) if d > 0 => format!("{:.0}% of {d}", 100.0 * t as f64 / d as f64),
                _ => "-".into(),
            };
            println!(
                "{:<58} {:>9.1} {:>9.1} {:>7} {:>10} {:>11} {:>14}",
                r.name,
                x.decode,
                x.wall,
                x.tokens,
                ratio(omni_plain.and_then(pick)),
                ratio(best),
                drafts
            );
        }
        if let Some(b) = best.and_then(|b| {
            rows.iter()
                .find(|r| pick(r).is_some_and(|x| std::ptr::eq(x, b)))
        }) {
            println!("(vs llama's: its best n-gram kind here, {})", b.name);
        }
    };
    table("first round:", |r| Some(&r.first));
    if a.rounds > 1 {
        table("again:", |r| r.again.as_ref());
    }
    let Some(plain) = omni_plain else { return };
    for drafted in rows
        .iter()
        .filter(|r| r.name.starts_with("omni") && r.first.drafts.is_some_and(|(d, _)| d > 0))
    {
        let mut pairs: Vec<(&String, &String)> =
            plain.first.texts.iter().zip(&drafted.first.texts).collect();
        if let (Some(x), Some(y)) = (&plain.again, &drafted.again) {
            pairs.extend(x.texts.iter().zip(&y.texts));
        }
        let same = pairs.iter().filter(|(x, y)| x == y).count();
        println!(
            "{}: answers equal those without drafts: {same} of {}",
            drafted.name,
            pairs.len()
        );
    }
}
