//! Errors across the wire that a program can read. A service's error enum
//! becomes a `tonic::Status` through [`status`], which attaches google.rpc
//! details (tonic-types): an `ErrorInfo` with a [`Reason`] (domain `omni`)
//! and, for a bad request, a `BadRequest` naming the field at fault by its
//! path in the request message (`sampling.temperature`, `chat.tool_choice`).
//! Clients read them back with [`reason`] and [`field`], never by matching
//! the message, which is for people.

use std::collections::HashMap;

use tonic::{Code, Status};
use tonic_types::{ErrorDetails, StatusExt};

/// `ErrorInfo.domain` of every omni error.
pub const DOMAIN: &str = "omni";

/// Why a call failed, as `ErrorInfo.reason` carries it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reason {
    /// A request field is wrong (the `BadRequest` detail names it).
    InvalidRequest,
    /// The prompt leaves no room in the context.
    PromptTooLong,
    /// What the request asks is not something this cluster serves (a chat
    /// on a model without a chat template).
    Unsupported,
    /// The cluster is not serving yet, or is shutting down.
    NotReady,
    /// Too many requests are waiting; retry later.
    Busy,
    /// The request was stopped by a failure in the cluster (a worker lost
    /// for good, a step that timed out).
    Stopped,
    /// The call lacks the right credentials (the admin token).
    Unauthenticated,
    /// What the call names does not exist (a worker id).
    NotFound,
    /// The cluster will not do it as things are (a move its plan refuses).
    Refused,
    /// It was tried and failed, and everything is as before (a move rolled back).
    Aborted,
    /// A bug or a broken invariant.
    Internal,
}

impl Reason {
    pub const ALL: [Reason; 11] = [
        Reason::InvalidRequest,
        Reason::PromptTooLong,
        Reason::Unsupported,
        Reason::NotReady,
        Reason::Busy,
        Reason::Stopped,
        Reason::Unauthenticated,
        Reason::NotFound,
        Reason::Refused,
        Reason::Aborted,
        Reason::Internal,
    ];

    /// The `ErrorInfo.reason` text (UPPER_SNAKE_CASE, as google.rpc asks).
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::InvalidRequest => "INVALID_REQUEST",
            Reason::PromptTooLong => "PROMPT_TOO_LONG",
            Reason::Unsupported => "UNSUPPORTED",
            Reason::NotReady => "NOT_READY",
            Reason::Busy => "BUSY",
            Reason::Stopped => "STOPPED",
            Reason::Unauthenticated => "UNAUTHENTICATED",
            Reason::NotFound => "NOT_FOUND",
            Reason::Refused => "REFUSED",
            Reason::Aborted => "ABORTED",
            Reason::Internal => "INTERNAL",
        }
    }

    fn from_str(s: &str) -> Option<Reason> {
        Reason::ALL.into_iter().find(|r| r.as_str() == s)
    }
}

/// A `Status` with `code`, the message people read, and the details a
/// program reads: `reason`, and `field` (the request field at fault) when
/// there is one.
pub fn status(
    code: Code,
    reason: Reason,
    field: Option<&str>,
    message: impl Into<String>,
) -> Status {
    let message = message.into();
    let mut details = ErrorDetails::with_error_info(reason.as_str(), DOMAIN, HashMap::new());
    if let Some(f) = field {
        details.add_bad_request_violation(f, message.clone());
    }
    Status::with_error_details(code, message, details)
}

/// INVALID_ARGUMENT about the request field `field`.
pub fn invalid(field: &str, message: impl Into<String>) -> Status {
    status(
        Code::InvalidArgument,
        Reason::InvalidRequest,
        Some(field),
        message,
    )
}

/// The reason an omni service gave, if the status carries one.
pub fn reason(s: &Status) -> Option<Reason> {
    s.get_error_details()
        .error_info()
        .filter(|i| i.domain == DOMAIN)
        .and_then(|i| Reason::from_str(&i.reason))
}

/// The request field a status is about, if it names one.
pub fn field(s: &Status) -> Option<String> {
    s.get_error_details()
        .bad_request()
        .and_then(|b| b.field_violations.first())
        .map(|v| v.field.clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn details_survive_the_wire_form() {
        let s = invalid("sampling.temperature", "temperature is -1");
        // What a client decodes: the code, the message and the details bytes.
        let back = Status::with_details(s.code(), s.message(), s.details().to_vec().into());
        assert_eq!(back.code(), Code::InvalidArgument);
        assert_eq!(back.message(), "temperature is -1");
        assert_eq!(reason(&back), Some(Reason::InvalidRequest));
        assert_eq!(field(&back).as_deref(), Some("sampling.temperature"));
        let plain = Status::invalid_argument("no details");
        assert_eq!((reason(&plain), field(&plain)), (None, None));
        for r in Reason::ALL {
            assert_eq!(Reason::from_str(r.as_str()), Some(r));
        }
    }
}
