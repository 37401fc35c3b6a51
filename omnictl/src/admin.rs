//! The admin console's verbs against a coordinator's admin API
//! (`omni.admin.v1` on its `--admin-listen` address): `omnictl workers`, and
//! `omnictl plan --admin` (the running plan, or a dry run of another split).
//! Human tables by default, `--json` for scripts.

use anyhow::Context;
use clap::Args;
use omni_proto::admin::v1::{
    admin_client::AdminClient, GetPlanRequest, ListWorkersRequest, PlanDryRunRequest, WorkerInfo,
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
}

#[derive(Args, Debug)]
pub struct WorkersArgs {
    #[command(flatten)]
    pub admin: AdminArgs,
    #[arg(long)]
    pub json: bool,
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
    let ch = tonic::transport::Endpoint::from_shared(format!("http://{}", a.admin))?
        .connect_timeout(Duration::from_secs(5))
        .timeout(Duration::from_secs(30))
        .connect()
        .await
        .with_context(|| format!("cannot reach the admin API at {}", a.admin))?;
    let header = match &a.token {
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
        "device_name": w.device_name, "memory_total": w.memory_total,
        "memory_free": w.memory_free, "memory_planned": w.memory_planned,
        "stage": (w.kind == "stage").then_some(w.stage), "layers": w.layers,
        "offloaded": w.offloaded, "kv_cells_used": w.kv_cells_used,
        "kv_cells_total": w.kv_cells_total, "steps": w.steps,
        "last_step_ms": w.last_step_ms, "health": w.health,
    })
}

/// The human table of `omnictl workers`.
pub fn workers_table(ws: &[WorkerInfo]) -> String {
    use omni_engine::fmt_bytes;
    let mut out = format!(
        "{:<6} {:<8} {:<6} {:<10} {:>10} {:>10} {:>10}  {:<24} {:<10} {:>11} {:>9}  {}\n",
        "worker",
        "kind",
        "stage",
        "device",
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
        let stage = if w.kind == "stage" {
            w.stage.to_string()
        } else {
            "-".into()
        };
        let experts = if w.kind == "stage" {
            format!("out {}", w.offloaded)
        } else {
            "routed".into()
        };
        let kv = if w.kind == "stage" {
            format!("{}/{}", w.kv_cells_used, w.kv_cells_total)
        } else {
            "-".into()
        };
        let step = if w.kind == "stage" {
            format!("{:.2}", w.last_step_ms)
        } else {
            "-".into()
        };
        out.push_str(&format!(
            "{:<6} {:<8} {:<6} {:<10} {:>10} {:>10} {:>10}  {:<24} {:<10} {:>11} {:>9}  {}\n",
            w.id,
            w.kind,
            stage,
            w.device,
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
