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

use std::fs::{File, OpenOptions};
use std::hash::{BuildHasher, Hasher};
use std::io::{self, Read};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::ptr::{self, NonNull};
use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use memmap2::{MmapMut, MmapOptions};

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

/// The receiving end and owner of a ring: creates the file, reads frames, and
/// removes the file when dropped.
pub struct RingReceiver {
    ring: Ring,
    token: u64,
    /// Our copy of the read index; only the receiver writes it.
    read: u64,
    /// Last write index seen, so a backlog of frames costs no shared load each.
    write_seen: u64,
}

impl RingReceiver {
    /// Creates `dir/name` (dir is normally `/dev/shm`) with room for
    /// `capacity` bytes of frames (rounded up to a multiple of 8) and writes
    /// the header. A frame takes its meta and payload plus 8 bytes, rounded up
    /// to 8; make the ring at least twice the largest frame, or sender and
    /// receiver take turns instead of overlapping copies. A file left behind by a receiver that crashed (its pid no
    /// longer exists) is replaced; any other existing file is an error.
    pub fn create(dir: &Path, name: &str, capacity: usize) -> Result<RingReceiver, ShmError> {
        let path = dir.join(name);
        if name.is_empty() || name.contains('/') || name == "." || name == ".." {
            return Err(ShmError::Invalid {
                path,
                detail: format!("name {name:?} must be a single non-empty file name"),
            });
        }
        let capacity = capacity.div_ceil(8) * 8;
        if !(MIN_CAPACITY..=MAX_CAPACITY).contains(&capacity) {
            return Err(ShmError::Invalid {
                path,
                detail: format!(
                    "capacity {capacity} is outside {MIN_CAPACITY}..={MAX_CAPACITY} bytes"
                ),
            });
        }
        let file = match create_file(&path) {
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists && looks_stale(&path) => {
                // The previous owner is dead, so nobody else can be using the
                // name; a new token keeps its old sender (if any) out.
                let _ = std::fs::remove_file(&path);
                create_file(&path)
            }
            other => other,
        }
        .map_err(|source| ShmError::Io {
            op: "create",
            path: path.clone(),
            source,
        })?;
        match Self::init(file, path.clone(), capacity as u64) {
            Ok(r) => Ok(r),
            Err(e) => {
                let _ = std::fs::remove_file(&path);
                Err(e)
            }
        }
    }

    fn init(file: File, path: PathBuf, capacity: u64) -> Result<RingReceiver, ShmError> {
        let io_err = |op, source| ShmError::Io {
            op,
            path: path.clone(),
            source,
        };
        file.set_len(HEADER_BYTES as u64 + capacity)
            .map_err(|e| io_err("size", e))?;
        // SAFETY: we just created this file with create_new and mode 0600; only
        // this ring's sender maps it, and it follows the same protocol. The
        // mapping is never viewed as a Rust slice, only through raw pointers
        // and atomics, so writes by the other process cannot alias a reference.
        // `populate` faults the pages in now rather than during the first hops.
        let map = unsafe { MmapOptions::new().populate().map_mut(&file) }
            .map_err(|e| io_err("map", e))?;
        let ring = Ring::new(path, map, capacity)?;
        let token = random_token();
        let h = ring.header();
        h.version.store(VERSION, Ordering::Relaxed);
        h.header_bytes.store(HEADER_BYTES as u32, Ordering::Relaxed);
        h.capacity.store(capacity, Ordering::Relaxed);
        h.token.store(token, Ordering::Relaxed);
        h.owner_pid.store(std::process::id(), Ordering::Relaxed);
        h.owner_pidns.store(pid_namespace(), Ordering::Relaxed);
        // Magic last: a sender that sees it sees a complete header.
        h.magic.store(MAGIC, Ordering::Release);
        Ok(RingReceiver {
            ring,
            token,
            read: 0,
            write_seen: 0,
        })
    }

    pub fn path(&self) -> &Path {
        &self.ring.path
    }

    /// The random token the sender must present to [`RingSender::open`].
    pub fn token(&self) -> u64 {
        self.token
    }

    /// Bytes of frame data the ring holds.
    pub fn capacity(&self) -> usize {
        self.ring.capacity as usize
    }

    /// How long `recv` spins before it sleeps on the futex (default
    /// [`DEFAULT_SPIN`]). Zero sleeps at once.
    pub fn set_spin(&mut self, spin: Duration) {
        self.ring.spin = spin;
    }

    /// Next frame as `(meta, payload)`; `Ok(None)` if nothing arrived within
    /// `timeout`; `Err(PeerClosed)` once the sender has dropped (or its
    /// process has exited) and every frame it sent has been read.
    pub fn recv(&mut self, timeout: Duration) -> Result<Option<ShmFrame>, ShmError> {
        let (mut meta, mut payload) = (Vec::new(), Vec::new());
        Ok(self
            .recv_into(&mut meta, &mut payload, timeout)?
            .then_some((meta, payload)))
    }

    /// Like [`recv`](Self::recv), but puts the frame into the caller's
    /// buffers (replacing their contents), so a stream of large frames reuses
    /// one allocation. Returns whether a frame arrived; the buffers are left
    /// alone when none did.
    pub fn recv_into(
        &mut self,
        meta: &mut Vec<u8>,
        payload: &mut Vec<u8>,
        timeout: Duration,
    ) -> Result<bool, ShmError> {
        Ok(self.recv_unless(meta, payload, timeout, &mut || false)? == Received::Frame)
    }

    /// Like [`recv_into`](Self::recv_into), but also returns as soon as
    /// `woken()` is true. `woken` is checked before every sleep and after
    /// every wake-up; whoever makes it true rings this ring's [`RingBell`],
    /// so a sleeping receiver notices at once.
    pub fn recv_unless(
        &mut self,
        meta: &mut Vec<u8>,
        payload: &mut Vec<u8>,
        timeout: Duration,
        woken: &mut dyn FnMut() -> bool,
    ) -> Result<Received, ShmError> {
        let mut deadline = None;
        loop {
            if self.write_seen == self.read {
                let w = self.ring.header().write.0.load(Ordering::Acquire);
                self.ring.check_indices(w, self.read)?;
                self.write_seen = w;
            }
            if self.write_seen != self.read {
                if self.take_one(meta, payload)? {
                    return Ok(Received::Frame);
                }
                continue; // a wrap marker; the frame follows at offset 0
            }
            let h = self.ring.header();
            if h.peers.0.writer_closed.load(Ordering::Acquire) != 0 {
                // The sender closes only after its last publish, so an empty
                // ring now stays empty.
                let w = h.write.0.load(Ordering::Acquire);
                if w == self.read {
                    return Err(self.ring.closed("sender"));
                }
                continue;
            }
            if woken() {
                return Ok(Received::Woken);
            }
            let deadline = *deadline.get_or_insert_with(|| deadline_after(Instant::now(), timeout));
            let read = self.read;
            let ring = &self.ring;
            let mut was_woken = false;
            let ready = |peer_may_be_dead: bool| {
                if h.write.0.load(Ordering::Acquire) != read
                    || h.peers.0.writer_closed.load(Ordering::Acquire) != 0
                {
                    return Ok(true);
                }
                if woken() {
                    was_woken = true;
                    return Ok(true);
                }
                if peer_may_be_dead && writer_died(h) {
                    // A dead sender publishes nothing more; drain, then close.
                    if h.write.0.load(Ordering::Acquire) != read {
                        return Ok(true);
                    }
                    return Err(ring.closed("sender process"));
                }
                Ok(false)
            };
            if !wait_for(
                &h.data_seq.0,
                &h.reader_waiting.0,
                ring.spin,
                deadline,
                ready,
            )? {
                return Ok(Received::TimedOut);
            }
            if was_woken && h.write.0.load(Ordering::Acquire) == read {
                return Ok(Received::Woken);
            }
        }
    }

    /// A handle that wakes this receiver from another thread of this
    /// process; it keeps the mapping, not the file, alive.
    pub fn bell(&self) -> RingBell {
        RingBell {
            _map: self.ring.map.clone(),
            base: self.ring.base,
        }
    }

    /// Consumes the record at the read index: a frame (returns true) or a wrap
    /// marker (returns false). The caller has seen `write_seen > read`.
    fn take_one(&mut self, meta: &mut Vec<u8>, payload: &mut Vec<u8>) -> Result<bool, ShmError> {
        let cap = self.ring.capacity;
        let pos = self.read % cap;
        let available = self.write_seen - self.read;
        let tail = cap - pos;
        // SAFETY: pos is a multiple of 8 below capacity, and capacity is a
        // multiple of 8, so the 8-byte record header lies inside the data area
        // and is 4-aligned (the data area starts on a page). The Acquire load
        // of the write index ordered the sender's writes of it before us, and
        // the sender does not touch published bytes until we release them.
        let (meta_len, payload_len) = unsafe {
            let p = self.ring.data().add(pos as usize) as *const u32;
            (ptr::read(p), ptr::read(p.add(1)))
        };
        let len = if meta_len == WRAP {
            if payload_len != 0 || tail > available {
                return Err(self.ring.corrupt(format!(
                    "wrap marker at offset {pos} claims {tail} bytes but {available} are published"
                )));
            }
            tail
        } else {
            let len = (FRAME_HEADER + meta_len as u64 + payload_len as u64).next_multiple_of(8);
            if len > available || len > tail {
                return Err(self.ring.corrupt(format!(
                    "frame at offset {pos} claims meta {meta_len} + payload {payload_len} bytes \
                     but only {available} are published and {tail} remain before the end"
                )));
            }
            let (m, p) = (meta_len as usize, payload_len as usize);
            meta.clear();
            payload.clear();
            meta.reserve(m);
            payload.reserve(p);
            // SAFETY: the checks above keep both source ranges inside the
            // published part of the data area; the destinations have at least
            // m and p bytes reserved, and the lengths are set only after the
            // bytes are written.
            unsafe {
                let src = self.ring.data().add(pos as usize + FRAME_HEADER as usize);
                ptr::copy_nonoverlapping(src, meta.as_mut_ptr(), m);
                meta.set_len(m);
                ptr::copy_nonoverlapping(src.add(m), payload.as_mut_ptr(), p);
                payload.set_len(p);
            }
            len
        };
        self.read += len;
        let h = self.ring.header();
        h.read.0.store(self.read, Ordering::Release);
        // Pairs with the fence in `wait_for`: either the sender sees the new
        // read index before it sleeps, or we see its waiting flag here.
        fence(Ordering::SeqCst);
        if h.writer_waiting.0.load(Ordering::Relaxed) != 0 {
            h.space_seq.0.fetch_add(1, Ordering::SeqCst);
            futex_wake(&h.space_seq.0);
        }
        Ok(meta_len != WRAP)
    }
}

impl Drop for RingReceiver {
    fn drop(&mut self) {
        let h = self.ring.header();
        h.peers.0.reader_closed.store(1, Ordering::Release);
        h.space_seq.0.fetch_add(1, Ordering::SeqCst);
        futex_wake(&h.space_seq.0);
        // The sender keeps its mapping; only the name goes.
        let _ = std::fs::remove_file(&self.ring.path);
    }
}

/// What [`RingReceiver::recv_unless`] returns when it returns without error.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Received {
    /// A frame is in the caller's buffers.
    Frame,
    /// `woken()` became true and no frame was waiting.
    Woken,
    /// Nothing within the timeout.
    TimedOut,
}

/// Rings a ring's doorbell from inside the receiving process: a receiver
/// asleep in [`RingReceiver::recv_unless`] wakes and checks its `woken`
/// condition. Make the condition true first, then ring.
#[derive(Clone)]
pub struct RingBell {
    _map: Arc<MmapMut>,
    base: NonNull<u8>,
}

// SAFETY: `base` points into the mapping `_map` keeps alive; a bell touches
// only the header's atomics, which any thread (or process) may use at once.
unsafe impl Send for RingBell {}
unsafe impl Sync for RingBell {}

impl RingBell {
    pub fn ring(&self) {
        // SAFETY: as in `Ring::header`: the mapping starts with the header,
        // is page-aligned and lives as long as `_map`.
        let h = unsafe { &*(self.base.as_ptr() as *const Header) };
        // Pairs with the fence in `wait_for`, as in `RingSender::publish`:
        // either the receiver sees the caller's condition before it sleeps,
        // or we see its waiting flag here.
        fence(Ordering::SeqCst);
        if h.reader_waiting.0.load(Ordering::Relaxed) != 0 {
            h.data_seq.0.fetch_add(1, Ordering::SeqCst);
            futex_wake(&h.data_seq.0);
        }
    }
}

/// A doorbell inside one process, for a thread that waits on something other
/// than a ring (the same spin-then-futex wait as a ring's receiver).
#[derive(Default)]
pub struct LocalBell {
    seq: AtomicU32,
    waiting: AtomicU32,
}

impl LocalBell {
    /// Waits until `ready()` is true (returns true) or `timeout` passes
    /// (returns false), spinning for `spin` first.
    pub fn wait(&self, timeout: Duration, spin: Duration, mut ready: impl FnMut() -> bool) -> bool {
        let deadline = deadline_after(Instant::now(), timeout);
        matches!(
            wait_for(&self.seq, &self.waiting, spin, deadline, |_| Ok(ready())),
            Ok(true)
        )
    }

    /// Wakes a thread in [`LocalBell::wait`]; make its condition true first.
    pub fn ring(&self) {
        fence(Ordering::SeqCst);
        if self.waiting.load(Ordering::Relaxed) != 0 {
            self.seq.fetch_add(1, Ordering::SeqCst);
            futex_wake(&self.seq);
        }
    }
}

/// The sending end of a ring created by a [`RingReceiver`], possibly in
/// another process. A ring takes one sender for its whole life.
pub struct RingSender {
    ring: Ring,
    /// Our copy of the write index; only the sender writes it.
    write: u64,
    /// Last read index seen, so free space is re-read only when it runs out.
    read_seen: u64,
    /// Whether kill(owner, 0) means anything: false when the owner lives in
    /// another pid namespace, where its pid names some other process or none.
    check_owner: bool,
}

impl RingSender {
    /// Maps the ring at `path`. Fails if the file is missing, is not a ring,
    /// was made by a receiver whose token is not `token`, already has a
    /// sender, or its receiver is gone.
    pub fn open(path: &Path, token: u64) -> Result<RingSender, ShmError> {
        let path = path.to_path_buf();
        let io_err = |op, source| ShmError::Io {
            op,
            path: path.clone(),
            source,
        };
        let not_a_ring = |detail: String| ShmError::NotARing {
            path: path.clone(),
            detail,
        };
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(|e| io_err("open", e))?;
        let len = file.metadata().map_err(|e| io_err("stat", e))?.len();
        if len < HEADER_BYTES as u64 + MIN_CAPACITY as u64 {
            return Err(not_a_ring(format!(
                "it is {len} bytes, smaller than the smallest ring"
            )));
        }
        // SAFETY: as in `RingReceiver::init`; the mapping is only accessed
        // through raw pointers and atomics, and its length was read above.
        let map = unsafe { MmapOptions::new().populate().map_mut(&file) }
            .map_err(|e| io_err("map", e))?;
        let capacity = len - HEADER_BYTES as u64;
        let ring = Ring::new(path.clone(), map, capacity)?;
        let h = ring.header();
        let magic = h.magic.load(Ordering::Acquire);
        if magic != MAGIC {
            return Err(not_a_ring(format!(
                "magic is {:?}, expected \"OMNIRING\"",
                String::from_utf8_lossy(&magic.to_le_bytes())
            )));
        }
        let version = h.version.load(Ordering::Relaxed);
        if version != VERSION {
            return Err(not_a_ring(format!(
                "layout version {version}, this build speaks version {VERSION}"
            )));
        }
        let header_bytes = h.header_bytes.load(Ordering::Relaxed);
        let cap_field = h.capacity.load(Ordering::Relaxed);
        if header_bytes as usize != HEADER_BYTES
            || cap_field != capacity
            || !capacity.is_multiple_of(8)
        {
            return Err(not_a_ring(format!(
                "header says {header_bytes} header bytes and capacity {cap_field}, \
                 but the file is {len} bytes"
            )));
        }
        let found = h.token.load(Ordering::Relaxed);
        if found != token {
            return Err(ShmError::TokenMismatch {
                path,
                expected: token,
                found,
            });
        }
        let our_ns = pid_namespace();
        let check_owner = our_ns != 0 && h.owner_pidns.load(Ordering::Relaxed) == our_ns;
        if h.peers.0.reader_closed.load(Ordering::Acquire) != 0
            || (check_owner && !pid_alive(h.owner_pid.load(Ordering::Relaxed)))
        {
            return Err(ring.closed("receiver"));
        }
        if h.peers
            .0
            .writer_attached
            .compare_exchange(0, 1, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            return Err(ShmError::AlreadyAttached { path });
        }
        h.peers.0.writer_pidns.store(our_ns, Ordering::Relaxed);
        h.peers
            .0
            .writer_pid
            .store(std::process::id(), Ordering::Release);
        let write = h.write.0.load(Ordering::Acquire);
        let read = h.read.0.load(Ordering::Acquire);
        ring.check_indices(write, read)?;
        Ok(RingSender {
            ring,
            write,
            read_seen: read,
            check_owner,
        })
    }

    pub fn path(&self) -> &Path {
        &self.ring.path
    }

    /// Bytes of frame data the ring holds; a frame needs its meta and payload
    /// plus 8 bytes, rounded up to a multiple of 8.
    pub fn capacity(&self) -> usize {
        self.ring.capacity as usize
    }

    /// How long `send` spins on a full ring before it sleeps on the futex
    /// (default [`DEFAULT_SPIN`]).
    pub fn set_spin(&mut self, spin: Duration) {
        self.ring.spin = spin;
    }

    /// Writes one frame, waiting at most `timeout` for room.
    pub fn send(&mut self, meta: &[u8], payload: &[u8], timeout: Duration) -> Result<(), ShmError> {
        let cap = self.ring.capacity;
        let len = (FRAME_HEADER + meta.len() as u64 + payload.len() as u64).next_multiple_of(8);
        // u32::MAX as a meta length is the wrap marker.
        if len > cap || meta.len() >= WRAP as usize || payload.len() > u32::MAX as usize {
            return Err(ShmError::FrameTooLarge {
                path: self.ring.path.clone(),
                frame: len,
                meta: meta.len(),
                payload: payload.len(),
                capacity: cap,
            });
        }
        if self
            .ring
            .header()
            .peers
            .0
            .reader_closed
            .load(Ordering::Acquire)
            != 0
        {
            return Err(self.ring.closed("receiver"));
        }
        let mut waiting_since = None;
        let pos = self.write % cap;
        let tail = cap - pos;
        if len > tail {
            self.reserve(tail, timeout, &mut waiting_since)?;
            // SAFETY: pos + 8 <= capacity (both multiples of 8, pos < cap), the
            // reservation made [pos, cap) ours, and the data area starts on a
            // page so the u32 writes are aligned.
            unsafe {
                let p = self.ring.data().add(pos as usize) as *mut u32;
                ptr::write(p, WRAP);
                ptr::write(p.add(1), 0);
            }
            self.publish(self.write + tail);
        }
        self.reserve(len, timeout, &mut waiting_since)?;
        let pos = (self.write % cap) as usize;
        // SAFETY: the frame fits before the end of the buffer (the wrap above
        // guarantees pos + len <= capacity), the reservation made those bytes
        // ours until we publish, and the record header is 4-aligned as above.
        unsafe {
            let p = self.ring.data().add(pos);
            ptr::write(p as *mut u32, meta.len() as u32);
            ptr::write((p as *mut u32).add(1), payload.len() as u32);
            let p = p.add(FRAME_HEADER as usize);
            ptr::copy_nonoverlapping(meta.as_ptr(), p, meta.len());
            ptr::copy_nonoverlapping(payload.as_ptr(), p.add(meta.len()), payload.len());
        }
        self.publish(self.write + len);
        Ok(())
    }

    /// Waits until `need` bytes past the write index are free.
    fn reserve(
        &mut self,
        need: u64,
        timeout: Duration,
        waiting_since: &mut Option<(Instant, Instant)>,
    ) -> Result<(), ShmError> {
        let cap = self.ring.capacity;
        if cap - (self.write - self.read_seen) >= need {
            return Ok(());
        }
        let h = self.ring.header();
        let r = h.read.0.load(Ordering::Acquire);
        self.ring.check_indices(self.write, r)?;
        self.read_seen = r;
        if cap - (self.write - r) >= need {
            return Ok(());
        }
        // Both reservations of one send (wrap marker, frame) share a deadline.
        let (start, until) = *waiting_since.get_or_insert_with(|| {
            let now = Instant::now();
            (now, deadline_after(now, timeout))
        });
        let (write, ring, check_owner) = (self.write, &self.ring, self.check_owner);
        let ready = |peer_may_be_dead: bool| {
            if h.peers.0.reader_closed.load(Ordering::Acquire) != 0 {
                return Err(ring.closed("receiver"));
            }
            if peer_may_be_dead && check_owner && !pid_alive(h.owner_pid.load(Ordering::Relaxed)) {
                return Err(ring.closed("receiver process"));
            }
            let r = h.read.0.load(Ordering::Acquire);
            ring.check_indices(write, r)?;
            Ok(cap - (write - r) >= need)
        };
        let got = wait_for(&h.space_seq.0, &h.writer_waiting.0, ring.spin, until, ready)?;
        let r = h.read.0.load(Ordering::Acquire);
        self.ring.check_indices(self.write, r)?;
        self.read_seen = r;
        if got {
            return Ok(());
        }
        Err(ShmError::Timeout {
            path: self.ring.path.clone(),
            waited: start.elapsed(),
            needed: need,
            free: cap - (self.write - r),
            capacity: cap,
        })
    }

    fn publish(&mut self, write: u64) {
        self.write = write;
        let h = self.ring.header();
        h.write.0.store(write, Ordering::Release);
        // Pairs with the fence in `wait_for`: either the receiver sees the new
        // write index before it sleeps, or we see its waiting flag here.
        fence(Ordering::SeqCst);
        if h.reader_waiting.0.load(Ordering::Relaxed) != 0 {
            h.data_seq.0.fetch_add(1, Ordering::SeqCst);
            futex_wake(&h.data_seq.0);
        }
    }
}

impl Drop for RingSender {
    fn drop(&mut self) {
        let h = self.ring.header();
        h.peers.0.writer_closed.store(1, Ordering::Release);
        h.data_seq.0.fetch_add(1, Ordering::SeqCst);
        futex_wake(&h.data_seq.0);
    }
}

/// Spins for `spin`, then sleeps on the futex `seq`, until `ready` returns
/// true (Ok(true)) or `deadline` passes (Ok(false)). `ready(true)` is called
/// after a sleep timed out, when it is worth a system call to check whether
/// the peer's process still exists.
fn wait_for(
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
fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) -> bool {
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

fn futex_wake(word: &AtomicU32) {
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
fn writer_died(h: &Header) -> bool {
    let pid = h.peers.0.writer_pid.load(Ordering::Acquire);
    let ns = h.peers.0.writer_pidns.load(Ordering::Relaxed);
    let our_ns = pid_namespace();
    pid != 0 && our_ns != 0 && ns == our_ns && !pid_alive(pid)
}

fn pid_alive(pid: u32) -> bool {
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
fn pid_namespace() -> u64 {
    static NS: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *NS.get_or_init(|| std::fs::metadata("/proc/self/ns/pid").map_or(0, |m| m.ino()))
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
