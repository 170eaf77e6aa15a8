//! The io_uring engine: one ring, owned by one submitting thread.

use std::io;
use std::os::fd::RawFd;

use io_uring::{IoUring, opcode, squeue, types};

use super::{EngineKind, RawCompletion, RawEngine, RawRequest};
use crate::error::Op;

/// One io_uring instance with registered files and, when asked, registered buffers.
pub struct UringEngine {
    ring: IoUring,
    fds: Vec<RawFd>,
    fixed_files: bool,
    fixed_buffers: bool,
    depth_max: usize,
}

impl UringEngine {
    /// Sets up a ring for `depth` requests and registers `fds` (falling back to
    /// plain descriptors if registration is refused).
    pub fn new(fds: &[RawFd], depth: usize) -> io::Result<Self> {
        assert!(depth > 0, "queue depth must be positive");
        let entries = (depth as u32).next_power_of_two();
        let ring = IoUring::builder().setup_clamp().build(entries)?;
        let fixed_files = match ring.submitter().register_files(fds) {
            Ok(()) => true,
            Err(err) => {
                tracing::info!(
                    "io_uring: registering files failed ({err}); using plain descriptors"
                );
                false
            }
        };
        Ok(Self {
            ring,
            fds: fds.to_vec(),
            fixed_files,
            fixed_buffers: false,
            depth_max: depth,
        })
    }

    fn entry(&self, req: &RawRequest) -> squeue::Entry {
        let index = if self.fixed_buffers {
            req.buf_index
        } else {
            None
        };
        macro_rules! with_fd {
            ($make:expr) => {
                if self.fixed_files {
                    $make(types::Fixed(req.file)).build()
                } else {
                    $make(types::Fd(self.fds[req.file as usize])).build()
                }
            };
        }
        let entry = match (req.op, index) {
            (Op::Read, Some(i)) => {
                with_fd!(|fd| opcode::ReadFixed::new(fd, req.ptr, req.len, i).offset(req.offset))
            }
            (Op::Write, Some(i)) => {
                with_fd!(|fd| opcode::WriteFixed::new(fd, req.ptr, req.len, i).offset(req.offset))
            }
            (Op::Read, None) => {
                with_fd!(|fd| opcode::Read::new(fd, req.ptr, req.len).offset(req.offset))
            }
            (Op::Write, None) => {
                with_fd!(|fd| opcode::Write::new(fd, req.ptr, req.len).offset(req.offset))
            }
        };
        entry.user_data(req.tag)
    }
}

impl RawEngine for UringEngine {
    fn kind(&self) -> EngineKind {
        EngineKind::Uring
    }

    fn depth_max(&self) -> usize {
        self.depth_max
    }

    unsafe fn push(&mut self, req: RawRequest) {
        assert!(
            (req.file as usize) < self.fds.len(),
            "file index out of range"
        );
        let entry = self.entry(&req);
        // The fd (or fixed index) refers to a file we hold open.
        // SAFETY: the buffer outlives the request by this method's contract.
        let pushed = unsafe { self.ring.submission().push(&entry) };
        if pushed.is_err() {
            // Submission queue full: flush it to the kernel, then retry once.
            self.ring
                .submit()
                .expect("io_uring_enter failed while flushing a full queue");
            // SAFETY: as above.
            unsafe { self.ring.submission().push(&entry) }
                .expect("submission queue still full after flushing");
        }
    }

    fn submit_and_wait(&mut self, min: usize, out: &mut Vec<RawCompletion>) -> io::Result<()> {
        loop {
            match self.ring.submit_and_wait(min) {
                Ok(_) => break,
                Err(err) if err.raw_os_error() == Some(libc::EINTR) => continue,
                // The kernel is short of memory for new requests: reap
                // what finished, give it a moment, submit again.
                Err(err) if err.raw_os_error() == Some(libc::EAGAIN) => {
                    let before = out.len();
                    self.reap(out);
                    if out.len() - before >= min {
                        break;
                    }
                    std::thread::sleep(std::time::Duration::from_micros(100));
                }
                // The completion queue is full: reap, then submit again.
                Err(err) if err.raw_os_error() == Some(libc::EBUSY) => {
                    let before = out.len();
                    self.reap(out);
                    if out.len() - before >= min {
                        break;
                    }
                }
                Err(err) => return Err(err),
            }
        }
        self.reap(out);
        Ok(())
    }

    /// Later tables use plain descriptors: re-registering files on every
    /// change would cost more than the lookups it saves.
    fn set_files(&mut self, fds: &[RawFd]) -> io::Result<()> {
        if self.fixed_files {
            self.ring.submitter().unregister_files()?;
            self.fixed_files = false;
        }
        self.fds.clear();
        self.fds.extend_from_slice(fds);
        Ok(())
    }

    unsafe fn register_buffers(&mut self, regions: &[(*mut u8, usize)]) -> bool {
        let iovecs: Vec<libc::iovec> = regions
            .iter()
            .map(|&(ptr, len)| libc::iovec {
                iov_base: ptr.cast(),
                iov_len: len,
            })
            .collect();
        // SAFETY: the caller keeps every region valid for the engine's life.
        match unsafe { self.ring.submitter().register_buffers(&iovecs) } {
            Ok(()) => {
                self.fixed_buffers = true;
                true
            }
            Err(err) => {
                static LOGGED: std::sync::atomic::AtomicBool =
                    std::sync::atomic::AtomicBool::new(false);
                if LOGGED.swap(true, std::sync::atomic::Ordering::Relaxed) {
                    return false;
                }
                tracing::info!(
                    "io_uring: registering {} buffers failed ({err}; registered buffers count against RLIMIT_MEMLOCK); using plain reads and writes",
                    regions.len()
                );
                false
            }
        }
    }
}

impl UringEngine {
    /// A ring with an empty file table, for [`RawEngine::set_files`].
    pub fn without_files(depth: usize) -> io::Result<Self> {
        assert!(depth > 0, "queue depth must be positive");
        let entries = (depth as u32).next_power_of_two();
        Ok(Self {
            ring: IoUring::builder().setup_clamp().build(entries)?,
            fds: Vec::new(),
            fixed_files: false,
            fixed_buffers: false,
            depth_max: depth,
        })
    }

    fn reap(&mut self, out: &mut Vec<RawCompletion>) {
        for cqe in self.ring.completion() {
            out.push(RawCompletion {
                tag: cqe.user_data(),
                result: cqe.result(),
            });
        }
    }
}
