//! A worker's stage switch (live migration) in one process: a real stage
//! thread (`omni_gpu_worker::exec::Exec`) serving Gemma 3 270M, its output
//! over a real shared-memory ring.
//!
//! What must hold for a move to be safe: a switch that fails leaves the
//! stage serving exactly as before; a switch rolled back (another worker of
//! the move failed) does too; a committed switch goes on from the same KV
//! cache and sampler state. In every case the sequence's tokens are those
//! of a run without any switch.

use omni_engine::stage::{HiddenDtype, LayerRange, Stage, StageConfig};
use omni_engine::KvConfig;
use omni_gpu_worker::exec::{DeviceExperts, Exec, ExecStats, Links};
use omni_proto::worker::v1::{SeqStart, Step};
use omni_tests::fixtures::{model, GEMMA};
use omni_transport::{Frame, Inbox, Outbox, TransportChoice};
use prost::Message;
use std::sync::{Arc, Mutex};
use std::time::Duration;

struct Harness {
    /// Frames to the stage go through a real inbox's ring, as a worker's do.
    input: Outbox,
    _inbox: Inbox,
    output: Inbox,
    exec: Exec,
    model: Arc<omni_engine::ModelFile>,
    cfg: StageConfig,
    next_id: u64,
    pos: i32,
    last: u32,
}

fn whole() -> LayerRange {
    LayerRange {
        embed: true,
        layers: 0..18,
        head: true,
    }
}

impl Harness {
    fn new() -> Harness {
        let model = omni_engine::ModelFile::open(model(GEMMA)).unwrap();
        let cfg = StageConfig {
            kv: KvConfig {
                n_ctx: 256,
                n_seq: 2,
            },
            n_ubatch: 64,
            n_threads: 2,
            device: Default::default(),
            repack: true,
            deterministic: false,
            expert_overlap: false,
            shared_overlap: false,
            local_experts: Default::default(),
        };
        let stage = Stage::load(model.clone(), whole(), cfg.clone()).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let mut output = Inbox::new();
        output.add_ring(dir.path(), "switch-test", 1 << 20).unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let ep = output.endpoint("127.0.0.1:1", "host");
        let outbox = rt
            .block_on(Outbox::connect(&ep, TransportChoice::Shm))
            .unwrap();
        let mut inbox = Inbox::new();
        inbox.add_ring(dir.path(), "switch-input", 1 << 20).unwrap();
        let input = rt
            .block_on(Outbox::connect(
                &inbox.endpoint("127.0.0.1:1", "host"),
                TransportChoice::Shm,
            ))
            .unwrap();
        let exec = Exec::start(
            stage,
            0,
            HiddenDtype::F32,
            Links {
                inbox: inbox.reader(),
                outbox: Arc::new(Mutex::new(Some(outbox))),
                experts: Arc::new(Mutex::new(None)),
            },
            DeviceExperts { k: 0, every: 32 },
            None,
            Arc::new(ExecStats::default()),
        );
        Harness {
            input,
            _inbox: inbox,
            output,
            exec,
            model,
            cfg,
            next_id: 1,
            pos: 0,
            last: 0,
        }
    }

    /// Runs one step of slot 0 (the prompt first, then one token at a
    /// time) and returns the sampled token.
    fn step(&mut self, tokens: &[u32], start: bool) -> u32 {
        let n = tokens.len();
        let step = Step {
            id: self.next_id,
            tokens: tokens.to_vec(),
            positions: (self.pos..self.pos + n as i32).collect(),
            seqs: vec![0; n],
            logits: (0..n).map(|i| i + 1 == n).collect(),
            starts: if start {
                // Sampled with a seed: the sampler's random stream must
                // survive the switches too.
                vec![SeqStart {
                    slot: 0,
                    sampling: Some(omni_proto::worker::v1::Sampling {
                        temperature: 0.8,
                        top_k: 40,
                        seed: Some(99),
                        repeat_penalty: 1.1,
                        repeat_last_n: 32,
                        ..Default::default()
                    }),
                    ..Default::default()
                }]
            } else {
                Vec::new()
            },
            ..Default::default()
        };
        self.next_id += 1;
        self.pos += n as i32;
        self.input
            .send(Frame {
                meta: step.encode_to_vec(),
                payload: Vec::new(),
            })
            .unwrap();
        let f = self
            .output
            .reader()
            .recv(Duration::from_secs(60))
            .expect("the stage answers");
        let out = Step::decode(f.meta.as_slice()).unwrap();
        assert!(out.error.is_empty(), "{}", out.error);
        self.last = out.sampled[0].token;
        self.last
    }

    fn decode(&mut self, n: usize) -> Vec<u32> {
        (0..n).map(|_| self.step(&[self.last], false)).collect()
    }

    fn fresh_stage(&self, range: LayerRange) -> Stage {
        Stage::load(self.model.clone(), range, self.cfg.clone()).unwrap()
    }
}

const PROMPT: [u32; 6] = [2, 818, 5279, 529, 7001, 563];

#[test]
fn failed_rolled_back_and_committed_switches_keep_every_token() {
    // Without any switch.
    let mut plain = Harness::new();
    let mut want = vec![plain.step(&PROMPT, true)];
    want.extend(plain.decode(24));
    drop(plain);

    let mut h = Harness::new();
    let mut got = vec![h.step(&PROMPT, true)];
    got.extend(h.decode(6));
    // 1. A switch that cannot work (the incoming KV cache belongs to
    // another cell table) fails, and the stage goes on as it was.
    let foreign = omni_engine::KvLayers {
        cells: vec![Some(omni_engine::kv::KvCell::of(1, 0))],
        layers: Vec::new(),
    };
    let twin = h.fresh_stage(whole());
    let err = h
        .exec
        .switch(Some(twin), 0, vec![foreign], Vec::new(), None)
        .unwrap_err();
    assert!(err.contains("cell tables differ"), "{err}");
    assert_eq!(h.exec.finish(false).unwrap(), Some(whole()));
    got.extend(h.decode(6));
    // 2. A switch rolled back: the old stage runs again (the new one, run
    // alone, would want a hidden state instead of tokens).
    let half = h.fresh_stage(LayerRange {
        embed: false,
        layers: 9..18,
        head: true,
    });
    h.exec
        .switch(Some(half), 0, Vec::new(), Vec::new(), None)
        .unwrap();
    assert_eq!(h.exec.finish(false).unwrap(), Some(whole()));
    got.extend(h.decode(6));
    // 3. A committed switch: the new stage goes on with the copied cache.
    let twin = h.fresh_stage(whole());
    h.exec
        .switch(Some(twin), 0, Vec::new(), Vec::new(), None)
        .unwrap();
    let err = h
        .exec
        .switch(
            Some(h.fresh_stage(whole())),
            0,
            Vec::new(),
            Vec::new(),
            None,
        )
        .unwrap_err();
    assert!(err.contains("already pending"), "{err}");
    assert_eq!(h.exec.finish(true).unwrap(), Some(whole()));
    got.extend(h.decode(6));
    assert_eq!(got, want, "the tokens changed across the switches");
}
