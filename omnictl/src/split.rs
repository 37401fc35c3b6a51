//! `omnictl split` and `omnictl merge`: llama.cpp's `gguf-split` layout
//! (`PREFIX-00001-of-0000N.gguf`, ...), made from a model or joined back
//! into one file. omni loads a split model from any of its parts.

use std::io::Write;
use std::path::PathBuf;

use omni_engine::gguf::split::{self, SplitBy};
use omni_engine::gguf::Gguf;
use omni_engine::units::{fmt_bytes, parse_size};

#[derive(clap::Args, Debug)]
#[command(group = clap::ArgGroup::new("by").args(["parts", "max_tensors", "max_size"]))]
pub struct SplitArgs {
    /// The model (a GGUF file, or any part of a split model).
    pub model: PathBuf,
    /// Where the parts go: PREFIX-00001-of-0000N.gguf, ...
    pub prefix: PathBuf,
    /// Cut into this many parts of about equal size.
    #[arg(long)]
    pub parts: Option<usize>,
    /// At most this many tensors per part (gguf-split's --split-max-tensors;
    /// the default when nothing else is given: 128).
    #[arg(long)]
    pub max_tensors: Option<usize>,
    /// At most this many bytes of tensors per part, e.g. 40GB (gguf-split's
    /// --split-max-size).
    #[arg(long, value_parser = parse_size)]
    pub max_size: Option<u64>,
    /// Print the parts and write nothing.
    #[arg(long)]
    pub dry_run: bool,
}

#[derive(clap::Args, Debug)]
pub struct MergeArgs {
    /// Any part of the split model.
    pub part: PathBuf,
    /// The one file to write.
    pub out: PathBuf,
}

pub fn split(a: &SplitArgs) -> anyhow::Result<()> {
    let g = Gguf::open(&a.model)?;
    let by = match (a.parts, a.max_tensors, a.max_size) {
        (Some(n), _, _) => SplitBy::Parts(n),
        (_, _, Some(b)) => SplitBy::MaxBytes(b),
        (_, t, _) => SplitBy::MaxTensors(t.unwrap_or(128)),
    };
    let parts = split::plan(&g, by).map_err(anyhow::Error::msg)?;
    let outs: Vec<PathBuf> = (0..parts.len())
        .map(|i| split::part_path(&a.prefix, i, parts.len()))
        .collect();
    for (part, out) in parts.iter().zip(&outs) {
        let bytes: u64 = part.iter().map(|&t| g.tensors()[t].size).sum();
        let (first, last) = (&g.tensors()[part[0]], &g.tensors()[part[part.len() - 1]]);
        println!(
            "{}: {} tensors, {} ({} .. {})",
            out.display(),
            part.len(),
            fmt_bytes(bytes),
            first.name,
            last.name
        );
    }
    if a.dry_run {
        return Ok(());
    }
    write(&g, &parts, &outs)?;
    println!("split {} into {} parts", a.model.display(), parts.len());
    Ok(())
}

pub fn merge(a: &MergeArgs) -> anyhow::Result<()> {
    let g = Gguf::open(&a.part)?;
    if g.n_parts() == 1 {
        anyhow::bail!(
            "{} is a whole model, not a part of a split one: nothing to merge",
            a.part.display()
        );
    }
    let all: Vec<usize> = (0..g.tensors().len()).collect();
    write(&g, &[all], std::slice::from_ref(&a.out))?;
    println!(
        "merged {} parts into {} ({})",
        g.n_parts(),
        a.out.display(),
        fmt_bytes(std::fs::metadata(&a.out)?.len())
    );
    Ok(())
}

/// Writes the files, showing progress on stderr.
fn write(g: &Gguf, parts: &[Vec<usize>], outs: &[PathBuf]) -> anyhow::Result<()> {
    use std::io::IsTerminal;
    // On a terminal one line that counts up; in a log a line per tenth.
    let (tty, step) = if std::io::stderr().is_terminal() {
        (true, 1)
    } else {
        (false, 10)
    };
    let mut last = u64::MAX;
    let mut progress = |done: u64, total: u64| {
        let pct = done * 100 / total.max(1) / step * step;
        if pct != last {
            last = pct;
            let line = format!(
                "omnictl: writing {pct:3}% ({} of {})",
                fmt_bytes(done),
                fmt_bytes(total)
            );
            if tty {
                eprint!("\r{line}");
                let _ = std::io::stderr().flush();
            } else {
                eprintln!("{line}");
            }
        }
    };
    split::write(g, parts, outs, &mut progress)?;
    if tty {
        eprintln!();
    }
    Ok(())
}
