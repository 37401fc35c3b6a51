//! cpu-worker: executes MoE routed experts on one NUMA node. So far: NUMA
//! placement (`numa`); the expert service arrives with the rest of the MoE
//! issue.

pub mod numa;
