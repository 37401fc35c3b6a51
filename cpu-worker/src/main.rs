//! `omni-cpu-worker`: one process per NUMA node, computing routed experts.

use clap::Parser;
use omni_cpu_worker::numa::{self, Binding};

#[derive(Parser)]
#[command(
    name = "omni-cpu-worker",
    version,
    about = "omni expert worker: runs MoE routed experts on one NUMA node's cores and memory"
)]
struct Cli {
    #[command(flatten)]
    cfg: omni_cpu_worker::service::CpuWorkerConfig,
}

fn main() {
    let cli = Cli::parse();
    // Bind before the runtime (or anything else) starts a thread: threads
    // inherit the affinity and memory policy of the thread that makes them.
    let binding = match cli.cfg.numa_node {
        None => Binding::Unbound {
            why: "no --numa-node given".into(),
        },
        Some(node) => match numa::bind(node) {
            Ok(b) => b,
            Err(e) => {
                eprintln!("omni-cpu-worker: cannot bind to NUMA node {node}: {e}");
                std::process::exit(2);
            }
        },
    };
    let telemetry = cli.cfg.telemetry.clone();
    let id = cli.cfg.worker_id();
    omni_telemetry::service_main(
        "omni-cpu-worker",
        Some(&id),
        &telemetry,
        omni_cpu_worker::service::run(cli.cfg, binding),
    )
}
