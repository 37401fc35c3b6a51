//! What this worker's device offers: memory (GPU memory through NVML for a
//! `cuda:N` device, what ggml's Vulkan backend reports for `vulkan:N`, system
//! memory for `cpu`), the GPU's particulars, cores and NUMA nodes.

use std::sync::OnceLock;

use nvml_wrapper::Nvml;
use omni_engine::Device;
use omni_proto::worker::v1::{GpuInfo, Inventory};

/// Reads the inventory of `device` ("cpu", "cuda:N" or "vulkan:N"). `cap` limits the
/// memory offered (a worker sharing a machine with others); `reserve` is
/// kept back from the free memory (a GPU's CUDA context and cuBLAS
/// workspaces, other programs).
///
/// A `cuda:N` worker needs NVML (the driver) to see the GPU and ggml's CUDA
/// backend to use it; either missing is an error that names it. A
/// `vulkan:N` worker needs ggml's Vulkan backend to see the device, and
/// takes its memory from it (the driver's memory budget where it has one).
pub fn read(device: &str, cap: Option<u64>, reserve: u64) -> anyhow::Result<Inventory> {
    let dev: Device = device.parse().map_err(anyhow::Error::msg)?;
    let mut sys = sysinfo::System::new();
    sys.refresh_memory();
    let mut inv = Inventory {
        device: dev.to_string(),
        cpu_cores: std::thread::available_parallelism().map_or(1, |n| n.get()) as u32,
        numa_nodes: numa_nodes(),
        hostname: sysinfo::System::host_name().unwrap_or_default(),
        host_id: omni_transport::host_id(),
        cpus: omni_telemetry::cpus::allowed()
            .into_iter()
            .map(|c| c as u32)
            .collect(),
        ..Default::default()
    };
    match dev {
        Device::Cpu => {
            inv.device_name = cpu_name();
            (inv.memory_total, inv.memory_free) = (sys.total_memory(), sys.available_memory());
        }
        Device::Cuda(idx) => {
            let gpu = gpu_info(idx)?;
            // The CUDA backend must load and see the same GPU.
            let props = omni_engine::device::gpu_props(dev)
                .map_err(|e| anyhow::anyhow!("device {dev}: {e}"))?;
            if let Some(bus) = props.pci_bus_id.as_deref() {
                anyhow::ensure!(
                    bus.eq_ignore_ascii_case(&gpu.info.pci_bus_id),
                    "device {dev}: NVML's GPU {idx} is at PCI {} but CUDA's is at {bus}; \
                     set CUDA_VISIBLE_DEVICES the same for every worker or none",
                    gpu.info.pci_bus_id
                );
            }
            inv.device_name = gpu.name;
            (inv.memory_total, inv.memory_free) = (gpu.total, gpu.free);
            inv.nvml = true;
            inv.gpu = Some(gpu.info);
        }
        Device::Vulkan(_) => {
            let props = omni_engine::device::gpu_props(dev)
                .map_err(|e| anyhow::anyhow!("device {dev}: {e}"))?;
            inv.device_name = props.description;
            (inv.memory_total, inv.memory_free) = (props.memory_total, props.memory_free);
        }
    }
    inv.reserved = reserve.min(inv.memory_free);
    inv.memory_free -= inv.reserved;
    if let Some(cap) = cap {
        inv.memory_total = inv.memory_total.min(cap);
        inv.memory_free = inv.memory_free.min(cap);
    }
    Ok(inv)
}

/// The default `--reserve`: on a GPU, room for the CUDA context, cuBLAS's
/// workspaces (or Vulkan's pipelines and staging buffers) and the
/// scheduler's host-side buffers beside the plan's own numbers (llama.cpp's
/// `--fit` leaves 1 GiB too); on the CPU nothing, the planner keeps its own
/// headroom.
pub fn default_reserve(device: &str) -> u64 {
    match device.parse::<Device>() {
        Ok(d) if d.is_gpu() => 1 << 30,
        _ => 0,
    }
}

struct Gpu {
    name: String,
    total: u64,
    free: u64,
    info: GpuInfo,
}

fn nvml() -> anyhow::Result<&'static Nvml> {
    static NVML: OnceLock<Result<Nvml, String>> = OnceLock::new();
    NVML.get_or_init(|| Nvml::init().map_err(|e| e.to_string()))
        .as_ref()
        .map_err(|e| {
            anyhow::anyhow!(
                "NVML is not available ({e}): the NVIDIA driver is not installed, \
                 or not visible here (in a container: the NVIDIA container runtime and a GPU request)"
            )
        })
}

/// NVML's view of GPU `idx`: name, memory, UUID, compute capability, PCIe.
fn gpu_info(idx: u32) -> anyhow::Result<Gpu> {
    let at = |e: &dyn std::fmt::Display| anyhow::anyhow!("device cuda:{idx}: {e}");
    let nvml = nvml().map_err(|e| at(&e))?;
    let count = nvml.device_count().map_err(|e| at(&e))?;
    if idx >= count {
        return Err(at(&format!(
            "no such GPU: NVML sees {count} (cuda:0..cuda:{})",
            count.saturating_sub(1)
        )));
    }
    let d = nvml.device_by_index(idx).map_err(|e| at(&e))?;
    let mem = d.memory_info().map_err(|e| at(&e))?;
    let cc = d.cuda_compute_capability().ok();
    let cuda = nvml.sys_cuda_driver_version().ok();
    Ok(Gpu {
        name: d.name().unwrap_or_default(),
        total: mem.total,
        free: mem.free,
        info: GpuInfo {
            index: idx,
            uuid: d.uuid().unwrap_or_default(),
            compute_capability: cc.map_or_else(String::new, |c| format!("{}.{}", c.major, c.minor)),
            // NVML writes "00000000:C1:00.0"; ggml and sysfs "0000:c1:00.0".
            pci_bus_id: d
                .pci_info()
                .map_or_else(|_| String::new(), |p| pci_bus_id(&p.bus_id)),
            pcie_gen: d.current_pcie_link_gen().unwrap_or(0),
            pcie_width: d.current_pcie_link_width().unwrap_or(0),
            pcie_max_gen: d.max_pcie_link_gen().unwrap_or(0),
            pcie_max_width: d.max_pcie_link_width().unwrap_or(0),
            driver_version: nvml.sys_driver_version().unwrap_or_default(),
            cuda_driver_version: cuda.map_or_else(String::new, |v| {
                format!(
                    "{}.{}",
                    nvml_wrapper::cuda_driver_version_major(v),
                    nvml_wrapper::cuda_driver_version_minor(v)
                )
            }),
        },
    })
}

/// NVML's 8-digit-domain, upper-case bus id in the 4-digit lower-case form.
fn pci_bus_id(nvml: &str) -> String {
    let lower = nvml.to_ascii_lowercase();
    match lower.split_once(':') {
        Some((domain, rest)) if domain.len() > 4 => {
            format!("{}:{rest}", &domain[domain.len() - 4..])
        }
        _ => lower,
    }
}

/// The memory `device` has now, (total, free), less `reserve` and with
/// `cap` applied: the cheap part of [`read`], for status answers.
pub fn memory_now(device: &str, cap: Option<u64>, reserve: u64) -> Option<(u64, u64)> {
    let (total, free) = match device.parse::<Device>().ok()? {
        Device::Cpu => {
            let mut sys = sysinfo::System::new();
            sys.refresh_memory();
            (sys.total_memory(), sys.available_memory())
        }
        Device::Cuda(i) => {
            let m = nvml().ok()?.device_by_index(i).ok()?.memory_info().ok()?;
            (m.total, m.free)
        }
        dev @ Device::Vulkan(_) => {
            let p = omni_engine::device::gpu_props(dev).ok()?;
            (p.memory_total, p.memory_free)
        }
    };
    let cap = cap.unwrap_or(u64::MAX);
    Some((total.min(cap), free.saturating_sub(reserve).min(cap)))
}

/// GPUs NVML can see, for the log line at start (none without a driver).
pub fn gpus() -> Vec<String> {
    let Ok(nvml) = nvml() else {
        return Vec::new();
    };
    let n = nvml.device_count().unwrap_or(0);
    (0..n)
        .filter_map(|i| {
            let d = nvml.device_by_index(i).ok()?;
            let m = d.memory_info().ok()?;
            Some(format!(
                "cuda:{i} {} ({:.1} GiB free of {:.1})",
                d.name().unwrap_or_default(),
                m.free as f64 / (1u64 << 30) as f64,
                m.total as f64 / (1u64 << 30) as f64
            ))
        })
        .collect()
}

fn numa_nodes() -> u32 {
    let n = std::fs::read_dir("/sys/devices/system/node")
        .map(|d| {
            d.filter_map(Result::ok)
                .filter(|e| {
                    let name = e.file_name();
                    let name = name.to_string_lossy();
                    name.strip_prefix("node")
                        .is_some_and(|n| n.chars().all(|c| c.is_ascii_digit()))
                })
                .count()
        })
        .unwrap_or(0);
    n.max(1) as u32
}

fn cpu_name() -> String {
    let mut sys = sysinfo::System::new();
    sys.refresh_cpu_list(sysinfo::CpuRefreshKind::nothing());
    sys.cpus()
        .first()
        .map(|c| c.brand().trim().to_string())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    #[test]
    fn nvml_bus_ids_read_as_ggml_writes_them() {
        assert_eq!(super::pci_bus_id("00000000:C1:00.0"), "0000:c1:00.0");
        assert_eq!(super::pci_bus_id("0000:3B:00.0"), "0000:3b:00.0");
    }

    #[test]
    fn a_gpu_that_is_not_there_is_refused_with_the_reason() {
        // On a machine with no NVIDIA driver (CI), NVML's reason; with one,
        // a GPU number no machine has.
        let e = super::read("cuda:999", None, 0).unwrap_err().to_string();
        assert!(e.contains("cuda:999"), "{e}");
        assert!(
            e.contains("NVML is not available") || e.contains("no such GPU"),
            "{e}"
        );
        let e = super::read("gpu0", None, 0).unwrap_err().to_string();
        assert!(e.contains("expected cpu, cuda:N or vulkan:N"), "{e}");
    }
}
