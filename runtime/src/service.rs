//! The `main` of every omni service, and what its `healthcheck` probes.

use std::future::Future;
use std::time::Duration;

use omni_telemetry::{init, TelemetryArgs};

/// The `main` of every omni service: logs and traces, a runtime, and `run`
/// raced against Ctrl-C and SIGTERM, so that stopping drops everything
/// `run` holds (shared-memory rings are unlinked on drop) instead of waiting
/// for open streams. The last traces are flushed before the process exits.
pub fn service_main<F>(service: &str, instance: Option<&str>, args: &TelemetryArgs, run: F) -> !
where
    F: Future<Output = anyhow::Result<()>>,
{
    main_of(service, instance, args, run, true)
}

/// [`service_main`] for a service whose `run` itself stops gracefully on
/// Ctrl-C and SIGTERM ([`shutdown_signal`]): the router, which finishes the
/// requests in flight first.
pub fn service_main_graceful<F>(
    service: &str,
    instance: Option<&str>,
    args: &TelemetryArgs,
    run: F,
) -> !
where
    F: Future<Output = anyhow::Result<()>>,
{
    main_of(service, instance, args, run, false)
}

fn main_of<F>(
    service: &str,
    instance: Option<&str>,
    args: &TelemetryArgs,
    run: F,
    stop_at_signal: bool,
) -> !
where
    F: Future<Output = anyhow::Result<()>>,
{
    let fail = |e: anyhow::Error| -> ! {
        eprintln!("{service}: error: {e:#}");
        std::process::exit(1)
    };
    let telemetry = init(service, instance, args).unwrap_or_else(|e| fail(e));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap_or_else(|e| fail(e.into()));
    let result = rt.block_on(async {
        if !stop_at_signal {
            return run.await;
        }
        tokio::select! {
            r = run => r,
            _ = shutdown_signal() => Ok(()),
        }
    });
    rt.shutdown_timeout(Duration::from_secs(2));
    drop(telemetry);
    match result {
        Ok(()) => std::process::exit(0),
        Err(e) => fail(e),
    }
}

/// Resolves on Ctrl-C or SIGTERM.
pub async fn shutdown_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("installing a SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}

/// The address to probe for a service that listens on `listen`: a
/// wildcard host (0.0.0.0, [::]) is probed on loopback. Port 0 (a port
/// picked at start) cannot be probed.
pub fn probe_addr(listen: &str) -> Result<String, String> {
    let (host, port) = listen
        .rsplit_once(':')
        .ok_or_else(|| format!("'{listen}' is not HOST:PORT"))?;
    if port == "0" {
        return Err(format!(
            "'{listen}' has port 0 (picked at start): give the address to probe with --addr"
        ));
    }
    let host = match host {
        "0.0.0.0" | "" => "127.0.0.1",
        "[::]" => "[::1]",
        h => h,
    };
    Ok(format!("{host}:{port}"))
}

/// Forgets every empty `OMNI_*` and `OTEL_*` variable, so that an empty
/// one is as if unset (a compose file's `${OMNI_NUMA_NODE:-}` gives empty
/// strings, which flags would otherwise refuse). Call first in `main`,
/// before any thread starts.
pub fn forget_empty_settings() {
    for (k, v) in std::env::vars_os() {
        let key = k.to_string_lossy();
        if v.is_empty() && (key.starts_with("OMNI_") || key.starts_with("OTEL_")) {
            std::env::remove_var(&k);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wildcards_are_probed_on_loopback_and_port_0_is_refused() {
        assert_eq!(probe_addr("0.0.0.0:50051").unwrap(), "127.0.0.1:50051");
        assert_eq!(probe_addr("[::]:7070").unwrap(), "[::1]:7070");
        assert_eq!(probe_addr("w0:50051").unwrap(), "w0:50051");
        assert!(probe_addr("127.0.0.1:0").unwrap_err().contains("--addr"));
        assert!(probe_addr("nonsense").unwrap_err().contains("HOST:PORT"));
    }
}
