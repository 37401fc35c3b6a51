//! Moving frames (a small protobuf header plus the hidden-state bytes) from one
//! omni process to the next: a shared-memory ring when both ends share a host,
//! a gRPC stream otherwise.

pub mod link;
pub mod metrics;
pub mod shm;

pub use link::{host_id, Frame, Inbox, LinkError, LinkStats, Outbox, TransportChoice};
