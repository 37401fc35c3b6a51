//! `omni-cpu-worker`: one process per NUMA node, computing routed experts.

use clap::Parser;
use omni_cpu_worker::numa::{self, Binding};

#[derive(Parser)]
#[command(
    name = "omni-cpu-worker",
    version,
    about = "omni expert worker: runs MoE routed experts on one NUMA node's cores and memory",
    args_conflicts_with_subcommands = true,
    subcommand_negates_reqs = true
)]
// Parsed by `omni_runtime::start`: the service's required flags are
// only required when no subcommand is given.
struct Cli {
    #[command(subcommand)]
    command: Option<omni_runtime::start::ServiceCommand>,
    /// A TOML file whose [cpu_worker] table gives settings (also OMNI_CONFIG); OMNI_CPU_WORKER_<SETTING> variables, then flags, override it.
    #[arg(long, value_name = "FILE")]
    config: Option<std::path::PathBuf>,
    #[command(flatten)]
    cfg: omni_cpu_worker::service::CpuWorkerConfig,
}

fn main() {
    let cfg: omni_cpu_worker::service::CpuWorkerConfig =
        omni_runtime::start::settings_or_healthcheck::<Cli, _>(
            "omni-cpu-worker",
            "",
            omni_runtime::config::Service {
                table: "cpu_worker",
                env_prefix: "OMNI_CPU_WORKER_",
                not_settings: &[],
                structured: &[],
            },
        );
    // Bind before the runtime (or anything else) starts a thread: threads
    // inherit the affinity and memory policy of the thread that makes them.
    let binding = match cfg.numa_node {
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
    let telemetry = cfg.telemetry.clone();
    let id = cfg.worker_id();
    omni_runtime::service_main(
        "omni-cpu-worker",
        Some(&id),
        &telemetry,
        omni_cpu_worker::service::run(cfg, binding),
    )
}
