//! The CPU device: a budgeted host arena that stands in for device memory,
//! with one copy thread per direction standing in for the DMA engines, so
//! copies run beside compute exactly as they would on a GPU.

use std::sync::Arc;
use std::sync::mpsc::{SyncSender, sync_channel};
use std::thread::JoinHandle;

use strata_storage::{AlignedBuf, PAGE_BYTES};

use strata_device::{DeviceError, Fence, HostSignal};

use super::{Commit, CopyPiece, Device, DeviceKind, Direction};
use crate::error::Result;

/// Copy jobs queued per direction before `copy` blocks.
const JOBS_QUEUED_MAX: usize = 256;

struct Job {
    direction: Direction,
    pieces: Vec<CopyPiece>,
    done: Arc<HostSignal>,
}

/// The arena's base address, shared with the copy threads.
#[derive(Clone, Copy)]
struct Base(*mut u8);

// SAFETY: the arena outlives the copy threads (they are joined in Drop before
// the arena is freed), and each copy touches only ranges its submitter owns.
unsafe impl Send for Base {}

/// A host arena of `budget` bytes and two copy engines.
pub struct CpuDevice {
    // Field order is drop order: engines stop before the arena is freed.
    engines: Engines,
    arena: AlignedBuf,
}

struct Engines {
    senders: Vec<SyncSender<Job>>,
    threads: Vec<JoinHandle<()>>,
}

impl Drop for Engines {
    fn drop(&mut self) {
        self.senders.clear();
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

impl CpuDevice {
    /// Reserves the arena (touching every page, so no copy pays a page
    /// fault) and starts the copy threads.
    pub fn new(budget_bytes: u64) -> Result<Self> {
        let mut arena = AlignedBuf::new(budget_bytes as usize, PAGE_BYTES)?;
        for page in arena.chunks_mut(PAGE_BYTES) {
            page[0] = 0;
        }
        let base = Base(arena.as_mut_ptr());
        let mut senders = Vec::with_capacity(2);
        let mut threads = Vec::with_capacity(2);
        for name in ["strata-h2d", "strata-d2h"] {
            let (sender, receiver) = sync_channel::<Job>(JOBS_QUEUED_MAX);
            let thread = std::thread::Builder::new()
                .name(name.into())
                .spawn(move || {
                    let base = base;
                    for job in receiver {
                        run_job(base.0, &job);
                        job.done.finish();
                    }
                })
                .map_err(|err| DeviceError::Thread {
                    thread: name,
                    cause: err.to_string(),
                })?;
            senders.push(sender);
            threads.push(thread);
        }
        Ok(Self {
            engines: Engines { senders, threads },
            arena,
        })
    }
}

fn run_job(base: *mut u8, job: &Job) {
    run_pieces(base, job.direction, &job.pieces);
}

fn run_pieces(base: *mut u8, direction: Direction, pieces: &[CopyPiece]) {
    for piece in pieces {
        // `Device::copy`'s contract: neither range is touched by anyone else
        // until the job's ticket is waited on.
        // SAFETY: the host range is valid and the arena range is in the arena.
        unsafe {
            let device = base.add(piece.device_offset as usize);
            match direction {
                Direction::ToDevice => {
                    std::ptr::copy_nonoverlapping(piece.host, device, piece.len_bytes)
                }
                Direction::ToHost => {
                    std::ptr::copy_nonoverlapping(device, piece.host, piece.len_bytes)
                }
            }
        }
    }
}

impl CpuDevice {
    fn check_range(&self, device_offset: u64, len_bytes: usize) {
        assert!(
            device_offset + len_bytes as u64 <= self.arena.len() as u64,
            "copy of {len_bytes} bytes at arena offset {device_offset} leaves the {}-byte arena",
            self.arena.len()
        );
    }
}

impl Device for CpuDevice {
    fn kind(&self) -> DeviceKind {
        DeviceKind::Cpu
    }

    fn describe(&self) -> String {
        format!("cpu device ({} bytes of host memory)", self.arena.len())
    }

    fn capacity_bytes(&self) -> u64 {
        self.arena.len() as u64
    }

    fn alloc_host(&self, len_bytes: usize, commit: &Commit<'_>) -> Result<AlignedBuf> {
        let mut buffer = AlignedBuf::new_uncommitted(len_bytes, PAGE_BYTES)?;
        commit(&mut buffer)?;
        buffer.try_lock();
        Ok(buffer)
    }

    unsafe fn copy(&self, direction: Direction, pieces: Vec<CopyPiece>) -> Result<Fence> {
        for piece in &pieces {
            self.check_range(piece.device_offset, piece.len_bytes);
        }
        let (fence, done) = Fence::host();
        let (engine, thread) = match direction {
            Direction::ToDevice => (0, "strata-h2d"),
            Direction::ToHost => (1, "strata-d2h"),
        };
        let job = Job {
            direction,
            pieces,
            done,
        };
        self.engines.senders[engine]
            .send(job)
            .map_err(|_| DeviceError::Thread {
                thread,
                cause: "the copy thread has stopped".into(),
            })?;
        Ok(fence)
    }

    fn fill(&self, device_offset: u64, len_bytes: u64, value: u8) -> Result<()> {
        self.check_range(device_offset, len_bytes as usize);
        let start = self
            .arena
            .as_ptr()
            .wrapping_add(device_offset as usize)
            .cast_mut();
        // SAFETY: the range is in the arena, owned by the copy being registered (or released, with its last use passed).
        unsafe { std::ptr::write_bytes(start, value, len_bytes as usize) };
        Ok(())
    }

    fn host_address(&self, device_offset: u64) -> Option<*mut u8> {
        assert!(device_offset <= self.arena.len() as u64);
        Some(
            self.arena
                .as_ptr()
                .wrapping_add(device_offset as usize)
                .cast_mut(),
        )
    }

    fn device_address(&self, device_offset: u64) -> u64 {
        self.arena.as_ptr() as u64 + device_offset
    }

    unsafe fn raw_copy(
        &self,
        direction: Direction,
        host: *mut u8,
        device_offset: u64,
        len_bytes: usize,
    ) -> Result<()> {
        self.check_range(device_offset, len_bytes);
        let piece = CopyPiece {
            host,
            device_offset,
            len_bytes,
        };
        run_pieces(self.arena.as_ptr().cast_mut(), direction, &[piece]);
        Ok(())
    }
}
