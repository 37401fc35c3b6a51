//! GPUs: ggml's CUDA backend (`libggml-cuda.so`, built by
//! `scripts/build-cuda`) and its Vulkan backend (`libggml-vulkan.so`, built
//! by `scripts/build-vulkan`), libraries loaded at run time from beside the
//! binaries, like the CPU variants. A build without them, or a machine
//! without the driver, still runs everything on the CPU; asking for
//! `cuda:N` or `vulkan:N` there is an error that says what is missing.
//!
//! ggml-vulkan uses only discrete and integrated GPUs unless
//! `GGML_VK_VISIBLE_DEVICES` (ggml's own variable, its `CUDA_VISIBLE_DEVICES`)
//! lists the devices to use by their Vulkan numbers: that is how a CPU-type
//! device, Mesa's software driver lavapipe, becomes `vulkan:0` where there is
//! no GPU (the tests' device). omni never sets it: a user with a GPU gets
//! ggml's choice.

use std::ffi::{CStr, CString};
use std::path::PathBuf;
use std::sync::OnceLock;

use llama_cpp_sys_2 as sys;

use super::cpu_variant::{self, Reg};
use crate::GpuBackend;

static CUDA: OnceLock<Result<Reg, String>> = OnceLock::new();
static VULKAN: OnceLock<Result<Reg, String>> = OnceLock::new();

/// A device of a loaded GPU backend.
#[derive(Clone, Copy, Debug)]
pub struct GpuDevice(pub(crate) sys::ggml_backend_dev_t);

// SAFETY: devices are static objects of a backend library that stays loaded.
unsafe impl Send for GpuDevice {}
unsafe impl Sync for GpuDevice {}

/// What a GPU backend says of one of its devices.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuProps {
    /// ggml's name (`CUDA0`, `Vulkan0`).
    pub name: String,
    /// The GPU's name (`NVIDIA H100 80GB HBM3`, `llvmpipe (LLVM 15.0.6, 256 bits)`).
    pub description: String,
    pub memory_free: u64,
    pub memory_total: u64,
    /// Lower-case PCI bus id (`0000:c1:00.0`), when the backend knows it.
    pub pci_bus_id: Option<String>,
}

/// Where the library of `backend` would be (beside the CPU variants).
pub fn library_path(backend: GpuBackend) -> Result<PathBuf, String> {
    Ok(cpu_variant::library_dir()?.join(backend.library()))
}

/// The backend's registration, loaded on first use.
fn reg(backend: GpuBackend) -> Result<sys::ggml_backend_reg_t, String> {
    let cell = match backend {
        GpuBackend::Cuda => &CUDA,
        GpuBackend::Vulkan => &VULKAN,
    };
    cell.get_or_init(|| load(backend))
        .as_ref()
        .map(|r| r.0)
        .map_err(Clone::clone)
}

fn load(backend: GpuBackend) -> Result<Reg, String> {
    super::ggml::init_logging();
    // The CPU backend first: ggml's scheduler needs it beside any GPU.
    cpu_variant::load(None)?;
    let name = backend.name();
    if backend == GpuBackend::Cuda && std::env::var_os("CUDA_DEVICE_ORDER").is_none() {
        // CUDA numbers GPUs fastest first unless told otherwise; NVML (the
        // inventory) numbers them by PCI bus. Same numbers on both sides.
        // Read by the CUDA runtime when the library below initialises it.
        std::env::set_var("CUDA_DEVICE_ORDER", "PCI_BUS_ID");
    }
    let path = library_path(backend)?;
    if !path.exists() {
        return Err(format!(
            "this build has no {name} backend ({} is missing; {} builds it)",
            path.display(),
            backend.build_script()
        ));
    }
    // Opened once ourselves for the loader's own reason (a missing
    // libcuda.so.1 means no NVIDIA driver, a missing libvulkan.so.1 no
    // Vulkan loader); ggml only logs it.
    // SAFETY: the library's initialisers are the backend's and ggml's, which
    // only register types; ggml loads the same file right after.
    if let Err(e) = unsafe { libloading::Library::new(&path) } {
        let why = e.to_string();
        let hint = if why.contains("libcuda.so") {
            " (the NVIDIA driver is not installed, or not visible in this container)"
        } else if why.contains("libvulkan.so") {
            " (the Vulkan loader is not installed: Debian's and Ubuntu's libvulkan1, with a driver \
             such as mesa-vulkan-drivers)"
        } else {
            ""
        };
        return Err(format!(
            "the {name} backend {} cannot load: {why}{hint}",
            path.display()
        ));
    }
    let c_path = CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|_| format!("{}: the path has a NUL byte", path.display()))?;
    // SAFETY: loads a ggml backend library by path; ggml checks its API version.
    let reg = unsafe { sys::ggml_backend_load(c_path.as_ptr()) };
    if reg.is_null() {
        let visible = match (backend, std::env::var("GGML_VK_VISIBLE_DEVICES")) {
            (GpuBackend::Vulkan, Ok(v)) => format!(
                "; GGML_VK_VISIBLE_DEVICES={v} must list device numbers that `vulkaninfo --summary` shows"
            ),
            _ => String::new(),
        };
        return Err(format!(
            "ggml could not start the {name} backend {} (no usable GPU, or a driver too old for it{visible}; \
             run with OMNI_GGML_LOG=1 for ggml's reason)",
            path.display()
        ));
    }
    Ok(Reg(reg))
}

/// The devices `backend` uses, as `vulkan:0 (llvmpipe ...)` for messages.
fn device_list(backend: GpuBackend, reg: sys::ggml_backend_reg_t) -> Vec<String> {
    // SAFETY: valid registration.
    let n = unsafe { sys::ggml_backend_reg_dev_count(reg) };
    (0..n)
        .map(|i| {
            // SAFETY: i is below the count.
            let dev = unsafe { sys::ggml_backend_reg_dev_get(reg, i) };
            let desc = if dev.is_null() {
                String::new()
            } else {
                format!(" ({})", GpuDevice(dev).props().description)
            };
            format!("{}:{i}{desc}", backend.prefix())
        })
        .collect()
}

/// Device `index` of `backend`: CUDA's numbering in PCI bus order (as
/// NVML's), Vulkan's as ggml-vulkan lists the devices it uses.
pub fn gpu_device(backend: GpuBackend, index: u32) -> Result<GpuDevice, String> {
    let reg = reg(backend)?;
    // SAFETY: valid registration.
    let n = unsafe { sys::ggml_backend_reg_dev_count(reg) };
    if n == 0 && backend == GpuBackend::Vulkan {
        return Err(format!(
            "vulkan:{index} does not exist: the Vulkan backend sees no usable device. It uses \
             discrete and integrated GPUs only, unless GGML_VK_VISIBLE_DEVICES lists the Vulkan \
             devices to use (their numbers as `vulkaninfo --summary` shows them): set \
             GGML_VK_VISIBLE_DEVICES=0 to use a CPU (software) device such as Mesa's lavapipe"
        ));
    }
    if index as usize >= n {
        return Err(format!(
            "{}:{index} does not exist: the {} backend sees {n} device{}{}",
            backend.prefix(),
            backend.name(),
            if n == 1 { "" } else { "s" },
            if n == 0 {
                String::new()
            } else {
                format!(": {}", device_list(backend, reg).join(", "))
            }
        ));
    }
    // SAFETY: index checked against the count.
    let dev = unsafe { sys::ggml_backend_reg_dev_get(reg, index as usize) };
    if dev.is_null() {
        return Err(format!(
            "the {} backend has no device {index}",
            backend.name()
        ));
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
