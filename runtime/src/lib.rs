//! What every omni service process shares around its own work: its settings
//! ([`config`]: defaults, file, environment, flags; [`start`]: the command
//! line with `print-config` and `healthcheck`), the `main`
//! ([`service_main`]: logs and traces, a runtime, Ctrl-C and SIGTERM),
//! secrets from files ([`secrets`]), the `healthcheck` subcommand and the
//! health probe ([`health`]), the `/metrics` listener ([`metrics`]), and
//! joining a cluster ([`registry`]: listen, register with the coordinator,
//! stop when it goes away). `omni-transport` is left with moving frames.

pub mod config;
pub mod health;
pub mod metrics;
pub mod registry;
pub mod secrets;
mod service;
pub mod start;
mod worker_error;

pub use secrets::{read_secret, value_or_secret_file, warn_secret_flags};
pub use service::{
    forget_empty_settings, probe_addr, service_main, service_main_graceful, shutdown_signal,
};
pub use worker_error::WorkerError;
