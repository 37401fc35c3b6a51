//! gRPC health (`grpc.health.v1`): the probe the coordinator runs on its
//! workers, and what the `healthcheck` subcommand of every gRPC service
//! binary runs for container health checks (exec form, so it works in an
//! image with no shell and no curl; see [`crate::start`]).

use std::time::Duration;
use tonic_health::pb::{
    health_check_response::ServingStatus, health_client::HealthClient, HealthCheckRequest,
};

/// Asks `addr` for the health of `service` ("" is the server as a whole)
/// within `wait`. Ok only for SERVING; the error says what came back.
pub async fn check(addr: &str, service: &str, wait: Duration) -> Result<(), String> {
    let ask = async {
        let ch = omni_transport::tls::endpoint(addr)
            .map_err(|e| format!("bad address {addr}: {e}"))?
            .connect_timeout(wait)
            .connect()
            .await
            .map_err(|e| {
                format!(
                    "cannot connect to {addr}: {}",
                    omni_transport::tls::describe(&e)
                )
            })?;
        let reply = HealthClient::new(ch)
            .check(HealthCheckRequest {
                service: service.to_string(),
            })
            .await
            .map_err(|s| s.message().to_string())?;
        match reply.get_ref().status() {
            ServingStatus::Serving => Ok(()),
            other => Err(format!("{} ({addr})", other.as_str_name())),
        }
    };
    tokio::time::timeout(wait, ask)
        .await
        .map_err(|_| format!("no answer from {addr} within {:.0}s", wait.as_secs_f64()))?
}

/// The `healthcheck` subcommand: probes the service listening on `listen`
/// and returns the process exit status (0 healthy, 1 not, 2 a bad
/// argument), printing why.
pub fn healthcheck_main(what: &str, listen: &str, service: &str, wait_secs: f64) -> i32 {
    let Ok(wait) = Duration::try_from_secs_f64(wait_secs) else {
        eprintln!("{what} healthcheck: --timeout {wait_secs} is not a number of seconds");
        return 2;
    };
    let addr = match crate::probe_addr(listen) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{what} healthcheck: {e}");
            return 2;
        }
    };
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("{what} healthcheck: {e}");
            return 2;
        }
    };
    let name = if service.is_empty() {
        "server"
    } else {
        service
    };
    match rt.block_on(check(&addr, service, wait)) {
        Ok(()) => {
            println!("{what} at {addr}: {name} SERVING");
            0
        }
        Err(why) => {
            eprintln!("{what} at {addr}: {name} not healthy: {why}");
            1
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nothing_listening_is_unhealthy_with_the_reason() {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let code = healthcheck_main("test", &format!("127.0.0.1:{port}"), "", 2.0);
        assert_eq!(code, 1);
    }
}
