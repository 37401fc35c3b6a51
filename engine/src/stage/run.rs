//! Running a step: [`Stage::forward`] builds the step's graph segments,
//! computes them, and between segments hands offloaded experts their work.

use super::device_experts::{split_work, SplitWork};
use super::graph::GraphParts;
use super::graph::SegmentOut;
use super::handover::Carry;
use super::wire::Batch;
use super::wire::Hidden;
use super::wire::Logits;
use super::Stage;
use super::StageOutput;
use crate::error::EngineError;
use crate::experts::ExpertBatch;
use crate::experts::ExpertExec;
use crate::ffi::ggml::Executor;
use crate::ffi::ggml::Graph;
use crate::ffi::ggml::Tensor;
use std::sync::Arc;
use std::time::Instant;

impl Stage {
    /// Runs one step. `input` is the previous stage's hidden state (absent
    /// on the stage that runs the embedding). Returns the hidden state for
    /// the next stage, or the logits of the tokens that asked for them.
    ///
    /// A stage with offloaded experts needs [`Stage::forward_with`].
    pub fn forward(
        &mut self,
        batch: &Batch,
        input: Option<&Hidden>,
    ) -> Result<StageOutput, EngineError> {
        if !self.offloaded.is_empty() {
            return Err(EngineError::Config(format!(
                "the routed experts of layers {:?} are not in this stage: run it with an expert executor (forward_with)",
                self.offloaded
            )));
        }
        self.forward_inner(batch, input, None)
    }

    /// As [`Stage::forward`], with the routed experts of the offloaded
    /// layers computed by `experts`. The step runs as one graph per
    /// segment between offloaded blocks; at each block it submits the
    /// block's input, ids and weights, computes the shared experts, waits
    /// for the routed result and goes on. Without offloaded layers this is
    /// `forward` and `experts` is never called.
    ///
    /// A block with experts kept here (`set_device_experts`) computes them
    /// beside the shared experts and submits only the tokens that selected
    /// an expert elsewhere, with only those selections (see
    /// [`ExpertBatch`]); when no token did, the executor is not called for
    /// that block. Weight-0 stand-ins add exactly 0, so this changes only
    /// the order of the sum.
    pub fn forward_with(
        &mut self,
        batch: &Batch,
        input: Option<&Hidden>,
        experts: &mut dyn ExpertExec,
    ) -> Result<StageOutput, EngineError> {
        self.forward_inner(batch, input, Some(experts))
    }

    pub(super) fn forward_inner(
        &mut self,
        batch: &Batch,
        input: Option<&Hidden>,
        experts: Option<&mut dyn ExpertExec>,
    ) -> Result<StageOutput, EngineError> {
        let hp = &self.model.hparams;
        batch.validate(self.range.embed)?;
        if batch.invariant && !self.cfg.deterministic {
            return Err(EngineError::Config(
                "a batch-invariant step needs a stage loaded for it (deterministic): this one repacked its weights, whose kernel computes a row differently inside a batch".into(),
            ));
        }
        let n = batch.len();
        if n > self.cfg.n_ubatch {
            return Err(EngineError::Config(format!(
                "batch of {n} tokens exceeds n_ubatch {}",
                self.cfg.n_ubatch
            )));
        }
        if self.range.embed {
            if let Some(&bad) = batch.tokens.iter().find(|&&t| t >= hp.n_vocab) {
                return Err(EngineError::Config(format!(
                    "token id {bad} is outside the vocabulary of {} tokens",
                    hp.n_vocab
                )));
            }
        } else {
            let h = input.ok_or_else(|| {
                EngineError::Config("this stage needs the previous stage's hidden state".into())
            })?;
            if h.n_tokens != n || h.n_embd != hp.n_embd as usize || h.data.len() != n * h.n_embd {
                return Err(EngineError::BadHidden(format!(
                    "hidden state is {} x {} but the step has {n} tokens of width {}",
                    h.n_tokens, h.n_embd, hp.n_embd
                )));
            }
        }
        let has_layers = !self.range.layers.is_empty();
        let kv_idx = match (has_layers, batch.cells.is_empty()) {
            (false, _) => Vec::new(),
            (true, true) => self.kv.allocate(&batch.seq, &batch.pos)?,
            (true, false) => {
                self.kv.place(&batch.seq, &batch.pos, &batch.cells)?;
                batch.cells.clone()
            }
        };
        self.last_cells.clone_from(&kv_idx);
        let result = self.run(batch, input, &kv_idx, experts);
        if result.is_err() && has_layers {
            self.kv.release(&kv_idx);
        }
        result
    }

    /// Runs a step whose cells are placed (`kv_idx`): as one group, or,
    /// for a stage with offloaded experts and `StageConfig::expert_overlap`,
    /// as two micro-batch groups (sequences never split) interleaved so
    /// that the stage computes one group's segments while the executor
    /// computes the other's experts.
    pub(super) fn run(
        &mut self,
        batch: &Batch,
        input: Option<&Hidden>,
        kv_idx: &[i64],
        mut experts: Option<&mut dyn ExpertExec>,
    ) -> Result<StageOutput, EngineError> {
        self.exec.set_batch_invariant(batch.invariant);
        let here = self.experts_here(batch.len());
        let split =
            (self.cfg.expert_overlap && experts.is_some() && !self.offloaded.is_empty() && !here)
                .then(|| group_split(&batch.seq))
                .flatten();
        let Some(m) = split else {
            if let (true, Some(rule)) = (here, self.local.as_mut()) {
                rule.steps += 1;
            }
            let mut r = self.begin(batch, input, kv_idx, here, true);
            let out = self.drive(&mut r, experts.as_deref_mut());
            self.end(r);
            return out;
        };
        self.overlapped_steps += 1;
        let (a, b) = (batch.range(0..m), batch.range(m..batch.len()));
        let e = self.model.hparams.n_embd as usize;
        let inputs = input.map(|h| (h.rows(0..m, e), h.rows(m..h.n_tokens, e)));
        // A head range's groups stop before the head: it runs once, below.
        let groups_head = !self.range.head;
        let mut runs = [
            self.begin(
                &a,
                inputs.as_ref().map(|i| &i.0),
                &kv_idx[..m],
                false,
                groups_head,
            ),
            self.begin(
                &b,
                inputs.as_ref().map(|i| &i.1),
                &kv_idx[m..],
                false,
                groups_head,
            ),
        ];
        let result = self.interleave(&mut runs, experts);
        // Each group's rows of the batch (logits wanted, or its stand-in row).
        let rows = runs
            .each_mut()
            .map(|r| (std::mem::take(&mut r.out_rows), r.no_logits));
        let [ra, rb] = runs;
        self.end(ra);
        self.end(rb);
        let [oa, ob] = result?;
        let out = merge(oa, ob, m)?;
        if groups_head {
            return Ok(out);
        }
        let StageOutput::Hidden(hidden) = out else {
            return Err(EngineError::Experts(
                "an overlapped step's groups gave logits before the head".into(),
            ));
        };
        self.head_of(batch, &hidden, rows, m)
    }

    /// Runs a group's segments to its output, waiting for each cut block's
    /// experts in turn.
    fn drive<'x>(
        &mut self,
        r: &mut GroupRun,
        mut experts: Option<&mut (dyn ExpertExec + 'x)>,
    ) -> Result<StageOutput, EngineError> {
        loop {
            match self.advance(r, experts.as_deref_mut())? {
                Progress::Done(o) => return Ok(o),
                Progress::Cut(p) => r.carry = Some(self.finish(p, experts.as_deref_mut())?),
            }
        }
    }

    /// The head of an overlapped step, for both groups' hidden rows (group
    /// `a`'s rows, then `b`'s, which start at batch row `m`): the logits of
    /// the rows wanted, as the whole batch's step gives them.
    fn head_of(
        &mut self,
        batch: &Batch,
        hidden: &Hidden,
        [(rows_a, none_a), (rows_b, none_b)]: [(Vec<usize>, bool); 2],
        m: usize,
    ) -> Result<StageOutput, EngineError> {
        let k = hidden.n_tokens;
        let mut r = GroupRun {
            batch,
            n_tokens: k,
            input: Some(hidden),
            kv_idx: &[],
            out_rows: (0..k).collect(),
            no_logits: false,
            n_kv: self.kv.n_kv(),
            in_order: None,
            mask: Vec::new(),
            mask_swa: Vec::new(),
            order: Vec::new(),
            segments: vec![self.head_segment()].into_iter(),
            carry: None,
        };
        let StageOutput::Logits(mut logits) = self.drive(&mut r, None)? else {
            unreachable!("the head segment ends with the head")
        };
        // Drop a group's stand-in row (it wanted no logits).
        let keep: Vec<(usize, bool)> = rows_a
            .iter()
            .map(|&i| (i, !none_a))
            .chain(rows_b.iter().map(|&i| (i + m, !none_b)))
            .collect();
        let v = logits.n_vocab;
        logits.rows.clear();
        let mut data = Vec::with_capacity(logits.data.len());
        for (j, &(row, wanted)) in keep.iter().enumerate() {
            if wanted {
                logits.rows.push(row);
                data.extend_from_slice(&logits.data[j * v..(j + 1) * v]);
            }
        }
        logits.data = data;
        Ok(StageOutput::Logits(logits))
    }

    /// Two groups' steps, interleaved: each group's segment runs while the
    /// executor computes the other's last submitted block (its calls are
    /// answered in order: A, B, A, B, ...). On an error the calls still
    /// outstanding are waited for, so the executor is left with nothing.
    fn interleave<'x>(
        &mut self,
        runs: &mut [GroupRun; 2],
        mut experts: Option<&mut (dyn ExpertExec + 'x)>,
    ) -> Result<[StageOutput; 2], EngineError> {
        let mut done: [Option<StageOutput>; 2] = [None, None];
        let mut pending: [Option<PendingCut>; 2] = [None, None];
        let mut result = Ok(());
        for g in 0..2 {
            match self.advance(&mut runs[g], experts.as_deref_mut()) {
                Ok(Progress::Done(o)) => done[g] = Some(o),
                Ok(Progress::Cut(p)) => pending[g] = Some(p),
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
        }
        while result.is_ok() && pending.iter().any(Option::is_some) {
            for g in 0..2 {
                let Some(p) = pending[g].take() else { continue };
                let step = self.finish(p, experts.as_deref_mut()).and_then(|c| {
                    runs[g].carry = Some(c);
                    self.advance(&mut runs[g], experts.as_deref_mut())
                });
                match step {
                    Ok(Progress::Done(o)) => done[g] = Some(o),
                    Ok(Progress::Cut(p)) => pending[g] = Some(p),
                    Err(e) => {
                        result = Err(e);
                        break;
                    }
                }
            }
        }
        if let Err(e) = result {
            for p in pending.into_iter().flatten() {
                if p.remote.is_some() {
                    if let Some(x) = experts.as_deref_mut() {
                        let _ = x.wait();
                    }
                }
            }
            return Err(e);
        }
        match done {
            [Some(a), Some(b)] => Ok([a, b]),
            _ => Err(EngineError::Experts(
                "an overlapped step ended without both groups' output".into(),
            )),
        }
    }

    /// A group's step, ready for its first segment: which rows it outputs
    /// and its attention masks (the stage's reused scratch for the first
    /// group; [`Stage::end`] gives it back). With `experts_here` the step
    /// computes its routed experts itself, as one graph; without `head` a
    /// head range's step ends with the hidden rows of its logits (their
    /// head computed apart: [`Stage::head_of`]).
    fn begin<'b>(
        &mut self,
        batch: &'b Batch,
        input: Option<&'b Hidden>,
        kv_idx: &'b [i64],
        experts_here: bool,
        head: bool,
    ) -> GroupRun<'b> {
        let hp = &self.model.hparams;
        let n = batch.len();
        let mut out_rows: Vec<usize> = if self.range.head {
            (0..n).filter(|&i| batch.logits[i]).collect()
        } else {
            (0..n).collect()
        };
        // A head step that wants no logits (a prompt chunk, or a replayed
        // prefix, alone in its step) still computes one row: a graph whose
        // last layer keeps no rows runs ops on empty tensors, and ggml
        // divides by their row counts (SIGFPE). The row is not returned.
        let no_logits = out_rows.is_empty();
        if no_logits {
            out_rows.push(n - 1);
        }
        let n_kv = self.kv.n_kv();
        let has_layers = !self.range.layers.is_empty();
        let (mut mask, mut mask_swa, mut order) = (
            std::mem::take(&mut self.mask),
            std::mem::take(&mut self.mask_swa),
            std::mem::take(&mut self.order),
        );
        let in_order = (batch.invariant && has_layers).then(|| {
            let window = hp.swa.as_ref().map(|s| s.window);
            self.kv.order(&batch.seq, &batch.pos, window, &mut order);
            order.len()
        });
        if has_layers && in_order.is_none() {
            self.kv.mask(&batch.seq, &batch.pos, n_kv, None, &mut mask);
            if let Some(swa) = &hp.swa {
                self.kv.mask(
                    &batch.seq,
                    &batch.pos,
                    n_kv,
                    Some(swa.window),
                    &mut mask_swa,
                );
            }
        }
        let mut segments = self.segments(n, experts_here);
        if let Some(last) = segments.last_mut() {
            last.head &= head;
        }
        GroupRun {
            batch,
            n_tokens: n,
            input,
            kv_idx,
            out_rows,
            no_logits,
            n_kv,
            in_order,
            mask,
            mask_swa,
            order,
            // Without offloaded layers: one segment, the whole range's graph.
            segments: segments.into_iter(),
            carry: None,
        }
    }

    /// Keeps a finished group's scratch for the next step.
    fn end(&mut self, r: GroupRun) {
        if r.mask.capacity() > self.mask.capacity() {
            self.mask = r.mask;
            self.mask_swa = r.mask_swa;
            self.order = r.order;
        }
    }

    /// Runs a group's next segment: the step's output, or a cut block
    /// whose routed experts are now with the executor.
    fn advance<'x>(
        &mut self,
        r: &mut GroupRun,
        experts: Option<&mut (dyn ExpertExec + 'x)>,
    ) -> Result<Progress, EngineError> {
        let model = Arc::clone(&self.model);
        let hp = &model.hparams;
        let batch = r.batch;
        let n = r.n_tokens;
        let Some(mut seg) = r.segments.next() else {
            unreachable!("the last segment ends the range")
        };
        if let (Some(res), Some(c)) = (seg.resume.as_mut(), r.carry.as_ref()) {
            res.n_tokens = c.n_tokens;
            res.side = c.shared.is_some();
        }
        let t0 = Instant::now();
        // A step of one segment (no offloaded experts) with the last step's
        // shape computes the last step's graph again, as llama.cpp does:
        // what a decode step changes is in its inputs. The shape: tokens,
        // cells attended, rows out, and a batch-invariant step's order list.
        let shape = [n, r.n_kv, r.out_rows.len(), r.in_order.map_or(0, |l| l + 1)];
        // (Without offloaded experts a step is one segment.)
        let reusable = self.offloaded.is_empty();
        let allocs = self.exec.allocs();
        let reused = if reusable && self.reuse_graphs {
            self.arena.reuse_or_reset(shape, allocs)
        } else {
            self.arena.reset();
            false
        };
        // Split the borrows: graph building reads weights/kv, compute needs the backend mutably.
        let parts = GraphParts {
            model: &self.model,
            range: &self.range,
            weights: &self.weights,
            kv: &self.kv,
            device: &self.device,
            in_order: r.in_order,
        };
        let ctx = self.arena.ctx();
        let (graph, out) = if reused {
            let (graph, out) = self.arena.kept(shape, allocs).expect("checked above");
            (graph, SegmentOut::Range(out))
        } else {
            parts.build_segment(ctx, n, r.n_kv, r.out_rows.len(), &seg)
        };
        let t1 = Instant::now();
        if !reused {
            self.exec.alloc(&graph).map_err(EngineError::Ggml)?;
            if let (true, SegmentOut::Range(out)) = (reusable, &out) {
                self.arena.keep(shape, &graph, *out, self.exec.allocs());
            }
        }
        let t2 = Instant::now();
        let set = |name: &str, f: &dyn Fn(Tensor<'_>)| {
            // Inputs no node reads (a range with no global layer has no use for
            // the global mask) get no memory from the allocator.
            if let Some(t) = ctx.get_tensor(name).filter(|t| t.is_allocated()) {
                f(t)
            }
        };
        set("inp_tokens", &|t| {
            t.write(&batch.tokens.iter().map(|&x| x as i32).collect::<Vec<_>>())
        });
        set("inp_hidden", &|t| {
            t.write(&r.input.expect("checked in forward").data)
        });
        set("inp_pos", &|t| t.write(&batch.pos));
        set("inp_kv_idx", &|t| t.write(r.kv_idx));
        set("inp_mask", &|t| t.write(&r.mask));
        set("inp_mask_swa", &|t| t.write(&r.mask_swa));
        set("inp_kv_order", &|t| t.write(&r.order));
        set("inp_out_ids", &|t| {
            t.write(&r.out_rows.iter().map(|&x| x as i32).collect::<Vec<_>>())
        });
        if let Some(c) = r.carry.take() {
            set("inp_routed", &|t| t.write(&c.routed));
            set("inp_ffn_inp", &|t| t.write(&c.ffn_inp));
            if let Some(sh) = &c.shared {
                set("inp_shared", &|t| t.write(sh));
            }
        }
        let t3 = Instant::now();
        self.exec.compute(&graph).map_err(EngineError::Ggml)?;
        let t4 = Instant::now();
        let times = &mut self.times;
        times.segments += 1;
        times.reused += u64::from(reused);
        times.build += t1 - t0;
        times.alloc += t2 - t1;
        times.inputs += t3 - t2;
        times.compute += t4 - t3;
        let (cur, ids, weights, ffn_inp) = match out {
            SegmentOut::Range(out) => {
                let mut data = Vec::new();
                self.exec.read_f32(out, &mut data);
                self.times.output += t4.elapsed();
                if !seg.head {
                    // All rows, or (a head range's group) the rows whose
                    // logits are wanted, its stand-in row kept for the head.
                    return Ok(Progress::Done(StageOutput::Hidden(Hidden {
                        n_tokens: r.out_rows.len(),
                        n_embd: hp.n_embd as usize,
                        data,
                    })));
                }
                let mut rows = std::mem::take(&mut r.out_rows);
                if r.no_logits {
                    rows.clear();
                    data.clear();
                }
                return Ok(Progress::Done(StageOutput::Logits(Logits {
                    n_vocab: hp.n_vocab as usize,
                    rows,
                    data,
                })));
            }
            SegmentOut::Cut {
                cur,
                ids,
                weights,
                ffn_inp,
            } => (cur, ids, weights, ffn_inp),
        };
        let layer = seg.cut.expect("a cut segment names its layer");
        let n_cut = cur.ne()[1] as usize;
        let (mut x, mut ffn_inp_vals, mut id_vals, mut w_vals) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        cur.read_f32(&mut x);
        ffn_inp.read_f32(&mut ffn_inp_vals);
        ids.read_i32(&mut id_vals);
        weights.read_f32(&mut w_vals);
        self.times.output += t4.elapsed();
        let cut = CutOut {
            layer,
            n_tokens: n_cut,
            x,
            ffn_inp: ffn_inp_vals,
            ids: id_vals,
            weights: w_vals,
            invariant: batch.invariant,
        };
        self.submit_experts(cut, experts).map(Progress::Cut)
    }

    /// A cut segment's routed experts: the executor's share submitted, and
    /// the shared and device-kept experts computed meanwhile (the side
    /// graph). [`Stage::finish`] waits for the executor.
    fn submit_experts<'x>(
        &mut self,
        cut: CutOut,
        experts: Option<&mut (dyn ExpertExec + 'x)>,
    ) -> Result<PendingCut, EngineError> {
        let model = Arc::clone(&self.model);
        let hp = &model.hparams;
        let CutOut {
            layer,
            n_tokens: n_cut,
            x,
            ffn_inp,
            ids: id_vals,
            weights: w_vals,
            invariant,
        } = cut;
        if let Some(counts) = self.expert_counts.get_mut(&layer) {
            for &id in &id_vals {
                if let Some(n) = usize::try_from(id).ok().and_then(|i| counts.get_mut(i)) {
                    *n += 1;
                }
            }
        }
        let e = hp.n_embd as usize;
        let n_used = id_vals.len() / n_cut.max(1);
        let split = self
            .device
            .get(&layer)
            .map(|d| split_work(&d.ids, n_used, &id_vals, &w_vals));
        let dev_width = split.as_ref().map_or(0, |s| s.dev_width);
        let has_side = hp.arch.has_shared_experts(hp, layer) || dev_width > 0;
        // The side graph takes its input before the routed experts'
        // input moves to the executor.
        self.side_arena.reset();
        let side_ctx = self.side_arena.ctx();
        let parts = GraphParts {
            model: &self.model,
            range: &self.range,
            weights: &self.weights,
            kv: &self.kv,
            device: &self.device,
            in_order: None,
        };
        let mut side_graph = if has_side {
            let (g, out) = parts.build_side(side_ctx, layer, n_cut, dev_width);
            self.exec.alloc(&g).map_err(EngineError::Ggml)?;
            let input = |name: &str| side_ctx.get_tensor(name).expect("declared");
            input("inp_moe_cur").write(&x);
            if let Some(s) = split.as_ref().filter(|_| dev_width > 0) {
                input("inp_dev_ids").write(&s.dev_ids);
                input("inp_dev_weights").write(&s.dev_weights);
            }
            Some((g, out))
        } else {
            None
        };
        // Without `shared_overlap`, for an executor on this host's cores,
        // the side graph runs first: the stage and the executor take turns.
        let side_first = if self.cfg.shared_overlap
            || !experts.as_ref().is_some_and(|x| x.on_this_host(layer))
        {
            None
        } else {
            side_graph.take().map(|s| compute_side(&mut self.exec, s))
        };
        let (rows, batch) = executor_share(split, layer, n_cut, e, x, id_vals, w_vals);
        let mut remote = None;
        if let Some(mut batch) = batch {
            batch.invariant = invariant;
            let exec = experts.ok_or_else(|| {
                EngineError::Config(format!(
                    "layer {layer}'s routed experts are elsewhere but no expert executor was given"
                ))
            })?;
            let n_sent = batch.n_tokens;
            let submitted = std::time::Instant::now();
            exec.submit(batch)?;
            remote = Some((n_sent, submitted));
        }
        // Unless it ran first, the side graph overlaps with the executor's
        // work; `finish` waits even if this failed, so that the executor is
        // left with nothing pending.
        let side = side_first.or_else(|| side_graph.map(|s| compute_side(&mut self.exec, s)));
        Ok(PendingCut {
            layer,
            n_cut,
            ffn_inp,
            rows,
            remote,
            side,
        })
    }

    /// Waits for a cut block's routed experts: what the next segment
    /// resumes with.
    fn finish<'x>(
        &mut self,
        p: PendingCut,
        experts: Option<&mut (dyn ExpertExec + 'x)>,
    ) -> Result<Carry, EngineError> {
        let e = self.model.hparams.n_embd as usize;
        let PendingCut {
            layer,
            n_cut,
            ffn_inp,
            rows,
            remote,
            side,
        } = p;
        let routed = match (remote, experts) {
            (Some((n_sent, submitted)), Some(x)) => {
                let got = x.wait();
                if let Some(rule) = self.local.as_mut() {
                    rule.note_call(n_sent, submitted.elapsed().as_secs_f64());
                }
                Some((got, n_sent))
            }
            _ => None,
        };
        let shared = side.transpose().map_err(EngineError::Ggml)?;
        let routed = match routed {
            // Nothing elsewhere: the side graph computed every selected expert.
            None => vec![0.0; n_cut * e],
            Some((got, n_sent)) => {
                let got = got?;
                if got.len() != n_sent * e {
                    return Err(EngineError::Experts(format!(
                        "layer {layer}: the executor returned {} values for {n_sent} tokens of width {e} ({})",
                        got.len(),
                        n_sent * e
                    )));
                }
                match rows {
                    None => got,
                    Some(rows) => {
                        // Tokens not sent had nothing elsewhere: 0.
                        let mut all = vec![0.0; n_cut * e];
                        for (i, &t) in rows.iter().enumerate() {
                            all[t * e..(t + 1) * e].copy_from_slice(&got[i * e..(i + 1) * e]);
                        }
                        all
                    }
                }
            }
        };
        Ok(Carry {
            n_tokens: n_cut,
            routed,
            shared,
            ffn_inp,
        })
    }
}

/// Computes a cut block's side graph (shared experts, routed experts kept
/// here) and reads its output.
fn compute_side(
    exec: &mut Executor,
    (g, out): (Graph<'_>, Tensor<'_>),
) -> Result<Vec<f32>, String> {
    exec.compute(&g).map(|()| {
        let mut v = Vec::new();
        out.read_f32(&mut v);
        v
    })
}

/// One group's step in progress.
struct GroupRun<'b> {
    batch: &'b Batch,
    /// Rows the step's graphs take (the batch's, or the head's hidden rows).
    n_tokens: usize,
    input: Option<&'b Hidden>,
    kv_idx: &'b [i64],
    out_rows: Vec<usize>,
    no_logits: bool,
    n_kv: usize,
    in_order: Option<usize>,
    mask: Vec<u16>,
    mask_swa: Vec<u16>,
    order: Vec<i32>,
    segments: std::vec::IntoIter<super::graph::Segment>,
    /// The finished-elsewhere block the next segment resumes.
    carry: Option<Carry>,
}

enum Progress {
    Done(StageOutput),
    Cut(PendingCut),
}

/// A cut block between submitting its routed experts and their answer.
struct PendingCut {
    layer: u32,
    n_cut: usize,
    ffn_inp: Vec<f32>,
    /// The tokens sent (all when `None`).
    rows: Option<Vec<usize>>,
    /// Tokens with the executor, if any were sent, and when.
    remote: Option<(usize, std::time::Instant)>,
    /// The side graph's result (shared and device-kept experts).
    side: Option<Result<Vec<f32>, String>>,
}

/// Where an overlapped step cuts its batch in two: the sequence boundary
/// nearest the middle (no sequence on both sides), or `None` when there
/// is none (one sequence, or sequences whose tokens interleave).
///
/// The cut keeps the repacked Q4_K matmul's kernel for every row: it
/// computes rows four at a time up to the last whole four and the rest one
/// at a time, so the cut falls on a multiple of 4 (or anywhere in a batch
/// of fewer than 4 rows, all computed one at a time). Other kernels choose
/// by a batch's size too (llamafile's from 2 rows, attention's tiles from
/// 64), so a group's rows can differ in their last bits from the whole
/// batch's, as any batching moves them; a batch-invariant step's kernels
/// do not choose, and its groups compute exactly what the whole would.
fn group_split(seq: &[u32]) -> Option<usize> {
    let n = seq.len();
    let mut last = std::collections::HashMap::new();
    for (i, &s) in seq.iter().enumerate() {
        last.insert(s, i);
    }
    // A cut before i is clean when every sequence seen so far ends before i.
    let mut reach = 0;
    let mut best: Option<usize> = None;
    for (i, &s) in seq.iter().enumerate() {
        let exact = n < 4 || i % 4 == 0;
        if i > 0 && exact && reach < i && best.is_none_or(|b| b.abs_diff(n / 2) > i.abs_diff(n / 2))
        {
            best = Some(i);
        }
        reach = reach.max(last[&s]);
    }
    best
}

/// The two groups' outputs as one step's.
fn merge(a: StageOutput, b: StageOutput, m: usize) -> Result<StageOutput, EngineError> {
    match (a, b) {
        (StageOutput::Hidden(mut a), StageOutput::Hidden(b)) => {
            a.n_tokens += b.n_tokens;
            a.data.extend(b.data);
            Ok(StageOutput::Hidden(a))
        }
        (StageOutput::Logits(mut a), StageOutput::Logits(b)) => {
            a.rows.extend(b.rows.iter().map(|r| r + m));
            a.data.extend(b.data);
            Ok(StageOutput::Logits(a))
        }
        _ => Err(EngineError::Experts(
            "an overlapped step's groups gave different kinds of output".into(),
        )),
    }
}

/// What a cut segment hands over: its layer's normed expert input `x`, the
/// residual, and each token's selected experts and weights.
struct CutOut {
    layer: u32,
    n_tokens: usize,
    x: Vec<f32>,
    ffn_inp: Vec<f32>,
    ids: Vec<i32>,
    weights: Vec<f32>,
    /// The step is batch-invariant.
    invariant: bool,
}

/// The expert executor's share of a cut: every token, or with device
/// experts only the tokens that selected an expert elsewhere (`rows`).
fn executor_share(
    split: Option<SplitWork>,
    layer: u32,
    n_cut: usize,
    e: usize,
    x: Vec<f32>,
    ids: Vec<i32>,
    weights: Vec<f32>,
) -> (Option<Vec<usize>>, Option<ExpertBatch>) {
    match split {
        None => (
            None,
            Some(ExpertBatch {
                layer,
                n_tokens: n_cut,
                x,
                ids,
                weights,
                invariant: false,
            }),
        ),
        Some(s) if s.rows.is_empty() => (None, None),
        Some(s) => {
            let x = if s.rows.len() == n_cut {
                x
            } else {
                s.rows
                    .iter()
                    .flat_map(|&t| &x[t * e..(t + 1) * e])
                    .copied()
                    .collect()
            };
            let batch = ExpertBatch {
                layer,
                n_tokens: s.rows.len(),
                x,
                ids: s.ids,
                weights: s.weights,
                invariant: false,
            };
            (Some(s.rows), Some(batch))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::group_split;

    #[test]
    fn groups_split_between_sequences_where_every_row_keeps_its_kernel() {
        // Decode steps: one token per sequence.
        assert_eq!(group_split(&[0, 1]), Some(1));
        assert_eq!(group_split(&[0, 1, 2]), Some(1));
        assert_eq!(group_split(&[0, 1, 2, 3, 4, 5, 6, 7]), Some(4));
        // 6 rows: only a cut at 4 keeps rows 0-3 four at a time.
        assert_eq!(group_split(&[0, 1, 2, 3, 4, 5]), Some(4));
        assert_eq!(group_split(&[0, 1, 2, 3, 4]), Some(4));
        // A prompt beside decodes: the boundary nearest the middle.
        assert_eq!(group_split(&[0, 0, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4]), Some(8));
        // One sequence, or sequences that interleave: no cut.
        assert_eq!(group_split(&[3]), None);
        assert_eq!(group_split(&[3, 3, 3, 3]), None);
        assert_eq!(group_split(&[0, 1, 0, 1]), None);
        assert_eq!(group_split(&[0, 0, 0, 1, 1]), None);
    }
}
