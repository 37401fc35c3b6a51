//! The reading end of a ring: owns the file, waits for frames.

use super::create_file;
use super::deadline_after;
use super::looks_stale;
use super::random_token;
use super::sender::RingBell;
use super::wait::futex_wake;
use super::wait::pid_namespace;
use super::wait::wait_for;
use super::wait::writer_died;
use super::Ring;
use super::ShmError;
use super::ShmFrame;
use super::FRAME_HEADER;
use super::HEADER_BYTES;
use super::MAGIC;
use super::MAX_CAPACITY;
use super::MIN_CAPACITY;
use super::VERSION;
use super::WRAP;
use memmap2::MmapOptions;
use std::fs::File;
use std::io;
use std::path::Path;
use std::path::PathBuf;
use std::ptr;
use std::sync::atomic::fence;
use std::sync::atomic::Ordering;
use std::time::Duration;
use std::time::Instant;

/// The receiving end and owner of a ring: creates the file, reads frames, and
/// removes the file when dropped.
pub struct RingReceiver {
    pub(super) ring: Ring,
    pub(super) token: u64,
    /// Our copy of the read index; only the receiver writes it.
    pub(super) read: u64,
    /// Last write index seen, so a backlog of frames costs no shared load each.
    pub(super) write_seen: u64,
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

    pub(super) fn init(file: File, path: PathBuf, capacity: u64) -> Result<RingReceiver, ShmError> {
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

    /// Whether a frame, or the sender's close, waits to be read: one look
    /// at the header, no system call. For a reader that watches several
    /// rings while it sleeps on one's doorbell ([`RingBell::open`]). (What
    /// waits may be the marker that sends a frame round the ring's end, the
    /// frame not yet written: a read with no timeout may still find none.)
    pub fn ready(&self) -> bool {
        let h = self.ring.header();
        h.write.0.load(Ordering::Acquire) != self.read
            || h.peers.0.writer_closed.load(Ordering::Acquire) != 0
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
    pub(super) fn take_one(
        &mut self,
        meta: &mut Vec<u8>,
        payload: &mut Vec<u8>,
    ) -> Result<bool, ShmError> {
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
