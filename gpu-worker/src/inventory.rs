//! What this worker's device offers: memory (GPU memory through NVML for a
//! `cuda:N` device, system memory for `cpu`), cores and NUMA nodes.

use omni_proto::worker::v1::Inventory;

/// Reads the inventory of `device` ("cpu" or "cuda:N"). `cap` limits the
/// memory offered (a worker sharing a machine with others).
pub fn read(device: &str, cap: Option<u64>) -> anyhow::Result<Inventory> {
    let mut sys = sysinfo::System::new();
    sys.refresh_memory();
    let mut inv = Inventory {
        device: device.to_string(),
        cpu_cores: std::thread::available_parallelism().map_or(1, |n| n.get()) as u32,
        numa_nodes: numa_nodes(),
        hostname: sysinfo::System::host_name().unwrap_or_default(),
        host_id: omni_transport::host_id(),
        ..Default::default()
    };
    if device == "cpu" {
        inv.device_name = cpu_name();
        (inv.memory_total, inv.memory_free) = (sys.total_memory(), sys.available_memory());
    } else if let Some(idx) = device.strip_prefix("cuda:") {
        let idx: u32 = idx
            .parse()
            .map_err(|_| anyhow::anyhow!("bad device '{device}': expected cpu or cuda:N"))?;
        let nvml = nvml_wrapper::Nvml::init().map_err(|e| {
            anyhow::anyhow!(
                "device {device}: NVML is not available ({e}); is the NVIDIA driver installed?"
            )
        })?;
        let dev = nvml
            .device_by_index(idx)
            .map_err(|e| anyhow::anyhow!("device {device}: {e}"))?;
        let mem = dev
            .memory_info()
            .map_err(|e| anyhow::anyhow!("device {device}: {e}"))?;
        inv.device_name = dev.name().unwrap_or_default();
        inv.memory_total = mem.total;
        inv.memory_free = mem.free;
        inv.nvml = true;
        anyhow::bail!(
            "device {device} ({}, {} bytes free) was found, but this build runs layers on the CPU only; use --device cpu",
            inv.device_name,
            inv.memory_free
        );
    } else {
        anyhow::bail!("bad device '{device}': expected cpu or cuda:N");
    }
    if let Some(cap) = cap {
        inv.memory_total = inv.memory_total.min(cap);
        inv.memory_free = inv.memory_free.min(cap);
    }
    Ok(inv)
}

/// The memory a `cpu` device has now, (total, free), with `cap` applied: the
/// cheap part of [`read`], for status answers. None for other devices.
pub fn cpu_memory(device: &str, cap: Option<u64>) -> Option<(u64, u64)> {
    if device != "cpu" {
        return None;
    }
    let mut sys = sysinfo::System::new();
    sys.refresh_memory();
    let cap = cap.unwrap_or(u64::MAX);
    Some((sys.total_memory().min(cap), sys.available_memory().min(cap)))
}

/// GPUs NVML can see, for the log line at start (none without a driver).
pub fn gpus() -> Vec<String> {
    let Ok(nvml) = nvml_wrapper::Nvml::init() else {
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
