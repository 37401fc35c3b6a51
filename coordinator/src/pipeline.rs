//! How many micro-batch groups the pipeline keeps in flight.
//!
//! A pipeline overlaps stages only where they have compute of their own.
//! Stages on one host whose CPUs overlap (the usual `omnictl up`: every
//! worker may run on every core) compete for the same cores: running two of
//! their steps at once splits the cores between them and halves each
//! step's batch, which costs more than the overlap gains (measured: two
//! stages on two cores served 8 streams at 0.52x of one process with a
//! group per stage and one thread each). They take turns instead: each
//! uses every core for its step and the next stage runs when it is done,
//! as the layers of one process do. So the default is one group per
//! *compute site*: stages that share cores (or a GPU) are one site.

/// Where a stage computes, as its worker reported it at registration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Site {
    pub worker: String,
    pub host_id: String,
    /// "cpu" or "cuda:N".
    pub device: String,
    /// The CPUs the worker may run on (empty: unknown, taken as all of the
    /// host's).
    pub cpus: Vec<u32>,
}

impl Site {
    pub fn of(w: &crate::Registered) -> Site {
        Site {
            worker: w.id.clone(),
            host_id: w.inventory.host_id.clone(),
            device: w.inventory.device.clone(),
            cpus: w.inventory.cpus.clone(),
        }
    }

    /// Whether two stages compete for the same compute: the same GPU, or
    /// overlapping CPUs of one host (a GPU stage's few CPU ops aside).
    fn shares_with(&self, other: &Site) -> bool {
        if self.host_id != other.host_id || self.device != other.device {
            return false;
        }
        if self.device != "cpu" {
            return true;
        }
        self.cpus.is_empty()
            || other.cpus.is_empty()
            || self.cpus.iter().any(|c| other.cpus.contains(c))
    }
}

/// The stages (by index) grouped into compute sites, in stage order.
pub fn sites(stages: &[Site]) -> Vec<Vec<usize>> {
    // Union-find over the stages; a handful, so quadratic is fine.
    let mut root: Vec<usize> = (0..stages.len()).collect();
    fn find(root: &mut [usize], mut i: usize) -> usize {
        while root[i] != i {
            root[i] = root[root[i]];
            i = root[i];
        }
        i
    }
    for i in 0..stages.len() {
        for j in i + 1..stages.len() {
            if stages[i].shares_with(&stages[j]) {
                let (a, b) = (find(&mut root, i), find(&mut root, j));
                root[a.max(b)] = a.min(b);
            }
        }
    }
    let mut out: Vec<Vec<usize>> = Vec::new();
    let mut of_root: Vec<Option<usize>> = vec![None; stages.len()];
    for i in 0..stages.len() {
        let r = find(&mut root, i);
        match of_root[r] {
            Some(k) => out[k].push(i),
            None => {
                of_root[r] = Some(out.len());
                out.push(vec![i]);
            }
        }
    }
    out
}

/// Each stage's weight read rate as the planner takes it: stages of one site
/// take turns, each with all of its compute, so they share one figure, the
/// best any of them measured (workers started together time their reads at
/// the same moment and slow each other down).
pub fn site_rates(stages: &[Site], rates: &[f64]) -> Vec<f64> {
    let mut out = rates.to_vec();
    for site in sites(stages) {
        let best = site.iter().map(|&i| rates[i]).fold(0.0, f64::max);
        for i in site {
            out[i] = best;
        }
    }
    out
}

/// The default number of micro-batch groups, and a line saying why when
/// stages take turns.
pub fn default_groups(stages: &[Site]) -> (usize, Option<String>) {
    let sites = sites(stages);
    let shared: Vec<String> = sites
        .iter()
        .filter(|s| s.len() > 1)
        .map(|s| {
            let names: Vec<&str> = s.iter().map(|&i| stages[i].worker.as_str()).collect();
            let what = if stages[s[0]].device == "cpu" {
                "the same CPUs".to_string()
            } else {
                format!("one GPU ({})", stages[s[0]].device)
            };
            format!("{} share {what}", names.join(", "))
        })
        .collect();
    let n = sites.len().max(1);
    let why = (!shared.is_empty()).then(|| {
        format!(
            "{}: they take turns, each step using all of it, so {n} micro-batch group{} \
             in flight (--micro-batches overrides)",
            shared.join("; "),
            if n == 1 { " is" } else { "s are" }
        )
    });
    (n, why)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn site(worker: &str, host: &str, device: &str, cpus: &[u32]) -> Site {
        Site {
            worker: worker.into(),
            host_id: host.into(),
            device: device.into(),
            cpus: cpus.to_vec(),
        }
    }

    #[test]
    fn stages_on_the_same_cores_are_one_site() {
        let local = [
            site("w0", "a", "cpu", &[0, 1]),
            site("w1", "a", "cpu", &[0, 1]),
        ];
        let (n, why) = default_groups(&local);
        assert_eq!(n, 1);
        assert!(why.unwrap().contains("w0, w1 share the same CPUs"));
    }

    #[test]
    fn stages_with_compute_of_their_own_overlap() {
        // Two hosts; two NUMA-pinned workers on one host; two GPUs.
        let cases = [
            vec![site("w0", "a", "cpu", &[]), site("w1", "b", "cpu", &[])],
            vec![
                site("w0", "a", "cpu", &[0, 1]),
                site("w1", "a", "cpu", &[2, 3]),
            ],
            vec![
                site("g0", "a", "cuda:0", &[0, 1]),
                site("g1", "a", "cuda:1", &[0, 1]),
            ],
            vec![
                site("g0", "a", "cuda:0", &[0, 1]),
                site("w1", "a", "cpu", &[0, 1]),
            ],
        ];
        for stages in cases {
            assert_eq!(default_groups(&stages), (2, None), "{stages:?}");
        }
    }

    #[test]
    fn sites_group_in_stage_order() {
        let stages = [
            site("g0", "a", "cuda:0", &[]),
            site("w1", "a", "cpu", &[]),
            site("g2", "a", "cuda:0", &[]),
            site("w3", "b", "cpu", &[]),
            site("w4", "a", "cpu", &[5]),
        ];
        assert_eq!(sites(&stages), vec![vec![0, 2], vec![1, 4], vec![3]]);
        let (n, why) = default_groups(&stages);
        assert_eq!(n, 3);
        let why = why.unwrap();
        assert!(why.contains("g0, g2 share one GPU (cuda:0)"), "{why}");
        assert!(why.contains("w1, w4 share the same CPUs"), "{why}");
        // Stages of one site share the best rate any of them measured.
        let rates = site_rates(&stages, &[900.0, 30.0, 800.0, 20.0, 40.0]);
        assert_eq!(rates, [900.0, 40.0, 900.0, 20.0, 40.0]);
    }
}
