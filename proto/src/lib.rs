//! gRPC definitions (`omni.worker.v1`, `omni.coordinator.v1`, `omni.admin.v1`). Filled by the cluster issue.
