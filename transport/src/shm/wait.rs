//! Waiting on a ring word (futex) and telling a dead peer from a slow one.

use super::Header;
use super::ShmError;
use super::PURE_SPIN;
use super::SLEEP_SLICE;
use std::io;
use std::os::unix::fs::MetadataExt;
use std::ptr;
use std::sync::atomic::fence;
use std::sync::atomic::AtomicU32;
use std::sync::atomic::Ordering;
use std::time::Duration;
use std::time::Instant;

/// Spins for `spin`, then sleeps on the futex `seq`, until `ready` returns
/// true (Ok(true)) or `deadline` passes (Ok(false)). `ready(true)` is called
/// after a sleep timed out, when it is worth a system call to check whether
/// the peer's process still exists.
pub(super) fn wait_for(
    seq: &AtomicU32,
    waiting: &AtomicU32,
    spin: Duration,
    deadline: Instant,
    mut ready: impl FnMut(bool) -> Result<bool, ShmError>,
) -> Result<bool, ShmError> {
    let start = Instant::now();
    let spin_until = start
        .checked_add(spin)
        .map_or(deadline, |t| t.min(deadline));
    let mut spins = 0u32;
    loop {
        if ready(false)? {
            return Ok(true);
        }
        spins = spins.wrapping_add(1);
        if spins.is_multiple_of(16) {
            let now = Instant::now();
            if now >= spin_until {
                break;
            }
            // Past the first few microseconds, give the core away between
            // checks: when the host has more busy threads than cores, the
            // peer we wait for may be queued behind us on this very core.
            if now - start > PURE_SPIN {
                std::thread::yield_now();
            }
        }
        std::hint::spin_loop();
    }
    loop {
        let now = Instant::now();
        if now >= deadline {
            return ready(true);
        }
        // Read the futex word before announcing: a wake that lands between
        // here and FUTEX_WAIT has bumped it, so the wait returns at once.
        let expected = seq.load(Ordering::SeqCst);
        waiting.store(1, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        let r = ready(false);
        if !matches!(r, Ok(false)) {
            waiting.store(0, Ordering::Relaxed);
            return r;
        }
        let timed_out = futex_wait(seq, expected, (deadline - now).min(SLEEP_SLICE));
        waiting.store(0, Ordering::Relaxed);
        if ready(timed_out)? {
            return Ok(true);
        }
    }
}

/// Sleeps while `*word == expected`, at most `timeout`. Returns whether the
/// sleep ended by timing out. Spurious returns are fine: callers re-check.
pub(super) fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) -> bool {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: `word` is a valid, aligned u32 in a MAP_SHARED mapping that
    // outlives the call; `ts` is a valid timespec on our stack. No
    // FUTEX_PRIVATE_FLAG: the other waiter/waker is another process, and the
    // kernel keys a shared futex by the file page, not our address.
    let r = unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
            ptr::null::<u32>(),
            0u32,
        )
    };
    r == -1 && io::Error::last_os_error().raw_os_error() == Some(libc::ETIMEDOUT)
}

pub(super) fn futex_wake(word: &AtomicU32) {
    // SAFETY: `word` is a valid, aligned u32 in a shared mapping; FUTEX_WAKE
    // only reads the address to find waiters.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE,
            i32::MAX,
            ptr::null::<libc::timespec>(),
            ptr::null::<u32>(),
            0u32,
        );
    }
}

/// Whether the sender attached and its process has since exited without
/// dropping its `RingSender` (a crash, or `std::process::exit`).
pub(super) fn writer_died(h: &Header) -> bool {
    let pid = h.peers.0.writer_pid.load(Ordering::Acquire);
    let ns = h.peers.0.writer_pidns.load(Ordering::Relaxed);
    let our_ns = pid_namespace();
    pid != 0 && our_ns != 0 && ns == our_ns && !pid_alive(pid)
}

pub(super) fn pid_alive(pid: u32) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return true; // not a pid we can ask about; assume alive
    };
    if pid <= 0 {
        return true;
    }
    // SAFETY: signal 0 sends nothing; kill only checks that the pid exists.
    let r = unsafe { libc::kill(pid, 0) };
    r == 0 || io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

/// Identifies our pid namespace (the inode of /proc/self/ns/pid), or 0 if
/// unknown. Pids are compared only between processes in the same namespace.
pub(super) fn pid_namespace() -> u64 {
    static NS: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *NS.get_or_init(|| std::fs::metadata("/proc/self/ns/pid").map_or(0, |m| m.ino()))
}
