//! A worker's errors (the gpu-worker's Worker service and the cpu-worker's
//! Experts service) and their one conversion to a `tonic::Status` with
//! details (`omni_proto::errors`), so the coordinator can tell a worker that
//! refuses a request from one that cannot reach its neighbours.

use omni_proto::errors::{self, Reason};
use tonic::{Code, Status};

#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// The next stage or an expert worker cannot be reached.
    #[error("{0}")]
    Unavailable(String),
    /// Not possible in this worker's state (nothing loaded, a move it is not
    /// part of, layers it cannot hold).
    #[error("{0}")]
    Refused(String),
    /// A request that is malformed (a switch without its header, OpenShm
    /// without the caller's ring).
    #[error("{0}")]
    BadRequest(String),
    #[error("{0}")]
    Internal(String),
}

impl WorkerError {
    pub fn unavailable(msg: impl Into<String>) -> Self {
        Self::Unavailable(msg.into())
    }
    pub fn refused(msg: impl Into<String>) -> Self {
        Self::Refused(msg.into())
    }
    pub fn bad_request(msg: impl Into<String>) -> Self {
        Self::BadRequest(msg.into())
    }
    pub fn internal(msg: impl ToString) -> Self {
        Self::Internal(msg.to_string())
    }
}

impl From<WorkerError> for Status {
    fn from(e: WorkerError) -> Status {
        let msg = e.to_string();
        let (code, reason) = match e {
            WorkerError::Unavailable(_) => (Code::Unavailable, Reason::NotReady),
            WorkerError::Refused(_) => (Code::FailedPrecondition, Reason::Refused),
            WorkerError::BadRequest(_) => (Code::InvalidArgument, Reason::InvalidRequest),
            WorkerError::Internal(_) => (Code::Internal, Reason::Internal),
        };
        errors::status(code, reason, None, msg)
    }
}
