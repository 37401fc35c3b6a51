//! cpu-worker: executes MoE routed experts on a NUMA node. Filled by the MoE issue.
