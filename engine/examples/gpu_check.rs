//! Greedy tokens on a GPU against llama.cpp's own build of the same vendored
//! source (CUDA or Vulkan), on the same GPU (`scripts/gpu-check` runs it
//! there; `tests/tests/vulkan.rs` runs it on lavapipe), and against omni's
//! own CPU stage.
//!
//! `gpu_check [--device cuda:N|vulkan:N] [--steps N] [--threads N]
//! [--prompts N] [--only SETUP]... MODEL.gguf...` (`--device cpu`: a dry
//! run with the GPU's part on the CPU; `--threads`: CPU threads, every core
//! up to 16 by default; `--prompts`: the first N prompts below; `--only`,
//! once per setup: these setups, by the names below): for each file and
//! prompt (one of them over 100 tokens), the greedy ids of omni with 1 GPU
//! stage, 2 GPU stages, a CPU stage then a GPU stage, and the CPU alone;
//! for a MoE file also a GPU stage whose routed experts run on the CPU (the
//! expert worker's `ExpertStage`, in process), and the same with two experts
//! of each layer kept on the GPU (`--gpu-experts`). Each is compared with
//! llama.cpp's run of the same placement: every layer offloaded,
//! `--n-gpu-layers` for the GPU's half, none, `-ot exps=CPU` (the kept
//! experts have no llama.cpp equivalent: against `-ot exps=CPU`). A
//! difference is accepted only at a near tie: at the first differing step
//! llama.cpp's logits of its pick and ours are within 0.25 of each other (a
//! reduction order can flip such a tie; the engine tests use the same
//! rule), or, for a MoE file in a setup that computes on both the GPU and
//! the CPU, after at least one identical token (see `Setup::exact_reference`).
//! Each GPU setup is also held to omni's CPU stage by the same rule (the
//! CPU run's logits decide the near tie), unless it gave exactly the tokens
//! of llama.cpp's run on the same device: then the two devices part where
//! llama.cpp's do.
//! Exits 1 on any other difference. It also prints what each GPU
//! stage holds in GPU memory, and each generation's text (`text |` lines,
//! which `scripts/gpu-check` compares with a cluster's answers).

use omni_engine::stage::{Batch, LayerRange, StageConfig, StageOutput};
use omni_engine::{
    fmt_bytes, Device, Engine, ExpertConfig, ExpertStage, LlamaPlacement, ModelFile, PromptCuts,
    Stage,
};

const PROMPTS: [&str; 4] = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village at the edge of the forest, there lived",
    // Over 100 tokens: short prompts hide bugs (masks, cells past one block).
    "The history of the printing press begins in the fifteenth century, when Johannes \
     Gutenberg, a goldsmith from Mainz, combined movable metal type, oil-based inks and a \
     wooden press adapted from those used to make wine. Before his invention, books were \
     copied by hand, usually by monks in monasteries, and a single Bible could take a scribe \
     more than a year to finish. The new presses spread quickly: by 1500 there were printing \
     shops in more than two hundred cities across Europe, and millions of books had been \
     printed. Prices fell, literacy rose, and ideas travelled faster than ever before. \
     Scholars argue that the press made possible the Reformation, the Scientific Revolution \
     and, later, the newspapers that shaped modern politics. In the centuries that followed,",
];
const NEAR_TIE: f32 = 0.25;

/// llama.cpp's greedy run of one prompt: each step's id and logits.
type Reference = Vec<(u32, Vec<f32>)>;

/// The ways `gpu_check` runs a model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Setup {
    OneGpu,
    TwoGpu,
    /// A CPU stage, then a GPU stage with the head (llama.cpp's partial
    /// offload puts the last layers on the GPU).
    CpuGpu,
    Cpu,
    /// MoE files only: one GPU stage, its routed experts on the CPU.
    GpuCpuExperts,
    /// The same with two experts per layer kept on the GPU.
    GpuCpuExpertsKept,
}

impl Setup {
    /// The CPU first: its run is what the GPU setups are also held to.
    const ALL: [Setup; 6] = [
        Setup::Cpu,
        Setup::OneGpu,
        Setup::TwoGpu,
        Setup::CpuGpu,
        Setup::GpuCpuExperts,
        Setup::GpuCpuExpertsKept,
    ];

    /// The name printed (and `--only` takes).
    fn name(self) -> &'static str {
        match self {
            Setup::OneGpu => "1 GPU stage",
            Setup::TwoGpu => "2 GPU stages",
            Setup::CpuGpu => "CPU + GPU stages",
            Setup::Cpu => "CPU only",
            Setup::GpuCpuExperts => "GPU, experts on CPU",
            Setup::GpuCpuExpertsKept => "GPU, experts on CPU, 2 kept on GPU",
        }
    }

    fn moe_only(self) -> bool {
        matches!(self, Setup::GpuCpuExperts | Setup::GpuCpuExpertsKept)
    }

    /// llama.cpp's run of the same placement (for a model of `n_layer`
    /// layers).
    fn placement(self, n_layer: u32) -> LlamaPlacement {
        let all = LlamaPlacement::default();
        match self {
            Setup::OneGpu | Setup::TwoGpu => all,
            // `--n-gpu-layers k` offloads the output and the last k - 1 layers.
            Setup::CpuGpu => LlamaPlacement {
                n_gpu_layers: (n_layer / 2 + 1) as i32,
                op_offload: false,
                ..all
            },
            Setup::Cpu => LlamaPlacement {
                n_gpu_layers: 0,
                op_offload: false,
                ..all
            },
            Setup::GpuCpuExperts | Setup::GpuCpuExpertsKept => LlamaPlacement {
                experts_on_cpu: true,
                op_offload: false,
                ..all
            },
        }
    }

    /// Whether llama.cpp's run computes every op on the same device, with
    /// the same kernels, as ours. Where a run uses both the GPU and the
    /// CPU, llama.cpp's scheduler gives the GPU every weightless op that
    /// leads to a GPU op (its "expand gpu up" pass): the residual adds after
    /// the last CPU layer run there (`GGML_SCHED_DEBUG=2` on the H200 showed
    /// `ffn_out` and `l_out` of that layer on CUDA0), where ggml-cuda fuses
    /// them with the next layer's norm, while our CPU stage adds them and
    /// our GPU stage norms its input alone; the same sums, rounded in
    /// another order. A dense model's logits then move a little (a near tie
    /// at most). A MoE model's expert selection is discontinuous: a router
    /// score that rounds across another picks another expert, and after
    /// identical tokens the logits may jump (a "routing flip", counted
    /// apart, not a failure).
    fn exact_reference(self) -> bool {
        matches!(self, Setup::OneGpu | Setup::TwoGpu | Setup::Cpu)
    }
}

/// One way of running the model.
enum Runner {
    /// A chain of stages on the given devices.
    Engine(Engine),
    /// One stage of the whole model on the GPU whose routed experts run on
    /// the CPU, as with an expert worker.
    Offloaded {
        stage: Box<Stage>,
        experts: Box<ExpertStage>,
    },
}

impl Runner {
    /// Logits after the last of `tokens` (all at positions from `start`).
    fn step(&mut self, tokens: &[u32], start: usize) -> anyhow::Result<Vec<f32>> {
        match self {
            Runner::Engine(e) => Ok(e.prefill(0, tokens, start)?),
            Runner::Offloaded { stage, experts } => {
                let mut b = Batch::default();
                for (i, &t) in tokens.iter().enumerate() {
                    b.push(t, (start + i) as i32, 0, i + 1 == tokens.len());
                }
                match stage.forward_with(&b, None, experts.as_mut())? {
                    StageOutput::Logits(l) => Ok(l.row(0).to_vec()),
                    StageOutput::Hidden(_) => {
                        anyhow::bail!("a whole-model stage returned no logits")
                    }
                }
            }
        }
    }

    fn remove_seq(&mut self) {
        match self {
            Runner::Engine(e) => e.remove_seq(0),
            Runner::Offloaded { stage, .. } => stage.remove_seq(0, None),
        }
    }

    fn stages(&self) -> Vec<&Stage> {
        match self {
            Runner::Engine(e) => e.stages().iter().collect(),
            Runner::Offloaded { stage, .. } => vec![&**stage],
        }
    }
}

/// Each step's greedy id and the logits it was picked from.
fn greedy(r: &mut Runner, prompt: &[u32], steps: usize) -> anyhow::Result<Reference> {
    let mut logits = r.step(prompt, 0)?;
    let mut out = Vec::with_capacity(steps);
    for i in 0..steps {
        let t = omni_engine::sampling::greedy(&logits);
        if i + 1 == steps {
            out.push((t, logits));
            break;
        }
        let next = r.step(&[t], prompt.len() + i)?;
        out.push((t, std::mem::replace(&mut logits, next)));
    }
    r.remove_seq();
    Ok(out)
}

/// How a run's ids compare with a reference run's.
enum Verdict {
    Same,
    /// The first differing step, and the reference's logit of its own pick
    /// less its logit of ours.
    Differs(usize, f32),
}

fn compare(ours: &[u32], reference: &Reference) -> Verdict {
    match ours.iter().zip(reference).position(|(a, (b, _))| a != b) {
        None => Verdict::Same,
        Some(i) => {
            let (want, logits) = &reference[i];
            Verdict::Differs(i, logits[*want as usize] - logits[ours[i] as usize])
        }
    }
}

/// What each GPU stage of `r` holds, as the planner counts it and as ggml
/// allocated it.
fn print_memory(name: &str, r: &Runner) {
    for (i, s) in r.stages().into_iter().enumerate() {
        if !s.device().is_gpu() {
            continue;
        }
        let (dev, host) = s.compute_bytes_split();
        let w = s.weights();
        println!(
            "  memory | {name} | stage {i} {} on {}: weights {} on the device + {} mapped in host memory, KV {}, compute {} on the device + {} pinned host, kept experts {}",
            s.range(),
            s.device(),
            fmt_bytes(w.repacked_bytes),
            fmt_bytes(w.mapped_bytes),
            fmt_bytes(s.kv().allocated_bytes()),
            fmt_bytes(dev as u64),
            fmt_bytes(host as u64),
            fmt_bytes(s.device_expert_bytes()),
        );
    }
}

fn load(
    path: &std::path::Path,
    setup: Setup,
    device: Device,
    cfg: &StageConfig,
) -> anyhow::Result<Runner> {
    let model = ModelFile::open(path)?;
    let n = model.hparams.n_layer;
    let engine = |split: Option<&[u32]>, devices: &[Device]| -> anyhow::Result<Runner> {
        let mut e = Engine::load_on_devices(path, split, cfg.clone(), devices, &mut |_, _, _| {})?;
        // llama.cpp's reference is llama_decode of the whole prompt: cut as
        // it does (not as llama-server, the engine's default).
        e.prompt_cuts = PromptCuts::Ubatch;
        Ok(Runner::Engine(e))
    };
    match setup {
        Setup::OneGpu => engine(None, &[device]),
        Setup::TwoGpu => engine(Some(&[n / 2, n - n / 2]), &[device, device]),
        Setup::CpuGpu => engine(Some(&[n - n / 2, n / 2]), &[Device::Cpu, device]),
        Setup::Cpu => engine(None, &[Device::Cpu]),
        Setup::GpuCpuExperts | Setup::GpuCpuExpertsKept => {
            let layers: Vec<u32> = (0..n)
                .filter(|&il| model.expert_weight_bytes(il) > 0)
                .collect();
            let stage_cfg = StageConfig {
                device,
                ..cfg.clone()
            };
            let mut stage =
                Stage::load_offloaded(model.clone(), LayerRange::whole(n), stage_cfg, &layers)?;
            if setup == Setup::GpuCpuExpertsKept {
                for &il in &layers {
                    stage.set_device_experts(il, &[0, 1])?;
                }
            }
            let experts = ExpertStage::load(
                model,
                &layers,
                ExpertConfig {
                    n_ubatch: cfg.n_ubatch,
                    n_threads: cfg.n_threads,
                    repack: true,
                },
            )?;
            Ok(Runner::Offloaded {
                stage: Box::new(stage),
                experts: Box::new(experts),
            })
        }
    }
}

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let (mut device, mut steps, mut files) = (Device::Cuda(0), 32usize, Vec::new());
    let mut threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(16);
    let mut only: Option<Vec<String>> = None;
    let mut n_prompts = PROMPTS.len();
    while let Some(a) = args.next() {
        match a.as_str() {
            "--device" => {
                device = args
                    .next()
                    .unwrap_or_default()
                    .parse()
                    .map_err(anyhow::Error::msg)?
            }
            "--steps" => steps = args.next().unwrap_or_default().parse()?,
            "--threads" => threads = args.next().unwrap_or_default().parse()?,
            "--prompts" => n_prompts = args.next().unwrap_or_default().parse()?,
            // One setup a flag (their names hold commas); repeated for more.
            "--only" => {
                let name = args.next().unwrap_or_default();
                anyhow::ensure!(
                    Setup::ALL.iter().any(|s| s.name() == name),
                    "--only {name:?} names no setup; the setups: {}",
                    Setup::ALL.map(|s| format!("{:?}", s.name())).join(", ")
                );
                only.get_or_insert_with(Vec::new).push(name);
            }
            _ => files.push(std::path::PathBuf::from(a)),
        }
    }
    anyhow::ensure!(
        !files.is_empty(),
        "usage: gpu_check [--device cuda:N|vulkan:N] [--steps N] [--threads N] [--prompts N] [--only SETUP]... MODEL.gguf..."
    );
    omni_engine::cpu_backend(None)?;
    match device {
        Device::Cuda(_) | Device::Vulkan(_) => {
            // Loading our GPU backend registers it, so llama.cpp offloads to it too.
            let gpu = omni_engine::device::gpu_props(device)?;
            println!(
                "gpu_check: {device} = {} ({:.1} GiB free of {:.1}), PCI {}",
                gpu.description,
                gpu.memory_free as f64 / (1u64 << 30) as f64,
                gpu.memory_total as f64 / (1u64 << 30) as f64,
                gpu.pci_bus_id.as_deref().unwrap_or("?")
            );
        }
        // A dry run of this program where there is no GPU: every setup, and
        // llama.cpp, on the CPU.
        Device::Cpu => println!("gpu_check: --device cpu: a dry run, the GPU's part on the CPU"),
    }
    println!("gpu_check: {threads} CPU threads, for omni and llama.cpp alike");
    let (mut failed, mut errors, mut ties, mut same, mut flips) = (0, 0, 0, 0, 0);
    // Against omni's CPU stage: the same, a near tie, a MoE routing flip, different.
    let (mut cpu_same, mut cpu_ties, mut cpu_flips, mut cpu_failed) = (0, 0, 0, 0);
    let mut cpu_as_llama = 0;
    for path in &files {
        let file = path.file_name().unwrap_or_default().to_string_lossy();
        let model = match ModelFile::open(path) {
            Ok(m) => m,
            Err(e) => {
                errors += 1;
                println!("{file} | ERROR opening: {e}");
                continue;
            }
        };
        let moe = model.hparams.moe.is_some();
        let tokenizer = omni_engine::Tokenizer::load(path)?;
        let n_layer = model.hparams.n_layer;
        let prompts = PROMPTS
            .iter()
            .take(n_prompts)
            .map(|text| Ok((*text, tokenizer.encode(text, true, false)?)))
            .collect::<anyhow::Result<Vec<_>>>()?;
        // llama.cpp's run of each prompt, once per file and placement.
        let mut references: Vec<(LlamaPlacement, Vec<Reference>)> = Vec::new();
        // omni's CPU stage's run of each prompt (the first setup).
        let mut on_cpu: Vec<Reference> = Vec::new();
        let setups = Setup::ALL.into_iter().filter(|s| {
            (moe || !s.moe_only())
                && only
                    .as_ref()
                    .is_none_or(|o| o.iter().any(|name| name == s.name()))
        });
        let cfg = StageConfig {
            n_threads: threads,
            ..StageConfig::default()
        };
        for setup in setups {
            let name = setup.name();
            let mut r = match load(path, setup, device, &cfg) {
                Ok(r) => r,
                Err(e) => {
                    errors += 1;
                    println!("{file} | {name} | ERROR loading: {e:#}");
                    continue;
                }
            };
            print_memory(name, &r);
            let place = setup.placement(n_layer);
            if !references.iter().any(|(p, _)| *p == place) {
                let mut runs = Vec::new();
                for (_, prompt) in &prompts {
                    runs.push(
                        omni_engine::llama_cpp_greedy_placed(path, prompt, steps, threads, place)
                            .map_err(|e| anyhow::anyhow!("{file}: llama.cpp ({place:?}): {e}"))?,
                    );
                }
                references.push((place, runs));
            }
            let runs = &references
                .iter()
                .find(|(p, _)| *p == place)
                .expect("made")
                .1;
            for (k, ((text, prompt), reference)) in prompts.iter().zip(runs).enumerate() {
                let head = format!("{file} | {name} | {} tokens {:?}", prompt.len(), {
                    text.chars().take(24).collect::<String>()
                });
                let run = match greedy(&mut r, prompt, steps) {
                    Ok(t) => t,
                    Err(e) => {
                        errors += 1;
                        println!("{head}: ERROR {e:#}");
                        r.remove_seq();
                        continue;
                    }
                };
                let ours: Vec<u32> = run.iter().map(|(t, _)| *t).collect();
                let vs_llama = compare(&ours, reference);
                let as_llama = matches!(vs_llama, Verdict::Same);
                let verdict = match vs_llama {
                    Verdict::Same => {
                        same += 1;
                        "same tokens".to_string()
                    }
                    Verdict::Differs(i, gap) => {
                        let want = reference[i].0;
                        if gap <= NEAR_TIE {
                            ties += 1;
                            format!("same up to step {i}, then a near tie (gap {gap:.3})")
                        } else if moe && i > 0 && !setup.exact_reference() {
                            flips += 1;
                            format!(
                                "same up to step {i}, then {} vs llama.cpp's {want} (gap {gap:.3}): a routing flip, llama.cpp computes the ops at the device boundary elsewhere",
                                ours[i]
                            )
                        } else {
                            failed += 1;
                            format!(
                                "DIFFERENT from step {i}: {} vs llama.cpp's {want} (gap {gap:.3})",
                                ours[i]
                            )
                        }
                    }
                };
                println!("{head}: {verdict}");
                if setup == Setup::Cpu {
                    on_cpu.push(run);
                } else if let Some(cpu) = on_cpu.get(k) {
                    let ids: Vec<u32> = cpu.iter().map(|(t, _)| *t).collect();
                    let v = match compare(&ours, cpu) {
                        Verdict::Same => {
                            cpu_same += 1;
                            "same tokens".to_string()
                        }
                        Verdict::Differs(i, gap) if gap <= NEAR_TIE => {
                            cpu_ties += 1;
                            format!("same up to step {i}, then a near tie (gap {gap:.3})")
                        }
                        // llama.cpp's run on this device gave these very
                        // tokens: the device's kernels round so (an H200's
                        // Gemma run parted from the CPU's at a gap of 0.255).
                        Verdict::Differs(i, gap) if as_llama => {
                            cpu_as_llama += 1;
                            format!(
                                "from step {i}: {} vs {} (gap {gap:.3}), as llama.cpp's run on {device} parts from its CPU run",
                                ours[i], ids[i]
                            )
                        }
                        Verdict::Differs(i, gap) if moe && i > 0 => {
                            cpu_flips += 1;
                            format!(
                                "same up to step {i}, then {} vs {} (gap {gap:.3}): a routing flip",
                                ours[i], ids[i]
                            )
                        }
                        Verdict::Differs(i, gap) => {
                            cpu_failed += 1;
                            format!(
                                "DIFFERENT from step {i}: {} vs {} (gap {gap:.3})",
                                ours[i], ids[i]
                            )
                        }
                    };
                    println!("  against omni's CPU stage: {v}");
                }
                println!(
                    "  text | {file} | {name} | {:?}: {}",
                    text.chars().take(24).collect::<String>(),
                    serde_json::to_string(&tokenizer.decode(&ours))?
                );
            }
        }
    }
    println!(
        "gpu_check: {same} generations the same as llama.cpp's, {ties} a near tie, {flips} a MoE routing flip where llama.cpp places ops otherwise, {failed} different, {errors} errors"
    );
    println!(
        "gpu_check: against omni's CPU stage, {cpu_same} GPU generations the same, {cpu_ties} a near tie, {cpu_flips} a MoE routing flip, {cpu_as_llama} parting where llama.cpp's device run parts from the CPU too, {cpu_failed} different"
    );
    anyhow::ensure!(
        failed == 0 && errors == 0 && cpu_failed == 0,
        "{failed} generations differ from llama.cpp's, {cpu_failed} GPU generations from the CPU's, and {errors} failed"
    );
    println!("gpu_check: every generation matches llama.cpp's (near ties aside)");
    Ok(())
}
