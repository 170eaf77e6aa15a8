//! Use guards: while one is held, its tensor's copy cannot be evicted, and
//! the guard gives access to the bytes (host buffers, or the CPU device's
//! arena) or the device address.

use std::sync::Arc;
use std::time::Instant;

use strata_device::{Cancel, Fence};

use crate::device::Direction;
use crate::error::{Result, RuntimeError};
use crate::host_pool::{Chunk, Slot};
use crate::state::{Access, Entry, Place, Shared, check_size, in_use_error, not_resident};
use crate::stats::caller_lane;
use crate::tier::{TensorId, Tier};

/// Where a guarded copy's bytes are.
pub(crate) enum View {
    Host {
        slots: Arc<[Slot]>,
        chunks: Arc<[Chunk]>,
    },
    Device {
        offset: u64,
    },
    Nvme,
}

impl View {
    pub(crate) fn of(entry: &Entry, tier: Tier) -> View {
        let (place, chunks) = entry.place(tier);
        match place {
            Place::Host(slots) => View::Host {
                slots: slots.clone(),
                chunks: chunks.clone(),
            },
            Place::Device { offset, .. } => View::Device { offset: *offset },
            Place::Nvme(_) => View::Nvme,
        }
    }

    /// (address, bytes) of each contiguous piece, in tensor order; None when
    /// the bytes are not addressable from the host (a GPU, NVMe).
    fn pieces(&self, shared: &Shared, len_bytes: u64, out: &mut dyn FnMut(*mut u8, usize)) -> bool {
        match self {
            View::Host { slots, chunks } => {
                for (slot, chunk) in slots.iter().zip(chunks.iter()) {
                    out(shared.pool.ptr(*slot), chunk.len_bytes as usize);
                }
                true
            }
            View::Device { offset } => match shared.device.host_address(*offset) {
                Some(ptr) => {
                    out(ptr, len_bytes as usize);
                    true
                }
                None => false,
            },
            View::Nvme => false,
        }
    }

    /// The address of byte `offset` of the copy and the bytes from there
    /// to the end of its contiguous piece; None when not host-addressable.
    fn piece_at(&self, shared: &Shared, len_bytes: u64, offset: u64) -> Option<(*mut u8, u64)> {
        match self {
            View::Host { slots, chunks } => {
                let i = chunks.partition_point(|c| c.offset + c.len_bytes <= offset);
                let chunk = chunks.get(i)?;
                let within = offset - chunk.offset;
                let ptr = shared.pool.ptr(slots[i]).wrapping_add(within as usize);
                Some((ptr, chunk.len_bytes - within))
            }
            View::Device { offset: at } => {
                let base = shared.device.host_address(*at)?;
                Some((base.wrapping_add(offset as usize), len_bytes - offset))
            }
            View::Nvme => None,
        }
    }

    /// Fills a freshly registered copy with zeros: host buffers here, the
    /// device's memory by the device itself.
    pub(crate) fn fill_zero(&self, shared: &Shared, len_bytes: u64) -> Result<()> {
        match self {
            View::Host { slots, chunks } => {
                for (slot, chunk) in slots.iter().zip(chunks.iter()) {
                    // SAFETY: the buffer is the copy being registered (marked moving).
                    unsafe {
                        std::ptr::write_bytes(shared.pool.ptr(*slot), 0, chunk.len_bytes as usize)
                    }
                }
                Ok(())
            }
            View::Device { offset } => shared.device.fill(*offset, len_bytes, 0),
            View::Nvme => unreachable!("only device and host copies are registered"),
        }
    }
}

/// A held use of one tensor's copy in one tier. Dropping it ends the use.
pub struct Guard {
    shared: Arc<Shared>,
    tensor: TensorId,
    tier: Tier,
    access: Access,
    len_bytes: u64,
    view: View,
    /// Drop this copy, not the others, when the guard ends (a write that
    /// failed part way).
    discard: bool,
    /// The fence of the last work enqueued on this copy under the guard.
    last_use: Option<Fence>,
    /// What the guard's user orders after: the copy's landing and the
    /// work enqueued on it before the guard was taken.
    ready: Fence,
}

impl Guard {
    /// A guard on a use already begun (`begin_use`) under the state lock.
    pub(crate) fn taken(
        shared: &Arc<Shared>,
        id: TensorId,
        entry: &Entry,
        tier: Tier,
        access: Access,
    ) -> Guard {
        Guard {
            shared: shared.clone(),
            tensor: id,
            tier,
            access,
            len_bytes: entry.len_bytes(),
            view: View::of(entry, tier),
            discard: false,
            last_use: None,
            ready: ready_fence(entry, tier),
        }
    }

    pub(crate) fn acquire(
        shared: &Arc<Shared>,
        id: TensorId,
        tier: Tier,
        access: Access,
    ) -> Result<Guard> {
        let mut waited_since = None;
        let mut state = shared.lock();
        loop {
            let entry = state.entry(id)?;
            let read_through = access == Access::Read && entry.readable_during_move(tier);
            if entry.is_moving() && !read_through {
                waited_since.get_or_insert_with(Instant::now);
                shared.check_cancelled()?;
                state = Cancel::sleep(&shared.changed, state);
                continue;
            }
            if !entry.valid(tier) {
                return Err(not_resident(id, entry, tier));
            }
            let busy = match access {
                Access::Read => entry.has_writer(),
                Access::Write => entry.has_writer() || entry.reader_count() > 0,
            };
            if busy {
                return Err(in_use_error(id, entry));
            }
            let view = View::of(entry, tier);
            let len_bytes = entry.len_bytes();
            let ready = ready_fence(entry, tier);
            let now = state.tick();
            state.entry_mut(id)?.begin_use(tier, access, now);
            drop(state);
            if let Some(started) = waited_since {
                shared.record_wait(id, len_bytes, started, caller_lane());
            }
            return Ok(Guard {
                shared: shared.clone(),
                tensor: id,
                tier,
                access,
                len_bytes,
                view,
                discard: false,
                last_use: None,
                ready,
            });
        }
    }

    /// The fence the guard's user orders its work after, without blocking
    /// the host: the copy's bytes are there and the work enqueued on it
    /// before the guard was taken is done once it passes. A move to the
    /// device hands the copy out as soon as its copy is enqueued, so this
    /// is usually that copy's event; kernels on the compute stream wait on
    /// it (`CudaDevice::wait_on`). Host accesses through the guard
    /// ([`Guard::for_each_chunk`] and the methods over it) wait for it
    /// themselves. [`Fence::Ready`] when nothing is pending.
    pub fn ready(&self) -> &Fence {
        &self.ready
    }

    /// Hands over the fence of the last work enqueued on this copy while
    /// the guard is held (an event the compute stream recorded after the
    /// last op that reads or writes it), as PyTorch's `record_stream`
    /// does: when the guard ends, a move out of the copy waits for it on
    /// its copy stream, and the copy's memory is not reused for another
    /// tensor before it passes. The guard itself ends at once, without
    /// waiting. Fences from one stream: a later one replaces an earlier.
    /// On the CPU device ops finish before they return, so their fences
    /// have passed and this changes nothing.
    pub fn used_until(&mut self, fence: Fence) {
        self.last_use = Some(fence);
    }

    /// The tensor.
    pub fn tensor(&self) -> TensorId {
        self.tensor
    }

    /// The tier of the guarded copy.
    pub fn tier(&self) -> Tier {
        self.tier
    }

    /// Bytes of the tensor.
    pub fn len_bytes(&self) -> u64 {
        self.len_bytes
    }

    /// The device address of a device-tier copy (a CUdeviceptr on CUDA).
    pub fn device_address(&self) -> Option<u64> {
        match self.view {
            View::Device { offset } => Some(self.shared.device.device_address(offset)),
            _ => None,
        }
    }

    /// The device-tier copy as `len_bytes / dtype` elements of `dtype`,
    /// for the backend to compute on (its work ordered after
    /// [`Guard::ready`] and handed back through [`Guard::used_until`]).
    /// `None` for other tiers.
    pub fn device_view(&self, dtype: strata_device::Dtype) -> Option<strata_device::View<'_>> {
        let (address, len) = self.device_elems(dtype)?;
        // SAFETY: the device copy holds `len` elements from `address` (the arena is aligned to DEVICE_ALIGN_BYTES) and stays allocated while the guard lives; the guard keeps writers out.
        Some(unsafe {
            strata_device::View::from_raw_parts(address, len, dtype, self.shared.device.kind())
        })
    }

    /// [`Guard::device_view`] to write, through a write guard.
    pub fn device_view_mut(
        &mut self,
        dtype: strata_device::Dtype,
    ) -> Option<strata_device::ViewMut<'_>> {
        assert_eq!(
            self.access,
            Access::Write,
            "a device view to write needs a write guard"
        );
        let (address, len) = self.device_elems(dtype)?;
        // SAFETY: as in `device_view`; a write guard is exclusive, and the view borrows it mutably.
        Some(unsafe {
            strata_device::ViewMut::from_raw_parts(address, len, dtype, self.shared.device.kind())
        })
    }

    fn device_elems(&self, dtype: strata_device::Dtype) -> Option<(u64, usize)> {
        let address = self.device_address()?;
        assert!(
            self.len_bytes.is_multiple_of(dtype.bytes()),
            "a tensor of {} bytes viewed as {dtype}",
            self.len_bytes
        );
        Some((address, (self.len_bytes / dtype.bytes()) as usize))
    }

    /// Calls `f(offset_in_tensor, bytes)` for each contiguous piece of the
    /// copy, in order. Errors for copies not addressable from the host.
    pub fn for_each_chunk(&self, f: &mut dyn FnMut(u64, &[u8])) -> Result<()> {
        self.ready.wait()?;
        let mut offset = 0;
        let addressable = self
            .view
            .pieces(&self.shared, self.len_bytes, &mut |ptr, len| {
                // SAFETY: the guard keeps the copy alive and excludes writers but itself.
                let bytes = unsafe { std::slice::from_raw_parts(ptr, len) };
                f(offset, bytes);
                offset += len as u64;
            });
        self.addressable(addressable)
    }

    /// Like [`Guard::for_each_chunk`], writable; needs [`Access::Write`].
    pub fn for_each_chunk_mut(&mut self, f: &mut dyn FnMut(u64, &mut [u8])) -> Result<()> {
        assert_eq!(self.access, Access::Write, "writing needs a write guard");
        self.ready.wait()?;
        let mut offset = 0;
        let addressable = self
            .view
            .pieces(&self.shared, self.len_bytes, &mut |ptr, len| {
                // SAFETY: a write guard is the tensor's only user; the copy lives while held.
                let bytes = unsafe { std::slice::from_raw_parts_mut(ptr, len) };
                f(offset, bytes);
                offset += len as u64;
            });
        self.addressable(addressable)
    }

    /// Runs `write` on this write guard; when it fails, the copy is dropped
    /// at the guard's end if another tier holds one (see
    /// [`crate::Runtime::overwrite_with`]).
    pub(crate) fn finish_write<R, E>(
        &mut self,
        write: impl FnOnce(&mut Guard) -> Result<R, E>,
    ) -> Result<R, E> {
        let result = write(self);
        self.discard = result.is_err();
        result
    }

    /// Copies the bytes at `offset..offset + out.len()` of the tensor into
    /// `out`, across chunk boundaries.
    pub fn read_range(&self, offset: u64, out: &mut [u8]) -> Result<()> {
        self.check_range(offset, out.len() as u64)?;
        self.for_each_chunk(&mut |at, bytes| {
            if let Some((chunk, range)) = overlap(at, bytes.len(), offset, out.len()) {
                out[range].copy_from_slice(&bytes[chunk]);
            }
        })
    }

    /// Writes `data` at `offset` of the tensor, across chunk boundaries;
    /// needs [`Access::Write`].
    pub fn write_range(&mut self, offset: u64, data: &[u8]) -> Result<()> {
        self.check_range(offset, data.len() as u64)?;
        self.for_each_chunk_mut(&mut |at, bytes| {
            if let Some((chunk, range)) = overlap(at, bytes.len(), offset, data.len()) {
                bytes[chunk].copy_from_slice(&data[range]);
            }
        })
    }

    /// Copies the tensor's bytes into `out` (exactly its size). A GPU copy
    /// is read with one synchronous copy after its last use: for setup,
    /// checkpoints and tests, not a step's path.
    pub fn read_into(&self, out: &mut [u8]) -> Result<()> {
        self.check_size(out.len())?;
        if let Some(offset) = self.gpu_offset() {
            self.ready.wait()?;
            // SAFETY: `out` holds the tensor's bytes and is ours for the call; the device range is the guarded copy, its last use passed.
            return unsafe {
                self.shared
                    .device
                    .raw_copy(Direction::ToHost, out.as_mut_ptr(), offset, out.len())
            };
        }
        self.for_each_chunk(&mut |offset, bytes| {
            out[offset as usize..offset as usize + bytes.len()].copy_from_slice(bytes)
        })
    }

    /// Overwrites the tensor with `data` (exactly its size); a GPU copy as
    /// [`Guard::read_into`] reads one.
    pub fn write_from(&mut self, data: &[u8]) -> Result<()> {
        self.check_size(data.len())?;
        if let Some(offset) = self.gpu_offset() {
            assert_eq!(self.access, Access::Write, "writing needs a write guard");
            self.ready.wait()?;
            // The copy reads `data` only; the API takes a mutable pointer.
            // SAFETY: the device range is the guarded copy (exclusive: a write guard), its last use passed; `data` outlives the synchronous call.
            return unsafe {
                self.shared.device.raw_copy(
                    Direction::ToDevice,
                    data.as_ptr().cast_mut(),
                    offset,
                    data.len(),
                )
            };
        }
        self.for_each_chunk_mut(&mut |offset, bytes| {
            let len = bytes.len();
            bytes.copy_from_slice(&data[offset as usize..offset as usize + len])
        })
    }

    /// The arena offset of a device copy the host cannot address (a GPU's).
    fn gpu_offset(&self) -> Option<u64> {
        match self.view {
            View::Device { offset } if self.shared.device.host_address(offset).is_none() => {
                Some(offset)
            }
            _ => None,
        }
    }

    /// xxh3 of the tensor's bytes (for tests and integrity checks).
    pub fn checksum(&self) -> Result<u64> {
        let mut hasher = xxhash_rust::xxh3::Xxh3::new();
        self.for_each_chunk(&mut |_, bytes| hasher.update(bytes))?;
        Ok(hasher.digest())
    }

    fn check_range(&self, offset: u64, len: u64) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len_bytes => Ok(()),
            _ => Err(RuntimeError::Config {
                key: "range",
                value: format!("{offset}+{len} of a {}-byte tensor", self.len_bytes),
                fix: "read or write within the tensor".into(),
            }),
        }
    }

    fn check_size(&self, given: usize) -> Result<()> {
        if given as u64 == self.len_bytes {
            return Ok(());
        }
        check_size(self.tensor, self.shared.lock().entry(self.tensor)?, given)
    }

    fn addressable(&self, addressable: bool) -> Result<()> {
        if addressable {
            return Ok(());
        }
        Err(RuntimeError::Config {
            key: "tier",
            value: self.tier.to_string(),
            fix: "this copy is not addressable from the host (GPU memory); use device_address() or move it to host".into(),
        })
    }
}

/// The fence a new user of the copy in `tier` orders after (its last use:
/// a copy still landing, or enqueued work that used it).
fn ready_fence(entry: &Entry, tier: Tier) -> Fence {
    entry.copies[tier.index()]
        .as_ref()
        .and_then(|copy| copy.last_use.clone())
        .unwrap_or(Fence::Ready)
}

/// A range of elements of one guarded copy, for [`zip_ranges`]: the
/// guard (a reference to it for reads, an index into the write guards for
/// writes), the byte offset of the range's first element in the tensor,
/// and the bytes of one element.
pub type RangeOf<G> = (G, u64, u64);

/// Walks the same `elems` elements of several guarded copies together
/// (ranges read, ranges written, each at its own offset and element size;
/// several written ranges may lie in one write guard's copy, apart):
/// `f(first, reads, writes)` is called for each stretch in which every
/// range is contiguous in host memory, `first` being the stretch's first
/// element. Host chunks split a tensor where its size classes say, so the
/// stretches are as long as the chunks allow. Each guard's `ready()` fence
/// is waited for first. Errors for ranges past a tensor's end or copies
/// not addressable from the host (a GPU, NVMe).
///
/// The slices live as long as the borrows of the guards, so `f` may keep
/// them (to hand every stretch to one parallel call): the read guards stay
/// alive and free of writers, `outputs` stays borrowed exclusively, and no
/// two written slices of one call overlap.
///
/// # Panics
/// If a written range's guard is not a write guard, or two written ranges
/// of one guard overlap.
pub fn zip_ranges<'a, const R: usize, const W: usize>(
    reads: [RangeOf<&'a Guard>; R],
    outputs: &'a mut [&mut Guard],
    writes: [RangeOf<usize>; W],
    elems: u64,
    mut f: impl FnMut(u64, [&'a [u8]; R], [&'a mut [u8]; W]),
) -> Result<()> {
    // A range's bytes, checked: a product that wrapped would pass the
    // bounds and overlap checks below with a range that is not the one
    // walked.
    let bytes = |elem: u64| {
        elems
            .checked_mul(elem)
            .filter(|_| elem > 0)
            .ok_or_else(|| RuntimeError::Config {
                key: "range",
                value: format!("{elems} elements of {elem} bytes"),
                fix: "walk ranges within the tensor, of elements at least one byte long".into(),
            })
    };
    for (guard, offset, elem) in reads {
        guard.check_range(offset, bytes(elem)?)?;
        guard.ready.wait()?;
    }
    for (i, &(g, offset, elem)) in writes.iter().enumerate() {
        let guard = &outputs[g];
        assert_eq!(guard.access, Access::Write, "writing needs a write guard");
        let len = bytes(elem)?;
        guard.check_range(offset, len)?;
        guard.ready.wait()?;
        for &(h, other, other_elem) in &writes[..i] {
            // Both ranges lie within their tensors (checked): no overflow.
            let apart = offset + len <= other || other + elems * other_elem <= offset;
            assert!(h != g || apart, "written ranges overlap in one copy");
        }
    }
    let mut done = 0;
    while done < elems {
        let mut stretch = elems - done;
        let mut read_at = [(std::ptr::null_mut(), 0u64); R];
        let mut write_at = [(std::ptr::null_mut(), 0u64); W];
        for (at, (guard, offset, elem)) in read_at.iter_mut().zip(reads.iter()) {
            *at = guard.piece(*offset + done * *elem)?;
            stretch = stretch.min(at.1 / *elem);
        }
        for (at, (g, offset, elem)) in write_at.iter_mut().zip(writes.iter()) {
            *at = outputs[*g].piece(*offset + done * *elem)?;
            stretch = stretch.min(at.1 / *elem);
        }
        assert!(stretch > 0, "a chunk boundary splits an element");
        // `piece` returned addresses with at least `stretch * elem` bytes
        // behind them in guarded copies: read guards keep theirs alive and
        // free of writers for 'a; `outputs` holds the write guards
        // exclusively for 'a, the written ranges are apart (asserted above)
        // and each stretch covers elements no other stretch does, so no
        // written slice of the call overlaps another, and no read guard can
        // share a tensor with a write guard.
        let read_slices = std::array::from_fn(|i| {
            let len = (stretch * reads[i].2) as usize;
            // SAFETY: in bounds of a live read-guarded copy (see above).
            unsafe { std::slice::from_raw_parts(read_at[i].0, len) }
        });
        let write_slices = std::array::from_fn(|i| {
            let len = (stretch * writes[i].2) as usize;
            // SAFETY: in bounds of a write-guarded copy, disjoint from every other slice (see above).
            unsafe { std::slice::from_raw_parts_mut(write_at[i].0, len) }
        });
        f(done, read_slices, write_slices);
        done += stretch;
    }
    Ok(())
}

impl Guard {
    /// [`View::piece_at`], or the error saying the copy is not addressable.
    fn piece(&self, offset: u64) -> Result<(*mut u8, u64)> {
        match self.view.piece_at(&self.shared, self.len_bytes, offset) {
            Some(piece) => Ok(piece),
            None => self
                .addressable(false)
                .map(|()| unreachable!("not addressable")),
        }
    }
}

/// Where a chunk at `at` of `len` bytes meets the range at `offset` of
/// `range_len` bytes: (those bytes' indices in the chunk, in the range), or
/// None when they do not meet.
fn overlap(
    at: u64,
    len: usize,
    offset: u64,
    range_len: usize,
) -> Option<(std::ops::Range<usize>, std::ops::Range<usize>)> {
    let from = offset.max(at);
    let to = (offset + range_len as u64).min(at + len as u64);
    (from < to).then(|| {
        (
            (from - at) as usize..(to - at) as usize,
            (from - offset) as usize..(to - offset) as usize,
        )
    })
}

impl std::fmt::Debug for Guard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Guard")
            .field("tensor", &self.tensor)
            .field("tier", &self.tier)
            .field("access", &self.access)
            .field("len_bytes", &self.len_bytes)
            .finish()
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        let mut state = self.shared.lock();
        if let Ok(entry) = state.entry_mut(self.tensor) {
            entry.end_use(self.tier, self.access);
            if let (Some(fence), Some(copy)) = (
                self.last_use.take(),
                entry.copies[self.tier.index()].as_mut(),
            ) {
                copy.last_use = Some(fence);
            }
            if self.access == Access::Write {
                // A failed write's copy goes when the old bytes are elsewhere;
                // otherwise the written copy is the one kept.
                let elsewhere = Tier::ALL.iter().any(|&t| t != self.tier && entry.valid(t));
                if self.discard && elsewhere {
                    state.drop_copy(self.tensor, self.tier);
                } else {
                    state.release_others(self.tensor, self.tier);
                }
            }
        }
        drop(state);
        self.shared.changed.notify_all();
    }
}
