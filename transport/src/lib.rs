//! Moving frames (a small protobuf header plus the hidden-state bytes) from one
//! omni process to the next: a shared-memory ring when both ends share a host,
//! a gRPC stream otherwise.

pub mod experts;
pub mod link;
pub mod shm;
pub mod tls;

pub use experts::{ExpertLink, ExpertLinkError};
pub use link::{
    host_id, Bell, BellSender, Frame, Inbox, InboxReader, LinkError, LinkStats, Next, Outbox,
    TransportChoice,
};
