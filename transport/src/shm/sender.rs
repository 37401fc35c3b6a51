//! The writing end of a ring, and the doorbells that wake a reader.

use super::deadline_after;
use super::wait::futex_wake;
use super::wait::pid_alive;
use super::wait::pid_namespace;
use super::wait::wait_for;
use super::Header;
use super::Ring;
use super::ShmError;
use super::FRAME_HEADER;
use super::HEADER_BYTES;
use super::MAGIC;
use super::MIN_CAPACITY;
use super::VERSION;
use super::WRAP;
use memmap2::MmapMut;
use memmap2::MmapOptions;
use std::fs::OpenOptions;
use std::path::Path;
use std::ptr;
use std::ptr::NonNull;
use std::sync::atomic::fence;
use std::sync::atomic::AtomicU32;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use std::time::Instant;

/// Rings a ring's doorbell from inside the receiving process: a receiver
/// asleep in [`RingReceiver::recv_unless`] wakes and checks its `woken`
/// condition. Make the condition true first, then ring.
#[derive(Clone)]
pub struct RingBell {
    pub(super) _map: Arc<MmapMut>,
    pub(super) base: NonNull<u8>,
}

// SAFETY: `base` points into the mapping `_map` keeps alive; a bell touches
// only the header's atomics, which any thread (or process) may use at once.
unsafe impl Send for RingBell {}
unsafe impl Sync for RingBell {}

impl RingBell {
    /// A bell for the ring at `path` (made by a receiver whose token is
    /// `token`), rung from another process: a reader that waits on several
    /// rings sleeps on one ring's doorbell ([`RingReceiver::recv_unless`]
    /// with `woken` looking at the others), and whoever sends it a frame
    /// on another ring rings this bell after the send. Any number of
    /// processes may hold one; it sends nothing itself.
    pub fn open(path: &Path, token: u64) -> Result<RingBell, ShmError> {
        let (ring, _) = map_ring(path, token)?;
        Ok(RingBell {
            _map: ring.map.clone(),
            base: ring.base,
        })
    }

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
    pub(super) seq: AtomicU32,
    pub(super) waiting: AtomicU32,
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
    pub(super) ring: Ring,
    /// Our copy of the write index; only the sender writes it.
    pub(super) write: u64,
    /// Last read index seen, so free space is re-read only when it runs out.
    pub(super) read_seen: u64,
    /// Whether kill(owner, 0) means anything: false when the owner lives in
    /// another pid namespace, where its pid names some other process or none.
    pub(super) check_owner: bool,
}

impl RingSender {
    /// Maps the ring at `path`. Fails if the file is missing, is not a ring,
    /// was made by a receiver whose token is not `token`, already has a
    /// sender, or its receiver is gone.
    pub fn open(path: &Path, token: u64) -> Result<RingSender, ShmError> {
        let (ring, check_owner) = map_ring(path, token)?;
        let path = path.to_path_buf();
        let h = ring.header();
        let our_ns = pid_namespace();
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
    pub(super) fn reserve(
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

    pub(super) fn publish(&mut self, write: u64) {
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

/// Maps the ring at `path` and checks that it is one, of this layout, made
/// by a receiver whose token is `token` and who is still there. Returns the
/// mapping and whether the owner's pid can be asked about (the same pid
/// namespace).
fn map_ring(path: &Path, token: u64) -> Result<(Ring, bool), ShmError> {
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
    let map =
        unsafe { MmapOptions::new().populate().map_mut(&file) }.map_err(|e| io_err("map", e))?;
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
    if header_bytes as usize != HEADER_BYTES || cap_field != capacity || !capacity.is_multiple_of(8)
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
    Ok((ring, check_owner))
}
