//! Recovery: bringing the pipeline back after a worker is lost, so that the
//! requests in flight go on instead of failing.
//!
//! The scheduler notices the loss (a health check that fails twice, a link
//! that breaks, a step that fails or gets no answer, a worker that
//! registers again because it restarted), drops what was in flight and
//! sends a [`RecoveryNeeded`] here. This task then, until it works:
//!
//! 1. Asks every serving stage worker for its Status and every expert
//!    worker for its health. A worker that does not answer is waited for:
//!    its supervisor (`omnictl up`, or compose's restart policy) restarts
//!    it and it registers again under its id, maybe at a new address.
//!    After `--rejoin-timeout` without it, the plan is made again over the
//!    stage workers that answer, if they can hold the model (the planner's
//!    numbers say why not); expert workers must come back (experts do not
//!    move live).
//! 2. Loads every worker that does not run its planned range (a restarted
//!    one, or a new range after re-planning), and the experts of expert
//!    workers that restarted. Every stage is then reset: it forgets every
//!    sequence and drops frames of steps sent before the fence.
//! 3. Wires the whole pipeline again with fresh inboxes (a ring takes one
//!    sender in its life) and the expert routes.
//! 4. Tells the scheduler, which replays each group's steps into the same
//!    KV cells and goes on.
//!
//! After `--recovery-timeout` the requests in flight are stopped with the
//! reason (a clear error event, not a hang); the task keeps waiting, and
//! the cluster serves again once the workers are back.

use crate::admin::AdminState;
use crate::migrate::{client, offloaded_layers, Live, CALL_TIMEOUT, PREPARE_TIMEOUT};
use crate::plan::Plan;
use crate::scheduler::{Event, RecoveryNeeded};
use crate::Registered;
use omni_proto::coordinator::v1::{InfoReply, WorkerKind};
use omni_proto::worker::v1::{
    experts_client::ExpertsClient, LoadExpertsRequest, LoadRequest, ResetRequest, StatusReply,
};
use omni_transport::Outbox;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// What the registry and the health watchers share with recovery.
#[derive(Default)]
pub struct Recovery {
    /// Every worker the plan knows: its kind and its address now.
    known: Mutex<HashMap<String, (WorkerKind, String)>>,
    /// Workers that registered again (they restarted) and were not yet
    /// loaded again.
    rejoined: Mutex<HashMap<String, Registered>>,
    /// Wakes the recovery task when a worker registers again.
    notify: tokio::sync::Notify,
}

impl Recovery {
    /// The workers of the plan (registrations after it are returns).
    pub fn know(&self, workers: &[Registered]) {
        let mut k = self.known.lock().unwrap();
        for w in workers {
            k.insert(w.id.clone(), (w.kind, w.addr.clone()));
        }
    }

    /// A registration after the plan was made: Ok if it is a worker of
    /// the plan coming back (recorded; recovery loads it), else why not.
    pub fn rejoin(&self, w: Registered) -> Result<(), String> {
        let mut k = self.known.lock().unwrap();
        match k.get_mut(&w.id) {
            Some((kind, addr)) if *kind == w.kind => {
                tracing::warn!(
                    "worker {} registered again from {} (it restarted); recovering",
                    w.id,
                    w.addr
                );
                addr.clone_from(&w.addr);
                self.rejoined.lock().unwrap().insert(w.id.clone(), w);
                self.notify.notify_one();
                Ok(())
            }
            Some(_) => Err(format!(
                "worker {} registered as another kind than it had",
                w.id
            )),
            None => Err(format!("worker {} is not part of this cluster", w.id)),
        }
    }

    /// Where worker `id` is now.
    pub fn addr(&self, id: &str) -> Option<String> {
        self.known.lock().unwrap().get(id).map(|x| x.1.clone())
    }
}

/// How long recovery waits.
#[derive(Clone, Copy, Debug)]
pub struct Timeouts {
    /// For a lost worker to come back before re-planning without it.
    pub rejoin: Duration,
    /// Before the requests in flight are stopped.
    pub give_up: Duration,
}

/// The recovery task: one recovery at a time, each until it succeeds.
pub async fn run(
    mut needs: tokio::sync::mpsc::UnboundedReceiver<RecoveryNeeded>,
    admin: Arc<AdminState>,
    recovery: Arc<Recovery>,
    info: Arc<Mutex<InfoReply>>,
    events: omni_transport::BellSender<Event>,
    timeouts: Timeouts,
) {
    while let Some(mut need) = needs.recv().await {
        while let Ok(n) = needs.try_recv() {
            need.fence = need.fence.max(n.fence);
        }
        let t0 = Instant::now();
        set_state(&info, false, format!("recovering: {}", need.why));
        let mut last = String::new();
        let mut gave_up = false;
        loop {
            let replan = t0.elapsed() >= timeouts.rejoin;
            match admin.recover(need.fence, replan, &recovery).await {
                Ok((outbox, done)) => {
                    let _ = events.send(Event::Recovered {
                        outbox,
                        fence: need.fence,
                    });
                    tracing::info!(
                        "recovered in {:.2}s from: {} ({done})",
                        t0.elapsed().as_secs_f64(),
                        need.why
                    );
                    set_state(&info, true, "serving".into());
                    break;
                }
                Err(e) => {
                    if e != last {
                        tracing::warn!("cannot recover yet: {e}");
                        last.clone_from(&e);
                    }
                    if !gave_up && t0.elapsed() >= timeouts.give_up {
                        gave_up = true;
                        let why = format!(
                            "the cluster could not recover within {:.0}s ({}): {e}",
                            timeouts.give_up.as_secs_f64(),
                            need.why
                        );
                        set_state(
                            &info,
                            false,
                            format!("{why}; waiting for the workers to come back"),
                        );
                        let _ = events.send(Event::RecoveryFailed(why));
                    }
                    tokio::select! {
                        _ = recovery.notify.notified() => {}
                        _ = tokio::time::sleep(Duration::from_millis(500)) => {}
                    }
                }
            }
        }
    }
}

fn set_state(info: &Mutex<InfoReply>, ready: bool, state: String) {
    let mut i = info.lock().unwrap();
    i.ready = ready;
    i.state = state;
}

/// A worker's gRPC health, within `wait`.
async fn healthy(addr: &str, wait: Duration) -> Result<(), String> {
    omni_runtime::health::check(addr, "", wait).await
}

/// How long a worker may take to answer a recovery's Status or health check.
const PROBE: Duration = Duration::from_secs(3);

impl Live {
    /// One recovery attempt (see the module documentation). `replan`: a
    /// stage worker that does not answer is left out if the others can
    /// hold the model. Returns the scheduler's new outbox and what was done.
    pub(crate) async fn recover(
        &mut self,
        fence: u64,
        replan: bool,
        recovery: &Recovery,
    ) -> Result<(Option<Outbox>, String), String> {
        // 1. Who answers, at the address it has now.
        let rejoined = recovery.rejoined.lock().unwrap().clone();
        for w in &mut self.workers {
            if let Some(a) = recovery.addr(&w.reg.id) {
                w.reg.addr = a;
            }
        }
        for (reg, _, info) in &mut self.expert_workers {
            if let Some(a) = recovery.addr(&reg.id) {
                reg.addr.clone_from(&a);
                info.worker_addr = a;
            }
        }
        let (running, dead) = self.probe().await?;
        let mut done = Vec::new();
        let (serving, plan) = match dead.first() {
            None => (self.serving.clone(), self.plan.clone()),
            Some((_, why)) if !replan => return Err(why.clone()),
            Some(_) => {
                let (serving, plan, note) = self.replan_without(&dead)?;
                done.push(note);
                (serving, plan)
            }
        };

        // 2. Load what does not run its planned range, and restarted
        // expert workers' experts; then reset every stage.
        self.reload(&serving, &plan, &running, &rejoined, &mut done)
            .await?;
        self.reset(&serving, fence).await?;

        // 3. A new pipeline: every link and every expert route again.
        self.links.clear();
        self.wired.clear();
        let outbox = self.rewire(&serving, &plan).await?;
        self.serving = serving;
        self.plan = plan;
        let mut r = recovery.rejoined.lock().unwrap();
        for id in rejoined.keys() {
            r.remove(id);
        }
        if done.is_empty() {
            done.push("every worker kept its layers".into());
        }
        Ok((outbox, done.join("; ")))
    }

    /// Which serving workers answer (with their status), and why each of
    /// the others is taken for dead; an error if an expert worker does not
    /// answer (its experts cannot move).
    async fn probe(&self) -> Result<(HashMap<usize, StatusReply>, Vec<(usize, String)>), String> {
        let mut running = HashMap::new();
        let mut dead = Vec::new();
        for &wi in &self.serving {
            let (id, addr) = self.addr(wi);
            match crate::admin::status(&addr, PROBE).await {
                Ok(s) => {
                    running.insert(wi, s);
                }
                Err(e) => dead.push((wi, format!("worker {id} ({addr}) does not answer: {e}"))),
            }
        }
        for (reg, _, _) in &self.expert_workers {
            if let Err(e) = healthy(&reg.addr, PROBE).await {
                return Err(format!(
                    "expert worker {} ({}) does not answer: {e}",
                    reg.id, reg.addr
                ));
            }
        }
        Ok((running, dead))
    }

    /// A plan over the serving workers without the dead ones, if they can
    /// take the layers and the experts stay where they are; and the note.
    fn replan_without(
        &self,
        dead: &[(usize, String)],
    ) -> Result<(Vec<usize>, Plan, String), String> {
        let gone: Vec<usize> = dead.iter().map(|d| d.0).collect();
        let names: Vec<String> = gone.iter().map(|&w| self.addr(w).0).collect();
        let serving: Vec<usize> = self
            .serving
            .iter()
            .copied()
            .filter(|w| !gone.contains(w))
            .collect();
        if serving.is_empty() {
            return Err(dead[0].1.clone());
        }
        let plan = self.plan_for(&serving, None).map_err(|s| {
            format!(
                "{}, and the other workers cannot take its layers: {}",
                dead[0].1,
                s.message()
            )
        })?;
        // Where the experts are, not the numbers beside them (a
        // budget shared with the lost worker's host changes).
        let placed = |p: &crate::plan::Plan| -> Vec<(String, Vec<u32>)> {
            p.experts
                .iter()
                .map(|e| (e.worker.clone(), e.layers.clone()))
                .collect()
        };
        if offloaded_layers(&plan) != offloaded_layers(&self.plan)
            || placed(&plan) != placed(&self.plan)
        {
            return Err(format!(
                "{}, and without it the experts would have to move",
                dead[0].1
            ));
        }
        let note = format!(
            "left out {} (no answer) and planned again over the others",
            names.join(", ")
        );
        Ok((serving, plan, note))
    }

    /// Loads what does not run its planned range, and restarted expert
    /// workers' experts, noting each in `done`.
    async fn reload(
        &mut self,
        serving: &[usize],
        plan: &Plan,
        running: &HashMap<usize, StatusReply>,
        rejoined: &HashMap<String, Registered>,
        done: &mut Vec<String>,
    ) -> Result<(), String> {
        let mut loads = tokio::task::JoinSet::new();
        for (i, &wi) in serving.iter().enumerate() {
            let st = &plan.stages[i];
            let runs = running
                .get(&wi)
                .is_some_and(|s| s.loaded && s.range == st.range.to_string());
            if runs && !rejoined.contains_key(&self.workers[wi].reg.id) {
                continue;
            }
            let req = LoadRequest {
                embed: st.range.embed,
                layer_start: st.range.layers.start,
                layer_end: st.range.layers.end,
                head: st.range.head,
                stage: i as u32,
                offloaded: st.offloaded.clone(),
                stream_experts: st.stream_bytes > 0,
                ..self.setup.load.clone()
            };
            let (id, addr) = self.addr(wi);
            done.push(format!("loaded {} on {id}", st.range));
            loads.spawn(async move {
                let r = client(&addr, PREPARE_TIMEOUT)
                    .await?
                    .load(req)
                    .await
                    .map_err(|s| format!("worker {id} could not load its layers: {}", s.message()))?
                    .into_inner();
                Ok::<_, String>(Some((wi, (r.weight_bytes, r.kv_bytes, r.compute_bytes))))
            });
        }
        for (reg, _, _) in &self.expert_workers {
            if !rejoined.contains_key(&reg.id) {
                continue;
            }
            let layers = self
                .plan
                .experts
                .iter()
                .find(|e| e.worker == reg.id)
                .map(|e| e.layers.clone())
                .unwrap_or_default();
            let req = LoadExpertsRequest {
                model_path: self.setup.load.model_path.clone(),
                layers,
                n_ubatch: self.setup.load.n_ubatch,
            };
            let (id, addr) = (reg.id.clone(), reg.addr.clone());
            done.push(format!("loaded the experts of {id}"));
            loads.spawn(async move {
                let ch = omni_transport::tls::endpoint(&addr)
                    .map_err(|e| e.to_string())?
                    .connect_timeout(Duration::from_secs(5))
                    .timeout(PREPARE_TIMEOUT)
                    .connect()
                    .await
                    .map_err(|e| {
                        format!(
                            "cannot reach expert worker {id} at {addr}: {}",
                            omni_transport::tls::describe(&e)
                        )
                    })?;
                ExpertsClient::new(ch)
                    .load_experts(req)
                    .await
                    .map_err(|s| {
                        format!(
                            "expert worker {id} could not load its experts: {}",
                            s.message()
                        )
                    })?;
                Ok(None)
            });
        }
        let mut loaded = Vec::new();
        while let Some(r) = loads.join_next().await {
            if let Some(x) = r.map_err(|e| e.to_string())?? {
                loaded.push(x);
            }
        }
        for (wi, bytes) in loaded {
            self.workers[wi].stage_bytes = bytes;
        }
        Ok(())
    }

    /// Resets every serving stage to the recovery's fence.
    async fn reset(&self, serving: &[usize], fence: u64) -> Result<(), String> {
        let mut resets = tokio::task::JoinSet::new();
        for &wi in serving {
            let (id, addr) = self.addr(wi);
            resets.spawn(async move {
                client(&addr, CALL_TIMEOUT)
                    .await?
                    .reset(ResetRequest { fence })
                    .await
                    .map(|_| ())
                    .map_err(|s| format!("worker {id} could not reset: {}", s.message()))
            });
        }
        while let Some(r) = resets.join_next().await {
            r.map_err(|e| e.to_string())??;
        }

        Ok(())
    }
}

impl AdminState {
    /// One recovery attempt on the live cluster (waiting for a move in
    /// progress to end first), then the view and Info as it left them.
    pub(crate) async fn recover(
        &self,
        fence: u64,
        replan: bool,
        recovery: &Recovery,
    ) -> Result<(Option<Outbox>, String), String> {
        let mut guard = self.live_lock().await;
        let live = guard
            .as_mut()
            .ok_or_else(|| "the cluster is still starting".to_string())?;
        let r = live.recover(fence, replan, recovery).await;
        self.refresh(live);
        r
    }
}
