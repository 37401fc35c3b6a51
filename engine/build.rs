//! Puts llama.cpp's shared libraries next to the binaries that load them.
//!
//! With `llama-cpp-sys-2`'s `dynamic-backends`, ggml is a set of shared
//! libraries: `libllama`, `libggml`, `libggml-base` (linked) and one CPU
//! backend per x86 level, `libggml-cpu-<variant>.so` (loaded at run time, the
//! best one this CPU runs: `src/ffi/cpu_variant.rs`). The crate leaves them in
//! its OUT_DIR and links only symlinks by their unversioned names into the
//! target directory, which dangle there (the loader wants the sonames,
//! `libllama.so.0`, ...). We copy the real files, under their sonames, and the
//! CPU variants into `target/<profile>/` (where the binaries are; they carry
//! an rpath of `$ORIGIN`), `target/<profile>/deps/` (the test binaries) and
//! `target/<profile>/examples/`.
//! The deploy image and `tests/compose/run` take them from there too.

use std::env;
use std::fs;
use std::path::{Path, PathBuf};

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    // Without the `ggml` feature nothing links llama.cpp (the fuzz targets).
    let Ok(backends) = env::var("DEP_LLAMA_BACKENDS_DIR") else {
        return;
    };
    let backends = PathBuf::from(backends);
    let libs = backends.parent().expect("OUT_DIR/backends").join("lib");
    let out = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    // OUT_DIR is target/<profile>/build/omni-engine-<hash>/out.
    let profile_dir = out.ancestors().nth(3).expect("OUT_DIR is deep enough");

    let mut files: Vec<(PathBuf, String)> = Vec::new();
    for entry in fs::read_dir(&libs).unwrap_or_else(|e| panic!("{}: {e}", libs.display())) {
        let path = entry.expect("readable dir").path();
        let name = file_name(&path);
        // libllama.so.0 -> libllama.so.0.6.0: copy the file under the soname.
        if is_soname(&name) {
            let real = fs::canonicalize(&path).expect("soname link resolves");
            files.push((real, name));
        }
    }
    for entry in fs::read_dir(&backends).expect("backends dir") {
        let path = entry.expect("readable dir").path();
        let name = file_name(&path);
        if name.starts_with("libggml-") && name.ends_with(".so") {
            files.push((path, name));
        }
    }
    assert!(
        files.iter().any(|(_, n)| n.starts_with("libggml-cpu-")),
        "llama-cpp-sys-2 built no CPU backend variants in {}",
        backends.display()
    );
    for (src, _) in &files {
        println!("cargo:rerun-if-changed={}", src.display());
    }
    for dir in [
        profile_dir.to_path_buf(),
        profile_dir.join("deps"),
        profile_dir.join("examples"),
    ] {
        fs::create_dir_all(&dir).expect("target dir");
        for (src, name) in &files {
            place(src, &dir.join(name));
        }
    }
    // The engine's own tests and examples find them beside themselves too.
    println!("cargo:rustc-link-arg=-Wl,--disable-new-dtags,-rpath,$ORIGIN");
    // Where the libraries are when a binary runs from elsewhere (an example,
    // a fuzz target): the last place `cpu_variant` looks.
    println!(
        "cargo:rustc-env=OMNI_BUILD_LIB_DIR={}",
        profile_dir.display()
    );
}

fn file_name(p: &Path) -> String {
    p.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// `libx.so.N` (one version number): the name the loader asks for.
fn is_soname(name: &str) -> bool {
    match name.split_once(".so.") {
        Some((stem, ver)) => {
            stem.starts_with("lib") && !ver.is_empty() && ver.bytes().all(|b| b.is_ascii_digit())
        }
        None => false,
    }
}

/// Replaces `dst` with `src`: a hard link when both are on one file system,
/// else a copy (never a symlink: the image build copies the directory).
fn place(src: &Path, dst: &Path) {
    let _ = fs::remove_file(dst);
    if fs::hard_link(src, dst).is_err() {
        fs::copy(src, dst)
            .unwrap_or_else(|e| panic!("copy {} to {}: {e}", src.display(), dst.display()));
    }
}
