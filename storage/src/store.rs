//! [`SwapStore`]: preallocated swap files in one or more directories, an
//! extent allocator over them, striping, and a checksum per chunk kept in
//! memory apart from the data.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

use crate::alloc::ExtentAllocator;
use crate::buffer::AlignedBuf;
use crate::checksum::checksum;
use crate::config::StorageConfig;
use crate::engine::{EngineKind, FaultCounts, FaultRates};
use crate::error::{Op, Result, StorageError};
use crate::file::{IoFile, check_dir_writable};
use crate::queue::Request;
use crate::service::{
    Batch, EngineFactory, IoService, Piece, PieceSink, ServiceConfig, Ticket, Verify,
};
use crate::size::{ByteSize, round_up};

/// Name of the directory a store owns inside each swap directory.
pub const OWNED_DIR: &str = "strata-swap";

static STORE_SEQ: AtomicU64 = AtomicU64::new(0);

/// One swap file: locked while the store lives, deleted when it drops.
struct SwapFile {
    io: IoFile,
}

impl Drop for SwapFile {
    fn drop(&mut self) {
        if let Err(err) = std::fs::remove_file(&self.io.path) {
            tracing::warn!(
                "could not delete swap file {}: {err}",
                self.io.path.display()
            );
        }
        if let Some(dir) = self.io.path.parent() {
            // Succeeds only once the last store using the directory is gone.
            let _ = std::fs::remove_dir(dir);
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Contents {
    /// Never written, or the last write failed.
    Empty,
    /// The last write succeeded; checksums are current.
    Valid,
}

struct ExtentMeta {
    offset: u64,
    len_bytes: u64,
    checksums: Vec<u64>,
    contents: Contents,
    /// The transfer in flight and how many batches of it.
    busy: Option<(Op, u32)>,
    /// The handle was dropped while busy: free when the last batch ends.
    dropped: bool,
}

/// Striping geometry: logical offset -> (file, file offset).
#[derive(Clone, Copy, Debug)]
struct Layout {
    files: u64,
    stripe_bytes: u64,
    block_bytes: u64,
}

impl Layout {
    fn locate(&self, logical: u64) -> (u32, u64) {
        let stripe = logical / self.stripe_bytes;
        let file = (stripe % self.files) as u32;
        let file_offset = (stripe / self.files) * self.stripe_bytes + logical % self.stripe_bytes;
        (file, file_offset)
    }

    /// Calls `f(index, offset_in_extent, file, file_offset, len)` for each
    /// chunk of the extent; chunks never cross a block or stripe boundary.
    fn for_each_chunk(&self, offset: u64, len: u64, mut f: impl FnMut(usize, u64, u32, u64, u32)) {
        let (mut at, end, mut index) = (offset, offset + len, 0);
        while at < end {
            let next = ((at / self.block_bytes) + 1) * self.block_bytes;
            let chunk_end = next.min(end);
            let (file, file_offset) = self.locate(at);
            f(
                index,
                at - offset,
                file,
                file_offset,
                (chunk_end - at) as u32,
            );
            index += 1;
            at = chunk_end;
        }
    }

    fn chunks(&self, offset: u64, len: u64) -> usize {
        let mut count = 0;
        self.for_each_chunk(offset, len, |_, _, _, _, _| count += 1);
        count
    }
}

struct Inner {
    // Field order is drop order: the rings finish in-flight I/O and stop
    // before the files they use are closed and deleted.
    service: IoService,
    files: Vec<SwapFile>,
    layout: Layout,
    align_bytes: u64,
    extents_max: usize,
    allocator: Mutex<ExtentAllocator>,
    extents: Mutex<HashMap<u64, ExtentMeta>>,
    next_id: AtomicU64,
    faults: Option<FaultCounters>,
}

/// Each faulty ring's counts, registered as the rings start.
type FaultCounters = Arc<Mutex<Vec<Arc<Mutex<FaultCounts>>>>>;

/// A checksummed, striped swap space on one or more drives.
///
/// ```no_run
/// use strata_storage::{AlignedBuf, StorageConfig, SwapStore};
/// let store = SwapStore::open(&StorageConfig::default())?;
/// let extent = store.allocate(1 << 20)?;
/// let mut buf = AlignedBuf::new(1 << 20, store.align_bytes() as usize)?;
/// buf.fill(7);
/// store.write(&extent, &buf)?;
/// store.read(&extent, &mut buf)?;
/// # Ok::<(), strata_storage::StorageError>(())
/// ```
#[derive(Clone)]
pub struct SwapStore {
    inner: Arc<Inner>,
}

/// A region of the swap store. Freed when dropped (after any transfer in
/// flight finishes); cannot be cloned, so it cannot be freed twice.
pub struct Extent {
    id: u64,
    len_bytes: u64,
    inner: Arc<Inner>,
}

impl Extent {
    /// Stable id, used in error messages.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Length in bytes (a multiple of the store's alignment).
    pub fn len_bytes(&self) -> u64 {
        self.len_bytes
    }
}

impl std::fmt::Debug for Extent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Extent")
            .field("id", &self.id)
            .field("len_bytes", &self.len_bytes)
            .finish()
    }
}

impl Drop for Extent {
    fn drop(&mut self) {
        self.inner.release(self.id);
    }
}

impl SwapStore {
    /// Creates the swap files, preallocated, and starts the rings.
    pub fn open(config: &StorageConfig) -> Result<Self> {
        Self::open_with(config, None, None)
    }

    /// Like [`SwapStore::open`] with each ring's engine wrapped in a seeded
    /// [`crate::FaultEngine`], for tests and simulations.
    /// [`SwapStore::fault_counts`] says how many faults were injected.
    pub fn open_faulty(config: &StorageConfig, rates: FaultRates, seed: u64) -> Result<Self> {
        let counts = FaultCounters::default();
        let handles = counts.clone();
        let wrap: EngineFactory = Arc::new(move |ring, engine| {
            let engine = crate::FaultEngine::new(engine, rates, seed.wrapping_add(ring as u64));
            handles
                .lock()
                .expect("fault counters lock")
                .push(engine.counts_handle());
            Box::new(engine)
        });
        Self::open_with(config, Some(wrap), Some(counts))
    }

    /// Faults injected so far over every ring, for a store opened with
    /// [`SwapStore::open_faulty`] (None otherwise). A ring's counts are
    /// updated before the completions they affect are delivered, so after a
    /// ticket finishes they include every fault of its transfer.
    pub fn fault_counts(&self) -> Option<FaultCounts> {
        let counters = self.inner.faults.as_ref()?;
        let counters = counters.lock().expect("fault counters lock");
        Some(counters.iter().fold(FaultCounts::default(), |sum, ring| {
            let ring = *ring.lock().expect("fault counts lock");
            FaultCounts {
                eio: sum.eio + ring.eio,
                enospc: sum.enospc + ring.enospc,
                eagain: sum.eagain + ring.eagain,
                short: sum.short + ring.short,
                flip: sum.flip + ring.flip,
            }
        }))
    }

    fn open_with(
        config: &StorageConfig,
        wrap: Option<EngineFactory>,
        faults: Option<FaultCounters>,
    ) -> Result<Self> {
        config.validate()?;
        let engine = config.engine.resolve()?;
        let dirs = config.dirs.len() as u64;
        let file_bytes = round_up(config.capacity.0.div_ceil(dirs), config.stripe_size.0);
        let seq = STORE_SEQ.fetch_add(1, Ordering::Relaxed);
        let mut files = Vec::with_capacity(config.dirs.len());
        for (index, dir) in config.dirs.iter().enumerate() {
            let owned = prepare_dir(dir)?;
            let path = owned.join(format!("swap-{}-{seq}-{index}.bin", std::process::id()));
            files.push(create_swap_file(&path, dir, file_bytes)?);
        }
        let align_bytes = files.iter().map(|f| f.io.align_bytes).max().unwrap_or(4096);
        for (what, value) in [
            ("block_size", config.block_size.0),
            ("stripe_size", config.stripe_size.0),
        ] {
            if value % align_bytes != 0 {
                return Err(StorageError::Misaligned {
                    what,
                    value,
                    align_bytes,
                });
            }
        }
        let fds: Vec<i32> = files.iter().map(|f| f.io.fd()).collect();
        let paths: Vec<PathBuf> = files.iter().map(|f| f.io.path.clone()).collect();
        let service_config = ServiceConfig {
            engine,
            rings: config.rings,
            queue_depth: config.queue_depth,
            retries_max: config.retries_max,
        };
        let service = IoService::start(&service_config, &fds, &paths, wrap)?;
        tracing::info!(
            "swap store: {} in {} file(s), engine {engine}, {} ring(s) x depth {}, block {}, stripe {}, alignment {align_bytes}",
            ByteSize(file_bytes * dirs),
            files.len(),
            config.rings,
            config.queue_depth,
            config.block_size,
            config.stripe_size,
        );
        Ok(Self {
            inner: Arc::new(Inner {
                service,
                files,
                layout: Layout {
                    files: dirs,
                    stripe_bytes: config.stripe_size.0,
                    block_bytes: config.block_size.0,
                },
                align_bytes,
                extents_max: config.extents_max,
                allocator: Mutex::new(ExtentAllocator::new(file_bytes * dirs, align_bytes)),
                extents: Mutex::new(HashMap::new()),
                next_id: AtomicU64::new(0),
                faults,
            }),
        })
    }

    /// Direct-I/O alignment every buffer address and extent length respects.
    pub fn align_bytes(&self) -> u64 {
        self.inner.align_bytes
    }

    /// Capacity over all files.
    pub fn capacity_bytes(&self) -> u64 {
        self.inner
            .allocator
            .lock()
            .expect("allocator lock")
            .capacity_bytes()
    }

    /// Bytes not allocated to any extent.
    pub fn free_bytes(&self) -> u64 {
        self.inner
            .allocator
            .lock()
            .expect("allocator lock")
            .free_bytes()
    }

    /// The engine the rings run.
    pub fn engine(&self) -> EngineKind {
        self.inner.service.kind()
    }

    /// Whether every swap file uses direct I/O (false: buffered fallback).
    pub fn is_direct(&self) -> bool {
        self.inner.files.iter().all(|f| f.io.direct)
    }

    /// Paths of the swap files.
    pub fn paths(&self) -> Vec<PathBuf> {
        self.inner.files.iter().map(|f| f.io.path.clone()).collect()
    }

    /// Where an extent starts in the store's striped address space (for
    /// benches that drive the raw engine over the same blocks).
    pub(crate) fn logical_offset(&self, extent: &Extent) -> u64 {
        self.inner.extents.lock().expect("extents lock")[&extent.id].offset
    }

    /// Reserves an extent of at least `len_bytes` (rounded up to the alignment).
    pub fn allocate(&self, len_bytes: u64) -> Result<Extent> {
        let inner = &self.inner;
        let mut extents = inner.extents.lock().expect("extents lock");
        if extents.len() >= inner.extents_max {
            return Err(StorageError::Config {
                key: "extents_max",
                value: inner.extents_max.to_string(),
                fix: "every extent is in use: free some or raise extents_max".into(),
            });
        }
        let (offset, len) = inner
            .allocator
            .lock()
            .expect("allocator lock")
            .allocate(len_bytes)?;
        let id = inner.next_id.fetch_add(1, Ordering::Relaxed);
        let chunks = inner.layout.chunks(offset, len);
        extents.insert(
            id,
            ExtentMeta {
                offset,
                len_bytes: len,
                checksums: vec![0; chunks],
                contents: Contents::Empty,
                busy: None,
                dropped: false,
            },
        );
        Ok(Extent {
            id,
            len_bytes: len,
            inner: inner.clone(),
        })
    }

    /// Writes the first `extent.len_bytes()` of `data` to the extent and
    /// records its checksums. Blocks until done; call from plain threads.
    pub fn write(&self, extent: &Extent, data: &AlignedBuf) -> Result<()> {
        let ptr = data.as_ptr().cast_mut();
        // `transfer` waits for every piece before returning, even on unwind (its guard).
        // SAFETY: so `data` outlives the I/O, and a write only reads it.
        unsafe { self.transfer(extent, Op::Write, ptr, data.len(), ()) }.1
    }

    /// Makes the extent read as zeros without writing its bytes where the
    /// file system can (`fallocate`'s zero range or hole punch: no disk
    /// traffic), else by writing zeros; records the zeros' checksums. Blocks
    /// until done. A fresh tensor's zero moments cost nothing this way.
    pub fn zero(&self, extent: &Extent) -> Result<()> {
        self.zero_all(std::slice::from_ref(extent))
    }

    /// [`SwapStore::zero`] for several extents, the file ranges of those
    /// that lie side by side zeroed in one call: a tensor's chunks.
    pub fn zero_all(&self, extents: &[Extent]) -> Result<()> {
        let mut spans = Vec::with_capacity(extents.len());
        {
            let mut table = self.inner.extents.lock().expect("extents lock");
            // All or none: an extent in use refuses the call before any
            // other is marked (and its data forgotten).
            for extent in extents {
                check_begin(&table[&extent.id], extent.id, Op::Write)?;
            }
            for extent in extents {
                let meta = table.get_mut(&extent.id).expect("live extent has metadata");
                begin(meta, extent.id, Op::Write).expect("checked above");
                spans.push((meta.offset, meta.len_bytes));
            }
        }
        let result = self.zero_chunks(&spans);
        if result.is_ok() {
            // Chunks are at most a block; most are whole ones: one
            // checksum per length.
            let (mut zeros, mut by_len) = (Vec::new(), Vec::<(u32, u64)>::new());
            let mut table = self.inner.extents.lock().expect("extents lock");
            for (extent, &(offset, len)) in extents.iter().zip(&spans) {
                let mut sums = Vec::new();
                self.inner
                    .layout
                    .for_each_chunk(offset, len, |_, _, _, _, len| {
                        let sum = match by_len.iter().find(|(l, _)| *l == len) {
                            Some(&(_, sum)) => sum,
                            None => {
                                zeros.resize(zeros.len().max(len as usize), 0u8);
                                let sum = checksum(&zeros[..len as usize]);
                                by_len.push((len, sum));
                                sum
                            }
                        };
                        sums.push(sum);
                    });
                table
                    .get_mut(&extent.id)
                    .expect("busy extent has metadata")
                    .checksums = sums;
            }
        }
        for extent in extents {
            finish_transfer(
                &Arc::downgrade(&self.inner),
                extent.id,
                Op::Write,
                result.is_ok(),
            );
        }
        result
    }

    /// Zeroes the store's bytes in `spans` (offset, length), file range by
    /// file range (consecutive chunks of one file in one call).
    fn zero_chunks(&self, spans: &[(u64, u64)]) -> Result<()> {
        let mut ranges: Vec<(u32, u64, u64)> = Vec::new();
        for &(offset, len) in spans {
            self.inner
                .layout
                .for_each_chunk(offset, len, |_, _, file, at, len| match ranges.last_mut() {
                    Some((f, start, n)) if *f == file && *start + *n == at => *n += u64::from(len),
                    _ => ranges.push((file, at, u64::from(len))),
                });
        }
        let mut zeros: Option<AlignedBuf> = None;
        for (file, at, len) in ranges {
            let io = &self.inner.files[file as usize].io;
            let os = |cause| StorageError::Os {
                what: "zero a range of",
                path: io.path.clone(),
                cause,
            };
            if crate::sys::zero_range(&io.file, at, len).map_err(os)? {
                continue;
            }
            // Neither zero range nor hole punch: write the zeros, a block
            // at a time (aligned, as direct I/O needs).
            let block = self.inner.layout.block_bytes;
            if zeros.is_none() {
                let mut buf = AlignedBuf::new(block as usize, self.inner.align_bytes as usize)?;
                buf.fill(0);
                zeros = Some(buf);
            }
            let zeros = zeros.as_ref().expect("made above");
            let mut done = 0;
            while done < len {
                let n = (len - done).min(block) as usize;
                use std::os::unix::fs::FileExt;
                io.file.write_all_at(&zeros[..n], at + done).map_err(os)?;
                done += n as u64;
            }
        }
        Ok(())
    }

    /// Reads the extent into `buf`, verifying every chunk's checksum. Blocks
    /// until done; call from plain threads.
    pub fn read(&self, extent: &Extent, buf: &mut AlignedBuf) -> Result<()> {
        let ptr = buf.as_mut_ptr();
        // SAFETY: as in `write`; `&mut` gives the reads exclusive access.
        unsafe { self.transfer(extent, Op::Read, ptr, buf.len(), ()) }.1
    }

    /// Starts writing `buf` to the extent and returns at once; the ticket
    /// hands the buffer back with the result.
    pub fn write_start(&self, extent: &Extent, buf: AlignedBuf) -> Ticket<AlignedBuf> {
        self.start(extent, Op::Write, buf)
    }

    /// Starts reading the extent into `buf` and returns at once.
    pub fn read_start(&self, extent: &Extent, buf: AlignedBuf) -> Ticket<AlignedBuf> {
        self.start(extent, Op::Read, buf)
    }

    /// Async write: waits for queue room and completion without blocking a thread.
    pub async fn write_async(&self, extent: &Extent, buf: AlignedBuf) -> (AlignedBuf, Result<()>) {
        self.run_async(extent, Op::Write, buf).await
    }

    /// Async read, verifying checksums.
    pub async fn read_async(&self, extent: &Extent, buf: AlignedBuf) -> (AlignedBuf, Result<()>) {
        self.run_async(extent, Op::Read, buf).await
    }

    fn start(&self, extent: &Extent, op: Op, mut buf: AlignedBuf) -> Ticket<AlignedBuf> {
        let (ptr, len) = (buf.as_mut_ptr(), buf.len());
        // The batch owns `buf` (as its payload) until every piece has completed.
        // SAFETY: the pointer is into `buf`, alive for the whole transfer.
        unsafe { self.start_raw(extent, op, ptr, len, buf) }
    }

    /// Starts writing `len_bytes` at `ptr` (memory owned by the caller, such
    /// as one buffer of a pool carved from a larger region) to the extent and
    /// returns at once; `payload` comes back with the result.
    ///
    /// # Safety
    /// `ptr..ptr + len_bytes` must stay valid, and must not be written, until
    /// the ticket reports the transfer finished (`wait` returns, `is_done` is
    /// true or the future resolves). Dropping the ticket does not end that
    /// obligation: the transfer still runs.
    pub unsafe fn write_start_raw<T: Send + 'static>(
        &self,
        extent: &Extent,
        ptr: *const u8,
        len_bytes: usize,
        payload: T,
    ) -> Ticket<T> {
        // SAFETY: forwarded from our caller; a write only reads the memory.
        unsafe { self.start_raw(extent, Op::Write, ptr.cast_mut(), len_bytes, payload) }
    }

    /// Starts reading the extent into `ptr..ptr + len_bytes`, verifying every
    /// chunk's checksum, and returns at once.
    ///
    /// # Safety
    /// `ptr..ptr + len_bytes` must stay valid, and must be neither read nor
    /// written by anyone else, until the ticket reports the transfer finished.
    pub unsafe fn read_start_raw<T: Send + 'static>(
        &self,
        extent: &Extent,
        ptr: *mut u8,
        len_bytes: usize,
        payload: T,
    ) -> Ticket<T> {
        // SAFETY: forwarded from our caller.
        unsafe { self.start_raw(extent, Op::Read, ptr, len_bytes, payload) }
    }

    /// # Safety
    /// As [`SwapStore::read_start_raw`] (for writes: valid and unwritten).
    unsafe fn start_raw<T: Send + 'static>(
        &self,
        extent: &Extent,
        op: Op,
        ptr: *mut u8,
        len: usize,
        payload: T,
    ) -> Ticket<T> {
        let (batch, ticket, pieces) = match self.prepare(extent, op, ptr, len, payload) {
            Ok(prepared) => prepared,
            Err((payload, err)) => return failed_ticket(payload, err),
        };
        self.send_all_blocking(extent.id, op, batch, pieces, false);
        ticket
    }

    /// Stamps and sends every piece, blocking on backpressure; with `wait`,
    /// returns only once all of them have completed (also when unwinding).
    fn send_all_blocking<T: Send>(
        &self,
        id: u64,
        op: Op,
        batch: Arc<Batch<T>>,
        pieces: Vec<Piece>,
        wait: bool,
    ) {
        let mut guard = SendGuard {
            batch,
            sent: 0,
            total: pieces.len(),
            wait,
        };
        for (index, piece) in pieces.into_iter().enumerate() {
            self.stamp(id, op, index, &piece);
            self.inner.service.send_blocking(piece);
            guard.sent += 1;
        }
    }

    async fn run_async(
        &self,
        extent: &Extent,
        op: Op,
        mut buf: AlignedBuf,
    ) -> (AlignedBuf, Result<()>) {
        let (ptr, len) = (buf.as_mut_ptr(), buf.len());
        let (batch, ticket, pieces) = match self.prepare(extent, op, ptr, len, buf) {
            Ok(prepared) => prepared,
            Err((buf, err)) => return (buf, Err(err)),
        };
        // If this future is dropped mid-way, the guard fails the unsent pieces
        // so the batch still finishes; the buffer lives in the batch meanwhile.
        let mut guard = SendGuard {
            batch,
            sent: 0,
            total: pieces.len(),
            wait: false,
        };
        for (index, piece) in pieces.into_iter().enumerate() {
            self.stamp(extent.id, op, index, &piece);
            self.inner.service.send_async(piece).await;
            guard.sent += 1;
        }
        drop(guard);
        ticket.await
    }

    /// # Safety
    /// `ptr..ptr+len` must be valid (writable for reads) until this returns;
    /// it returns only after every submitted piece has completed.
    unsafe fn transfer<T: Send + 'static>(
        &self,
        extent: &Extent,
        op: Op,
        ptr: *mut u8,
        len: usize,
        payload: T,
    ) -> (T, Result<()>) {
        let (batch, ticket, pieces) = match self.prepare(extent, op, ptr, len, payload) {
            Ok(prepared) => prepared,
            Err((payload, err)) => return (payload, Err(err)),
        };
        self.send_all_blocking(extent.id, op, batch, pieces, true);
        ticket.wait()
    }

    /// Records the checksum of a write piece, just before it is sent, so that
    /// hashing chunk i+1 overlaps the transfer of chunk i.
    fn stamp(&self, id: u64, op: Op, index: usize, piece: &Piece) {
        if op != Op::Write {
            return;
        }
        let (ptr, len) = (piece.request.ptr, piece.request.len as usize);
        // The piece's memory is valid (the caller's obligation).
        // SAFETY: a write only reads it, and nothing writes it while the transfer is busy.
        let data = unsafe { std::slice::from_raw_parts(ptr, len) };
        let sum = checksum(data);
        let mut extents = self.inner.extents.lock().expect("extents lock");
        extents
            .get_mut(&id)
            .expect("busy extent has metadata")
            .checksums[index] = sum;
    }

    /// Checks the extent's state, marks it busy and
    /// builds the pieces. Pieces point into `ptr`, which must be kept valid by
    /// the caller (directly or through `payload`).
    #[allow(clippy::type_complexity)]
    fn prepare<T: Send + 'static>(
        &self,
        extent: &Extent,
        op: Op,
        ptr: *mut u8,
        buffer_bytes: usize,
        payload: T,
    ) -> std::result::Result<(Arc<Batch<T>>, Ticket<T>, Vec<Piece>), (T, StorageError)> {
        assert!(
            Arc::ptr_eq(&extent.inner, &self.inner),
            "extent belongs to another store"
        );
        if (buffer_bytes as u64) < extent.len_bytes {
            let err = StorageError::BufferTooSmall {
                extent: extent.id,
                extent_bytes: extent.len_bytes,
                buffer_bytes: buffer_bytes as u64,
            };
            return Err((payload, err));
        }
        if !(ptr as u64).is_multiple_of(self.inner.align_bytes) {
            let err = StorageError::Misaligned {
                what: "buffer address",
                value: ptr as u64,
                align_bytes: self.inner.align_bytes,
            };
            return Err((payload, err));
        }
        let mut extents = self.inner.extents.lock().expect("extents lock");
        let meta = extents
            .get_mut(&extent.id)
            .expect("live extent has metadata");
        if let Err(err) = begin(meta, extent.id, op) {
            return Err((payload, err));
        }
        let layout = self.inner.layout;
        let weak = Arc::downgrade(&self.inner);
        let id = extent.id;
        let hook = Box::new(move |succeeded: bool| finish_transfer(&weak, id, op, succeeded));
        let chunks = meta.checksums.len();
        let (batch, ticket) = IoService::batch(chunks, payload, Some(hook));
        let sink: Arc<dyn PieceSink> = batch.clone();
        let mut pieces = Vec::with_capacity(chunks);
        layout.for_each_chunk(
            meta.offset,
            meta.len_bytes,
            |index, at, file, file_offset, len| {
                // SAFETY: `at + len <= extent length <= buffer length`, checked above.
                let chunk_ptr = unsafe { ptr.add(at as usize) };
                let verify = match op {
                    // Write checksums are stamped just before each piece is sent.
                    Op::Write => None,
                    Op::Read => Some(Verify {
                        extent: id,
                        offset: at,
                        expected: meta.checksums[index],
                    }),
                };
                let request = Request {
                    op,
                    file,
                    offset: file_offset,
                    ptr: chunk_ptr,
                    len,
                    tag: 0,
                };
                pieces.push(Piece {
                    request,
                    verify,
                    sink: sink.clone(),
                });
            },
        );
        Ok((batch, ticket, pieces))
    }
}

fn failed_ticket<T: Send + 'static>(payload: T, err: StorageError) -> Ticket<T> {
    let (batch, ticket) = IoService::batch(1, payload, None);
    batch.piece_done(Err(err));
    ticket
}

/// Marks an extent busy for `op`, or says why it cannot be.
fn begin(meta: &mut ExtentMeta, id: u64, op: Op) -> Result<()> {
    check_begin(meta, id, op)?;
    meta.busy = Some(match meta.busy {
        Some((busy_op, count)) => (busy_op, count + 1),
        None => (op, 1),
    });
    if op == Op::Write {
        // Until this write succeeds the old checksums no longer describe the data.
        meta.contents = Contents::Empty;
    }
    Ok(())
}

/// Why an extent cannot begin `op` now, if it cannot.
fn check_begin(meta: &ExtentMeta, id: u64, op: Op) -> Result<()> {
    match (op, meta.busy) {
        (_, Some((busy_with, _))) if busy_with != op || op == Op::Write => {
            Err(StorageError::ExtentBusy {
                extent: id,
                busy_with,
                requested: op,
            })
        }
        (Op::Read, _) if meta.contents != Contents::Valid => {
            Err(StorageError::ExtentNotWritten { extent: id })
        }
        _ => Ok(()),
    }
}

/// Runs when a transfer's last piece finishes.
fn finish_transfer(inner: &Weak<Inner>, id: u64, op: Op, succeeded: bool) {
    let Some(inner) = inner.upgrade() else { return };
    let mut extents = inner.extents.lock().expect("extents lock");
    let meta = extents.get_mut(&id).expect("busy extent has metadata");
    if op == Op::Write && succeeded {
        meta.contents = Contents::Valid;
    }
    meta.busy = match meta.busy {
        Some((busy_op, count)) if count > 1 => Some((busy_op, count - 1)),
        _ => None,
    };
    if meta.busy.is_none() && meta.dropped {
        let meta = extents.remove(&id).expect("present");
        inner
            .allocator
            .lock()
            .expect("allocator lock")
            .free(meta.offset, meta.len_bytes);
    }
}

impl Inner {
    fn release(&self, id: u64) {
        let mut extents = self.extents.lock().expect("extents lock");
        let meta = extents.get_mut(&id).expect("live extent has metadata");
        if meta.busy.is_some() {
            meta.dropped = true;
            return;
        }
        let meta = extents.remove(&id).expect("present");
        self.allocator
            .lock()
            .expect("allocator lock")
            .free(meta.offset, meta.len_bytes);
    }
}

/// Makes sure a batch finishes even if submission stops part-way (a panic,
/// or an async caller dropping the future): unsent pieces are failed, and
/// with `wait` the guard blocks until the sent ones complete.
struct SendGuard<T: Send> {
    batch: Arc<Batch<T>>,
    sent: usize,
    total: usize,
    wait: bool,
}

impl<T: Send> Drop for SendGuard<T> {
    fn drop(&mut self) {
        for _ in self.sent..self.total {
            self.batch.piece_done(Err(StorageError::ServiceStopped));
        }
        if self.wait {
            self.batch.wait_finished();
        }
    }
}

/// Creates `<dir>/strata-swap` (mode 0700) and removes swap files that a
/// crashed run left there (their lock is free).
fn prepare_dir(dir: &Path) -> Result<PathBuf> {
    use std::os::unix::fs::DirBuilderExt;
    check_dir_writable(dir)?;
    let owned = dir.join(OWNED_DIR);
    match std::fs::DirBuilder::new().mode(0o700).create(&owned) {
        Ok(()) => {}
        Err(err) if err.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(err) => {
            return Err(StorageError::NotWritable {
                path: owned,
                cause: err,
            });
        }
    }
    let entries = std::fs::read_dir(&owned).map_err(|err| StorageError::NotWritable {
        path: owned.clone(),
        cause: err,
    })?;
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if !(name.starts_with("swap-") && name.ends_with(".bin")) {
            continue;
        }
        let Ok(file) = std::fs::OpenOptions::new().read(true).open(&path) else {
            continue;
        };
        if lock_stale(&file, &name) {
            let bytes = file.metadata().map(|m| m.len()).unwrap_or(0);
            std::fs::remove_file(&path).map_err(|err| StorageError::NotWritable {
                path: path.clone(),
                cause: err,
            })?;
            tracing::info!(
                "removed stale swap file {} ({}) left by a run that did not exit cleanly",
                path.display(),
                ByteSize(bytes)
            );
        }
    }
    Ok(owned)
}

/// How long a swap file of a process that has exited may stay locked: the
/// kernel releases a dead process's locks only after tearing down its
/// memory (seconds for a large pinned pool).
const STALE_LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// Whether `file` (named `swap-<pid>-...`) is a dead run's: its lock is
/// free, or is held by a process that no longer exists and is released
/// within [`STALE_LOCK_WAIT`]. Locks this function takes stay held until
/// `file` is closed.
fn lock_stale(file: &std::fs::File, name: &str) -> bool {
    if crate::sys::try_lock_exclusive(file).unwrap_or(false) {
        return true;
    }
    let pid = name
        .strip_prefix("swap-")
        .and_then(|rest| rest.split('-').next())
        .and_then(|pid| pid.parse::<u32>().ok());
    let Some(pid) = pid else {
        return false;
    };
    if pid == std::process::id() || Path::new(&format!("/proc/{pid}")).exists() {
        return false;
    }
    let deadline = std::time::Instant::now() + STALE_LOCK_WAIT;
    while std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(10));
        if crate::sys::try_lock_exclusive(file).unwrap_or(false) {
            return true;
        }
    }
    false
}

fn create_swap_file(path: &Path, dir: &Path, file_bytes: u64) -> Result<SwapFile> {
    let available = crate::sys::available_bytes(dir).map_err(|cause| StorageError::Os {
        what: "statvfs",
        path: dir.to_path_buf(),
        cause,
    })?;
    if available < file_bytes {
        return Err(StorageError::NoSpace {
            path: dir.to_path_buf(),
            needed_bytes: file_bytes,
            available_bytes: available,
        });
    }
    let io = IoFile::open(path, true)?;
    let file = SwapFile { io };
    if !crate::sys::try_lock_exclusive(&file.io.file).map_err(|cause| StorageError::Os {
        what: "flock",
        path: path.to_path_buf(),
        cause,
    })? {
        // Another process opened the file between its creation and this
        // lock: the directory is in use by another run.
        return Err(StorageError::Os {
            what: "lock the new swap file",
            path: path.to_path_buf(),
            cause: std::io::Error::new(
                std::io::ErrorKind::WouldBlock,
                "another process holds a lock on it: another run is using this swap directory; give each run its own",
            ),
        });
    }
    crate::sys::fallocate(&file.io.file, file_bytes).map_err(|cause| {
        match cause.raw_os_error() {
            Some(libc::ENOSPC) | Some(libc::EDQUOT) => StorageError::NoSpace {
                path: dir.to_path_buf(),
                needed_bytes: file_bytes,
                available_bytes: crate::sys::available_bytes(dir).unwrap_or(0),
            },
            _ => StorageError::Os {
                what: "fallocate",
                path: path.to_path_buf(),
                cause,
            },
        }
    })?;
    Ok(file)
}
