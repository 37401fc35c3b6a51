//! Offloaded routed experts placed on the expert workers.

use crate::cost::budget;
use crate::cost::expert_compute_estimate;
use crate::cost::Costs;
use crate::error::ExpertNoFit;
use crate::error::PlanError;
use crate::pool::Pools;
use crate::spec::ExpertPlan;
use crate::spec::StageBytes;
use crate::spec::WorkerSpec;
use omni_engine::units::fmt_bytes;

/// Offloaded layers, in order, to the expert workers, each filled before
/// the next. One that shares memory with stages or other expert workers
/// gets at most what they left of it (`shared_used`: what the stages put
/// on each shared memory).
pub(crate) fn assign_experts(
    costs: &Costs<'_>,
    expert_workers: &[WorkerSpec],
    layers: &[u32],
    pools: &Pools,
    shared_used: &[u64],
) -> Result<Vec<ExpertPlan>, PlanError> {
    if layers.is_empty() {
        return Ok(Vec::new());
    }
    let cfg = costs.cfg;
    let compute = expert_compute_estimate(&costs.model.hparams, cfg.n_ubatch);
    let mut used = shared_used.to_vec();
    let mut plans = Vec::new();
    let mut next = 0;
    let mut last = None;
    let mut offered = 0u64;
    for (k, wk) in expert_workers.iter().enumerate() {
        let pool = pools.of_expert(k);
        let own = budget(wk.free_bytes, cfg.headroom);
        // What the others on its memory use before it.
        let others = pool.map_or(0, |p| used[p]);
        let budget = match pool {
            Some(p) => own.min(pools.shared[p].budget.saturating_sub(others)),
            None => own,
        };
        offered += budget.saturating_sub(compute);
        let (mut held, mut weights) = (Vec::new(), 0u64);
        while let Some(&il) = layers.get(next) {
            let b = costs.expert[il as usize];
            if compute + weights + b > budget {
                break;
            }
            held.push(il);
            weights += b;
            next += 1;
        }
        let bytes = StageBytes {
            weights,
            kv: 0,
            compute,
            total: weights + compute,
            budget,
            free: wk.free_bytes,
        };
        if !held.is_empty() {
            if let Some(p) = pool {
                used[p] += bytes.total;
            }
            plans.push(ExpertPlan {
                worker: wk.id.clone(),
                device: wk.device.clone(),
                layers: held.clone(),
                bytes: bytes.clone(),
            });
        }
        last = Some((k, wk, held, bytes, others));
        if next == layers.len() {
            return Ok(plans);
        }
    }
    let (k, wk, held, bytes, others) = last.expect("offloading needs expert workers");
    let shared = pools.of_expert(k).map_or(String::new(), |p| {
        format!(
            "{} shares {} with {}: they use {} of its {} usable, which leaves {} to {}",
            wk.id,
            pools.shared[p].name,
            pools.others(p, &wk.id),
            fmt_bytes(others),
            fmt_bytes(pools.shared[p].budget),
            fmt_bytes(bytes.budget),
            wk.id,
        )
    });
    let layer = layers[next];
    Err(PlanError::ExpertsDoNotFit(Box::new(ExpertNoFit {
        layer,
        layer_bytes: costs.expert[layer as usize],
        left: layers[next..].to_vec(),
        worker: wk.id.clone(),
        device: wk.device.clone(),
        layers: held,
        bytes,
        total_bytes: wk.total_bytes,
        headroom: cfg.headroom,
        all_need: layers.iter().map(|&il| costs.expert[il as usize]).sum(),
        all_budget: offered,
        shared,
    })))
}
