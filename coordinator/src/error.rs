//! The coordinator's errors, and the one conversion to what crosses the
//! wire: a `tonic::Status` whose details name the reason and, for a bad
//! request, the field at fault by its path in `GenerateRequest` (see
//! `omni_proto::errors`). The router turns those into OpenAI's `param` and
//! `code` without reading the message.

use omni_proto::errors::{self, Reason};
use tonic::{Code, Status};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A request field is wrong; `field` is its path in the request
    /// (`prompt`, `max_tokens`, `sampling.temperature`, `chat.tool_choice`).
    #[error("{msg}")]
    Invalid { field: String, msg: String },
    /// The prompt leaves no room in the context.
    #[error("{0}")]
    PromptTooLong(String),
    /// What is asked is not something this cluster does (a chat on a model
    /// without a chat template, a worker joining after the plan).
    #[error("{0}")]
    Unsupported(String),
    /// Not serving yet, or shutting down.
    #[error("{0}")]
    NotReady(String),
    /// Too many requests are waiting.
    #[error("{0}")]
    Busy(String),
    /// The request was stopped by a failure in the cluster.
    #[error("{0}")]
    Stopped(String),
    /// An admin call without the right token.
    #[error("{0}")]
    Unauthenticated(String),
    /// A worker (or other thing a call names) that does not exist.
    #[error("{0}")]
    NotFound(String),
    /// An admin request the cluster will not carry out as things are.
    #[error("{0}")]
    Refused(String),
    /// A move that failed and was rolled back.
    #[error("{0}")]
    Aborted(String),
    /// A request that is wrong as a whole, not in one field.
    #[error("{0}")]
    BadRequest(String),
    #[error("{0}")]
    Internal(String),
}

impl Error {
    pub fn not_ready(msg: impl Into<String>) -> Error {
        Error::NotReady(msg.into())
    }
    pub fn unauthenticated(msg: impl Into<String>) -> Error {
        Error::Unauthenticated(msg.into())
    }
    pub fn not_found(msg: impl Into<String>) -> Error {
        Error::NotFound(msg.into())
    }
    pub fn refused(msg: impl Into<String>) -> Error {
        Error::Refused(msg.into())
    }
    pub fn aborted(msg: impl Into<String>) -> Error {
        Error::Aborted(msg.into())
    }
    pub fn invalid_request(msg: impl Into<String>) -> Error {
        Error::BadRequest(msg.into())
    }
    pub fn internal(msg: impl Into<String>) -> Error {
        Error::Internal(msg.into())
    }
    pub fn invalid(field: impl Into<String>, msg: impl Into<String>) -> Error {
        Error::Invalid {
            field: field.into(),
            msg: msg.into(),
        }
    }
}

impl From<Error> for Status {
    fn from(e: Error) -> Status {
        let msg = e.to_string();
        match e {
            Error::Invalid { field, .. } => errors::invalid(&field, msg),
            Error::PromptTooLong(_) => errors::status(
                Code::InvalidArgument,
                Reason::PromptTooLong,
                Some("prompt"),
                msg,
            ),
            Error::Unsupported(_) => {
                errors::status(Code::FailedPrecondition, Reason::Unsupported, None, msg)
            }
            Error::NotReady(_) => errors::status(Code::Unavailable, Reason::NotReady, None, msg),
            Error::Busy(_) => errors::status(Code::Unavailable, Reason::Busy, None, msg),
            Error::Stopped(_) => errors::status(Code::Unavailable, Reason::Stopped, None, msg),
            Error::Unauthenticated(_) => {
                errors::status(Code::Unauthenticated, Reason::Unauthenticated, None, msg)
            }
            Error::NotFound(_) => errors::status(Code::NotFound, Reason::NotFound, None, msg),
            Error::Refused(_) => {
                errors::status(Code::FailedPrecondition, Reason::Refused, None, msg)
            }
            Error::Aborted(_) => errors::status(Code::Aborted, Reason::Aborted, None, msg),
            Error::BadRequest(_) => {
                errors::status(Code::InvalidArgument, Reason::InvalidRequest, None, msg)
            }
            Error::Internal(_) => errors::status(Code::Internal, Reason::Internal, None, msg),
        }
    }
}
