//! [`IoQueue`]: one engine plus the rules every transfer obeys - short
//! transfers and EAGAIN are resubmitted (EAGAIN a bounded number of times),
//! errno becomes a typed error naming the file and offset.

use std::io;
use std::path::PathBuf;
use std::time::Instant;

use crate::engine::{EngineKind, RawCompletion, RawEngine, RawRequest};
use crate::error::{Op, StorageError};

/// Default bound on EAGAIN/EINTR resubmissions of one request.
pub const RETRIES_MAX_DEFAULT: u32 = 8;

/// A transfer for [`IoQueue::push`].
#[derive(Clone, Copy, Debug)]
pub struct Request {
    /// Direction.
    pub op: Op,
    /// Index into the queue's file table.
    pub file: u32,
    /// Byte offset in that file.
    pub offset: u64,
    /// Host memory.
    pub ptr: *mut u8,
    /// Bytes to move.
    pub len: u32,
    /// Caller's tag, returned in the [`Completion`].
    pub tag: u64,
}

/// A finished transfer: all bytes moved, or the error that stopped it.
#[derive(Debug)]
pub struct Completion {
    /// The request's tag.
    pub tag: u64,
    /// Outcome.
    pub result: Result<(), StorageError>,
    /// From first submission to completion, retries included.
    pub latency_ns: u64,
}

/// Counters a queue keeps for reports and tests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QueueStats {
    /// Requests completed successfully.
    pub completed: u64,
    /// Requests that ended in an error.
    pub failed: u64,
    /// Resubmissions after a short transfer.
    pub short_resubmits: u64,
    /// Resubmissions after EAGAIN/EINTR.
    pub again_resubmits: u64,
    /// Bytes moved by successful requests.
    pub bytes: u64,
}

struct Slot {
    request: Request,
    done: u32,
    retries: u32,
    started: Instant,
}

/// A registered host memory region (for fixed-buffer transfers).
#[derive(Clone, Copy)]
struct Region {
    start: usize,
    end: usize,
}

/// One engine, its in-flight slots and the retry rules. Owned by one thread.
pub struct IoQueue {
    engine: Box<dyn RawEngine>,
    paths: Vec<PathBuf>,
    slots: Vec<Option<Slot>>,
    free: Vec<u32>,
    raw: Vec<RawCompletion>,
    regions: Vec<Region>,
    retries_max: u32,
    staged: usize,
    stats: QueueStats,
}

impl IoQueue {
    /// Wraps `engine`, whose file table matches `paths` index for index.
    pub fn new(engine: Box<dyn RawEngine>, paths: Vec<PathBuf>, retries_max: u32) -> Self {
        let depth = engine.depth_max();
        Self {
            engine,
            paths,
            slots: (0..depth).map(|_| None).collect(),
            free: (0..depth as u32).rev().collect(),
            raw: Vec::with_capacity(depth * 2),
            regions: Vec::new(),
            retries_max,
            staged: 0,
            stats: QueueStats::default(),
        }
    }

    /// The engine kind.
    pub fn kind(&self) -> EngineKind {
        self.engine.kind()
    }

    /// Most requests in flight at once.
    pub fn depth_max(&self) -> usize {
        self.slots.len()
    }

    /// Requests pushed and not yet completed.
    pub fn in_flight(&self) -> usize {
        self.slots.len() - self.free.len()
    }

    /// Whether another request may be pushed.
    pub fn has_room(&self) -> bool {
        !self.free.is_empty()
    }

    /// Counters so far.
    pub fn stats(&self) -> QueueStats {
        self.stats
    }

    /// Replaces the file table (`paths[i]` names `fds[i]` in errors).
    ///
    /// # Panics
    /// If a request is in flight.
    pub fn set_files(&mut self, fds: &[std::os::fd::RawFd], paths: &[PathBuf]) -> io::Result<()> {
        assert_eq!(self.in_flight(), 0, "set_files with requests in flight");
        assert_eq!(fds.len(), paths.len(), "one path per descriptor");
        self.engine.set_files(fds)?;
        self.paths.clear();
        self.paths.extend_from_slice(paths);
        Ok(())
    }

    /// Registers memory for fixed-buffer transfers; requests inside a region
    /// use it automatically. Returns whether the engine accepted them.
    ///
    /// # Safety
    /// Every region must stay valid for as long as this queue lives.
    pub unsafe fn register_buffers(&mut self, regions: &[(*mut u8, usize)]) -> bool {
        assert!(
            regions.len() <= usize::from(u16::MAX),
            "too many buffers to register"
        );
        // SAFETY: forwarded from our caller.
        let accepted = unsafe { self.engine.register_buffers(regions) };
        if accepted {
            self.regions = regions
                .iter()
                .map(|&(ptr, len)| Region {
                    start: ptr as usize,
                    end: ptr as usize + len,
                })
                .collect();
        }
        accepted
    }

    /// Queues a request; it is submitted by the next [`IoQueue::submit_and_wait`].
    ///
    /// # Safety
    /// `req.ptr..req.ptr+req.len` must stay valid (and writable for reads) and
    /// untouched by anyone else until the request's [`Completion`] is returned.
    pub unsafe fn push(&mut self, req: Request) {
        assert!(req.len > 0, "empty transfer");
        assert!(
            (req.file as usize) < self.paths.len(),
            "file index out of range"
        );
        let slot = self
            .free
            .pop()
            .expect("IoQueue::push without room: check has_room()");
        self.slots[slot as usize] = Some(Slot {
            request: req,
            done: 0,
            retries: 0,
            started: Instant::now(),
        });
        // SAFETY: forwarded from our caller.
        unsafe { self.push_raw(slot) };
    }

    /// # Safety
    /// As for [`IoQueue::push`], for the remainder of the slot's request.
    unsafe fn push_raw(&mut self, slot: u32) {
        let state = self.slots[slot as usize].as_ref().expect("live slot");
        let req = state.request;
        // SAFETY: `done < len`, so the remainder lies inside the caller's buffer.
        let ptr = unsafe { req.ptr.add(state.done as usize) };
        let len = req.len - state.done;
        let buf_index = self.region_of(ptr, len);
        let raw = RawRequest {
            op: req.op,
            file: req.file,
            offset: req.offset + u64::from(state.done),
            ptr,
            len,
            buf_index,
            tag: u64::from(slot),
        };
        // SAFETY: the buffer obligation is our caller's (push's contract).
        unsafe { self.engine.push(raw) };
        self.staged += 1;
    }

    fn region_of(&self, ptr: *mut u8, len: u32) -> Option<u16> {
        let (start, end) = (ptr as usize, ptr as usize + len as usize);
        self.regions
            .iter()
            .position(|r| r.start <= start && end <= r.end)
            .map(|i| i as u16)
    }

    /// Submits what was pushed and waits until at least `min` requests have
    /// finished (fewer if fewer are in flight), appending them to `out`.
    pub fn submit_and_wait(&mut self, min: usize, out: &mut Vec<Completion>) {
        let want = min.min(self.in_flight());
        let mut got = 0;
        loop {
            let wait_for = if got >= want { 0 } else { 1 };
            self.raw.clear();
            self.staged = 0;
            let mut raw = std::mem::take(&mut self.raw);
            self.engine
                .submit_and_wait(wait_for, &mut raw)
                .unwrap_or_else(|err| panic!("{} engine broke: {err}", self.engine.kind()));
            for completion in raw.drain(..) {
                got += self.finish(completion, out);
            }
            self.raw = raw;
            if got >= want && self.staged == 0 {
                return;
            }
        }
    }

    /// Handles one raw completion: done, resubmitted, or failed. Returns 1 if
    /// the request finished (well or not).
    fn finish(&mut self, completion: RawCompletion, out: &mut Vec<Completion>) -> usize {
        let slot = completion.tag as u32;
        let state = self.slots[slot as usize]
            .as_ref()
            .expect("completion for a free slot");
        let (req, mut done, mut retries) = (state.request, state.done, state.retries);
        let outcome = match completion.result {
            moved if moved > 0 => {
                done += moved as u32;
                assert!(done <= req.len, "kernel reported more bytes than asked");
                if done == req.len {
                    Some(Ok(()))
                } else {
                    self.stats.short_resubmits += 1;
                    None
                }
            }
            0 => Some(Err(self.zero_transfer_error(&req, done))),
            errno if errno == -libc::EAGAIN || errno == -libc::EINTR => {
                retries += 1;
                if retries > self.retries_max {
                    Some(Err(StorageError::RetriesExhausted {
                        op: req.op,
                        path: self.paths[req.file as usize].clone(),
                        offset: req.offset + u64::from(done),
                        retries: retries - 1,
                        cause: io::Error::from_raw_os_error(-errno),
                    }))
                } else {
                    self.stats.again_resubmits += 1;
                    None
                }
            }
            errno => Some(Err(self.errno_error(&req, done, -errno))),
        };
        let state = self.slots[slot as usize].as_mut().expect("live slot");
        (state.done, state.retries) = (done, retries);
        match outcome {
            None => {
                // SAFETY: same buffer, same obligation as the original push.
                unsafe { self.push_raw(slot) };
                0
            }
            Some(result) => {
                let state = self.slots[slot as usize].take().expect("live slot");
                self.free.push(slot);
                match &result {
                    Ok(()) => {
                        self.stats.completed += 1;
                        self.stats.bytes += u64::from(req.len);
                    }
                    Err(_) => self.stats.failed += 1,
                }
                out.push(Completion {
                    tag: req.tag,
                    result,
                    latency_ns: state.started.elapsed().as_nanos() as u64,
                });
                1
            }
        }
    }

    /// Waits for every request in flight; their results are discarded.
    pub fn drain(&mut self) {
        let mut sink = Vec::new();
        while self.in_flight() > 0 {
            self.submit_and_wait(self.in_flight(), &mut sink);
            sink.clear();
        }
    }

    fn zero_transfer_error(&self, req: &Request, done: u32) -> StorageError {
        let path = self.paths[req.file as usize].clone();
        let offset = req.offset + u64::from(done);
        let missing_bytes = u64::from(req.len - done);
        match req.op {
            Op::Read => StorageError::UnexpectedEof {
                path,
                offset,
                missing_bytes,
            },
            Op::Write => StorageError::Io {
                op: Op::Write,
                path,
                offset,
                len_bytes: missing_bytes,
                cause: io::Error::new(io::ErrorKind::WriteZero, "the kernel wrote 0 bytes"),
            },
        }
    }

    fn errno_error(&self, req: &Request, done: u32, errno: i32) -> StorageError {
        let path = self.paths[req.file as usize].clone();
        let offset = req.offset + u64::from(done);
        let len_bytes = u64::from(req.len - done);
        let cause = io::Error::from_raw_os_error(errno);
        if errno == libc::ENOSPC || errno == libc::EDQUOT {
            StorageError::DiskFull {
                path,
                offset,
                len_bytes,
                cause,
            }
        } else {
            StorageError::Io {
                op: req.op,
                path,
                offset,
                len_bytes,
                cause,
            }
        }
    }
}

impl Drop for IoQueue {
    /// Memory handed to the kernel must not be freed under it: closing a ring
    /// does not wait for transfers in flight, so dropping a queue does.
    fn drop(&mut self) {
        self.drain();
    }
}
