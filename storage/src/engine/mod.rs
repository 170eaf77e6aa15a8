//! Raw I/O engines: they only submit requests and reap results. Retrying short
//! transfers and EAGAIN, and turning errno into typed errors, happens once, in
//! [`crate::IoQueue`], for every engine alike.

mod fault;
mod threads;
mod uring;

pub use fault::{FaultCounts, FaultEngine, FaultRates, SplitMix64};
pub use threads::ThreadEngine;
pub use uring::UringEngine;

use std::io;
use std::os::fd::RawFd;

use crate::error::Op;

/// Which engine moves the bytes.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum EngineKind {
    /// Linux io_uring.
    Uring,
    /// A pool of threads calling pread/pwrite.
    Threads,
}

impl std::fmt::Display for EngineKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            EngineKind::Uring => "uring",
            EngineKind::Threads => "threads",
        })
    }
}

/// One transfer handed to an engine. `len` fits a u32 because the kernel caps
/// a single read/write below 2 GiB.
#[derive(Clone, Copy, Debug)]
pub struct RawRequest {
    /// Direction.
    pub op: Op,
    /// Index into the engine's file table.
    pub file: u32,
    /// Byte offset in the file.
    pub offset: u64,
    /// Host memory to read into or write from.
    pub ptr: *mut u8,
    /// Bytes to move.
    pub len: u32,
    /// Index of a registered buffer containing `ptr..ptr+len`, if any.
    pub buf_index: Option<u16>,
    /// Returned unchanged in the completion.
    pub tag: u64,
}

/// The kernel's answer to one [`RawRequest`]: bytes moved, or a negated errno.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RawCompletion {
    /// The request's tag.
    pub tag: u64,
    /// Bytes moved (`>= 0`) or `-errno`.
    pub result: i32,
}

/// A submission/completion engine over a fixed table of files.
pub trait RawEngine: Send {
    /// What kind of engine this is.
    fn kind(&self) -> EngineKind;

    /// Most requests that may be in flight at once.
    fn depth_max(&self) -> usize;

    /// Queues one request; it reaches the kernel at the next
    /// [`RawEngine::submit_and_wait`]. The caller keeps in-flight requests at
    /// or below [`RawEngine::depth_max`].
    ///
    /// # Safety
    /// `req.ptr..req.ptr+req.len` must stay valid (writable for reads) and
    /// untouched by anyone else until this request's completion is returned,
    /// and `req.file` must index the engine's file table.
    unsafe fn push(&mut self, req: RawRequest);

    /// Submits everything pushed, then waits until at least `min` completions
    /// are available and appends all available ones to `out`.
    fn submit_and_wait(&mut self, min: usize, out: &mut Vec<RawCompletion>) -> io::Result<()>;

    /// Registers host memory regions for fixed-buffer transfers. Returns
    /// whether the engine will use them.
    ///
    /// # Safety
    /// Each region must stay valid for as long as the engine lives.
    unsafe fn register_buffers(&mut self, _regions: &[(*mut u8, usize)]) -> bool {
        false
    }

    /// Replaces the file table (for engines that serve one file after
    /// another, as [`crate::IoHandle`]'s do). Only while nothing is in
    /// flight; the descriptors must stay open while requests use them.
    fn set_files(&mut self, fds: &[RawFd]) -> io::Result<()>;
}

impl RawEngine for Box<dyn RawEngine> {
    fn kind(&self) -> EngineKind {
        (**self).kind()
    }
    fn depth_max(&self) -> usize {
        (**self).depth_max()
    }
    unsafe fn push(&mut self, req: RawRequest) {
        // SAFETY: forwarded from our caller.
        unsafe { (**self).push(req) }
    }
    fn submit_and_wait(&mut self, min: usize, out: &mut Vec<RawCompletion>) -> io::Result<()> {
        (**self).submit_and_wait(min, out)
    }
    unsafe fn register_buffers(&mut self, regions: &[(*mut u8, usize)]) -> bool {
        // SAFETY: forwarded from our caller.
        unsafe { (**self).register_buffers(regions) }
    }
    fn set_files(&mut self, fds: &[RawFd]) -> io::Result<()> {
        (**self).set_files(fds)
    }
}

/// Whether io_uring can run here, and if not, why not.
pub fn probe_uring() -> Result<(), String> {
    if let Ok(text) = std::fs::read_to_string("/proc/sys/kernel/io_uring_disabled")
        && text.trim() == "2"
    {
        return Err("the sysctl kernel.io_uring_disabled is 2 (disabled for everyone)".into());
    }
    let ring = io_uring::IoUring::new(4).map_err(|err| match err.raw_os_error() {
        Some(libc::ENOSYS) => "the kernel has no io_uring (older than 5.1)".to_string(),
        Some(libc::EPERM) => format!(
            "io_uring_setup was refused ({err}): a seccomp filter (containers) or kernel.io_uring_disabled blocks it"
        ),
        _ => format!("io_uring_setup failed: {err}"),
    })?;
    let mut probe = io_uring::Probe::new();
    ring.submitter()
        .register_probe(&mut probe)
        .map_err(|err| format!("io_uring probe failed ({err}): the kernel is older than 5.6"))?;
    for (code, name) in [
        (io_uring::opcode::Read::CODE, "READ"),
        (io_uring::opcode::Write::CODE, "WRITE"),
    ] {
        if !probe.is_supported(code) {
            return Err(format!(
                "the kernel's io_uring lacks {name} (kernel older than 5.6)"
            ));
        }
    }
    Ok(())
}

/// Builds an engine of `kind` over `fds` with room for `depth` requests.
pub fn build(kind: EngineKind, fds: &[RawFd], depth: usize) -> io::Result<Box<dyn RawEngine>> {
    Ok(match kind {
        EngineKind::Uring => Box::new(UringEngine::new(fds, depth)?),
        EngineKind::Threads => Box::new(ThreadEngine::new(fds, depth)?),
    })
}
