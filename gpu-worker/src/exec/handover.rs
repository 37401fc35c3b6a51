//! The stage thread's side of moves and recoveries: exporting and importing state,
//! switching to a new stage, dropping the old one, resetting after a crash elsewhere.

use super::*;
use omni_engine::kv::KvLayers;
use omni_engine::sampling::Sampler;
use omni_engine::stage::Stage;
use omni_proto::worker::v1::ExpertUse;
use std::ops::Range;
use std::sync::atomic::Ordering;

impl StageRun {
    pub(super) fn reset(&mut self, fence: u64) -> Option<omni_engine::stage::LayerRange> {
        if self.previous.is_some() {
            self.finish(false);
        }
        if let Some(stage) = self.stage.as_mut() {
            stage.clear_kv();
        }
        self.slots.clear();
        self.samplers.clear();
        if let Some(d) = self.drafter.as_mut() {
            d.clear();
        }
        self.fence = fence;
        self.publish_kv();
        tracing::info!(
            "stage {}: reset for recovery; frames of steps before {fence} are dropped",
            self.index
        );
        self.stage.as_ref().map(|s| s.range().clone())
    }

    /// Every `every` steps: keep the `k` most used experts of each
    /// offloaded layer here (only once the layer has statistics), and
    /// publish the statistics for Status and metrics. Runs between steps,
    /// so a step never sees a half-changed set.
    pub(super) fn refresh_experts(&mut self) {
        let steps = self.stats.steps.load(Ordering::Relaxed);
        let Some(stage) = self.stage.as_mut() else {
            return;
        };
        if stage.offloaded_layers().is_empty()
            || !steps.is_multiple_of(self.device_experts.every.max(1))
        {
            return;
        }
        let k = self.device_experts.k;
        if k > 0 {
            let layers: Vec<u32> = stage.offloaded_layers().to_vec();
            for il in layers {
                let seen = stage
                    .expert_counts()
                    .get(&il)
                    .is_some_and(|c| c.iter().any(|&n| n > 0));
                if !seen {
                    continue;
                }
                let hot = stage.hot_experts(il, k);
                if hot.as_slice() != stage.device_experts(il) {
                    match stage.set_device_experts(il, &hot) {
                        Ok(()) => {
                            self.stats.expert_moves.fetch_add(1, Ordering::Relaxed);
                            tracing::info!(
                                "stage {}: layer {il} keeps experts {hot:?} here (the {k} most used)",
                                self.index
                            );
                        }
                        Err(e) => tracing::warn!(
                            "stage {}: cannot keep layer {il}'s experts {hot:?} here: {e}",
                            self.index
                        ),
                    }
                }
            }
            self.stats
                .device_expert_bytes
                .store(stage.device_expert_bytes(), Ordering::Relaxed);
            self.stats
                .held_bytes
                .store(stage.held_bytes(), Ordering::Relaxed);
        }
        let uses = stage
            .expert_counts()
            .iter()
            .map(|(&layer, counts)| ExpertUse {
                layer,
                counts: counts.clone(),
                on_device: stage.device_experts(layer).to_vec(),
            })
            .collect();
        *self.stats.experts.lock().unwrap() = uses;
    }

    pub(super) fn export(
        &self,
        layers: Range<u32>,
    ) -> Result<(Option<KvLayers>, SeqState), String> {
        let stage = match &self.previous {
            Some(p) => p.stage.as_ref(),
            None => self.stage.as_ref(),
        };
        let kv = if layers.is_empty() {
            None
        } else {
            let stage = stage.ok_or("this worker holds no layers to export")?;
            Some(stage.export_kv(layers).map_err(|e| e.to_string())?)
        };
        let state = SeqState {
            slots: self
                .slots
                .iter()
                .map(|(&slot, i)| SlotState {
                    slot,
                    request_id: i.request_id.clone(),
                    traceparent: i.traceparent.clone(),
                })
                .collect(),
            samplers: self
                .samplers
                .iter()
                .map(|(&slot, s)| SamplerEntry {
                    slot,
                    state: s.sampler.state(),
                    history: s.history.clone(),
                    logprobs: s.logprobs,
                    top_logprobs: s.top_logprobs,
                    prompt_len: s.prompt_len,
                })
                .collect(),
        };
        Ok((kv, state))
    }

    pub(super) fn switch(
        &mut self,
        new: Option<Stage>,
        index: u32,
        incoming: Vec<KvLayers>,
        seqs: Vec<SeqState>,
    ) -> Result<(), String> {
        if self.previous.is_some() {
            return Err("a switch is already pending (finish it first)".into());
        }
        let head = new.as_ref().is_some_and(|s| s.range().head);
        let new = match new {
            Some(mut st) => {
                let refs: Vec<&KvLayers> = incoming.iter().collect();
                st.take_over(self.stage.as_ref(), &refs)
                    .map_err(|e| e.to_string())?;
                Some(st)
            }
            None => None,
        };
        let mut added_slots = Vec::new();
        let mut added_samplers = Vec::new();
        for st in seqs {
            for s in st.slots {
                if let std::collections::hash_map::Entry::Vacant(e) = self.slots.entry(s.slot) {
                    added_slots.push(s.slot);
                    e.insert(SlotInfo {
                        trace: omni_telemetry::Remote::parse(&s.traceparent),
                        request_id: s.request_id,
                        traceparent: s.traceparent,
                    });
                }
            }
            if !head {
                continue;
            }
            for e in st.samplers {
                if self.samplers.contains_key(&e.slot) {
                    continue;
                }
                let sampler =
                    Sampler::restore(e.state).map_err(|why| format!("slot {}: {why}", e.slot))?;
                added_samplers.push(e.slot);
                let start = SamplerStart {
                    logprobs: e.logprobs,
                    top_logprobs: e.top_logprobs,
                    prompt_len: e.prompt_len,
                };
                let model = new.as_ref().expect("head").model();
                let s = SeqSampler::new(sampler, start, e.history, &mut self.grammars, model);
                self.samplers.insert(e.slot, s);
            }
        }
        let old = std::mem::replace(&mut self.stage, new);
        let held = |s: &Option<Stage>| s.as_ref().map_or(0, Stage::held_bytes);
        self.stats
            .held_bytes
            .store(held(&self.stage) + held(&old), Ordering::Relaxed);
        self.previous = Some(Previous {
            stage: old,
            index: std::mem::replace(&mut self.index, index),
            added_slots,
            added_samplers,
        });
        Ok(())
    }

    pub(super) fn finish(&mut self, commit: bool) -> Option<omni_engine::stage::LayerRange> {
        if let Some(p) = self.previous.take() {
            if commit {
                drop(p.stage);
                if !self.stage.as_ref().is_some_and(|s| s.range().head) {
                    self.samplers.clear();
                    // The head went elsewhere, and its draft model with it.
                    self.drafter = None;
                }
                if self.stage.is_none() {
                    self.slots.clear();
                }
            } else {
                self.stage = p.stage;
                self.index = p.index;
                for s in p.added_slots {
                    self.slots.remove(&s);
                }
                for s in p.added_samplers {
                    self.samplers.remove(&s);
                }
            }
        }
        let stage = self.stage.as_ref();
        self.stats
            .held_bytes
            .store(stage.map_or(0, Stage::held_bytes), Ordering::Relaxed);
        self.publish_kv();
        stage.map(|s| s.range().clone())
    }
}
