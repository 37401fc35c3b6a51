//! Coordinator: planner, scheduler, sequence log, admin and inference services. Filled by the cluster issue.
