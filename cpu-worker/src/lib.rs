//! omni's expert worker: runs the routed experts of MoE layers whose
//! experts do not fit on a device, on the cores and memory of one NUMA node.
//!
//! `numa` binds the process to its node (before any thread starts);
//! `service` registers with the coordinator as an expert worker and serves
//! `omni.worker.v1.Experts`; `compute` is the one thread that computes
//! every call and reads the stages' shared-memory rings itself.

mod compute;
pub mod numa;
pub mod service;
