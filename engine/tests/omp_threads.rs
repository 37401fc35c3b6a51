//! Timing a device's weight reads at start leaves no OpenMP threads behind.
//!
//! A worker times its device (`device::weight_read_rate`) on its main
//! thread and then computes every step on its stage thread. ggml's graph
//! threads are an OpenMP team whose helpers stay parked with the thread
//! that started it; a second team left behind by the timing put more
//! OpenMP threads than cores in a 2-core worker, so libgomp cut every
//! barrier's spin short and the stage decoded 15-30% slower than alone
//! (docs/benchmarks.md). This binary holds one test, so the process's
//! thread count is the test's own.

use omni_engine::Device;

fn threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .expect("/proc/self/task")
        .count()
}

#[test]
fn timing_the_weight_reads_leaves_no_compute_threads_behind() {
    omni_engine::cpu_backend(None).expect("CPU backend");
    let before = threads();
    // More threads than this machine may have cores: a team of 4 leaves 3
    // helpers behind wherever it is started from a thread that lives on.
    let rate = omni_engine::device::weight_read_rate(Device::Cpu, 4, 16 << 20)
        .expect("timing the CPU's weight reads");
    assert!(rate > 1e8, "{rate} bytes/s");
    // A released helper leaves /proc a moment after it is told to end; a
    // parked one never does.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while threads() != before && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert_eq!(
        threads(),
        before,
        "weight_read_rate left threads behind (an OpenMP team parked with the calling thread)"
    );
}
