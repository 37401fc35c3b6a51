//! One configuration chain for every service: defaults, then the service's
//! table of a TOML file (`--config` or `OMNI_CONFIG`), then `OMNI_<SERVICE>_<KEY>`
//! variables, then flags, each layer over the one before.
//!
//! The service's clap definition stays the one description of its settings:
//! a file key or a variable is its long flag's name (`admin-listen` is the
//! key `admin_listen` and the variable `OMNI_COORDINATOR_ADMIN_LISTEN`), and
//! every value goes through the same parser and checks as the flag would
//! (units, ranges). The layers become flags in front of the command line's,
//! which clap lets later ones override; so the result is what clap parses,
//! and [`Merged::source`] says where each setting came from. A key or a
//! variable that is no setting is refused by name, with the nearest one.
//!
//! Written here rather than with figment (which the router used before)
//! because the point is that file and environment go through clap's own
//! parsing: one set of checks and messages for a setting however it is given.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::fmt;
use std::path::{Path, PathBuf};

/// Which service's settings: its table in the file and its variables' prefix.
#[derive(Clone, Copy, Debug)]
pub struct Service {
    /// The TOML table: `coordinator`, `worker`, `cpu_worker`, `router`.
    pub table: &'static str,
    /// `OMNI_COORDINATOR_`, ...
    pub env_prefix: &'static str,
    /// Variables with the prefix that are not settings (a supervisor's
    /// word to the process, such as `OMNI_WORKER_LAST_EXIT`).
    pub not_settings: &'static [&'static str],
    /// Keys of the table that are no flag but structured values the service
    /// reads itself (the router's `[[router.models]]`): handed over as they
    /// are in [`Merged::structured`].
    pub structured: &'static [&'static str],
}

/// Where a setting's value came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Source {
    Default,
    File(PathBuf),
    Env(String),
    Flag,
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::Default => write!(f, "default"),
            Source::File(p) => write!(f, "{}", p.display()),
            Source::Env(v) => write!(f, "${v}"),
            Source::Flag => write!(f, "flag"),
        }
    }
}

/// The command line to parse (the layers as flags, then the real ones) and
/// where each setting came from.
#[derive(Debug)]
pub struct Merged {
    pub argv: Vec<OsString>,
    sources: BTreeMap<String, Source>,
    /// The config file read, if any.
    pub file: Option<PathBuf>,
    /// The file's values of the service's [`Service::structured`] keys.
    pub structured: toml::Table,
}

impl Merged {
    /// Where the setting with this clap id came from.
    pub fn source(&self, id: &str) -> Source {
        self.sources.get(id).cloned().unwrap_or(Source::Default)
    }
}

/// The chain's own flag: which file to read (also `OMNI_CONFIG`).
pub const CONFIG_FLAG: &str = "--config";

/// The file read when neither `--config` nor `OMNI_CONFIG` names one, if it
/// exists in the working directory.
pub const DEFAULT_FILE: &str = "omni.toml";

/// Gathers the layers for `cmd` (the service's command, or its subcommand
/// that serves) from `argv` (without the program name), `env` (the
/// process's variables) and the file `argv`'s `--config` or `OMNI_CONFIG`
/// names (else `./omni.toml` when there is one); `--config` is taken out of
/// the returned argv.
pub fn merge(
    cmd: &clap::Command,
    service: Service,
    argv: &[OsString],
    env: &[(String, String)],
) -> Result<Merged, String> {
    let settings = settings(cmd);
    let mut rest: Vec<OsString> = Vec::new();
    let mut file: Option<PathBuf> = env
        .iter()
        .find(|(k, v)| k == "OMNI_CONFIG" && !v.is_empty())
        .map(|(_, v)| PathBuf::from(v));
    let mut it = argv.iter();
    while let Some(a) = it.next() {
        let s = a.to_string_lossy();
        if s == CONFIG_FLAG {
            let p = it
                .next()
                .ok_or_else(|| format!("{CONFIG_FLAG} needs a file"))?;
            file = Some(PathBuf::from(p));
        } else if let Some(p) = s.strip_prefix("--config=") {
            file = Some(PathBuf::from(p));
        } else {
            rest.push(a.clone());
        }
    }
    if file.is_none() {
        file = Some(PathBuf::from(DEFAULT_FILE)).filter(|p| p.is_file());
    }
    // Each layer replaces a setting's values from the layers before it
    // (a list too: a list flag replaces the file's list, it does not add
    // to it).
    let mut layered: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut sources = BTreeMap::new();
    let mut structured = toml::Table::new();
    if let Some(path) = &file {
        let (flat, rest) = file_layer(path, service, &settings)?;
        for (id, values) in flat {
            layered.insert(id.clone(), values);
            sources.insert(id, Source::File(path.clone()));
        }
        structured = rest;
    }
    for (var, value) in env {
        let Some(key) = var.strip_prefix(service.env_prefix) else {
            continue;
        };
        if service.not_settings.contains(&var.as_str()) {
            continue;
        }
        let key = key.to_ascii_lowercase();
        if !settings.contains_key(&key) {
            return Err(format!(
                "{var} is not a setting of this service{}",
                nearest(&key, settings.keys().map(String::as_str))
                    .map(|n| format!(
                        " (did you mean {}{}?)",
                        service.env_prefix,
                        n.to_ascii_uppercase()
                    ))
                    .unwrap_or_default()
            ));
        }
        layered.insert(key.clone(), vec![value.clone()]);
        sources.insert(key, Source::Env(var.clone()));
    }
    for a in &rest {
        if let Some(key) = flag_key(&a.to_string_lossy(), &settings) {
            layered.remove(&key);
            sources.insert(key, Source::Flag);
        }
    }
    let mut argv = Vec::new();
    for (key, values) in &layered {
        push(&mut argv, &settings[key], values);
    }
    argv.extend(rest);
    Ok(Merged {
        argv,
        sources,
        file,
        structured,
    })
}

/// The setting a command-line word gives (`--long`, `--long=V`, `-s`,
/// `-sV`), if it is one.
fn flag_key(word: &str, settings: &BTreeMap<String, Setting>) -> Option<String> {
    if let Some(flag) = word.strip_prefix("--") {
        let key = flag.split('=').next().unwrap_or(flag).replace('-', "_");
        return settings.contains_key(&key).then_some(key);
    }
    let short = word.strip_prefix('-')?.chars().next()?;
    settings
        .iter()
        .find(|(_, s)| s.short == Some(short))
        .map(|(k, _)| k.clone())
}

/// A setting as the chain sees it: its long flag, and whether it takes a
/// value (a switch is given by its flag alone) and how many.
struct Setting {
    long: String,
    short: Option<char>,
    switch: bool,
    delimiter: Option<char>,
}

/// The settings of `cmd`, by key (the long flag with `_` for `-`).
fn settings(cmd: &clap::Command) -> BTreeMap<String, Setting> {
    cmd.get_arguments()
        .filter_map(|a| {
            let long = a.get_long()?.to_string();
            if long == "help" || long == "version" || long == "config" {
                return None;
            }
            let switch = matches!(
                a.get_action(),
                clap::ArgAction::SetTrue | clap::ArgAction::SetFalse | clap::ArgAction::Count
            );
            Some((
                long.replace('-', "_"),
                Setting {
                    long,
                    short: a.get_short(),
                    switch,
                    delimiter: a.get_value_delimiter(),
                },
            ))
        })
        .collect()
}

fn push(out: &mut Vec<OsString>, s: &Setting, values: &[String]) {
    if s.switch {
        // A switch is on or off; only "on" can be said as a flag.
        if values.iter().any(|v| v == "true") {
            out.push(format!("--{}", s.long).into());
        }
        return;
    }
    let joined = match s.delimiter {
        Some(d) => values.join(&d.to_string()),
        None => values.join(","),
    };
    out.push(format!("--{}={joined}", s.long).into());
}

/// The service's table of the file, as values per key, and its structured
/// keys as they are. Tables of other services are left alone; a key of
/// this one that is neither a setting nor structured is an error.
type FileLayer = (Vec<(String, Vec<String>)>, toml::Table);

fn file_layer(
    path: &Path,
    service: Service,
    settings: &BTreeMap<String, Setting>,
) -> Result<FileLayer, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read the config file {}: {e}", path.display()))?;
    let doc: toml::Table = text
        .parse()
        .map_err(|e| format!("{} is not valid TOML: {e}", path.display()))?;
    let Some(table) = doc.get(service.table) else {
        return Ok(Default::default());
    };
    let table = table.as_table().ok_or_else(|| {
        format!(
            "{}: [{}] must be a table of settings",
            path.display(),
            service.table
        )
    })?;
    let mut out = Vec::new();
    let mut structured = toml::Table::new();
    for (key, value) in table {
        if service.structured.contains(&key.as_str()) {
            structured.insert(key.clone(), value.clone());
            continue;
        }
        if !settings.contains_key(key) {
            return Err(format!(
                "{}: [{}] has no setting `{key}`{}",
                path.display(),
                service.table,
                nearest(
                    key,
                    settings
                        .keys()
                        .map(String::as_str)
                        .chain(service.structured.iter().copied())
                )
                .map(|n| format!(" (did you mean `{n}`?)"))
                .unwrap_or_default()
            ));
        }
        let values = match value {
            toml::Value::Array(items) => items.iter().map(scalar).collect::<Result<_, _>>(),
            v => scalar(v).map(|s| vec![s]),
        }
        .map_err(|why| format!("{}: [{}] {key}: {why}", path.display(), service.table))?;
        out.push((key.clone(), values));
    }
    Ok((out, structured))
}

fn scalar(v: &toml::Value) -> Result<String, String> {
    Ok(match v {
        toml::Value::String(s) => s.clone(),
        toml::Value::Integer(i) => i.to_string(),
        toml::Value::Float(f) => f.to_string(),
        toml::Value::Boolean(b) => b.to_string(),
        other => return Err(format!("a {} is not a value here", other.type_str())),
    })
}

/// The setting whose key is closest to `key`, if one is close.
fn nearest<'a>(key: &str, names: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    names
        .into_iter()
        .map(|k| (strsim_distance(key, k), k))
        .filter(|(d, k)| *d <= 2.max(k.len() / 4))
        .min()
        .map(|(_, k)| k)
}

/// Levenshtein distance (small strings: setting names).
fn strsim_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut prev = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let cur = row[j + 1];
            row[j + 1] = (prev + usize::from(ca != *cb)).min(row[j] + 1).min(cur + 1);
            prev = cur;
        }
    }
    row[b.len()]
}

/// The settings a parse ended with, as the service's TOML table (what
/// `print-config` prints): each with where it came from, secrets masked.
pub fn render(
    cmd: &clap::Command,
    service: Service,
    matches: &clap::ArgMatches,
    merged: &Merged,
) -> String {
    let mut out = format!("[{}]\n", service.table);
    for (key, s) in settings(cmd) {
        let id = cmd
            .get_arguments()
            .find(|a| a.get_long() == Some(s.long.as_str()))
            .map(|a| a.get_id().as_str().to_string())
            .unwrap_or_else(|| key.clone());
        let raw: Vec<String> = matches
            .get_raw(&id)
            .map(|v| v.map(|x| x.to_string_lossy().to_string()).collect())
            .unwrap_or_default();
        // A variable clap reads itself (a standard one, such as
        // OTEL_EXPORTER_OTLP_ENDPOINT) is a source too.
        let source = match merged.source(&key) {
            Source::Default
                if matches.value_source(&id) == Some(clap::parser::ValueSource::EnvVariable) =>
            {
                cmd.get_arguments()
                    .find(|a| a.get_id() == id.as_str())
                    .and_then(|a| a.get_env())
                    .map_or(Source::Default, |v| Source::Env(v.to_string_lossy().into()))
            }
            s => s,
        };
        let value = if raw.is_empty() {
            if s.switch {
                matches.get_flag(&id).to_string()
            } else {
                out.push_str(&format!("# {key} is not set\n"));
                continue;
            }
        } else if is_secret(&key) {
            // A NAME=SECRET value keeps its name: which upstream has a key.
            let masked: Vec<String> = raw
                .iter()
                .map(|r| match r.split_once('=') {
                    Some((name, _)) => toml_literal(&format!("{name}=***")),
                    None => "\"***\"".to_string(),
                })
                .collect();
            match masked.as_slice() {
                [one] => one.clone(),
                many => format!("[{}]", many.join(", ")),
            }
        } else if raw.len() == 1 {
            toml_literal(&raw[0])
        } else {
            format!(
                "[{}]",
                raw.iter()
                    .map(|r| toml_literal(r))
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        };
        out.push_str(&format!("{key} = {value}  # {source}\n"));
    }
    out
}

/// Whether a setting holds a secret (printed masked).
fn is_secret(key: &str) -> bool {
    ["token", "key", "secret", "password"]
        .iter()
        .any(|w| key.contains(w))
        && !key.ends_with("_file")
}

fn toml_literal(s: &str) -> String {
    if s == "true"
        || s == "false"
        || s.parse::<i64>().is_ok()
        || s.parse::<f64>().is_ok_and(f64::is_finite)
    {
        s.to_string()
    } else {
        toml::Value::String(s.to_string()).to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{Arg, ArgAction, Command};

    const SVC: Service = Service {
        table: "coordinator",
        env_prefix: "OMNI_COORDINATOR_",
        not_settings: &["OMNI_COORDINATOR_INTERNAL"],
        structured: &["models"],
    };

    fn cmd() -> Command {
        Command::new("svc")
            .args_override_self(true)
            .arg(
                Arg::new("ctx")
                    .long("ctx")
                    .value_parser(clap::value_parser!(u32))
                    .default_value("4096"),
            )
            .arg(
                Arg::new("listen")
                    .long("listen")
                    .default_value("127.0.0.1:7070"),
            )
            .arg(
                Arg::new("f16_hidden")
                    .long("f16-hidden")
                    .action(ArgAction::SetTrue),
            )
            .arg(
                Arg::new("counts")
                    .long("counts")
                    .value_delimiter(',')
                    .value_parser(clap::value_parser!(u32)),
            )
            .arg(Arg::new("admin_token").long("admin-token"))
    }

    fn file(text: &str) -> (tempfile::TempDir, PathBuf) {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("omni.toml");
        std::fs::write(&p, text).unwrap();
        (d, p)
    }

    fn parse(argv: &[&str], env: &[(&str, &str)]) -> Result<(clap::ArgMatches, Merged), String> {
        let argv: Vec<OsString> = argv.iter().map(OsString::from).collect();
        let env: Vec<(String, String)> = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let m = merge(&cmd(), SVC, &argv, &env)?;
        let mut full = vec![OsString::from("svc")];
        full.extend(m.argv.clone());
        let matches = cmd()
            .try_get_matches_from(full)
            .map_err(|e| e.to_string())?;
        Ok((matches, m))
    }

    #[test]
    fn flags_over_environment_over_file_over_defaults() {
        let (_d, p) = file(
            "[coordinator]\nctx = 2048\nlisten = \"0.0.0.0:1\"\nf16_hidden = true\ncounts = [12, 6]\n[router]\nport = 1\n",
        );
        let p = p.to_str().unwrap();
        // The file alone.
        let (m, src) = parse(&["--config", p], &[]).unwrap();
        assert_eq!(m.get_one::<u32>("ctx"), Some(&2048));
        assert!(m.get_flag("f16_hidden"));
        assert_eq!(
            m.get_many::<u32>("counts")
                .unwrap()
                .copied()
                .collect::<Vec<_>>(),
            [12, 6]
        );
        assert_eq!(src.source("ctx"), Source::File(PathBuf::from(p)));
        // The environment over the file; OMNI_CONFIG names the file too.
        let (m, src) = parse(&[], &[("OMNI_CONFIG", p), ("OMNI_COORDINATOR_CTX", "1024")]).unwrap();
        assert_eq!(m.get_one::<u32>("ctx"), Some(&1024));
        assert_eq!(m.get_one::<String>("listen").unwrap(), "0.0.0.0:1");
        assert_eq!(
            src.source("ctx"),
            Source::Env("OMNI_COORDINATOR_CTX".into())
        );
        // A flag over both; untouched settings keep their defaults.
        let (m, src) = parse(
            &["--config", p, "--ctx", "512"],
            &[("OMNI_COORDINATOR_CTX", "1024")],
        )
        .unwrap();
        assert_eq!(m.get_one::<u32>("ctx"), Some(&512));
        assert_eq!(src.source("ctx"), Source::Flag);
        // A list given again replaces the list before it.
        let (m, _) = parse(
            &["--config", p, "--counts", "1"],
            &[("OMNI_COORDINATOR_COUNTS", "7,7,7")],
        )
        .unwrap();
        let counts: Vec<u32> = m.get_many::<u32>("counts").unwrap().copied().collect();
        assert_eq!(counts, [1]);
        let (m, _) = parse(&["--config", p], &[("OMNI_COORDINATOR_COUNTS", "7,7,7")]).unwrap();
        let counts: Vec<u32> = m.get_many::<u32>("counts").unwrap().copied().collect();
        assert_eq!(counts, [7, 7, 7]);
        let (m, src) = parse(&[], &[]).unwrap();
        assert_eq!(m.get_one::<u32>("ctx"), Some(&4096));
        assert_eq!(src.source("ctx"), Source::Default);
    }

    #[test]
    fn unknown_keys_and_variables_are_refused_by_name() {
        let (_d, p) = file("[coordinator]\nctxx = 2048\n");
        let e = parse(&["--config", p.to_str().unwrap()], &[]).unwrap_err();
        assert!(
            e.contains("[coordinator] has no setting `ctxx` (did you mean `ctx`?)"),
            "{e}"
        );
        let e = parse(&[], &[("OMNI_COORDINATOR_LISTN", "x")]).unwrap_err();
        assert!(e.contains("OMNI_COORDINATOR_LISTN is not a setting"), "{e}");
        assert!(e.contains("OMNI_COORDINATOR_LISTEN"), "{e}");
        assert!(parse(&[], &[("OMNI_COORDINATOR_INTERNAL", "x")]).is_ok());
        // Other services' tables and variables are theirs.
        let (_d2, p2) = file("[worker]\nanything = 1\n");
        assert!(parse(
            &["--config", p2.to_str().unwrap()],
            &[("OMNI_ROUTER_X", "1")]
        )
        .is_ok());
    }

    #[test]
    fn a_bad_value_from_the_file_is_checked_like_a_flag() {
        let (_d, p) = file("[coordinator]\nctx = \"big\"\n");
        let e = parse(&["--config", p.to_str().unwrap()], &[]).unwrap_err();
        assert!(e.contains("--ctx") && e.contains("big"), "{e}");
        let (_d, p) = file("[coordinator]\nctx = { a = 1 }\n");
        let e = parse(&["--config", p.to_str().unwrap()], &[]).unwrap_err();
        assert!(
            e.contains("[coordinator] ctx: a table is not a value here"),
            "{e}"
        );
        let (_d, p) = file("not toml [");
        assert!(parse(&["--config", p.to_str().unwrap()], &[])
            .unwrap_err()
            .contains("not valid TOML"));
    }

    #[test]
    fn the_rendered_table_says_where_and_masks_secrets() {
        let (_d, p) = file("[coordinator]\nadmin_token = \"hunter2\"\nlisten = \"0.0.0.0:9\"\n");
        let (m, src) = parse(&["--config", p.to_str().unwrap(), "--ctx", "8"], &[]).unwrap();
        let text = render(&cmd(), SVC, &m, &src);
        assert!(text.starts_with("[coordinator]\n"), "{text}");
        assert!(text.contains("ctx = 8  # flag"), "{text}");
        assert!(text.contains("admin_token = \"***\""), "{text}");
        assert!(!text.contains("hunter2"), "{text}");
        assert!(text.contains("listen = \"0.0.0.0:9\"  # "), "{text}");
        assert!(text.contains("# counts is not set"), "{text}");
        // What it prints reads back as the same settings.
        let table: toml::Table = text.parse().unwrap();
        assert_eq!(table["coordinator"]["ctx"].as_integer(), Some(8));
    }
}
