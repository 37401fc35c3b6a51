//! The scheduler in a recovery: pausing, replaying every sequence into the same cells,
//! checking replayed tokens against those already sent, and giving up.

use super::*;
use crate::error::Error;
use omni_proto::worker::v1::Step;
use omni_proto::worker::v1::{Draft, SlotRequest};
use omni_transport::Outbox;
use std::collections::HashMap;
use std::collections::VecDeque;
use tonic::Status;

impl Scheduler {
    /// Answers a pause once no step is in flight.
    pub(super) fn check_pause(&mut self) {
        if self.pausing.is_some()
            && self.groups.iter().all(Option::is_none)
            && self.control_in_flight == 0
        {
            let reply = self.pausing.take().unwrap();
            self.paused = reply.send(Ok(())).is_ok();
        }
    }

    /// The pipeline broke: drop what is in flight, send nothing more, and
    /// ask for a recovery (without a recovery task: fail everything).
    pub(super) fn begin_recovery(&mut self, why: String) {
        if self.failed.is_some() {
            return;
        }
        if let Some(now) = &self.recovering {
            tracing::warn!("{why} (while recovering from: {now})");
            return;
        }
        let Some(recover) = &self.recover else {
            self.fail_all(why);
            return;
        };
        tracing::error!(
            "{why}; recovering ({} wait, {} in flight)",
            omni_engine::count(self.seqs.len() as u64, "sequence"),
            omni_engine::count(
                self.groups.iter().filter(|g| g.is_some()).count() as u64,
                "step"
            )
        );
        if recover
            .send(RecoveryNeeded {
                fence: self.next_step,
                why: why.clone(),
            })
            .is_err()
        {
            self.fail_all(why);
            return;
        }
        self.in_flight_at_loss = self
            .groups
            .iter()
            .flatten()
            .flat_map(|f| f.flight.entries.iter().map(|e| e.seq))
            .collect();
        // A replay cut short is replayed again from where it got: its steps
        // in flight and still to send go back to the log, in order.
        for g in 0..self.groups.len() {
            let cut = self.groups[g].take().filter(|f| f.flight.replay);
            let rest = std::mem::take(&mut self.replay[g]);
            self.logs[g].extend(cut.map(|f| f.flight.entries).into_iter().chain(rest));
        }
        self.control_in_flight = 0;
        if let Some(p) = self.pausing.take() {
            let _ = p.send(Err(format!("the cluster is recovering: {why}")));
        }
        self.paused = false;
        self.metrics.recoveries.inc();
        self.recovering = Some(why);
    }

    /// The stages were reset (no sequence, every cell free) and wired
    /// again: every group replays its log, every sequence goes on from
    /// where its last step that came back left it.
    pub(super) fn recovered(&mut self, outbox: Option<Outbox>, fence: u64) {
        if let Some(o) = outbox {
            self.outbox = o;
        }
        self.fence = fence;
        self.next_step = self.next_step.max(fence);
        let why = self.recovering.take().unwrap_or_default();
        let in_flight = std::mem::take(&mut self.in_flight_at_loss);
        let death = self.death.take();
        self.gave_up = None;
        let mut stopped = Vec::new();
        for (id, s) in self.seqs.iter_mut() {
            let done = self
                .logs
                .iter()
                .flatten()
                .flatten()
                .filter(|e| e.seq == *id)
                .map(|e| e.from + e.n)
                .max()
                .unwrap_or(0);
            s.fed = done;
            s.drafts_in_flight = 0;
            s.proposed.clear();
            // The replay's first step carries the start again.
            s.started = done > 0;
            s.recoveries += 1;
            if death.is_some() && in_flight.contains(id) {
                s.crashes += 1;
            }
            if s.recoveries > MAX_RECOVERIES {
                stopped.push(*id);
            }
        }
        for id in stopped {
            if let Some(s) = self.seqs.get(&id) {
                // A request that was running every time a worker died is
                // likely what kills it: say so, and how the worker died.
                let msg = match &death {
                    Some(d) if s.crashes == s.recoveries => format!(
                        "the request was stopped because it crashed a worker {} times \
                         (the last time {d} running this request)",
                        s.crashes
                    ),
                    _ => format!(
                        "the request was stopped after {MAX_RECOVERIES} recoveries, the last because {why}"
                    ),
                };
                s.new.fail(Error::Stopped(msg).into());
            }
            self.drop_seq(id);
        }
        self.drop_prefix_cache();
        for (g, log) in self.logs.iter_mut().enumerate() {
            self.replay[g] = std::mem::take(log);
        }
        // Every stage forgot every sequence: all slots not held are free,
        // and no cell of a draft is left.
        self.pending_remove.clear();
        self.pending_truncate.clear();
        let held: Vec<u32> = self.seqs.values().map(|s| s.slot).collect();
        self.free_slots = (0..self.cfg.n_seq as u32)
            .rev()
            .filter(|s| !held.contains(s))
            .collect();
        let steps: usize = self.replay.iter().map(VecDeque::len).sum();
        tracing::info!(
            "recovered; replaying {} of {}",
            omni_engine::count(steps as u64, "step"),
            omni_engine::count(self.seqs.len() as u64, "sequence")
        );
    }

    /// The stages were reset, so the prefix cache's cells are gone: the
    /// index is cleared, and a sequence that started from cached cells
    /// computes its prefix again in its own cells, first in its group's
    /// replay (cells no logged step names, its old ones where it can).
    /// Its blocks are registered again, as its own, when its next step
    /// comes back: after the replay, so that a sequence that ends before
    /// its cells are computed again leaves nothing in the index.
    fn drop_prefix_cache(&mut self) {
        let Some(pc) = self.prefix.as_mut() else {
            return;
        };
        let blocks = pc.clear();
        let mut used: std::collections::HashSet<i64> = self
            .logs
            .iter()
            .flatten()
            .flatten()
            .flat_map(|e| e.cells.iter().copied())
            .collect();
        let mut lowest = 0i64;
        let mut recomputed = 0;
        for id in &self.order {
            let s = self.seqs.get_mut(id).expect("ordered sequences are live");
            s.chain = prefix::Chain::new(s.new.deterministic);
            s.cells.truncate(s.fed);
            if s.prefix == 0 {
                continue;
            }
            recomputed += 1;
            let k = std::mem::take(&mut s.prefix);
            if s.fed == 0 {
                // Nothing of it ran since (its cells were truncated away
                // above): it prefills from the start.
                s.cached_tokens = 0;
                continue;
            }
            let old = s.cells[..k].to_vec();
            let mut cells = Vec::with_capacity(k);
            for c in old {
                let c = if used.contains(&c) {
                    while used.contains(&lowest) {
                        lowest += 1;
                    }
                    lowest
                } else {
                    c
                };
                used.insert(c);
                cells.push(c);
            }
            s.cells[..k].copy_from_slice(&cells);
            let chunk = self.cfg.n_ubatch.max(1);
            let entries: Vec<Vec<Entry>> = (0..k)
                .step_by(chunk)
                .map(|from| {
                    let n = chunk.min(k - from);
                    vec![Entry {
                        seq: *id,
                        from,
                        n,
                        logits: false,
                        cells: cells[from..from + n].to_vec(),
                        ..Default::default()
                    }]
                })
                .collect();
            for e in entries.into_iter().rev() {
                self.logs[s.group].push_front(e);
            }
        }
        if blocks > 0 || recomputed > 0 {
            tracing::warn!(
                "recovery dropped the prefix cache ({}); cached prefixes of {} are computed again",
                omni_engine::count(blocks as u64, "block"),
                omni_engine::count(recomputed as u64, "sequence")
            );
            self.metrics.prefix.dropped.inc();
        }
        self.metrics.prefix.cells.set(pc.retained_cells() as i64);
    }

    /// Whether replayed steps are still to send or on their way (nothing
    /// else is sent meanwhile: a new token's cell could be one a replayed
    /// token must go back into).
    pub(super) fn replaying(&self) -> bool {
        self.replay.iter().any(|r| !r.is_empty())
            || self.groups.iter().flatten().any(|f| f.flight.replay)
    }

    /// Stops everything in flight with `why` (the client gets the error).
    pub(super) fn fail_all(&mut self, why: String) {
        if self.failed.is_none() {
            tracing::error!("{why}; failing every request");
        }
        self.stop_every_request(&why);
        if let Some(p) = self.pausing.take() {
            let _ = p.send(Err(why.clone()));
        }
        self.failed = Some(why);
    }

    /// Ends every running and queued request with `why` (their slots are
    /// free again once the stages are reset, or never used again).
    pub(super) fn stop_every_request(&mut self, why: &str) {
        let status: Status = Error::Stopped(format!("{why}; the request was stopped")).into();
        for (_, s) in self.seqs.drain() {
            s.new.fail(status.clone());
        }
        for s in self.queue.drain(..) {
            s.fail(status.clone());
        }
        self.order.clear();
        if let Some(pc) = self.prefix.as_mut() {
            pc.clear();
            self.metrics.prefix.cells.set(0);
        }
        self.logs.iter_mut().for_each(VecDeque::clear);
        self.replay.iter_mut().for_each(VecDeque::clear);
    }

    /// A logged step again, after a recovery: the same tokens of the same
    /// (still live) sequences, into the same cells, with the starts of
    /// sequences whose first tokens it carries.
    pub(super) fn build_replay(&mut self, g: usize, entries: Vec<Entry>) -> Option<(Step, Flight)> {
        let mut step = Step {
            group: g as u32,
            ..Default::default()
        };
        let mut owners = HashMap::new();
        let mut placed = true;
        // Only live sequences' parts (the entries name the step's tokens).
        let entries: Vec<Entry> = entries
            .into_iter()
            .filter(|e| self.seqs.contains_key(&e.seq))
            .collect();
        for e in &entries {
            let s = &self.seqs[&e.seq];
            // A step that verified drafts: its last `verify` tokens are
            // verified again (the sampler draws as it did).
            let end = e.from + e.n;
            for p in e.from..end {
                step.tokens.push(s.tokens[p]);
                step.positions.push(p as i32);
                step.seqs.push(s.slot);
                step.logits.push(e.logits && p + 1 + e.verify >= end);
            }
            if e.logits && e.verify > 0 {
                step.drafts.push(Draft {
                    slot: s.slot,
                    n: e.verify as u32,
                });
            }
            placed &= e.cells.len() == e.n;
            step.cells.extend_from_slice(&e.cells);
            if e.from == 0 {
                step.starts.push(seq_start(s));
                step.requests.push(SlotRequest {
                    slot: s.slot,
                    request_id: s.new.request_id.clone(),
                    traceparent: s.new.traceparent.clone().unwrap_or_default(),
                });
            }
            owners.insert(s.slot, e.seq);
        }
        if step.tokens.is_empty() {
            return None;
        }
        if !placed {
            step.cells.clear();
        }
        step.invariant = self.invariant(&entries);
        Some((
            step,
            Flight {
                owners,
                entries,
                replay: true,
            },
        ))
    }

    /// A replayed step's samples repeat tokens the clients already have;
    /// they are dropped, and checked: with the same cache and the same
    /// sampler state they are the same tokens.
    pub(super) fn check_replayed(
        &mut self,
        entries: &[Entry],
        owners: &HashMap<u32, u64>,
        sampled: &[omni_proto::worker::v1::Sampled],
    ) {
        // A sequence's samples in a replayed step of drafts: one per
        // verified row, in order.
        let mut nth: HashMap<u32, usize> = HashMap::new();
        for x in sampled {
            let Some(&id) = owners.get(&x.slot) else {
                continue;
            };
            let Some(s) = self.seqs.get(&id) else {
                continue;
            };
            let Some(e) = entries.iter().find(|e| e.seq == id && e.logits) else {
                continue;
            };
            let j = nth.entry(x.slot).or_default();
            let at = e.from + e.n - e.verify + *j;
            *j += 1;
            match s.tokens.get(at) {
                Some(&t) if t == x.token => {}
                Some(&t) => {
                    self.metrics.replay_mismatches.inc();
                    tracing::warn!(
                        seq = id,
                        "the replay sampled token {} at position {at} where {t} was sent; the stream goes on with {t}",
                        x.token
                    );
                }
                None => tracing::warn!(seq = id, "a replayed step sampled past the sequence's log"),
            }
        }
    }
}
