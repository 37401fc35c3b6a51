//! A shared-memory ring with a doorbell: one producer process hands frames to
//! one consumer process on the same Linux host without a socket in between.
//!
//! A pipeline stage forwards each hidden state to the next stage. Over gRPC that
//! costs serialisation, a loopback TCP round and a few copies; through this ring
//! it costs one `memcpy` in and one out. The receiver owns the ring: it creates a
//! file (normally in `/dev/shm`), tells the sender the file's path and a random
//! token over gRPC, and the sender maps the same file. A token that does not
//! match means the two processes do not see the same `/dev/shm` (other host,
//! other container), and the caller keeps using gRPC.
//!
//! Layout: one 4096-byte header page, then `capacity` bytes of frame data. Each
//! frame is `[u32 meta_len][u32 payload_len][meta][payload]` padded to 8 bytes.
//! A frame that does not fit before the end of the buffer is preceded by a wrap
//! marker (`meta_len == u32::MAX`) that sends the reader back to offset 0. The
//! write and read indices are byte counts that only grow; `index % capacity` is
//! the position in the buffer, and `write - read` is the number of bytes in use.
//!
//! Waiting: each side spins for a few tens of microseconds (a reply usually
//! arrives within that during a busy decode loop) and then sleeps on a futex in
//! the header. A side announces that it is about to sleep in a flag word; the
//! other side issues `FUTEX_WAKE` only when it sees that flag, so a busy stream
//! costs no system call per frame. The receiving process can ring the same
//! doorbell itself ([`RingBell`]), so the thread that reads the ring can also
//! be woken for other work (frames that came over gRPC, control calls) without
//! a second thread or a channel between the ring and it.

mod receiver;
mod sender;
mod wait;

use memmap2::MmapMut;
pub use receiver::{Received, RingReceiver};
pub use sender::{LocalBell, RingBell, RingSender};
use std::fs::{File, OpenOptions};
use std::hash::{BuildHasher, Hasher};
use std::io::{self, Read};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64};
use std::sync::Arc;
use std::time::{Duration, Instant};
use wait::{pid_alive, pid_namespace};

/// Bytes before the frame data: the header page.
pub const HEADER_BYTES: usize = 4096;

/// Smallest ring [`RingReceiver::create`] accepts.
pub const MIN_CAPACITY: usize = 64;

/// Largest ring [`RingReceiver::create`] accepts (1 TiB), far above any real
/// use; it keeps the index arithmetic far from overflow.
pub const MAX_CAPACITY: usize = 1 << 40;

/// How long a side spins before it sleeps on the futex, unless changed with
/// `set_spin`.
pub const DEFAULT_SPIN: Duration = Duration::from_micros(50);

/// A received frame: `(meta, payload)`.
pub type ShmFrame = (Vec<u8>, Vec<u8>);

const MAGIC: u64 = u64::from_le_bytes(*b"OMNIRING");

const VERSION: u32 = 1;

const FRAME_HEADER: u64 = 8;

const WRAP: u32 = u32::MAX;

/// How long the spin phase runs without yielding the core.
const PURE_SPIN: Duration = Duration::from_micros(5);

/// Longest single futex sleep. A peer that crashes never rings the doorbell,
/// so a sleeper wakes at least this often to check that the peer's process
/// still exists.
const SLEEP_SLICE: Duration = Duration::from_millis(20);

/// Errors from the shared-memory ring. Every message names the ring's path.
#[derive(Debug, thiserror::Error)]
pub enum ShmError {
    #[error("cannot {op} shared-memory ring {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("invalid shared-memory ring {path}: {detail}")]
    Invalid { path: PathBuf, detail: String },
    #[error("{path} is not an omni shared-memory ring: {detail}")]
    NotARing { path: PathBuf, detail: String },
    #[error(
        "shared-memory ring {path} has token {found:#018x}, expected {expected:#018x}: \
         the two processes do not share this shared-memory directory (different host or container?)"
    )]
    TokenMismatch {
        path: PathBuf,
        expected: u64,
        found: u64,
    },
    #[error("shared-memory ring {path} already has a sender; a ring carries one stream")]
    AlreadyAttached { path: PathBuf },
    #[error(
        "frame of {frame} bytes (meta {meta} + payload {payload} + header, padded) cannot fit \
         shared-memory ring {path} of {capacity} bytes"
    )]
    FrameTooLarge {
        path: PathBuf,
        frame: u64,
        meta: usize,
        payload: usize,
        capacity: u64,
    },
    #[error(
        "timed out after {waited:?} waiting for {needed} free bytes in shared-memory ring {path} \
         ({free} of {capacity} bytes free; is the receiver stalled?)"
    )]
    Timeout {
        path: PathBuf,
        waited: Duration,
        needed: u64,
        free: u64,
        capacity: u64,
    },
    #[error("the {peer} of shared-memory ring {path} is gone")]
    PeerClosed { path: PathBuf, peer: &'static str },
    #[error("shared-memory ring {path} is corrupt: {detail}")]
    Corrupt { path: PathBuf, detail: String },
}

/// Keeps the fields that each side writes on their own cache line, so the
/// sender publishing `write` does not evict the line the receiver updates.
#[repr(C, align(64))]
struct Line<T>(T);

#[repr(C)]
struct Peers {
    reader_closed: AtomicU32,
    writer_closed: AtomicU32,
    writer_attached: AtomicU32,
    writer_pid: AtomicU32,
    writer_pidns: AtomicU64,
}

/// The header page. Everything is atomic, even the fields fixed at creation,
/// because another process can write any byte of the mapping at any time.
#[repr(C)]
struct Header {
    magic: AtomicU64,
    version: AtomicU32,
    header_bytes: AtomicU32,
    capacity: AtomicU64,
    token: AtomicU64,
    owner_pid: AtomicU32,
    _reserved: AtomicU32,
    owner_pidns: AtomicU64,
    write: Line<AtomicU64>,
    read: Line<AtomicU64>,
    /// Futex word the receiver sleeps on; the sender bumps it to wake it.
    data_seq: Line<AtomicU32>,
    /// Futex word the sender sleeps on while the ring is full.
    space_seq: Line<AtomicU32>,
    reader_waiting: Line<AtomicU32>,
    writer_waiting: Line<AtomicU32>,
    peers: Line<Peers>,
}

const _: () = assert!(std::mem::size_of::<Header>() <= HEADER_BYTES);

// Offsets that `looks_stale` reads without mapping the file.
const OWNER_PID_OFFSET: usize = 32;

const OWNER_PIDNS_OFFSET: usize = 40;

/// The mapping both ends share, plus the checks and copies they have in common.
struct Ring {
    path: PathBuf,
    /// Keeps the mapping alive (shared with the ring's bells); all access
    /// goes through `base`.
    map: Arc<MmapMut>,
    base: NonNull<u8>,
    capacity: u64,
    spin: Duration,
}

// SAFETY: `base` points into `map`, which the `Ring` owns and which stays
// mapped until the `Ring` drops; nothing about the pointer is tied to the
// thread that created it. Shared-memory accesses are atomics or are ordered by
// the index protocol, so moving the owner to another thread is sound.
unsafe impl Send for Ring {}

impl Ring {
    fn new(path: PathBuf, mut map: MmapMut, capacity: u64) -> Result<Ring, ShmError> {
        let Some(base) = NonNull::new(map.as_mut_ptr()) else {
            return Err(ShmError::Io {
                op: "map",
                path,
                source: io::Error::other("the mapping is at address 0"),
            });
        };
        Ok(Ring {
            path,
            map: Arc::new(map),
            base,
            capacity,
            spin: DEFAULT_SPIN,
        })
    }

    fn header(&self) -> &Header {
        // SAFETY: the mapping is at least HEADER_BYTES long (checked before a
        // `Ring` is built), page-aligned (so aligned for `Header`), lives as
        // long as `self`, and `Header` is made only of atomics, for which any
        // bit pattern is valid and concurrent access from other processes is
        // defined.
        unsafe { &*(self.base.as_ptr() as *const Header) }
    }

    fn data(&self) -> *mut u8 {
        // SAFETY: the mapping is HEADER_BYTES + capacity long, so the data area
        // starts inside it.
        unsafe { self.base.as_ptr().add(HEADER_BYTES) }
    }

    fn corrupt(&self, detail: String) -> ShmError {
        ShmError::Corrupt {
            path: self.path.clone(),
            detail,
        }
    }

    fn closed(&self, peer: &'static str) -> ShmError {
        ShmError::PeerClosed {
            path: self.path.clone(),
            peer,
        }
    }

    /// Validates a (write, read) pair read from the header; a bad pair would
    /// otherwise send a copy outside the buffer.
    fn check_indices(&self, write: u64, read: u64) -> Result<(), ShmError> {
        if write < read
            || write - read > self.capacity
            || !write.is_multiple_of(8)
            || !read.is_multiple_of(8)
        {
            return Err(self.corrupt(format!(
                "write index {write} and read index {read} are inconsistent with capacity {}",
                self.capacity
            )));
        }
        Ok(())
    }
}

fn create_file(path: &Path) -> io::Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
}

/// Whether `path` is a ring whose owner died without removing it (only
/// decided for owners in our pid namespace; anything else is "not stale").
pub fn looks_stale(path: &Path) -> bool {
    let mut head = [0u8; 48];
    let read = File::open(path).and_then(|mut f| f.read_exact(&mut head));
    let word = |at: usize| u64::from_le_bytes(head[at..at + 8].try_into().unwrap_or([0; 8]));
    let pid = u32::from_le_bytes(
        head[OWNER_PID_OFFSET..OWNER_PID_OFFSET + 4]
            .try_into()
            .unwrap_or([0; 4]),
    );
    let our_ns = pid_namespace();
    read.is_ok()
        && word(0) == MAGIC
        && our_ns != 0
        && word(OWNER_PIDNS_OFFSET) == our_ns
        && pid != 0
        && !pid_alive(pid)
}

/// This host's `CLOCK_MONOTONIC` in ns: the clock both ends of a ring
/// read (whatever their processes or containers), so a frame's way from
/// one to the other is a difference of two readings.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec on our stack; CLOCK_MONOTONIC exists
    // on every Linux, so the call cannot fail.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

fn deadline_after(now: Instant, timeout: Duration) -> Instant {
    now.checked_add(timeout)
        .or_else(|| now.checked_add(Duration::from_secs(1 << 32)))
        .unwrap_or(now)
}

/// A token no other ring on the host is likely to have. std's `RandomState`
/// is seeded from the OS's random source, which saves a dependency.
fn random_token() -> u64 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.finish()
}
