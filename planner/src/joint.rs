//! Several models planned together over the same devices: an Oracle on the
//! GPUs with its experts on the CPU, an Executor on CPU threads. Each model
//! is planned by [`plan_with_experts`] as if alone, but on what the models
//! before it left of every device, so that memory two models share is
//! counted once: a set that does not fit is refused before anything loads,
//! naming the model, the device and the numbers. Models are planned in the
//! order given (put the one that must fit first: the big one).
//!
//! The host's cores are counted once too: every model computes at the same
//! time as the others (its stages take turns among themselves, its expert
//! workers run beside them), so the threads they run at once are added up
//! against the cores.

use std::fmt;

use omni_engine::model::ModelFile;
use omni_engine::units::fmt_bytes;
use serde::Serialize;

use crate::cost::budget;
use crate::show::{pct, table};
use crate::{plan_with_experts, MemoryPool, Plan, PlanConfig, PlanError, WorkerSpec};

/// A device several models may use, and the memory it offers.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct JointDevice {
    /// "cpu", "cuda:0", ...: what a model's workers name as their device.
    pub name: String,
    pub free: u64,
}

/// One model of a joint plan.
pub struct JointModel<'a> {
    /// The name it is served under ("oracle").
    pub name: String,
    pub model: &'a ModelFile,
    /// Its stage workers in pipeline order, each on a device of the joint
    /// plan (by name); `free_bytes` caps a worker alone (its `--memory`;
    /// `u64::MAX` for none).
    pub workers: Vec<WorkerSpec>,
    /// Its expert workers, likewise.
    pub expert_workers: Vec<WorkerSpec>,
    pub cfg: PlanConfig,
    /// Threads its stages compute with (they take turns: one step at a time).
    pub threads: usize,
    /// Threads of each of its expert workers.
    pub expert_threads: usize,
}

/// Several models' plans over the same devices.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct JointPlan {
    /// In the order planned.
    pub models: Vec<NamedPlan>,
    pub devices: Vec<DeviceUse>,
    pub cores: CoreUse,
    /// Fraction of each device left unplanned.
    pub headroom: f64,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct NamedPlan {
    pub name: String,
    pub plan: Plan,
}

/// What every model takes of one device.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct DeviceUse {
    pub name: String,
    pub free: u64,
    /// `free × (1 − headroom)`.
    pub budget: u64,
    pub uses: Vec<ModelUse>,
    /// `budget` less every model's total.
    pub left: u64,
}

/// What one model's stages and expert workers on a device need together.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ModelUse {
    pub model: String,
    /// Its workers there, "w0, w1, c0".
    pub workers: String,
    pub weights: u64,
    pub kv: u64,
    pub compute: u64,
    pub total: u64,
}

/// The host's cores and the threads the models run on them at once.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct CoreUse {
    pub cores: usize,
    pub models: Vec<ModelThreads>,
    /// Threads computing at once, every model together.
    pub busy: usize,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ModelThreads {
    pub model: String,
    /// Its stages' threads (one stage computes at a time).
    pub stage_threads: usize,
    pub stages: usize,
    pub expert_workers: usize,
    pub expert_threads: usize,
}

impl ModelThreads {
    /// Threads this model computes with at once: one stage's and every
    /// expert worker's.
    pub fn busy(&self) -> usize {
        self.stage_threads + self.expert_workers * self.expert_threads
    }
}

/// Why a set of models cannot be planned together.
#[derive(Debug, thiserror::Error)]
pub enum JointError {
    #[error("{0}")]
    Config(String),
    /// `model` alone, or beside the models planned before it, does not fit.
    #[error("model '{model}' {context}: {error}{beside}")]
    DoesNotFit {
        model: String,
        /// "does not fit beside 'oracle'" or "does not fit".
        context: String,
        error: PlanError,
        /// What the models before it take of each device it uses.
        beside: String,
    },
}

/// Plans `models` in order over `devices`, each on what the ones before it
/// left (see the module's text), with `headroom` of every device left
/// unplanned and `cores` the host's.
pub fn plan_jointly(
    models: &[JointModel],
    devices: &[JointDevice],
    headroom: f64,
    cores: usize,
) -> Result<JointPlan, JointError> {
    if models.is_empty() {
        return Err(JointError::Config("no models to plan".into()));
    }
    for (i, m) in models.iter().enumerate() {
        if models[..i].iter().any(|o| o.name == m.name) {
            return Err(JointError::Config(format!(
                "two models are named '{}': give each its own name",
                m.name
            )));
        }
    }
    let mut left: Vec<u64> = devices.iter().map(|d| budget(d.free, headroom)).collect();
    let mut uses: Vec<Vec<ModelUse>> = vec![Vec::new(); devices.len()];
    let mut plans = Vec::new();
    for m in models {
        let device_of = |w: &WorkerSpec| -> Result<usize, JointError> {
            devices
                .iter()
                .position(|d| d.name == w.device)
                .ok_or_else(|| {
                    let names: Vec<&str> = devices.iter().map(|d| d.name.as_str()).collect();
                    JointError::Config(format!(
                    "model '{}': worker {} is on device '{}', which is not one of the devices ({})",
                    m.name,
                    w.id,
                    w.device,
                    names.join(", ")
                ))
                })
        };
        // Each worker offers what is left of its device (so that its
        // budget after headroom is that), capped by its own offer; the
        // model's workers on one device share it as one pool.
        let offer = |w: &WorkerSpec| -> Result<WorkerSpec, JointError> {
            let d = device_of(w)?;
            let free = ((left[d] as f64) / (1.0 - headroom)).floor() as u64;
            Ok(WorkerSpec {
                free_bytes: free.min(w.free_bytes),
                total_bytes: devices[d].free,
                pool: Some(MemoryPool {
                    key: devices[d].name.clone(),
                    name: devices[d].name.clone(),
                }),
                ..w.clone()
            })
        };
        let workers = m.workers.iter().map(offer).collect::<Result<Vec<_>, _>>()?;
        let experts = m
            .expert_workers
            .iter()
            .map(offer)
            .collect::<Result<Vec<_>, _>>()?;
        let cfg = PlanConfig {
            headroom,
            ..m.cfg.clone()
        };
        let plan = plan_with_experts(m.model, &workers, &experts, &cfg).map_err(|error| {
            let before: Vec<String> = plans
                .iter()
                .map(|p: &NamedPlan| format!("'{}'", p.name))
                .collect();
            let mut used: Vec<usize> = Vec::new();
            for w in m.workers.iter().chain(&m.expert_workers) {
                if let Ok(d) = device_of(w) {
                    if !used.contains(&d) {
                        used.push(d);
                    }
                }
            }
            let beside: Vec<String> = used
                .iter()
                .filter(|&&d| !uses[d].is_empty())
                .map(|&d| {
                    let taken: Vec<String> = uses[d]
                        .iter()
                        .map(|u| format!("'{}' takes {}", u.model, fmt_bytes(u.total)))
                        .collect();
                    format!(
                        "{}: {} of its {} usable ({} free, {}% headroom), leaving {}",
                        devices[d].name,
                        taken.join(" and "),
                        fmt_bytes(budget(devices[d].free, headroom)),
                        fmt_bytes(devices[d].free),
                        pct(headroom),
                        fmt_bytes(left[d])
                    )
                })
                .collect();
            JointError::DoesNotFit {
                model: m.name.clone(),
                context: if before.is_empty() {
                    "does not fit".into()
                } else {
                    format!("does not fit beside {}", before.join(" and "))
                },
                error,
                beside: if beside.is_empty() {
                    String::new()
                } else {
                    format!(" (on {})", beside.join("; "))
                },
            }
        })?;
        // What this model takes of each device.
        let parts = plan
            .stages
            .iter()
            .map(|s| (&s.worker, &s.device, &s.bytes))
            .chain(
                plan.experts
                    .iter()
                    .map(|e| (&e.worker, &e.device, &e.bytes)),
            );
        let mut mine: Vec<(usize, ModelUse)> = Vec::new();
        for (worker, device, b) in parts {
            let d = devices
                .iter()
                .position(|x| &x.name == device)
                .expect("the planner keeps each worker's device");
            let u = match mine.iter_mut().find(|(k, _)| *k == d) {
                Some((_, u)) => u,
                None => {
                    mine.push((
                        d,
                        ModelUse {
                            model: m.name.clone(),
                            workers: String::new(),
                            weights: 0,
                            kv: 0,
                            compute: 0,
                            total: 0,
                        },
                    ));
                    &mut mine.last_mut().expect("just pushed").1
                }
            };
            if !u.workers.is_empty() {
                u.workers.push_str(", ");
            }
            u.workers.push_str(worker);
            u.weights += b.weights;
            u.kv += b.kv;
            u.compute += b.compute;
            u.total += b.total;
        }
        for (d, u) in mine {
            left[d] = left[d].saturating_sub(u.total);
            uses[d].push(u);
        }
        plans.push(NamedPlan {
            name: m.name.clone(),
            plan,
        });
    }
    let threads: Vec<ModelThreads> = models
        .iter()
        .map(|m| ModelThreads {
            model: m.name.clone(),
            stage_threads: m.threads,
            stages: m.workers.len(),
            expert_workers: m.expert_workers.len(),
            expert_threads: m.expert_threads,
        })
        .collect();
    let busy = threads.iter().map(ModelThreads::busy).sum();
    Ok(JointPlan {
        models: plans,
        devices: devices
            .iter()
            .zip(uses)
            .zip(&left)
            .map(|((d, uses), &left)| DeviceUse {
                name: d.name.clone(),
                free: d.free,
                budget: budget(d.free, headroom),
                uses,
                left,
            })
            .collect(),
        cores: CoreUse {
            cores,
            models: threads,
            busy,
        },
        headroom,
    })
}

/// Splits `cores` among groups of threads that compute at once (each
/// model's stages, each expert worker): as evenly as the cores allow, the
/// first groups taking the remainder, at least one thread each.
pub fn split_cores(cores: usize, groups: usize) -> Vec<usize> {
    if groups == 0 {
        return Vec::new();
    }
    (0..groups)
        .map(|i| (cores / groups + usize::from(i < cores % groups)).max(1))
        .collect()
}

impl fmt::Display for JointPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<&str> = self.models.iter().map(|m| m.name.as_str()).collect();
        if self.models.len() > 1 {
            writeln!(
                f,
                "{} models planned together ({}), each on what the ones before it left; headroom {}%",
                self.models.len(),
                names.join(", "),
                pct(self.headroom)
            )?;
        } else {
            writeln!(
                f,
                "1 model ({}); headroom {}%",
                names.join(", "),
                pct(self.headroom)
            )?;
        }
        let header = [
            "device",
            "model",
            "workers",
            "weights",
            "KV",
            "compute",
            "total",
            "of usable",
        ];
        let mut rows: Vec<Vec<String>> = Vec::new();
        for d in &self.devices {
            for u in &d.uses {
                rows.push(vec![
                    d.name.clone(),
                    u.model.clone(),
                    u.workers.clone(),
                    fmt_bytes(u.weights),
                    fmt_bytes(u.kv),
                    fmt_bytes(u.compute),
                    fmt_bytes(u.total),
                    format!("{:.0}%", crate::cost::ratio(u.total, d.budget) * 100.0),
                ]);
            }
            rows.push(vec![
                d.name.clone(),
                "(left)".into(),
                format!("{} free, {} usable", fmt_bytes(d.free), fmt_bytes(d.budget)),
                String::new(),
                String::new(),
                String::new(),
                fmt_bytes(d.left),
                format!("{:.0}%", crate::cost::ratio(d.left, d.budget) * 100.0),
            ]);
        }
        table(f, &header, &rows, 0..=2)?;
        let c = &self.cores;
        let parts: Vec<String> = c
            .models
            .iter()
            .map(|m| {
                let mut s = format!(
                    "'{}' {}",
                    m.model,
                    omni_engine::count(m.stage_threads as u64, "thread")
                );
                if m.stages > 1 {
                    s.push_str(&format!(" (its {} stages take turns)", m.stages));
                }
                if m.expert_workers > 0 {
                    s.push_str(&format!(
                        " + {} x {} (expert workers)",
                        m.expert_workers,
                        omni_engine::count(m.expert_threads as u64, "thread")
                    ));
                }
                s
            })
            .collect();
        writeln!(
            f,
            "cores: {} on this host; at once: {} = {}{}",
            c.cores,
            parts.join(", "),
            omni_engine::count(c.busy as u64, "thread"),
            if c.busy > c.cores {
                " (more than the cores: threads that wait for a core slow every step of every model; give them fewer threads)".to_string()
            } else {
                String::new()
            }
        )?;
        for m in &self.models {
            writeln!(f, "\nmodel '{}':", m.name)?;
            write!(f, "{}", m.plan)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cores_split_evenly_with_the_remainder_first() {
        assert_eq!(split_cores(16, 3), vec![6, 5, 5]);
        assert_eq!(split_cores(2, 2), vec![1, 1]);
        assert_eq!(split_cores(2, 3), vec![1, 1, 1]);
        assert!(split_cores(8, 0).is_empty());
    }
}
