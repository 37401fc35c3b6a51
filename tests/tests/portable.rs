//! The build runs on any x86-64: no instruction a CPU may lack is compiled
//! into omni's executables or the libraries they link. AVX-512 (any EVEX
//! instruction), AVX-VNNI (`{vex} vpdp*`) and AMX (tile instructions) may
//! only appear in ggml's per-level CPU backends (`libggml-cpu-<variant>.so`),
//! one of which is chosen at run time for the CPU at hand.
//!
//! The check disassembles with binutils' `objdump` and reads each
//! instruction's bytes: in 64-bit mode an instruction whose first byte after
//! its legacy prefixes is 0x62 is EVEX-encoded, which only AVX-512 uses.
//!
//! Code that checks the CPU before it runs such instructions is fine, and
//! named in [`RUN_TIME_DISPATCHED`]: a new entry there needs the same proof.

use omni_tests::target_bin;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};

/// What one file holds, with the first few places for the message.
#[derive(Debug, Default)]
struct Found {
    evex: usize,
    vex_vnni: usize,
    amx: usize,
    examples: Vec<String>,
}

impl Found {
    fn any(&self) -> bool {
        self.evex + self.vex_vnni + self.amx > 0
    }
}

/// Functions built with `#[target_feature]` that their crate calls only after
/// checking the CPU at run time (demangled names, without the hash).
const RUN_TIME_DISPATCHED: [&str; 7] = [
    // crc32fast (gzip in omnictl's fetch and the HTTP client): chosen by
    // `is_x86_feature_detected!("avx512f")` and `("vpclmulqdq")`.
    "crc32fast::specialized::pclmulqdq::calculate_avx512",
    // omni's expert kernel (engine/src/ffi/ggml/experts_kernel.rs): reached
    // only through `x86::dots` and `x86::dots_x8`, from the ops that
    // `Ctx::expert_matmuls` and `Ctx::matmul` put in a graph after
    // `available()` found AVX-512 F/BW/VL, VNNI, F16C and FMA with
    // `is_x86_feature_detected!` (and its helpers, where not inlined).
    "omni_engine::ffi::ggml::experts_kernel::x86::q4_k",
    "omni_engine::ffi::ggml::experts_kernel::x86::q4_kx8",
    "omni_engine::ffi::ggml::experts_kernel::x86::q6_k",
    "omni_engine::ffi::ggml::experts_kernel::x86::totals",
    "omni_engine::ffi::ggml::experts_kernel::x86::hsum256",
    "omni_engine::ffi::ggml::experts_kernel::x86::halves",
];

const LEGACY_PREFIXES: [&str; 11] = [
    "66", "67", "f2", "f3", "2e", "36", "3e", "26", "64", "65", "f0",
];

fn scan(path: &Path) -> Found {
    let mut child = Command::new("objdump")
        .args(["-d", "-w", "-C"])
        .arg(path)
        .stdout(Stdio::piped())
        .spawn()
        .expect("objdump (binutils) runs; scripts/deps installs it");
    let mut found = Found::default();
    let mut function = String::new();
    for line in BufReader::new(child.stdout.take().unwrap())
        .lines()
        .map_while(Result::ok)
    {
        // "0000000000012340 <name>:" starts a function.
        if let Some(name) = line.strip_suffix(">:").and_then(|l| l.split_once(" <")) {
            function = name.1.to_string();
            continue;
        }
        if RUN_TIME_DISPATCHED.contains(&function.as_str()) {
            continue;
        }
        // "   12345:\t62 f1 7c 48 10 00 \tvmovups (%rax),%zmm0"
        let mut cols = line.split('\t');
        let (Some(_), Some(bytes), Some(insn)) = (cols.next(), cols.next(), cols.next()) else {
            continue;
        };
        let first = bytes
            .split_whitespace()
            .find(|b| !LEGACY_PREFIXES.contains(b));
        let kind = if first == Some("62") {
            &mut found.evex
        } else if insn.starts_with("{vex} vpdp") {
            &mut found.vex_vnni
        } else if ["tdp", "tile", "ldtilecfg", "sttilecfg"]
            .iter()
            .any(|p| insn.starts_with(p))
        {
            &mut found.amx
        } else {
            continue;
        };
        *kind += 1;
        if found.examples.len() < 8 {
            found.examples.push(format!("{function}: {}", insn.trim()));
        }
    }
    assert!(
        child.wait().unwrap().success(),
        "objdump {}",
        path.display()
    );
    found
}

#[test]
fn no_host_specific_instructions_outside_the_cpu_variants() {
    let dir = target_bin("omnictl").parent().unwrap().to_path_buf();
    let mut files: Vec<_> = [
        "omni-coordinator",
        "omni-gpu-worker",
        "omni-cpu-worker",
        "omni-router",
        "omnictl",
        "libllama.so.0",
        "libggml.so.0",
        "libggml-base.so.0",
    ]
    .iter()
    .map(|f| dir.join(f))
    .collect();
    files.sort();
    let mut bad = Vec::new();
    for f in &files {
        assert!(f.exists(), "{} is missing", f.display());
        let found = scan(f);
        eprintln!(
            "{}: {} EVEX, {} AVX-VNNI, {} AMX instructions",
            f.display(),
            found.evex,
            found.vex_vnni,
            found.amx
        );
        if found.any() {
            bad.push(format!("{}: {found:?}", f.display()));
        }
    }
    assert!(
        bad.is_empty(),
        "instructions a CPU may lack, outside the per-level backends:\n{}",
        bad.join("\n")
    );
}

/// The scan sees what it looks for: each kind is in the variant built for it.
#[test]
fn the_scan_finds_avx512_avx_vnni_and_amx_in_the_variants_that_use_them() {
    let dir = target_bin("omnictl").parent().unwrap().to_path_buf();
    let zen4 = scan(&dir.join("libggml-cpu-zen4.so"));
    assert!(
        zen4.evex > 0 && zen4.vex_vnni == 0 && zen4.amx == 0,
        "{zen4:?}"
    );
    let alderlake = scan(&dir.join("libggml-cpu-alderlake.so"));
    assert!(
        alderlake.vex_vnni > 0 && alderlake.evex == 0,
        "{alderlake:?}"
    );
    let spr = scan(&dir.join("libggml-cpu-sapphirerapids.so"));
    assert!(spr.amx > 0 && spr.evex > 0, "{spr:?}");
    let haswell = scan(&dir.join("libggml-cpu-haswell.so"));
    assert!(!haswell.any(), "{haswell:?}");
}
