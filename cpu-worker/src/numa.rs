//! NUMA placement: which cores and memory belong to a node (read from
//! /sys), and binding this process to one node — its threads to the node's
//! cores (`sched_setaffinity`) and its memory to the node's memory
//! (`set_mempolicy(MPOL_BIND)`), so routed experts are read from local
//! memory by local cores. Written on the two syscalls directly: hwloc or
//! libnuma would add a C library to every build for these two calls.
//!
//! Bind before any thread is started: threads inherit the affinity and the
//! memory policy of the thread that creates them (ggml's OpenMP pool, the
//! tokio runtime), and pages are placed by the policy of the thread that
//! first touches them (memory-mapped weights included).

use std::path::{Path, PathBuf};

/// The kernel's view of the machine's NUMA nodes.
pub const SYS_NODES: &str = "/sys/devices/system/node";

/// One NUMA node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Node {
    pub id: u32,
    /// Logical CPUs of the node.
    pub cpus: Vec<usize>,
    /// The node's memory (`MemTotal` in its meminfo), when known.
    pub mem_total: Option<u64>,
}

#[derive(Debug, thiserror::Error)]
pub enum NumaError {
    #[error("NUMA node {asked} does not exist; this machine has node(s) {have:?}")]
    NoSuchNode { asked: u32, have: Vec<u32> },
    #[error("NUMA node {0} has no CPUs this process may use")]
    NoCpus(u32),
    #[error("cannot read {path}: {why}")]
    Sys { path: PathBuf, why: String },
    #[error("{call} failed: {err}")]
    Syscall {
        call: &'static str,
        err: std::io::Error,
    },
}

/// What [`bind`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Binding {
    /// Threads pinned to `cpus`; memory bound to `node` unless the kernel
    /// refused (`memory_refused` says why: Docker's default seccomp profile
    /// allows `set_mempolicy` only with CAP_SYS_NICE).
    Bound {
        node: u32,
        cpus: Vec<usize>,
        memory_refused: Option<String>,
    },
    /// Not bound, and why (a machine or container that shows no NUMA nodes).
    Unbound { why: String },
}

pub use omni_telemetry::cpus::parse_cpulist;

/// The nodes under `root` (normally [`SYS_NODES`]); empty when it does not
/// exist.
pub fn nodes_in(root: &Path) -> Result<Vec<Node>, NumaError> {
    let Ok(dir) = std::fs::read_dir(root) else {
        return Ok(Vec::new());
    };
    let sys = |path: PathBuf, why: String| NumaError::Sys { path, why };
    let mut nodes = Vec::new();
    for entry in dir.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(id) = name
            .strip_prefix("node")
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let list = entry.path().join("cpulist");
        let text = std::fs::read_to_string(&list).map_err(|e| sys(list.clone(), e.to_string()))?;
        let cpus = parse_cpulist(&text).map_err(|e| sys(list, e))?;
        let mem_total = std::fs::read_to_string(entry.path().join("meminfo"))
            .ok()
            .and_then(|m| meminfo_total(&m));
        nodes.push(Node {
            id,
            cpus,
            mem_total,
        });
    }
    nodes.sort_by_key(|n| n.id);
    Ok(nodes)
}

/// `Node 0 MemTotal:  32768 kB` → bytes.
fn meminfo_total(text: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.contains("MemTotal:"))?;
    let kb: u64 = line.split_whitespace().rev().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// This machine's nodes.
pub fn nodes() -> Result<Vec<Node>, NumaError> {
    nodes_in(Path::new(SYS_NODES))
}

/// The CPUs this process may run on now.
pub fn allowed_cpus() -> Result<Vec<usize>, NumaError> {
    // SAFETY: an all-zero cpu_set_t is a valid empty set, and the kernel
    // writes at most size_of::<cpu_set_t>() bytes into it.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: pid 0 is this thread; `set` is a live, writable cpu_set_t of the size given.
    let rc =
        unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) };
    if rc != 0 {
        return Err(NumaError::Syscall {
            call: "sched_getaffinity",
            err: std::io::Error::last_os_error(),
        });
    }
    Ok((0..libc::CPU_SETSIZE as usize)
        // SAFETY: i < CPU_SETSIZE, the size of the set.
        .filter(|&i| unsafe { libc::CPU_ISSET(i, &set) })
        .collect())
}

/// Binds this process (call it before starting threads) to `node`:
/// threads to the node's CPUs that it may use, memory to the node's
/// memory. A machine that shows no NUMA nodes is left unbound, and says so.
pub fn bind(node: u32) -> Result<Binding, NumaError> {
    bind_in(Path::new(SYS_NODES), node)
}

fn bind_in(root: &Path, node: u32) -> Result<Binding, NumaError> {
    let all = nodes_in(root)?;
    if all.is_empty() {
        return Ok(Binding::Unbound {
            why: format!("{} shows no NUMA nodes", root.display()),
        });
    }
    let Some(n) = all.iter().find(|n| n.id == node) else {
        return Err(NumaError::NoSuchNode {
            asked: node,
            have: all.iter().map(|n| n.id).collect(),
        });
    };
    let allowed = allowed_cpus()?;
    let cpus: Vec<usize> = n
        .cpus
        .iter()
        .copied()
        .filter(|c| allowed.contains(c))
        .collect();
    if cpus.is_empty() {
        return Err(NumaError::NoCpus(node));
    }
    pin(&cpus)?;
    let memory_refused = match bind_memory(node) {
        Ok(()) => None,
        Err(NumaError::Syscall { err, .. }) if err.raw_os_error() == Some(libc::EPERM) => Some(
            format!("set_mempolicy(MPOL_BIND) was refused ({err}); in a container, add the SYS_NICE capability"),
        ),
        Err(e) => return Err(e),
    };
    Ok(Binding::Bound {
        node,
        cpus,
        memory_refused,
    })
}

fn pin(cpus: &[usize]) -> Result<(), NumaError> {
    // SAFETY: an all-zero cpu_set_t is a valid empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for &c in cpus.iter().filter(|&&c| c < libc::CPU_SETSIZE as usize) {
        // SAFETY: c < CPU_SETSIZE, the size of the set.
        unsafe { libc::CPU_SET(c, &mut set) };
    }
    // SAFETY: pid 0 is this thread; `set` is a valid cpu_set_t of the size given.
    let rc = unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) };
    if rc != 0 {
        return Err(NumaError::Syscall {
            call: "sched_setaffinity",
            err: std::io::Error::last_os_error(),
        });
    }
    Ok(())
}

/// `MPOL_BIND` from <linux/mempolicy.h>.
const MPOL_BIND: libc::c_int = 2;

fn bind_memory(node: u32) -> Result<(), NumaError> {
    let bits = u64::BITS as usize;
    let mut mask = vec![0u64; node as usize / bits + 1];
    mask[node as usize / bits] |= 1 << (node as usize % bits);
    let maxnode = (mask.len() * bits) as libc::c_ulong;
    // SAFETY: set_mempolicy reads `maxnode` bits from `mask`, which holds
    // mask.len() * 64 bits and outlives the call.
    let rc = unsafe { libc::syscall(libc::SYS_set_mempolicy, MPOL_BIND, mask.as_ptr(), maxnode) };
    if rc != 0 {
        return Err(NumaError::Syscall {
            call: "set_mempolicy(MPOL_BIND)",
            err: std::io::Error::last_os_error(),
        });
    }
    Ok(())
}

/// The nodes this thread's memory is bound to (`MPOL_BIND`), or None
/// when its policy is another (the default: local allocation).
pub fn memory_binding() -> Result<Option<Vec<u32>>, NumaError> {
    let mut mode: libc::c_int = 0;
    let mut mask = [0u64; 16];
    let maxnode = (mask.len() * 64) as libc::c_ulong;
    // SAFETY: get_mempolicy writes one int to `mode` and at most `maxnode`
    // bits to `mask`, which holds 16 * 64 bits; both outlive the call.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_get_mempolicy,
            &mut mode as *mut libc::c_int,
            mask.as_mut_ptr(),
            maxnode,
            std::ptr::null::<libc::c_void>(),
            0 as libc::c_ulong,
        )
    };
    if rc != 0 {
        return Err(NumaError::Syscall {
            call: "get_mempolicy",
            err: std::io::Error::last_os_error(),
        });
    }
    if mode != MPOL_BIND {
        return Ok(None);
    }
    Ok(Some(
        (0..maxnode as u32)
            .filter(|&n| mask[n as usize / 64] & (1 << (n % 64)) != 0)
            .collect(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake /sys with two nodes: node ids, CPUs and memory come from it.
    #[test]
    fn nodes_are_read_from_sys() {
        let root = tempfile::tempdir().unwrap();
        for (id, cpus, kb) in [(0, "0-1", 1024), (1, "2-3", 2048)] {
            let d = root.path().join(format!("node{id}"));
            std::fs::create_dir(&d).unwrap();
            std::fs::write(d.join("cpulist"), format!("{cpus}\n")).unwrap();
            std::fs::write(
                d.join("meminfo"),
                format!("Node {id} MemTotal:       {kb} kB\nNode {id} MemFree: 1 kB\n"),
            )
            .unwrap();
        }
        std::fs::create_dir(root.path().join("power")).unwrap();
        let nodes = nodes_in(root.path()).unwrap();
        assert_eq!(nodes.len(), 2);
        assert_eq!(nodes[1].cpus, [2, 3]);
        assert_eq!(nodes[1].mem_total, Some(2048 * 1024));
        let err = bind_in(root.path(), 7).unwrap_err().to_string();
        assert!(err.contains("node 7") && err.contains("[0, 1]"), "{err}");
        let none = tempfile::tempdir().unwrap();
        let gone = none.path().join("missing");
        assert!(matches!(
            bind_in(&gone, 0).unwrap(),
            Binding::Unbound { .. }
        ));
    }

    /// Binding to this machine's first node really pins and binds (checked
    /// in /proc), in a child thread so the test harness is not affected.
    #[test]
    fn binding_pins_threads_and_memory() {
        let Some(first) = nodes().unwrap().first().cloned() else {
            eprintln!("this machine shows no NUMA nodes; nothing to bind");
            return;
        };
        std::thread::spawn(move || {
            let b = bind(first.id).unwrap();
            let Binding::Bound {
                cpus,
                memory_refused: None,
                ..
            } = b
            else {
                panic!("{b:?}")
            };
            assert_eq!(allowed_cpus().unwrap(), cpus);
            // A thread started now inherits the pinning.
            let child = std::thread::spawn(allowed_cpus).join().unwrap().unwrap();
            assert_eq!(child, cpus);
            assert_eq!(memory_binding().unwrap(), Some(vec![first.id]));
        })
        .join()
        .unwrap();
    }
}
