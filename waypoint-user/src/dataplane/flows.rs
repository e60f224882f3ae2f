//! The per-socket records of the eBPF dataplane, shared with the verdict through memory.
//!
//! Each redirected socket gets a slot in the `FLOWS` array (see `waypoint_common::Flow`),
//! which this module maps into the daemon's memory: setting a budget and reading the
//! counters are plain atomic memory accesses, not `bpf()` syscalls. The verdict finds a
//! socket's slot through the `SLOTS` hash (cookie → slot), which costs one syscall to
//! fill and one to clear per socket.
//!
//! **Reuse.** A verdict that looked up a slot just before the socket left `SLOTS` may
//! still write to it for a moment (it runs in softirq, in microseconds). So a freed slot
//! rests for [`QUARANTINE`] before it serves another socket, and the verdict also checks
//! the slot's `owner` against its socket's cookie.

use std::{
    collections::VecDeque,
    mem::{offset_of, size_of},
    num::NonZeroUsize,
    os::fd::AsFd,
    ptr::NonNull,
    sync::{
        atomic::{AtomicU64, Ordering},
        Mutex, MutexGuard,
    },
    time::{Duration, Instant},
};

use aya::maps::{HashMap, MapData};
use nix::sys::mman::{mmap, munmap, MapFlags, ProtFlags};
use waypoint_common::{Flow, Skip, SKIPS};

/// How long a freed slot rests before it serves another socket: far longer than any
/// verdict runs.
const QUARANTINE: Duration = Duration::from_secs(1);

/// Errors of the flow table.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The FLOWS array could not be mapped into memory.
    #[error("mapping the FLOWS array into memory: {0}")]
    Mmap(#[source] nix::Error),
    /// Every slot is in use or resting.
    #[error("no free flow slot (all {0} in use or resting after a close)")]
    Full(u32),
    /// The cookie could not be entered into SLOTS.
    #[error("SLOTS update failed: {0}")]
    Slots(#[source] aya::maps::MapError),
}

/// The userspace view of one [`Flow`]: the same layout, with atomic fields, because the
/// kernel reads and writes the record concurrently.
#[repr(C)]
#[cfg_attr(test, derive(Default))]
pub(super) struct FlowCell {
    owner: AtomicU64,
    credit: AtomicU64,
    consumed: AtomicU64,
    redirected: AtomicU64,
    passed: AtomicU64,
    trimmed: AtomicU64,
    /// `next_seq` and `seq_known`, which only the kernel uses.
    seq: AtomicU64,
    skips: [SkipCell; SKIPS],
}

/// The userspace view of one [`waypoint_common::Skip`].
#[repr(C)]
#[cfg_attr(test, derive(Default))]
struct SkipCell {
    at: AtomicU64,
    /// `len` (the low half, little-endian) and padding.
    len: AtomicU64,
}

const _: () = {
    assert!(size_of::<FlowCell>() == size_of::<Flow>());
    assert!(offset_of!(FlowCell, owner) == offset_of!(Flow, owner));
    assert!(offset_of!(FlowCell, credit) == offset_of!(Flow, credit));
    assert!(offset_of!(FlowCell, consumed) == offset_of!(Flow, consumed));
    assert!(offset_of!(FlowCell, redirected) == offset_of!(Flow, redirected));
    assert!(offset_of!(FlowCell, passed) == offset_of!(Flow, passed));
    assert!(offset_of!(FlowCell, trimmed) == offset_of!(Flow, trimmed));
    assert!(offset_of!(FlowCell, seq) == offset_of!(Flow, next_seq));
    assert!(offset_of!(FlowCell, skips) == offset_of!(Flow, skips));
    assert!(size_of::<SkipCell>() == size_of::<Skip>());
    assert!(offset_of!(SkipCell, at) == offset_of!(Skip, at));
    assert!(offset_of!(SkipCell, len) == offset_of!(Skip, len));
    assert!(cfg!(target_endian = "little"));
    // The kernel rounds an array's elements up to 8 bytes: no gap between records.
    assert!(size_of::<Flow>().is_multiple_of(8));
};

/// What userspace allows the verdict for one socket (see `waypoint_common::Flow`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Budget {
    /// Highest value of `redirected` allowed.
    pub credit: u64,
    /// Bytes of `passed` that userspace has forwarded.
    pub consumed: u64,
}

/// What the verdict did with one socket's bytes so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Counters {
    pub redirected: u64,
    pub passed: u64,
}

/// A record's counters and budget, as read at one moment (for logs).
#[derive(Clone, Copy, Debug)]
pub(super) struct FlowState {
    redirected: u64,
    passed: u64,
    consumed: u64,
    credit: u64,
}

impl std::fmt::Display for FlowState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let FlowState {
            redirected,
            passed,
            consumed,
            credit,
        } = self;
        write!(
            f,
            "redirected={redirected} passed={passed} consumed={consumed} credit={credit}"
        )
    }
}

impl FlowCell {
    /// Publishes a budget. The verdict may see the two fields change in either order;
    /// both only grow, so either mix is a safe (stricter) budget.
    pub fn publish(&self, b: Budget) {
        self.consumed.store(b.consumed, Ordering::Release);
        self.credit.store(b.credit, Ordering::Release);
    }

    /// Sets the verdict's count of passed bytes, as the kernel would.
    #[cfg(test)]
    pub fn set_passed(&self, passed: u64) {
        self.passed.store(passed, Ordering::Release);
    }

    /// Claims the slot for another socket, as a reuse in progress would.
    #[cfg(test)]
    pub fn set_owner(&self, owner: u64) {
        self.owner.store(owner, Ordering::Release);
    }

    /// The passed bytes userspace must drop: the repeats the verdict could not cut, as
    /// ranges of offsets in the stream of passed bytes, in stream order (empty ranges for
    /// unused records). The kernel sets each once, before it passes the segment that
    /// holds it, so it is in place by the time userspace reads those bytes.
    pub fn skips(&self) -> [std::ops::Range<u64>; SKIPS] {
        self.skips.each_ref().map(|skip| {
            let len = skip.len.load(Ordering::Acquire) & u64::from(u32::MAX);
            if len == 0 {
                return 0..0;
            }
            let at = skip.at.load(Ordering::Acquire);
            at..at + len
        })
    }

    /// Bytes of the repeats the verdict could not cut, in total: how far the kernel's
    /// count of the socket's read bytes (`copied_seq`) runs ahead of what it read.
    pub fn skipped(&self) -> u64 {
        self.skips().iter().map(|s| s.end - s.start).sum()
    }

    pub fn counters(&self) -> Counters {
        Counters {
            redirected: self.redirected.load(Ordering::Acquire),
            passed: self.passed.load(Ordering::Acquire),
        }
    }

    /// The counters and the budget (four plain loads: no system call).
    pub fn state(&self) -> FlowState {
        let Counters { redirected, passed } = self.counters();
        FlowState {
            redirected,
            passed,
            consumed: self.consumed.load(Ordering::Acquire),
            credit: self.credit.load(Ordering::Acquire),
        }
    }
}

/// The FLOWS array mapped into memory, the SLOTS hash, and the free slots.
pub(super) struct FlowTable {
    base: NonNull<FlowCell>,
    capacity: u32,
    len: usize,
    slots: Mutex<HashMap<MapData, u64, u32>>,
    free: Mutex<FreeSlots>,
    /// Keeps the array's descriptor (and so the map) alive while it is mapped.
    _flows: MapData,
}

// SAFETY: the mapping is shared memory accessed only through atomics (`FlowCell`), and
// the rest of the table is behind mutexes.
unsafe impl Send for FlowTable {}
// SAFETY: as above.
unsafe impl Sync for FlowTable {}

struct FreeSlots {
    /// Slots never handed out: `next..capacity`.
    next: u32,
    /// Freed slots, oldest first, with the time they were freed.
    resting: VecDeque<(u32, Instant)>,
    in_use: usize,
}

impl FreeSlots {
    fn new() -> FreeSlots {
        FreeSlots {
            next: 0,
            resting: VecDeque::new(),
            in_use: 0,
        }
    }

    fn take(&mut self, capacity: u32, now: Instant) -> Option<u32> {
        let slot = match self.resting.front() {
            Some(&(slot, freed)) if now.duration_since(freed) >= QUARANTINE => {
                self.resting.pop_front();
                slot
            }
            _ if self.next < capacity => {
                self.next += 1;
                self.next - 1
            }
            _ => return None,
        };
        self.in_use += 1;
        Some(slot)
    }

    fn put(&mut self, slot: u32, now: Instant) {
        self.in_use -= 1;
        self.resting.push_back((slot, now));
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Each critical section is one map syscall or a few field updates: a panic cannot
    // leave the state half-changed, so a poisoned lock is still safe to use.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl FlowTable {
    /// Maps `flows` (an mmapable array of `capacity` [`Flow`]s) and takes `slots`.
    pub fn new(
        flows: MapData,
        slots: HashMap<MapData, u64, u32>,
        capacity: u32,
    ) -> Result<FlowTable, Error> {
        // The kernel rounds the length up to whole pages, in mmap and munmap alike.
        let len = capacity as usize * size_of::<Flow>();
        let size = NonZeroUsize::new(len).ok_or(Error::Full(capacity))?;
        // SAFETY: a fresh shared mapping of the array's descriptor, at no fixed address;
        // the kernel bounds it by the array's size and fails otherwise. It is unmapped in
        // `Drop`, before `_flows` closes the descriptor.
        let base = unsafe {
            mmap(
                None,
                size,
                ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
                MapFlags::MAP_SHARED,
                flows.fd().as_fd(),
                0,
            )
        }
        .map_err(Error::Mmap)?;
        Ok(FlowTable {
            base: base.cast(),
            capacity,
            len,
            slots: Mutex::new(slots),
            free: Mutex::new(FreeSlots::new()),
            _flows: flows,
        })
    }

    /// Slots serving a socket now.
    pub fn in_use(&self) -> usize {
        lock(&self.free).in_use
    }

    /// Entries of the SLOTS hash (walks it: diagnostics only).
    pub fn slot_entries(&self) -> usize {
        lock(&self.slots).keys().count()
    }

    /// Gives the socket with this cookie a record with zero counters and zero credit
    /// (everything passed) and makes it visible to the verdict.
    pub fn register(&self, cookie: u64) -> Result<FlowRef<'_>, Error> {
        let slot = lock(&self.free)
            .take(self.capacity, Instant::now())
            .ok_or(Error::Full(self.capacity))?;
        let cell = self.cell(slot);
        // No verdict touches a rested slot: reset it, then claim it for this socket.
        for f in [
            &cell.credit,
            &cell.consumed,
            &cell.redirected,
            &cell.passed,
            &cell.trimmed,
            &cell.seq,
        ]
        .into_iter()
        .chain(cell.skips.iter().flat_map(|skip| [&skip.at, &skip.len]))
        {
            f.store(0, Ordering::Relaxed);
        }
        cell.owner.store(cookie, Ordering::Release);
        let flow = FlowRef {
            table: self,
            slot,
            cookie,
        };
        lock(&self.slots)
            .insert(cookie, slot, 0)
            .map_err(Error::Slots)?;
        Ok(flow)
    }

    fn cell(&self, slot: u32) -> &FlowCell {
        debug_assert!(slot < self.capacity);
        // SAFETY: `slot < capacity` (slots come only from `FreeSlots::take`), so the
        // record lies inside the mapping, which lives as long as `self`. FlowCell is made
        // of atomics, so shared references to it are sound while the kernel writes.
        unsafe { &*self.base.as_ptr().add(slot as usize) }
    }
}

impl Drop for FlowTable {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, with its length; no FlowRef outlives the
        // table (they borrow it), so nothing reads it after this.
        let _ = unsafe { munmap(self.base.cast(), self.len) };
    }
}

/// One socket's record; removed from the verdict's view on drop.
pub(super) struct FlowRef<'a> {
    table: &'a FlowTable,
    slot: u32,
    cookie: u64,
}

impl<'a> FlowRef<'a> {
    /// The record. Tied to the table, not to this handle, so that callers can hold it
    /// next to the handle; it is only meaningful while the handle lives.
    pub fn cell(&self) -> &'a FlowCell {
        self.table.cell(self.slot)
    }

    /// The record's index in the FLOWS array, as the verdict's signals name it.
    pub fn slot(&self) -> u32 {
        self.slot
    }
}

impl Drop for FlowRef<'_> {
    fn drop(&mut self) {
        // ENOENT cannot happen (inserted in `register`); any other failure leaves a stale
        // cookie that the owner check below makes harmless.
        let _ = lock(&self.table.slots).remove(&self.cookie);
        self.cell().owner.store(0, Ordering::Release);
        lock(&self.table.free).put(self.slot, Instant::now());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn never_used_slots_first_then_rested_ones() {
        let mut f = FreeSlots::new();
        let t0 = Instant::now();
        assert_eq!(f.take(3, t0), Some(0));
        assert_eq!(f.take(3, t0), Some(1));
        f.put(0, t0);
        // Slot 0 rests: a never-used slot comes first.
        assert_eq!(f.take(3, t0), Some(2));
        // None left that may be used yet.
        assert_eq!(f.take(3, t0 + QUARANTINE / 2), None);
        assert_eq!(f.take(3, t0 + QUARANTINE), Some(0));
        assert_eq!(f.in_use, 3);
    }

    #[test]
    fn rested_slots_come_back_oldest_first() {
        let mut f = FreeSlots::new();
        let t0 = Instant::now();
        for _ in 0..2 {
            f.take(2, t0);
        }
        f.put(1, t0);
        f.put(0, t0 + Duration::from_millis(1));
        let later = t0 + QUARANTINE * 2;
        assert_eq!(f.take(2, later), Some(1));
        assert_eq!(f.take(2, later), Some(0));
        assert_eq!(f.take(2, later), None);
        assert_eq!(f.in_use, 2);
    }
}
