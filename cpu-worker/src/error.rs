//! The Experts service's errors and their one conversion to a `tonic::Status`
//! with details (`omni_proto::errors`).

use omni_proto::errors::{self, Reason};
use tonic::{Code, Status};

#[derive(Debug, thiserror::Error)]
pub enum ExpertsError {
    /// Not serving (shutting down).
    #[error("{0}")]
    Unavailable(String),
    /// Not possible in this worker's state (no experts loaded, layers it
    /// cannot hold).
    #[error("{0}")]
    Refused(String),
    /// A request that is malformed (OpenShm without the caller's ring).
    #[error("{0}")]
    BadRequest(String),
    #[error("{0}")]
    Internal(String),
}

impl ExpertsError {
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

impl From<ExpertsError> for Status {
    fn from(e: ExpertsError) -> Status {
        let msg = e.to_string();
        let (code, reason) = match e {
            ExpertsError::Unavailable(_) => (Code::Unavailable, Reason::NotReady),
            ExpertsError::Refused(_) => (Code::FailedPrecondition, Reason::Refused),
            ExpertsError::BadRequest(_) => (Code::InvalidArgument, Reason::InvalidRequest),
            ExpertsError::Internal(_) => (Code::Internal, Reason::Internal),
        };
        errors::status(code, reason, None, msg)
    }
}
