//! Which of ggml's CPU backends this process computes with.
//!
//! ggml is built once per x86 level (`libggml-cpu-<variant>.so`: x64,
//! sse42, sandybridge, haswell, skylakex, icelake, zen4, alderlake, ...,
//! llama-cpp-sys-2's `dynamic-backends`), and nothing in our binaries is
//! compiled for one CPU. At the first use of the CPU backend we load one
//! variant: the one a user forced (`OMNI_CPU_VARIANT` or a service's
//! `--cpu-variant`), else the best this CPU runs, as ggml's own
//! `ggml_backend_load_best` would choose it (its `ggml_backend_score`), except
//! that a variant using AMX is never loaded: ggml's AMX matmul segfaults on
//! Sapphire Rapids (llama.cpp #20824, closed stale without a fix) and dies of
//! SIGILL (`tilezero`) on an AMX-capable VM whose kernel grants AMX, so such
//! a CPU gets the best variant without AMX (zen4's feature set: AVX-512 with
//! VBMI, VNNI and BF16), and forcing one is refused with what to choose.
//!
//! We choose here rather than call `ggml_backend_load_best` to keep that rule,
//! to honour a forced variant with an error that names what this CPU runs, and
//! to report which variant each process uses.

use std::ffi::{c_void, CStr, CString};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use llama_cpp_sys_2 as sys;

/// The variable that forces a variant (a service's `--cpu-variant` sets it too).
pub const ENV: &str = "OMNI_CPU_VARIANT";

/// `ggml_backend_score` adds this bit for a variant built with AMX-INT8 on
/// a CPU that has it (ggml-cpu/arch/x86/cpu-feats.cpp).
const AMX_SCORE_BIT: i32 = 1 << 11;
/// Variants built with AMX in this ggml (ggml/src/CMakeLists.txt), in case a
/// later scoring stops setting the bit.
const AMX_VARIANTS: &[&str] = &["sapphirerapids"];

/// One variant library found beside the binaries, scored against this CPU.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Candidate {
    pub name: String,
    pub path: PathBuf,
    /// ggml's score: 0 when this CPU lacks an instruction the variant uses,
    /// higher for more features.
    pub score: i32,
}

impl Candidate {
    /// Whether the variant computes with AMX (never loaded, see the module
    /// comment).
    pub fn uses_amx(&self) -> bool {
        self.score & AMX_SCORE_BIT != 0 || AMX_VARIANTS.contains(&self.name.as_str())
    }
}

/// The CPU backend this process loaded (one of ggml's per-CPU-level
/// libraries), as `omni_engine::cpu_backend` describes it.
#[derive(Debug)]
pub struct CpuBackendInfo {
    /// The variant's name (`haswell`, `zen4`, ...).
    pub variant: String,
    pub path: PathBuf,
    /// What ggml reports the loaded backend uses (AVX2, AVX512_VNNI, ...).
    pub features: Vec<String>,
    /// Chosen by `OMNI_CPU_VARIANT` / `--cpu-variant` rather than automatically.
    pub forced: bool,
    /// Every variant the build has, best first, with ggml's score on this
    /// CPU (0: it uses instructions this CPU lacks).
    pub candidates: Vec<Candidate>,
    pub(crate) reg: Reg,
}

impl std::fmt::Display for CpuBackendInfo {
    /// `haswell (SSE3 SSSE3 AVX AVX2 ...)`, `, forced` after the name when forced.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}{} ({})",
            self.variant,
            if self.forced { ", forced" } else { "" },
            self.features.join(" ")
        )
    }
}

#[derive(Debug)]
pub(crate) struct Reg(pub(crate) sys::ggml_backend_reg_t);

// SAFETY: a backend registration is a static object inside the loaded
// library, which stays loaded for the life of the process.
unsafe impl Send for Reg {}
unsafe impl Sync for Reg {}

static LOADED: OnceLock<Result<CpuBackendInfo, String>> = OnceLock::new();

/// The CPU backend, loaded on first use. `request` (a service's flag) wins
/// over `OMNI_CPU_VARIANT`; without either the best variant is chosen. A
/// request that differs from what an earlier call already loaded is an error:
/// a process computes with one variant.
pub fn load(request: Option<&str>) -> Result<&'static CpuBackendInfo, String> {
    let env = std::env::var(ENV).ok().filter(|v| !v.trim().is_empty());
    let wanted = request
        .filter(|r| !r.trim().is_empty())
        .map(|r| r.trim().to_string())
        .or(env.map(|e| e.trim().to_string()));
    let loaded = LOADED
        .get_or_init(|| load_now(wanted.as_deref()))
        .as_ref()
        .map_err(Clone::clone)?;
    match request {
        Some(r) if !r.trim().is_empty() && r.trim() != loaded.variant => Err(format!(
            "the CPU variant '{}' is already loaded in this process; '{}' cannot replace it \
             (set {ENV} before the process starts)",
            loaded.variant,
            r.trim()
        )),
        _ => Ok(loaded),
    }
}

fn load_now(wanted: Option<&str>) -> Result<CpuBackendInfo, String> {
    super::ggml::init_logging();
    let dir = library_dir()?;
    let candidates = scan(&dir)?;
    let pick = choose(&candidates, wanted)?;
    let c_path = CString::new(pick.path.as_os_str().as_encoded_bytes())
        .map_err(|_| format!("{}: the path has a NUL byte", pick.path.display()))?;
    // SAFETY: loads a ggml backend library by path; ggml checks its score
    // (0: not for this CPU) and API version before registering it.
    let reg = unsafe { sys::ggml_backend_load(c_path.as_ptr()) };
    if reg.is_null() {
        return Err(format!(
            "ggml could not load the CPU backend {} (run with OMNI_GGML_LOG=1 for ggml's reason)",
            pick.path.display()
        ));
    }
    let features = features(reg);
    let forced = wanted.is_some();
    if features.iter().any(|f| f.starts_with("AMX")) {
        return Err(format!(
            "the CPU variant '{}' uses AMX, which omni never uses (llama.cpp #20824); \
             set {ENV} to a variant without it",
            pick.name
        ));
    }
    Ok(CpuBackendInfo {
        variant: pick.name.clone(),
        path: pick.path.clone(),
        features,
        forced,
        candidates,
        reg: Reg(reg),
    })
}

/// Where the libraries are: beside the executable (the binaries in
/// `target/<profile>/` and in the image), its parent (test binaries in
/// `target/<profile>/deps/` and examples), or where the build put them.
pub(crate) fn library_dir() -> Result<PathBuf, String> {
    let exe = std::env::current_exe().ok();
    let mut dirs: Vec<PathBuf> = Vec::new();
    if let Some(dir) = exe.as_deref().and_then(Path::parent) {
        dirs.push(dir.to_path_buf());
        if let Some(up) = dir.parent() {
            dirs.push(up.to_path_buf());
        }
    }
    dirs.push(PathBuf::from(env!("OMNI_BUILD_LIB_DIR")));
    for d in &dirs {
        if list(d).is_ok_and(|v| !v.is_empty()) {
            return Ok(d.clone());
        }
    }
    Err(format!(
        "no ggml CPU backend (libggml-cpu-<variant>.so) in {}: omni's binaries need the \
         libraries the build puts beside them (target/release/lib*.so*); copy them along",
        dirs.iter()
            .map(|d| d.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    ))
}

/// The variant libraries in `dir`, as (name, path).
fn list(dir: &Path) -> std::io::Result<Vec<(String, PathBuf)>> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        let Some(file) = path.file_name().and_then(|f| f.to_str()) else {
            continue;
        };
        if let Some(name) = file
            .strip_prefix("libggml-cpu-")
            .and_then(|f| f.strip_suffix(".so"))
        {
            out.push((name.to_string(), path.clone()));
        }
    }
    Ok(out)
}

/// Scores every variant in `dir` against this CPU, best first.
fn scan(dir: &Path) -> Result<Vec<Candidate>, String> {
    let mut out = Vec::new();
    for (name, path) in list(dir).map_err(|e| format!("{}: {e}", dir.display()))? {
        let score = score(&path)?;
        out.push(Candidate { name, path, score });
    }
    out.sort_by(|a, b| b.score.cmp(&a.score).then(a.name.cmp(&b.name)));
    Ok(out)
}

/// ggml's own score of one variant (what `ggml_backend_load_best` asks):
/// the library is opened, asked, and closed again.
fn score(path: &Path) -> Result<i32, String> {
    // SAFETY: a ggml CPU variant library; its initialisers run no
    // instructions the CPU may lack (that is what the score is for), and
    // ggml's own loader opens every variant the same way.
    let lib = unsafe { libloading::Library::new(path) }
        .map_err(|e| format!("cannot open the CPU backend {}: {e}", path.display()))?;
    // SAFETY: `ggml_backend_score` is `int (void)` in every ggml backend
    // library (GGML_BACKEND_DL_SCORE_IMPL).
    let f = unsafe { lib.get::<unsafe extern "C" fn() -> i32>(b"ggml_backend_score\0") }
        .map_err(|e| format!("{} is not a ggml CPU backend: {e}", path.display()))?;
    // SAFETY: plain query, no arguments.
    Ok(unsafe { f() })
}

/// The variant to load: the forced one (which this CPU must run), else the
/// best-scoring one without AMX.
pub fn choose<'a>(
    candidates: &'a [Candidate],
    wanted: Option<&str>,
) -> Result<&'a Candidate, String> {
    // The names of the variants that pass `keep`, for the messages.
    let names = |keep: fn(&Candidate) -> bool| {
        candidates
            .iter()
            .filter(|c| keep(c))
            .map(|c| c.name.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    };
    if let Some(w) = wanted {
        let c = candidates.iter().find(|c| c.name == w).ok_or_else(|| {
            format!(
                "CPU variant '{w}' ({ENV} or --cpu-variant): no such variant; built: {}",
                names(|_| true)
            )
        })?;
        if c.score == 0 {
            return Err(format!(
                "CPU variant '{w}' ({ENV} or --cpu-variant) uses instructions this CPU lacks; \
                 it runs: {}",
                names(|c| c.score > 0 && !c.uses_amx())
            ));
        }
        if c.uses_amx() {
            return Err(format!(
                "CPU variant '{w}' ({ENV} or --cpu-variant) computes with AMX, whose matmul \
                 kernels in this ggml crash (llama.cpp #20824: a segfault on Sapphire Rapids, an \
                 illegal instruction on an AMX virtual machine); choose one of: {}",
                names(|c| c.score > 0 && !c.uses_amx())
            ));
        }
        return Ok(c);
    }
    candidates
        .iter()
        .filter(|c| c.score > 0 && !c.uses_amx())
        .max_by_key(|c| c.score)
        .ok_or_else(|| {
            format!(
                "none of the CPU variants ({}) runs on this CPU",
                names(|_| true)
            )
        })
}

/// A function a backend exports through its registry (as llama.cpp reaches
/// the CPU backend's under `GGML_BACKEND_DL`: they are not linked).
pub(crate) fn proc_address(reg: sys::ggml_backend_reg_t, name: &CStr) -> Option<*mut c_void> {
    // SAFETY: a proc-address query by a NUL-terminated name on a valid reg.
    let f = unsafe { sys::ggml_backend_reg_get_proc_address(reg, name.as_ptr()) };
    (!f.is_null()).then_some(f)
}

/// The features a loaded CPU backend reports (`ggml_backend_get_features`).
fn features(reg: sys::ggml_backend_reg_t) -> Vec<String> {
    type GetFeatures =
        unsafe extern "C" fn(sys::ggml_backend_reg_t) -> *mut sys::ggml_backend_feature;
    let Some(f) = proc_address(reg, c"ggml_backend_get_features") else {
        return Vec::new();
    };
    // SAFETY: ggml documents this proc's signature as `ggml_backend_get_features_t`.
    let get: GetFeatures = unsafe { std::mem::transmute::<*mut c_void, GetFeatures>(f) };
    let mut out = Vec::new();
    // SAFETY: returns a static array terminated by an entry with a NULL name.
    unsafe {
        let mut p = get(reg);
        while !p.is_null() && !(*p).name.is_null() {
            let name = CStr::from_ptr((*p).name).to_string_lossy();
            let value = if (*p).value.is_null() {
                String::new()
            } else {
                CStr::from_ptr((*p).value).to_string_lossy().into_owned()
            };
            out.push(if value == "1" {
                name.into_owned()
            } else {
                format!("{name}={value}")
            });
            p = p.add(1);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(name: &str, score: i32) -> Candidate {
        Candidate {
            name: name.into(),
            path: PathBuf::from(format!("libggml-cpu-{name}.so")),
            score,
        }
    }

    /// Scores as ggml gives them on a Sapphire Rapids (AMX + AVX-512 BF16/VNNI/VBMI).
    fn sapphire_rapids() -> Vec<Candidate> {
        vec![
            c("sapphirerapids", 4032),
            c("zen4", 1984),
            c("cooperlake", 1728),
            c("icelake", 1472),
            c("haswell", 64),
            c("x64", 1),
            c("alderlake", 0),
        ]
    }

    #[test]
    fn the_best_variant_without_amx_is_chosen() {
        let cands = sapphire_rapids();
        assert_eq!(choose(&cands, None).unwrap().name, "zen4");
        // Without the AMX variant's bit, its name still keeps it out.
        let mut no_bit = cands.clone();
        no_bit[0].score = 4032 & !AMX_SCORE_BIT;
        assert_eq!(choose(&no_bit, None).unwrap().name, "zen4");
        // An AVX2 desktop.
        let desktop = vec![
            c("haswell", 64),
            c("sandybridge", 21),
            c("zen4", 0),
            c("x64", 1),
        ];
        assert_eq!(choose(&desktop, None).unwrap().name, "haswell");
    }

    #[test]
    fn a_forced_variant_must_exist_and_run_here() {
        let cands = sapphire_rapids();
        assert_eq!(choose(&cands, Some("haswell")).unwrap().name, "haswell");
        // AMX crashes in this ggml: refused, with what to choose instead.
        let e = choose(&cands, Some("sapphirerapids")).unwrap_err();
        assert!(
            e.contains("computes with AMX") && e.contains("choose one of: zen4, cooperlake"),
            "{e}"
        );
        let e = choose(&cands, Some("alderlake")).unwrap_err();
        assert!(
            e.contains("instructions this CPU lacks") && e.contains("zen4, cooperlake"),
            "{e}"
        );
        let e = choose(&cands, Some("pentium")).unwrap_err();
        assert!(
            e.contains("'pentium'") && e.contains("no such variant") && e.contains("haswell"),
            "{e}"
        );
        let e = choose(&[c("zen4", 0)], None).unwrap_err();
        assert!(e.contains("none of the CPU variants (zen4)"), "{e}");
    }
}
