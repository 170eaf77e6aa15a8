//! [`IoHandle`]: DeepNVMe's verbs - read or write a whole buffer at
//! (path, offset) - on worker threads, each with its own ring.
//!
//! An operation opens its file, splits the direct-I/O-aligned body into one
//! contiguous part per worker and moves each part in `block_bytes` pieces
//! with up to `queue_depth` in flight per worker. A tail shorter than the
//! file's alignment, and a whole operation at an unaligned file offset, go
//! through a buffered descriptor (so a write never extends the file past
//! what was asked). A caller's buffer that is not aligned for direct I/O is
//! staged through the worker's aligned bounce blocks, allocated on first
//! need; aligned buffers are read into and written from in place.
//!
//! Workers are started lazily and re-created after `fork` (threads do not
//! survive it): a child's first operation starts its own.

use std::fs::{File, OpenOptions};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use crate::buffer::{AlignedBuf, PAGE_BYTES};
use crate::engine::{EngineKind, RawEngine, ThreadEngine, UringEngine};
use crate::error::{Op, Result, StorageError};
use crate::queue::{Completion, IoQueue, RETRIES_MAX_DEFAULT, Request};

/// Most worker threads one handle may run.
pub const HANDLE_THREADS_MAX: usize = 64;
/// Largest block one request moves (the kernel caps a transfer below 2 GiB).
pub const HANDLE_BLOCK_BYTES_MAX: usize = 256 << 20;
/// Most requests in flight per worker.
pub const HANDLE_QUEUE_DEPTH_MAX: usize = 1024;
/// Most operations started and not yet waited for.
pub const HANDLE_PENDING_MAX: usize = 1 << 16;

/// How an [`IoHandle`] moves bytes: DeepNVMe's `aio_handle` settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HandleConfig {
    /// Bytes per request (a multiple of 4096).
    pub block_bytes: usize,
    /// Requests in flight per worker.
    pub queue_depth: usize,
    /// Workers an operation is split over (DeepNVMe's `intra_op_parallelism`).
    pub threads: usize,
    /// The engine every worker runs.
    pub engine: EngineKind,
}

impl Default for HandleConfig {
    fn default() -> Self {
        Self {
            block_bytes: 1 << 20,
            queue_depth: 32,
            threads: 1,
            engine: EngineKind::Uring,
        }
    }
}

impl HandleConfig {
    /// Checks every setting against its limit.
    pub fn validate(&self) -> Result<()> {
        let bad = |key: &'static str, value: usize, fix: String| {
            Err(StorageError::Config {
                key,
                value: value.to_string(),
                fix,
            })
        };
        if self.block_bytes == 0
            || self.block_bytes > HANDLE_BLOCK_BYTES_MAX
            || !self.block_bytes.is_multiple_of(PAGE_BYTES)
        {
            return bad(
                "block_size",
                self.block_bytes,
                format!("use a multiple of {PAGE_BYTES} bytes up to {HANDLE_BLOCK_BYTES_MAX}"),
            );
        }
        if self.queue_depth == 0 || self.queue_depth > HANDLE_QUEUE_DEPTH_MAX {
            return bad(
                "queue_depth",
                self.queue_depth,
                format!("use 1 to {HANDLE_QUEUE_DEPTH_MAX}"),
            );
        }
        if self.threads == 0 || self.threads > HANDLE_THREADS_MAX {
            return bad(
                "threads",
                self.threads,
                format!("use 1 to {HANDLE_THREADS_MAX}"),
            );
        }
        Ok(())
    }
}

/// The files of one operation: a direct descriptor when the filesystem
/// takes O_DIRECT, and a buffered one for tails and unaligned offsets.
struct OpFiles {
    direct: Option<File>,
    buffered: File,
    path: PathBuf,
}

/// Where an operation's outcome gathers: parts left, and the first error.
struct OpState {
    progress: Mutex<(usize, Option<StorageError>)>,
    done: Condvar,
}

impl OpState {
    fn part_done(&self, result: Result<()>) {
        let mut progress = self.progress.lock().unwrap_or_else(|p| p.into_inner());
        progress.0 -= 1;
        if let Err(err) = result
            && progress.1.is_none()
        {
            progress.1 = Some(err);
        }
        if progress.0 == 0 {
            self.done.notify_all();
        }
    }

    fn wait(&self) -> Result<()> {
        let mut progress = self.progress.lock().unwrap_or_else(|p| p.into_inner());
        while progress.0 > 0 {
            progress = self.done.wait(progress).unwrap_or_else(|p| p.into_inner());
        }
        match progress.1.take() {
            None => Ok(()),
            Some(err) => Err(err),
        }
    }
}

/// One worker's share of an operation: bytes `from..to` of the caller's
/// buffer, of which `body_end..to` go through the buffered descriptor.
struct Part {
    op: Op,
    files: Arc<OpFiles>,
    base: *mut u8,
    file_offset: u64,
    from: usize,
    body_end: usize,
    to: usize,
    bounce: bool,
    state: Arc<OpState>,
}

// SAFETY: `base` is only dereferenced by the one worker that receives the
// part, inside the range the part names, under `IoHandle::start`'s contract
// (the memory stays valid and untouched until the operation is waited for).
unsafe impl Send for Part {}

struct Worker {
    parts: Sender<Part>,
    thread: JoinHandle<()>,
}

/// Asynchronous whole-buffer reads and writes at (path, offset).
///
/// ```no_run
/// use strata_storage::{HandleConfig, IoHandle, Op};
/// let mut handle = IoHandle::new(HandleConfig::default())?;
/// let mut data = vec![7u8; 1 << 20];
/// // SAFETY: `data` is neither moved nor touched until `wait` returns.
/// unsafe { handle.start(Op::Write, data.as_mut_ptr(), data.len(), "/nvme/t.bin".as_ref(), 0)? };
/// assert_eq!(handle.wait()?, 1);
/// # Ok::<(), strata_storage::StorageError>(())
/// ```
pub struct IoHandle {
    config: HandleConfig,
    workers: Vec<Worker>,
    pending: Vec<Arc<OpState>>,
    pid: u32,
}

impl IoHandle {
    /// Checks `config`; workers start with the first operation.
    pub fn new(config: HandleConfig) -> Result<Self> {
        config.validate()?;
        if config.engine == EngineKind::Uring {
            crate::engine::probe_uring()
                .map_err(|reason| StorageError::UringUnavailable { reason })?;
        }
        Ok(Self {
            config,
            workers: Vec::new(),
            pending: Vec::new(),
            pid: std::process::id(),
        })
    }

    /// The settings.
    pub fn config(&self) -> HandleConfig {
        self.config
    }

    /// Operations started and not yet waited for.
    pub fn pending(&self) -> usize {
        self.pending.len()
    }

    /// Starts moving `len` bytes at `ptr` to or from `path` at `offset`
    /// and returns at once; [`IoHandle::wait`] reports the outcome. A
    /// write creates the file if needed and never truncates it; a read
    /// must lie inside the file.
    ///
    /// # Safety
    /// `ptr..ptr+len` must stay valid (writable for reads) and untouched by
    /// anyone else until [`IoHandle::wait`] returns or the handle is dropped.
    pub unsafe fn start(
        &mut self,
        op: Op,
        ptr: *mut u8,
        len: usize,
        path: &Path,
        offset: u64,
    ) -> Result<()> {
        self.restart_after_fork();
        if self.pending.len() >= HANDLE_PENDING_MAX {
            return Err(StorageError::Config {
                key: "pending operations",
                value: self.pending.len().to_string(),
                fix: format!("call wait() before starting more than {HANDLE_PENDING_MAX}"),
            });
        }
        let end = u64::try_from(len)
            .ok()
            .and_then(|len| offset.checked_add(len))
            .filter(|&end| end <= i64::MAX as u64)
            .ok_or_else(|| StorageError::Config {
                key: "offset",
                value: offset.to_string(),
                fix: format!("offset + {len} bytes must fit a file offset"),
            })?;
        let files = open(op, path)?;
        if op == Op::Read {
            let file_bytes = files
                .buffered
                .metadata()
                .map_err(|cause| StorageError::Os {
                    what: "reading the size of",
                    path: path.to_path_buf(),
                    cause,
                })?
                .len();
            if end > file_bytes {
                return Err(StorageError::UnexpectedEof {
                    path: path.to_path_buf(),
                    offset: file_bytes.max(offset),
                    missing_bytes: end - file_bytes.max(offset),
                });
            }
        }
        let state = Arc::new(OpState {
            progress: Mutex::new((0, None)),
            done: Condvar::new(),
        });
        if len == 0 {
            self.pending.push(state);
            return Ok(());
        }
        let align = files.direct.as_ref().map(alignment);
        let (body, bounce) = match align {
            Some((offset_align, memory_align)) if offset.is_multiple_of(offset_align as u64) => (
                len - len % offset_align,
                !(ptr as usize).is_multiple_of(memory_align),
            ),
            _ => (0, false),
        };
        self.ensure_workers()?;
        let parts = split(len, body, self.config.threads, self.config.block_bytes);
        state.progress.lock().unwrap_or_else(|p| p.into_inner()).0 = parts.len();
        let files = Arc::new(files);
        for (worker, (from, to)) in self.workers.iter().zip(parts) {
            let part = Part {
                op,
                files: files.clone(),
                base: ptr,
                file_offset: offset,
                from,
                body_end: body.clamp(from, to),
                to,
                bounce,
                state: state.clone(),
            };
            if let Err(returned) = worker.parts.send(part) {
                returned
                    .0
                    .state
                    .part_done(Err(StorageError::ServiceStopped));
            }
        }
        self.pending.push(state);
        Ok(())
    }

    /// Waits for every operation started; returns how many there were, or
    /// the first error (after all of them have finished either way).
    pub fn wait(&mut self) -> Result<usize> {
        let count = self.pending.len();
        let mut first = None;
        for state in self.pending.drain(..) {
            if let Err(err) = state.wait()
                && first.is_none()
            {
                first = Some(err);
            }
        }
        match first {
            None => Ok(count),
            Some(err) => Err(err),
        }
    }

    /// Threads do not survive `fork`: a child forgets its parent's workers
    /// (joining them would wait forever) and the operations they carried
    /// (the parent waits for those), and starts its own.
    fn restart_after_fork(&mut self) {
        let pid = std::process::id();
        if pid != self.pid {
            std::mem::forget(std::mem::take(&mut self.workers));
            std::mem::forget(std::mem::take(&mut self.pending));
            self.pid = pid;
        }
    }

    fn ensure_workers(&mut self) -> Result<()> {
        while self.workers.len() < self.config.threads {
            let index = self.workers.len();
            let (sender, receiver) = channel::<Part>();
            let (ready_tx, ready_rx) = channel::<Result<()>>();
            let config = self.config;
            let thread = std::thread::Builder::new()
                .name(format!("strata-aio-{index}"))
                .spawn(move || {
                    let engine: std::io::Result<Box<dyn RawEngine>> = match config.engine {
                        EngineKind::Uring => UringEngine::without_files(config.queue_depth)
                            .map(|e| Box::new(e) as Box<dyn RawEngine>),
                        EngineKind::Threads => ThreadEngine::new(&[], config.queue_depth)
                            .map(|e| Box::new(e) as Box<dyn RawEngine>),
                    };
                    match engine {
                        Ok(engine) => {
                            let _ = ready_tx.send(Ok(()));
                            worker_loop(
                                IoQueue::new(engine, Vec::new(), RETRIES_MAX_DEFAULT),
                                config,
                                &receiver,
                            );
                        }
                        Err(cause) => {
                            let _ = ready_tx.send(Err(StorageError::Os {
                                what: "starting an I/O engine for",
                                path: PathBuf::from("an async I/O handle"),
                                cause,
                            }));
                        }
                    }
                })
                .map_err(|cause| StorageError::Os {
                    what: "spawning an I/O thread for",
                    path: PathBuf::from("an async I/O handle"),
                    cause,
                })?;
            ready_rx
                .recv()
                .map_err(|_| StorageError::ServiceStopped)??;
            self.workers.push(Worker {
                parts: sender,
                thread,
            });
        }
        Ok(())
    }
}

impl Drop for IoHandle {
    /// The kernel may still be writing into callers' buffers: wait for
    /// every operation before they can be freed.
    fn drop(&mut self) {
        self.restart_after_fork();
        let _ = self.wait();
        for worker in self.workers.drain(..) {
            drop(worker.parts);
            let _ = worker.thread.join();
        }
    }
}

fn open(op: Op, path: &Path) -> Result<OpFiles> {
    let mut options = OpenOptions::new();
    match op {
        Op::Read => options.read(true),
        Op::Write => options.write(true).create(true).mode(0o644),
    };
    let what = match op {
        Op::Read => "opening for reading",
        Op::Write => "opening for writing",
    };
    let error = |cause| StorageError::Os {
        what,
        path: path.to_path_buf(),
        cause,
    };
    let buffered = options.open(path).map_err(error)?;
    let direct = match options.custom_flags(libc::O_DIRECT).open(path) {
        Ok(file) => Some(file),
        Err(err) if err.raw_os_error() == Some(libc::EINVAL) => None,
        Err(err) => return Err(error(err)),
    };
    Ok(OpFiles {
        direct,
        buffered,
        path: path.to_path_buf(),
    })
}

/// (offset and length alignment, memory alignment) for direct I/O on `file`.
fn alignment(file: &File) -> (usize, usize) {
    if let Ok(Some(dio)) = crate::sys::statx_dio_align(file)
        && dio.offset_bytes > 0
    {
        return (dio.offset_bytes as usize, dio.memory_bytes.max(1) as usize);
    }
    let block = crate::sys::logical_block_size(file).map_or(PAGE_BYTES, |b| b as usize);
    (block, block)
}

/// Cuts `0..len` into at most `threads` contiguous parts. The aligned body
/// `0..body` is cut at multiples of `block` so every direct request stays
/// aligned; the tail joins the last part.
fn split(len: usize, body: usize, threads: usize, block: usize) -> Vec<(usize, usize)> {
    let blocks = body.div_ceil(block);
    let per = blocks.div_ceil(threads).max(1) * block;
    let mut parts = Vec::with_capacity(threads);
    let mut from = 0;
    while from < len {
        let to = if from + per >= body { len } else { from + per };
        parts.push((from, to));
        from = to;
    }
    parts
}

fn worker_loop(mut queue: IoQueue, config: HandleConfig, parts: &Receiver<Part>) {
    let mut bounce: Option<AlignedBuf> = None;
    let mut slots: Vec<Option<(usize, u32)>> = vec![None; config.queue_depth];
    let mut free: Vec<usize> = (0..config.queue_depth).rev().collect();
    let mut done: Vec<Completion> = Vec::with_capacity(config.queue_depth);
    while let Ok(part) = parts.recv() {
        let result = run_part(
            &mut queue,
            &config,
            &part,
            &mut bounce,
            &mut slots,
            &mut free,
            &mut done,
        );
        part.state.part_done(result);
    }
}

fn run_part(
    queue: &mut IoQueue,
    config: &HandleConfig,
    part: &Part,
    bounce: &mut Option<AlignedBuf>,
    slots: &mut [Option<(usize, u32)>],
    free: &mut Vec<usize>,
    done: &mut Vec<Completion>,
) -> Result<()> {
    let files = &part.files;
    let direct_fd: RawFd = files
        .direct
        .as_ref()
        .map_or(files.buffered.as_raw_fd(), AsRawFd::as_raw_fd);
    let paths = [files.path.clone(), files.path.clone()];
    queue
        .set_files(&[direct_fd, files.buffered.as_raw_fd()], &paths)
        .map_err(|cause| StorageError::Os {
            what: "preparing the ring for",
            path: files.path.clone(),
            cause,
        })?;
    if part.bounce && part.from < part.body_end && bounce.is_none() {
        *bounce = Some(AlignedBuf::new(
            config.block_bytes * config.queue_depth,
            PAGE_BYTES,
        )?);
    }
    let mut next = part.from;
    let mut first_error: Option<StorageError> = None;
    loop {
        while first_error.is_none() && next < part.to && queue.has_room() {
            let slot = free.pop().expect("a free slot for each room in the queue");
            let direct = next < part.body_end;
            let end = (next + config.block_bytes).min(if direct { part.body_end } else { part.to });
            let len = end - next;
            let staged = part.bounce && direct;
            // SAFETY: `next..end` lies inside the caller's buffer (start's contract).
            let user = unsafe { part.base.add(next) };
            let ptr = match (staged, bounce.as_mut()) {
                (true, Some(buf)) => {
                    // SAFETY: each slot owns block_bytes of the bounce buffer.
                    let slot_ptr = unsafe { buf.as_mut_ptr().add(slot * config.block_bytes) };
                    if part.op == Op::Write {
                        // SAFETY: both ranges are `len` bytes, valid, and disjoint (the bounce buffer is ours).
                        unsafe { std::ptr::copy_nonoverlapping(user, slot_ptr, len) };
                    }
                    slot_ptr
                }
                _ => user,
            };
            slots[slot] = Some((next, len as u32));
            let request = Request {
                op: part.op,
                file: u32::from(!direct),
                offset: part.file_offset + next as u64,
                ptr,
                len: len as u32,
                tag: slot as u64,
            };
            // SAFETY: the memory is the caller's (valid until the operation is waited for) or this slot's bounce block (held until its completion).
            unsafe { queue.push(request) };
            next = end;
        }
        if queue.in_flight() == 0 {
            break;
        }
        // Refill a quarter of the queue at a time: three quarters stay in
        // flight, and each refill reaches the kernel as one submission of
        // a quarter's requests rather than one request per entry.
        queue.submit_and_wait((config.queue_depth / 4).max(1), done);
        for completion in done.drain(..) {
            let slot = completion.tag as usize;
            let (at, len) = slots[slot].take().expect("a completion for a live slot");
            free.push(slot);
            match completion.result {
                Ok(()) => {
                    if part.bounce && part.op == Op::Read && at < part.body_end {
                        let buf = bounce.as_ref().expect("bounce buffer allocated");
                        // SAFETY: the read filled this slot's `len` bytes; the destination is inside the caller's buffer.
                        unsafe {
                            std::ptr::copy_nonoverlapping(
                                buf.as_ptr().add(slot * config.block_bytes),
                                part.base.add(at),
                                len as usize,
                            );
                        }
                    }
                }
                Err(err) => {
                    first_error.get_or_insert(err);
                }
            }
        }
    }
    match first_error {
        None => Ok(()),
        Some(err) => Err(err),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_cover_the_buffer_once_and_cut_the_body_at_blocks() {
        for (len, body, threads, block) in [
            (10 << 20, 10 << 20, 4, 1 << 20),
            ((10 << 20) + 100, 10 << 20, 3, 1 << 20),
            (100, 0, 4, 4096),
            (4096 * 3 + 1, 4096 * 3, 8, 4096),
            (1 << 20, 1 << 20, 1, 1 << 20),
        ] {
            let parts = split(len, body, threads, block);
            assert!(parts.len() <= threads, "{parts:?}");
            assert_eq!(parts[0].0, 0);
            assert_eq!(parts.last().unwrap().1, len);
            for pair in parts.windows(2) {
                assert_eq!(pair[0].1, pair[1].0);
                assert!(pair[0].1.is_multiple_of(block) && pair[0].1 <= body);
            }
        }
    }

    #[test]
    fn settings_out_of_range_are_named() {
        for (config, key) in [
            (
                HandleConfig {
                    block_bytes: 1000,
                    ..HandleConfig::default()
                },
                "block_size",
            ),
            (
                HandleConfig {
                    queue_depth: 0,
                    ..HandleConfig::default()
                },
                "queue_depth",
            ),
            (
                HandleConfig {
                    threads: 1000,
                    ..HandleConfig::default()
                },
                "threads",
            ),
        ] {
            let error = config.validate().unwrap_err().to_string();
            assert!(error.contains(key), "{error}");
        }
    }
}
