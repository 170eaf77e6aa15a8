//! The CUDA device, over cudarc's driver API loaded at run time (building
//! needs no CUDA). One arena of `budget` bytes is allocated at start; copies
//! go on two non-blocking copy streams, one per direction, apart from any
//! compute stream, and each batch ends with an event to wait on.

use std::ffi::c_void;
use std::ptr::NonNull;
use std::sync::Arc;

use cudarc::driver::safe::{CudaContext, CudaEvent, CudaStream};
use cudarc::driver::{result, sys};
use strata_storage::{AlignedBuf, PAGE_BYTES};

use super::{CopyPiece, CopyTicket, Device, DeviceKind, Direction};
use crate::error::{Result, RuntimeError};

/// The event recorded after a batch of copies.
pub struct CudaTicket {
    event: CudaEvent,
}

fn cuda_error(op: &'static str) -> impl Fn(result::DriverError) -> RuntimeError {
    move |err| RuntimeError::Cuda {
        op,
        cause: format!("{err:?}"),
    }
}

/// Whether the driver library loads and reports a device.
pub(super) fn probe() -> std::result::Result<(), String> {
    // SAFETY: only tries to load the library; no symbol is called.
    if !unsafe { sys::is_culib_present() } {
        return Err("the CUDA driver library (libcuda.so) was not found".into());
    }
    result::init().map_err(|err| format!("cuInit failed: {err:?}"))?;
    match result::device::get_count() {
        Ok(0) => Err("the CUDA driver reports no device".into()),
        Ok(_) => Ok(()),
        Err(err) => Err(format!("cuDeviceGetCount failed: {err:?}")),
    }
}

/// A GPU with an arena of device memory and two copy streams.
pub struct CudaDevice {
    context: Arc<CudaContext>,
    to_device: Arc<CudaStream>,
    to_host: Arc<CudaStream>,
    raw: Arc<CudaStream>,
    base: sys::CUdeviceptr,
    capacity_bytes: u64,
    name: String,
}

impl CudaDevice {
    /// Opens device `ordinal` and reserves `budget_bytes` of its memory.
    pub fn new(ordinal: usize, budget_bytes: u64) -> Result<Self> {
        probe().map_err(|reason| RuntimeError::CudaUnavailable { reason })?;
        let count = result::device::get_count().map_err(cuda_error("cuDeviceGetCount"))?;
        if ordinal >= count as usize {
            return Err(RuntimeError::CudaUnavailable {
                reason: format!(
                    "device ordinal {ordinal} asked for, but only {count} device(s) exist"
                ),
            });
        }
        let context = CudaContext::new(ordinal).map_err(cuda_error("context creation"))?;
        let (free_bytes, _total) = context.mem_get_info().map_err(cuda_error("cuMemGetInfo"))?;
        if (free_bytes as u64) < budget_bytes {
            return Err(RuntimeError::DeviceMemory {
                budget_bytes,
                free_bytes: free_bytes as u64,
            });
        }
        context
            .bind_to_thread()
            .map_err(cuda_error("cuCtxSetCurrent"))?;
        // SAFETY: a plain allocation in the bound context; freed in Drop.
        let base = unsafe { result::malloc_sync(budget_bytes as usize) }
            .map_err(cuda_error("cuMemAlloc"))?;
        let stream = || context.new_stream().map_err(cuda_error("cuStreamCreate"));
        let (to_device, to_host, raw) = (stream()?, stream()?, stream()?);
        let name = context.name().unwrap_or_else(|_| "CUDA device".into());
        tracing::info!("device: cuda {ordinal} ({name}), arena {budget_bytes} bytes");
        Ok(Self {
            context,
            to_device,
            to_host,
            raw,
            base,
            capacity_bytes: budget_bytes,
            name,
        })
    }

    fn check_range(&self, device_offset: u64, len_bytes: usize) {
        assert!(
            device_offset + len_bytes as u64 <= self.capacity_bytes,
            "copy of {len_bytes} bytes at arena offset {device_offset} leaves the {}-byte arena",
            self.capacity_bytes
        );
    }

    /// Queues one copy on `stream`.
    ///
    /// # Safety
    /// The host range is valid and the device range is in the arena, both
    /// untouched by others until the stream has passed this copy.
    unsafe fn enqueue(
        &self,
        stream: &CudaStream,
        direction: Direction,
        piece: &CopyPiece,
    ) -> Result<()> {
        self.check_range(piece.device_offset, piece.len_bytes);
        let device = self.base + piece.device_offset;
        let code = match direction {
            // SAFETY: the caller's contract; the context is bound by `copy`.
            Direction::ToDevice => unsafe {
                sys::cuMemcpyHtoDAsync_v2(
                    device,
                    piece.host as *const c_void,
                    piece.len_bytes,
                    stream.cu_stream(),
                )
            },
            // SAFETY: as above.
            Direction::ToHost => unsafe {
                sys::cuMemcpyDtoHAsync_v2(
                    piece.host as *mut c_void,
                    device,
                    piece.len_bytes,
                    stream.cu_stream(),
                )
            },
        };
        code.result().map_err(cuda_error("cuMemcpyAsync"))
    }
}

impl Drop for CudaDevice {
    fn drop(&mut self) {
        let _ = self.context.synchronize();
        // SAFETY: allocated in `new` in this context; all copies have finished.
        let freed = unsafe { result::free_sync(self.base) };
        if let Err(err) = freed {
            tracing::warn!("freeing the device arena failed: {err:?}");
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
            self.name, self.capacity_bytes
        )
    }

    fn capacity_bytes(&self) -> u64 {
        self.capacity_bytes
    }

    fn alloc_host(&self, len_bytes: usize) -> Result<AlignedBuf> {
        let len = len_bytes.div_ceil(PAGE_BYTES) * PAGE_BYTES;
        self.context
            .bind_to_thread()
            .map_err(cuda_error("cuCtxSetCurrent"))?;
        // SAFETY: a plain pinned allocation; zeroed below before any read.
        let raw = unsafe { result::malloc_host(len, sys::CU_MEMHOSTALLOC_PORTABLE) }
            .map_err(cuda_error("cuMemHostAlloc"))?;
        let ptr = NonNull::new(raw.cast::<u8>()).ok_or(RuntimeError::Cuda {
            op: "cuMemHostAlloc",
            cause: "returned null".into(),
        })?;
        let context = self.context.clone();
        let release = move |ptr: NonNull<u8>, _len: usize| {
            let _ = context.bind_to_thread();
            // SAFETY: allocated by cuMemHostAlloc above, released once.
            if let Err(err) = unsafe { result::free_host(ptr.as_ptr().cast()) } {
                tracing::warn!("freeing pinned host memory failed: {err:?}");
            }
        };
        if !(ptr.as_ptr() as usize).is_multiple_of(PAGE_BYTES) {
            release(ptr, len);
            return Err(RuntimeError::Cuda {
                op: "cuMemHostAlloc",
                cause: "returned memory that is not page-aligned".into(),
            });
        }
        // SAFETY: `len` bytes at `ptr` are ours, writable and not yet shared.
        unsafe { std::ptr::write_bytes(ptr.as_ptr(), 0, len) };
        // SAFETY: page-aligned, `len` (a multiple of a page) bytes, owned by the
        // buffer and released exactly once by `release`.
        Ok(unsafe { AlignedBuf::from_raw_parts(ptr, len, PAGE_BYTES, true, release) })
    }

    unsafe fn copy(&self, direction: Direction, pieces: Vec<CopyPiece>) -> Result<CopyTicket> {
        let stream = match direction {
            Direction::ToDevice => &self.to_device,
            Direction::ToHost => &self.to_host,
        };
        self.context
            .bind_to_thread()
            .map_err(cuda_error("cuCtxSetCurrent"))?;
        for piece in &pieces {
            // SAFETY: forwarded from our caller.
            unsafe { self.enqueue(stream, direction, piece)? };
        }
        let event = stream
            .record_event(None)
            .map_err(cuda_error("cuEventRecord"))?;
        Ok(CopyTicket::Cuda(CudaTicket { event }))
    }

    fn wait(&self, ticket: CopyTicket) -> Result<()> {
        match ticket {
            CopyTicket::Cuda(ticket) => ticket
                .event
                .synchronize()
                .map_err(cuda_error("cuEventSynchronize")),
            CopyTicket::Cpu(_) => unreachable!("a CPU ticket on a CUDA device"),
        }
    }

    fn zero(&self, device_offset: u64, len_bytes: u64) -> Result<()> {
        self.check_range(device_offset, len_bytes as usize);
        self.context
            .bind_to_thread()
            .map_err(cuda_error("cuCtxSetCurrent"))?;
        // SAFETY: the range is in the arena, owned by the copy being registered.
        unsafe { result::memset_d8_sync(self.base + device_offset, 0, len_bytes as usize) }
            .map_err(cuda_error("cuMemsetD8"))
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
        self.context
            .bind_to_thread()
            .map_err(cuda_error("cuCtxSetCurrent"))?;
        let piece = CopyPiece {
            host,
            device_offset,
            len_bytes,
        };
        // SAFETY: forwarded from our caller; synchronized before returning.
        unsafe { self.enqueue(&self.raw, direction, &piece)? };
        self.raw
            .synchronize()
            .map_err(cuda_error("cuStreamSynchronize"))
    }
}
