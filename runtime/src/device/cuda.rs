//! The CUDA device: one arena of `budget` bytes allocated at start on the
//! GPU of a `strata_device::cuda::Context`; copies go on the context's two
//! copy streams, one per direction, apart from the compute stream, and each
//! batch ends with a fence. No CUDA type is named here.

use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use strata_device::cuda::Context;
use strata_device::{DeviceError, Fence, StreamKind};
use strata_storage::{AlignedBuf, PAGE_BYTES};

use super::{Commit, CopyPiece, Device, DeviceKind, Direction};
use crate::error::Result;

/// A GPU with an arena of device memory and two copy streams.
pub struct CudaDevice {
    context: Arc<Context>,
    base: u64,
    capacity_bytes: u64,
}

fn stream(direction: Direction) -> StreamKind {
    match direction {
        Direction::ToDevice => StreamKind::CopyToDevice,
        Direction::ToHost => StreamKind::CopyToHost,
    }
}

impl CudaDevice {
    /// Opens device `ordinal` and reserves `budget_bytes` of its memory.
    pub fn new(ordinal: usize, budget_bytes: u64) -> Result<Self> {
        Self::on_context(Context::open(ordinal)?, budget_bytes)
    }

    /// Pinned host memory from the driver (`cuMemHostAlloc`), committed
    /// and zeroed from the calling thread.
    fn alloc_driver_pinned(&self, len_bytes: usize) -> Result<AlignedBuf> {
        let len = len_bytes.div_ceil(PAGE_BYTES) * PAGE_BYTES;
        let pinned = self.context.alloc_pinned(len, PAGE_BYTES)?;
        let pointer = pinned.pointer();
        // Dropping the closure (which owns `pinned`) releases the memory.
        let release = move |_pointer, _len| drop(pinned);
        // Page-aligned (checked by alloc_pinned), `len` zeroed bytes (a multiple of a
        // page), owned by the buffer; `release` drops `pinned` after its call.
        // SAFETY: the memory is valid, aligned and zeroed, and released exactly once.
        let buffer = unsafe { AlignedBuf::from_raw_parts(pointer, len, PAGE_BYTES, true, release) };
        Ok(buffer)
    }

    /// Reserves `budget_bytes` on an open context, whose streams it shares
    /// with the caller (a backend computing on the same compute stream).
    pub fn on_context(context: Arc<Context>, budget_bytes: u64) -> Result<Self> {
        let free_bytes = context.free_bytes()?;
        if free_bytes < budget_bytes {
            return Err(DeviceError::DeviceMemory {
                budget_bytes,
                free_bytes,
            }
            .into());
        }
        let base = context.malloc(budget_bytes)?;
        tracing::info!(
            "device: cuda ({}), arena {budget_bytes} bytes",
            context.name()
        );
        Ok(Self {
            context,
            base,
            capacity_bytes: budget_bytes,
        })
    }

    /// The context (compute stream, copy streams) kernels run in.
    pub fn context(&self) -> &Arc<Context> {
        &self.context
    }

    fn check_range(&self, device_offset: u64, len_bytes: usize) {
        assert!(
            device_offset + len_bytes as u64 <= self.capacity_bytes,
            "copy of {len_bytes} bytes at arena offset {device_offset} leaves the {}-byte arena",
            self.capacity_bytes
        );
    }
}

impl Drop for CudaDevice {
    fn drop(&mut self) {
        let _ = self.context.synchronize();
        // Allocated in `new` on this context; the synchronize above finished every copy.
        // SAFETY: freed once, here, with no copy into it in flight.
        if let Err(err) = unsafe { self.context.free(self.base) } {
            tracing::warn!("freeing the device arena failed: {err}");
        }
    }
}

impl Device for CudaDevice {
    fn kind(&self) -> DeviceKind {
        DeviceKind::Cuda
    }

    fn describe(&self) -> String {
        format!(
            "{} ({} bytes of device memory)",
            self.context.name(),
            self.capacity_bytes
        )
    }

    fn capacity_bytes(&self) -> u64 {
        self.capacity_bytes
    }

    /// Commits the memory with `commit` and then registers it with the
    /// driver where it lies, so its pages stay where the committing
    /// threads put them. Should the driver refuse to register it, warns
    /// and takes the driver's own allocation instead (committed from this
    /// thread).
    fn alloc_host(&self, len_bytes: usize, commit: &Commit<'_>) -> Result<AlignedBuf> {
        let mut memory = AlignedBuf::new_uncommitted(len_bytes, PAGE_BYTES)?;
        commit(&mut memory)?;
        // A child process must not get these pages copied on write: the
        // parent would then write pages the GPU no longer reads.
        memory.exclude_from_fork();
        let (pointer, len) = (memory.as_mut_ptr(), memory.len());
        let pointer = NonNull::new(pointer).expect("a buffer is never at address zero");
        // SAFETY: `memory`'s own range, page-aligned; `memory` is dropped only
        // after the registration, in `release` below.
        match unsafe { self.context.register_host(pointer, len) } {
            Ok(registration) => {
                // Unregistered first, then unmapped, when the buffer drops.
                let release = move |_pointer, _len| {
                    drop(registration);
                    drop(memory);
                };
                // `memory`'s range is valid, page-aligned, zeroed and a multiple
                // of a page long; from here on only the returned buffer uses it.
                // SAFETY: as above, and `release` frees it once, when the buffer drops.
                Ok(unsafe { AlignedBuf::from_raw_parts(pointer, len, PAGE_BYTES, true, release) })
            }
            Err(err) => {
                static WARNED: AtomicBool = AtomicBool::new(false);
                if !WARNED.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        "could not page-lock {len} bytes of host memory where they lie ({err}); \
                         taking the driver's pinned allocation instead, whose pages are \
                         placed from this thread rather than the optimizer's"
                    );
                }
                drop(memory);
                self.alloc_driver_pinned(len_bytes)
            }
        }
    }

    unsafe fn copy(&self, direction: Direction, pieces: Vec<CopyPiece>) -> Result<Fence> {
        let on = stream(direction);
        for piece in &pieces {
            self.check_range(piece.device_offset, piece.len_bytes);
            let device = self.base + piece.device_offset;
            // SAFETY: forwarded from our caller; the range is in the arena.
            unsafe {
                self.context
                    .copy_async(on, piece.host, device, piece.len_bytes)?
            };
        }
        Ok(self.context.record(on)?)
    }

    fn fill(&self, device_offset: u64, len_bytes: u64, value: u8) -> Result<()> {
        self.check_range(device_offset, len_bytes as usize);
        let (device, len) = (self.base + device_offset, len_bytes as usize);
        // Uploads into the range follow on the same stream, and the other two
        // streams wait (on the device) for the fence below.
        // SAFETY: the range is in the arena, owned by the copy being registered (or released, with its last use passed).
        unsafe {
            self.context
                .fill_async(StreamKind::CopyToDevice, device, len, value)?
        };
        let zeroed = self.context.record(StreamKind::CopyToDevice)?;
        self.context.wait_on(StreamKind::CopyToHost, &zeroed)?;
        self.context.wait_on(StreamKind::Compute, &zeroed)?;
        Ok(())
    }

    fn host_address(&self, _device_offset: u64) -> Option<*mut u8> {
        None
    }

    fn device_address(&self, device_offset: u64) -> u64 {
        self.base + device_offset
    }

    unsafe fn raw_copy(
        &self,
        direction: Direction,
        host: *mut u8,
        device_offset: u64,
        len_bytes: usize,
    ) -> Result<()> {
        self.check_range(device_offset, len_bytes);
        // SAFETY: forwarded from our caller; synchronized before returning.
        unsafe {
            self.context.raw_copy(
                stream(direction),
                host,
                self.base + device_offset,
                len_bytes,
            )?
        };
        Ok(())
    }
}
