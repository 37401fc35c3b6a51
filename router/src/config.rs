//! The router's settings, through the chain every service shares
//! ([`omni_runtime::config`]): defaults, the `[router]` table of the config
//! file (`--config`, `OMNI_CONFIG`, or `./omni.toml` when it exists),
//! `OMNI_ROUTER_<KEY>` variables, flags; then [`RouterSettings::validate`].
//! `omni-router print-config` shows the result.
//!
//! ```toml
//! [router]
//! listen = "0.0.0.0:8080"
//! auto = ["prompt_chars>2000=deepseek", "keyword:code=qwen", "default=qwen"]
//!
//! [[router.models]]
//! name = "deepseek"
//! coordinator = "10.0.0.2:7070"
//! aliases = ["oracle"]
//!
//! [[router.models]]
//! name = "qwen"
//! upstream = "http://10.0.0.3:8080/v1"   # an OpenAI-compatible server
//! upstream_model = "qwen2.5-coder"
//! ```
//!
//! Every flag is a key of the table and a variable: `--max-in-flight` is
//! `max_in_flight` and `OMNI_ROUTER_MAX_IN_FLIGHT`. The one key that is no
//! flag is `models`, the tables above; `model`/`upstream` specs (flags,
//! `OMNI_ROUTER_MODEL`, ...) replace them. Secrets (`api_key`, an
//! upstream's key) are better given through the environment
//! (`OMNI_ROUTER_API_KEY`, `OMNI_ROUTER_UPSTREAM_KEY`) or a file
//! (`OMNI_ROUTER_API_KEYS_FILE`, e.g. a compose secret) than written in the
//! config file; `print-config` masks them.

use crate::backends;
use omni_runtime::config::{Merged, Service};
use serde::{Deserialize, Serialize};
use std::collections::HashSet;
use std::path::PathBuf;

/// The router's place in the chain: its table, its variables, and the key
/// it reads itself.
pub const SERVICE: Service = Service {
    table: "router",
    env_prefix: "OMNI_ROUTER_",
    not_settings: &[],
    structured: &["models"],
};

/// What the router runs with, after merging.
#[derive(Clone, Debug, PartialEq)]
pub struct RouterSettings {
    /// Where the HTTP API listens.
    pub listen: String,
    /// The served models.
    pub models: Vec<ModelEntry>,
    /// Rules for the model name `auto`, tried in order: `CONDITION=MODEL`
    /// with conditions `prompt_chars>N`, `keyword:WORD` or `default`.
    /// `auto` is always served: without a `default` rule, requests no rule
    /// matches go to the first model.
    pub auto: Vec<String>,
    /// Keys clients must send as `Authorization: Bearer KEY`; none: open.
    pub api_keys: Vec<String>,
    /// Requests served at once; beyond it, 429 with Retry-After.
    pub max_in_flight: usize,
    /// Largest request body in bytes; beyond it, 413.
    pub body_limit: usize,
    /// How long a request whose coordinator went away waits for one to
    /// resume it (seconds); the client's stream pauses meanwhile.
    pub resume_timeout: f64,
    /// OTLP/HTTP base URL for traces; none: no traces.
    pub otlp_endpoint: Option<String>,
    /// Mutual TLS to the coordinators.
    pub tls: omni_transport::tls::TlsArgs,
}

/// One served model: a coordinator of an omni cluster, or an upstream
/// OpenAI-compatible server.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelEntry {
    pub name: String,
    /// The coordinator's gRPC address (host:port).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub coordinator: Option<String>,
    /// The upstream's base URL, ending in /v1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upstream: Option<String>,
    /// The upstream's name for the model (default: `name`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upstream_model: Option<String>,
    /// The key the upstream wants (also `--upstream-key NAME=KEY`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_key: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub aliases: Vec<String>,
}

/// The router's settings as flags (each also a key of the `[router]` table
/// and an `OMNI_ROUTER_<KEY>` variable).
#[derive(Clone, Debug, clap::Args)]
pub struct RouterConfig {
    /// Where the HTTP API listens.
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub listen: String,
    /// A served model: NAME=COORDINATOR_ADDR[,ALIAS...] (repeatable, or
    /// ';'-separated), e.g. `gemma3-270m=127.0.0.1:7070,gemma`. Models given
    /// here replace the config file's [[router.models]].
    #[arg(long = "model", value_delimiter = ';')]
    pub models: Vec<String>,
    /// An upstream OpenAI-compatible server: NAME=URL[#UPSTREAM_MODEL][,ALIAS...]
    /// (repeatable), e.g. `big=http://10.0.0.5:8080/v1#deepseek-r1,deepseek`.
    #[arg(long = "upstream", value_delimiter = ';')]
    pub upstreams: Vec<String>,
    /// Keys for upstreams: NAME=KEY (repeatable, or ';'-separated).
    #[arg(long = "upstream-key", value_delimiter = ';')]
    pub upstream_keys: Vec<String>,
    /// Rules for the model name `auto`, tried in order:
    /// `prompt_chars>2000=big;keyword:code=qwen;default=gemma`. Without a
    /// default rule, `auto` falls back to the first model.
    #[arg(long, value_delimiter = ';')]
    pub auto: Vec<String>,
    /// API keys clients must send as `Authorization: Bearer KEY`
    /// (comma-separated); none means no authentication. Better as
    /// OMNI_ROUTER_API_KEY or --api-keys-file: a flag shows in `ps`.
    #[arg(long = "api-key", value_delimiter = ',')]
    pub api_keys: Vec<String>,
    /// A file of API keys (one per line, or comma-separated), e.g. a
    /// compose secret at /run/secrets/api_keys; added to --api-key's.
    #[arg(long = "api-keys-file")]
    pub api_keys_file: Option<PathBuf>,
    /// Requests served at once; beyond it, 429 with Retry-After.
    #[arg(long, default_value_t = 64)]
    pub max_in_flight: usize,
    /// Largest request body in bytes; beyond it, 413.
    #[arg(long, default_value_t = 4 << 20)]
    pub body_limit: usize,
    /// How long a request whose coordinator went away (a crash, an
    /// upgrade) waits for a coordinator at the same address to resume it,
    /// in seconds: the client's stream pauses and goes on with the tokens
    /// it would have had. 0: the request fails at once.
    #[arg(long, default_value_t = 120.0)]
    pub resume_timeout: f64,
    #[command(flatten)]
    pub telemetry: omni_telemetry::TelemetryArgs,
    #[command(flatten)]
    pub tls: omni_transport::tls::TlsArgs,
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("config file {path}: [[router.models]]: {why}")]
    File { path: PathBuf, why: String },
    #[error("{0}")]
    Flag(String),
    #[error("invalid router settings: {0}")]
    Invalid(String),
}

impl RouterConfig {
    /// The models the specs (`--model`, `--upstream`) give.
    fn spec_models(&self) -> Result<Vec<ModelEntry>, ConfigError> {
        let mut models = Vec::new();
        for spec in &self.models {
            let (name, addr, aliases) = parse_spec("--model", spec)?;
            models.push(ModelEntry {
                name,
                coordinator: Some(addr),
                aliases,
                ..Default::default()
            });
        }
        for spec in &self.upstreams {
            let (name, url, aliases) = parse_spec("--upstream", spec)?;
            let (upstream, upstream_model) = match url.split_once('#') {
                Some((b, m)) => (b.to_string(), Some(m.to_string())),
                None => (url, None),
            };
            models.push(ModelEntry {
                name,
                upstream: Some(upstream),
                upstream_model,
                aliases,
                ..Default::default()
            });
        }
        Ok(models)
    }

    /// The file's `[[router.models]]` tables, if it has them.
    fn file_models(merged: &Merged) -> Result<Vec<ModelEntry>, ConfigError> {
        let Some(value) = merged.structured.get("models") else {
            return Ok(Vec::new());
        };
        value
            .clone()
            .try_into::<Vec<ModelEntry>>()
            .map_err(|e| ConfigError::File {
                path: merged.file.clone().unwrap_or_default(),
                why: e.message().trim().to_string(),
            })
    }

    /// Whether the models come from the config file's tables (no spec
    /// was given).
    pub fn models_from_file(&self) -> bool {
        self.models.is_empty() && self.upstreams.is_empty()
    }

    /// The settings, from what the chain parsed (`merged` holds the file's
    /// model tables), validated.
    pub fn settings(&self, merged: &Merged) -> Result<RouterSettings, ConfigError> {
        let mut models = self.spec_models()?;
        if self.models_from_file() {
            models = Self::file_models(merged)?;
        }
        let from_file = match &self.api_keys_file {
            Some(f) => {
                omni_runtime::read_secret(f, "--api-keys-file").map_err(ConfigError::Flag)?
            }
            None => String::new(),
        };
        let api_keys: Vec<String> = self
            .api_keys
            .iter()
            .flat_map(|k| k.split(','))
            .chain(from_file.split([',', '\n']))
            .map(|k| k.trim().to_string())
            .filter(|k| !k.is_empty())
            .collect();
        let mut s = RouterSettings {
            listen: self.listen.clone(),
            models,
            auto: self
                .auto
                .iter()
                .map(|r| r.trim())
                .filter(|r| !r.is_empty())
                .map(String::from)
                .collect(),
            api_keys,
            max_in_flight: self.max_in_flight,
            body_limit: self.body_limit,
            resume_timeout: self.resume_timeout,
            otlp_endpoint: self.telemetry.otlp_endpoint.clone(),
            tls: self.tls.clone(),
        };
        for k in &self.upstream_keys {
            let (name, key) = k.split_once('=').ok_or_else(|| {
                ConfigError::Flag(format!("--upstream-key '{}': expected NAME=KEY", mask(k)))
            })?;
            let m = s
                .models
                .iter_mut()
                .find(|m| m.name == name.trim() && m.upstream.is_some())
                .ok_or_else(|| {
                    ConfigError::Flag(format!(
                        "--upstream-key names '{}', which is no upstream model",
                        name.trim()
                    ))
                })?;
            m.api_key = Some(key.trim().to_string());
        }
        s.validate()?;
        Ok(s)
    }
}

/// Parses `NAME=TARGET[,ALIAS...]`.
fn parse_spec(flag: &str, spec: &str) -> Result<(String, String, Vec<String>), ConfigError> {
    let bad = |why: &str| ConfigError::Flag(format!("{flag} '{spec}': {why}"));
    let (name, rest) = spec
        .split_once('=')
        .ok_or_else(|| bad("expected NAME=ADDRESS[,ALIAS...]"))?;
    let mut parts = rest.split(',').map(str::trim).filter(|s| !s.is_empty());
    let target = parts.next().ok_or_else(|| bad("no address"))?;
    Ok((
        name.trim().to_string(),
        target.to_string(),
        parts.map(String::from).collect(),
    ))
}

fn mask(secret: &str) -> String {
    match secret.split_once('=') {
        Some((name, _)) => format!("{name}=***"),
        None => "***".into(),
    }
}

impl RouterSettings {
    /// Checks what each key alone cannot: every model has exactly one
    /// target, names are unique, `auto` rules name served models.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |m: String| Err(ConfigError::Invalid(m));
        if self.models.is_empty() {
            return bad(
                "no models: give --model NAME=COORDINATOR_ADDR, --upstream NAME=URL, or [[router.models]] in the config file".into(),
            );
        }
        let mut names = HashSet::new();
        for m in &self.models {
            if m.name.trim().is_empty() {
                return bad("a model has an empty name".into());
            }
            match (&m.coordinator, &m.upstream) {
                (Some(_), Some(_)) => {
                    return bad(format!(
                        "model '{}' has both a coordinator and an upstream; give one",
                        m.name
                    ))
                }
                (None, None) => {
                    return bad(format!(
                        "model '{}' needs a coordinator (host:port) or an upstream (URL)",
                        m.name
                    ))
                }
                (None, Some(u)) if !(u.starts_with("http://") || u.starts_with("https://")) => {
                    return bad(format!(
                        "model '{}': upstream '{u}' is not an http(s) URL",
                        m.name
                    ))
                }
                _ => {}
            }
            for n in std::iter::once(&m.name).chain(&m.aliases) {
                if n == "auto" {
                    return bad(format!(
                        "model '{}': 'auto' is reserved for the auto rules",
                        m.name
                    ));
                }
                if !names.insert(n.as_str()) {
                    return bad(format!("the model name or alias '{n}' is used twice"));
                }
            }
        }
        for (_, model) in self.auto_rules()? {
            if !names.contains(model.as_str()) {
                return bad(format!(
                    "auto rule names model '{model}', which no model or alias serves"
                ));
            }
        }
        if self.max_in_flight == 0 {
            return bad("max_in_flight must be at least 1".into());
        }
        if !(self.resume_timeout >= 0.0 && self.resume_timeout.is_finite()) {
            return bad(format!(
                "resume_timeout is {}; it must be 0 or more seconds",
                self.resume_timeout
            ));
        }
        if self.body_limit < 1024 {
            return bad(format!(
                "body_limit is {} bytes; at least 1024 are needed for any request",
                self.body_limit
            ));
        }
        Ok(())
    }

    pub fn auto_rules(&self) -> Result<Vec<(backends::Rule, String)>, ConfigError> {
        backends::parse_auto(&self.auto.join(";")).map_err(ConfigError::Invalid)
    }

    /// The served models as the config file's `[[router.models]]` tables,
    /// keys masked: what `print-config` adds to the chain's table when the
    /// models come from the file.
    pub fn models_toml(&self) -> String {
        let mut models = self.models.clone();
        for m in &mut models {
            if m.api_key.is_some() {
                m.api_key = Some("***".into());
            }
        }
        #[derive(Serialize)]
        struct Router {
            models: Vec<ModelEntry>,
        }
        #[derive(Serialize)]
        struct File {
            router: Router,
        }
        toml::to_string_pretty(&File {
            router: Router { models },
        })
        .expect("model entries serialize to TOML")
    }
}

/// What `omni-router print-config` prints: the chain's `[router]` table
/// (each setting with its source), and the models' tables when they come
/// from the file.
pub fn print_config(table: &str, cfg: &RouterConfig, settings: &RouterSettings) -> String {
    let mut out = table.trim_end().to_string();
    out.push('\n');
    if cfg.models_from_file() {
        out.push('\n');
        out.push_str(&settings.models_toml());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;
    use std::ffi::OsString;

    /// The binary's command line without its subcommands.
    #[derive(clap::Parser)]
    struct Cli {
        #[arg(long)]
        config: Option<PathBuf>,
        #[command(flatten)]
        cfg: RouterConfig,
    }

    /// What the router would run with for `argv` and `env`, and what
    /// print-config would print.
    fn parse(argv: &[&str], env: &[(&str, &str)]) -> Result<(RouterSettings, String), String> {
        let argv: Vec<OsString> = argv.iter().map(OsString::from).collect();
        let env: Vec<(String, String)> = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let p = omni_runtime::start::parse::<RouterConfig>(
            "omni-router",
            Cli::command(),
            SERVICE,
            &argv,
            &env,
            true,
        )
        .map_err(|e| e.to_string())?;
        let cfg = p.settings.ok_or("no settings")?;
        let s = cfg.settings(&p.merged).map_err(|e| e.to_string())?;
        let shown = print_config(p.print.as_deref().unwrap_or(""), &cfg, &s);
        Ok((s, shown))
    }

    fn write(text: &str) -> tempfile::NamedTempFile {
        let f = tempfile::Builder::new().suffix(".toml").tempfile().unwrap();
        std::fs::write(f.path(), text).unwrap();
        f
    }

    fn from_file(path: &std::path::Path) -> Result<RouterSettings, String> {
        parse(&["--config", path.to_str().unwrap()], &[]).map(|(s, _)| s)
    }

    const FILE: &str = r#"
[router]
listen = "0.0.0.0:9000"
auto = ["keyword:code=qwen", "default=deepseek"]
max_in_flight = 8

[[router.models]]
name = "deepseek"
coordinator = "10.0.0.2:7070"
aliases = ["oracle"]

[[router.models]]
name = "qwen"
upstream = "http://10.0.0.3:8080/v1"
upstream_model = "qwen2.5-coder"
"#;

    #[test]
    fn the_file_gives_backends_and_flags_override_it() {
        let f = write(FILE);
        let path = f.path().to_str().unwrap();
        let s = from_file(f.path()).unwrap();
        assert_eq!(s.listen, "0.0.0.0:9000");
        assert_eq!(s.max_in_flight, 8);
        assert_eq!(s.body_limit, 4 << 20, "defaults fill what the file omits");
        assert_eq!(s.models.len(), 2);
        assert_eq!(s.models[0].aliases, ["oracle"]);
        assert_eq!(s.models[1].upstream_model.as_deref(), Some("qwen2.5-coder"));
        assert_eq!(s.auto_rules().unwrap().len(), 2);

        let (s, _) = parse(&["--config", path], &[("OMNI_ROUTER_MAX_IN_FLIGHT", "5")]).unwrap();
        assert_eq!(s.max_in_flight, 5, "a variable wins over the file");
        let (s, shown) = parse(
            &[
                "--config",
                path,
                "--max-in-flight",
                "3",
                "--upstream-key",
                "qwen=sk-up",
            ],
            &[("OMNI_ROUTER_MAX_IN_FLIGHT", "5")],
        )
        .unwrap();
        assert_eq!(s.max_in_flight, 3, "a flag wins over the variable");
        assert_eq!(s.listen, "0.0.0.0:9000", "the file wins over defaults");
        assert_eq!(s.models[1].api_key.as_deref(), Some("sk-up"));
        assert!(
            shown.contains("api_key = \"***\"") && !shown.contains("sk-up"),
            "{shown}"
        );
        assert!(shown.contains("max_in_flight = 3  # flag"), "{shown}");
        assert!(shown.contains("[[router.models]]"), "{shown}");
        // What print-config shows reads back as the same settings.
        assert!(
            shown.contains("upstream_key = \"qwen=***\"  # flag"),
            "{shown}"
        );
        let again = write(
            &shown
                .replace("\"***\"", "\"sk-up\"")
                .replace("=***\"", "=sk-up\""),
        );
        assert_eq!(from_file(again.path()).unwrap(), s);

        let (s, shown) = parse(
            &[
                "--config",
                path,
                "--model",
                "gemma=127.0.0.1:7070,g",
                "--auto",
                "default=gemma",
            ],
            &[],
        )
        .unwrap();
        assert_eq!(
            s.models.len(),
            1,
            "models given as flags replace the file's"
        );
        assert_eq!(s.models[0].coordinator.as_deref(), Some("127.0.0.1:7070"));
        assert!(!shown.contains("[[router.models]]"), "{shown}");
        let again = write(&shown);
        assert_eq!(from_file(again.path()).unwrap(), s);
        // Specs come from the environment as well.
        let (s, _) = parse(&[], &[("OMNI_ROUTER_MODEL", "a=h:1;b=h:2")]).unwrap();
        assert_eq!(s.models.len(), 2);
    }

    #[test]
    fn api_keys_come_from_a_file_too() {
        let f = write("sk-one\nsk-two, sk-three\n");
        let (s, shown) = parse(
            &[
                "--model",
                "m=127.0.0.1:7070",
                "--api-key",
                "sk-flag",
                "--api-keys-file",
                f.path().to_str().unwrap(),
            ],
            &[],
        )
        .unwrap();
        assert_eq!(s.api_keys, ["sk-flag", "sk-one", "sk-two", "sk-three"]);
        assert!(!shown.contains("sk-flag"), "{shown}");
        let empty = write("\n");
        let e = parse(
            &[
                "--model",
                "m=127.0.0.1:7070",
                "--api-keys-file",
                empty.path().to_str().unwrap(),
            ],
            &[],
        )
        .unwrap_err();
        assert!(
            e.contains("--api-keys-file") && e.contains("is empty"),
            "{e}"
        );
    }

    #[test]
    fn mistakes_are_named() {
        let err = |text: &str| from_file(write(text).path()).unwrap_err();
        let e = err("[router]\nlisten = \"x\"\nmodles = []\n");
        assert!(
            e.contains("[router] has no setting `modles` (did you mean `model"),
            "{e}"
        );
        let e = err("[router]\nmax_in_flight = \"many\"\n");
        assert!(e.contains("--max-in-flight") && e.contains("many"), "{e}");
        let e = err("[router]\n");
        assert!(e.contains("no models"), "{e}");
        let e = err("[[router.models]]\nname = \"a\"\n");
        assert!(e.contains("needs a coordinator"), "{e}");
        let e = err("[[router.models]]\nname = \"a\"\ncoordinatr = \"h:1\"\n");
        assert!(
            e.contains("[[router.models]]") && e.contains("coordinatr"),
            "{e}"
        );
        let e = err(
            "[[router.models]]\nname = \"a\"\ncoordinator = \"h:1\"\n[[router.models]]\nname = \"b\"\ncoordinator = \"h:2\"\naliases = [\"a\"]\n",
        );
        assert!(e.contains("'a' is used twice"), "{e}");
        let e = err("[router]\nauto = [\"default=nope\"]\n[[router.models]]\nname = \"a\"\ncoordinator = \"h:1\"\n");
        assert!(e.contains("'nope'"), "{e}");
        let e = err("[router\n");
        assert!(e.contains("not valid TOML"), "{e}");
        let e = from_file(std::path::Path::new("/nonexistent/omni.toml")).unwrap_err();
        assert!(e.contains("cannot read the config file"), "{e}");
        let e = parse(&["--model", "nameonly"], &[]).unwrap_err();
        assert!(e.contains("--model 'nameonly'"), "{e}");
        let e = parse(&[], &[("OMNI_ROUTER_MODELS", "a=h:1")]).unwrap_err();
        assert!(
            e.contains("OMNI_ROUTER_MODELS is not a setting") && e.contains("OMNI_ROUTER_MODEL?"),
            "{e}"
        );
    }
}
