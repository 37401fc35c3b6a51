//! A worker in a live move or a recovery: the new stage prepared beside the old one,
//! the switch, the commit or rollback, the reset.

use super::*;
use omni_engine::stage::LayerRange;
use omni_engine::stage::Stage;
use omni_proto::worker::v1::FinishReply;
use omni_proto::worker::v1::PrepareReply;
use omni_proto::worker::v1::PrepareRequest;
use omni_proto::worker::v1::ResetReply;
use omni_runtime::WorkerError;
use std::sync::atomic::Ordering;
use std::time::Instant;
use tonic::Status;

impl Worker {
    /// Loads the standby stage for a move, beside the running one.
    pub(super) fn prepare(&self, req: PrepareRequest) -> Result<PrepareReply, Status> {
        let t = Instant::now();
        let range = LayerRange {
            embed: req.embed,
            layers: req.layer_start..req.layer_end,
            head: req.head,
        };
        let (model, cfg, draft, had_head) = {
            let mut st = self.state.lock().unwrap();
            if st.move_pending {
                return Err(Status::from(WorkerError::refused(format!(
                    "worker {}: a move is pending (finish it first)",
                    self.id
                ))));
            }
            // A standby stage from an unfinished move is replaced.
            st.prepared = None;
            st.prepared_drafter = None;
            let (model, cfg) = st.loaded.clone().ok_or_else(|| {
                Status::from(WorkerError::refused(format!(
                    "worker {} has loaded nothing",
                    self.id
                )))
            })?;
            let had_head = st.range.as_ref().is_some_and(|r| r.head);
            (model, cfg, st.draft_model.clone(), had_head)
        };
        tracing::info!("preparing {range} beside the running stage");
        // A worker taking the head from another loads the draft model too.
        let drafter = if range.head && !had_head {
            self.load_drafter(&draft, &model, &cfg)?
        } else {
            None
        };
        let stage = Stage::load_offloaded(model, range.clone(), cfg, &req.offloaded)
            .map_err(|e| Status::from(WorkerError::refused(format!("worker {}: {e}", self.id))))?;
        let reply = PrepareReply {
            weight_bytes: stage.weights().mapped_bytes + stage.weights().repacked_bytes,
            kv_bytes: stage.kv().allocated_bytes(),
            compute_bytes: stage.compute_bytes() as u64,
            held_bytes: stage.held_bytes() + self.stats.held_bytes.load(Ordering::Relaxed),
            load_seconds: t.elapsed().as_secs_f64(),
        };
        let mut st = self.state.lock().unwrap();
        st.prepared = Some(stage);
        st.prepared_drafter = drafter;
        drop(st);
        tracing::info!("prepared {range} in {:.2}s", reply.load_seconds);
        Ok(reply)
    }

    /// Switches to the prepared stage (or to none), with the incoming KV
    /// cache and sequence state.
    pub(super) fn switch(
        &self,
        h: omni_proto::worker::v1::SwitchHeader,
        kv: Vec<Vec<u8>>,
        seqs: Vec<exec::SeqState>,
    ) -> Result<(), Status> {
        let bad =
            |e: String| Status::from(WorkerError::refused(format!("worker {}: {e}", self.id)));
        let incoming = kv
            .iter()
            .map(|b| omni_engine::kv::KvLayers::from_bytes(b).map_err(|e| bad(e.to_string())))
            .collect::<Result<Vec<_>, _>>()?;
        let (exec, new, drafter) = {
            let mut st = self.state.lock().unwrap();
            let exec = st
                .exec
                .clone()
                .ok_or_else(|| bad("nothing is loaded".into()))?;
            let new = if h.drain {
                st.prepared = None;
                st.prepared_drafter = None;
                None
            } else {
                let want = LayerRange {
                    embed: h.embed,
                    layers: h.layer_start..h.layer_end,
                    head: h.head,
                };
                let p = st
                    .prepared
                    .take()
                    .ok_or_else(|| bad(format!("no stage was prepared for {want}")))?;
                if *p.range() != want {
                    return Err(bad(format!(
                        "the prepared stage runs {}, not {want}",
                        p.range()
                    )));
                }
                Some(p)
            };
            (exec, new, st.prepared_drafter.take())
        };
        let range = new.as_ref().map(|s| s.range().clone());
        let t = Instant::now();
        exec.switch(new, h.stage, incoming, seqs, drafter)
            .map_err(bad)?;
        let took = t.elapsed().as_secs_f64() * 1e3;
        let mut st = self.state.lock().unwrap();
        st.move_pending = true;
        st.range = range.clone();
        // A moved stage is no longer what its Load asked (a new coordinator
        // loads it again); a rollback keeps the Load it had.
        st.pending_held = st.held.take();
        match range {
            Some(r) => tracing::info!("switched to {r} ({took:.1} ms on the stage thread)"),
            None => tracing::info!("drained: this worker runs no layers now"),
        }
        Ok(())
    }

    /// Commits or rolls back a pending switch, and drops any standby stage.
    pub(super) fn finish(&self, commit: bool) -> Result<FinishReply, Status> {
        let exec = {
            let mut st = self.state.lock().unwrap();
            st.prepared = None;
            st.prepared_drafter = None;
            st.exec.clone()
        };
        let range = match exec {
            Some(e) => e.finish(commit).map_err(|e| {
                Status::from(WorkerError::internal(format!("worker {}: {e}", self.id)))
            })?,
            None => None,
        };
        let mut st = self.state.lock().unwrap();
        if std::mem::take(&mut st.move_pending) {
            tracing::info!(
                "{} the move: running {}",
                if commit { "committed" } else { "rolled back" },
                range
                    .as_ref()
                    .map_or_else(|| "no layers".to_string(), |r| r.to_string())
            );
        }
        st.range = range.clone();
        if let Some(before) = st.pending_held.take().filter(|_| !commit) {
            st.held = Some(before);
        }
        Ok(FinishReply {
            held_bytes: self.stats.held_bytes.load(Ordering::Relaxed),
            range: range.map(|r| r.to_string()).unwrap_or_default(),
        })
    }

    /// Recovery: forgets every sequence and fences off the frames of the
    /// broken pipeline still on their way; a pending move rolls back and a
    /// standby stage is dropped.
    pub(super) fn reset(&self, fence: u64) -> Result<ResetReply, Status> {
        let exec = {
            let mut st = self.state.lock().unwrap();
            st.prepared = None;
            st.prepared_drafter = None;
            st.move_pending = false;
            if let Some(before) = st.pending_held.take() {
                st.held = Some(before);
            }
            st.exec.clone()
        };
        let exec = exec.ok_or_else(|| {
            Status::from(WorkerError::refused(format!(
                "worker {} has loaded nothing",
                self.id
            )))
        })?;
        let range = exec
            .reset(fence)
            .map_err(|e| Status::from(WorkerError::internal(format!("worker {}: {e}", self.id))))?;
        self.state.lock().unwrap().range = range.clone();
        Ok(ResetReply {
            range: range.map(|r| r.to_string()).unwrap_or_default(),
        })
    }
}
