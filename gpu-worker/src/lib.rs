//! gpu-worker: executes a layer range on one device. Filled by the cluster issue.
