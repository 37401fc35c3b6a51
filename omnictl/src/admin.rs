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
#[derive(Args, Debug, Clone, Default)]
pub struct AdminArgs {
    /// The coordinator's admin address (its --admin-listen), as host:port
    /// or a URL.
    #[arg(long, env = "OMNI_ADMIN", default_value = "127.0.0.1:7071")]
    pub admin: String,
    /// A file holding the admin token (default: the one `omnictl up` wrote
    /// for this address, see --help). The token itself may come from
    /// OMNI_ADMIN_TOKEN; never from a flag, which `ps` would show.
    #[arg(long, env = "OMNI_ADMIN_TOKEN_FILE")]
    pub token_file: Option<std::path::PathBuf>,
    /// Refused: a token on the command line is visible to every user of
    /// the machine. Use --token-file or OMNI_ADMIN_TOKEN.
    #[arg(long, hide = true)]
    pub token: Option<String>,
}

impl AdminArgs {
    /// The admin address as host:port (a URL's scheme and path dropped).
    pub fn addr(&self) -> String {
        crate::remote::host_port(&self.admin)
    }

    /// The token to send: OMNI_ADMIN_TOKEN, else --token-file, else the
    /// file `omnictl up` wrote for this address (if there is one).
    pub fn resolve_token(&self) -> anyhow::Result<Option<String>> {
        Ok(self.token_and_source()?.map(|(t, _)| t))
    }

    /// The token and where it came from (for error messages).
    fn token_and_source(&self) -> anyhow::Result<Option<(String, String)>> {
        if self.token.is_some() {
            anyhow::bail!(
                "--token would show the admin token to every user of this machine (ps); put it in a file and pass --token-file FILE, or set OMNI_ADMIN_TOKEN"
            );
        }
        let env = std::env::var("OMNI_ADMIN_TOKEN")
            .ok()
            .filter(|t| !t.is_empty());
        if let Some(t) = env {
            return Ok(Some((t, "OMNI_ADMIN_TOKEN".into())));
        }
        let what = "the admin token (--token-file)";
        let file = match &self.token_file {
            Some(f) => f.clone(),
            None => token_path(&self.addr()),
        };
        if self.token_file.is_none() && !file.exists() {
            return Ok(None);
        }
        let t = omni_runtime::read_secret(&file, what).map_err(anyhow::Error::msg)?;
        Ok(Some((t, file.display().to_string())))
    }

    /// `e` said in the user's terms: which token to give when the admin
    /// API wants one, what listens at the address when it is not the
    /// admin API.
    pub fn explain(&self, e: anyhow::Error) -> anyhow::Error {
        let Some(Refused(s)) = e.downcast_ref::<Refused>() else {
            return e;
        };
        let addr = self.addr();
        match s.code() {
            tonic::Code::Unauthenticated => match self.token_and_source() {
                Ok(None) if !s.message().contains("no admin token") => anyhow::anyhow!(
                    "the admin API at {addr} wants a token and none was found: set OMNI_ADMIN_TOKEN or pass --token-file FILE (`omnictl up` writes it to {})",
                    token_path(&addr).display()
                ),
                Ok(Some((_, from))) => anyhow::anyhow!(
                    "the admin API at {addr} refused the token from {from}: {}",
                    s.message()
                ),
                _ => e,
            },
            tonic::Code::Unimplemented | tonic::Code::Internal | tonic::Code::Unknown => {
                let what = runtime()
                    .ok()
                    .and_then(|rt| rt.block_on(crate::remote::what_is_at(&addr)));
                match what {
                    Some(w) if !w.contains("admin") => anyhow::anyhow!(
                        "{addr} is {w}, not the coordinator's admin API (its --admin-listen, 127.0.0.1:7071 by default)"
                    ),
                    _ => e,
                }
            }
            _ => e,
        }
    }
}

/// An admin call the coordinator answered with an error.
#[derive(Debug)]
pub(crate) struct Refused(pub tonic::Status);

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "the admin API refused: {}", self.0.message())
    }
}

impl std::error::Error for Refused {}

/// Where `omnictl up` keeps the admin token of the cluster whose admin API
/// is at `addr` (one file per address, readable by the user only):
/// `$XDG_STATE_HOME/omni/admin-token-HOST_PORT`, by default under
/// `~/.local/state`.
pub fn token_path(addr: &str) -> std::path::PathBuf {
    let base = std::env::var_os("XDG_STATE_HOME")
        .filter(|d| !d.is_empty())
        .map(std::path::PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| std::path::Path::new(&h).join(".local/state")))
        .unwrap_or_else(std::env::temp_dir);
    let name: String = addr
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '.' {
                c
            } else {
                '_'
            }
        })
        .collect();
    base.join("omni").join(format!("admin-token-{name}"))
}

/// Where `omnictl up` records the models of a launch of several, for the
/// first model's admin address `addr`: one line per model, `NAME ADMIN_ADDR`
/// (beside the admin tokens, which are one per address).
pub fn launch_path(addr: &str) -> std::path::PathBuf {
    let token = token_path(addr);
    let name = token
        .file_name()
        .map(|n| n.to_string_lossy().replacen("admin-token-", "launch-", 1))
        .unwrap_or_default();
    token.with_file_name(name)
}

/// The models of the launch whose first model's admin API is at `addr`,
/// as `up` recorded them; none for a cluster of one model.
fn launch_models(addr: &str) -> Vec<(String, String)> {
    std::fs::read_to_string(launch_path(addr))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let (name, admin) = l.trim().split_once(' ')?;
            Some((name.to_string(), admin.trim().to_string()))
        })
        .collect()
}

/// The admin APIs `a` stands for: every model's of a launch of several
/// (when its token is not given as a file, which would be one model's),
/// else its own, unnamed.
pub(crate) fn each_model(a: &AdminArgs) -> Vec<(Option<String>, AdminArgs)> {
    let models = if a.token_file.is_none() {
        launch_models(&a.addr())
    } else {
        Vec::new()
    };
    if models.is_empty() {
        return vec![(None, a.clone())];
    }
    models
        .into_iter()
        .map(|(name, admin)| (Some(name), AdminArgs { admin, ..a.clone() }))
        .collect()
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
#[command(override_usage = "omnictl rebalance --layers 8-11 --to w2 [OPTIONS]
       omnictl rebalance --counts 6,6,6 [OPTIONS]
       omnictl rebalance --split 3,1 [OPTIONS]")]
pub struct RebalanceArgs {
    #[command(flatten)]
    pub admin: AdminArgs,
    /// The layers to move, with --to: 8-11 (layers 8 to 11), 8..12 (the
    /// same) or 8.
    #[arg(long, requires = "to", value_parser = omni_engine::parse_layers)]
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
    /// Also print the whole new plan.
    #[arg(long, short)]
    pub verbose: bool,
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
    /// Also print the whole new plan.
    #[arg(long, short)]
    pub verbose: bool,
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
    });
    let reply = reply.map_err(|e| a.admin.explain(e))?;
    print_move(&reply, a.json, a.verbose)
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
    });
    let reply = reply.map_err(|e| a.admin.explain(e))?;
    print_move(&reply, a.json, a.verbose)
}

fn print_move(r: &MoveReply, json: bool, verbose: bool) -> anyhow::Result<()> {
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
    if verbose {
        print!("{}", plan.text);
    } else {
        println!("(the whole plan: omnictl plan, or --verbose)");
    }
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
    let token = a.resolve_token()?;
    let addr = a.addr();
    let ch = omni_transport::tls::endpoint(&addr)?
        .connect_timeout(Duration::from_secs(5))
        .timeout(timeout)
        .connect()
        .await
        .with_context(|| format!("cannot reach the admin API at {addr}"))?;
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
    Refused(s).into()
}

/// `omnictl workers`: one cluster's workers, or every model's of a launch
/// of several (each under its name; `--json`: `{"models": [{"name",
/// "admin", "workers"}]}`).
pub fn workers(a: &WorkersArgs) -> anyhow::Result<()> {
    let rt = runtime()?;
    let models = each_model(&a.admin);
    let mut all = Vec::new();
    for (name, admin) in &models {
        let ws = rt.block_on(async {
            let mut c = admin_client(admin).await?;
            let r = c
                .list_workers(ListWorkersRequest {})
                .await
                .map_err(refused)?;
            anyhow::Ok(r.into_inner().workers)
        });
        let ws = ws.map_err(|e| admin.explain(e));
        let ws = match (name, ws) {
            (Some(n), Err(e)) => Err(e.context(format!("model '{n}'"))),
            (_, r) => r,
        }?;
        all.push((name, admin.addr(), ws));
    }
    if let [(None, _, ws)] = all.as_slice() {
        if a.json {
            let v: Vec<_> = ws.iter().map(worker_json).collect();
            println!("{}", serde_json::to_string_pretty(&v)?);
        } else {
            print!("{}", workers_table(ws));
        }
        return Ok(());
    }
    let sections = all.iter().map(|(name, admin, ws)| ModelSection {
        name: name.as_deref().unwrap_or_default().to_string(),
        admin: admin.clone(),
        key: "workers",
        json: serde_json::Value::Array(ws.iter().map(worker_json).collect()),
        text: workers_table(ws),
    });
    print_models(sections, a.json)
}

/// One model's part of an admin verb's answer for a launch of several.
struct ModelSection {
    name: String,
    admin: String,
    /// The JSON key of `json` beside `name` and `admin`.
    key: &'static str,
    json: serde_json::Value,
    text: String,
}

/// Every model's section: `{"models": [{"name", "admin", KEY}]}` with
/// `json`, else each text under its model's heading.
fn print_models(sections: impl Iterator<Item = ModelSection>, json: bool) -> anyhow::Result<()> {
    let sections: Vec<ModelSection> = sections.collect();
    if json {
        let v: Vec<_> = sections
            .iter()
            .map(|m| {
                let mut o = serde_json::json!({ "name": m.name, "admin": m.admin });
                o[m.key] = m.json.clone();
                o
            })
            .collect();
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({ "models": v }))?
        );
        return Ok(());
    }
    for (i, m) in sections.iter().enumerate() {
        if i > 0 {
            println!();
        }
        println!("model '{}' (admin {}):", m.name, m.admin);
        print!("{}", m.text);
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
    // The running plans of every model of a launch of several; a dry run
    // asks the one coordinator named.
    let models = each_model(a);
    if !dry && models.len() > 1 {
        let mut out = Vec::new();
        for (name, admin) in &models {
            let name = name.clone().unwrap_or_default();
            let reply = rt
                .block_on(async {
                    let mut c = admin_client(admin).await?;
                    anyhow::Ok(
                        c.get_plan(GetPlanRequest {})
                            .await
                            .map_err(refused)?
                            .into_inner(),
                    )
                })
                .map_err(|e| admin.explain(e).context(format!("model '{name}'")))?;
            out.push((name, admin.addr(), reply));
        }
        let sections = out.into_iter().map(|(name, admin, r)| ModelSection {
            name,
            admin,
            key: "plan",
            json: serde_json::from_str(&r.json).unwrap_or(serde_json::Value::Null),
            text: r.text,
        });
        return print_models(sections, json);
    }
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
    });
    let reply = reply.map_err(|e| a.explain(e))?;
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
