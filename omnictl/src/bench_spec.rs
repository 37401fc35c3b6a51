//! `omnictl bench-spec`: speculative decoding's speed on a code-rewrite
//! workload (a function in the prompt, one change asked, the whole function
//! answered: the answer repeats most of its prompt), single stream, side by
//! side in one run: an omni cluster of `--stages` stages without drafts and
//! with n-gram drafts (`speculative.n_max` per request, the same cluster),
//! and llama.cpp's `llama-server` without speculation and with each of its
//! `--spec-type ngram-*` kinds (when given). Decode speed is each server's
//! own `timings.predicted_per_second` summed over the prompts (tokens over
//! time after the first token), the median of `--rounds`; the wall column is
//! tokens over each request's whole time. omni's acceptance is its
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
    #[arg(long, default_value_t = 16)]
    pub draft_max: usize,
    /// Most tokens of each answer.
    #[arg(long, default_value_t = 256)]
    pub tokens: usize,
    /// Rounds over the prompts; the median round is reported.
    #[arg(long, short, default_value_t = 3)]
    pub rounds: usize,
}

/// Code-rewrite requests: the answer is the prompt's function with one change.
const PROMPTS: [&str; 3] = [
    "Here is a Python function:\n\n```python\ndef total_price(items, tax_rate):\n    subtotal = 0\n    for item in items:\n        subtotal += item.price * item.quantity\n    discount = 0\n    if subtotal > 100:\n        discount = subtotal * 0.05\n    tax = (subtotal - discount) * tax_rate\n    return round(subtotal - discount + tax, 2)\n```\n\nRaise the discount threshold from 100 to 250 and change nothing else. Reply with the whole function in a code block.",
    "Here is a Rust function:\n\n```rust\nfn parse_pairs(input: &str) -> Vec<(String, i64)> {\n    let mut out = Vec::new();\n    for line in input.lines() {\n        let line = line.trim();\n        if line.is_empty() || line.starts_with('#') {\n            continue;\n        }\n        if let Some((key, value)) = line.split_once('=') {\n            if let Ok(v) = value.trim().parse::<i64>() {\n                out.push((key.trim().to_string(), v));\n            }\n        }\n    }\n    out\n}\n```\n\nMake it skip lines that start with \"//\" as well as '#'. Reply with the whole function in a code block and nothing else.",
    "Here is a JavaScript function:\n\n```javascript\nfunction summarize(orders) {\n  const totals = {};\n  for (const order of orders) {\n    const key = order.customer.toLowerCase();\n    if (!totals[key]) {\n      totals[key] = { count: 0, amount: 0 };\n    }\n    totals[key].count += 1;\n    totals[key].amount += order.amount;\n  }\n  return Object.entries(totals)\n    .sort((a, b) => b[1].amount - a[1].amount)\n    .map(([customer, t]) => `${customer}: ${t.count} orders, ${t.amount.toFixed(2)}`);\n}\n```\n\nRename the variable `totals` to `byCustomer` everywhere. Reply with the whole function in a code block.",
];

/// One server setting's median round.
struct Row {
    name: String,
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
    eprintln!("bench-spec: {name}");
    let listen = format!("127.0.0.1:{}", free_port()?);
    let port = free_port()?;
    let up = UpArgs {
        port,
        ctx: 2048,
        seqs: 1,
        admin_listen: Some(format!("127.0.0.1:{}", free_port()?)),
        ..UpArgs::bench(&a.model, a.stages, "auto", &listen, threads)
    };
    let mut cluster = LocalCluster::start(&up, &path, threads, true)?;
    let result = (|| {
        cluster.wait_ready(&listen, Duration::from_secs(180))?;
        let base = format!("http://127.0.0.1:{port}");
        wait_http(
            &rt,
            &http,
            &format!("{base}/ready"),
            Duration::from_secs(60),
            || match cluster.exited() {
                Some((name, status)) => {
                    anyhow::bail!("{name} {}", omni_telemetry::crash::describe(&status))
                }
                None => Ok(()),
            },
        )?;
        let model = rt.block_on(served_model(&http, &base))?;
        let plain = rt.block_on(measure(&http, &base, &model, Some(0), &a))?;
        let drafted = rt.block_on(measure(&http, &base, &model, Some(a.draft_max), &a))?;
        anyhow::Ok((plain, drafted))
    })();
    cluster.stop();
    let (plain, drafted) = result.with_context(|| format!("benchmark '{name}'"))?;
    rows.push(Row {
        name: format!("{name}, no drafts"),
        ..plain
    });
    rows.push(Row {
        name: format!("{name}, n-gram drafts (n_max {})", a.draft_max),
        ..drafted
    });
    print(&a, &path, threads, &rows);
    Ok(())
}

/// The median round over the prompts (`n_max`: omni's per-request draft
/// setting; None: the server's own).
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
        rounds.push(Row {
            name: String::new(),
            decode: tokens as f64 / decode_s.max(1e-9),
            wall: tokens as f64 / wall_s.max(1e-9),
            tokens,
            drafts: n_max.is_some().then_some((drafted, taken)),
            texts,
        });
    }
    rounds.sort_by(|x, y| x.decode.total_cmp(&y.decode));
    Ok(rounds.swap_remove(rounds.len() / 2))
}

fn print(a: &BenchSpecArgs, model: &std::path::Path, threads: usize, rows: &[Row]) {
    let omni_plain = rows.iter().find(|r| r.name.ends_with("no drafts"));
    let best_llama = rows
        .iter()
        .filter(|r| r.name.starts_with("llama-server --spec-type"))
        .max_by(|x, y| x.decode.total_cmp(&y.decode));
    println!(
        "speculative decoding, code rewrites ({} prompts, up to {} tokens each, greedy, one stream), {} threads per process, median of {} rounds",
        PROMPTS.len(),
        a.tokens,
        threads,
        a.rounds
    );
    println!("model: {}", model.display());
    println!(
        "{:<58} {:>9} {:>9} {:>7} {:>12} {:>12} {:>14}",
        "server", "decode/s", "wall/s", "tokens", "vs omni", "vs llama", "drafts taken"
    );
    for r in rows {
        let ratio = |base: Option<&Row>| {
            base.map_or("-".to_string(), |b| format!("{:.2}x", r.decode / b.decode))
        };
        let drafts = match r.drafts {
            Some((d, t)) if d > 0 => format!("{:.0}% of {d}", 100.0 * t as f64 / d as f64),
            _ => "-".into(),
        };
        println!(
            "{:<58} {:>9.1} {:>9.1} {:>7} {:>12} {:>12} {:>14}",
            r.name,
            r.decode,
            r.wall,
            r.tokens,
            ratio(omni_plain),
            ratio(best_llama),
            drafts
        );
    }
    if let (Some(plain), Some(drafted)) = (omni_plain, rows.last()) {
        let same = plain
            .texts
            .iter()
            .zip(&drafted.texts)
            .filter(|(x, y)| x == y)
            .count();
        println!(
            "omni's answers with drafts equal those without: {same} of {}",
            plain.texts.len()
        );
    }
    if let Some(b) = best_llama {
        println!("llama-server's best n-gram kind here: {}", b.name);
    }
}
