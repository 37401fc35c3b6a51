//! The start of every service's `main`: the command line through the
//! [`crate::config`] chain, and the two subcommands every service has:
//! `print-config` (the merged settings as its TOML table, then exit) and
//! `healthcheck` (probe the running service, then exit; the container
//! health check).
//!
//! A service's command line `C` is its settings flattened beside a
//! `--config` flag and a `Healthcheck` subcommand with `--config`, `--addr`
//! and `--timeout`. The address a health check probes is `--addr`, else the
//! service's `listen` setting as the chain gives it (the file named by
//! `--config` or `OMNI_CONFIG`, `OMNI_<SERVICE>_LISTEN`), a wildcard host
//! probed on loopback.

use crate::config::{merge, render, Merged, Service};
use std::ffi::OsString;
use std::path::PathBuf;

/// What a command line gave: the settings, where each came from, and,
/// for `print-config`, the table to print.
#[derive(Debug)]
pub struct Parsed<T> {
    /// The settings; for `print-config`, `None` when a required one is
    /// missing (print-config shows what is there).
    pub settings: Option<T>,
    pub merged: Merged,
    /// `print-config`'s table (each setting with its source, secrets
    /// masked) when that was asked.
    pub print: Option<String>,
}

/// Why a command line was refused.
#[derive(Debug)]
pub enum ParseError {
    /// A key, variable or file the chain refused (named in the message).
    Chain(String),
    /// What clap refused, or `--help`.
    Clap(clap::Error),
}

impl std::fmt::Display for ParseError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ParseError::Chain(e) => write!(f, "{e}"),
            ParseError::Clap(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for ParseError {}

impl ParseError {
    /// Prints the error as the service `what` and exits (2; clap's own
    /// status for clap's errors and help).
    pub fn exit(self, what: &str) -> ! {
        match self {
            ParseError::Chain(e) => {
                eprintln!("{what}: {e}");
                std::process::exit(2)
            }
            ParseError::Clap(e) => e.exit(),
        }
    }
}

/// Parses `argv` (without the program name) for the service command `cmd`
/// through the chain (file, `env`, flags). With `printing`, no setting is
/// required and [`Parsed::print`] holds the table.
pub fn parse<T: clap::FromArgMatches>(
    what: &str,
    cmd: clap::Command,
    svc: Service,
    argv: &[OsString],
    env: &[(String, String)],
    printing: bool,
) -> Result<Parsed<T>, ParseError> {
    let (cmd, matches, merged) = chain_matches(what, cmd, svc, argv, env, printing)?;
    let print = printing.then(|| render(&cmd, svc, &matches, &merged));
    let settings = match T::from_arg_matches(&matches) {
        Ok(t) => Some(t),
        Err(_) if printing => None,
        Err(e) => return Err(ParseError::Clap(e)),
    };
    Ok(Parsed {
        settings,
        merged,
        print,
    })
}

/// The layers of `argv` and `env` put before the flags, and what clap makes
/// of them for `cmd` (made lenient: no setting required, with `lenient`).
fn chain_matches(
    what: &str,
    cmd: clap::Command,
    svc: Service,
    argv: &[OsString],
    env: &[(String, String)],
    lenient: bool,
) -> Result<(clap::Command, clap::ArgMatches, Merged), ParseError> {
    let mut cmd = cmd.args_override_self(true);
    if lenient {
        cmd = cmd.mut_args(|a| a.required(false));
    }
    let merged = merge(&cmd, svc, argv, env).map_err(ParseError::Chain)?;
    let full = std::iter::once(OsString::from(what)).chain(merged.argv.iter().cloned());
    let matches = cmd
        .clone()
        .try_get_matches_from(full)
        .map_err(ParseError::Clap)?;
    Ok((cmd, matches, merged))
}

/// The start of `main` for the service binary `what` with command line
/// `C`: forgets empty settings; `healthcheck` runs `probe` with the address
/// to probe (see the module) and its own arguments, and exits with what it
/// returns; otherwise the settings are parsed (see [`parse`]), exiting with
/// the reason when they are refused.
pub fn start<C, T>(
    what: &str,
    svc: Service,
    probe: impl FnOnce(&str, &clap::ArgMatches) -> i32,
) -> Parsed<T>
where
    C: clap::CommandFactory,
    T: clap::FromArgMatches,
{
    crate::forget_empty_settings();
    let args: Vec<OsString> = std::env::args_os().skip(1).collect();
    let env: Vec<(String, String)> = std::env::vars().collect();
    let first = args.first().and_then(|a| a.to_str()).unwrap_or("");
    if matches!(
        first,
        "healthcheck" | "help" | "-h" | "--help" | "-V" | "--version"
    ) {
        let matches = C::command().get_matches();
        if let Some(("healthcheck", m)) = matches.subcommand() {
            let who = format!("{what} healthcheck");
            let chain = healthcheck_chain::<C>(what, svc, m, &env).unwrap_or_else(|e| e.exit(&who));
            let addr = match m.get_one::<String>("addr") {
                Some(a) => a.clone(),
                None => chain
                    .get_one::<String>("listen")
                    .cloned()
                    .unwrap_or_else(|| {
                        ParseError::Chain("no listen address: give --addr".into()).exit(&who)
                    }),
            };
            // The probe speaks the service's own TLS, from the same chain.
            let path = |id: &str| chain.try_get_one::<PathBuf>(id).ok().flatten().cloned();
            let tls = omni_transport::tls::TlsArgs {
                tls_ca: path("tls_ca"),
                tls_cert: path("tls_cert"),
                tls_key: path("tls_key"),
            };
            if let Err(e) = omni_transport::tls::install(&tls) {
                eprintln!("{who}: {e}");
                std::process::exit(2);
            }
            std::process::exit(probe(&addr, m));
        }
        std::process::exit(0);
    }
    let printing = first == "print-config";
    let rest = if printing { &args[1..] } else { &args[..] };
    parse(what, C::command(), svc, rest, &env, printing).unwrap_or_else(|e| e.exit(what))
}

/// The service's settings as the chain gives them for a health check (its
/// `--config`, the environment; no flags): its `listen` and TLS.
fn healthcheck_chain<C: clap::CommandFactory>(
    what: &str,
    svc: Service,
    healthcheck: &clap::ArgMatches,
    env: &[(String, String)],
) -> Result<clap::ArgMatches, ParseError> {
    let mut argv = Vec::new();
    if let Some(file) = healthcheck.get_one::<PathBuf>("config") {
        argv.push(OsString::from(crate::config::CONFIG_FLAG));
        argv.push(file.clone().into_os_string());
    }
    let (_, matches, _) = chain_matches(what, C::command(), svc, &argv, env, true)?;
    Ok(matches)
}

/// [`start`] for a gRPC service whose health check asks for `health_service`
/// (`grpc.health.v1`); prints the table and exits for `print-config`.
pub fn settings_or_healthcheck<C, T>(what: &str, health_service: &str, svc: Service) -> T
where
    C: clap::CommandFactory,
    T: clap::FromArgMatches,
{
    let parsed = start::<C, T>(what, svc, |addr, m| {
        let timeout = *m
            .get_one::<f64>("timeout")
            .expect("--timeout has a default");
        // The server's own entry ("") is SERVING as soon as it listens.
        let service = if m.get_flag("live") {
            ""
        } else {
            health_service
        };
        crate::health::healthcheck_main(what, addr, service, timeout)
    });
    if let Some(table) = parsed.print {
        print!("{table}");
        std::process::exit(0);
    }
    // `parse` gives the settings whenever it is not printing.
    parsed.settings.unwrap_or_else(|| {
        eprintln!("{what}: the settings are incomplete");
        std::process::exit(2)
    })
}

/// The subcommands of every gRPC service (`omni_runtime::start` reads them
/// by name; the services only declare them).
#[derive(Clone, Debug, clap::Subcommand)]
pub enum ServiceCommand {
    /// Probe the running service's gRPC health (exit 0 when SERVING; a
    /// coordinator serves once its workers registered and the model is
    /// loaded): the container health check, which needs no shell and no curl.
    Healthcheck(HealthcheckArgs),
    /// Print the settings this service would run with, as the TOML table of
    /// its config file: each with where it came from (default, file,
    /// variable, flag), secrets masked. Takes the service's flags.
    PrintConfig,
}

/// The `healthcheck` subcommand's arguments, the same for every service.
#[derive(Clone, Debug, clap::Args)]
pub struct HealthcheckArgs {
    /// A config file to read the service's `listen` from (also OMNI_CONFIG,
    /// else ./omni.toml when there is one).
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// The address to probe [default: the service's `listen` setting (the
    /// config file, then OMNI_<SERVICE>_LISTEN), 0.0.0.0 as 127.0.0.1].
    #[arg(long)]
    pub addr: Option<String>,
    /// Seconds to wait for the answer.
    #[arg(long, default_value_t = 3.0)]
    pub timeout: f64,
    /// Only that the process answers, not that it serves (a coordinator
    /// waiting for its workers is live): for orchestrators that publish a
    /// service's name only once it is healthy, as Swarm does, where workers
    /// must find the coordinator that waits for them.
    #[arg(long)]
    pub live: bool,
}
