//! Devices as the runtime sees them, memory and copy engines behind one
//! interface: [`CpuDevice`] (a budgeted host arena that stands in for
//! device memory, so everything runs without a GPU) and [`CudaDevice`] (an
//! arena on a GPU, over `strata_device::cuda::Context`; no CUDA type here).
//!
//! A device owns one arena of `budget` bytes, reserved at start; the
//! registry sub-allocates it. Copies between pinned host buffers and the
//! arena are queued on copy engines (threads on the CPU device, copy streams
//! on CUDA), one per direction, and never on the compute stream.

mod cpu;
mod cuda;

pub use cpu::CpuDevice;
pub use cuda::CudaDevice;

pub use strata_device::DeviceKind;
use strata_device::Fence;
use strata_storage::AlignedBuf;

use crate::config::{DeviceChoice, DeviceConfig};
use crate::error::{Result, RuntimeError};

/// Direction of a copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// Pinned host buffer to the device arena.
    ToDevice,
    /// Device arena to pinned host buffer.
    ToHost,
}

/// One contiguous copy between a host buffer and the arena.
#[derive(Clone, Copy, Debug)]
pub struct CopyPiece {
    /// Host address (a pinned pool buffer).
    pub host: *mut u8,
    /// Offset in the device arena.
    pub device_offset: u64,
    /// Bytes.
    pub len_bytes: usize,
}

// SAFETY: a CopyPiece is an address range handed to a copy engine; whoever
// submits it guarantees the memory stays valid until the copy is waited on
// (`Device::copy`'s contract).
unsafe impl Send for CopyPiece {}

/// How [`Device::alloc_host`] commits a new buffer's pages.
pub type Commit<'a> = dyn Fn(&mut [u8]) -> Result<()> + 'a;

/// Commits on the calling thread ([`Device::alloc_host`]'s `commit` where
/// no other threads will update the memory).
pub fn commit_here(bytes: &mut [u8]) -> Result<()> {
    Ok(strata_storage::commit_pages(bytes)?)
}

/// What the registry needs from a device.
pub trait Device: Send + Sync {
    /// CPU or CUDA.
    fn kind(&self) -> DeviceKind;

    /// One line for logs and reports ("cpu arena" or the GPU's name).
    fn describe(&self) -> String;

    /// Bytes of the arena (the device budget).
    fn capacity_bytes(&self) -> u64;

    /// Allocates page-locked host memory for the pinned pool, zeroed, with
    /// its pages committed by `commit` (given the whole buffer, before it
    /// is locked; [`crate::host_pool::commit_spread`] commits from the
    /// threads that will update it): page-locked through CUDA when a GPU
    /// is present (so copies are true DMA), mlock otherwise.
    fn alloc_host(&self, len_bytes: usize, commit: &Commit<'_>) -> Result<AlignedBuf>;

    /// Queues copies on the copy engine of `direction` and returns at once,
    /// with the fence that passes when they are done.
    /// Takes the list by value: the CPU device hands it to its copy thread.
    ///
    /// # Safety
    /// Every piece's host range must be valid (and, for `ToHost`, not
    /// accessed by anyone else) until the ticket has been waited on; device
    /// ranges must lie in the arena and not be written by anyone else until
    /// then.
    unsafe fn copy(&self, direction: Direction, pieces: Vec<CopyPiece>) -> Result<Fence>;

    /// Fills `len_bytes` of the arena at `device_offset` with the byte
    /// `value` (zeros for a new tensor registered on the device; 0xFF, a
    /// NaN in every float dtype, for a released range in the
    /// `runtime.poison_released` debug mode): on the CPU device before
    /// returning, on a GPU enqueued on the host->device copy stream, which
    /// every later upload or reader of the range is ordered after.
    fn fill(&self, device_offset: u64, len_bytes: u64, value: u8) -> Result<()>;

    /// Blocks until a batch of copies has finished.
    fn wait(&self, fence: Fence) -> Result<()> {
        Ok(fence.wait()?)
    }

    /// A host address for an arena offset when the arena is host memory (the
    /// CPU device); None on a GPU.
    fn host_address(&self, device_offset: u64) -> Option<*mut u8>;

    /// The device address of an arena offset (a CUdeviceptr on CUDA).
    fn device_address(&self, device_offset: u64) -> u64;

    /// The raw path the runtime is measured against: one synchronous copy of
    /// `len_bytes` in the calling thread (memcpy), or one cudaMemcpyAsync
    /// from pinned memory followed by a stream synchronize.
    ///
    /// # Safety
    /// As [`Device::copy`], for the duration of the call.
    unsafe fn raw_copy(
        &self,
        direction: Direction,
        host: *mut u8,
        device_offset: u64,
        len_bytes: usize,
    ) -> Result<()>;
}

/// Opens the device the config asks for. `Auto` takes CUDA when it can be
/// used and says why not (at info level) when it falls back to the CPU.
pub fn open(config: &DeviceConfig) -> Result<Box<dyn Device>> {
    match config.kind {
        DeviceChoice::Cpu => Ok(Box::new(CpuDevice::new(config.budget.0)?)),
        DeviceChoice::Cuda => Ok(Box::new(CudaDevice::new(config.ordinal, config.budget.0)?)),
        DeviceChoice::Auto => match CudaDevice::new(config.ordinal, config.budget.0) {
            Ok(device) => Ok(Box::new(device)),
            Err(RuntimeError::Device(strata_device::DeviceError::CudaUnavailable { reason })) => {
                tracing::info!("device: cpu, because {reason}");
                Ok(Box::new(CpuDevice::new(config.budget.0)?))
            }
            Err(err) => Err(err),
        },
    }
}

/// Whether a CUDA device can be used here, and why not. Tests that need a
/// GPU print the reason and skip.
pub fn cuda_available() -> std::result::Result<(), String> {
    strata_device::cuda::probe_device()
}
