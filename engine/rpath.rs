//! The build script of every crate whose binaries link the engine
//! (`build = "../engine/rpath.rs"`): llama.cpp and ggml are shared libraries
//! that the engine's build script puts beside the binaries, so the binaries
//! look for them there (`$ORIGIN`), wherever the directory is moved to
//! (`target/release/`, the image's `/usr/local/bin/`).
fn main() {
    println!("cargo:rerun-if-changed=../engine/rpath.rs");
    // Every target: binaries, and the test binaries in deps/ (run by hand too).
    // DT_RPATH, not the newer DT_RUNPATH: only RPATH also serves the
    // libraries' own needs (libllama.so.0 needs libggml.so.0, and a binary
    // that calls no ggml function directly does not list it itself).
    println!("cargo:rustc-link-arg=-Wl,--disable-new-dtags,-rpath,$ORIGIN");
}
