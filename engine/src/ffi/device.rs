//! GPUs: ggml's CUDA backend, a library (`libggml-cuda.so`, built by
//! `scripts/build-cuda`) loaded at run time from beside the binaries, like
//! the CPU variants. A build without it, or a machine without the NVIDIA
//! driver, still runs everything on the CPU; asking for `cuda:N` there is an
//! error that says which of the two is missing.

use std::ffi::{CStr, CString};
use std::path::PathBuf;
use std::sync::OnceLock;

use llama_cpp_sys_2 as sys;

use super::cpu_variant::{self, Reg};

/// The library's file name.
pub const CUDA_LIBRARY: &str = "libggml-cuda.so";

static CUDA: OnceLock<Result<Reg, String>> = OnceLock::new();

/// A device of a loaded GPU backend.
#[derive(Clone, Copy, Debug)]
pub struct GpuDevice(pub(crate) sys::ggml_backend_dev_t);

// SAFETY: devices are static objects of a backend library that stays loaded.
unsafe impl Send for GpuDevice {}
unsafe impl Sync for GpuDevice {}

/// What ggml's CUDA backend says of one of its devices.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuProps {
    /// ggml's name (`CUDA0`).
    pub name: String,
    /// The GPU's name (`NVIDIA H100 80GB HBM3`).
    pub description: String,
    pub memory_free: u64,
    pub memory_total: u64,
    /// Lower-case PCI bus id (`0000:c1:00.0`), when the backend knows it.
    pub pci_bus_id: Option<String>,
}

/// Where `libggml-cuda.so` would be (beside the CPU variants).
pub fn cuda_library_path() -> Result<PathBuf, String> {
    Ok(cpu_variant::library_dir()?.join(CUDA_LIBRARY))
}

/// ggml's CUDA backend, loaded on first use.
fn cuda_reg() -> Result<sys::ggml_backend_reg_t, String> {
    CUDA.get_or_init(load_cuda)
        .as_ref()
        .map(|r| r.0)
        .map_err(Clone::clone)
}

fn load_cuda() -> Result<Reg, String> {
    super::ggml::init_logging();
    // The CPU backend first: ggml's scheduler needs it beside any GPU.
    cpu_variant::load(None)?;
    // CUDA numbers GPUs fastest first unless told otherwise; NVML (the
    // inventory) numbers them by PCI bus. Same numbers on both sides.
    if std::env::var_os("CUDA_DEVICE_ORDER").is_none() {
        // Read by the CUDA runtime when the library below initialises it.
        std::env::set_var("CUDA_DEVICE_ORDER", "PCI_BUS_ID");
    }
    let path = cuda_library_path()?;
    if !path.exists() {
        return Err(format!(
            "this build has no CUDA backend ({} is missing; scripts/build-cuda builds it)",
            path.display()
        ));
    }
    // Opened once ourselves for the loader's own reason (a missing
    // libcuda.so.1 means no NVIDIA driver); ggml only logs it.
    // SAFETY: the library's initialisers are CUDA's and ggml's, which only
    // register types; ggml loads the same file right after.
    if let Err(e) = unsafe { libloading::Library::new(&path) } {
        return Err(format!(
            "the CUDA backend {} cannot load: {e}{}",
            path.display(),
            if e.to_string().contains("libcuda.so") {
                " (the NVIDIA driver is not installed, or not visible in this container)"
            } else {
                ""
            }
        ));
    }
    let c_path = CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|_| format!("{}: the path has a NUL byte", path.display()))?;
    // SAFETY: loads a ggml backend library by path; ggml checks its API version.
    let reg = unsafe { sys::ggml_backend_load(c_path.as_ptr()) };
    if reg.is_null() {
        return Err(format!(
            "ggml could not start the CUDA backend {} (no usable GPU, or a driver too old for it; \
             run with OMNI_GGML_LOG=1 for ggml's reason)",
            path.display()
        ));
    }
    Ok(Reg(reg))
}

/// The CUDA device `index` (CUDA's numbering in PCI bus order, as NVML's).
pub fn cuda_device(index: u32) -> Result<GpuDevice, String> {
    let reg = cuda_reg()?;
    // SAFETY: valid registration.
    let n = unsafe { sys::ggml_backend_reg_dev_count(reg) };
    if index as usize >= n {
        return Err(format!(
            "cuda:{index} does not exist: the CUDA backend sees {n} GPU{}",
            if n == 1 { "" } else { "s" }
        ));
    }
    // SAFETY: index checked against the count.
    let dev = unsafe { sys::ggml_backend_reg_dev_get(reg, index as usize) };
    if dev.is_null() {
        return Err(format!("the CUDA backend has no device {index}"));
    }
    Ok(GpuDevice(dev))
}

impl GpuDevice {
    pub fn props(&self) -> GpuProps {
        // SAFETY: plain-data struct that ggml fills in.
        let mut p: sys::ggml_backend_dev_props = unsafe { std::mem::zeroed() };
        // SAFETY: valid device; the strings it points to are static.
        unsafe { sys::ggml_backend_dev_get_props(self.0, &mut p) };
        let s = |c: *const std::ffi::c_char| {
            (!c.is_null()).then(|| {
                // SAFETY: NUL-terminated string owned by the backend.
                unsafe { CStr::from_ptr(c) }.to_string_lossy().into_owned()
            })
        };
        GpuProps {
            name: s(p.name).unwrap_or_default(),
            description: s(p.description).unwrap_or_default(),
            memory_free: p.memory_free as u64,
            memory_total: p.memory_total as u64,
            pci_bus_id: s(p.device_id),
        }
    }
}
