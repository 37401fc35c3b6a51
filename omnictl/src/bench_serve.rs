//! `omnictl bench-serve`: serving speed through the OpenAI API, side by side
//! in one run: llama.cpp's `llama-server` (the reference, when given) and
//! local omni clusters of 1, 2, 3... stages behind the router. For each:
//! one stream, N concurrent streams (aggregate), and the seeds' chat
//! benchmark (`../shared/seeds/`: three questions, `max_tokens` 256, no
//! streaming, tokens over wall time per request); and for omni, where each
//! stage's time went while N streams ran (computing, sending on, waiting
//! for input) from the workers' Status; and the prefix cache's run: time to
//! first token of turn 10 of a chat with a long shared history, with the
//! server's prompt cache and without (`cache_prompt`). Every row also has
//! its prefill speed (a prompt of about 600 tokens, uncached). With
//! `--deterministic`, each omni cluster runs a second time with
//! `--deterministic on`, and the two modes are compared as ratios.

use crate::bench_cluster::free_port;
use crate::up::{LocalCluster, UpArgs};
use anyhow::Context;
use clap::Args;
use omni_proto::worker::v1::StatusReply;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

#[derive(Args, Debug)]
pub struct BenchServeArgs {
    /// GGUF path or known model name.
    #[arg(long, short)]
    pub model: String,
    /// llama.cpp's llama-server binary, the reference (built by
    /// `scripts/llama-bench portable server`); without it only omni runs.
    #[arg(long)]
    pub llama_server: Option<PathBuf>,
    /// omni clusters to run, by number of stages.
    #[arg(long, value_delimiter = ',', default_value = "1,2,3")]
    pub stages: Vec<usize>,
    /// Compute threads of every process (default: every core).
    #[arg(long, short = 't')]
    pub threads: Option<usize>,
    /// Concurrent streams of the throughput run (and the servers' slots).
    #[arg(long, default_value_t = 8)]
    pub streams: usize,
    /// Tokens each stream generates (ignore_eos) in the 1- and N-stream runs.
    #[arg(long, default_value_t = 64)]
    pub tokens: usize,
    /// Rounds of each run; the best is reported (the chat benchmark: the mean over rounds and prompts).
    #[arg(long, short, default_value_t = 2)]
    pub rounds: usize,
    /// Skip the seeds' chat benchmark (256 tokens, three prompts).
    #[arg(long)]
    pub no_chat: bool,
    /// Skip the stall run (a long prompt arriving while a stream generates).
    #[arg(long)]
    pub no_stall: bool,
    /// Skip the prefix run (turn 10 of a chat with a long history, with
    /// and without the prompt cache).
    #[arg(long)]
    pub no_prefix: bool,
    /// Also run each omni cluster deterministic (`--deterministic on`) and
    /// print its speeds against the default mode's.
    #[arg(long)]
    pub deterministic: bool,
    #[arg(long)]
    pub json: bool,
}

/// The seeds' benchmark prompts (`benchmark_lazarus.py`).
const CHAT_PROMPTS: [&str; 3] = [
    "Explain quantum entanglement in simple terms.",
    "Write a Python function to find prime numbers.",
    "What are the key principles of distributed systems?",
];

/// Prompts of the 1- and N-stream runs, dealt round-robin.
const PROMPTS: [&str; 4] = [
    "The history of the city begins",
    "Write a Python function to find prime numbers.",
    "Explain quantum entanglement in simple terms.",
    "What are the key principles of distributed systems?",
];

/// Context of one sequence in every server.
const CTX: usize = 2048;

struct Row {
    name: String,
    /// Prompt tokens per second of one uncached prompt.
    prefill: f64,
    one: f64,
    many: f64,
    chat: Option<f64>,
    stall: Option<Stall>,
    prefix: Option<Prefix>,
    /// Per stage: (worker, compute, send, input wait), fractions of the wall
    /// time of the N-stream runs.
    timeline: Vec<(String, f64, f64, f64)>,
}

pub fn run(a: BenchServeArgs) -> anyhow::Result<()> {
    let path = crate::resolve_model(&a.model)?;
    anyhow::ensure!(a.streams >= 1, "--streams must be at least 1");
    anyhow::ensure!(
        a.stages.iter().all(|&s| s >= 1),
        "--stages takes stage counts of at least 1"
    );
    let (threads, rt, http) = setup(a.threads, Duration::from_secs(600))?;
    let mut rows = Vec::new();

    if let Some(bin) = &a.llama_server {
        eprintln!("bench-serve: llama-server ({})", bin.display());
        let port = free_port()?;
        let mut server = LlamaServer::start(bin, &path, port, threads, a.streams, &[])?;
        let result = (|| {
            let base = format!("http://127.0.0.1:{port}");
            server.wait_ready(&rt, &http, &base)?;
            rt.block_on(measure(&http, &base, "auto", &a, None))
        })();
        server.stop();
        let m = result.context("benchmark 'llama-server'")?;
        rows.push(Row {
            name: format!("llama-server -np {} -t {threads}", a.streams),
            timeline: Vec::new(),
            ..m
        });
    }

    let modes: &[bool] = if a.deterministic {
        &[false, true]
    } else {
        &[false]
    };
    for (&stages, &det) in a
        .stages
        .iter()
        .flat_map(|s| modes.iter().map(move |d| (s, d)))
    {
        let name = format!(
            "omni {stages} stage{}{}",
            if stages == 1 { "" } else { "s" },
            if det { " deterministic" } else { "" }
        );
        eprintln!("bench-serve: {name}");
        let listen = format!("127.0.0.1:{}", free_port()?);
        let port = free_port()?;
        let up = UpArgs {
            port,
            ctx: CTX,
            seqs: a.streams,
            admin_listen: Some(format!("127.0.0.1:{}", free_port()?)),
            deterministic: det.then(|| "on".to_string()),
            ..UpArgs::bench(&a.model, stages, "auto", &listen, threads)
        };
        let mut cluster = LocalCluster::start(&up, &path, threads, true)?;
        let result = (|| {
            let info = cluster.wait_ready(&listen, Duration::from_secs(180))?;
            let base = format!("http://127.0.0.1:{port}");
            let url = format!("{base}/ready");
            wait_http(
                &rt,
                &http,
                &url,
                Duration::from_secs(60),
                || match cluster.exited() {
                    Some((name, status)) => {
                        anyhow::bail!("{name} {}", omni_telemetry::crash::describe(&status))
                    }
                    None => Ok(()),
                },
            )?;
            let model = rt.block_on(served_model(&http, &base))?;
            rt.block_on(measure(&http, &base, &model, &a, Some(&info)))
        })();
        cluster.stop();
        let m = result.with_context(|| format!("benchmark '{name}'"))?;
        rows.push(Row { name, ..m });
    }
    print(&a, &path, threads, &rows)
}

/// What a serving benchmark starts from: threads per process (default:
/// every core), a runtime, and an HTTP client whose requests may take
/// `timeout`.
pub(crate) fn setup(
    threads: Option<usize>,
    timeout: Duration,
) -> anyhow::Result<(usize, tokio::runtime::Runtime, reqwest::Client)> {
    let threads =
        threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let http = reqwest::Client::builder().timeout(timeout).build()?;
    Ok((threads, rt, http))
}

/// One stream, N streams (with the stages' timeline), the chat benchmark,
/// the stall run.
async fn measure(
    http: &reqwest::Client,
    base: &str,
    model: &str,
    a: &BenchServeArgs,
    cluster: Option<&omni_proto::coordinator::v1::InfoReply>,
) -> anyhow::Result<Row> {
    // A warm-up request: the first one pays for page faults and caches.
    completion(http, base, model, PROMPTS[0], 8).await?;
    let mut prefill = Vec::new();
    for round in 0..a.rounds {
        prefill.push(prefill_rate(http, base, model, round).await?);
    }
    let mut one = Vec::new();
    for _ in 0..a.rounds {
        let t = Instant::now();
        let n = completion(http, base, model, PROMPTS[0], a.tokens).await?;
        one.push(n as f64 / t.elapsed().as_secs_f64());
    }
    let before = match cluster {
        Some(info) => Some(crate::remote::statuses(info).await?),
        None => None,
    };
    let mut many = Vec::new();
    for _ in 0..a.rounds {
        let t = Instant::now();
        let runs = (0..a.streams)
            .map(|i| completion(http, base, model, PROMPTS[i % PROMPTS.len()], a.tokens));
        let n: usize = futures_sum(runs).await?;
        many.push(n as f64 / t.elapsed().as_secs_f64());
    }
    let timeline = match (cluster, before) {
        (Some(info), Some(before)) => {
            let after = crate::remote::statuses(info).await?;
            timeline(&before, &after)
        }
        _ => Vec::new(),
    };
    let chat = if a.no_chat {
        None
    } else {
        let mut rates = Vec::new();
        for _ in 0..a.rounds {
            for p in CHAT_PROMPTS {
                rates.push(chat(http, base, model, p).await?);
            }
        }
        Some(rates.iter().sum::<f64>() / rates.len() as f64)
    };
    let stall = if a.no_stall {
        None
    } else {
        let mut runs = Vec::new();
        for round in 0..a.rounds {
            runs.push(stall(http, base, model, round).await?);
        }
        // The round whose stream was held up least.
        runs.into_iter()
            .min_by(|x, y| x.longest_ms.total_cmp(&y.longest_ms))
    };
    let prefix = if a.no_prefix {
        None
    } else {
        let mut runs = Vec::new();
        for round in 0..a.rounds {
            runs.push(prefix(http, base, model, round).await?);
        }
        // The round with the fastest cached turn.
        runs.into_iter()
            .min_by(|x, y| x.cached_ms.total_cmp(&y.cached_ms))
    };
    let best = |v: &[f64]| v.iter().copied().fold(0.0, f64::max);
    Ok(Row {
        name: String::new(),
        prefill: best(&prefill),
        one: best(&one),
        many: best(&many),
        chat,
        stall,
        prefix,
        timeline,
    })
}

/// Turn 10 of a chat whose history the server has seen.
struct Prefix {
    prompt_tokens: usize,
    /// What the server says it took from its cache (when it says).
    cached_tokens: Option<usize>,
    /// Time to first token (a request for one token) with the prompt
    /// cache and without it.
    cached_ms: f64,
    uncached_ms: f64,
}

/// Turns before the measured one.
const PREFIX_TURNS: usize = 9;

/// The prefix run: a system prompt of about 900 tokens, then 9 turns (a
/// question, 32 greedy tokens of answer, kept in the history), then turn
/// 10 asked for one token twice: with `cache_prompt` (omni's prefix cache,
/// llama-server's slot cache; both on by default) and with `cache_prompt:
/// false`. The request time of one token is the time to first token.
async fn prefix(
    http: &reqwest::Client,
    base: &str,
    model: &str,
    round: usize,
) -> anyhow::Result<Prefix> {
    // A different first word each round, so no round finds an earlier one's.
    let system = format!(
        "Round {round}. You answer questions about these topics. {}",
        CHAT_PROMPTS.join(" ").repeat(32)
    );
    let mut messages = vec![serde_json::json!({"role": "system", "content": system})];
    let question = |turn: usize| {
        format!(
            "Question {turn}: {}",
            CHAT_PROMPTS[turn % CHAT_PROMPTS.len()]
        )
    };
    let ask = |messages: &Vec<serde_json::Value>, max_tokens: usize, cache: bool| {
        http.post(format!("{base}/v1/chat/completions"))
            .json(&serde_json::json!({
                "model": model, "messages": messages, "max_tokens": max_tokens,
                "temperature": 0, "cache_prompt": cache,
            }))
    };
    for turn in 0..PREFIX_TURNS {
        messages.push(serde_json::json!({"role": "user", "content": question(turn)}));
        let body = answer(ask(&messages, 32, true)).await?;
        let text = body["choices"][0]["message"]["content"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        messages.push(serde_json::json!({"role": "assistant", "content": text}));
    }
    messages.push(serde_json::json!({"role": "user", "content": question(PREFIX_TURNS)}));
    // Cached first: a request without the cache may leave a server's slot
    // without the history.
    let t = Instant::now();
    let cached = answer(ask(&messages, 1, true)).await?;
    let cached_ms = t.elapsed().as_secs_f64() * 1e3;
    let t = Instant::now();
    answer(ask(&messages, 1, false)).await?;
    let uncached_ms = t.elapsed().as_secs_f64() * 1e3;
    let usage = &cached["usage"];
    Ok(Prefix {
        prompt_tokens: usage["prompt_tokens"].as_u64().unwrap_or(0) as usize,
        cached_tokens: usage["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .map(|n| n as usize),
        cached_ms,
        uncached_ms,
    })
}

/// Prompt tokens per second of one prompt of about 600 tokens, uncached
/// (`cache_prompt: false`, and another first word each round), for one
/// token: its request time is its prefill.
async fn prefill_rate(
    http: &reqwest::Client,
    base: &str,
    model: &str,
    round: usize,
) -> anyhow::Result<f64> {
    let prompt = format!("Prefill {round}. {}", CHAT_PROMPTS.join(" ").repeat(24));
    let t = Instant::now();
    let body = answer(
        http.post(format!("{base}/v1/completions"))
            .json(&serde_json::json!({
                "model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0,
                "cache_prompt": false,
            })),
    )
    .await?;
    let n = body["usage"]["prompt_tokens"].as_u64().unwrap_or(0) as f64;
    Ok(n / t.elapsed().as_secs_f64())
}

/// A request's JSON answer; an error status is an error.
pub(crate) async fn answer(req: reqwest::RequestBuilder) -> anyhow::Result<serde_json::Value> {
    let r = req.send().await?;
    let status = r.status();
    let body: serde_json::Value = r.json().await?;
    anyhow::ensure!(status.is_success(), "HTTP {status}: {body}");
    Ok(body)
}

/// How a generating stream fares when a long prompt comes in beside it.
struct Stall {
    /// Median gap between the stream's tokens before the prompt came.
    typical_ms: f64,
    /// Longest gap between its tokens while the prompt was being served.
    longest_ms: f64,
    /// The long prompt's tokens and its request's time (its prefill and
    /// one token).
    prompt_tokens: usize,
    prompt_ms: f64,
}

/// Tokens the stream has before the long prompt is sent, and in all.
const STALL_BEFORE: usize = 16;
const STALL_TOKENS: usize = 160;

/// The stall run: a streamed completion (greedy, `ignore_eos`); after its
/// first tokens, a prompt of about 1,000 tokens with `max_tokens` 1. A
/// server that prefills the whole prompt in one go stops the stream for
/// that long; one that prefills it in chunks between decode steps slows it
/// a little for longer.
async fn stall(
    http: &reqwest::Client,
    base: &str,
    model: &str,
    round: usize,
) -> anyhow::Result<Stall> {
    // A different first word each round: a server that keeps prompts
    // (llama-server's slots do) must not find this one cached.
    let long = format!("Round {round}. {}", CHAT_PROMPTS.join(" ").repeat(40));
    let mut r = http
        .post(format!("{base}/v1/completions"))
        .json(&serde_json::json!({
            "model": model, "prompt": PROMPTS[0], "max_tokens": STALL_TOKENS,
            "temperature": 0, "ignore_eos": true, "stream": true,
        }))
        .send()
        .await?;
    anyhow::ensure!(r.status().is_success(), "HTTP {}", r.status());
    let (mut times, mut buf) = (Vec::new(), String::new());
    let mut late = None;
    while let Some(chunk) = r.chunk().await? {
        let now = Instant::now();
        buf.push_str(&String::from_utf8_lossy(&chunk));
        while let Some(end) = buf.find("\n\n") {
            let event: String = buf.drain(..end + 2).collect();
            if event.starts_with("data: {") && event.contains("\"text\"") {
                times.push(now);
            }
        }
        if times.len() == STALL_BEFORE && late.is_none() {
            let req = http
                .post(format!("{base}/v1/completions"))
                .json(&serde_json::json!({
                    "model": model, "prompt": long, "max_tokens": 1, "temperature": 0,
                }));
            late = Some(tokio::spawn(async move {
                let t = Instant::now();
                let r = req.send().await?;
                let status = r.status();
                let body: serde_json::Value = r.json().await?;
                anyhow::ensure!(status.is_success(), "HTTP {status}: {body}");
                let n = body["usage"]["prompt_tokens"].as_u64().unwrap_or(0) as usize;
                Ok((t, Instant::now(), n))
            }));
        }
    }
    let late = late.context("the stream ended before the long prompt was sent")?;
    let (start, end, prompt_tokens) = late.await??;
    let ms = |a: Instant, b: Instant| (b - a).as_secs_f64() * 1e3;
    let mut before: Vec<f64> = times[1..STALL_BEFORE]
        .windows(2)
        .map(|w| ms(w[0], w[1]))
        .collect();
    before.sort_by(f64::total_cmp);
    let longest = times
        .windows(2)
        .filter(|w| w[1] > start && w[0] < end)
        .map(|w| ms(w[0], w[1]))
        .fold(0.0, f64::max);
    Ok(Stall {
        typical_ms: before[before.len() / 2],
        longest_ms: longest,
        prompt_tokens,
        prompt_ms: ms(start, end),
    })
}

/// Each stage's compute, send and input-wait time over the wall time
/// between two Status snapshots.
fn timeline(before: &[StatusReply], after: &[StatusReply]) -> Vec<(String, f64, f64, f64)> {
    after
        .iter()
        .map(|a| {
            let b = before.iter().find(|b| b.worker_id == a.worker_id);
            let d = |f: fn(&StatusReply) -> f64| f(a) - b.map_or(0.0, f);
            let wall = d(|s| s.uptime_seconds).max(1e-9);
            (
                a.worker_id.clone(),
                d(|s| s.compute_seconds) / wall,
                d(|s| s.send_seconds) / wall,
                d(|s| s.input_wait_seconds) / wall,
            )
        })
        .collect()
}

/// Runs the futures concurrently and sums their token counts.
async fn futures_sum(
    runs: impl Iterator<
        Item = impl std::future::Future<Output = anyhow::Result<usize>> + Send + 'static,
    >,
) -> anyhow::Result<usize> {
    let handles: Vec<_> = runs.map(tokio::spawn).collect();
    let mut n = 0;
    for h in handles {
        n += h.await??;
    }
    Ok(n)
}

/// `/v1/completions`, greedy, `ignore_eos`: the tokens generated.
fn completion(
    http: &reqwest::Client,
    base: &str,
    model: &str,
    prompt: &str,
    tokens: usize,
) -> impl std::future::Future<Output = anyhow::Result<usize>> + Send + 'static {
    let req = http
        .post(format!("{base}/v1/completions"))
        .json(&serde_json::json!({
            "model": model, "prompt": prompt, "max_tokens": tokens,
            "temperature": 0, "ignore_eos": true,
        }));
    async move { usage(req).await }
}

/// The seeds' request: a chat of one question, `max_tokens` 256, not
/// streamed; tokens over the request's wall time. Greedy and `ignore_eos`
/// here, so that every server writes 256 tokens whatever its chat template
/// makes the model say.
async fn chat(
    http: &reqwest::Client,
    base: &str,
    model: &str,
    prompt: &str,
) -> anyhow::Result<f64> {
    let req = http
        .post(format!("{base}/v1/chat/completions"))
        .json(&serde_json::json!({
            "model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 256, "stream": false, "temperature": 0, "ignore_eos": true,
        }));
    let t = Instant::now();
    let n = usage(req).await?;
    Ok(n as f64 / t.elapsed().as_secs_f64())
}

async fn usage(req: reqwest::RequestBuilder) -> anyhow::Result<usize> {
    let body = answer(req).await?;
    body["usage"]["completion_tokens"]
        .as_u64()
        .map(|n| n as usize)
        .with_context(|| format!("no usage.completion_tokens in {body}"))
}

/// The first model the server lists.
pub(crate) async fn served_model(http: &reqwest::Client, base: &str) -> anyhow::Result<String> {
    let v: serde_json::Value = http
        .get(format!("{base}/v1/models"))
        .send()
        .await?
        .json()
        .await?;
    v["data"][0]["id"]
        .as_str()
        .map(str::to_string)
        .with_context(|| format!("no model in {base}/v1/models: {v}"))
}

/// Polls `url` until it answers 2xx, at most `timeout`; `alive` is asked
/// between tries (a server that exited fails at once, with how it ended).
pub(crate) fn wait_http(
    rt: &tokio::runtime::Runtime,
    http: &reqwest::Client,
    url: &str,
    timeout: Duration,
    mut alive: impl FnMut() -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        alive()?;
        let ok = rt.block_on(async {
            http.get(url)
                .timeout(Duration::from_secs(2))
                .send()
                .await
                .is_ok_and(|r| r.status().is_success())
        });
        if ok {
            return Ok(());
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "{url} was not ready within {timeout:?}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// llama.cpp's server as a child process.
pub(crate) struct LlamaServer(Child);

impl LlamaServer {
    /// With `extra` flags after the common ones (`--spec-type ...`).
    pub(crate) fn start(
        bin: &Path,
        model: &Path,
        port: u16,
        threads: usize,
        slots: usize,
        extra: &[&str],
    ) -> anyhow::Result<Self> {
        let child = Command::new(bin)
            .arg("-m")
            .arg(model)
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .args(["-np", &slots.to_string(), "-t", &threads.to_string()])
            // Its context is shared by the slots: the same per sequence as omni's.
            .args(["-c", &(CTX * slots).to_string()])
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("cannot start {}", bin.display()))?;
        Ok(LlamaServer(child))
    }

    pub(crate) fn wait_ready(
        &mut self,
        rt: &tokio::runtime::Runtime,
        http: &reqwest::Client,
        base: &str,
    ) -> anyhow::Result<()> {
        let url = format!("{base}/health");
        wait_http(rt, http, &url, Duration::from_secs(120), || {
            match self.0.try_wait()? {
                Some(status) => {
                    anyhow::bail!("llama-server {}", omni_telemetry::crash::describe(&status))
                }
                None => Ok(()),
            }
        })
    }

    pub(crate) fn stop(mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn print(a: &BenchServeArgs, model: &Path, threads: usize, rows: &[Row]) -> anyhow::Result<()> {
    let reference = a.llama_server.as_ref().map(|_| &rows[0]);
    let one_stage = rows.iter().find(|r| r.name == "omni 1 stage");
    let ratio = |v: Option<f64>, of: Option<f64>| match (v, of) {
        (Some(v), Some(of)) if of > 0.0 => Some(v / of),
        _ => None,
    };
    // A deterministic row's default-mode twin.
    let default_of = |r: &Row| {
        r.name
            .strip_suffix(" deterministic")
            .and_then(|n| rows.iter().find(|d| d.name == n))
    };
    if a.json {
        let v: Vec<_> = rows
            .iter()
            .map(|r| {
                let det = default_of(r).map(|d| {
                    serde_json::json!({
                        "prefill": ratio(Some(r.prefill), Some(d.prefill)),
                        "one_stream": ratio(Some(r.one), Some(d.one)),
                        "streams": ratio(Some(r.many), Some(d.many)),
                    })
                });
                serde_json::json!({
                    "config": r.name,
                    "prefill_tok_s": r.prefill,
                    "deterministic_vs_default": det,
                    "one_stream_tok_s": r.one,
                    "streams_tok_s": r.many,
                    "chat_tok_s": r.chat,
                    "one_stream_vs_llama_server": ratio(Some(r.one), reference.map(|x| x.one)),
                    "streams_vs_llama_server": ratio(Some(r.many), reference.map(|x| x.many)),
                    "chat_vs_llama_server": ratio(r.chat, reference.and_then(|x| x.chat)),
                    "one_stream_vs_one_stage": ratio(Some(r.one), one_stage.map(|x| x.one)),
                    "streams_vs_one_stage": ratio(Some(r.many), one_stage.map(|x| x.many)),
                    "stall": r.stall.as_ref().map(|s| serde_json::json!({
                        "typical_gap_ms": s.typical_ms, "longest_gap_ms": s.longest_ms,
                        "prompt_tokens": s.prompt_tokens, "prompt_ms": s.prompt_ms,
                    })),
                    "prefix": r.prefix.as_ref().map(|p| serde_json::json!({
                        "prompt_tokens": p.prompt_tokens, "cached_tokens": p.cached_tokens,
                        "ttft_cached_ms": p.cached_ms, "ttft_uncached_ms": p.uncached_ms,
                        "speedup": p.uncached_ms / p.cached_ms,
                        "cached_vs_llama_server": ratio(
                            reference.and_then(|x| x.prefix.as_ref()).map(|x| x.cached_ms),
                            Some(p.cached_ms)),
                    })),
                    "stages": r.timeline.iter().map(|(w, c, s, i)| serde_json::json!({
                        "worker": w, "compute": c, "send": s, "input_wait": i,
                    })).collect::<Vec<_>>(),
                })
            })
            .collect();
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({
                "model": model, "threads_per_process": threads, "streams": a.streams,
                "tokens": a.tokens, "rounds": a.rounds, "rows": v,
            }))?
        );
        return Ok(());
    }
    let x = |r: Option<f64>| r.map_or("-".to_string(), |r| format!("{r:.2}x"));
    println!(
        "model {} | {threads} thread(s) per process | {} tokens per stream (ignore_eos), best of {}; chat: the seeds' benchmark, 256 tokens, mean of {}",
        model.display(),
        a.tokens,
        a.rounds,
        a.rounds * CHAT_PROMPTS.len()
    );
    let n = a.streams;
    println!(
        "{:<28} {:>8} {:>9} {:>8} {:>8} {:>11} {:>8} {:>8} {:>9} {:>8}",
        "config",
        "prefill",
        "1 stream",
        "vs llama",
        "vs 1 st",
        format!("{n} streams"),
        "vs llama",
        "vs 1 st",
        "chat",
        "vs llama"
    );
    for r in rows {
        println!(
            "{:<28} {:>8.1} {:>9.1} {:>8} {:>8} {:>11.1} {:>8} {:>8} {:>9} {:>8}",
            r.name,
            r.prefill,
            r.one,
            x(ratio(Some(r.one), reference.map(|x| x.one))),
            x(ratio(Some(r.one), one_stage.map(|x| x.one))),
            r.many,
            x(ratio(Some(r.many), reference.map(|x| x.many))),
            x(ratio(Some(r.many), one_stage.map(|x| x.many))),
            r.chat.map_or("-".into(), |c| format!("{c:.1}")),
            x(ratio(r.chat, reference.and_then(|x| x.chat))),
        );
    }
    if rows.iter().any(|r| default_of(r).is_some()) {
        println!("deterministic against the default mode (same run):");
        for r in rows {
            if let Some(d) = default_of(r) {
                println!(
                    "  {:<26} prefill {}, 1 stream {}, {n} streams {}",
                    d.name,
                    x(ratio(Some(r.prefill), Some(d.prefill))),
                    x(ratio(Some(r.one), Some(d.one))),
                    x(ratio(Some(r.many), Some(d.many))),
                );
            }
        }
    }
    if rows.iter().any(|r| r.stall.is_some()) {
        println!(
            "a generating stream while a long prompt comes in (gaps between its tokens; the prompt's request time):"
        );
        let longest = |r: &Row| r.stall.as_ref().map(|s| s.longest_ms);
        for r in rows {
            if let Some(s) = &r.stall {
                println!(
                    "  {:<24} typical {:>6.1} ms, longest {:>7.1} ms ({} vs llama-server); {} prompt tokens in {:.0} ms",
                    r.name,
                    s.typical_ms,
                    s.longest_ms,
                    x(ratio(longest(r), reference.and_then(longest))),
                    s.prompt_tokens,
                    s.prompt_ms
                );
            }
        }
    }
    if rows.iter().any(|r| r.prefix.is_some()) {
        println!(
            "turn {} of a chat with a long history, time to first token with the prompt cache and without (cache_prompt: false):",
            PREFIX_TURNS + 1
        );
        let cached = |r: &Row| r.prefix.as_ref().map(|p| p.cached_ms);
        for r in rows {
            if let Some(p) = &r.prefix {
                println!(
                    "  {:<24} {} prompt tokens, {} cached: {:>7.1} ms cached, {:>7.1} ms uncached ({:.1}x); cached {} llama-server's",
                    r.name,
                    p.prompt_tokens,
                    p.cached_tokens.map_or("?".into(), |n| n.to_string()),
                    p.cached_ms,
                    p.uncached_ms,
                    p.uncached_ms / p.cached_ms,
                    // Speed against llama-server: its time over ours.
                    x(ratio(reference.and_then(cached), cached(r)))
                );
            }
        }
    }
    println!("where each stage's time went while {n} streams ran (of wall time):");
    for r in rows.iter().filter(|r| !r.timeline.is_empty()) {
        let parts: Vec<String> = r
            .timeline
            .iter()
            .map(|(w, c, s, i)| {
                format!(
                    "{w} compute {:.0}% send {:.0}% waiting {:.0}%",
                    c * 100.0,
                    s * 100.0,
                    i * 100.0
                )
            })
            .collect();
        println!("  {:<24} {}", r.name, parts.join(" | "));
    }
    Ok(())
}
