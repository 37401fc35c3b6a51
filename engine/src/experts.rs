//! Routed experts run apart from the rest of their layers.
//!
//! DeepSeek-size models keep most of their weights in the routed experts
//! (`ffn_{gate,up,down}_exps`). A [`Stage`](crate::Stage) can leave some
//! layers' experts out (`Stage::load_offloaded`) and hand each such block's
//! input, selected ids and weights to an [`ExpertExec`] while it computes
//! the shared experts itself (and the routed experts it keeps after all:
//! `Stage::set_device_experts`). [`ExpertStage`] holds the experts of chosen
//! layers and computes them with the same ggml nodes, in the same order,
//! as the in-graph block, so the result is bit-identical; it is also the
//! in-process [`ExpertExec`].

use std::sync::Arc;

use crate::error::EngineError;
use crate::ffi::ggml::{self, CpuBackend, Ctx, GraphAllocator, OwnedGraph, TYPE_F32, TYPE_I32};
use crate::model::layers::Activation;
use crate::model::moe::{moe_experts, Routing};
use crate::model::{ModelFile, WeightOp};
use crate::stage::Weights;

/// One offloaded expert block's work for one step: `n_tokens` tokens of
/// layer `layer`. All three are column-major over tokens, as ggml lays them
/// out: `x` is `[n_tokens][n_embd]` (the block's normed input), `ids` and
/// `weights` are `[n_tokens][n_used]` (the selected experts, best first,
/// and the weights their outputs are multiplied by: after renormalisation
/// and scale).
///
/// When the stage keeps some of the layer's experts itself
/// (`Stage::set_device_experts`), the batch holds only the tokens that
/// selected an expert elsewhere, and only those selections: `ids` and
/// `weights` are then `[n_tokens][k]`, `k` (1 to `n_used`) the most any of
/// these tokens has, a token with fewer filled up with other experts of
/// the batch at weight 0 (ids stay distinct within a token, as ggml's
/// repacked kernels need).
#[derive(Clone, Debug, PartialEq)]
pub struct ExpertBatch {
    pub layer: u32,
    pub n_tokens: usize,
    pub x: Vec<f32>,
    pub ids: Vec<i32>,
    pub weights: Vec<f32>,
    /// Compute with batch-invariant kernels (the step's `Batch::invariant`).
    pub invariant: bool,
}

/// Something that computes routed experts, submit then wait, so that a
/// remote one can work while the stage computes the shared experts.
///
/// A stage calls `submit` once, then `wait` once, for each offloaded block
/// that has work here, in layer order (a block whose selected experts the
/// stage all keeps itself, `Stage::set_device_experts`, is not sent); `wait`
/// returns the weighted sum of the selected experts, `[n_tokens][n_embd]`.
/// An overlapped step (`StageConfig::expert_overlap`) keeps up to
/// [`MAX_OUTSTANDING`] calls submitted, one per micro-batch group; `wait`
/// answers them in the order they were submitted.
pub trait ExpertExec {
    fn submit(&mut self, batch: ExpertBatch) -> Result<(), EngineError>;
    fn wait(&mut self) -> Result<Vec<f32>, EngineError>;
    /// Whether `layer`'s experts are computed on this host's cores (in
    /// this process, or by an expert worker over shared memory): a CPU
    /// stage computing at the same time would take cores from it
    /// (`StageConfig::shared_overlap`).
    fn on_this_host(&self, _layer: u32) -> bool {
        true
    }
}

/// The most calls an executor holds submitted and not yet waited for.
pub const MAX_OUTSTANDING: usize = 2;

/// Settings of an [`ExpertStage`].
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ExpertConfig {
    /// Most tokens in one call (the stages' `n_ubatch`).
    pub n_ubatch: usize,
    pub n_threads: usize,
    /// Re-lay the expert weights for the CPU's fastest `mul_mat_id` kernels
    /// where llama.cpp's loader would.
    pub repack: bool,
}

impl Default for ExpertConfig {
    fn default() -> Self {
        ExpertConfig {
            n_ubatch: 512,
            n_threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
            repack: true,
        }
    }
}

/// The routed experts of some layers of a model, ready to compute.
pub struct ExpertStage {
    model: Arc<ModelFile>,
    layers: Vec<u32>,
    cfg: ExpertConfig,
    weights: Weights,
    backend: CpuBackend,
    alloc: GraphAllocator,
    /// The results of `submit`s, until `wait` takes them, in order.
    pending: std::collections::VecDeque<Result<Vec<f32>, EngineError>>,
    /// How long the last `run` took to build and allocate its graph.
    graph_time: std::time::Duration,
    /// Graphs built and allocated, by layer, tokens and experts per token,
    /// with the compute buffer's size when each was allocated: a call of
    /// the same shape computes the same graph again (a decode step's calls
    /// come round layer after layer). A buffer of another size was
    /// reallocated, and the graphs allocated in the old one are dropped.
    graphs: std::collections::HashMap<(u32, usize, usize), (OwnedGraph, usize)>,
}

/// Most graphs an [`ExpertStage`] keeps before it starts again: a few call
/// sizes for each of many layers, each graph a few tens of KB.
const KEPT_GRAPHS: usize = 1024;

impl ExpertStage {
    /// Maps (and repacks where llama.cpp would) the routed-expert tensors
    /// of `layers` and sizes the compute buffer for `n_ubatch` tokens.
    pub fn load(
        model: Arc<ModelFile>,
        layers: &[u32],
        cfg: ExpertConfig,
    ) -> Result<ExpertStage, EngineError> {
        if cfg.n_ubatch == 0 {
            return Err(EngineError::Config("n_ubatch must be at least 1".into()));
        }
        let mut layers = layers.to_vec();
        layers.sort_unstable();
        layers.dedup();
        if layers.is_empty() {
            return Err(EngineError::Config(
                "an expert stage needs at least one layer".into(),
            ));
        }
        let mut wanted = Vec::new();
        for &il in &layers {
            let specs = expert_layer_tensors(&model, il)?;
            wanted.extend(
                specs
                    .into_iter()
                    .map(|name| (format!("blk.{il}.{name}"), WeightOp::MulMatId)),
            );
        }
        let weights = Weights::load_named(
            &model,
            &wanted,
            &[],
            crate::stage::Repack::all(cfg.repack),
            None,
            &mut |_, _| {},
        )?;
        let backend = CpuBackend::new(cfg.n_threads).map_err(EngineError::CpuBackend)?;
        let alloc = GraphAllocator::new(backend.buffer_type());
        let mut stage = ExpertStage {
            model,
            layers,
            cfg,
            weights,
            backend,
            alloc,
            pending: Default::default(),
            graph_time: Default::default(),
            graphs: Default::default(),
        };
        // Layers may differ in expert types (Q4_K_M mixes them): size for each.
        let n = stage.cfg.n_ubatch;
        let n_used = hp_n_used(&stage.model);
        for &il in &stage.layers.clone() {
            let ctx = Ctx::for_graph(graph_nodes(n_used));
            let graph = build(&stage.model, &stage.weights, &ctx, il, n, n_used);
            stage
                .alloc
                .reserve(&graph.0)
                .map_err(|e| EngineError::OutOfMemory {
                    what: format!("expert compute buffer: {e}"),
                    bytes: 0,
                })?;
        }
        Ok(stage)
    }

    /// The layers whose experts this stage holds, ascending.
    pub fn layers(&self) -> &[u32] {
        &self.layers
    }
    pub fn model(&self) -> &Arc<ModelFile> {
        &self.model
    }
    pub fn config(&self) -> &ExpertConfig {
        &self.cfg
    }
    pub fn weights(&self) -> &Weights {
        &self.weights
    }
    /// Bytes of expert weights held (mapped and repacked).
    pub fn weight_bytes(&self) -> u64 {
        self.weights.mapped_bytes + self.weights.repacked_bytes
    }
    /// Bytes of the compute buffer (sized for `n_ubatch` tokens).
    pub fn compute_bytes(&self) -> usize {
        self.alloc.buffer_size()
    }
    /// How long the last [`ExpertStage::run`] spent building and
    /// allocating its graph (the rest of it is ggml computing).
    pub fn graph_time(&self) -> std::time::Duration {
        self.graph_time
    }

    /// The weighted sum of the selected experts' SiLU-gated FFNs of layer
    /// `layer` on `x` (`[n_tokens][n_embd]`), with `ids` and `weights`
    /// `[n_tokens][k]` (`k` usually `n_used`, at most that): `[n_tokens][n_embd]`.
    /// Computes the next calls with batch-invariant kernels (`on`: a
    /// token's result does not depend on the others in the call), or the
    /// fastest ones.
    pub fn set_batch_invariant(&mut self, on: bool) {
        self.backend.set_batch_invariant(on)
    }

    pub fn run(
        &mut self,
        layer: u32,
        x: &[f32],
        ids: &[i32],
        weights: &[f32],
    ) -> Result<Vec<f32>, EngineError> {
        let hp = &self.model.hparams;
        let moe = hp
            .moe
            .as_ref()
            .expect("an expert stage's model has experts");
        let bad = |why: String| Err(EngineError::Experts(why));
        if !self.layers.contains(&layer) {
            return bad(format!(
                "layer {layer}'s experts are not here (this expert stage holds layers {:?})",
                self.layers
            ));
        }
        let (e, n_used) = (hp.n_embd as usize, moe.n_expert_used as usize);
        if x.is_empty() || !x.len().is_multiple_of(e) {
            return bad(format!(
                "input of {} values is not a whole number of {e}-wide tokens",
                x.len()
            ));
        }
        let n = x.len() / e;
        if n > self.cfg.n_ubatch {
            return bad(format!(
                "{n} tokens exceed this expert stage's n_ubatch {}",
                self.cfg.n_ubatch
            ));
        }
        // Fewer than n_used per token is a batch the stage cut down
        // (some experts are kept on the stage), the same number for each.
        let k = ids.len() / n;
        if ids.len() != weights.len() || k == 0 || k > n_used || k * n != ids.len() {
            return bad(format!(
                "{n} tokens with {n_used} experts each need {} ids and weights, got {} ids and {} weights (a batch may also give every token the same smaller number)",
                n * n_used,
                ids.len(),
                weights.len()
            ));
        }
        if let Some(&id) = ids.iter().find(|&&id| id < 0 || id as u32 >= moe.n_expert) {
            return bad(format!(
                "expert id {id} is outside the layer's {} experts",
                moe.n_expert
            ));
        }
        let t = std::time::Instant::now();
        let key = (layer, n, k);
        let size = self.alloc.buffer_size();
        if !matches!(self.graphs.get(&key), Some((_, s)) if *s == size) {
            if self.graphs.len() >= KEPT_GRAPHS {
                self.graphs.clear();
            }
            let (model, weights) = (&self.model, &self.weights);
            let g = OwnedGraph::build(Ctx::for_graph(graph_nodes(n_used)), |ctx| {
                build(model, weights, ctx, layer, n, k)
            });
            self.alloc.alloc(&g.graph()).map_err(EngineError::Ggml)?;
            let size = self.alloc.buffer_size();
            self.graphs.retain(|_, (_, s)| *s == size);
            self.graphs.insert(key, (g, size));
        }
        let g = &self.graphs[&key].0;
        self.graph_time = t.elapsed();
        let set = |name: &str, f: &dyn Fn(ggml::Tensor<'_>)| {
            if let Some(t) = g.ctx().get_tensor(name) {
                f(t)
            }
        };
        set("inp_x", &|t| t.write(x));
        set("inp_ids", &|t| t.write(ids));
        set("inp_weights", &|t| t.write(weights));
        self.backend
            .compute(&g.graph())
            .map_err(EngineError::Ggml)?;
        let mut data = Vec::new();
        g.out().read_f32(&mut data);
        Ok(data)
    }
}

/// Room for one call's graph: the three matmuls and what joins them, and
/// a view and an add per used expert, with margin.
fn graph_nodes(n_used: usize) -> usize {
    64 + 4 * n_used
}

/// The graph of one call: inputs `inp_x`, `inp_ids`, `inp_weights`.
fn build<'g>(
    model: &ModelFile,
    store: &Weights,
    ctx: &'g Ctx,
    il: u32,
    n_tokens: usize,
    n_used: usize,
) -> (ggml::Graph<'g>, ggml::Tensor<'g>) {
    let e = model.hparams.n_embd as i64;
    let (nt, nu) = (n_tokens as i64, n_used as i64);
    let mut graph = ctx.new_graph();
    let x = ctx.input(TYPE_F32, &[e, nt], "inp_x");
    let selected = ctx.input(TYPE_I32, &[nu, nt], "inp_ids");
    let weights = ctx.input(TYPE_F32, &[1, nu, nt], "inp_weights");
    let w = |name: &str| {
        store
            .layer(il, name)
            .expect("expert tensors loaded for every held layer")
    };
    // Every supported MoE architecture gates its experts with SiLU.
    let out = moe_experts(
        ctx,
        &mut graph,
        x,
        &Routing { selected, weights },
        [
            w("ffn_up_exps.weight"),
            w("ffn_gate_exps.weight"),
            w("ffn_down_exps.weight"),
        ],
        Activation::Silu,
        true,
    );
    out.set_output();
    graph.expand(out);
    (graph, out)
}

impl ExpertExec for ExpertStage {
    /// Computes at once (in process there is nothing to overlap with).
    fn submit(&mut self, b: ExpertBatch) -> Result<(), EngineError> {
        if self.pending.len() >= MAX_OUTSTANDING {
            return Err(EngineError::Experts(format!(
                "submit with {MAX_OUTSTANDING} batches not yet waited for"
            )));
        }
        let n_embd = self.model.hparams.n_embd as usize;
        if b.x.len() != b.n_tokens * n_embd {
            return Err(EngineError::Experts(format!(
                "{} tokens of width {n_embd} need {} values, got {}",
                b.n_tokens,
                b.n_tokens * n_embd,
                b.x.len()
            )));
        }
        self.set_batch_invariant(b.invariant);
        let r = self.run(b.layer, &b.x, &b.ids, &b.weights);
        self.pending.push_back(r);
        Ok(())
    }

    fn wait(&mut self) -> Result<Vec<f32>, EngineError> {
        self.pending.pop_front().unwrap_or_else(|| {
            Err(EngineError::Experts(
                "wait without a submitted batch".into(),
            ))
        })
    }
}

fn hp_n_used(model: &ModelFile) -> usize {
    model
        .hparams
        .moe
        .as_ref()
        .map_or(1, |m| m.n_expert_used as usize)
}

/// The routed-expert tensor names (after `blk.N.`) of layer `il`, or an
/// error naming the layer if it has none.
pub fn expert_layer_tensors(model: &ModelFile, il: u32) -> Result<Vec<&'static str>, EngineError> {
    let hp = &model.hparams;
    if il >= hp.n_layer {
        return Err(EngineError::Config(format!(
            "layer {il} is outside the model's layers 0-{}",
            hp.n_layer.saturating_sub(1)
        )));
    }
    let specs = hp.arch.expert_tensors(hp, il);
    if specs.is_empty() {
        return Err(EngineError::Config(format!(
            "layer {il} of this {} model has no routed experts to offload",
            hp.arch.name()
        )));
    }
    Ok(specs.into_iter().map(|s| s.name).collect())
}
