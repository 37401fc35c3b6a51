//! Saying how a process died: by which signal, in words, to its supervisor's
//! log and to the coordinator that must explain a lost worker to a client.
//!
//! Two ways reach the coordinator, both through the next registration of the
//! worker that died (`RegisterRequest.last_exit`):
//! - the worker's own handler for the fatal signals (SIGILL, SIGSEGV,
//!   SIGBUS, SIGFPE, SIGABRT) writes a record file as it dies, which the next
//!   process of that worker reads, whoever restarted it (Docker, systemd);
//! - a supervisor that saw the exit (`omnictl up`) tells the restarted worker
//!   in `OMNI_WORKER_LAST_EXIT` (it sees every signal, SIGKILL too).

use std::ffi::CString;
use std::path::PathBuf;
use std::process::ExitStatus;
use std::sync::OnceLock;

/// How the previous process of a worker ended, from its supervisor.
pub const LAST_EXIT_ENV: &str = "OMNI_WORKER_LAST_EXIT";

/// The signals whose handler writes the record (the ones a bad kernel or
/// a bad instruction raises; the others are sent and seen by a supervisor).
const FATAL: [libc::c_int; 5] = [
    libc::SIGILL,
    libc::SIGSEGV,
    libc::SIGBUS,
    libc::SIGFPE,
    libc::SIGABRT,
];

/// `SIGILL (illegal instruction)`: a signal's name and what it means.
pub fn signal_text(sig: i32) -> String {
    match signal_name(sig) {
        Some((name, what)) => format!("{name} ({what})"),
        None => format!("signal {sig}"),
    }
}

fn signal_name(sig: i32) -> Option<(&'static str, &'static str)> {
    Some(match sig {
        libc::SIGILL => ("SIGILL", "illegal instruction"),
        libc::SIGSEGV => ("SIGSEGV", "segmentation fault"),
        libc::SIGBUS => ("SIGBUS", "bus error"),
        libc::SIGFPE => ("SIGFPE", "arithmetic exception"),
        libc::SIGABRT => ("SIGABRT", "aborted"),
        libc::SIGKILL => ("SIGKILL", "killed: out of memory, or kill -9"),
        libc::SIGTERM => ("SIGTERM", "terminated"),
        libc::SIGINT => ("SIGINT", "interrupted"),
        libc::SIGHUP => ("SIGHUP", "hang-up"),
        libc::SIGPIPE => ("SIGPIPE", "broken pipe"),
        _ => return None,
    })
}

/// How a child ended, in words: "died of SIGILL (illegal instruction)",
/// "exited with status 1".
pub fn describe(status: &ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    if let Some(sig) = status.signal() {
        let core = if status.core_dumped() {
            ", core dumped"
        } else {
            ""
        };
        match signal_name(sig) {
            Some((name, what)) => format!("died of {name} ({what}{core})"),
            None => format!("died of signal {sig}{core}"),
        }
    } else {
        match status.code() {
            Some(0) => "exited".into(),
            Some(c) => format!("exited with status {c}"),
            None => format!("ended ({status})"),
        }
    }
}

struct Armed {
    record: CString,
    /// Per entry of FATAL: the record's text, and the line for stderr.
    texts: Vec<(Vec<u8>, Vec<u8>)>,
    old: Vec<libc::sigaction>,
}

static ARMED: OnceLock<Armed> = OnceLock::new();

/// Where a worker's record lives: one file per worker id and coordinator,
/// in the temporary directory (it survives a container's restart).
fn record_path(id: &str, coordinator: &str) -> PathBuf {
    let clean = |s: &str| -> String {
        s.chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '-' {
                    c
                } else {
                    '_'
                }
            })
            .collect()
    };
    std::env::temp_dir().join(format!("omni-{}-{}.exit", clean(id), clean(coordinator)))
}

/// Installs the fatal-signal handlers of worker `id` of `coordinator` and
/// returns how its previous process ended, if anyone knows (and logs it):
/// the record that process left (read once, then removed), else the
/// supervisor's `OMNI_WORKER_LAST_EXIT`. A SIGILL's text names `cpu_variant`, the
/// ggml CPU variant the process computes with: the likeliest reason for one.
pub fn arm(service: &str, id: &str, coordinator: &str, cpu_variant: &str) -> Option<String> {
    let path = record_path(id, coordinator);
    let recorded = std::fs::read_to_string(&path)
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty());
    let _ = std::fs::remove_file(&path);
    let from_supervisor = std::env::var(LAST_EXIT_ENV)
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty());
    // The record, when there is one, was written by the previous process
    // itself as it died (each start removes it), and says more (the CPU
    // variant); the supervisor's word covers the signals no handler sees.
    let last = recorded.or(from_supervisor);
    if let Some(e) = &last {
        tracing::warn!("the previous process of worker {id} {e}");
    }
    let Ok(record) = CString::new(path.as_os_str().as_encoded_bytes()) else {
        return last;
    };
    let texts = FATAL
        .iter()
        .map(|&sig| {
            let mut text = format!("died of {}", signal_text(sig));
            if sig == libc::SIGILL && !cpu_variant.is_empty() {
                text.push_str(&format!(" with ggml CPU variant {cpu_variant}"));
            }
            let line = format!("{service} {id}: {text}\n");
            (text.into_bytes(), line.into_bytes())
        })
        .collect();
    let mut armed = Armed {
        record,
        texts,
        old: Vec::with_capacity(FATAL.len()),
    };
    for &sig in &FATAL {
        // SAFETY: a zeroed sigaction is a valid "no handler" value to read into.
        let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
        // SAFETY: querying the current action of a valid signal.
        unsafe { libc::sigaction(sig, std::ptr::null(), &mut old) };
        armed.old.push(old);
    }
    if ARMED.set(armed).is_ok() {
        for &sig in &FATAL {
            // SAFETY: installs `on_fatal` (async-signal-safe: it only uses
            // open/write/close/sigaction on data prepared above) with
            // SA_SIGINFO so the previous handler can be chained to.
            unsafe {
                let mut act: libc::sigaction = std::mem::zeroed();
                act.sa_sigaction = on_fatal as *const () as usize;
                act.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
                libc::sigemptyset(&mut act.sa_mask);
                libc::sigaction(sig, &act, std::ptr::null_mut());
            }
        }
    }
    last
}

/// Writes the record and the log line, then puts the previous action back:
/// a fault's instruction runs again on return, and a signal that was sent
/// (`kill`, `abort`) is raised again, so the previous handler (Rust's
/// stack-overflow check) or the default action ends the process with the
/// same signal, as it would have without us.
extern "C" fn on_fatal(sig: libc::c_int, info: *mut libc::siginfo_t, _: *mut libc::c_void) {
    let Some(a) = ARMED.get() else { return };
    let Some(i) = FATAL.iter().position(|&s| s == sig) else {
        return;
    };
    let (text, line) = &a.texts[i];
    // SAFETY: only async-signal-safe calls, on buffers prepared before any
    // signal could arrive; a failed open or write is ignored.
    unsafe {
        libc::write(2, line.as_ptr().cast(), line.len());
        let fd = libc::open(
            a.record.as_ptr(),
            libc::O_WRONLY | libc::O_CREAT | libc::O_TRUNC | libc::O_CLOEXEC,
            0o600,
        );
        if fd >= 0 {
            libc::write(fd, text.as_ptr().cast(), text.len());
            libc::close(fd);
        }
        libc::sigaction(sig, &a.old[i], std::ptr::null_mut());
        // si_code <= 0: sent by a process (SI_USER, SI_QUEUE, SI_TKILL),
        // not raised by an instruction that would fault again.
        if info.is_null() || (*info).si_code <= 0 {
            libc::raise(sig);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::ExitStatusExt;

    #[test]
    fn exits_are_said_in_words() {
        // Wait statuses: a signal in the low 7 bits, 0x80 for a core dump.
        assert_eq!(
            describe(&ExitStatus::from_raw(libc::SIGILL)),
            "died of SIGILL (illegal instruction)"
        );
        assert_eq!(
            describe(&ExitStatus::from_raw(libc::SIGSEGV | 0x80)),
            "died of SIGSEGV (segmentation fault, core dumped)"
        );
        assert_eq!(
            describe(&ExitStatus::from_raw(9)),
            "died of SIGKILL (killed: out of memory, or kill -9)"
        );
        assert_eq!(
            describe(&ExitStatus::from_raw(3 << 8)),
            "exited with status 3"
        );
        assert_eq!(describe(&ExitStatus::from_raw(0)), "exited");
        assert_eq!(signal_text(63), "signal 63");
    }

    #[test]
    fn a_record_is_per_worker_and_coordinator() {
        let a = record_path("w0", "127.0.0.1:7070");
        assert!(a.ends_with("omni-w0-127_0_0_1_7070.exit"), "{a:?}");
        assert_ne!(a, record_path("w1", "127.0.0.1:7070"));
        assert_ne!(a, record_path("w0", "127.0.0.1:7071"));
    }
}
