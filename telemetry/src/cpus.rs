//! CPU lists in the kernel's notation, and the CPUs this process may run on.

/// Parses a kernel CPU list such as `0-3,8,10-11`.
pub fn parse_cpulist(s: &str) -> Result<Vec<usize>, String> {
    let mut cpus = Vec::new();
    for part in s.trim().split(',').filter(|p| !p.is_empty()) {
        let num = |t: &str| {
            t.trim()
                .parse::<usize>()
                .map_err(|_| format!("'{t}' in the CPU list '{s}' is not a number"))
        };
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b) = (num(a)?, num(b)?);
                if a > b {
                    return Err(format!("'{part}' in the CPU list '{s}' runs backwards"));
                }
                cpus.extend(a..=b);
            }
            None => cpus.push(num(part)?),
        }
    }
    Ok(cpus)
}

/// The CPUs this process may run on (its affinity: `taskset`, a cgroup's
/// cpuset, a container's `--cpuset-cpus`), from `/proc/self/status`; empty
/// when unknown.
pub fn allowed() -> Vec<usize> {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
                .and_then(|l| parse_cpulist(l).ok())
        })
        .unwrap_or_default()
}

/// The CPUs online on this machine, from `/sys`; empty when unknown.
pub fn online() -> Vec<usize> {
    std::fs::read_to_string("/sys/devices/system/cpu/online")
        .ok()
        .and_then(|l| parse_cpulist(&l).ok())
        .unwrap_or_default()
}

/// Whether this process may run on only some of the machine's CPUs
/// (`taskset`, a NUMA binding, a container's cpuset): then it is taken to
/// have those cores to itself, so a thread of it that waits may spin
/// rather than sleep without slowing anyone.
pub fn pinned() -> bool {
    let (allowed, online) = (allowed(), online());
    !allowed.is_empty() && allowed.len() < online.len()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_parse_and_bad_ones_are_named() {
        assert_eq!(
            parse_cpulist("0-3,8,10-11\n").unwrap(),
            [0, 1, 2, 3, 8, 10, 11]
        );
        assert_eq!(parse_cpulist("").unwrap(), Vec::<usize>::new());
        assert!(parse_cpulist("3-1").unwrap_err().contains("backwards"));
        assert!(parse_cpulist("0-x").unwrap_err().contains("'x'"));
    }

    /// The standard library counts the same affinity (less a cgroup's
    /// CPU quota, so never more).
    #[test]
    fn this_process_runs_on_the_cpus_its_affinity_names() {
        let cpus = allowed();
        let usable = std::thread::available_parallelism().unwrap().get();
        assert!(cpus.len() >= usable, "{cpus:?} against {usable} usable");
    }
}
