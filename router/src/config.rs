//! The router's settings, merged in this order (later wins): defaults, the
//! `[router]` table of the config file (`--config`, `OMNI_CONFIG`, or
//! `./omni.toml` when it exists), `OMNI_ROUTER_*` variables, flags; then
//! [`RouterSettings::validate`]. `omni-router print-config` shows the result.
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
//! Secrets (`api_keys`, an upstream's `api_key`) are better given through
//! the environment (`OMNI_API_KEYS`, `OMNI_UPSTREAM_KEYS`) or a file
//! (`OMNI_API_KEYS_FILE`, e.g. a compose secret) than written in the
//! config file; `print-config` masks them.

use crate::backends;
use figment::providers::{Format, Serialized, Toml};
use figment::Figment;
use serde::{Deserialize, Serialize};
use std::collections::HashSet;
use std::path::{Path, PathBuf};

/// Every environment variable the router reads, in one place.
pub mod env {
    pub const CONFIG: &str = "OMNI_CONFIG";
    pub const LISTEN: &str = "OMNI_ROUTER_LISTEN";
    pub const MODELS: &str = "OMNI_ROUTER_MODELS";
    pub const UPSTREAMS: &str = "OMNI_ROUTER_UPSTREAMS";
    pub const UPSTREAM_KEYS: &str = "OMNI_UPSTREAM_KEYS";
    pub const AUTO: &str = "OMNI_ROUTER_AUTO";
    pub const API_KEYS: &str = "OMNI_API_KEYS";
    pub const API_KEYS_FILE: &str = "OMNI_API_KEYS_FILE";
    pub const MAX_IN_FLIGHT: &str = "OMNI_ROUTER_MAX_IN_FLIGHT";
    pub const BODY_LIMIT: &str = "OMNI_ROUTER_BODY_LIMIT";
}

/// The file read when neither `--config` nor `OMNI_CONFIG` names one.
pub const DEFAULT_FILE: &str = "omni.toml";

/// What the router runs with, after merging.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
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
    /// OTLP/HTTP base URL for traces; none: no traces.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub otlp_endpoint: Option<String>,
}

impl Default for RouterSettings {
    fn default() -> RouterSettings {
        RouterSettings {
            listen: "127.0.0.1:8080".into(),
            models: Vec::new(),
            auto: Vec::new(),
            api_keys: Vec::new(),
            max_in_flight: 64,
            body_limit: 4 << 20,
            otlp_endpoint: None,
        }
    }
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
    /// The key the upstream wants (also `OMNI_UPSTREAM_KEYS=NAME=KEY`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_key: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub aliases: Vec<String>,
}

/// The router's command line (flags, or the variables in [`env`]).
#[derive(Clone, Debug, Default, clap::Args)]
pub struct RouterConfig {
    /// A config file with a [router] table (default: ./omni.toml when it
    /// exists).
    #[arg(long, env = env::CONFIG)]
    pub config: Option<PathBuf>,
    /// Where the HTTP API listens [default: 127.0.0.1:8080].
    #[arg(long, env = env::LISTEN)]
    pub listen: Option<String>,
    /// A served model: NAME=COORDINATOR_ADDR[,ALIAS...] (repeatable), e.g.
    /// `gemma3-270m=127.0.0.1:7070,gemma`. Models given here replace the
    /// file's.
    #[arg(long = "model", env = env::MODELS, value_delimiter = ';')]
    pub models: Vec<String>,
    /// An upstream OpenAI-compatible server: NAME=URL[#UPSTREAM_MODEL][,ALIAS...]
    /// (repeatable), e.g. `big=http://10.0.0.5:8080/v1#deepseek-r1,deepseek`.
    #[arg(long = "upstream", env = env::UPSTREAMS, value_delimiter = ';')]
    pub upstreams: Vec<String>,
    /// Keys for upstreams: NAME=KEY (repeatable).
    #[arg(long = "upstream-key", env = env::UPSTREAM_KEYS, value_delimiter = ';')]
    pub upstream_keys: Vec<String>,
    /// Rules for the model name `auto`, tried in order:
    /// `prompt_chars>2000=big;keyword:code=qwen;default=gemma`. Without a
    /// default rule, `auto` falls back to the first model.
    #[arg(long, env = env::AUTO)]
    pub auto: Option<String>,
    /// API keys clients must send as `Authorization: Bearer KEY`
    /// (comma-separated); none means no authentication. Better as
    /// OMNI_API_KEYS or --api-keys-file: a flag shows in `ps`.
    #[arg(long = "api-key", env = env::API_KEYS, value_delimiter = ',')]
    pub api_keys: Vec<String>,
    /// A file of API keys (one per line, or comma-separated), e.g. a
    /// compose secret at /run/secrets/api_keys; added to --api-key's.
    #[arg(long = "api-keys-file", env = env::API_KEYS_FILE)]
    pub api_keys_file: Option<PathBuf>,
    /// Requests served at once; beyond it, 429 with Retry-After [default: 64].
    #[arg(long, env = env::MAX_IN_FLIGHT)]
    pub max_in_flight: Option<usize>,
    /// Largest request body in bytes; beyond it, 413 [default: 4194304].
    #[arg(long, env = env::BODY_LIMIT)]
    pub body_limit: Option<usize>,
    #[command(flatten)]
    pub telemetry: omni_telemetry::TelemetryArgs,
}

/// What the command line sets: only what was given, so that it overrides
/// the file key by key.
#[derive(Serialize)]
struct Overrides {
    #[serde(skip_serializing_if = "Option::is_none")]
    listen: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    models: Option<Vec<ModelEntry>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    auto: Option<Vec<String>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    api_keys: Option<Vec<String>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    max_in_flight: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    body_limit: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    otlp_endpoint: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("config file {path}: {source}")]
    File {
        path: PathBuf,
        source: Box<figment::Error>,
    },
    #[error("{0}")]
    Flag(String),
    #[error("invalid router settings: {0}")]
    Invalid(String),
}

impl RouterConfig {
    /// The file to read, if any: the one named, or ./omni.toml if present.
    fn file(&self) -> Result<Option<PathBuf>, ConfigError> {
        match &self.config {
            Some(p) if !p.exists() => Err(ConfigError::Flag(format!(
                "config file {} does not exist",
                p.display()
            ))),
            Some(p) => Ok(Some(p.clone())),
            None => Ok(Some(PathBuf::from(DEFAULT_FILE)).filter(|p| p.exists())),
        }
    }

    fn overrides(&self) -> Result<Overrides, ConfigError> {
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
        let from_file = match &self.api_keys_file {
            Some(f) => {
                omni_runtime::read_secret(f, "--api-keys-file").map_err(ConfigError::Flag)?
            }
            None => String::new(),
        };
        let keys: Vec<String> = self
            .api_keys
            .iter()
            .flat_map(|k| k.split(','))
            .chain(from_file.split([',', '\n']))
            .map(|k| k.trim().to_string())
            .filter(|k| !k.is_empty())
            .collect();
        Ok(Overrides {
            listen: self.listen.clone(),
            models: (!models.is_empty()).then_some(models),
            auto: self.auto.as_ref().map(|a| {
                a.split(';')
                    .map(str::trim)
                    .filter(|r| !r.is_empty())
                    .map(String::from)
                    .collect()
            }),
            api_keys: (!keys.is_empty()).then_some(keys),
            max_in_flight: self.max_in_flight,
            body_limit: self.body_limit,
            otlp_endpoint: self.telemetry.otlp_endpoint.clone(),
        })
    }

    /// Merges defaults, the file, the environment and the flags, and
    /// validates the result.
    pub fn settings(&self) -> Result<RouterSettings, ConfigError> {
        // Figment profiles: the defaults are the default profile, the
        // file's [router] table the selected one, the flags global (which
        // wins over both).
        let mut fig = Figment::from(Serialized::defaults(RouterSettings::default()));
        let file = self.file()?;
        if let Some(path) = &file {
            fig = fig.merge(Toml::file_exact(path).nested());
        }
        let mut s: RouterSettings = fig
            .merge(Serialized::globals(self.overrides()?))
            .select("router")
            .extract()
            .map_err(|e| match &file {
                Some(path) => ConfigError::File {
                    path: path.clone(),
                    source: Box::new(e),
                },
                None => ConfigError::Invalid(e.to_string()),
            })?;
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

    /// The settings as TOML (a `[router]` table), secrets masked.
    pub fn to_toml(&self) -> String {
        let mut s = self.clone();
        for k in &mut s.api_keys {
            *k = "***".into();
        }
        for m in &mut s.models {
            if m.api_key.is_some() {
                m.api_key = Some("***".into());
            }
        }
        #[derive(Serialize)]
        struct File {
            router: RouterSettings,
        }
        toml::to_string_pretty(&File { router: s }).expect("settings serialize to TOML")
    }
}

/// Reads settings from a file alone (tests and tools).
pub fn from_file(path: &Path) -> Result<RouterSettings, ConfigError> {
    RouterConfig {
        config: Some(path.to_path_buf()),
        ..Default::default()
    }
    .settings()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(text: &str) -> tempfile::NamedTempFile {
        let f = tempfile::Builder::new().suffix(".toml").tempfile().unwrap();
        std::fs::write(f.path(), text).unwrap();
        f
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
        let s = from_file(f.path()).unwrap();
        assert_eq!(s.listen, "0.0.0.0:9000");
        assert_eq!(s.max_in_flight, 8);
        assert_eq!(s.body_limit, 4 << 20, "defaults fill what the file omits");
        assert_eq!(s.models.len(), 2);
        assert_eq!(s.models[0].aliases, ["oracle"]);
        assert_eq!(s.models[1].upstream_model.as_deref(), Some("qwen2.5-coder"));
        assert_eq!(s.auto_rules().unwrap().len(), 2);

        let cli = RouterConfig {
            config: Some(f.path().to_path_buf()),
            max_in_flight: Some(3),
            upstream_keys: vec!["qwen=sk-up".into()],
            ..Default::default()
        };
        let s = cli.settings().unwrap();
        assert_eq!(s.max_in_flight, 3, "a flag wins over the file");
        assert_eq!(s.listen, "0.0.0.0:9000", "the file wins over defaults");
        assert_eq!(s.models[1].api_key.as_deref(), Some("sk-up"));
        let shown = s.to_toml();
        assert!(
            shown.contains("api_key = \"***\"") && !shown.contains("sk-up"),
            "{shown}"
        );
        // What print-config shows reads back as the same settings.
        let again = write(&shown.replace("\"***\"", "\"sk-up\""));
        assert_eq!(from_file(again.path()).unwrap(), s);

        let cli = RouterConfig {
            config: Some(f.path().to_path_buf()),
            models: vec!["gemma=127.0.0.1:7070,g".into()],
            auto: Some("default=gemma".into()),
            ..Default::default()
        };
        let s = cli.settings().unwrap();
        assert_eq!(
            s.models.len(),
            1,
            "models given as flags replace the file's"
        );
        assert_eq!(s.models[0].coordinator.as_deref(), Some("127.0.0.1:7070"));
    }

    #[test]
    fn api_keys_come_from_a_file_too() {
        let f = write("sk-one\nsk-two, sk-three\n");
        let cli = RouterConfig {
            models: vec!["m=127.0.0.1:7070".into()],
            api_keys: vec!["sk-flag".into()],
            api_keys_file: Some(f.path().to_path_buf()),
            ..Default::default()
        };
        let s = cli.settings().unwrap();
        assert_eq!(s.api_keys, ["sk-flag", "sk-one", "sk-two", "sk-three"]);
        let empty = write("\n");
        let cli = RouterConfig {
            models: vec!["m=127.0.0.1:7070".into()],
            api_keys_file: Some(empty.path().to_path_buf()),
            ..Default::default()
        };
        let e = cli.settings().unwrap_err().to_string();
        assert!(
            e.contains("--api-keys-file") && e.contains("is empty"),
            "{e}"
        );
    }

    #[test]
    fn mistakes_are_named() {
        let err = |text: &str| from_file(write(text).path()).unwrap_err().to_string();
        let e = err("[router]\nlisten = \"x\"\nmodles = []\n");
        assert!(e.contains("modles"), "{e}");
        let e = err("[router]\nmax_in_flight = \"many\"\n");
        assert!(e.contains("max_in_flight"), "{e}");
        let e = err("[router]\n");
        assert!(e.contains("no models"), "{e}");
        let e = err("[[router.models]]\nname = \"a\"\n");
        assert!(e.contains("needs a coordinator"), "{e}");
        let e = err(
            "[[router.models]]\nname = \"a\"\ncoordinator = \"h:1\"\n[[router.models]]\nname = \"b\"\ncoordinator = \"h:2\"\naliases = [\"a\"]\n",
        );
        assert!(e.contains("'a' is used twice"), "{e}");
        let e = err("[router]\nauto = [\"default=nope\"]\n[[router.models]]\nname = \"a\"\ncoordinator = \"h:1\"\n");
        assert!(e.contains("'nope'"), "{e}");
        let e = err("[router\n");
        assert!(e.contains("config file"), "{e}");
        let missing = RouterConfig {
            config: Some("/nonexistent/omni.toml".into()),
            ..Default::default()
        };
        assert!(missing
            .settings()
            .unwrap_err()
            .to_string()
            .contains("does not exist"));
        let flag = RouterConfig {
            models: vec!["nameonly".into()],
            ..Default::default()
        };
        assert!(flag
            .settings()
            .unwrap_err()
            .to_string()
            .contains("--model 'nameonly'"));
    }
}
