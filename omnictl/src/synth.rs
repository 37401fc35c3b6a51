//! `omnictl synth`: a GGUF with a named model's real shapes and random
//! weights (`omni_engine::synth`), for benchmarks at shapes we cannot
//! download: an R1-shaped slice measures what R1's layers cost.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use clap::Args;
use omni_engine::fmt_bytes;
use omni_engine::synth::{shapes, Synth};

#[derive(Args, Debug)]
pub struct SynthArgs {
    /// The model whose shapes to use (`--list` shows them).
    #[arg(required_unless_present = "list")]
    pub shape: Option<String>,
    /// Where to write the file.
    #[arg(long, short, required_unless_present = "list")]
    pub out: Option<PathBuf>,
    /// Layers (the model's leading dense layers first; default: all).
    #[arg(long)]
    pub layers: Option<u64>,
    /// Leading dense layers (default: the model's share of --layers, at
    /// least one where it has any, and at least one MoE layer).
    #[arg(long)]
    pub dense: Option<u64>,
    /// Routed experts per MoE layer (default: the model's).
    #[arg(long)]
    pub experts: Option<u64>,
    /// Tokens in the vocabulary (default: the model's).
    #[arg(long)]
    pub vocab: Option<u64>,
    /// Seed of the random weights (the same seed writes the same bytes).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// List the known shapes and where their numbers come from.
    #[arg(long)]
    pub list: bool,
}

pub fn run(a: &SynthArgs) -> anyhow::Result<()> {
    let known = shapes();
    if a.list {
        for s in &known {
            println!(
                "{:<16} {}: {} layers ({} dense), hidden {}, {} experts of {} ({} used{}), vocabulary {}; {}",
                s.name,
                s.arch,
                s.n_layer,
                s.n_dense,
                s.hidden,
                s.n_expert,
                s.expert_ff,
                s.n_used,
                if s.n_shared > 0 { format!(", {} shared", s.n_shared) } else { String::new() },
                s.vocab,
                s.source
            );
        }
        return Ok(());
    }
    let (Some(name), Some(out)) = (a.shape.as_deref(), a.out.as_ref()) else {
        anyhow::bail!("omnictl synth SHAPE --out FILE (or --list)");
    };
    let shape = known
        .iter()
        .find(|s| s.name == name)
        .cloned()
        .with_context(|| {
            format!(
                "no shape named '{name}' (known: {})",
                known.iter().map(|s| s.name).collect::<Vec<_>>().join(", ")
            )
        })?;
    let synth = Synth {
        shape,
        layers: a.layers,
        dense: a.dense,
        experts: a.experts,
        vocab: a.vocab,
        seed: a.seed,
    };
    let s = synth.resolved().map_err(anyhow::Error::msg)?;
    let (_, tensors) = synth.layout().map_err(anyhow::Error::msg)?;
    let total: u64 = tensors.iter().filter_map(|t| t.size()).sum();
    let dir = match out.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let free = free_bytes(&dir)
        .with_context(|| format!("{}: cannot read its free space", dir.display()))?;
    anyhow::ensure!(
        total + (64 << 20) <= free,
        "{}: the file is {} and {} has {} free; ask for fewer --layers or --experts",
        out.display(),
        fmt_bytes(total),
        dir.display(),
        fmt_bytes(free)
    );
    eprintln!(
        "omnictl synth: {} as {}: {} layers ({} dense), {} experts of {} per MoE layer ({} used), vocabulary {}: {} to write",
        s.name,
        s.arch,
        s.n_layer,
        s.n_dense,
        s.n_expert,
        s.expert_ff,
        s.n_used,
        s.vocab,
        fmt_bytes(total)
    );
    let t0 = Instant::now();
    let mut last = Instant::now();
    synth
        .write(out, &mut |done, all| {
            if last.elapsed().as_secs_f64() >= 1.0 || done == all {
                last = Instant::now();
                eprint!(
                    "\r  {} of {} ({:.0}%)   ",
                    fmt_bytes(done),
                    fmt_bytes(all),
                    100.0 * done as f64 / all.max(1) as f64
                );
            }
        })
        .map_err(anyhow::Error::msg)
        .with_context(|| format!("writing {}", out.display()))?;
    eprintln!("\n  written in {:.1} s", t0.elapsed().as_secs_f64());
    println!("{}", out.display());
    Ok(())
}

/// Free bytes for an unprivileged writer on the file system holding `dir`.
fn free_bytes(dir: &std::path::Path) -> nix::Result<u64> {
    let st = nix::sys::statvfs::statvfs(dir)?;
    Ok(st.blocks_available() as u64 * st.fragment_size() as u64)
}
