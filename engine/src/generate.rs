//! In-process generation over a chain of stages: tokenizer in, sampled
//! tokens out. With several stages the hidden state goes through its
//! serialized form between them, exactly as it would between processes.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use crate::constraint::Grammars;
use crate::error::EngineError;
use crate::model::ModelFile;
use crate::prompt_cuts::PromptCuts;
use crate::sampling::{top_logprobs, Sampler, SamplingParams, StopMatcher};
use crate::stage::{
    Batch, Hidden, HiddenDtype, LayerRange, Logits, Stage, StageConfig, StageOutput,
};
use crate::tokenizer::{StreamDecoder, Tokenizer};

/// A model loaded as one or more stages in this process.
pub struct Engine {
    pub model: Arc<ModelFile>,
    pub tokenizer: Tokenizer,
    stages: Vec<Stage>,
    /// Wire format of the hidden state between stages.
    pub hidden_dtype: HiddenDtype,
    /// Bytes of hidden state moved between stages so far.
    pub hidden_bytes_moved: u64,
    /// The vocabulary as the grammar engine sees it, built at the first
    /// constrained request.
    grammars: Option<Grammars>,
    /// Every step batch-invariant (loaded with `StageConfig::deterministic`).
    invariant: bool,
    /// Where prompts are cut into steps (see [`PromptCuts`]).
    pub prompt_cuts: PromptCuts,
}

impl Engine {
    /// Loads `path` split into contiguous ranges of `split` layers each
    /// (`None`: the whole model as one stage).
    pub fn load(
        path: impl AsRef<Path>,
        split: Option<&[u32]>,
        cfg: StageConfig,
    ) -> Result<Engine, EngineError> {
        Self::load_with_progress(path, split, cfg, &mut |_, _, _| {})
    }

    /// As [`Engine::load`], reporting `(stage, done, total)` while weights are prepared.
    pub fn load_with_progress(
        path: impl AsRef<Path>,
        split: Option<&[u32]>,
        cfg: StageConfig,
        progress: &mut dyn FnMut(usize, usize, usize),
    ) -> Result<Engine, EngineError> {
        let devices = [cfg.device];
        Self::load_on_devices(path, split, cfg, &devices, progress)
    }

    /// As [`Engine::load_with_progress`], stage `i` on `devices[i]` (the
    /// last device again for the stages past the list): a GPU and CPU
    /// pipeline in one process.
    pub fn load_on_devices(
        path: impl AsRef<Path>,
        split: Option<&[u32]>,
        cfg: StageConfig,
        devices: &[crate::Device],
        progress: &mut dyn FnMut(usize, usize, usize),
    ) -> Result<Engine, EngineError> {
        let model = ModelFile::open(path.as_ref())?;
        let n_layer = model.hparams.n_layer;
        let ranges = match split {
            Some(s) => LayerRange::split(n_layer, s)?,
            None => vec![LayerRange::whole(n_layer)],
        };
        let tokenizer = Tokenizer::load(path.as_ref())?;
        let invariant = cfg.deterministic;
        let mut stages = Vec::with_capacity(ranges.len());
        for (i, r) in ranges.into_iter().enumerate() {
            let device = devices.get(i).or(devices.last()).copied();
            stages.push(Stage::load_with_progress(
                model.clone(),
                r,
                StageConfig {
                    device: device.unwrap_or(cfg.device),
                    ..cfg.clone()
                },
                &mut |d, t| progress(i, d, t),
            )?);
        }
        Ok(Engine {
            model,
            tokenizer,
            stages,
            hidden_dtype: HiddenDtype::F32,
            hidden_bytes_moved: 0,
            grammars: None,
            invariant,
            prompt_cuts: PromptCuts::default(),
        })
    }

    pub fn stages(&self) -> &[Stage] {
        &self.stages
    }

    /// Starts every stage's [`Stage::step_times`] afresh.
    pub fn reset_step_times(&mut self) {
        self.stages.iter_mut().for_each(Stage::reset_step_times);
    }

    pub fn n_ubatch(&self) -> usize {
        self.stages[0].config().n_ubatch
    }

    pub fn n_ctx(&self) -> usize {
        self.stages[0].config().kv.n_ctx
    }

    /// Runs one batch through every stage and returns the requested logits.
    /// With `StageConfig::deterministic`, every step is batch-invariant.
    pub fn step(&mut self, batch: &Batch) -> Result<Logits, EngineError> {
        let owned;
        let batch = if self.invariant && !batch.invariant {
            owned = Batch {
                invariant: true,
                ..batch.clone()
            };
            &owned
        } else {
            batch
        };
        let mut hidden: Option<Hidden> = None;
        for stage in &mut self.stages {
            match stage.forward(batch, hidden.as_ref())? {
                StageOutput::Hidden(h) => {
                    let wire = h.to_bytes(self.hidden_dtype);
                    self.hidden_bytes_moved += wire.len() as u64;
                    hidden = Some(Hidden::from_bytes(&wire)?);
                }
                StageOutput::Logits(l) => return Ok(l),
            }
        }
        Err(EngineError::Config(
            "the last stage does not run the head".into(),
        ))
    }

    /// Frees sequence `seq` on every stage.
    pub fn remove_seq(&mut self, seq: u32) {
        for s in &mut self.stages {
            s.remove_seq(seq, None);
        }
    }

    /// Feeds `tokens` of sequence `seq` from position `start` in chunks of
    /// `n_ubatch`, cut as [`Self::prompt_cuts`] says, and returns the logits
    /// after the last one.
    pub fn prefill(
        &mut self,
        seq: u32,
        tokens: &[u32],
        start: usize,
    ) -> Result<Vec<f32>, EngineError> {
        if tokens.is_empty() {
            return Err(EngineError::Config("cannot prefill an empty prompt".into()));
        }
        let mut last = Vec::new();
        let cuts = self.prompt_cuts.for_model(&self.model.hparams);
        let pieces = cuts.pieces(tokens.len(), self.n_ubatch());
        let mut fed = 0;
        for n in pieces {
            let mut b = Batch::default();
            for (i, &t) in tokens[fed..fed + n].iter().enumerate() {
                b.push(
                    t,
                    (start + fed + i) as i32,
                    seq,
                    fed + i + 1 == tokens.len(),
                );
            }
            let l = self.step(&b)?;
            if let Some(row) = l.for_batch_index(n - 1) {
                last = row.to_vec();
            }
            fed += n;
        }
        Ok(last)
    }

    /// Logits at every position of `tokens` (teacher forcing), in chunks of n_ubatch.
    pub fn logits_all(&mut self, seq: u32, tokens: &[u32]) -> Result<Vec<Vec<f32>>, EngineError> {
        let mut out = Vec::with_capacity(tokens.len());
        let chunk = self.n_ubatch();
        for (c, part) in tokens.chunks(chunk).enumerate() {
            let mut b = Batch::default();
            for (i, &t) in part.iter().enumerate() {
                b.push(t, (c * chunk + i) as i32, seq, true);
            }
            let l = self.step(&b)?;
            out.extend((0..part.len()).map(|i| l.row(i).to_vec()));
        }
        Ok(out)
    }

    /// Tokenizes a prompt the way llama.cpp's tools do (BOS when the model asks for it).
    pub fn tokenize_prompt(
        &self,
        text: &str,
        parse_special: bool,
    ) -> Result<Vec<u32>, EngineError> {
        self.tokenizer.encode(text, true, parse_special)
    }

    /// Generates up to `opts.max_tokens` tokens after `prompt` as sequence 0.
    /// `on_text` receives text as soon as it is complete and safe to show.
    pub fn generate(
        &mut self,
        prompt: &[u32],
        opts: &GenerateOptions,
        on_text: &mut dyn FnMut(&str),
    ) -> Result<Generation, EngineError> {
        opts.sampling
            .validate(self.model.hparams.n_vocab as usize)?;
        let needed = prompt.len() + opts.max_tokens;
        if needed > self.n_ctx() {
            return Err(EngineError::ContextFull {
                pos: needed,
                n_ctx: self.n_ctx(),
            });
        }
        let mut constraint = match &opts.sampling.grammar {
            Some(g) => {
                if self.grammars.is_none() {
                    self.grammars = Some(Grammars::new(&self.tokenizer)?);
                }
                Some(self.grammars.as_ref().expect("built above").compile(g)?)
            }
            None => None,
        };
        let seq = 0;
        self.remove_seq(seq);
        let mut sampler = Sampler::new(opts.sampling.clone());
        let mut stops = StopMatcher::new(opts.stop.clone());
        let mut decoder = StreamDecoder::default();
        let mut history: Vec<u32> = prompt.to_vec();
        let mut gen = Generation {
            prompt_ids: prompt.to_vec(),
            ..Generation::default()
        };

        let t0 = Instant::now();
        let mut logits = self.prefill(seq, prompt, 0)?;
        gen.timings.prompt_ms = t0.elapsed().as_secs_f64() * 1e3;
        let t1 = Instant::now();
        gen.finish_reason = FinishReason::Length;
        for i in 0..opts.max_tokens {
            let id = match &mut constraint {
                Some(c) => {
                    c.mask(&mut logits)?;
                    let id = sampler.sample(&logits, &history);
                    c.accept(id)?;
                    id
                }
                None => sampler.sample(&logits, &history),
            };
            // A full-vocabulary softmax per step: only when asked for.
            let (logprob, top) = if opts.top_logprobs > 0 {
                (
                    Some(crate::sampling::logprob_of(&logits, id)),
                    top_logprobs(&logits, opts.top_logprobs),
                )
            } else {
                (None, Vec::new())
            };
            gen.steps.push(Step { id, logprob, top });
            gen.ids.push(id);
            history.push(id);
            let eog = self.tokenizer.is_eog(id);
            if eog && opts.stop_at_eog {
                gen.finish_reason = FinishReason::Stop;
                break;
            }
            let text = decoder.push(&self.tokenizer.piece(id));
            let out = stops.push(&text);
            if !out.text.is_empty() {
                on_text(&out.text);
                gen.text.push_str(&out.text);
            }
            if out.stopped {
                gen.finish_reason = FinishReason::Stop;
                break;
            }
            if i + 1 < opts.max_tokens {
                let mut b = Batch::default();
                b.push(id, (prompt.len() + i) as i32, seq, true);
                logits = self.step(&b)?.row(0).to_vec();
            }
        }
        if gen.finish_reason == FinishReason::Length {
            let rest = stops.push(&decoder.finish());
            let tail = rest.text + &stops.finish();
            on_text(&tail);
            gen.text.push_str(&tail);
        }
        gen.timings.gen_ms = t1.elapsed().as_secs_f64() * 1e3;
        gen.timings.prompt_tokens = prompt.len();
        gen.timings.gen_tokens = gen.ids.len();
        self.remove_seq(seq);
        Ok(gen)
    }
}

#[derive(Clone, Debug)]
pub struct GenerateOptions {
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Stop at an end-of-generation token (llama.cpp's references do not).
    pub stop_at_eog: bool,
    pub stop: Vec<String>,
    /// How many alternatives to report per token (0: none).
    pub top_logprobs: usize,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        GenerateOptions {
            max_tokens: 64,
            sampling: SamplingParams::default(),
            stop_at_eog: true,
            stop: Vec::new(),
            top_logprobs: 0,
        }
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum FinishReason {
    #[default]
    Length,
    Stop,
}

#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Step {
    pub id: u32,
    /// Log-probability of the chosen token (when logprobs were requested).
    pub logprob: Option<f32>,
    pub top: Vec<(u32, f32)>,
}

#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Timings {
    pub prompt_tokens: usize,
    pub prompt_ms: f64,
    pub gen_tokens: usize,
    pub gen_ms: f64,
}

impl Timings {
    pub fn prompt_tok_s(&self) -> f64 {
        self.prompt_tokens as f64 / (self.prompt_ms / 1e3).max(1e-9)
    }
    pub fn gen_tok_s(&self) -> f64 {
        self.gen_tokens as f64 / (self.gen_ms / 1e3).max(1e-9)
    }
}

#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Generation {
    pub prompt_ids: Vec<u32>,
    pub ids: Vec<u32>,
    pub text: String,
    pub finish_reason: FinishReason,
    pub steps: Vec<Step>,
    pub timings: Timings,
}
