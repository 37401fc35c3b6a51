//! The admin console's verbs against a coordinator's admin API
//! (`omni.admin.v1` on its `--admin-listen` address): `omnictl workers`,
//! `omnictl plan --admin` (the running plan, or a dry run of another split),
//! and the live moves `rebalance`, `drain` and `undrain`.
//! Human tables by default, `--json` for scripts.

use anyhow::Context;
use clap::Args;
use omni_proto::admin::v1::{
    admin_client::AdminClient, DrainRequest, GetPlanRequest, ListWorkersRequest, MoveReply,
    PlanDryRunRequest, RebalanceRequest, UndrainRequest, WorkerInfo,
};
use std::time::Duration;

/// Where the admin API is and the token it wants.
#[derive(Args, Debug, Clone)]
pub struct AdminArgs {
    /// The coordinator's admin address (its --admin-listen).
    #[arg(long, env = "OMNI_ADMIN", default_value = "127.0.0.1:7071")]
    pub admin: String,
    /// The admin token (the coordinator's --admin-token).
    #[arg(long, env = "OMNI_ADMIN_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// A file holding the admin token (e.g. /run/secrets/admin_token).
    #[arg(long, env = "OMNI_ADMIN_TOKEN_FILE")]
    pub token_file: Option<std::path::PathBuf>,
}

#[derive(Args, Debug)]
pub struct WorkersArgs {
    #[command(flatten)]
    pub admin: AdminArgs,
    #[arg(long)]
    pub json: bool,
}

/// `omnictl rebalance`: move layers to a worker, or apply a new split.
#[derive(Args, Debug)]
#[command(group(clap::ArgGroup::new("how").required(true).args(["layers", "split", "counts"])))]
pub struct RebalanceArgs {
    #[command(flatten)]
    pub admin: AdminArgs,
    /// The layers to move (e.g. 8-11, inclusive), with --to.
    #[arg(long, requires = "to", value_parser = parse_layer_range)]
    pub layers: Option<std::ops::Range<u32>>,
    /// The worker that takes them (it must run the layers next to them).
    #[arg(long)]
    pub to: Option<String>,
    /// A new split over the serving workers by proportion (e.g. 3,1).
    #[arg(long, value_delimiter = ',')]
    pub split: Option<Vec<f64>>,
    /// A new split over the serving workers by layer counts (e.g. 6,6,6).
    #[arg(long, value_delimiter = ',')]
    pub counts: Option<Vec<u32>>,
    #[arg(long)]
    pub json: bool,
}

/// `omnictl drain` / `undrain`.
#[derive(Args, Debug)]
pub struct DrainArgs {
    /// The worker's id (as `omnictl workers` shows it).
    pub worker: String,
    #[command(flatten)]
    pub admin: AdminArgs,
    #[arg(long)]
    pub json: bool,
}

/// "8-11" (inclusive) or "8" as the range 8..12 or 8..9.
fn parse_layer_range(s: &str) -> Result<std::ops::Range<u32>, String> {
    let num = |x: &str| {
        x.trim()
            .parse::<u32>()
            .map_err(|_| format!("'{s}' is not a layer range like 8-11"))
    };
    let (a, b) = match s.split_once('-') {
        Some((a, b)) => (num(a)?, num(b)?),
        None => (num(s)?, num(s)?),
    };
    if b < a {
        return Err(format!("'{s}': the range ends before it starts"));
    }
    Ok(a..b + 1)
}

pub fn rebalance(a: &RebalanceArgs) -> anyhow::Result<()> {
    let req = RebalanceRequest {
        layer_start: a.layers.as_ref().map_or(0, |r| r.start),
        layer_end: a.layers.as_ref().map_or(0, |r| r.end),
        to: a.to.clone().unwrap_or_default(),
        layers: a.counts.clone().unwrap_or_default(),
        split: a.split.clone().unwrap_or_default(),
    };
    let reply = runtime()?.block_on(async {
        let mut c = move_client(&a.admin).await?;
        anyhow::Ok(c.rebalance(req).await.map_err(refused)?.into_inner())
    })?;
    print_move(&reply, a.json)
}

pub fn drain(a: &DrainArgs, undrain: bool) -> anyhow::Result<()> {
    let reply = runtime()?.block_on(async {
        let mut c = move_client(&a.admin).await?;
        let worker = a.worker.clone();
        let r = if undrain {
            c.undrain(UndrainRequest { worker }).await
        } else {
            c.drain(DrainRequest { worker }).await
        };
        anyhow::Ok(r.map_err(refused)?.into_inner())
    })?;
    print_move(&reply, a.json)
}

fn print_move(r: &MoveReply, json: bool) -> anyhow::Result<()> {
    let plan = r.plan.clone().unwrap_or_default();
    if json {
        let plan: serde_json::Value =
            serde_json::from_str(&plan.json).unwrap_or(serde_json::Value::Null);
        let v = serde_json::json!({
            "moves": r.moves, "unchanged": r.unchanged,
            "prepare_seconds": r.prepare_seconds, "pause_seconds": r.pause_seconds,
            "total_seconds": r.total_seconds, "kv_bytes": r.kv_bytes, "plan": plan,
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    if r.unchanged {
        println!("nothing to move: the cluster already runs this split");
    } else {
        println!("moved:");
        for m in &r.moves {
            println!("  {m}");
        }
        println!(
            "loaded the new ranges in {:.2}s while serving; the pipeline paused {:.1} ms to hand over {} of KV cache; {:.2}s in all",
            r.prepare_seconds,
            r.pause_seconds * 1e3,
            omni_engine::fmt_bytes(r.kv_bytes),
            r.total_seconds
        );
    }
    print!("{}", plan.text);
    Ok(())
}

/// A client for moves, which may take as long as loading layers does.
pub(crate) async fn move_client(a: &AdminArgs) -> anyhow::Result<Client> {
    client_with_timeout(a, Duration::from_secs(3600)).await
}

/// Adds `authorization: Bearer <token>` to every call (when there is a token).
#[derive(Clone)]
pub(crate) struct Bearer(Option<tonic::metadata::MetadataValue<tonic::metadata::Ascii>>);

impl tonic::service::Interceptor for Bearer {
    fn call(&mut self, mut r: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(h) = &self.0 {
            r.metadata_mut().insert("authorization", h.clone());
        }
        Ok(r)
    }
}

type Client =
    AdminClient<tonic::service::interceptor::InterceptedService<tonic::transport::Channel, Bearer>>;

/// A client of the admin API at `a.admin`, sending `a.token`.
pub(crate) async fn admin_client(a: &AdminArgs) -> anyhow::Result<Client> {
    client_with_timeout(a, Duration::from_secs(30)).await
}

async fn client_with_timeout(a: &AdminArgs, timeout: Duration) -> anyhow::Result<Client> {
    let ch = tonic::transport::Endpoint::from_shared(format!("http://{}", a.admin))?
        .connect_timeout(Duration::from_secs(5))
        .timeout(timeout)
        .connect()
        .await
        .with_context(|| format!("cannot reach the admin API at {}", a.admin))?;
    let token = omni_telemetry::value_or_secret_file(
        a.token.clone(),
        a.token_file.as_deref(),
        "the admin token (--token / --token-file)",
    )
    .map_err(anyhow::Error::msg)?;
    let header = match &token {
        Some(t) => Some(
            format!("Bearer {t}")
                .parse()
                .context("the admin token is not a valid header value")?,
        ),
        None => None,
    };
    Ok(AdminClient::with_interceptor(ch, Bearer(header)))
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?)
}

pub(crate) fn refused(s: tonic::Status) -> anyhow::Error {
    anyhow::anyhow!("the admin API refused: {} ({:?})", s.message(), s.code())
}

pub fn workers(a: &WorkersArgs) -> anyhow::Result<()> {
    let rt = runtime()?;
    let ws = rt.block_on(async {
        let mut c = admin_client(&a.admin).await?;
        let r = c
            .list_workers(ListWorkersRequest {})
            .await
            .map_err(refused)?;
        anyhow::Ok(r.into_inner().workers)
    })?;
    if a.json {
        let v: Vec<_> = ws.iter().map(worker_json).collect();
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        print!("{}", workers_table(&ws));
    }
    Ok(())
}

fn worker_json(w: &WorkerInfo) -> serde_json::Value {
    serde_json::json!({
        "id": w.id, "kind": w.kind, "addr": w.addr, "device": w.device,
        "device_name": w.device_name, "cpu_variant": w.cpu_variant,
        "cpu_features": w.cpu_features, "gpu": w.gpu, "memory_total": w.memory_total,
        "memory_free": w.memory_free, "memory_planned": w.memory_planned,
        "stage": (w.kind == "stage").then_some(w.stage), "layers": w.layers,
        "offloaded": w.offloaded, "kv_cells_used": w.kv_cells_used,
        "kv_cells_total": w.kv_cells_total, "steps": w.steps,
        "last_step_ms": w.last_step_ms, "health": w.health,
        "memory_used": w.memory_used, "drained": w.drained,
        "layer_start": w.layer_start, "layer_end": w.layer_end,
        "weight_read_rate": w.weight_read_rate,
    })
}

/// The human table of `omnictl workers`.
pub fn workers_table(ws: &[WorkerInfo]) -> String {
    use omni_engine::fmt_bytes;
    let mut out = format!(
        "{:<6} {:<8} {:<6} {:<10} {:>10} {:<14} {:>10} {:>10} {:>10}  {:<24} {:<10} {:>11} {:>9}  {}\n",
        "worker",
        "kind",
        "stage",
        "device",
        "reads",
        "cpu variant",
        "total",
        "free",
        "planned",
        "layers",
        "experts",
        "KV cells",
        "step ms",
        "health"
    );
    for w in ws {
        let serving = w.kind == "stage" && !w.drained;
        let stage = if serving {
            w.stage.to_string()
        } else {
            "-".into()
        };
        let experts = if serving {
            format!("out {}", w.offloaded)
        } else if w.kind == "experts" {
            "routed".into()
        } else {
            "-".into()
        };
        let kv = if serving {
            format!("{}/{}", w.kv_cells_used, w.kv_cells_total)
        } else {
            "-".into()
        };
        let step = if serving {
            format!("{:.2}", w.last_step_ms)
        } else {
            "-".into()
        };
        let reads = if w.weight_read_rate > 0.0 {
            format!("{:.1}GB/s", w.weight_read_rate / 1e9)
        } else {
            "-".into()
        };
        out.push_str(&format!(
            "{:<6} {:<8} {:<6} {:<10} {:>10} {:<14} {:>10} {:>10} {:>10}  {:<24} {:<10} {:>11} {:>9}  {}\n",
            w.id,
            w.kind,
            stage,
            w.device,
            reads,
            if w.cpu_variant.is_empty() {
                "-"
            } else {
                &w.cpu_variant
            },
            fmt_bytes(w.memory_total),
            fmt_bytes(w.memory_free),
            fmt_bytes(w.memory_planned),
            w.layers,
            experts,
            kv,
            step,
            w.health
        ));
    }
    for w in ws.iter().filter(|w| !w.gpu.is_empty()) {
        out.push_str(&format!("{} {}: {}\n", w.id, w.device, w.gpu));
    }
    out
}

/// `omnictl plan --admin`: the running plan, or with a split a dry run.
pub fn plan(
    a: &AdminArgs,
    layers: Option<Vec<u32>>,
    split: Option<Vec<f64>>,
    experts: Option<String>,
    gpu_experts: Option<u32>,
    json: bool,
) -> anyhow::Result<()> {
    let rt = runtime()?;
    let dry = layers.is_some() || split.is_some() || experts.is_some() || gpu_experts.is_some();
    let reply = rt.block_on(async {
        let mut c = admin_client(a).await?;
        let r = if dry {
            c.plan_dry_run(PlanDryRunRequest {
                layers: layers.unwrap_or_default(),
                split: split.unwrap_or_default(),
                experts: experts.unwrap_or_default(),
                gpu_experts,
            })
            .await
        } else {
            c.get_plan(GetPlanRequest {}).await
        };
        anyhow::Ok(r.map_err(refused)?.into_inner())
    })?;
    if json {
        println!("{}", reply.json);
    } else {
        if dry {
            println!("dry run: nothing moves; the cluster keeps its plan");
        }
        print!("{}", reply.text);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A GPU worker's GPU is listed under the table, one line each; CPU
    /// workers add nothing.
    #[test]
    fn the_workers_table_names_each_gpu() {
        let gpu = WorkerInfo {
            id: "g0".into(),
            kind: "stage".into(),
            device: "cuda:0".into(),
            gpu: "NVIDIA H100 80GB HBM3, compute 9.0, PCIe gen 5 x16, driver 580.82.07, CUDA 13.0, GPU-1234".into(),
            ..Default::default()
        };
        let cpu = WorkerInfo {
            id: "w1".into(),
            kind: "stage".into(),
            device: "cpu".into(),
            stage: 1,
            ..Default::default()
        };
        let t = workers_table(&[gpu.clone(), cpu]);
        assert!(
            t.lines().any(|l| l == format!("g0 cuda:0: {}", gpu.gpu)),
            "{t}"
        );
        assert_eq!(t.lines().count(), 4, "header, two workers, one GPU: {t}");
        assert_eq!(worker_json(&gpu)["gpu"], gpu.gpu.as_str());
    }
}
