//! The switch of a move: pause at a step boundary, hand the KV cache and sampling state
//! over, rewire the pipeline, then commit or roll back.

use super::*;
use crate::plan::Plan;
use crate::scheduler::Event;
use omni_proto::worker::v1::ExpertRoute;
use omni_proto::worker::v1::ExportStateRequest;
use omni_proto::worker::v1::FinishRequest;
use omni_proto::worker::v1::OpenInboxRequest;
use omni_proto::worker::v1::StateChunk;
use omni_proto::worker::v1::SwitchHeader;
use omni_proto::worker::v1::Transport;
use omni_proto::worker::v1::WireRequest;
use omni_transport::Outbox;

impl Live {
    /// Asks the scheduler to pause and waits until nothing is in flight.
    pub(super) async fn pause(&self) -> Result<(), String> {
        let (tx, rx) = crossbeam_channel::bounded(1);
        self.setup
            .events
            .send(Event::Pause(tx))
            .map_err(|_| "the scheduler has stopped".to_string())?;
        let wait = self.setup.step_timeout;
        let r = tokio::task::spawn_blocking(move || rx.recv_timeout(wait))
            .await
            .map_err(|e| e.to_string())?;
        match r {
            Ok(r) => r,
            Err(_) => {
                let _ = self.setup.events.send(Event::Resume(None));
                Err(format!(
                    "steps still in flight after {:.0}s",
                    wait.as_secs_f64()
                ))
            }
        }
    }

    /// Switches every changed worker, streaming each the KV cache of the
    /// layers it takes from the workers that ran them. Returns the bytes.
    pub(super) async fn hand_over(&self, changes: &[Change]) -> Result<u64, String> {
        let mut switches = tokio::task::JoinSet::new();
        for c in changes {
            let header = SwitchHeader {
                embed: c.new.as_ref().is_some_and(|n| n.0.embed),
                layer_start: c.new.as_ref().map_or(0, |n| n.0.layers.start),
                layer_end: c.new.as_ref().map_or(0, |n| n.0.layers.end),
                head: c.new.as_ref().is_some_and(|n| n.0.head),
                drain: c.new.is_none(),
                stage: c.stage,
            };
            // Who gives what: every layer this worker did not run comes from
            // the worker that ran it; the head's holder gives the samplers.
            let mut sources: Vec<(usize, std::ops::Range<u32>)> = Vec::new();
            if let Some((range, _)) = &c.new {
                let had = c.old.as_ref().map_or(0..0, |o| o.0.layers.clone());
                for (i, st) in self.plan.stages.iter().enumerate() {
                    let giver = self.serving[i];
                    if giver == c.worker {
                        continue;
                    }
                    let r = &st.range.layers;
                    let (a, b) = (r.start.max(range.layers.start), r.end.min(range.layers.end));
                    // The part of the giver's layers this worker takes.
                    let take: Vec<u32> = (a..b).filter(|l| !had.contains(l)).collect();
                    if let (Some(&first), Some(&last)) = (take.first(), take.last()) {
                        sources.push((giver, first..last + 1));
                    } else if range.head && st.range.head {
                        sources.push((giver, 0..0));
                    }
                }
            }
            let (id, addr) = self.addr(c.worker);
            let givers: Vec<(String, String, std::ops::Range<u32>)> = sources
                .iter()
                .map(|(g, r)| {
                    let (gid, gaddr) = self.addr(*g);
                    (gid, gaddr, r.clone())
                })
                .collect();
            // Every worker switches at once: exports come from the stages
            // that ran before the switch, which stay until commit.
            switches.spawn(switch_one(id, addr, header, givers));
        }
        let mut total = 0;
        let mut failed = None;
        while let Some(r) = switches.join_next().await {
            match r.map_err(|e| e.to_string()).and_then(|r| r) {
                Ok(n) => total += n,
                Err(e) => failed = failed.or(Some(e)),
            }
        }
        match failed {
            Some(e) => Err(e),
            None => Ok(total),
        }
    }

    /// Wires the pipeline `serving` (with `plan`'s expert routes): a worker
    /// whose sender changes gets a fresh inbox and its sender is wired to
    /// it; a worker whose offloaded layers change gets its routes. Returns
    /// the scheduler's new outbox when the first stage changed.
    pub(crate) async fn rewire(
        &mut self,
        serving: &[usize],
        plan: &Plan,
    ) -> Result<Option<Outbox>, String> {
        let now = pipeline_links(serving);
        let transport = Transport::from(self.setup.transport);
        let mut outbox = None;
        for &(from, to) in &now {
            let new_link = !self.links.contains(&(from, to));
            // The sender's offloaded layers in the new plan.
            let offloaded = from.map(|f| {
                let i = serving
                    .iter()
                    .position(|&s| s == f)
                    .expect("a serving sender");
                plan.stages[i].offloaded.clone()
            });
            let routes_changed = from.is_some_and(|f| {
                self.wired.iter().find(|(w, _)| *w == f).map(|x| &x.1) != offloaded.as_ref()
            });
            if !new_link && !routes_changed {
                continue;
            }
            let next = if new_link {
                Some(match to {
                    Some(t) => {
                        let (id, addr) = self.addr(t);
                        let ep = client(&addr, CALL_TIMEOUT)
                            .await?
                            .open_inbox(OpenInboxRequest {})
                            .await
                            .map_err(|s| {
                                format!("worker {id} could not open an inbox: {}", s.message())
                            })?
                            .into_inner()
                            .inbox
                            .unwrap_or_default();
                        ep
                    }
                    None => {
                        self.rings += 1;
                        let name =
                            format!("omni-coordinator-{}-{}", std::process::id(), self.rings);
                        let mut inbox = self.results.lock().unwrap();
                        if let Err(e) = inbox.add_ring(&self.setup.shm_dir, &name, 4 << 20) {
                            tracing::warn!("no new results ring ({e}); results come over gRPC");
                        }
                        inbox.endpoint(&self.setup.advertise, &omni_transport::host_id())
                    }
                })
            } else {
                None
            };
            match from {
                Some(f) => {
                    let (id, addr) = self.addr(f);
                    let r = client(&addr, CALL_TIMEOUT)
                        .await?
                        .wire(WireRequest {
                            next: next.clone(),
                            transport: transport as i32,
                            experts: self.routes(offloaded.as_deref().unwrap_or_default()),
                        })
                        .await
                        .map_err(|s| format!("worker {id} could not be rewired: {}", s.message()))?
                        .into_inner();
                    let w = &mut self.workers[f];
                    w.transport = r.transport;
                    w.expert_transports = r.expert_transports;
                    let off = offloaded.unwrap_or_default();
                    match self.wired.iter_mut().find(|(w, _)| *w == f) {
                        Some(x) => x.1 = off,
                        None => self.wired.push((f, off)),
                    }
                    tracing::info!(
                        "{id} now sends to {}",
                        next.map_or_else(|| "the same stage".into(), |n| n.grpc_addr)
                    );
                }
                None => {
                    let ep = next.expect("a new link");
                    outbox = Some(
                        Outbox::connect(&ep, self.setup.transport)
                            .await
                            .map_err(|e| format!("cannot reach the new first stage: {e}"))?,
                    );
                }
            }
            if new_link {
                self.links.retain(|l| l.0 != from && l.1 != to);
                self.links.push((from, to));
            }
        }
        Ok(outbox)
    }

    /// The expert routes of a stage with these offloaded layers.
    pub(super) fn routes(&self, offloaded: &[u32]) -> Vec<ExpertRoute> {
        routes_for(offloaded, &self.plan, |id| {
            self.expert_workers
                .iter()
                .find(|e| e.0.id == id)
                .map(|e| e.0.addr.clone())
                .unwrap_or_default()
        })
    }

    /// Commits (or rolls back) every changed worker; a worker that cannot
    /// is logged (it keeps what it has).
    pub(super) async fn finish(&self, changes: &[Change], commit: bool) {
        for c in changes {
            let (id, addr) = self.addr(c.worker);
            let r = async {
                client(&addr, CALL_TIMEOUT)
                    .await?
                    .finish(FinishRequest { commit })
                    .await
                    .map_err(|s| s.message().to_string())
            }
            .await;
            if let Err(e) = r {
                tracing::error!(
                    "worker {id} could not {} the move: {e}",
                    if commit { "commit" } else { "roll back" }
                );
            }
        }
    }
}

/// Switches worker `id` at `addr` as `header` says, streaming it the
/// exports of `givers` (id, address, layers) piece by piece as they come.
/// Returns the KV bytes it took in.
pub(super) async fn switch_one(
    id: String,
    addr: String,
    header: SwitchHeader,
    givers: Vec<(String, String, std::ops::Range<u32>)>,
) -> Result<u64, String> {
    let mut cl = client(&addr, CALL_TIMEOUT).await?;
    let (tx, rx) = tokio::sync::mpsc::channel::<StateChunk>(8);
    // Exports flow straight into the switch, a piece at a time.
    let pump = tokio::spawn(async move {
        use tokio_stream::StreamExt;
        tx.send(StateChunk {
            header: Some(header),
            ..Default::default()
        })
        .await
        .map_err(|_| "the switch call ended early".to_string())?;
        for (gid, gaddr, r) in givers {
            let mut g = client(&gaddr, CALL_TIMEOUT).await?;
            let mut s = g
                .export_state(ExportStateRequest {
                    layer_start: r.start,
                    layer_end: r.end,
                })
                .await
                .map_err(|s| {
                    format!(
                        "worker {gid} could not export layers {}: {}",
                        omni_engine::fmt_layers(&r),
                        s.message()
                    )
                })?
                .into_inner();
            while let Some(chunk) = s.next().await {
                let chunk = chunk.map_err(|s| {
                    format!(
                        "worker {gid}'s export of layers {} broke: {}",
                        omni_engine::fmt_layers(&r),
                        s.message()
                    )
                })?;
                tx.send(chunk)
                    .await
                    .map_err(|_| "the switch call ended early".to_string())?;
            }
        }
        Ok::<(), String>(())
    });
    let switched = cl
        .switch(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await;
    let pumped = pump.await.map_err(|e| e.to_string()).and_then(|r| r);
    pumped?;
    let r = switched
        .map_err(|s| format!("worker {id} could not switch: {}", s.message()))?
        .into_inner();
    Ok(r.kv_bytes_in)
}
