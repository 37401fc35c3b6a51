//! `omnictl plan`: shows how a model would be split across devices, and the
//! arithmetic behind it, without loading anything. The same planner the
//! coordinator runs before it asks any worker to load. With
//! `--coordinator ADDR` it shows a running cluster's plan instead, with the
//! routing statistics of every offloaded layer and the experts its stage
//! keeps (`--gpu-experts`).

use anyhow::Context;
use clap::Args;
use omni_engine::ModelFile;
use omni_planner::{
    parse_size, plan_with_experts, ExpertPolicy, Plan, PlanConfig, Split, WorkerSpec,
};

#[derive(Args, Debug)]
#[command(
    override_usage = "omnictl plan --model M --devices NAME:SIZE,... [--counts 12,6 | --split 3,1] [OPTIONS]
       omnictl plan --model NAME=M[,device=D+D,...] --model NAME=M[,...] --devices NAME:SIZE,... [--json]
       omnictl plan [--admin ADDR] [--counts 12,6 | --split 3,1 | --experts ..] [--json]
       omnictl plan --coordinator ADDR [--json]"
)]
pub struct PlanArgs {
    /// GGUF path or known model name (without it, and without
    /// --coordinator, the plan of the cluster at --admin is shown).
    /// Repeated as NAME=PATH[,KEY=VALUE...]: several models planned
    /// together on the same --devices (each named once, with its memory),
    /// each model on what the ones before it left; a model's settings:
    /// device (its stages' devices in order, joined with '+'; default: every
    /// device), cpu-workers (expert workers on the device named cpu),
    /// threads, ctx, seqs, experts, gpu-experts, split, counts.
    #[arg(long, short)]
    pub model: Vec<String>,
    /// The host's cores, for a joint plan's thread count (default: this
    /// machine's).
    #[arg(long)]
    pub cores: Option<usize>,
    /// The devices in pipeline order, each NAME:SIZE with the memory it offers
    /// (e.g. cpu:6GiB,cpu:2GiB or cuda:0:20GiB,cuda:1:8GiB). They become
    /// workers w0, w1, ...; the name is everything before the last ':'.
    /// NAME:SIZE@RATE adds how fast the device reads weights (e.g.
    /// cuda:0:24GiB@900GB/s,cpu:96GiB@40GB/s, as `omnictl workers` shows a
    /// worker's): with a rate for every device the split balances time.
    #[arg(long, value_delimiter = ',', requires = "model")]
    pub devices: Vec<String>,
    /// Show the plan of the cluster this coordinator runs, with each
    /// offloaded layer's routing statistics and device experts.
    #[arg(long, conflicts_with_all = ["model", "devices", "expert_devices"])]
    pub coordinator: Option<String>,
    /// Ask this coordinator's admin API for the plan it runs, or, with
    /// --counts, --split, --experts or --gpu-experts, a dry run of another
    /// one on the same workers (nothing moves). The default without
    /// --model: OMNI_ADMIN, else 127.0.0.1:7071.
    #[arg(long, conflicts_with_all = ["model", "devices", "expert_devices", "coordinator"])]
    pub admin: Option<String>,
    /// A file holding the admin token (default: the one `omnictl up` wrote
    /// for this address); the token itself may come from OMNI_ADMIN_TOKEN.
    #[arg(long, env = "OMNI_ADMIN_TOKEN_FILE")]
    pub token_file: Option<std::path::PathBuf>,
    /// Refused: use --token-file or OMNI_ADMIN_TOKEN.
    #[arg(long, hide = true)]
    pub token: Option<String>,
    /// Expert workers that can run MoE layers' routed experts, each
    /// NAME:SIZE (e.g. numa0:256GiB,numa1:256GiB). They become c0, c1, ...
    #[arg(long, value_delimiter = ',')]
    pub expert_devices: Vec<String>,
    /// Where routed experts run: auto (on the devices when the model fits
    /// them, else as few layers' as possible on the expert workers), device
    /// or cpu (all on the expert workers). Default: auto (with --admin: the
    /// cluster's).
    #[arg(long, value_enum)]
    pub experts: Option<ExpertPolicy>,
    /// Routed experts of each offloaded layer its device stage holds as
    /// well. Default: 0 (with --admin: the cluster's).
    #[arg(long)]
    pub gpu_experts: Option<u32>,
    /// Context length of one sequence.
    #[arg(long, default_value_t = 4096)]
    pub ctx: usize,
    /// Sequences resident at once (KV cache slots); 8, as the coordinator.
    #[arg(long, default_value_t = 8)]
    pub seqs: usize,
    /// Most tokens in one step (sizes the compute buffer).
    #[arg(long, default_value_t = 512)]
    pub ubatch: usize,
    /// Fraction of each device's memory left unplanned.
    #[arg(long, default_value_t = 0.10)]
    pub headroom: f64,
    /// Manual split by proportion, like llama.cpp's --tensor-split (e.g. 3,1).
    #[arg(long, value_delimiter = ',', conflicts_with = "counts")]
    pub split: Option<Vec<f64>>,
    /// Manual split by layer count per device (e.g. 12,12).
    #[arg(long, value_delimiter = ',')]
    pub counts: Option<Vec<u32>>,
    /// Refused with a pointer to --counts (here --layers would be a range).
    #[arg(long, hide = true)]
    pub layers: Option<String>,
    /// Print the plan as JSON.
    #[arg(long)]
    pub json: bool,
}

/// `NAME:SIZE` entries to workers `w0`, `w1`, ...
pub fn parse_devices(devices: &[String]) -> anyhow::Result<Vec<WorkerSpec>> {
    parse_workers(devices, "w")
}

/// `NAME:SIZE` entries to expert workers `c0`, `c1`, ...
pub fn parse_expert_devices(devices: &[String]) -> anyhow::Result<Vec<WorkerSpec>> {
    parse_workers(devices, "c")
}

fn parse_workers(devices: &[String], prefix: &str) -> anyhow::Result<Vec<WorkerSpec>> {
    devices
        .iter()
        .enumerate()
        .map(|(i, d)| {
            // "cuda:0:24GiB, cpu:64GiB" splits into " cpu:64GiB".
            let d = d.trim();
            let (d_mem, rate) = match d.split_once('@') {
                Some((m, r)) => (m, Some(r)),
                None => (d, None),
            };
            let (name, size) = d_mem
                .rsplit_once(':')
                .map(|(n, s)| (n.trim(), s))
                .filter(|(n, _)| !n.is_empty())
                .with_context(|| format!("device '{d}' needs a name and a size, like cpu:6GiB"))?;
            let bytes = parse_size(size).map_err(|e| anyhow::anyhow!("device '{d}': {e}"))?;
            let read_rate = match rate {
                None => 0,
                Some(r) => omni_engine::parse_rate(r)
                    .map_err(|e| anyhow::anyhow!("device '{d}': after @, {e}"))?,
            };
            Ok(WorkerSpec {
                id: format!("{prefix}{i}"),
                device: name.to_string(),
                free_bytes: bytes,
                total_bytes: bytes,
                read_rate,
                // Hypothetical devices: each its own memory.
                pool: None,
            })
        })
        .collect()
}

pub fn run(args: &PlanArgs) -> anyhow::Result<()> {
    if let Some(addr) = &args.coordinator {
        return live(addr, args.json);
    }
    if let Some(l) = &args.layers {
        anyhow::bail!("{}", crate::counts_not_layers(l));
    }
    // Several models, or one with a name (NAME=PATH): the joint plan.
    let named =
        || crate::models::parse_all(&args.model).is_ok_and(|m| m.iter().any(|s| s.name.is_some()));
    if args.admin.is_none() && (args.model.len() > 1 || named()) {
        let p = joint(args)?;
        if args.json {
            println!("{}", serde_json::to_string_pretty(&p)?);
        } else {
            print!("{p}");
        }
        return Ok(());
    }
    if args.admin.is_some() || args.model.is_empty() {
        let addr = args
            .admin
            .clone()
            .or_else(|| std::env::var("OMNI_ADMIN").ok().filter(|a| !a.is_empty()))
            .unwrap_or_else(|| "127.0.0.1:7071".into());
        let a = crate::admin::AdminArgs {
            admin: addr,
            token: args.token.clone(),
            token_file: args.token_file.clone(),
        };
        return crate::admin::plan(
            &a,
            args.counts.clone(),
            args.split.clone(),
            args.experts.map(|e| e.name().to_string()),
            args.gpu_experts,
            args.json,
        );
    }
    let p = make_plan(args)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&p)?);
    } else {
        print!("{p}");
    }
    Ok(())
}

/// The plan the arguments ask for.
pub fn make_plan(args: &PlanArgs) -> anyhow::Result<Plan> {
    if args.devices.is_empty() {
        anyhow::bail!(
            "--devices is needed with --model: the memory each worker offers, e.g. --devices cuda:0:24GiB,cpu:64GiB"
        );
    }
    let workers = parse_devices(&args.devices)?;
    let expert_workers = parse_expert_devices(&args.expert_devices)?;
    let path = crate::resolve_model(args.model.first().context("--model is needed")?)?;
    let model =
        ModelFile::open(&path).with_context(|| format!("cannot plan {}", path.display()))?;
    let cfg = PlanConfig {
        n_ctx: args.ctx,
        n_seq: args.seqs,
        n_ubatch: args.ubatch,
        headroom: args.headroom,
        split: match (&args.split, &args.counts) {
            (Some(p), _) => Some(Split::Proportions(p.clone())),
            (None, Some(l)) => Some(Split::Layers(l.clone())),
            (None, None) => None,
        },
        experts: args.experts.unwrap_or_default(),
        gpu_experts: args.gpu_experts.unwrap_or(0),
    };
    Ok(plan_with_experts(&model, &workers, &expert_workers, &cfg)?)
}

/// Several models planned together on `--devices` (see `--model`).
pub fn joint(args: &PlanArgs) -> anyhow::Result<omni_planner::JointPlan> {
    use crate::models::{parse_all, plus_list, split_of, worker, PlannedModel};
    if args.devices.is_empty() {
        anyhow::bail!(
            "--devices is needed with --model: every device the models share, each once with the memory it offers, e.g. --devices cuda:0:96GiB,cpu:256GiB"
        );
    }
    let devices: Vec<omni_planner::JointDevice> = parse_devices(&args.devices)?
        .into_iter()
        .map(|w| omni_planner::JointDevice {
            name: w.device,
            free: w.free_bytes,
        })
        .collect();
    for (i, d) in devices.iter().enumerate() {
        if devices[..i].iter().any(|o| o.name == d.name) {
            anyhow::bail!(
                "--devices names {} twice: with several models each device is named once, and each model says which it runs on (device=...)",
                d.name
            );
        }
    }
    let cores = args
        .cores
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let specs = parse_all(&args.model)?;
    let n_models = specs.len();
    let mut models = Vec::new();
    for mut spec in specs {
        let name = spec.label();
        let stage_devices = spec
            .take_parsed("device", |v| plus_list(v, str::parse::<String>))?
            .unwrap_or_else(|| devices.iter().map(|d| d.name.clone()).collect());
        let cpu_workers = spec
            .take_parsed("cpu-workers", str::parse::<usize>)?
            .unwrap_or(0);
        let threads = spec.take_parsed("threads", str::parse::<usize>)?;
        let cfg = PlanConfig {
            n_ctx: spec
                .take_parsed("ctx", str::parse::<usize>)?
                .unwrap_or(args.ctx),
            n_seq: spec
                .take_parsed("seqs", str::parse::<usize>)?
                .unwrap_or(args.seqs),
            n_ubatch: args.ubatch,
            headroom: args.headroom,
            split: split_of(&mut spec)?,
            experts: spec
                .take_parsed("experts", |v| {
                    <ExpertPolicy as clap::ValueEnum>::from_str(v, false)
                })?
                .or(args.experts)
                .unwrap_or_default(),
            gpu_experts: spec
                .take_parsed("gpu-experts", str::parse::<u32>)?
                .or(args.gpu_experts)
                .unwrap_or(0),
        };
        spec.finish(&[
            "device",
            "cpu-workers",
            "threads",
            "ctx",
            "seqs",
            "experts",
            "gpu-experts",
            "split",
            "counts",
        ])?;
        let path = crate::resolve_model(&spec.model)?;
        let file = ModelFile::open(&path)
            .with_context(|| format!("model '{name}': cannot read {}", path.display()))?;
        // Threads: a model's own, else an equal share of the cores for its
        // stages and for each of its expert workers.
        let share = (cores / (n_models * (1 + cpu_workers))).max(1);
        models.push(PlannedModel {
            name,
            file,
            workers: stage_devices
                .iter()
                .enumerate()
                .map(|(i, d)| worker(format!("w{i}"), d, None))
                .collect(),
            expert_workers: (0..cpu_workers)
                .map(|i| worker(format!("c{i}"), "cpu", None))
                .collect(),
            cfg,
            threads: threads.unwrap_or(share),
            expert_threads: threads.unwrap_or(share),
        });
    }
    crate::models::plan_models(&models, &devices, args.headroom, cores)
}

/// A running cluster's plan, and where each offloaded layer's experts run
/// now: the experts its stage keeps and the most used ones.
fn live(addr: &str, json: bool) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let timeout = std::time::Duration::from_secs(5);
    let info = rt.block_on(crate::remote::info(addr, timeout))?;
    let statuses = rt.block_on(crate::remote::statuses(&info))?;
    let mut layers = Vec::new();
    for (s, st) in info.stages.iter().zip(statuses) {
        for u in st.experts {
            layers.push((s.worker_id.clone(), u));
        }
    }
    if json {
        let v: Vec<_> = layers
            .iter()
            .map(|(w, u)| {
                serde_json::json!({
                    "worker": w, "layer": u.layer, "on_device": u.on_device, "counts": u.counts,
                })
            })
            .collect();
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({
                "plan": info.plan, "state": info.state, "offloaded_layers": v,
            }))?
        );
        return Ok(());
    }
    print!("{}", info.plan);
    if layers.is_empty() {
        return Ok(());
    }
    println!("offloaded layers now (routing statistics since load):");
    println!(
        "{:<8} {:>5} {:>9}  {:<24} most used (expert:count)",
        "worker", "layer", "routed", "on the device"
    );
    for (w, u) in &layers {
        let mut top: Vec<(usize, u64)> = u.counts.iter().copied().enumerate().collect();
        top.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        let top: Vec<String> = top
            .iter()
            .take(8)
            .filter(|(_, n)| *n > 0)
            .map(|(e, n)| format!("{e}:{n}"))
            .collect();
        let kept = if u.on_device.is_empty() {
            "none".to_string()
        } else {
            format!("{:?}", u.on_device)
        };
        println!(
            "{w:<8} {:>5} {:>9}  {kept:<24} {}",
            u.layer,
            u.counts.iter().sum::<u64>(),
            top.join(" ")
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_become_numbered_workers() {
        let ws = parse_devices(&["cpu:6GiB".into(), "cuda:1:512MiB".into()]).unwrap();
        assert_eq!(ws[0].id, "w0");
        assert_eq!(ws[0].device, "cpu");
        assert_eq!(ws[0].free_bytes, 6 << 30);
        assert_eq!(ws[1].id, "w1");
        assert_eq!(ws[1].device, "cuda:1");
        assert_eq!(ws[1].free_bytes, 512 << 20);
        let e = parse_devices(&["cpu".into()]).unwrap_err().to_string();
        assert!(e.contains("'cpu'"), "{e}");
        let e = parse_devices(&["cpu:lots".into()]).unwrap_err().to_string();
        assert!(e.contains("cpu:lots") && e.contains("'lots'"), "{e}");
        // A size needs its unit: cuda:96 is not 96 bytes on "cuda".
        let e = parse_devices(&["cuda:96".into()]).unwrap_err().to_string();
        assert!(
            e.contains("device 'cuda:96'") && e.contains("'96' has no unit: write 96GiB or 96GB"),
            "{e}"
        );
        // GB is decimal, GiB binary.
        let ws = parse_devices(&["cuda:0:96GB".into(), "cuda:1:96GiB".into()]).unwrap();
        assert_eq!(ws[0].free_bytes, 96_000_000_000);
        assert_eq!(ws[1].free_bytes, 96 << 30);
        // Spaces around an entry (after the comma) and its name are not part of them.
        let ws = parse_devices(&[
            "cuda:0:24GiB".into(),
            " cpu:64GiB ".into(),
            " cpu : 1GiB".into(),
        ])
        .unwrap();
        assert_eq!(ws[1].device, "cpu");
        assert_eq!(ws[1].free_bytes, 64 << 30);
        assert_eq!(ws[2].device, "cpu");
        assert_eq!(ws[2].free_bytes, 1 << 30);
        assert!(
            ws.iter().all(|w| w.pool.is_none()),
            "each device its own memory"
        );

        let cs = parse_expert_devices(&["numa0:256GiB".into(), "numa1:1TiB".into()]).unwrap();
        assert_eq!(cs[0].id, "c0");
        assert_eq!(cs[0].device, "numa0");
        assert_eq!(cs[0].free_bytes, 256 << 30);
        assert_eq!(cs[1].id, "c1");
        assert_eq!(cs[1].free_bytes, 1 << 40);
        let e = parse_expert_devices(&[":1GiB".into()])
            .unwrap_err()
            .to_string();
        assert!(e.contains("':1GiB'"), "{e}");

        // A read rate after @, in bytes per second.
        let ws =
            parse_devices(&["cuda:0:24GiB@900GB/s".into(), "cpu:96GiB@40GiB/s".into()]).unwrap();
        assert_eq!(ws[0].device, "cuda:0");
        assert_eq!(ws[0].free_bytes, 24 << 30);
        assert_eq!(ws[0].read_rate, 900_000_000_000);
        assert_eq!(ws[1].read_rate, 40 << 30);
        assert_eq!(parse_devices(&["cpu:6GiB".into()]).unwrap()[0].read_rate, 0);
        for (bad, says) in [
            ("cpu:6GiB@40GB", "bytes per second"),
            ("cpu:6GiB@fast/s", "not a rate"),
            ("cpu:6GiB@0GB/s", "out of range"),
        ] {
            let e = parse_devices(&[bad.into()]).unwrap_err().to_string();
            assert!(e.contains(bad) && e.contains(says), "{bad}: {e}");
        }
    }

    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        plan: PlanArgs,
    }

    fn args(line: &[&str]) -> Result<PlanArgs, clap::Error> {
        use clap::Parser;
        Cli::try_parse_from(std::iter::once("plan").chain(line.iter().copied())).map(|c| c.plan)
    }

    fn tiny_deepseek2() -> String {
        let manifest = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"));
        let dir = std::env::var_os("OMNI_FIXTURES_DIR")
            .map(std::path::PathBuf::from)
            .unwrap_or_else(|| manifest.join("../../shared/fixtures"));
        dir.join("synthetic/tiny-deepseek2-mla-f32.gguf")
            .display()
            .to_string()
    }

    #[test]
    fn expert_flags_parse_with_their_defaults() {
        let a = args(&["-m", "x.gguf", "--devices", "cpu:6GiB"]).unwrap();
        assert_eq!(a.experts, None);
        assert_eq!(a.gpu_experts, None);
        assert!(a.expert_devices.is_empty());
        let a = args(&[
            "-m",
            "x.gguf",
            "--devices",
            "cuda:0:24GiB",
            "--expert-devices",
            "numa0:256GiB,numa1:256GiB",
            "--experts",
            "cpu",
            "--gpu-experts",
            "2",
        ])
        .unwrap();
        assert_eq!(a.experts, Some(ExpertPolicy::Cpu));
        assert_eq!(a.gpu_experts, Some(2));
        assert_eq!(a.expert_devices, ["numa0:256GiB", "numa1:256GiB"]);
        for (flag, want) in [
            ("auto", ExpertPolicy::Auto),
            ("device", ExpertPolicy::Device),
        ] {
            let a = args(&["-m", "x", "--devices", "cpu:1GiB", "--experts", flag]).unwrap();
            assert_eq!(a.experts, Some(want));
        }
        let e = args(&["-m", "x", "--devices", "cpu:1GiB", "--experts", "gpu"])
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("gpu") && e.contains("auto"), "{e}");
    }

    /// `--experts cpu` on the tiny DeepSeek file: every MoE layer's experts
    /// on c0, and the JSON carries them.
    #[test]
    fn the_json_plan_carries_the_offloaded_experts() {
        let model = tiny_deepseek2();
        let a = args(&[
            "-m",
            &model,
            "--devices",
            "cpu:1GiB,cpu:1GiB",
            "--expert-devices",
            "numa0:1GiB",
            "--experts",
            "cpu",
            "--ctx",
            "256",
            "--seqs",
            "1",
        ])
        .unwrap();
        let p = make_plan(&a).unwrap();
        let json: serde_json::Value = serde_json::to_value(&p).unwrap();
        assert_eq!(json["config"]["experts"], "cpu");
        assert_eq!(json["config"]["gpu_experts"], 0);
        assert_eq!(json["experts"][0]["worker"], "c0");
        assert_eq!(json["experts"][0]["device"], "numa0");
        assert_eq!(json["experts"][0]["layers"], serde_json::json!([1, 2, 3]));
        let out: Vec<serde_json::Value> = json["stages"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|s| s["offloaded"].as_array().unwrap().clone())
            .collect();
        assert_eq!(out, [1, 2, 3]);

        // The same without expert workers is refused, saying what is missing.
        let a = args(&["-m", &model, "--devices", "cpu:1GiB", "--experts", "cpu"]).unwrap();
        let e = make_plan(&a).unwrap_err().to_string();
        assert!(e.contains("--expert-devices"), "{e}");
    }
}
