//! A GPU stage computing its offloaded layers' routed experts itself for a
//! big step ([`LocalExperts`]): the experts stay mapped in host memory and
//! ggml's scheduler streams them to the device for each `mul_mat_id` whose
//! batch reaches the backend's offload threshold (llama.cpp's op offload).

use super::LocalExperts;
use super::Stage;
use crate::error::EngineError;
use crate::ffi::ggml;
use crate::ffi::ggml::Buffer;
use crate::ffi::ggml::BufferType;
use crate::ffi::ggml::Ctx;
use std::time::Instant;

/// ggml's GPU backends offload an op on host weights from this many rows
/// (`GGML_OP_OFFLOAD_MIN_BATCH`, read by the backend at start-up).
pub(super) fn ggml_offload_min_batch() -> usize {
    std::env::var("GGML_OP_OFFLOAD_MIN_BATCH")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(32)
}

/// Bytes copied to time the host-to-device path at load.
const PROBE_BYTES: usize = 32 << 20;

/// How a stage decides, step by step, where its routed experts compute.
#[derive(Debug)]
pub(super) struct LocalRule {
    setting: LocalExperts,
    /// The backend's offload threshold: below it the experts would compute
    /// on the CPU in this process, never worth it beside an executor.
    min_batch: usize,
    /// Seconds to stream the routed experts of the stage's largest
    /// offloaded layer to the device (their bytes over the measured rate).
    stream_s: f64,
    /// The executor's seconds per token and layer, from its calls of at
    /// least `min_batch` tokens (a moving average).
    per_token_s: Option<f64>,
    /// Steps computed here.
    pub(super) steps: u64,
}

impl LocalRule {
    /// The rule for a GPU stage whose largest offloaded layer holds
    /// `layer_bytes` of routed experts, timing a copy into `buft`.
    pub(super) fn new(
        setting: LocalExperts,
        buft: BufferType,
        layer_bytes: u64,
    ) -> Result<LocalRule, EngineError> {
        let rate = upload_rate(buft)?;
        Ok(LocalRule {
            setting,
            min_batch: ggml_offload_min_batch(),
            stream_s: layer_bytes as f64 / rate,
            per_token_s: None,
            steps: 0,
        })
    }

    /// Whether a step of `n` tokens computes its routed experts here: as
    /// set, and for `Auto` once the executor is timed and slower for `n`.
    pub(super) fn here(&self, n: usize) -> bool {
        self.may(n)
            && (self.setting != LocalExperts::Auto
                || self
                    .per_token_s
                    .is_some_and(|t| n as f64 * t > self.stream_s))
    }

    /// Whether a step of `n` tokens may ever compute here (what the
    /// compute buffer is sized for).
    pub(super) fn may(&self, n: usize) -> bool {
        n >= self.min_batch
            && match self.setting {
                LocalExperts::Off => false,
                LocalExperts::From(k) => n >= k,
                LocalExperts::Auto => true,
            }
    }

    /// The smallest step that computes here now, if any.
    pub(super) fn threshold(&self) -> Option<usize> {
        match self.setting {
            LocalExperts::Off => None,
            LocalExperts::From(k) => Some(k.max(self.min_batch)),
            LocalExperts::Auto => self
                .per_token_s
                .map(|t| ((self.stream_s / t).floor() as usize + 1).max(self.min_batch)),
        }
    }

    /// An executor call of `n` tokens took `secs` from submit to answer.
    pub(super) fn note_call(&mut self, n: usize, secs: f64) {
        if n < self.min_batch || n == 0 {
            return;
        }
        let t = secs / n as f64;
        self.per_token_s = Some(match self.per_token_s {
            None => t,
            Some(p) => 0.75 * p + 0.25 * t,
        });
    }
}

/// Bytes per second from host memory into a buffer of `buft` (the second
/// of two copies, the first paying for first touches).
fn upload_rate(buft: BufferType) -> Result<f64, EngineError> {
    let ctx = Ctx::new(1, false);
    let t = ctx.new_tensor(ggml::TYPE_F32, &[(PROBE_BYTES / 4) as i64]);
    let _buf = Buffer::alloc_ctx(&ctx, buft).ok_or(EngineError::OutOfMemory {
        what: format!(
            "a {} MiB probe of the host-to-device copy",
            PROBE_BYTES >> 20
        ),
        bytes: PROBE_BYTES as u64,
    })?;
    let data = vec![1u8; PROBE_BYTES];
    let mut secs = 0.0;
    for _ in 0..2 {
        let start = Instant::now();
        t.write_bytes(&data);
        secs = start.elapsed().as_secs_f64();
    }
    Ok(PROBE_BYTES as f64 / secs.max(1e-9))
}

impl Stage {
    /// Whether a step of `n` tokens computes the offloaded layers' routed
    /// experts on this stage ([`LocalExperts`]).
    pub(super) fn experts_here(&self, n: usize) -> bool {
        self.local.as_ref().is_some_and(|r| r.here(n))
    }

    /// Whether a step of `n` tokens may ever compute its routed experts on
    /// this stage (an `Auto` rule until it has timed the executor).
    pub(super) fn experts_may_be_here(&self, n: usize) -> bool {
        self.local.as_ref().is_some_and(|r| r.may(n))
    }

    /// Steps whose routed experts this stage computed itself.
    pub fn local_expert_steps(&self) -> u64 {
        self.local.as_ref().map_or(0, |r| r.steps)
    }

    /// The smallest step that computes its routed experts on this stage
    /// now (`None`: every step sends them to the executor).
    pub fn local_experts_from(&self) -> Option<usize> {
        self.local.as_ref().and_then(LocalRule::threshold)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(setting: LocalExperts) -> LocalRule {
        LocalRule {
            setting,
            min_batch: 32,
            stream_s: 0.1,
            per_token_s: None,
            steps: 0,
        }
    }

    #[test]
    fn a_set_threshold_never_goes_below_ggmls() {
        let r = rule(LocalExperts::From(8));
        assert!(!r.here(16));
        assert!(r.here(32));
        assert_eq!(r.threshold(), Some(32));
        let r = rule(LocalExperts::From(100));
        assert!(!r.here(99));
        assert!(r.here(100));
        assert!(!rule(LocalExperts::Off).here(512));
    }

    #[test]
    fn auto_waits_for_a_timed_call_then_streams_where_it_is_cheaper() {
        let mut r = rule(LocalExperts::Auto);
        assert!(!r.here(512));
        assert_eq!(r.threshold(), None);
        // Calls too small to say what a prompt step costs are ignored.
        r.note_call(4, 1.0);
        assert!(!r.here(512));
        // 3 ms a token: streaming (100 ms) pays from 34 tokens.
        r.note_call(64, 0.192);
        assert!(!r.here(33));
        assert!(r.here(34));
        assert_eq!(r.threshold(), Some(34));
    }

    #[test]
    fn settings_parse_and_print() {
        for s in ["off", "auto", "256"] {
            assert_eq!(s.parse::<LocalExperts>().unwrap().to_string(), s);
        }
        assert!("0".parse::<LocalExperts>().is_err());
        assert!("sometimes".parse::<LocalExperts>().is_err());
    }
}
