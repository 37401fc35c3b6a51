//! `omni.admin.v1`: the operators' view of the cluster, on its own listener.
//!
//! Every call carries `authorization: Bearer <token>`, compared in constant
//! time with the coordinator's `--admin-token`; a coordinator without a
//! token refuses them all, so the admin API is never open by accident.

use crate::error::Error;
use crate::migrate::{ClusterView, Live};
use crate::plan::{self, ExpertPolicy, Plan, Split};
use omni_proto::admin::v1::{
    admin_server, DrainRequest, GetPlanRequest, ListWorkersReply, ListWorkersRequest, MoveReply,
    PlanDryRunRequest, PlanReply, RebalanceRequest, UndrainRequest, WorkerInfo,
};
use omni_proto::coordinator::v1::InfoReply;
use omni_proto::coordinator::v1::WorkerKind;
use omni_proto::worker::v1::{worker_client::WorkerClient, StatusRequest};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tonic::{Request, Response, Status};

/// What the admin service reads: the view once the cluster is up, and the
/// health the watchers report.
pub struct AdminState {
    pub view: Mutex<Option<Arc<ClusterView>>>,
    pub metrics: Arc<crate::metrics::Metrics>,
    /// Worker id -> "serving" or why not.
    pub health: Mutex<HashMap<String, String>>,
    /// The running cluster, for moves (one at a time).
    live: tokio::sync::Mutex<Option<Live>>,
    /// The coordinator's Info, kept true after moves.
    info: Mutex<Option<Arc<Mutex<InfoReply>>>>,
}

/// A change of placement the admin API was asked for.
enum MoveOp {
    Rebalance(RebalanceRequest),
    Drain(String),
    Undrain(String),
}

impl AdminState {
    pub fn new(metrics: Arc<crate::metrics::Metrics>) -> AdminState {
        AdminState {
            view: Mutex::default(),
            metrics,
            health: Mutex::default(),
            live: tokio::sync::Mutex::const_new(None),
            info: Mutex::default(),
        }
    }

    /// Whether `worker` is registered but out of the pipeline.
    pub fn is_drained(&self, worker: &str) -> bool {
        self.view.lock().unwrap().as_ref().is_some_and(|v| {
            v.placements
                .iter()
                .any(|p| p.drained && p.worker.id == worker)
        })
    }

    pub fn set_info(&self, info: Arc<Mutex<InfoReply>>) {
        *self.info.lock().unwrap() = Some(info);
    }

    /// The cluster is up: what the admin API shows, and what moves change.
    pub fn set_live(&self, live: Live) {
        *self.view.lock().unwrap() = Some(Arc::new(live.view()));
        *self
            .live
            .try_lock()
            .expect("no move before the cluster is up") = Some(live);
    }

    /// Carries out a move (moves wait for each other), then updates the
    /// view and the coordinator's Info.
    async fn move_cluster(&self, op: MoveOp) -> Result<MoveReply, Status> {
        let mut guard = self.live.lock().await;
        let live = guard.as_mut().ok_or_else(|| {
            Status::from(Error::not_ready(
                "the cluster is still starting: nothing can move yet",
            ))
        })?;
        let reply = match op {
            MoveOp::Rebalance(r) => {
                let counts = match (r.to.is_empty(), r.layers.is_empty(), r.split.is_empty()) {
                    (false, true, true) => live.counts_moving(r.layer_start..r.layer_end, &r.to)?,
                    (true, false, true) => r.layers,
                    (true, true, false) => live.counts_for(Split::Proportions(r.split))?,
                    _ => {
                        return Err(Status::from(Error::invalid_request(
                            "give one of: layers to move with the worker to take them, layer counts, or a split",
                        )))
                    }
                };
                live.rebalance(counts).await
            }
            MoveOp::Drain(w) => live.drain(&w).await,
            MoveOp::Undrain(w) => live.undrain(&w).await,
        };
        self.refresh(live);
        reply
    }

    /// The live cluster, once it is up (moves and recoveries take turns).
    pub(crate) async fn live_lock(&self) -> tokio::sync::MutexGuard<'_, Option<Live>> {
        self.live.lock().await
    }

    /// The view and the coordinator's Info, as `live` is now.
    pub(crate) fn refresh(&self, live: &Live) {
        *self.view.lock().unwrap() = Some(Arc::new(live.view()));
        if let Some(info) = self.info.lock().unwrap().as_ref() {
            let mut info = info.lock().unwrap();
            info.stages = live.stage_infos();
            info.expert_workers = live.expert_workers.iter().map(|e| e.2.clone()).collect();
            info.plan = live.plan.to_string();
        }
    }

    pub fn set_health(&self, worker: &str, health: String) {
        self.health
            .lock()
            .unwrap()
            .insert(worker.to_string(), health);
    }

    /// `worker` answers again: its health is what its placement says.
    pub fn clear_health(&self, worker: &str) {
        self.health.lock().unwrap().remove(worker);
    }
}

/// Checks `authorization: Bearer <token>` on every call.
#[derive(Clone)]
pub struct Auth {
    token: Option<Arc<str>>,
}

impl Auth {
    pub fn new(token: Option<String>) -> Auth {
        Auth {
            token: token.filter(|t| !t.is_empty()).map(Arc::from),
        }
    }
}

impl tonic::service::Interceptor for Auth {
    fn call(&mut self, req: Request<()>) -> Result<Request<()>, Status> {
        let Some(token) = &self.token else {
            return Err(Status::from(Error::unauthenticated(
                "admin calls are refused: this coordinator has no admin token (start it with OMNI_COORDINATOR_ADMIN_TOKEN or --admin-token-file; `omnictl up` makes one)",
            )));
        };
        let given = req
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        match given {
            Some(g) if constant_time_eq(g.as_bytes(), token.as_bytes()) => Ok(req),
            Some(_) => Err(Status::from(Error::unauthenticated("wrong admin token"))),
            None => Err(Status::from(Error::unauthenticated(
                "admin calls need `authorization: Bearer <admin token>`",
            ))),
        }
    }
}

/// Equal in time that does not depend on where the first difference is.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

pub struct AdminSvc(pub Arc<AdminState>);

impl AdminSvc {
    /// Runs a move on its own task: a client that goes away mid-move must
    /// not leave the pipeline paused or half moved.
    async fn spawn_move(&self, op: MoveOp) -> Result<Response<MoveReply>, Status> {
        let state = self.0.clone();
        tokio::spawn(async move { state.move_cluster(op).await })
            .await
            .map_err(|e| Status::from(Error::internal(format!("the move task failed: {e}"))))?
            .map(Response::new)
    }

    fn view(&self) -> Result<Arc<ClusterView>, Status> {
        self.0.view.lock().unwrap().clone().ok_or_else(|| {
            Status::from(Error::not_ready(
                "the cluster is still starting: no plan has been loaded yet",
            ))
        })
    }
}

fn plan_reply(p: &Plan) -> Result<Response<PlanReply>, Status> {
    crate::migrate::plan_reply(p).map(Response::new)
}

#[tonic::async_trait]
impl admin_server::Admin for AdminSvc {
    async fn list_workers(
        &self,
        _: Request<ListWorkersRequest>,
    ) -> Result<Response<ListWorkersReply>, Status> {
        let view = self.view()?;
        let health = self.0.health.lock().unwrap().clone();
        let mut workers = Vec::new();
        for p in &view.placements {
            let w = &p.worker;
            let inv = &w.inventory;
            let mut info = WorkerInfo {
                id: w.id.clone(),
                kind: match w.kind {
                    WorkerKind::Stage => "stage",
                    WorkerKind::Experts => "experts",
                }
                .into(),
                addr: w.addr.clone(),
                device: inv.device.clone(),
                device_name: inv.device_name.clone(),
                cpu_variant: inv.cpu_variant.clone(),
                weight_read_rate: inv.weight_read_rate,
                cpu_features: inv.cpu_features.clone(),
                gpu: inv
                    .gpu
                    .as_ref()
                    .map(|g| {
                        format!(
                            "{}, compute {}, PCIe gen {} x{}, driver {}, CUDA {}, {}",
                            inv.device_name,
                            g.compute_capability,
                            g.pcie_gen,
                            g.pcie_width,
                            g.driver_version,
                            g.cuda_driver_version,
                            g.uuid
                        )
                    })
                    .unwrap_or_default(),
                memory_total: inv.memory_total,
                memory_free: inv.memory_free,
                memory_planned: p.planned_bytes,
                stage: p.stage,
                layer_start: p.range.start,
                layer_end: p.range.end,
                expert_layers: p.expert_layers.clone(),
                drained: p.drained,
                layers: p.layers.clone(),
                offloaded: p.offloaded.clone(),
                health: health
                    .get(&w.id)
                    .cloned()
                    .unwrap_or_else(|| if p.drained { "drained" } else { "serving" }.into()),
                ..Default::default()
            };
            if w.kind == WorkerKind::Stage {
                match status(&w.addr, Duration::from_secs(2)).await {
                    Ok(s) => {
                        info.kv_cells_used = s.kv_cells_used;
                        info.kv_cells_total = s.kv_cells_total;
                        info.steps = s.steps;
                        info.last_step_ms = s.last_step_ms;
                        info.tokens = s.tokens;
                        info.memory_used = s.memory_used;
                        info.uptime_seconds = s.uptime_seconds;
                        info.compute_seconds = s.compute_seconds;
                        info.send_seconds = s.send_seconds;
                        info.input_wait_seconds = s.input_wait_seconds;
                        if s.memory_total > 0 {
                            info.memory_total = s.memory_total;
                            info.memory_free = s.memory_free;
                        }
                    }
                    Err(why) if info.health == "serving" => {
                        info.health = format!("no answer: {why}");
                    }
                    Err(_) => {}
                }
            }
            workers.push(info);
        }
        let m = &self.0.metrics;
        Ok(Response::new(ListWorkersReply {
            workers,
            model: view.plan.model.clone(),
            n_layer: view.plan.n_layer,
            tokens_out: m.tokens_out.get(),
            active_sequences: m.active_sequences.get(),
            draft_tokens: m.draft_tokens.get(),
            draft_accepted: m.draft_accepted.get(),
        }))
    }

    async fn rebalance(
        &self,
        req: Request<RebalanceRequest>,
    ) -> Result<Response<MoveReply>, Status> {
        self.spawn_move(MoveOp::Rebalance(req.into_inner())).await
    }

    async fn drain(&self, req: Request<DrainRequest>) -> Result<Response<MoveReply>, Status> {
        self.spawn_move(MoveOp::Drain(req.into_inner().worker))
            .await
    }

    async fn undrain(&self, req: Request<UndrainRequest>) -> Result<Response<MoveReply>, Status> {
        self.spawn_move(MoveOp::Undrain(req.into_inner().worker))
            .await
    }

    async fn get_plan(&self, _: Request<GetPlanRequest>) -> Result<Response<PlanReply>, Status> {
        plan_reply(&self.view()?.plan)
    }

    async fn plan_dry_run(
        &self,
        req: Request<PlanDryRunRequest>,
    ) -> Result<Response<PlanReply>, Status> {
        let r = req.into_inner();
        let view = self.view()?;
        let mut cfg = view.config.clone();
        cfg.split = match (r.layers.is_empty(), r.split.is_empty()) {
            (true, true) => None,
            (false, true) => Some(Split::Layers(r.layers)),
            (true, false) => Some(Split::Proportions(r.split)),
            (false, false) => {
                return Err(Status::from(Error::invalid_request(
                    "give layers or split, not both",
                )))
            }
        };
        if !r.experts.is_empty() {
            cfg.experts =
                <ExpertPolicy as clap::ValueEnum>::from_str(&r.experts, true).map_err(|_| {
                    Status::from(Error::invalid_request(format!(
                        "experts '{}' is not auto, device or cpu",
                        r.experts
                    )))
                })?;
        }
        if let Some(k) = r.gpu_experts {
            cfg.gpu_experts = k;
        }
        let model = view.model.clone();
        let (stages, experts) = (view.stages.clone(), view.expert_workers.clone());
        let p = tokio::task::spawn_blocking(move || {
            plan::plan_with_experts(&model, &stages, &experts, &cfg)
        })
        .await
        .map_err(|e| Status::from(Error::internal(e.to_string())))?
        .map_err(|e| Status::from(Error::refused(e.to_string())))?;
        plan_reply(&p)
    }
}

/// A stage's Status, within `wait`.
pub(crate) async fn status(
    addr: &str,
    wait: Duration,
) -> Result<omni_proto::worker::v1::StatusReply, String> {
    let ask = async {
        let ch = omni_transport::tls::endpoint(addr)
            .map_err(|e| e.to_string())?
            .connect_timeout(Duration::from_secs(1))
            .connect()
            .await
            .map_err(|e| omni_transport::tls::describe(&e))?;
        WorkerClient::new(ch)
            .status(StatusRequest {})
            .await
            .map(|r| r.into_inner())
            .map_err(|s| s.message().to_string())
    };
    tokio::time::timeout(wait, ask)
        .await
        .map_err(|_| format!("no Status answer within {:.0} s", wait.as_secs_f64()))?
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::service::Interceptor;

    fn call(auth: &mut Auth, header: Option<&str>) -> Result<(), String> {
        let mut req = Request::new(());
        if let Some(h) = header {
            req.metadata_mut()
                .insert("authorization", h.parse().unwrap());
        }
        auth.call(req)
            .map(|_| ())
            .map_err(|s| s.message().to_string())
    }

    #[test]
    fn only_the_configured_token_passes() {
        let mut none = Auth::new(None);
        assert!(call(&mut none, Some("Bearer x"))
            .unwrap_err()
            .contains("no admin token"));
        let mut empty = Auth::new(Some(String::new()));
        assert!(call(&mut empty, Some("Bearer "))
            .unwrap_err()
            .contains("no admin token"));
        let mut auth = Auth::new(Some("s3cret".into()));
        assert!(call(&mut auth, Some("Bearer s3cret")).is_ok());
        assert_eq!(
            call(&mut auth, Some("Bearer s3cres")).unwrap_err(),
            "wrong admin token"
        );
        assert_eq!(
            call(&mut auth, Some("Bearer s3cret2")).unwrap_err(),
            "wrong admin token"
        );
        assert!(call(&mut auth, Some("s3cret"))
            .unwrap_err()
            .contains("Bearer"));
        assert!(call(&mut auth, None).unwrap_err().contains("Bearer"));
    }
}
