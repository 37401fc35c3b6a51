//! Several models in one launch or one dry run: `--model NAME=PATH[,KEY=VALUE]...`,
//! repeated. Each model gets its own settings after its path (devices,
//! threads, context, aliases, ...; lists inside a value are `+`-separated,
//! since `,` separates the settings), the flags of the command giving the
//! defaults. `omnictl up` and `omnictl plan` read the same form.

use anyhow::Context;
use omni_planner::{
    plan_jointly, JointDevice, JointModel, JointPlan, PlanConfig, Split, WorkerSpec,
};

/// One `--model` value.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelSpec {
    /// `None` for a bare path (only when it is the only model).
    pub name: Option<String>,
    /// A GGUF path or a known model's name.
    pub model: String,
    /// Its settings, in the order given; each is taken once by [`ModelSpec::take`].
    opts: Vec<(String, String)>,
}

impl ModelSpec {
    /// Parses `NAME=PATH[,KEY=VALUE]...` or a bare `PATH` (which may be a
    /// file whose name holds `=` or `,`: an existing file is taken whole).
    pub fn parse(s: &str) -> anyhow::Result<ModelSpec> {
        let s = s.trim();
        if std::path::Path::new(s).exists() {
            return Ok(ModelSpec {
                name: None,
                model: s.to_string(),
                opts: Vec::new(),
            });
        }
        let mut parts = s.split(',').map(str::trim);
        let head = parts.next().unwrap_or_default();
        let (name, model) = match head.split_once('=') {
            Some((n, m)) if valid_name(n) => (Some(n.to_string()), m.to_string()),
            Some((n, _)) => anyhow::bail!(
                "--model {s}: '{n}' is not a model name (letters, digits, '.', '_' and '-'; not 'auto')"
            ),
            None => (None, head.to_string()),
        };
        if model.is_empty() {
            anyhow::bail!("--model {s}: no model after '='; give NAME=PATH");
        }
        let mut opts = Vec::new();
        for p in parts.filter(|p| !p.is_empty()) {
            let (k, v) = p.split_once('=').with_context(|| {
                format!("--model {s}: '{p}' is not KEY=VALUE (settings after the path are KEY=VALUE, lists inside a value joined with '+')")
            })?;
            opts.push((k.trim().to_string(), v.trim().to_string()));
        }
        Ok(ModelSpec { name, model, opts })
    }

    /// The name it is served and shown under: its own, or the file's.
    pub fn label(&self) -> String {
        self.name.clone().unwrap_or_else(|| self.model.clone())
    }

    /// Takes every value of `key` given.
    pub fn take_all(&mut self, key: &str) -> Vec<String> {
        let (mine, rest): (Vec<_>, Vec<_>) = self.opts.drain(..).partition(|(k, _)| k == key);
        self.opts = rest;
        mine.into_iter().map(|(_, v)| v).collect()
    }

    /// Takes the value of `key`; given twice is an error.
    pub fn take(&mut self, key: &str) -> anyhow::Result<Option<String>> {
        let mut all = self.take_all(key);
        if all.len() > 1 {
            anyhow::bail!(
                "model '{}': {key} is given {} times",
                self.label(),
                all.len()
            );
        }
        Ok(all.pop())
    }

    /// Takes `key` and parses it with `parse`, naming the model on error.
    pub fn take_parsed<T, E: std::fmt::Display>(
        &mut self,
        key: &str,
        parse: impl Fn(&str) -> Result<T, E>,
    ) -> anyhow::Result<Option<T>> {
        let label = self.label();
        self.take(key)?
            .map(|v| parse(&v).map_err(|e| anyhow::anyhow!("model '{label}': {key}={v}: {e}")))
            .transpose()
    }

    /// Fails on a setting nobody took, naming those there are.
    pub fn finish(&self, known: &[&str]) -> anyhow::Result<()> {
        if let Some((k, _)) = self.opts.first() {
            anyhow::bail!(
                "model '{}': unknown setting '{k}' (known: {})",
                self.label(),
                known.join(", ")
            );
        }
        Ok(())
    }
}

fn valid_name(n: &str) -> bool {
    !n.is_empty()
        && n != "auto"
        && n.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
}

/// Parses every `--model`: one bare path, or models that all have names.
pub fn parse_all(values: &[String]) -> anyhow::Result<Vec<ModelSpec>> {
    let specs = values
        .iter()
        .map(|v| ModelSpec::parse(v))
        .collect::<anyhow::Result<Vec<_>>>()?;
    if specs.len() > 1 {
        if let Some(s) = specs.iter().find(|s| s.name.is_none()) {
            anyhow::bail!(
                "--model {}: with several models each needs a name, as in --model oracle=PATH --model executor=PATH",
                s.model
            );
        }
    }
    for (i, s) in specs.iter().enumerate() {
        if specs[..i].iter().any(|o| o.name == s.name) {
            anyhow::bail!(
                "two models are named '{}': give each its own name",
                s.label()
            );
        }
    }
    Ok(specs)
}

/// A `+`-separated list in a value.
pub fn plus_list<T, E: std::fmt::Display>(
    v: &str,
    parse: impl Fn(&str) -> Result<T, E>,
) -> Result<Vec<T>, String> {
    v.split('+')
        .map(|x| parse(x.trim()).map_err(|e| e.to_string()))
        .collect()
}

/// One model's part of a joint dry run or launch, ready to plan.
pub struct PlannedModel {
    pub name: String,
    pub file: std::sync::Arc<omni_engine::ModelFile>,
    pub workers: Vec<WorkerSpec>,
    pub expert_workers: Vec<WorkerSpec>,
    pub cfg: PlanConfig,
    pub threads: usize,
    pub expert_threads: usize,
}

/// The joint plan of `models` over `devices`.
pub fn plan_models(
    models: &[PlannedModel],
    devices: &[JointDevice],
    headroom: f64,
    cores: usize,
) -> anyhow::Result<JointPlan> {
    let joint: Vec<JointModel> = models
        .iter()
        .map(|m| JointModel {
            name: m.name.clone(),
            model: &m.file,
            workers: m.workers.clone(),
            expert_workers: m.expert_workers.clone(),
            cfg: m.cfg.clone(),
            threads: m.threads,
            expert_threads: m.expert_threads,
        })
        .collect();
    Ok(plan_jointly(&joint, devices, headroom, cores)?)
}

/// A worker of a model on `device`, capped by `cap` when given.
pub fn worker(id: String, device: &str, cap: Option<u64>) -> WorkerSpec {
    WorkerSpec {
        id,
        device: device.to_string(),
        free_bytes: cap.unwrap_or(u64::MAX),
        total_bytes: cap.unwrap_or(u64::MAX),
        read_rate: 0,
        pool: None,
    }
}

/// `--split`/`--counts` values (`+`-separated in a model's settings).
pub fn split_of(spec: &mut ModelSpec) -> anyhow::Result<Option<Split>> {
    let p = spec.take_parsed("split", |v| plus_list(v, str::parse::<f64>))?;
    let c = spec.take_parsed("counts", |v| plus_list(v, str::parse::<u32>))?;
    Ok(match (p, c) {
        (Some(_), Some(_)) => anyhow::bail!(
            "model '{}': split and counts both given; give one",
            spec.label()
        ),
        (Some(p), None) => Some(Split::Proportions(p)),
        (None, Some(c)) => Some(Split::Layers(c)),
        (None, None) => None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_paths_and_settings() {
        let mut s =
            ModelSpec::parse("executor=qwen.gguf,threads=2,alias=coder,alias=qwen").unwrap();
        assert_eq!(s.name.as_deref(), Some("executor"));
        assert_eq!(s.model, "qwen.gguf");
        assert_eq!(s.take_all("alias"), vec!["coder", "qwen"]);
        assert_eq!(
            s.take_parsed("threads", str::parse::<usize>).unwrap(),
            Some(2)
        );
        s.finish(&["threads", "alias"]).unwrap();

        let s = ModelSpec::parse("gemma3-270m").unwrap();
        assert_eq!((s.name, s.model.as_str()), (None, "gemma3-270m"));

        let mut s = ModelSpec::parse("o=m.gguf,thread=2").unwrap();
        let e = s.finish(&["threads"]).unwrap_err().to_string();
        assert!(
            e.contains("unknown setting 'thread'") && e.contains("threads"),
            "{e}"
        );
        let e = s.take_parsed("thread", str::parse::<usize>).unwrap();
        assert_eq!(e, Some(2));

        let mut s = ModelSpec::parse("o=m.gguf,threads=many").unwrap();
        let e = s.take_parsed("threads", str::parse::<usize>).unwrap_err();
        assert!(e.to_string().starts_with("model 'o': threads=many:"), "{e}");

        assert!(ModelSpec::parse("auto=m.gguf").is_err());
        assert!(ModelSpec::parse("o=m.gguf,threads").is_err());
        let e = parse_all(&["a=x.gguf".into(), "y.gguf".into()]).unwrap_err();
        assert!(e.to_string().contains("each needs a name"), "{e}");
        let e = parse_all(&["a=x.gguf".into(), "a=y.gguf".into()]).unwrap_err();
        assert!(e.to_string().contains("two models are named 'a'"), "{e}");
        assert_eq!(
            plus_list("cuda:0+cpu", str::parse::<String>).unwrap().len(),
            2
        );
    }
}
