//! Where a stage computes: `cpu`, `cuda:N` (a GPU through ggml's CUDA
//! backend, loaded at run time when `libggml-cuda.so` is beside the binaries)
//! or `vulkan:N` (a GPU through ggml's Vulkan backend, `libggml-vulkan.so`:
//! AMD and Intel GPUs, and Mesa's software driver lavapipe where there is no
//! GPU at all).

use std::fmt;
use std::str::FromStr;

#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize,
)]
#[serde(into = "String", try_from = "String")]
pub enum Device {
    #[default]
    Cpu,
    /// CUDA's device N, numbered in PCI bus order as NVML numbers them.
    Cuda(u32),
    /// Vulkan device N, as ggml's Vulkan backend numbers the devices it uses
    /// (`GGML_VK_VISIBLE_DEVICES` picks and orders them; see
    /// [`crate::ffi::device`]).
    Vulkan(u32),
}

impl Device {
    /// Whether a stage here computes on a device of a GPU backend (CUDA or
    /// Vulkan: weights and KV cells in the device's memory), not the CPU's.
    pub fn is_gpu(&self) -> bool {
        self.gpu().is_some()
    }

    /// The GPU backend and its device number; `None` for the CPU.
    pub fn gpu(&self) -> Option<(GpuBackend, u32)> {
        match *self {
            Device::Cpu => None,
            Device::Cuda(i) => Some((GpuBackend::Cuda, i)),
            Device::Vulkan(i) => Some((GpuBackend::Vulkan, i)),
        }
    }
}

/// A ggml GPU backend: a library beside the binaries, loaded on first use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GpuBackend {
    Cuda,
    Vulkan,
}

impl GpuBackend {
    /// How devices of this backend are written (`cuda` in `cuda:0`).
    pub fn prefix(self) -> &'static str {
        match self {
            GpuBackend::Cuda => "cuda",
            GpuBackend::Vulkan => "vulkan",
        }
    }

    /// The backend's name in messages.
    pub fn name(self) -> &'static str {
        match self {
            GpuBackend::Cuda => "CUDA",
            GpuBackend::Vulkan => "Vulkan",
        }
    }

    /// The library's file name, beside the binaries.
    pub fn library(self) -> &'static str {
        match self {
            GpuBackend::Cuda => "libggml-cuda.so",
            GpuBackend::Vulkan => "libggml-vulkan.so",
        }
    }

    /// The script that builds the library.
    pub fn build_script(self) -> &'static str {
        match self {
            GpuBackend::Cuda => "scripts/build-cuda",
            GpuBackend::Vulkan => "scripts/build-vulkan",
        }
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
            Device::Vulkan(i) => write!(f, "vulkan:{i}"),
        }
    }
}

impl From<Device> for String {
    fn from(d: Device) -> String {
        d.to_string()
    }
}

impl TryFrom<String> for Device {
    type Error = String;
    fn try_from(s: String) -> Result<Device, String> {
        s.parse()
    }
}

impl FromStr for Device {
    type Err = String;
    fn from_str(s: &str) -> Result<Device, String> {
        let bad = || {
            format!("bad device '{s}': expected cpu, cuda:N or vulkan:N (N a GPU's number, from 0)")
        };
        let t = s.trim();
        if t == "cpu" {
            return Ok(Device::Cpu);
        }
        let (backend, n) = t.split_once(':').ok_or_else(bad)?;
        let n: u32 = n.parse().map_err(|_| bad())?;
        match backend {
            "cuda" => Ok(Device::Cuda(n)),
            "vulkan" => Ok(Device::Vulkan(n)),
            _ => Err(bad()),
        }
    }
}

/// What ggml's GPU backend reports of `device` (CUDA's or Vulkan's), loading
/// the backend if needed: an error names what is missing (the library, the
/// driver, the device: an unknown one is named with the devices there are).
#[cfg(feature = "ggml")]
pub fn gpu_props(device: Device) -> Result<crate::ffi::device::GpuProps, crate::EngineError> {
    let Some((backend, index)) = device.gpu() else {
        return Err(crate::EngineError::Gpu(format!("{device} is not a GPU")));
    };
    crate::ffi::device::gpu_device(backend, index)
        .map(|d| d.props())
        .map_err(crate::EngineError::Gpu)
}

/// How fast a stage on `device` reads its weights in a decode step, in
/// bytes per second: a one-token Q4_K matrix-vector product timed at start
/// (128 MiB on the CPU, past its caches; 1 GiB on a GPU, where a smaller
/// one is mostly launch overhead; never more than `max_bytes`) with
/// `n_threads` CPU threads. Q4_K stands for the quantized weights this
/// project's models are made of; the planner only compares these figures
/// with each other.
///
/// It computes on a thread of its own, which ends before this returns. ggml
/// runs a graph's threads as an OpenMP team, and the thread that starts a
/// team keeps its helper threads parked for the rest of its life. The
/// caller (a worker's `main`) is not the thread its stage computes on, so
/// computing here would leave a second team behind, and while a process
/// has more OpenMP threads than cores, libgomp cuts every barrier's spin
/// short (its "throttled" spin): the stage's threads then sleep and wake at
/// each of a step's few hundred barriers, and a 2-core worker decoded
/// Gemma 3 270M 15-30% slower than the same stage alone in a process.
#[cfg(feature = "ggml")]
pub fn weight_read_rate(
    device: Device,
    n_threads: usize,
    max_bytes: u64,
) -> Result<f64, crate::EngineError> {
    std::thread::scope(|s| {
        s.spawn(|| timed_weight_reads(device, n_threads, max_bytes))
            .join()
            .unwrap_or_else(|_| {
                Err(crate::EngineError::CpuBackend(
                    "timing the weight reads panicked".into(),
                ))
            })
    })
}

#[cfg(feature = "ggml")]
fn timed_weight_reads(
    device: Device,
    n_threads: usize,
    max_bytes: u64,
) -> Result<f64, crate::EngineError> {
    use crate::ffi::ggml;
    let q4_k = crate::gguf::GgmlType::Q4_K.id();
    let budget = std::time::Duration::from_millis(100);
    let size = |want: u64| want.min(max_bytes) as usize;
    match device.gpu() {
        None => ggml::weight_read_rate(None, n_threads, q4_k, size(128 << 20), budget)
            .map_err(crate::EngineError::CpuBackend),
        Some((backend, i)) => {
            let gpu =
                crate::ffi::device::gpu_device(backend, i).map_err(crate::EngineError::Gpu)?;
            ggml::weight_read_rate(Some(gpu), n_threads, q4_k, size(1 << 30), budget)
                .map_err(crate::EngineError::Gpu)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Device;

    #[test]
    fn devices_parse_and_print_the_same() {
        for s in ["cpu", "cuda:0", "cuda:7", "vulkan:0", "vulkan:3"] {
            assert_eq!(s.parse::<Device>().unwrap().to_string(), s);
        }
        for s in [
            "gpu", "cuda", "cuda:", "cuda:-1", "cuda:x", "CPU0", "vulkan", "vulkan:", "rocm:0",
        ] {
            let e = s.parse::<Device>().unwrap_err();
            assert!(
                e.contains(s) && e.contains("cpu, cuda:N or vulkan:N"),
                "{e}"
            );
        }
    }
}
