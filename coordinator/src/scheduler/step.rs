//! A step: which sequences go into it (prefill chunks beside decode), sending it, and
//! what comes back (tokens, logprobs, stops).

use super::*;
use omni_engine::sampling::StopMatcher;
use omni_engine::tokenizer::StreamDecoder;
use omni_proto::coordinator::v1::Done;
use omni_proto::coordinator::v1::FinishReason;
use omni_proto::coordinator::v1::GenerateEvent;
use omni_proto::coordinator::v1::Token;
use omni_proto::worker::v1::Step;
use omni_proto::worker::v1::TopLogprob;
use omni_proto::worker::v1::{Draft, Propose, SlotRequest, Truncate};
use omni_transport::Frame;
use prost::Message;
use std::collections::HashMap;
use std::time::Instant;

impl Scheduler {
    /// Admits queued sequences into free slots, then sends a step for every
    /// idle group that has work (or a control step if only removals wait).
    pub(super) fn schedule(&mut self) {
        if self.failed.is_some()
            || self.recovering.is_some()
            || self.paused
            || self.pausing.is_some()
        {
            return;
        }
        let replaying = self.replaying();
        while !replaying && !self.queue.is_empty() && !self.free_slots.is_empty() {
            let new = self.queue.pop_front().unwrap();
            let slot = self.free_slots.pop().unwrap();
            let group = (0..self.groups.len())
                .min_by_key(|&g| self.seqs.values().filter(|s| s.group == g).count())
                .unwrap_or(0);
            let mut tokens = new.prompt.clone();
            tokens.extend_from_slice(&new.resumed);
            let mut stops = StopMatcher::new(new.stop.clone());
            // A resumed request's text so far (the client has it) puts the
            // decoder and the stop strings where they were.
            let mut decoder = StreamDecoder::default();
            for &t in &new.resumed {
                push_text(&self.tokenizer, &mut decoder, &mut stops, t);
            }
            let first_token = (!new.resumed.is_empty()).then_some(new.arrived);
            let generated = new.resumed.len();
            let hit = match self.prefix.as_mut() {
                Some(pc) if new.cache_prompt => {
                    // A batch-invariant step computes a row the same in
                    // any step; otherwise the prompt's last step is
                    // computed as it was the first time.
                    let tail = if new.deterministic {
                        1
                    } else {
                        self.cfg.prompt_cuts.cache_tail()
                    };
                    let hit = pc.lookup(&new.prompt, new.deterministic, tail);
                    let m = &self.metrics.prefix;
                    m.lookups.inc();
                    m.hit_tokens.inc_by(hit.cells.len() as u64);
                    m.miss_tokens
                        .inc_by((new.prompt.len() - hit.cells.len()) as u64);
                    new.span.record("cached_tokens", hit.cells.len());
                    hit
                }
                _ => prefix::Hit::default(),
            };
            let k = hit.cells.len();
            self.order.push(new.id);
            self.seqs.insert(
                new.id,
                Seq {
                    new,
                    slot,
                    group,
                    tokens,
                    fed: k,
                    prefix: k,
                    cells: hit.cells,
                    chain: hit.chain,
                    cached_tokens: k,
                    generated,
                    started: false,
                    decoder,
                    stops,
                    first_token,
                    recoveries: 0,
                    crashes: 0,
                    drafts_in_flight: 0,
                    proposed: Vec::new(),
                    draft_n: 0,
                    draft_accepted: 0,
                },
            );
        }
        for g in 0..self.groups.len() {
            if self.groups[g].is_some() {
                continue;
            }
            let built = match self.replay[g].pop_front() {
                Some(entries) => self.build_replay(g, entries),
                None if replaying => None,
                None => self.build_step(g),
            };
            if let Some((step, flight)) = built {
                self.send(step, Some((g, flight)));
                if self.recovering.is_some() {
                    return;
                }
            }
        }
        let cache_pending = self.prefix.as_ref().is_some_and(|p| p.has_pending());
        if !self.pending_remove.is_empty() || cache_pending {
            let step = Step {
                group: CONTROL_GROUP,
                ..Default::default()
            };
            self.send(step, None);
        }
    }

    pub(super) fn build_step(&mut self, g: usize) -> Option<(Step, Flight)> {
        let mut budget = self.cfg.n_ubatch;
        let mut step = Step {
            group: g as u32,
            ..Default::default()
        };
        let mut owners = HashMap::new();
        let mut entries = Vec::new();
        // Decode tokens first (one each), then prompt chunks: bounded by
        // `prefill_chunk` when the step decodes, so a long prompt does not
        // hold the generating streams up for all of its tokens at once.
        let ids: Vec<u64> = self.order.clone();
        let mut prompt_tokens = 0;
        // Decode tokens still to place: drafts take only what leaves each
        // of them its token.
        let mut decoders = ids
            .iter()
            .filter(|id| {
                let s = &self.seqs[id];
                s.group == g && s.fed < s.tokens.len() && s.fed >= s.new.prefill_len()
            })
            .count();
        for decode_pass in [true, false] {
            let decoded = self.cfg.n_ubatch - budget;
            if !decode_pass && decoded > 0 && self.cfg.prefill_chunk > 0 {
                budget = budget.min(self.cfg.prefill_chunk);
            }
            for id in &ids {
                let s = self.seqs.get_mut(id).unwrap();
                let remaining = s.tokens.len() - s.fed;
                let decoding = s.fed >= s.new.prefill_len();
                if s.group != g || remaining == 0 || decoding != decode_pass || budget == 0 {
                    continue;
                }
                // A prompt stops at its cuts (a decoding sequence has one
                // token left, which no cut stops).
                let take =
                    self.cfg
                        .prompt_cuts
                        .take(s.fed, s.tokens.len(), budget, self.cfg.n_ubatch);
                entries.push(Entry {
                    seq: *id,
                    from: s.fed,
                    n: take,
                    logits: s.fed + take == s.tokens.len(),
                    ..Default::default()
                });
                for p in s.fed..s.fed + take {
                    step.tokens.push(s.tokens[p]);
                    step.positions.push(p as i32);
                    step.seqs.push(s.slot);
                    step.logits.push(p + 1 == s.tokens.len());
                }
                if decode_pass {
                    decoders -= 1;
                    // Speculative decoding: a draft after the token, each
                    // of its rows sampled by the last stage. Room: the
                    // step's budget left beside the other decode tokens,
                    // the context, and the tokens max_tokens still allows.
                    let room = budget
                        .saturating_sub(take + decoders)
                        .min(self.cfg.n_ctx.saturating_sub(s.tokens.len()))
                        .min(
                            s.new
                                .max_tokens
                                .saturating_sub(s.generated)
                                .saturating_sub(1),
                        );
                    let (draft, agree) = match s.new.spec.source {
                        DraftSource::Lookup => s.new.spec.draft(
                            &s.tokens,
                            Some(&self.recent),
                            room,
                            self.cfg.spec_tuned.then_some(&self.tuner),
                        ),
                        DraftSource::Model => {
                            let mut d = std::mem::take(&mut s.proposed);
                            d.truncate(room);
                            if d.len() < s.new.spec.n_min {
                                d.clear();
                            }
                            (d, 0)
                        }
                    };
                    if !draft.is_empty() {
                        let entry = entries.last_mut().expect("pushed above");
                        for (i, &t) in draft.iter().enumerate() {
                            step.tokens.push(t);
                            step.positions.push((s.tokens.len() + i) as i32);
                            step.seqs.push(s.slot);
                            step.logits.push(true);
                        }
                        step.drafts.push(Draft {
                            slot: s.slot,
                            n: draft.len() as u32,
                        });
                        budget -= draft.len();
                        s.drafts_in_flight = draft.len();
                        s.draft_n += draft.len();
                        self.metrics.draft_tokens.inc_by(draft.len() as u64);
                        entry.drafts = draft;
                        entry.agree = agree;
                    }
                }
                // Draft-model speculation: the last stage's draft model
                // guesses what follows the token this step samples.
                let e = entries.last().expect("pushed above");
                if e.logits && s.new.spec.is_on() && s.new.spec.source == DraftSource::Model {
                    let n_max = s
                        .new
                        .spec
                        .n_max
                        .min(self.cfg.n_ctx.saturating_sub(s.tokens.len() + 1))
                        .min(s.new.max_tokens.saturating_sub(s.generated + 2));
                    if n_max > 0 {
                        step.propose.push(Propose {
                            slot: s.slot,
                            n_max: n_max as u32,
                            p_min: s.new.spec.p_min,
                        });
                    }
                }
                if !s.started {
                    s.started = true;
                    step.starts.push(seq_start(s));
                    step.requests.push(SlotRequest {
                        slot: s.slot,
                        request_id: s.new.request_id.clone(),
                        traceparent: s.new.traceparent.clone().unwrap_or_default(),
                    });
                }
                s.fed += take;
                budget -= take;
                if !decode_pass {
                    prompt_tokens += take;
                }
                owners.insert(s.slot, *id);
            }
        }
        if step.tokens.is_empty() {
            None
        } else {
            step.invariant = self.invariant(&entries);
            self.make_room();
            if prompt_tokens > 0 && prompt_tokens < step.tokens.len() {
                self.metrics
                    .mixed_step_prompt_tokens
                    .observe(prompt_tokens as f64);
            }
            Some((
                step,
                Flight {
                    owners,
                    entries,
                    replay: false,
                },
            ))
        }
    }

    /// Whether a step carrying `entries` must be batch-invariant: one of
    /// its sequences is deterministic.
    pub(super) fn invariant(&self, entries: &[Entry]) -> bool {
        entries
            .iter()
            .any(|e| self.seqs.get(&e.seq).is_some_and(|s| s.new.deterministic))
    }

    /// Evicts prefix cache blocks until every cell sent (this step's
    /// tokens too) fits in the pool. The evictions ride this step, and
    /// every stage applies them before it takes cells for its tokens.
    fn make_room(&mut self) {
        let Some(pc) = self.prefix.as_mut() else {
            return;
        };
        let own: usize = self
            .seqs
            .values()
            .map(|s| s.fed - s.prefix + s.drafts_in_flight)
            .sum();
        let n_cells = self.cfg.n_ctx * self.cfg.n_seq;
        let used = own + pc.retained_cells();
        if used > n_cells {
            let keep = pc.retained_cells().saturating_sub(used - n_cells);
            self.metrics.prefix.evicted("need", pc.shrink_to(keep));
            self.metrics.prefix.cells.set(pc.retained_cells() as i64);
        }
    }

    /// Sends a step; a group's step records the owner of each of its slots.
    pub(super) fn send(&mut self, mut step: Step, group: Option<(usize, Flight)>) {
        step.id = self.next_step;
        self.next_step += 1;
        // Removals ride on whatever step goes first; the slots are free
        // for reuse once it is on its way.
        step.remove = std::mem::take(&mut self.pending_remove);
        step.truncate = std::mem::take(&mut self.pending_truncate);
        if let Some(pc) = self.prefix.as_mut() {
            (step.retain, step.evict) = pc.take_pending();
        }
        let freed = step.remove.clone();
        let n_tokens = step.tokens.len() as u64;
        let invariant = step.invariant;
        let frame = Frame {
            meta: step.encode_to_vec(),
            payload: Vec::new(),
        };
        if let Err(e) = self.outbox.send(frame) {
            self.begin_recovery(format!("cannot reach the first stage: {e}"));
            return;
        }
        self.free_slots.extend(freed);
        self.metrics.steps.inc();
        if invariant {
            self.metrics.invariant_steps.inc();
        }
        self.metrics.tokens_in.inc_by(n_tokens);
        match group {
            Some((g, f)) => {
                self.groups[g] = Some(InFlight {
                    id: step.id,
                    sent: Instant::now(),
                    flight: f,
                })
            }
            None => self.control_in_flight += 1,
        }
    }

    pub(super) fn on_frame(&mut self, frame: Frame) {
        let step = match Step::decode(frame.meta.as_slice()) {
            Ok(s) => s,
            Err(e) => {
                self.begin_recovery(format!("the last stage sent an undecodable frame: {e}"));
                return;
            }
        };
        if step.id < self.fence || self.recovering.is_some() {
            tracing::debug!(step = step.id, "ignored a result of the broken pipeline");
            return;
        }
        if step.group == CONTROL_GROUP {
            self.control_in_flight = self.control_in_flight.saturating_sub(1);
            return;
        }
        let g = step.group as usize;
        let Some(inflight) = self.groups.get_mut(g).and_then(|f| f.take()) else {
            tracing::warn!(
                "result for step {} of group {g}, which has none in flight",
                step.id
            );
            return;
        };
        if inflight.id != step.id {
            self.begin_recovery(format!(
                "the pipeline returned step {} but step {} was expected",
                step.id, inflight.id
            ));
            return;
        }
        let mut compute_us = 0.0;
        let mut expert_wait_ms = None;
        for t in &step.times {
            self.metrics.record_stage(t.stage, t.compute_ms as f64);
            compute_us += t.compute_ms as f64 * 1e3;
            if t.expert_wait_ms > 0.0 {
                self.metrics
                    .record_expert_wait(t.stage, t.expert_wait_ms as f64);
                *expert_wait_ms.get_or_insert(0.0) += t.expert_wait_ms as f64;
            }
        }
        if let Some(ms) = expert_wait_ms {
            self.metrics.record_step_expert_wait(ms);
        }
        if !step.times.is_empty() {
            let rtt_us = inflight.sent.elapsed().as_secs_f64() * 1e6;
            let hops = (step.times.len() + 1) as f64;
            self.metrics
                .record_hop((rtt_us - compute_us).max(0.0) / hops);
        }
        self.metrics
            .step_latency_us
            .set(inflight.sent.elapsed().as_micros() as i64);
        if !step.error.is_empty() {
            // Its sequences' cache is now unknown somewhere along the
            // pipeline (and a dead expert worker shows up here first).
            self.begin_recovery(format!("step {} failed: {}", step.id, step.error));
            return;
        }
        let mut f = inflight.flight;
        if !f.replay {
            // Only decode steps teach the tuner what a draft's rows cost
            // (each row wants logits; a prompt's rows do not).
            if f.entries.iter().all(|e| e.n == 1) {
                let ms = inflight.sent.elapsed().as_secs_f64() * 1e3;
                tracing::debug!(rows = step.positions.len(), ms, "decode step timed");
                self.tuner.record_step(step.positions.len(), ms);
            }
            self.settle_drafts(&mut f.entries, &f.owners, &step.sampled);
        }
        self.log_step(g, &f.entries, &step.cells, f.replay);
        if f.replay {
            self.check_replayed(&f.entries, &f.owners, &step.sampled);
            return;
        }
        for p in step.proposals {
            if let Some(s) = f.owners.get(&p.slot).and_then(|id| self.seqs.get_mut(id)) {
                s.proposed = p.tokens;
            }
        }
        for sampled in &step.sampled {
            let Some(&id) = f.owners.get(&sampled.slot) else {
                continue;
            };
            self.on_token(id, sampled);
        }
    }

    /// A step with drafts came back: the last stage sampled each drafted
    /// sequence's rows until one disagreed with the draft, so its samples
    /// are the drafts it took and then its own token. The taken drafts
    /// join the entry (its tokens are fed: the sequence's `fed` moves past
    /// them); the cells of the others are truncated away by every stage
    /// before the next step.
    fn settle_drafts(
        &mut self,
        entries: &mut [Entry],
        owners: &HashMap<u32, u64>,
        sampled: &[omni_proto::worker::v1::Sampled],
    ) {
        for e in entries.iter_mut().filter(|e| !e.drafts.is_empty()) {
            let Some((&slot, _)) = owners.iter().find(|(_, &id)| id == e.seq) else {
                continue;
            };
            let samples = sampled.iter().filter(|x| x.slot == slot).count();
            let k = e.drafts.len();
            let taken = samples.saturating_sub(1).min(k);
            self.metrics.draft_accepted.inc_by(taken as u64);
            tracing::debug!(agree = e.agree, k, taken, "draft settled");
            e.verify = taken;
            // A sequence that is gone had its slot removed (every cell).
            let Some(s) = self.seqs.get_mut(&e.seq) else {
                continue;
            };
            s.drafts_in_flight = 0;
            s.draft_accepted += taken;
            s.fed += taken;
            if taken < k {
                self.pending_truncate.push(Truncate {
                    slot,
                    from: (e.from + e.n + taken) as i32,
                });
            }
        }
    }

    /// Keeps a step that came back in its group's log, with the cells its
    /// tokens went into (in token order, as the first stage reported them).
    /// A step that is not a replay also gives its sequences' cells, and the
    /// blocks they complete go into the prefix cache. Of a step with
    /// drafts, the ones taken are logged as the sequence's tokens.
    pub(super) fn log_step(&mut self, g: usize, entries: &[Entry], cells: &[i64], replay: bool) {
        let mut at = 0;
        let mut logged = Vec::new();
        for e in entries {
            let sent = e.n + e.drafts.len();
            let fed = e.n + if e.drafts.is_empty() { 0 } else { e.verify };
            let mine = cells.get(at..at + fed).unwrap_or_default();
            at += sent;
            if let Some(s) = self.seqs.get_mut(&e.seq) {
                logged.push(Entry {
                    n: fed,
                    cells: mine.to_vec(),
                    drafts: Vec::new(),
                    ..e.clone()
                });
                if !replay && s.cells.len() == e.from && mine.len() == fed {
                    s.cells.extend_from_slice(mine);
                    if let (Some(pc), true) = (self.prefix.as_mut(), s.new.cache_prompt) {
                        pc.register(&mut s.chain, &s.tokens, &s.cells);
                    }
                }
            }
        }
        if !logged.is_empty() {
            self.logs[g].push_back(logged);
        }
    }

    pub(super) fn on_token(&mut self, id: u64, sampled: &omni_proto::worker::v1::Sampled) {
        let Some(s) = self.seqs.get_mut(&id) else {
            return; // cancelled while its step was in flight
        };
        let tok = sampled.token;
        s.tokens.push(tok);
        s.generated += 1;
        self.metrics.tokens_out.inc();
        let first = s.first_token.is_none();
        if first {
            s.first_token = Some(Instant::now());
            self.metrics
                .record_ttft(s.new.arrived.elapsed().as_secs_f64() * 1e3);
        }
        let mut ev = GenerateEvent {
            prompt_ids: if first {
                s.new.prompt.clone()
            } else {
                Vec::new()
            },
            tokens: vec![Token {
                id: tok,
                logprob: sampled.logprob,
                top: sampled
                    .top
                    .iter()
                    .map(|t| TopLogprob {
                        piece: self.tokenizer.text_of(t.token),
                        ..t.clone()
                    })
                    .collect(),
                piece: self.tokenizer.text_of(tok),
            }],
            ..Default::default()
        };
        let mut finish = None;
        if self.tokenizer.is_eog(tok) && !s.new.ignore_eos {
            finish = Some(FinishReason::Stop);
        } else {
            let out = push_text(&self.tokenizer, &mut s.decoder, &mut s.stops, tok);
            ev.text = out.text;
            if out.stopped {
                finish = Some(FinishReason::Stop);
            }
        }
        if finish.is_none() && (s.generated >= s.new.max_tokens || s.tokens.len() >= self.cfg.n_ctx)
        {
            finish = Some(FinishReason::Length);
        }
        if let Some(reason) = finish {
            if reason == FinishReason::Length {
                let rest = s.stops.push(&s.decoder.finish());
                ev.text.push_str(&rest.text);
                ev.text.push_str(&s.stops.finish());
            }
            let now = Instant::now();
            let ttft_ms = s
                .first_token
                .map_or(0.0, |t| (t - s.new.arrived).as_secs_f64() * 1e3);
            s.new.span.record("completion_tokens", s.generated);
            s.new.span.record("finish_reason", reason.as_str_name());
            s.new.span.record("ttft_ms", ttft_ms);
            ev.done = Some(Done {
                finish_reason: reason as i32,
                prompt_tokens: s.new.prompt.len() as u32,
                completion_tokens: s.generated as u32,
                time_to_first_token_ms: ttft_ms,
                total_ms: (now - s.new.arrived).as_secs_f64() * 1e3,
                cached_tokens: s.cached_tokens as u32,
                draft_n: s.draft_n as u32,
                draft_n_accepted: s.draft_accepted as u32,
            });
        }
        let gone = s.new.events.send(Ok(ev)).is_err();
        if finish.is_some() || gone {
            self.drop_seq(id);
        }
    }
}
