//! Compiles proto/omni/**.proto with tonic/prost. `protoc` comes from the
//! protoc-bin-vendored crate so no system package is needed.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    // SAFETY-free: build scripts are single-threaded, so setting the variable is sound.
    unsafe { std::env::set_var("PROTOC", protoc) };
    let files = [
        "proto/omni/worker/v1/worker.proto",
        "proto/omni/coordinator/v1/coordinator.proto",
        "proto/omni/admin/v1/admin.proto",
    ];
    for f in files {
        println!("cargo:rerun-if-changed={f}");
    }
    tonic_prost_build::configure().compile_protos(&files, &["proto"])?;
    Ok(())
}
