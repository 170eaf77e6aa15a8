//! The fallback engine: a pool of threads, each doing one pread/pwrite at a time.

use std::io;
use std::os::fd::RawFd;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use super::{EngineKind, RawCompletion, RawEngine, RawRequest};
use crate::error::Op;

/// Most threads one engine starts, whatever the queue depth.
pub const THREADS_MAX: usize = 256;

struct Job(RawRequest, RawFd);

// SAFETY: the request's pointer is only dereferenced by the one worker that
// receives it, under the contract of `RawEngine::push`.
unsafe impl Send for Job {}

/// pread/pwrite on `depth` threads (at most [`THREADS_MAX`]).
pub struct ThreadEngine {
    fds: Vec<RawFd>,
    jobs: Option<Sender<Job>>,
    done: Receiver<RawCompletion>,
    staged: Vec<Job>,
    workers: Vec<JoinHandle<()>>,
    depth_max: usize,
}

impl ThreadEngine {
    /// Starts the pool.
    pub fn new(fds: &[RawFd], depth: usize) -> io::Result<Self> {
        assert!(depth > 0, "queue depth must be positive");
        let (job_tx, job_rx) = channel::<Job>();
        let (done_tx, done_rx) = channel();
        let job_rx = Arc::new(Mutex::new(job_rx));
        let mut workers = Vec::new();
        for index in 0..depth.min(THREADS_MAX) {
            let jobs = job_rx.clone();
            let done = done_tx.clone();
            let worker = std::thread::Builder::new()
                .name(format!("strata-io-{index}"))
                .spawn(move || worker_loop(&jobs, &done))?;
            workers.push(worker);
        }
        Ok(Self {
            fds: fds.to_vec(),
            jobs: Some(job_tx),
            done: done_rx,
            staged: Vec::with_capacity(depth),
            workers,
            depth_max: depth,
        })
    }
}

fn worker_loop(jobs: &Mutex<Receiver<Job>>, done: &Sender<RawCompletion>) {
    loop {
        let job = {
            let Ok(receiver) = jobs.lock() else { return };
            match receiver.recv() {
                Ok(job) => job,
                Err(_) => return,
            }
        };
        let Job(req, fd) = job;
        // SAFETY: `push`'s contract keeps the buffer valid and ours until completion.
        let result = unsafe {
            crate::sys::pread_or_pwrite(
                fd,
                req.op == Op::Read,
                req.ptr,
                req.len as usize,
                req.offset,
            )
        };
        if done
            .send(RawCompletion {
                tag: req.tag,
                result,
            })
            .is_err()
        {
            return;
        }
    }
}

impl RawEngine for ThreadEngine {
    fn kind(&self) -> EngineKind {
        EngineKind::Threads
    }

    fn depth_max(&self) -> usize {
        self.depth_max
    }

    fn set_files(&mut self, fds: &[RawFd]) -> io::Result<()> {
        self.fds.clear();
        self.fds.extend_from_slice(fds);
        Ok(())
    }

    unsafe fn push(&mut self, req: RawRequest) {
        let fd = self.fds[req.file as usize];
        self.staged.push(Job(req, fd));
    }

    fn submit_and_wait(&mut self, min: usize, out: &mut Vec<RawCompletion>) -> io::Result<()> {
        let jobs = self.jobs.as_ref().expect("engine is running");
        for job in self.staged.drain(..) {
            jobs.send(job)
                .map_err(|_| io::Error::other("I/O worker threads have exited"))?;
        }
        let mut got = 0;
        while got < min {
            let completion = self
                .done
                .recv()
                .map_err(|_| io::Error::other("I/O worker threads have exited"))?;
            out.push(completion);
            got += 1;
        }
        while let Ok(completion) = self.done.try_recv() {
            out.push(completion);
        }
        Ok(())
    }
}

impl Drop for ThreadEngine {
    fn drop(&mut self) {
        self.jobs = None;
        for worker in self.workers.drain(..) {
            let _ = worker.join();
        }
    }
}
