//! The worker's Prometheus text: its stage, its links, its steps.

use super::*;
use crate::exec::Phase;
use std::sync::atomic::Ordering;

impl Worker {
    /// The Prometheus text for this worker, read from its counters.
    pub(super) fn render_metrics(&self) -> String {
        use prometheus_client::metrics::{counter::ConstCounter, gauge::ConstGauge};
        let mut r = prometheus_client::registry::Registry::with_prefix("omni_worker");
        let s = &self.stats;
        let get = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        r.register(
            "steps",
            "Steps this stage ran",
            ConstCounter::new(get(&s.steps)),
        );
        r.register(
            "tokens",
            "Tokens this stage ran",
            ConstCounter::new(get(&s.tokens)),
        );
        r.register(
            "step_compute_seconds",
            "Compute time of all steps",
            ConstCounter::new(get(&s.total_step_us) as f64 / 1e6),
        );
        r.register(
            "step_send_seconds",
            "Time the stage thread spent sending results on",
            ConstCounter::new(s.timeline.seconds(Phase::Sending)),
        );
        r.register(
            "input_wait_seconds",
            "Time the stage thread waited for the next frame (idle)",
            ConstCounter::new(s.timeline.seconds(Phase::Waiting)),
        );
        r.register(
            "last_step_ms",
            "Compute time of the last step",
            ConstGauge::new(get(&s.last_step_us) as f64 / 1e3),
        );
        r.register(
            "kv_cells_used",
            "KV cache cells in use",
            ConstGauge::new(get(&s.kv_cells_used) as i64),
        );
        r.register(
            "kv_cells_cached",
            "KV cache cells the prefix cache keeps",
            ConstGauge::new(get(&s.kv_cells_cached) as i64),
        );
        r.register(
            "kv_cached_bytes",
            "Bytes of K and V the prefix cache's cells hold on this stage",
            ConstGauge::new(get(&s.kv_cached_bytes) as i64),
        );
        r.register(
            "step_errors",
            "Steps that failed",
            ConstCounter::new(get(&s.errors)),
        );
        let inbox = self.inbox.lock().unwrap().stats.clone();
        r.register(
            "bytes_received",
            "Frame bytes received (both transports)",
            ConstCounter::new(get(&inbox.bytes_received)),
        );
        r.register(
            "frames_received",
            "Frames received",
            ConstCounter::new(get(&inbox.frames_received)),
        );
        r.register(
            "device_expert_bytes",
            "Bytes of offloaded layers' experts kept on this device (--gpu-experts)",
            ConstGauge::new(get(&s.device_expert_bytes) as i64),
        );
        r.register(
            "device_expert_moves",
            "Times an offloaded layer's device experts changed",
            ConstCounter::new(get(&s.expert_moves)),
        );
        for u in s.experts.lock().unwrap().iter() {
            let sub = r.sub_registry_with_label(("layer".into(), u.layer.to_string().into()));
            sub.register(
                "device_experts",
                "Experts of an offloaded layer computed on this device",
                ConstGauge::new(u.on_device.len() as i64),
            );
            sub.register(
                "routed_tokens",
                "Expert selections seen in an offloaded layer",
                ConstCounter::new(u.counts.iter().sum::<u64>()),
            );
        }
        r.register(
            "expert_wait_seconds",
            "Time steps spent waiting for expert workers",
            ConstCounter::new(get(&s.expert_wait_us) as f64 / 1e6),
        );
        let calls = &s.expert_calls;
        r.register(
            "expert_round_trip_seconds",
            "Expert calls from each request sent to its answer read",
            ConstCounter::new(get(&calls.round_trip_us) as f64 / 1e6),
        );
        r.register(
            "expert_compute_seconds",
            "Part of the expert calls' round trips the expert workers computed",
            ConstCounter::new(get(&calls.compute_us) as f64 / 1e6),
        );
        for (name, help, v) in [
            (
                "expert_send_seconds",
                "Part of the expert calls' round trips spent encoding and sending the requests",
                &calls.send_us,
            ),
            (
                "expert_transit_seconds",
                "Part of the expert calls' round trips between the processes: the frames' way both ways, a request queued behind another call, an answer waiting for the stage to read it",
                &calls.transit_us,
            ),
            (
                "expert_pickup_seconds",
                "Shared memory: from each request sent (or the expert worker's previous answer, if later) to the worker having it",
                &calls.pickup_us,
            ),
            (
                "expert_delivery_seconds",
                "Shared memory: from each answer sent (or the stage starting to wait, if later) to the stage having it",
                &calls.delivery_us,
            ),
            (
                "expert_handoff_seconds",
                "Part of the expert calls' round trips the expert workers spent between a request in hand and its compute, and between the result and its answer",
                &calls.handoff_us,
            ),
            (
                "expert_graph_seconds",
                "Of the experts' compute, building and allocating each call's graph",
                &calls.graph_us,
            ),
        ] {
            r.register(name, help, ConstCounter::new(get(v) as f64 / 1e6));
        }
        r.register(
            "draft_seconds",
            "Time the draft model spent guessing tokens after the last stage's samples (--model-draft)",
            ConstCounter::new(get(&s.draft_us) as f64 / 1e6),
        );
        r.register(
            "overlapped_steps",
            "Steps run as two micro-batch groups beside the expert workers (--expert-overlap)",
            ConstCounter::new(get(&s.overlapped_steps)),
        );
        r.register(
            "streamed_expert_steps",
            "Steps that computed their routed experts on this GPU, streamed from host memory (--stream-experts)",
            ConstCounter::new(get(&s.streamed_expert_steps)),
        );
        if let Some(x) = self.experts.lock().unwrap().as_ref() {
            for route in x.routes() {
                let sub = r
                    .sub_registry_with_label(("expert_worker".into(), route.worker.clone().into()));
                let st = &route.link.stats;
                sub.register(
                    "expert_bytes_sent",
                    "Bytes sent to an expert worker",
                    ConstCounter::new(get(&st.bytes_sent)),
                );
                sub.register(
                    "expert_bytes_received",
                    "Bytes received from an expert worker",
                    ConstCounter::new(get(&st.bytes_received)),
                );
                sub.register(
                    "expert_calls",
                    "Calls to an expert worker",
                    ConstCounter::new(get(&st.frames_sent)),
                );
            }
        }
        if let Some(o) = self.outbox.lock().unwrap().as_ref() {
            let sub = r.sub_registry_with_label(("transport".into(), o.kind().into()));
            sub.register(
                "bytes_sent",
                "Frame bytes sent to the next stage",
                ConstCounter::new(get(&o.stats.bytes_sent)),
            );
            sub.register(
                "frames_sent",
                "Frames sent to the next stage",
                ConstCounter::new(get(&o.stats.frames_sent)),
            );
        }
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &r).expect("writing to a String");
        out
    }
}
