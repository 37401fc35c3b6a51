//! Moving layers between stages while sequences are live: a stage changes
//! its range ([`Stage::rerange`]) or takes over another's weights and cache
//! ([`Stage::take_over`]), checked before anything changes.

use super::Stage;
use crate::error::EngineError;
use crate::kv::KvLayers;
use crate::range::LayerRange;

impl Stage {
    /// Makes this stage run `range` instead, keeping its sequences: as
    /// [`Stage::rerange_offloaded`] with the offloaded layers that stay in
    /// the range (and their kept experts).
    pub fn rerange(
        &mut self,
        range: LayerRange,
        incoming: Option<&KvLayers>,
    ) -> Result<(), EngineError> {
        let offloaded: Vec<u32> = self
            .offloaded
            .iter()
            .copied()
            .filter(|l| range.layers.contains(l))
            .collect();
        self.rerange_offloaded(range, &offloaded, incoming)
    }

    /// Makes this stage run `range` (with these `offloaded` layers) at a
    /// step boundary, keeping every sequence: [`Stage::load_offloaded`] a
    /// new stage for `range` with the same configuration, then
    /// [`Stage::take_over`] this one with `incoming` (the
    /// [`Stage::export_kv`] of the neighbour that gave up the layers this
    /// stage did not run), and only then replace this stage.
    ///
    /// On any error this stage is left exactly as it was (rollback) and
    /// still runs its old range. Memory: the new stage is complete before
    /// the old one is dropped, so the peak is both stages at once (repacked
    /// weights, KV cache and compute buffer of each; mapped weights are
    /// shared through the model's memory map), plus one layer's used KV
    /// rows in transit.
    pub fn rerange_offloaded(
        &mut self,
        range: LayerRange,
        offloaded: &[u32],
        incoming: Option<&KvLayers>,
    ) -> Result<(), EngineError> {
        let incoming: Vec<&KvLayers> = incoming.into_iter().collect();
        check_takeover(Some(self), &range, &incoming)?;
        let mut new =
            Stage::load_offloaded(self.model.clone(), range, self.cfg.clone(), offloaded)?;
        new.take_over(Some(self), &incoming)?;
        *self = new;
        Ok(())
    }

    /// Makes this freshly loaded stage (no step run yet) the successor of
    /// `old` at a step boundary: copies the KV cache of the layers both
    /// run from `old`, imports `incoming` (the other layers' exports, from
    /// the stages that ran them; all with `old`'s cell table, or any one
    /// table when `old` is None or runs no layer), and carries over the
    /// routing statistics and kept experts of the offloaded layers both
    /// have. `old` is not changed, so on error the caller still has it
    /// (and this stage is to be dropped); no step may run on `old` between
    /// this and replacing it.
    pub fn take_over(
        &mut self,
        old: Option<&Stage>,
        incoming: &[&KvLayers],
    ) -> Result<(), EngineError> {
        check_takeover(old, &self.range, incoming)?;
        let from = old.map_or_else(String::new, |o| format!("{} ", o.range));
        let in_move =
            |e: EngineError| EngineError::Config(format!("moving {from}to {}: {e}", self.range));
        if let Some(old) = old {
            let (a, b) = (old.range.layers.clone(), self.range.layers.clone());
            // One layer at a time, so only one layer's rows are in transit.
            for il in a.start.max(b.start)..a.end.min(b.end) {
                let one = old.kv.export(il..il + 1)?;
                self.kv.import(&one).map_err(in_move)?;
            }
        }
        for kv in incoming {
            self.kv.import(kv).map_err(in_move)?;
        }
        if let Some(old) = old {
            for il in self.offloaded.clone() {
                if let Some(counts) = old.expert_counts.get(&il) {
                    self.expert_counts.insert(il, counts.clone());
                }
                if let Some(d) = old.device.get(&il) {
                    self.set_device_experts(il, &d.ids)?;
                }
            }
        }
        Ok(())
    }
}

/// An offloaded block's results on the host, for the segment that finishes it.
pub(super) struct Carry {
    pub(super) n_tokens: usize,
    pub(super) routed: Vec<f32>,
    pub(super) shared: Option<Vec<f32>>,
    pub(super) ffn_inp: Vec<f32>,
}

/// [`Stage::take_over`]'s checks, before anything is loaded or written:
/// every layer of `range` that `old` does not run is in `incoming`, once,
/// and (when `old` runs layers) every incoming cell table is `old`'s.
pub(super) fn check_takeover(
    old: Option<&Stage>,
    range: &LayerRange,
    incoming: &[&KvLayers],
) -> Result<(), EngineError> {
    let had = old.map_or(0..0, |o| o.range.layers.clone());
    let bad = |why: String| {
        Err(EngineError::Config(match old {
            Some(o) => format!("moving {} to {range}: {why}", o.range),
            None => format!("taking over {range}: {why}"),
        }))
    };
    let carried = |l: u32| {
        incoming
            .iter()
            .flat_map(|kv| kv.layers.iter())
            .filter(|x| x.layer == l)
            .count()
    };
    let missing: Vec<u32> = range
        .layers
        .clone()
        .filter(|&l| !had.contains(&l) && carried(l) == 0)
        .collect();
    if !missing.is_empty() {
        return bad(format!(
            "the KV cache of layers {missing:?} is not in the incoming export"
        ));
    }
    if let Some(l) = range.layers.clone().find(|&l| carried(l) > 1) {
        return bad(format!("the KV cache of layer {l} comes more than once"));
    }
    if let Some(o) = old.filter(|o| !o.range.layers.is_empty()) {
        for kv in incoming {
            o.kv.check_table(&kv.cells, false)
                .or_else(|e| bad(e.to_string()))?;
        }
    }
    Ok(())
}
