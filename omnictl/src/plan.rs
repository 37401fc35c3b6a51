//! `omnictl plan`: shows how a model would be split across devices, and the
//! arithmetic behind it, without loading anything. The same planner the
//! coordinator runs before it asks any worker to load.

use anyhow::Context;
use clap::Args;
use omni_coordinator::plan::{parse_size, plan, PlanConfig, Split, WorkerSpec};
use omni_engine::ModelFile;

#[derive(Args, Debug)]
pub struct PlanArgs {
    /// GGUF path or known model name.
    #[arg(long, short)]
    pub model: String,
    /// The devices in pipeline order, each NAME:SIZE with the memory it offers
    /// (e.g. cpu:6GiB,cpu:2GiB or cuda:0:20GiB,cuda:1:8GiB). They become
    /// workers w0, w1, ...; the name is everything before the last ':'.
    #[arg(long, value_delimiter = ',', required = true)]
    pub devices: Vec<String>,
    /// Context length of one sequence.
    #[arg(long, default_value_t = 4096)]
    pub ctx: usize,
    /// Sequences resident at once (KV cache slots); 8, as the coordinator.
    #[arg(long, default_value_t = 8)]
    pub seqs: usize,
    /// Most tokens in one step (sizes the compute buffer).
    #[arg(long, default_value_t = 512)]
    pub ubatch: usize,
    /// Fraction of each device's memory left unplanned.
    #[arg(long, default_value_t = 0.10)]
    pub headroom: f64,
    /// Manual split by proportion, like llama.cpp's --tensor-split (e.g. 3,1).
    #[arg(long, value_delimiter = ',', conflicts_with = "layers")]
    pub split: Option<Vec<f64>>,
    /// Manual split by layer count per device (e.g. 12,12).
    #[arg(long, value_delimiter = ',')]
    pub layers: Option<Vec<u32>>,
    /// Print the plan as JSON.
    #[arg(long)]
    pub json: bool,
}

/// `NAME:SIZE` entries to workers `w0`, `w1`, ...
pub fn parse_devices(devices: &[String]) -> anyhow::Result<Vec<WorkerSpec>> {
    devices
        .iter()
        .enumerate()
        .map(|(i, d)| {
            let (name, size) = d
                .rsplit_once(':')
                .filter(|(n, _)| !n.is_empty())
                .with_context(|| format!("device '{d}' needs a name and a size, like cpu:6GiB"))?;
            let bytes = parse_size(size).map_err(|e| anyhow::anyhow!("device '{d}': {e}"))?;
            Ok(WorkerSpec {
                id: format!("w{i}"),
                device: name.to_string(),
                free_bytes: bytes,
                total_bytes: bytes,
            })
        })
        .collect()
}

pub fn run(args: &PlanArgs) -> anyhow::Result<()> {
    let workers = parse_devices(&args.devices)?;
    let path = crate::resolve_model(&args.model)?;
    let model =
        ModelFile::open(&path).with_context(|| format!("cannot plan {}", path.display()))?;
    let cfg = PlanConfig {
        n_ctx: args.ctx,
        n_seq: args.seqs,
        n_ubatch: args.ubatch,
        headroom: args.headroom,
        split: match (&args.split, &args.layers) {
            (Some(p), _) => Some(Split::Proportions(p.clone())),
            (None, Some(l)) => Some(Split::Layers(l.clone())),
            (None, None) => None,
        },
    };
    let p = plan(&model, &workers, &cfg)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&p)?);
    } else {
        print!("{p}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_become_numbered_workers() {
        let ws = parse_devices(&["cpu:6GiB".into(), "cuda:1:512MiB".into()]).unwrap();
        assert_eq!(ws[0].id, "w0");
        assert_eq!(ws[0].device, "cpu");
        assert_eq!(ws[0].free_bytes, 6 << 30);
        assert_eq!(ws[1].id, "w1");
        assert_eq!(ws[1].device, "cuda:1");
        assert_eq!(ws[1].free_bytes, 512 << 20);
        let e = parse_devices(&["cpu".into()]).unwrap_err().to_string();
        assert!(e.contains("'cpu'"), "{e}");
        let e = parse_devices(&["cpu:lots".into()]).unwrap_err().to_string();
        assert!(e.contains("cpu:lots") && e.contains("'lots'"), "{e}");
    }
}
