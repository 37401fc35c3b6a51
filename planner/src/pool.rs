//! Memory that several workers compute on: one host's RAM (its CPU stage
//! workers and expert workers), or one GPU (two workers on the same card).
//! Each of them offers what that memory has free, so their offers are the
//! same bytes counted again: together they get one budget, the largest of
//! their offers after headroom, while each worker's own offer (its
//! `--memory`) still caps it alone.

use crate::cost::budget;
use crate::show::pct;
use crate::{fmt_bytes, WorkerSpec};

/// One memory that more than one worker computes on.
#[derive(Clone, Debug)]
pub(super) struct Shared {
    /// How the plan names it: "host box1's RAM".
    pub name: String,
    /// The largest offer among the workers on it, and its budget after headroom.
    pub free: u64,
    pub budget: u64,
    /// The stage workers and expert workers on it (indices).
    pub stages: Vec<usize>,
    pub experts: Vec<usize>,
}

/// The memories a plan's workers share.
pub(super) struct Pools {
    pub shared: Vec<Shared>,
    stage_of: Vec<Option<usize>>,
    expert_of: Vec<Option<usize>>,
    stage_ids: Vec<String>,
    expert_ids: Vec<String>,
}

impl Pools {
    pub fn new(workers: &[WorkerSpec], expert_workers: &[WorkerSpec], headroom: f64) -> Pools {
        let mut keys: Vec<String> = Vec::new();
        let mut shared: Vec<Shared> = Vec::new();
        let mut group = |w: &WorkerSpec| -> Option<usize> {
            let pool = w.pool.as_ref()?;
            let p = match keys.iter().position(|k| *k == pool.key) {
                Some(p) => p,
                None => {
                    keys.push(pool.key.clone());
                    shared.push(Shared {
                        name: pool.name.clone(),
                        free: 0,
                        budget: 0,
                        stages: Vec::new(),
                        experts: Vec::new(),
                    });
                    keys.len() - 1
                }
            };
            shared[p].free = shared[p].free.max(w.free_bytes);
            Some(p)
        };
        let stage_of: Vec<Option<usize>> = workers.iter().map(&mut group).collect();
        let expert_of: Vec<Option<usize>> = expert_workers.iter().map(&mut group).collect();
        for (i, p) in stage_of.iter().enumerate() {
            if let Some(p) = p {
                shared[*p].stages.push(i);
            }
        }
        for (k, p) in expert_of.iter().enumerate() {
            if let Some(p) = p {
                shared[*p].experts.push(k);
            }
        }
        // A memory with one worker on it is that worker's own: nothing to share.
        let mut renumber = Vec::with_capacity(shared.len());
        let mut kept = Vec::new();
        for mut s in shared {
            if s.stages.len() + s.experts.len() > 1 {
                s.budget = budget(s.free, headroom);
                renumber.push(Some(kept.len()));
                kept.push(s);
            } else {
                renumber.push(None);
            }
        }
        let map = |v: Vec<Option<usize>>| -> Vec<Option<usize>> {
            v.into_iter().map(|p| p.and_then(|p| renumber[p])).collect()
        };
        Pools {
            shared: kept,
            stage_of: map(stage_of),
            expert_of: map(expert_of),
            stage_ids: workers.iter().map(|w| w.id.clone()).collect(),
            expert_ids: expert_workers.iter().map(|w| w.id.clone()).collect(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.shared.is_empty()
    }

    /// The shared memory stage worker `i` computes on, if it shares one.
    pub fn of_stage(&self, i: usize) -> Option<usize> {
        self.stage_of.get(i).copied().flatten()
    }

    /// The shared memory expert worker `k` computes on, if it shares one.
    pub fn of_expert(&self, k: usize) -> Option<usize> {
        self.expert_of.get(k).copied().flatten()
    }

    /// What the stage workers offer together after headroom (`budgets`,
    /// each its own), every shared memory counted once.
    pub fn stage_offer(&self, budgets: &[u64]) -> u64 {
        let alone: u64 = budgets
            .iter()
            .enumerate()
            .filter(|&(i, _)| self.of_stage(i).is_none())
            .map(|(_, b)| b)
            .sum();
        let shared: u64 = self
            .shared
            .iter()
            .map(|s| {
                let own: u64 = s.stages.iter().map(|&i| budgets[i]).sum();
                own.min(s.budget)
            })
            .sum();
        alone + shared
    }

    /// What the stages (`totals`, in worker order) put on each shared memory.
    pub fn stage_use(&self, totals: &[u64]) -> Vec<u64> {
        self.shared
            .iter()
            .map(|s| s.stages.iter().map(|&i| totals[i]).sum())
            .collect()
    }

    /// The shared memory the stages overfill the most, with what they put on it.
    pub fn overflow(&self, totals: &[u64]) -> Option<(usize, u64)> {
        self.stage_use(totals)
            .into_iter()
            .enumerate()
            .filter(|&(p, used)| used > self.shared[p].budget)
            .max_by(|a, b| {
                let r = |(p, used): (usize, u64)| used as f64 / self.shared[p].budget.max(1) as f64;
                r(*a).total_cmp(&r(*b))
            })
    }

    /// Budgets for a split search that keep each shared memory's stages
    /// within it: each stage worker on one gets a part of it in proportion
    /// to `weights` (what it holds now, or its own budget), never more than
    /// its own budget; the others keep theirs.
    pub fn shares(&self, budgets: &[u64], weights: &[u64]) -> Vec<u64> {
        let mut out = budgets.to_vec();
        for s in &self.shared {
            let sum: u64 = s.stages.iter().map(|&i| weights[i]).sum();
            for &i in &s.stages {
                let part = if sum == 0 {
                    s.budget / s.stages.len() as u64
                } else {
                    (s.budget as u128 * weights[i] as u128 / sum as u128) as u64
                };
                out[i] = budgets[i].min(part);
            }
        }
        out
    }

    /// "w0 and w1", "w0, w1 and c0": the workers on shared memory `p`.
    pub fn members(&self, p: usize) -> String {
        and_list(&self.ids(p).collect::<Vec<_>>())
    }

    /// The other workers on the shared memory of stage `i` (or of expert
    /// worker `k`), for "it shares host box1's RAM with w1".
    pub fn others(&self, p: usize, me: &str) -> String {
        and_list(&self.ids(p).filter(|id| *id != me).collect::<Vec<_>>())
    }

    /// The ids of the workers on shared memory `p`, stages first.
    fn ids(&self, p: usize) -> impl Iterator<Item = &str> {
        let s = &self.shared[p];
        s.stages
            .iter()
            .map(|&i| self.stage_ids[i].as_str())
            .chain(s.experts.iter().map(|&k| self.expert_ids[k].as_str()))
    }

    /// "w0 and w1 share host box1's RAM; w2 and w3 share host box1's cuda:1".
    pub fn summary(&self) -> String {
        (0..self.shared.len())
            .map(|p| format!("{} share {}", self.members(p), self.shared[p].name))
            .collect::<Vec<_>>()
            .join("; ")
    }

    /// One note per shared memory: who shares it, its budget, and what the
    /// plan puts on it (`stage_totals` per stage worker, `expert_totals` per
    /// expert worker).
    pub fn notes(
        &self,
        stage_totals: &[u64],
        expert_totals: &[u64],
        headroom: f64,
        moved: bool,
    ) -> Vec<String> {
        let used = self.stage_use(stage_totals);
        self.shared
            .iter()
            .enumerate()
            .map(|(p, s)| {
                let experts: u64 = s.experts.iter().map(|&k| expert_totals[k]).sum();
                let all = used[p] + experts;
                let mut n = format!(
                    "memory: {} share {}, {} free ({} usable after {}% headroom), counted once: each offers what that memory has free, so together they get the largest offer, not the sum (a worker's own offer still caps it alone); the plan puts {} on it",
                    self.members(p),
                    s.name,
                    fmt_bytes(s.free),
                    fmt_bytes(s.budget),
                    pct(headroom),
                    fmt_bytes(all),
                );
                if experts > 0 && used[p] > 0 {
                    n.push_str(&format!(
                        " ({} on the stages, {} on the expert workers)",
                        fmt_bytes(used[p]),
                        fmt_bytes(experts)
                    ));
                }
                n.push_str(&format!(
                    ", {:.0}% of it",
                    100.0 * all as f64 / s.budget.max(1) as f64
                ));
                if moved && !s.stages.is_empty() {
                    n.push_str("; the split that fits each worker's own offer overfilled it, so layers moved to other workers");
                }
                n
            })
            .collect()
    }
}

/// "a", "a and b", "a, b and c".
pub(super) fn and_list(items: &[&str]) -> String {
    match items {
        [] => String::new(),
        [one] => one.to_string(),
        [init @ .., last] => format!("{} and {last}", init.join(", ")),
    }
}
