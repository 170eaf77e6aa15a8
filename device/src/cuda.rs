//! The CUDA context of one GPU, over cudarc's driver API loaded at run time
//! (building needs no CUDA). This module and its siblings are the only
//! place in the workspace (with the CUDA halves of `kernels` and `comm`)
//! that names a CUDA type: the runtime sees [`Context`], device addresses
//! as `u64`, and [`Fence`]s.
//!
//! One [`Context`] per device owns the compute stream and the two copy
//! streams (and later NCCL's communicators); whoever holds the `Arc`
//! shares them.

use std::ffi::c_void;
use std::ptr::NonNull;
use std::sync::Arc;

use cudarc::driver::safe::{CudaContext, CudaStream};
use cudarc::driver::{result, sys};

use crate::error::{DeviceError, Result};
use crate::fence::{Event, Fence, StreamKind, Watch};

/// A CUDA library strata loads at run time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Library {
    /// The driver (libcuda): devices, memory, streams.
    Driver,
    /// NVRTC: compiling the CUDA C kernels.
    Nvrtc,
    /// cuBLASLt: GEMMs on tensor cores.
    CublasLt,
    /// NCCL: collectives between GPUs.
    Nccl,
}

impl Library {
    /// Every library, in the order they are needed.
    pub const ALL: [Library; 4] = [
        Library::Driver,
        Library::Nvrtc,
        Library::CublasLt,
        Library::Nccl,
    ];

    /// The short name the loader looks for (`lib<name>.so...`).
    pub fn name(self) -> &'static str {
        match self {
            Library::Driver => "cuda",
            Library::Nvrtc => "nvrtc",
            Library::CublasLt => "cublasLt",
            Library::Nccl => "nccl",
        }
    }

    fn purpose(self) -> &'static str {
        match self {
            Library::Driver => "the CUDA driver",
            Library::Nvrtc => "compiling CUDA kernels",
            Library::CublasLt => "matrix products on the GPU",
            Library::Nccl => "collectives between GPUs",
        }
    }
}

/// Whether `library` can be loaded. cudarc panics at the first call into
/// a library it cannot find; strata probes first and reports a typed error.
pub fn probe_library(library: Library) -> Result<()> {
    // SAFETY: each only tries to open the library; no symbol is called.
    let present = unsafe {
        match library {
            Library::Driver => sys::is_culib_present(),
            Library::Nvrtc => cudarc::nvrtc::sys::is_culib_present(),
            Library::CublasLt => cudarc::cublaslt::sys::is_culib_present(),
            Library::Nccl => cudarc::nccl::sys::is_culib_present(),
        }
    };
    if present {
        return Ok(());
    }
    Err(DeviceError::LibraryMissing {
        library: library.name(),
        purpose: library.purpose(),
        candidates: cudarc::get_lib_name_candidates(library.name()).join(", "),
    })
}

/// Whether a CUDA device can be used here, and why not. Tests that need a
/// GPU print the reason and skip.
pub fn probe_device() -> std::result::Result<(), String> {
    probe_library(Library::Driver).map_err(|err| err.to_string())?;
    result::init().map_err(|err| format!("cuInit failed: {err:?}"))?;
    match result::device::get_count() {
        Ok(0) => Err("the CUDA driver reports no device".into()),
        Ok(_) => Ok(()),
        Err(err) => Err(format!("cuDeviceGetCount failed: {err:?}")),
    }
}

/// Total memory of device `ordinal`, in bytes, as the driver counts it;
/// or why it cannot be read (no driver, no such device).
pub fn device_total_bytes(ordinal: usize) -> std::result::Result<u64, String> {
    probe_device()?;
    let index = std::ffi::c_int::try_from(ordinal)
        .map_err(|_| format!("device ordinal {ordinal} is out of range"))?;
    let device = result::device::get(index)
        .map_err(|err| format!("cuDeviceGet({ordinal}) failed: {err:?}"))?;
    // cuInit ran (in probe_device); cuDeviceTotalMem only reads the handle.
    // SAFETY: `device` is a handle the driver returned just now.
    let bytes = unsafe { result::device::total_mem(device) }
        .map_err(|err| format!("cuDeviceTotalMem({ordinal}) failed: {err:?}"))?;
    Ok(bytes as u64)
}

fn cuda_error(op: &'static str) -> impl Fn(result::DriverError) -> DeviceError {
    move |err| DeviceError::Cuda {
        op,
        cause: format!("{err:?}"),
    }
}

/// Page-locked host memory from the driver, released when dropped.
pub struct PinnedHost {
    pointer: NonNull<u8>,
    len_bytes: usize,
    context: Arc<CudaContext>,
}

impl PinnedHost {
    /// Its first byte.
    pub fn pointer(&self) -> NonNull<u8> {
        self.pointer
    }

    /// Its length.
    pub fn len_bytes(&self) -> usize {
        self.len_bytes
    }
}

impl Drop for PinnedHost {
    fn drop(&mut self) {
        let _ = self.context.bind_to_thread();
        // SAFETY: from cuMemHostAlloc in `Context::alloc_pinned`; released once, here.
        if let Err(err) = unsafe { result::free_host(self.pointer.as_ptr().cast()) } {
            tracing::warn!("freeing pinned host memory failed: {err:?}");
        }
    }
}

// SAFETY: plain host memory owned by this value.
unsafe impl Send for PinnedHost {}
// SAFETY: shared access hands out only the address and length.
unsafe impl Sync for PinnedHost {}

/// Host memory allocated elsewhere and page-locked by the driver
/// (`cuMemHostRegister`), unregistered when dropped; the memory itself
/// stays its owner's.
pub struct RegisteredHost {
    pointer: NonNull<u8>,
    context: Arc<CudaContext>,
}

impl Drop for RegisteredHost {
    fn drop(&mut self) {
        let _ = self.context.bind_to_thread();
        // SAFETY: registered in `Context::register_host`; unregistered once, here.
        if let Err(err) = unsafe { sys::cuMemHostUnregister(self.pointer.as_ptr().cast()) }.result()
        {
            tracing::warn!("unregistering pinned host memory failed: {err:?}");
        }
    }
}

// SAFETY: holds only an address to unregister, and the context.
unsafe impl Send for RegisteredHost {}
// SAFETY: no access through shared references.
unsafe impl Sync for RegisteredHost {}

/// One GPU: its context, its compute stream, its two copy streams, the
/// stream collectives run on, and a stream for the raw baseline copies
/// benches compare with.
pub struct Context {
    context: Arc<CudaContext>,
    compute: Arc<CudaStream>,
    to_device: Arc<CudaStream>,
    to_host: Arc<CudaStream>,
    collective: Arc<CudaStream>,
    raw: Arc<CudaStream>,
    ordinal: usize,
    name: String,
}

impl Context {
    /// Opens device `ordinal`. cudarc loads the driver's symbols here, at
    /// first use, and panics on one it cannot find (an older driver than
    /// it was built for): the library is probed first, and a panic that
    /// still comes is caught and returned as an error.
    pub fn open(ordinal: usize) -> Result<Arc<Context>> {
        probe_device().map_err(|reason| DeviceError::CudaUnavailable { reason })?;
        std::panic::catch_unwind(|| Self::open_probed(ordinal)).unwrap_or_else(|panic| {
            let cause = panic
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| panic.downcast_ref::<&str>().copied())
                .unwrap_or("a panic without a message");
            Err(DeviceError::Cuda {
                op: "opening the device (cudarc panicked: the driver may be older than CUDA 12)",
                cause: cause.to_string(),
            })
        })
    }

    fn open_probed(ordinal: usize) -> Result<Arc<Context>> {
        let count = result::device::get_count().map_err(cuda_error("cuDeviceGetCount"))?;
        if ordinal >= count as usize {
            return Err(DeviceError::CudaUnavailable {
                reason: format!(
                    "device ordinal {ordinal} asked for, but only {count} device(s) exist"
                ),
            });
        }
        let context = CudaContext::new(ordinal).map_err(cuda_error("context creation"))?;
        let stream = || context.new_stream().map_err(cuda_error("cuStreamCreate"));
        let (compute, to_device, to_host) = (stream()?, stream()?, stream()?);
        let (collective, raw) = (stream()?, stream()?);
        let name = context.name().unwrap_or_else(|_| "CUDA device".into());
        Ok(Arc::new(Context {
            context,
            compute,
            to_device,
            to_host,
            collective,
            raw,
            ordinal,
            name,
        }))
    }

    /// The GPU's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its ordinal.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// Makes the context current on the calling thread.
    pub fn bind(&self) -> Result<()> {
        self.context
            .bind_to_thread()
            .map_err(cuda_error("cuCtxSetCurrent"))
    }

    /// Free device memory, in bytes.
    pub fn free_bytes(&self) -> Result<u64> {
        let (free, _total) = self
            .context
            .mem_get_info()
            .map_err(cuda_error("cuMemGetInfo"))?;
        Ok(free as u64)
    }

    /// Allocates `len_bytes` of device memory; the address is freed with
    /// [`Context::free`].
    pub fn malloc(&self, len_bytes: u64) -> Result<u64> {
        self.bind()?;
        // SAFETY: a plain allocation in the bound context.
        unsafe { result::malloc_sync(len_bytes as usize) }.map_err(cuda_error("cuMemAlloc"))
    }

    /// Frees an allocation of [`Context::malloc`] after all work on it.
    ///
    /// # Safety
    /// `address` came from `malloc` on this context, is freed once, and no
    /// enqueued work still uses it.
    pub unsafe fn free(&self, address: u64) -> Result<()> {
        self.bind()?;
        // SAFETY: the caller's contract.
        unsafe { result::free_sync(address) }.map_err(cuda_error("cuMemFree"))
    }

    /// Page-locked, zeroed, page-aligned host memory, so copies are DMA.
    pub fn alloc_pinned(&self, len_bytes: usize, align_bytes: usize) -> Result<PinnedHost> {
        self.bind()?;
        // SAFETY: a plain pinned allocation; zeroed below before any read.
        let raw = unsafe { result::malloc_host(len_bytes, sys::CU_MEMHOSTALLOC_PORTABLE) }
            .map_err(cuda_error("cuMemHostAlloc"))?;
        let pointer = NonNull::new(raw.cast::<u8>()).ok_or(DeviceError::Cuda {
            op: "cuMemHostAlloc",
            cause: "returned null".into(),
        })?;
        let pinned = PinnedHost {
            pointer,
            len_bytes,
            context: self.context.clone(),
        };
        if !(pointer.as_ptr() as usize).is_multiple_of(align_bytes) {
            return Err(DeviceError::Cuda {
                op: "cuMemHostAlloc",
                cause: format!("returned memory not aligned to {align_bytes} bytes"),
            });
        }
        // SAFETY: `len_bytes` at `pointer` are ours, writable, not shared.
        unsafe { std::ptr::write_bytes(pointer.as_ptr(), 0, len_bytes) };
        Ok(pinned)
    }

    /// Page-locks `len_bytes` of host memory at `pointer` for DMA from
    /// every context (`cuMemHostRegister`, portable), where it already is:
    /// its pages keep the NUMA nodes they were committed on, unlike
    /// [`Context::alloc_pinned`]'s, which the driver places.
    ///
    /// # Safety
    /// The range is valid host memory, page-aligned, and stays mapped until
    /// the returned value is dropped.
    pub unsafe fn register_host(
        &self,
        pointer: NonNull<u8>,
        len_bytes: usize,
    ) -> Result<RegisteredHost> {
        self.bind()?;
        // SAFETY: the caller's contract.
        unsafe {
            sys::cuMemHostRegister_v2(
                pointer.as_ptr().cast(),
                len_bytes,
                sys::CU_MEMHOSTREGISTER_PORTABLE,
            )
        }
        .result()
        .map_err(cuda_error("cuMemHostRegister"))?;
        Ok(RegisteredHost {
            pointer,
            context: self.context.clone(),
        })
    }

    /// The cudarc context (for the CUDA halves of `kernels` and `comm`:
    /// modules, launches, library handles).
    pub fn cuda(&self) -> &Arc<CudaContext> {
        &self.context
    }

    /// The compute stream kernels are launched on.
    pub fn compute_stream(&self) -> &Arc<CudaStream> {
        &self.compute
    }

    /// Enqueues a device-to-device copy on the compute stream (ordered with
    /// the kernels around it).
    ///
    /// # Safety
    /// Both ranges are allocated in this context and do not overlap; `to`
    /// is not used by others until a fence recorded after it has passed.
    pub unsafe fn copy_on_compute(&self, from: u64, to: u64, len_bytes: usize) -> Result<()> {
        self.bind()?;
        // SAFETY: the caller's contract; the context is bound.
        unsafe { sys::cuMemcpyDtoDAsync_v2(to, from, len_bytes, self.compute.cu_stream()) }
            .result()
            .map_err(cuda_error("cuMemcpyDtoDAsync"))
    }

    /// Enqueues a small host-to-device copy on the compute stream (a
    /// step's token ids, ordered before the kernels that read them).
    ///
    /// # Safety
    /// `host` is page-locked and holds `len_bytes`, unchanged until a fence
    /// recorded after this has passed; the device range is allocated and
    /// not used by others until then.
    pub unsafe fn write_on_compute(
        &self,
        host: *const u8,
        to: u64,
        len_bytes: usize,
    ) -> Result<()> {
        self.bind()?;
        // SAFETY: the caller's contract; the context is bound.
        unsafe { sys::cuMemcpyHtoDAsync_v2(to, host.cast(), len_bytes, self.compute.cu_stream()) }
            .result()
            .map_err(cuda_error("cuMemcpyHtoDAsync"))
    }

    /// Enqueues a small device-to-host copy on the compute stream (a
    /// scalar read back after the kernel that wrote it).
    ///
    /// # Safety
    /// `host` is page-locked and holds `len_bytes`, untouched until a
    /// fence recorded after this has passed; the device range is allocated.
    pub unsafe fn read_on_compute(&self, from: u64, host: *mut u8, len_bytes: usize) -> Result<()> {
        self.bind()?;
        // SAFETY: the caller's contract; the context is bound.
        unsafe { sys::cuMemcpyDtoHAsync_v2(host.cast(), from, len_bytes, self.compute.cu_stream()) }
            .result()
            .map_err(cuda_error("cuMemcpyDtoHAsync"))
    }

    fn stream(&self, kind: StreamKind) -> &CudaStream {
        match kind {
            StreamKind::Compute => &self.compute,
            StreamKind::CopyToDevice => &self.to_device,
            StreamKind::CopyToHost => &self.to_host,
            StreamKind::Collective => &self.collective,
        }
    }

    /// `stream`'s handle, for a library that enqueues on it (NCCL).
    pub fn raw_stream(&self, stream: StreamKind) -> sys::CUstream {
        self.stream(stream).cu_stream()
    }

    /// Enqueues one copy between host memory and device memory on copy
    /// stream `stream` (direction by the stream) and returns at once.
    ///
    /// # Safety
    /// The host range is valid (page-locked for a true asynchronous copy)
    /// and the device range allocated; neither is touched by others until
    /// a fence recorded after it has passed.
    pub unsafe fn copy_async(
        &self,
        stream: StreamKind,
        host: *mut u8,
        device: u64,
        len_bytes: usize,
    ) -> Result<()> {
        // SAFETY: forwarded.
        unsafe { self.copy_on(self.stream(stream), stream, host, device, len_bytes) }
    }

    /// # Safety
    /// As [`Context::copy_async`].
    unsafe fn copy_on(
        &self,
        on: &CudaStream,
        direction: StreamKind,
        host: *mut u8,
        device: u64,
        len_bytes: usize,
    ) -> Result<()> {
        self.bind()?;
        let code = match direction {
            // SAFETY: the caller's contract; the context is bound.
            StreamKind::CopyToDevice => unsafe {
                sys::cuMemcpyHtoDAsync_v2(device, host as *const c_void, len_bytes, on.cu_stream())
            },
            // SAFETY: as above.
            StreamKind::CopyToHost => unsafe {
                sys::cuMemcpyDtoHAsync_v2(host as *mut c_void, device, len_bytes, on.cu_stream())
            },
            StreamKind::Compute | StreamKind::Collective => panic!("copies go on a copy stream"),
        };
        code.result().map_err(cuda_error("cuMemcpyAsync"))
    }

    /// Enqueues setting `len_bytes` at `device` to the byte `value` on
    /// `stream`.
    ///
    /// # Safety
    /// The range is allocated and not used by others until a fence
    /// recorded after it has passed.
    pub unsafe fn fill_async(
        &self,
        stream: StreamKind,
        device: u64,
        len_bytes: usize,
        value: u8,
    ) -> Result<()> {
        self.bind()?;
        // SAFETY: the caller's contract.
        unsafe {
            result::memset_d8_async(device, value, len_bytes, self.stream(stream).cu_stream())
        }
        .map_err(cuda_error("cuMemsetD8Async"))
    }

    /// A fence after the work enqueued so far on `stream`.
    pub fn record(&self, stream: StreamKind) -> Result<Fence> {
        self.record_with(stream, None)
    }

    /// A fence after the work enqueued so far on `stream` whose waiters
    /// poll it, checking `watch` between polls (a collective that can hang
    /// on a peer): never a blocking event wait.
    pub fn record_watched(&self, stream: StreamKind, watch: Arc<dyn Watch>) -> Result<Fence> {
        self.record_with(stream, Some(watch))
    }

    fn record_with(&self, stream: StreamKind, watch: Option<Arc<dyn Watch>>) -> Result<Fence> {
        let event = self
            .stream(stream)
            .record_event(None)
            .map_err(cuda_error("cuEventRecord"))?;
        Ok(Fence::Cuda(Arc::new(Event {
            event,
            stream,
            watch,
        })))
    }

    /// Makes `stream` wait (on the device, not the host) for `fence`.
    pub fn wait_on(&self, stream: StreamKind, fence: &Fence) -> Result<()> {
        match fence {
            Fence::Cuda(event) => self
                .stream(stream)
                .wait(&event.event)
                .map_err(cuda_error("cuStreamWaitEvent")),
            other => other.wait(),
        }
    }

    /// The raw path benches measure the runtime against: one copy on a
    /// stream of its own, then a synchronize of that stream.
    ///
    /// # Safety
    /// As [`Context::copy_async`], for the duration of the call.
    pub unsafe fn raw_copy(
        &self,
        direction: StreamKind,
        host: *mut u8,
        device: u64,
        len_bytes: usize,
    ) -> Result<()> {
        // SAFETY: forwarded; synchronized before returning.
        unsafe { self.copy_on(&self.raw, direction, host, device, len_bytes)? };
        self.raw
            .synchronize()
            .map_err(cuda_error("cuStreamSynchronize"))
    }

    /// Waits for all work of the context (teardown only, never per step).
    pub fn synchronize(&self) -> Result<()> {
        self.context
            .synchronize()
            .map_err(cuda_error("cuCtxSynchronize"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_library_is_a_typed_error_naming_the_files_tried() {
        for library in Library::ALL {
            match probe_library(library) {
                Ok(()) => println!("{} is present here", library.name()),
                Err(DeviceError::LibraryMissing {
                    library: name,
                    candidates,
                    ..
                }) => {
                    assert_eq!(name, library.name());
                    assert!(
                        candidates.contains(&format!("lib{name}.so")),
                        "{candidates}"
                    );
                }
                Err(other) => panic!("unexpected {other}"),
            }
        }
    }
}
