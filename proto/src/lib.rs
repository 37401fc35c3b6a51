//! omni's wire: the gRPC services and messages of `omni.worker.v1`,
//! `omni.coordinator.v1` and `omni.admin.v1`, generated from `proto/` by `build.rs`,
//! and [`errors`]: what a failed call says in a form a program can read.

pub mod errors;
#[cfg(feature = "engine")]
pub mod sampling;

pub mod worker {
    pub mod v1 {
        tonic::include_proto!("omni.worker.v1");
    }
}

pub mod coordinator {
    pub mod v1 {
        tonic::include_proto!("omni.coordinator.v1");
    }
}

pub mod admin {
    pub mod v1 {
        tonic::include_proto!("omni.admin.v1");
    }
}
