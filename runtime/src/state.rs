//! The residency manager's shared state, one level below the registry
//! (`residency.rs`) and the guards (`guard.rs`): the registry uses guards,
//! and both use this, which uses neither. It holds [`Access`], each tensor's
//! [`Entry`] with the [`Place`] of each [`Copy`](struct@Copy), the registry
//! [`State`] kept under one lock, [`Shared`] (what the movers, guards and
//! completions hold: the state, the pinned pool, the device, the store and
//! the trace), and the error helpers both report with ([`check_size`],
//! [`in_use_error`], [`not_resident`], [`moving_error`]).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use strata_device::Fence;
use strata_storage::{Extent, ExtentAllocator, SwapStore};

use crate::device::Device;
use crate::error::{Result, RuntimeError};
use crate::host_pool::{Chunk, FreeLists, HostPool, Shortfall, Slot};
use crate::stats::{EventKind, Stats, Trace, TraceEvent};
use crate::tier::{TensorId, TensorMeta, Tier};

/// Read (shared) or write (exclusive) use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// Any number of readers; no writer.
    Read,
    /// One writer, no reader; other copies are released when it ends.
    Write,
}

/// Where one copy of a tensor lives.
pub(crate) enum Place {
    Device { offset: u64, bytes: u64 },
    Host(Arc<[Slot]>),
    Nvme(Arc<[Extent]>),
}

pub(crate) struct Copy {
    pub(crate) place: Place,
    /// False while a move is filling it.
    pub(crate) valid: bool,
    /// The fence of the last enqueued work that used it
    /// ([`crate::Guard::used_until`]): a move out of it waits for it, and
    /// its memory is not reused before it passes.
    pub(crate) last_use: Option<Fence>,
}

pub(crate) struct Entry {
    pub(crate) meta: TensorMeta,
    pub(crate) len_bytes: u64,
    pub(crate) chunks: Arc<[Chunk]>,
    pub(crate) copies: [Option<Copy>; 3],
    /// Target of the move in flight.
    pub(crate) moving: Option<Tier>,
    /// Tiers above this one keep their copies through the move in flight,
    /// so readers may take them meanwhile (a write-back to NVMe does not
    /// stop the device copy's readers). `Tier::Device`: none.
    pub(crate) kept_above: Tier,
    pub(crate) readers: [u32; 3],
    pub(crate) writer: bool,
    pub(crate) last_use: u64,
    pub(crate) next_use: u64,
    /// Placements asked for so far (the attempt in an injected
    /// out-of-memory fault's hash).
    pub(crate) placements: u32,
}

impl Entry {
    pub(crate) fn place(&self, tier: Tier) -> (&Place, &Arc<[Chunk]>) {
        let copy = self.copies[tier.index()].as_ref().expect("copy present");
        (&copy.place, &self.chunks)
    }

    pub(crate) fn is_moving(&self) -> bool {
        self.moving.is_some()
    }

    /// Whether a reader may take the copy in `tier` now: no move, or one
    /// that neither writes nor releases it.
    pub(crate) fn readable_during_move(&self, tier: Tier) -> bool {
        self.moving.is_some() && tier < self.kept_above && self.valid(tier)
    }

    pub(crate) fn has_writer(&self) -> bool {
        self.writer
    }

    pub(crate) fn reader_count(&self) -> u32 {
        self.readers.iter().sum()
    }

    pub(crate) fn len_bytes(&self) -> u64 {
        self.len_bytes
    }

    pub(crate) fn begin_use(&mut self, tier: Tier, access: Access, now: u64) {
        self.last_use = now;
        match access {
            Access::Read => self.readers[tier.index()] += 1,
            Access::Write => self.writer = true,
        }
    }

    pub(crate) fn end_use(&mut self, tier: Tier, access: Access) {
        match access {
            Access::Read => self.readers[tier.index()] -= 1,
            Access::Write => self.writer = false,
        }
    }

    /// The extents of the NVMe copy, if it has one.
    pub(crate) fn nvme_extents(&self) -> Option<Arc<[Extent]>> {
        match &self.copies[Tier::Nvme.index()] {
            Some(Copy {
                place: Place::Nvme(extents),
                ..
            }) => Some(extents.clone()),
            _ => None,
        }
    }

    pub(crate) fn valid(&self, tier: Tier) -> bool {
        matches!(&self.copies[tier.index()], Some(copy) if copy.valid)
    }

    pub(crate) fn in_use(&self) -> bool {
        self.writer || self.readers.iter().any(|&r| r > 0)
    }

    fn resident(&self) -> String {
        let tiers: Vec<&str> = Tier::ALL
            .iter()
            .filter(|&&t| self.valid(t))
            .map(|t| t.name())
            .collect();
        if tiers.is_empty() {
            "no tier".into()
        } else {
            tiers.join(", ")
        }
    }
}

pub(crate) struct State {
    pub(crate) tensors: HashMap<TensorId, Entry>,
    pub(crate) next_id: u64,
    pub(crate) tensors_max: usize,
    pub(crate) free_lists: FreeLists,
    pub(crate) device_space: ExtentAllocator,
    pub(crate) stats: Stats,
    /// Moves in progress that will release a copy in each tier when done.
    pub(crate) releasing: [u32; 3],
    pub(crate) clock: u64,
    /// Names of freed tensors, newest last, at most `trace_events_max`
    /// (room reserved at start): the trace names what they moved.
    pub(crate) retired: VecDeque<(TensorId, String)>,
    /// Released copies whose last use has not passed its fence yet, oldest
    /// first: their memory stays counted as used until it does (at most
    /// one per copy released, so bounded by `tensors_max` x 3).
    pub(crate) fenced: VecDeque<(Tier, Place, Fence)>,
    /// Copies to the device handed out and not yet known to have landed
    /// (their time and trace span come when they do).
    pub(crate) landings: u32,
    /// Seeded out-of-memory faults (simulations only).
    pub(crate) memory_faults: Option<MemoryFaults>,
    /// Fills released memory with NaN (`runtime.poison_released`).
    pub(crate) poison: Option<Poison>,
}

/// What `runtime.poison_released` fills released device ranges and host
/// buffers with: 0xFF bytes, a NaN in every float dtype.
pub(crate) const POISON_BYTE: u8 = 0xFF;

/// The memory a released place may lie in, for the poisoning debug mode.
pub(crate) struct Poison {
    pub(crate) pool: Arc<HostPool>,
    pub(crate) device: Arc<dyn Device>,
}

impl Poison {
    /// Fills a released device range or host buffers (its last use has
    /// passed; nothing else owns it until it is freed below).
    fn fill(&self, place: &Place) {
        match place {
            Place::Device { offset, bytes } => {
                if let Err(err) = self.device.fill(*offset, *bytes, POISON_BYTE) {
                    // The device's error surfaces at its next fence too.
                    tracing::error!("poisoning a released device range failed: {err}");
                }
            }
            Place::Host(slots) => {
                for slot in slots.iter() {
                    // SAFETY: the buffer is released (its last use has passed) and not yet back in the free lists: nobody else owns it.
                    unsafe {
                        std::ptr::write_bytes(
                            self.pool.ptr(*slot),
                            POISON_BYTE,
                            self.pool.buffer_bytes(slot.class) as usize,
                        )
                    }
                }
            }
            Place::Nvme(_) => {}
        }
    }
}

/// Seeded out-of-memory faults, for simulations: a placement in the device
/// or host tier is refused as if the tier were full, with probability
/// `rate`, decided by a hash of (seed, tensor, tier, attempt), so a seed
/// refuses the same placements however the threads interleave. The runtime
/// answers as it does to a full tier: it spills, waits for room, or fails
/// with [`crate::RuntimeError::OutOfMemory`]; nothing may be lost.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct MemoryFaults {
    /// Probability per placement.
    pub rate: f64,
    /// The seed.
    pub seed: u64,
}

impl State {
    /// Whether an injected out-of-memory fault refuses this placement of
    /// `id` in `tier` (device and host only; counted in the stats).
    pub(crate) fn refuses_placement(&mut self, id: TensorId, tier: Tier) -> bool {
        let Some(faults) = self.memory_faults else {
            return false;
        };
        if tier == Tier::Nvme || faults.rate <= 0.0 {
            return false;
        }
        let entry = self.tensors.get_mut(&id).expect("live tensor");
        entry.placements = entry.placements.saturating_add(1);
        let key = [
            faults.seed,
            id.0,
            tier.index() as u64,
            u64::from(entry.placements),
        ];
        let hash = key.iter().fold(0, |h, &k| {
            strata_storage::engine::SplitMix64(h ^ k).next_u64()
        });
        let refused = strata_storage::engine::SplitMix64(hash).next_f64() < faults.rate;
        if refused {
            self.stats.ooms_injected += 1;
        }
        refused
    }
}

/// What the movers, guards and completions share.
pub(crate) struct Shared {
    pub(crate) state: Mutex<State>,
    pub(crate) changed: Condvar,
    pub(crate) pool: Arc<HostPool>,
    pub(crate) device: Arc<dyn Device>,
    pub(crate) store: Option<SwapStore>,
    pub(crate) trace: Mutex<Trace>,
    pub(crate) started: Instant,
    /// How long a mover waits for room held by copies in use or moving.
    pub(crate) room_wait: Duration,
    /// Cancelled: every wait on another party (a move, a tensor in use,
    /// room on a tier) ends with [`RuntimeError::Cancelled`].
    pub(crate) cancel: strata_device::Cancel,
    /// Staging buffers of streamed NVMe fills and reads, kept for the
    /// next one (fresh ones cost a page fault per page).
    pub(crate) staging: Mutex<Vec<strata_storage::AlignedBuf>>,
}

impl Shared {
    /// [`RuntimeError::Cancelled`] once the runtime's token is cancelled.
    pub(crate) fn check_cancelled(&self) -> Result<()> {
        if self.cancel.is_cancelled() {
            return Err(RuntimeError::Cancelled);
        }
        Ok(())
    }
}

pub(crate) fn moving_error(id: TensorId, entry: &Entry, target: Tier) -> RuntimeError {
    RuntimeError::Moving {
        tensor: id,
        name: entry.meta.name.clone(),
        target_tier: target,
    }
}

/// The tiers whose copies a move to `target` releases once it lands: from
/// `release_from` down to just above `target` (none when `release_from`
/// is `target`: a copy).
pub(crate) fn released_by(release_from: Tier, target: Tier) -> &'static [Tier] {
    &Tier::ALL[release_from.index().min(target.index())..target.index()]
}

/// `SizeMismatch` unless `given` bytes are the tensor's size.
pub(crate) fn check_size(id: TensorId, entry: &Entry, given: usize) -> Result<()> {
    if given as u64 == entry.len_bytes {
        return Ok(());
    }
    Err(RuntimeError::SizeMismatch {
        tensor: id,
        name: entry.meta.name.clone(),
        tensor_bytes: entry.len_bytes,
        given_bytes: given as u64,
    })
}

pub(crate) fn in_use_error(id: TensorId, entry: &Entry) -> RuntimeError {
    RuntimeError::InUse {
        tensor: id,
        name: entry.meta.name.clone(),
        readers: entry.readers.iter().sum(),
        writer: entry.writer,
    }
}

pub(crate) fn not_resident(id: TensorId, entry: &Entry, tier: Tier) -> RuntimeError {
    RuntimeError::NotResident {
        tensor: id,
        name: entry.meta.name.clone(),
        tier,
        resident: entry.resident(),
    }
}

impl State {
    pub(crate) fn entry(&self, id: TensorId) -> Result<&Entry> {
        self.tensors
            .get(&id)
            .ok_or(RuntimeError::UnknownTensor { tensor: id })
    }

    pub(crate) fn entry_mut(&mut self, id: TensorId) -> Result<&mut Entry> {
        self.tensors
            .get_mut(&id)
            .ok_or(RuntimeError::UnknownTensor { tensor: id })
    }

    pub(crate) fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    pub(crate) fn account(&mut self, tier: Tier, added_bytes: u64, removed_bytes: u64) {
        let stats = &mut self.stats.tiers[tier.index()];
        stats.used_bytes = stats.used_bytes + added_bytes - removed_bytes;
        stats.peak_bytes = stats.peak_bytes.max(stats.used_bytes);
        assert!(
            stats.used_bytes <= stats.budget_bytes,
            "{tier} holds {} bytes, over its budget of {}",
            stats.used_bytes,
            stats.budget_bytes
        );
    }

    /// Frees a released copy's memory now, or once the fence of its last
    /// use passes (a fence that reports a device error counts as passed:
    /// the error surfaces at the compute stream's next fence).
    fn release_copy(&mut self, tier: Tier, copy: Copy) {
        match copy.last_use {
            Some(fence) if !fence.is_passed().unwrap_or(true) => {
                self.fenced.push_back((tier, copy.place, fence));
            }
            _ => self.release_place(tier, copy.place),
        }
    }

    /// Frees the fenced copies whose fences have passed.
    pub(crate) fn reclaim_fenced(&mut self) {
        let mut kept = 0;
        while kept < self.fenced.len() {
            if self.fenced[kept].2.is_passed().unwrap_or(true) {
                let (tier, place, _) = self.fenced.remove(kept).expect("in range");
                self.release_place(tier, place);
            } else {
                kept += 1;
            }
        }
    }

    /// Takes the oldest fenced copy in `tier`, for a caller that needs its
    /// room to wait for its fence (off the lock) and then free it.
    pub(crate) fn take_fenced(&mut self, tier: Tier) -> Option<(Place, Fence)> {
        let at = self.fenced.iter().position(|(t, _, _)| *t == tier)?;
        let (_, place, fence) = self.fenced.remove(at).expect("in range");
        Some((place, fence))
    }

    /// Frees a copy's memory and updates the accounting.
    pub(crate) fn release_place(&mut self, tier: Tier, place: Place) {
        if let Some(poison) = &self.poison {
            poison.fill(&place);
        }
        let bytes = match place {
            Place::Device { offset, bytes } => {
                self.device_space.free(offset, bytes);
                bytes
            }
            Place::Host(slots) => {
                self.free_lists.give_back(&slots);
                self.free_lists.bytes_of(&slots)
            }
            // Extents free themselves once no transfer holds them.
            Place::Nvme(extents) => extents.iter().map(|e| e.len_bytes()).sum(),
        };
        self.account(tier, 0, bytes);
    }

    pub(crate) fn drop_copy(&mut self, id: TensorId, tier: Tier) {
        let entry = self.tensors.get_mut(&id).expect("live tensor");
        if let Some(copy) = entry.copies[tier.index()].take() {
            self.release_copy(tier, copy);
        }
    }

    /// Drops the copies in `from` and the tiers below it, above `target`.
    pub(crate) fn release_between(&mut self, id: TensorId, from: Tier, target: Tier) {
        for tier in released_by(from, target) {
            self.drop_copy(id, *tier);
        }
    }

    pub(crate) fn release_others(&mut self, id: TensorId, kept: Tier) {
        for tier in Tier::ALL {
            if tier != kept {
                self.drop_copy(id, tier);
            }
        }
    }

    pub(crate) fn release_all(&mut self, mut entry: Entry) {
        for tier in Tier::ALL {
            if let Some(copy) = entry.copies[tier.index()].take() {
                self.release_copy(tier, copy);
            }
        }
    }

    /// The copy to spill from `tier` to make room for `requester`: the one
    /// needed last, then the one that can be dropped for free, then the least
    /// recently used. Tensors in use or moving are never chosen.
    pub(crate) fn pick_victim(
        &self,
        tier: Tier,
        requester: TensorId,
        shortfall: Option<Shortfall>,
        can_write_down: bool,
    ) -> Option<(TensorId, bool)> {
        self.tensors
            .iter()
            .filter(|(id, entry)| {
                **id != requester && entry.moving.is_none() && !entry.in_use() && entry.valid(tier)
            })
            .filter(
                |(_, entry)| match (shortfall, &entry.copies[tier.index()]) {
                    (
                        Some(short),
                        Some(Copy {
                            place: Place::Host(slots),
                            ..
                        }),
                    ) => slots.iter().any(|s| s.class == short.class),
                    _ => true,
                },
            )
            .map(|(id, entry)| {
                let free = Tier::ALL.iter().any(|&t| t != tier && entry.valid(t));
                (*id, entry, free)
            })
            .filter(|(_, _, free)| *free || can_write_down)
            .max_by_key(|(id, entry, free)| (entry.next_use, *free, u64::MAX - entry.last_use, *id))
            .map(|(id, _, free)| (id, free))
    }

    /// Bytes in `tier` that cannot be spilled now.
    pub(crate) fn unevictable_bytes(&self, tier: Tier) -> u64 {
        self.tensors
            .values()
            .filter(|e| e.copies[tier.index()].is_some() && (e.moving.is_some() || e.in_use()))
            .map(|e| e.len_bytes)
            .sum()
    }
}

impl Shared {
    pub(crate) fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().expect("runtime state lock")
    }

    pub(crate) fn record_wait(&self, tensor: TensorId, bytes: u64, started: Instant, lane: u32) {
        let duration_ns = started.elapsed().as_nanos() as u64;
        {
            let mut state = self.lock();
            state.stats.wait_ns += duration_ns;
            state.stats.waits += 1;
        }
        let start_ns = (started - self.started).as_nanos() as u64;
        self.trace.lock().expect("trace lock").push(TraceEvent {
            kind: EventKind::Wait,
            tensor: Some(tensor),
            bytes,
            start_ns,
            duration_ns,
            lane,
        });
    }
}
