//! A move: the new layout checked, every changing worker prepared beside its old stage,
//! then the switch (`handover.rs`), committed or rolled back.

use super::*;
use crate::error::Error;
use crate::plan;
use crate::plan::Plan;
use crate::plan::Split;
use crate::scheduler::Event;
use omni_engine::fmt_bytes;
use omni_engine::stage::LayerRange;
use omni_proto::admin::v1::MoveReply;
use omni_proto::worker::v1::{
    FinishRequest, LoadRequest, PrepareRequest, StateChunk, StatusRequest, SwitchHeader,
};
use std::time::Instant;
use tonic::Status;

impl Live {
    /// Carries out a move to `serving` with `counts` (None: the automatic
    /// split), as the module documentation says.
    pub(super) async fn apply(
        &mut self,
        serving: Vec<usize>,
        counts: Option<Vec<u32>>,
    ) -> Result<MoveReply, Status> {
        let t0 = Instant::now();
        let new_plan = self.plan_for(&serving, counts.map(Split::Layers))?;
        if offloaded_layers(&new_plan) != offloaded_layers(&self.plan)
            || new_plan.experts != self.plan.experts
        {
            return Err(Status::from(Error::refused(format!(
                "the new split would change which layers' routed experts run on expert workers (now {}, then {}); experts do not move live, restart with the split instead",
                plan::fmt_layers(&offloaded_layers(&self.plan)),
                plan::fmt_layers(&offloaded_layers(&new_plan))
            ))));
        }
        let changes = self.changes(&serving, &new_plan);
        if changes.is_empty() {
            return Ok(MoveReply {
                plan: Some(plan_reply(&self.plan)?),
                unchanged: true,
                total_seconds: t0.elapsed().as_secs_f64(),
                ..Default::default()
            });
        }
        self.check_both_fit(&changes, &serving, &new_plan)?;
        let moves: Vec<String> = changes
            .iter()
            .map(|c| {
                let show = |x: &Option<(LayerRange, Vec<u32>)>| {
                    x.as_ref()
                        .map_or_else(|| "nothing (drained)".to_string(), |(r, _)| r.to_string())
                };
                format!(
                    "{}: {} -> {}",
                    self.workers[c.worker].reg.id,
                    show(&c.old),
                    show(&c.new)
                )
            })
            .collect();
        tracing::info!("moving layers: {}", moves.join("; "));

        // 2. Prepare, while serving.
        let t_prepare = Instant::now();
        let prepared = self.prepare(&changes).await;
        let prepare_seconds = t_prepare.elapsed().as_secs_f64();
        let stage_bytes = match prepared {
            Ok(b) => b,
            Err(e) => {
                self.finish(&changes, false).await;
                return Err(Status::from(Error::aborted(format!(
                    "the move was abandoned before the switch, nothing changed: {e}"
                ))));
            }
        };

        // 3. Pause at a step boundary, hand over, switch, rewire.
        let t_pause = Instant::now();
        if let Err(e) = self.pause().await {
            self.finish(&changes, false).await;
            return Err(Status::from(Error::aborted(format!(
                "the move was abandoned, nothing changed: the pipeline could not pause: {e}"
            ))));
        }
        let t_paused = Instant::now();
        let handed = match self.hand_over(&changes).await {
            Ok(kv) => self.rewire(&serving, &new_plan).await.map(|o| (kv, o)),
            Err(e) => Err(e),
        };
        let (kv_bytes, outbox) = match handed {
            Ok(x) => x,
            Err(e) => {
                self.finish(&changes, false).await;
                // Back to the old wiring where the new one was (partly) made.
                let (old_serving, old_plan) = (self.serving.clone(), self.plan.clone());
                let outbox = match self.rewire(&old_serving, &old_plan).await {
                    Ok(o) => o,
                    Err(e2) => {
                        tracing::error!("rolling back the wiring failed too: {e2}");
                        None
                    }
                };
                let _ = self.setup.events.send(Event::Resume(outbox));
                return Err(Status::from(Error::aborted(format!(
                    "the move failed and was rolled back (every worker runs its old range): {e}"
                ))));
            }
        };

        // 4. Go on, and commit: the old stages are dropped between steps
        // (no rollback is possible once a step ran on the new ones).
        let _ = self.setup.events.send(Event::Resume(outbox));
        let pause_seconds = t_pause.elapsed().as_secs_f64();
        tracing::debug!(
            "paused {:.1} ms: {:.1} ms until nothing was in flight, {:.1} ms handing over",
            pause_seconds * 1e3,
            (t_paused - t_pause).as_secs_f64() * 1e3,
            t_paused.elapsed().as_secs_f64() * 1e3
        );
        self.finish(&changes, true).await;
        for c in &changes {
            self.workers[c.worker].stage_bytes = stage_bytes
                .iter()
                .find(|(wi, _)| *wi == c.worker)
                .map_or((0, 0, 0), |x| x.1);
        }
        self.serving = serving;
        self.plan = new_plan;
        tracing::info!(
            "moved in {:.3}s (prepared in {prepare_seconds:.3}s, paused {:.1} ms, {} of KV cache handed over)",
            t0.elapsed().as_secs_f64(),
            pause_seconds * 1e3,
            fmt_bytes(kv_bytes)
        );
        Ok(MoveReply {
            moves,
            plan: Some(plan_reply(&self.plan)?),
            prepare_seconds,
            pause_seconds,
            total_seconds: t0.elapsed().as_secs_f64(),
            kv_bytes,
            unchanged: false,
        })
    }

    /// What a move changes, worker by worker.
    pub(super) fn changes(&self, serving: &[usize], new_plan: &Plan) -> Vec<Change> {
        let at = |serving: &[usize], p: &Plan, wi: usize| {
            serving.iter().position(|&s| s == wi).map(|i| {
                (
                    i as u32,
                    p.stages[i].range.clone(),
                    p.stages[i].offloaded.clone(),
                )
            })
        };
        let mut changes = Vec::new();
        for wi in 0..self.workers.len() {
            let old = at(&self.serving, &self.plan, wi);
            let new = at(serving, new_plan, wi);
            let strip = |x: &Option<(u32, LayerRange, Vec<u32>)>| {
                x.as_ref().map(|(_, r, o)| (r.clone(), o.clone()))
            };
            if strip(&old) != strip(&new) {
                changes.push(Change {
                    worker: wi,
                    stage: new.as_ref().map_or(0, |n| n.0),
                    old: strip(&old),
                    new: strip(&new),
                });
            }
        }
        changes
    }

    /// Every worker that changes holds its old and its new stage at once
    /// during the move: both within its budget.
    pub(super) fn check_both_fit(
        &self,
        changes: &[Change],
        serving: &[usize],
        new_plan: &Plan,
    ) -> Result<(), Status> {
        for c in changes {
            let Some(i) = serving.iter().position(|&s| s == c.worker) else {
                continue;
            };
            let w = &self.workers[c.worker];
            let old = if c.old.is_some() {
                let (a, b, c) = w.stage_bytes;
                a + b + c
            } else {
                0
            };
            let new = new_plan.stages[i].bytes.total;
            let budget = new_plan.stages[i].bytes.budget;
            if old + new > budget {
                return Err(Status::from(Error::refused(format!(
                    "during the move worker {} holds its old and its new stage at once: {} + {} = {}, more than its {} usable ({} free, {:.0}% headroom); move fewer layers at a time",
                    w.reg.id,
                    fmt_bytes(old),
                    fmt_bytes(new),
                    fmt_bytes(old + new),
                    fmt_bytes(budget),
                    fmt_bytes(w.spec.free_bytes),
                    self.setup.pcfg.headroom * 100.0
                ))));
            }
        }
        Ok(())
    }

    /// Has every changing worker load its new range beside the old one
    /// (all at once, while serving); the new stages' bytes per worker.
    pub(super) async fn prepare(
        &self,
        changes: &[Change],
    ) -> Result<Vec<(usize, (u64, u64, u64))>, String> {
        let mut prepares = Vec::new();
        for c in changes {
            let Some((range, off)) = &c.new else { continue };
            let req = PrepareRequest {
                embed: range.embed,
                layer_start: range.layers.start,
                layer_end: range.layers.end,
                head: range.head,
                offloaded: off.clone(),
                stage: c.stage,
            };
            let (id, addr) = self.addr(c.worker);
            // A worker that restarted while drained has loaded nothing: it
            // loads its new range first (its pipeline is wired later), so
            // that it has a stage thread to switch on.
            let load = LoadRequest {
                embed: range.embed,
                layer_start: range.layers.start,
                layer_end: range.layers.end,
                head: range.head,
                stage: c.stage,
                offloaded: off.clone(),
                ..self.setup.load.clone()
            };
            prepares.push((
                c.worker,
                tokio::spawn(async move {
                    let mut cl = client(&addr, PREPARE_TIMEOUT).await?;
                    let loaded = cl
                        .status(StatusRequest {})
                        .await
                        .map_err(|s| format!("worker {id} does not answer: {}", s.message()))?
                        .into_inner()
                        .loaded;
                    if !loaded {
                        // Loaded, then drained at once: a drained worker
                        // (a stage thread, no stage) is what an undrain
                        // switches.
                        tracing::info!("worker {id} has loaded nothing (it restarted): loading it");
                        let failed = |s: Status| {
                            format!("worker {id} could not load its new range: {}", s.message())
                        };
                        cl.load(load).await.map_err(failed)?;
                        let drain = StateChunk {
                            header: Some(SwitchHeader {
                                drain: true,
                                ..Default::default()
                            }),
                            ..Default::default()
                        };
                        cl.switch(tokio_stream::iter(vec![drain]))
                            .await
                            .map_err(failed)?;
                        cl.finish(FinishRequest { commit: true })
                            .await
                            .map_err(failed)?;
                    }
                    cl.prepare(req).await.map(|r| r.into_inner()).map_err(|s| {
                        format!("worker {id} could not load its new range: {}", s.message())
                    })
                }),
            ));
        }
        let mut stage_bytes = Vec::new();
        let mut failed = None;
        for (wi, p) in prepares {
            match p.await.map_err(|e| e.to_string()).and_then(|r| r) {
                Ok(r) => stage_bytes.push((wi, (r.weight_bytes, r.kv_bytes, r.compute_bytes))),
                Err(e) => failed = failed.or(Some(e)),
            }
        }
        match failed {
            Some(e) => Err(e),
            None => Ok(stage_bytes),
        }
    }
}
