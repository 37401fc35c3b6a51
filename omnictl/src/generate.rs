//! `omnictl generate`: one process, no network. Loads the model (optionally
//! split into layer ranges chained in this process), then prints the text
//! as it is generated, or a JSON report with `--json`.

use std::io::Write;

use anyhow::Context;
use clap::Args;
use omni_engine::chat::ChatMessage;
use omni_engine::sampling::SamplingParams;
use omni_engine::{Engine, GenerateOptions, StageConfig};

#[derive(Args, Debug)]
#[command(
    override_usage = "omnictl generate --model M (--prompt TEXT | --prompt-ids 1,2,3) [OPTIONS]
       omnictl generate --coordinator ADDR (--prompt TEXT | --prompt-ids 1,2,3) [OPTIONS]"
)]
pub struct GenerateArgs {
    /// GGUF path, or a known model name (gemma3-270m, qwen2.5-coder-0.5b), fetched if missing.
    #[arg(long, short, required_unless_present = "coordinator")]
    pub model: Option<String>,
    /// Run through a cluster: the coordinator's address (see `omnictl up`).
    #[arg(long, conflicts_with_all = ["model", "split", "threads", "ctx"])]
    pub coordinator: Option<String>,
    /// Prompt text.
    #[arg(
        long,
        short,
        conflicts_with = "prompt_ids",
        required_unless_present = "prompt_ids"
    )]
    pub prompt: Option<String>,
    /// Prompt as token ids, comma-separated (used as given: no BOS added).
    #[arg(long, value_delimiter = ',')]
    pub prompt_ids: Option<Vec<u32>>,
    /// Most tokens to generate, at least 1 (as the API's max_tokens).
    #[arg(short = 'n', long, default_value_t = 64, value_parser = at_least_one)]
    pub max_tokens: usize,
    /// 0 = greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    #[arg(long, default_value_t = 0)]
    pub top_k: u32,
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    #[arg(long, default_value_t = 0.0)]
    pub min_p: f32,
    #[arg(long, default_value_t = 1.0)]
    pub repeat_penalty: f32,
    #[arg(long)]
    pub seed: Option<u64>,
    /// Stop strings (repeatable).
    #[arg(long)]
    pub stop: Vec<String>,
    /// Keep going past end-of-generation tokens (as llama.cpp's references do).
    #[arg(long)]
    pub ignore_eos: bool,
    /// Wrap the prompt as a user message in the model's chat template.
    #[arg(long)]
    pub chat: bool,
    /// Optional system message for --chat.
    #[arg(long, requires = "chat")]
    pub system: Option<String>,
    #[arg(long, short = 't')]
    pub threads: Option<usize>,
    /// Compute on `cpu` or `cuda:N` (every stage of the local run).
    #[arg(long, default_value = "cpu", conflicts_with = "coordinator")]
    pub device: omni_engine::Device,
    /// Context length (prompt + generated tokens).
    #[arg(long, default_value_t = 4096)]
    pub ctx: usize,
    /// Where the prompt is cut into steps, which moves logits a little:
    /// `llama-server` (every 512 tokens, and for models with sliding-window
    /// layers also 4 and 4 + 512 tokens before the end, as llama-server does
    /// by default) or `ubatch` (every 512 tokens only, as llama.cpp's
    /// llama_decode and `llama-server --swa-full`). See docs/llama-cpp.md.
    #[arg(long, default_value_t = omni_engine::PromptCuts::default(), conflicts_with = "coordinator")]
    pub prompt_cuts: omni_engine::PromptCuts,
    /// Run as chained layer ranges of these sizes, e.g. `--split 9,15`.
    #[arg(long, value_delimiter = ',')]
    pub split: Option<Vec<u32>>,
    /// Report per-token alternatives (with --json).
    #[arg(long, default_value_t = 0)]
    pub top_logprobs: usize,
    /// Print a JSON report: prompt ids, generated ids, text, timings.
    #[arg(long)]
    pub json: bool,
    /// Constrain the output to JSON valid against this JSON schema (the
    /// schema's text, or @FILE).
    #[arg(long, conflicts_with_all = ["grammar", "json_object"])]
    pub json_schema: Option<String>,
    /// Constrain the output to a JSON object.
    #[arg(long, conflicts_with = "grammar")]
    pub json_object: bool,
    /// Constrain the output to a grammar in llguidance's Lark syntax (e.g.
    /// 'start: "yes" | "no"'; the text, or @FILE).
    #[arg(long)]
    pub grammar: Option<String>,
    /// Batch-invariant decoding: the same tokens whatever else runs (in one
    /// process: whatever the prompt's chunking; with --coordinator, the
    /// request asks for it, which the cluster must allow).
    #[arg(long)]
    pub deterministic: bool,
    /// With --coordinator: speculative decoding for this request, drafts of
    /// at most N tokens (0: none; absent: the coordinator's setting).
    #[arg(long, requires = "coordinator")]
    pub draft_max: Option<u32>,
}

/// `-n`: a count of tokens, at least 1 — 0 is refused here as the router
/// and the coordinator refuse `max_tokens: 0`, so it means one thing on
/// every path.
fn at_least_one(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(0) => Err("0 tokens: give at least 1 (the API's max_tokens: 0 is refused too)".into()),
        Ok(n) => Ok(n),
        Err(_) => Err(format!("'{s}' is not a number of tokens")),
    }
}

/// The constraint the flags ask for, if any.
pub(crate) fn grammar(
    a: &GenerateArgs,
) -> anyhow::Result<Option<omni_engine::constraint::Grammar>> {
    use omni_engine::constraint::Grammar;
    let text = |v: &str| -> anyhow::Result<String> {
        match v.strip_prefix('@') {
            Some(path) => std::fs::read_to_string(path).with_context(|| format!("reading {path}")),
            None => Ok(v.to_string()),
        }
    };
    Ok(if let Some(s) = &a.json_schema {
        let schema = serde_json::from_str(&text(s)?).context("--json-schema is not JSON")?;
        Some(Grammar::JsonSchema { schema })
    } else if a.json_object {
        Some(Grammar::JsonObject)
    } else if let Some(g) = &a.grammar {
        Some(Grammar::Lark { grammar: text(g)? })
    } else {
        None
    })
}

pub fn run(a: GenerateArgs) -> anyhow::Result<()> {
    if let Some(addr) = &a.coordinator {
        return crate::remote::generate(addr, &a);
    }
    let path = crate::resolve_model(a.model.as_deref().expect("clap requires --model"))?;
    let mut cfg = StageConfig::default();
    cfg.kv.n_ctx = a.ctx;
    if let Some(t) = a.threads {
        cfg.n_threads = t;
    }
    cfg.device = a.device;
    cfg.deterministic = a.deterministic;
    let model = omni_engine::ModelFile::open(&path)?;
    cfg.kv.n_ctx = cfg.kv.n_ctx.min(model.hparams.n_ctx_train as usize);
    eprintln!(
        "omnictl: {} ({}, {} layers, {} MB) from {}",
        model.hparams.arch.name(),
        model.gguf.opt_str("general.name")?.unwrap_or("unnamed"),
        model.hparams.n_layer,
        model.gguf.file_size() >> 20,
        path.display()
    );
    let t0 = std::time::Instant::now();
    let mut engine =
        Engine::load_with_progress(&path, a.split.as_deref(), cfg, &mut |stage, done, total| {
            if done == total || done % 32 == 0 {
                eprint!("\romnictl: stage {stage}: preparing weights {done}/{total}");
                if done == total {
                    eprintln!();
                }
            }
        })?;
    engine.prompt_cuts = a.prompt_cuts;
    let load_ms = t0.elapsed().as_secs_f64() * 1e3;
    eprintln!(
        "omnictl: loaded {} stage(s) in {:.0} ms",
        engine.stages().len(),
        load_ms
    );

    let prompt_ids = match (&a.prompt_ids, &a.prompt) {
        (Some(ids), _) => ids.clone(),
        (None, Some(text)) if a.chat => {
            let template = engine.model.chat_template()?;
            let mut msgs = Vec::new();
            if let Some(s) = &a.system {
                msgs.push(ChatMessage::text("system", s));
            }
            msgs.push(ChatMessage::text("user", text));
            let rendered = template.render(&msgs, true)?;
            engine.tokenize_prompt(&rendered, true)?
        }
        (None, Some(text)) => engine.tokenize_prompt(text, false)?,
        (None, None) => unreachable!("clap requires one of them"),
    };
    let opts = GenerateOptions {
        max_tokens: a.max_tokens,
        sampling: SamplingParams {
            temperature: a.temperature,
            top_k: a.top_k,
            top_p: a.top_p,
            min_p: a.min_p,
            repeat_penalty: a.repeat_penalty,
            seed: a.seed,
            grammar: grammar(&a)?,
            ..SamplingParams::default()
        },
        stop_at_eog: !a.ignore_eos,
        stop: a.stop.clone(),
        top_logprobs: a.top_logprobs,
    };
    let json = a.json;
    let mut stdout = std::io::stdout();
    let gen = engine
        .generate(&prompt_ids, &opts, &mut |text| {
            if !json {
                print!("{text}");
                stdout.flush().ok();
            }
        })
        .context("generation failed")?;
    if json {
        let report = serde_json::json!({
            "model": path,
            "prompt_ids": gen.prompt_ids,
            "generated_ids": gen.ids,
            "text": gen.text,
            "finish_reason": gen.finish_reason,
            "steps": if a.top_logprobs > 0 { serde_json::to_value(&gen.steps)? } else { serde_json::Value::Null },
            "timings": {
                "load_ms": load_ms,
                "prompt_tokens": gen.timings.prompt_tokens,
                "prompt_ms": gen.timings.prompt_ms,
                "prompt_tok_s": gen.timings.prompt_tok_s(),
                "gen_tokens": gen.timings.gen_tokens,
                "gen_ms": gen.timings.gen_ms,
                "gen_tok_s": gen.timings.gen_tok_s(),
            },
        });
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        println!();
        eprintln!(
            "omnictl: prompt {} tokens at {:.1} tok/s, generated {} tokens at {:.1} tok/s ({:?})",
            gen.timings.prompt_tokens,
            gen.timings.prompt_tok_s(),
            gen.timings.gen_tokens,
            gen.timings.gen_tok_s(),
            gen.finish_reason
        );
    }
    Ok(())
}
