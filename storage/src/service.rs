//! [`IoService`]: rings on worker threads behind bounded queues, and
//! [`Ticket`]s that plain threads wait on and async code awaits.

use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::task::{Context, Poll, Waker};
use std::thread::JoinHandle;

use tokio::sync::mpsc;

use crate::checksum::checksum;
use crate::engine::{self, EngineKind, RawEngine};
use crate::error::{Op, Result, StorageError};
use crate::queue::{Completion, IoQueue, Request};

/// What a finished piece reports to its batch.
pub(crate) trait PieceSink: Send + Sync {
    fn piece_done(&self, result: Result<()>);
}

/// One transfer of a batch, on its way to a ring.
pub(crate) struct Piece {
    pub(crate) request: Request,
    /// For reads: the extent id, the chunk's offset in it, and the checksum it must have.
    pub(crate) verify: Option<Verify>,
    pub(crate) sink: Arc<dyn PieceSink>,
}

/// The checksum a read chunk must match.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Verify {
    pub(crate) extent: u64,
    pub(crate) offset: u64,
    pub(crate) expected: u64,
}

// SAFETY: the raw pointer in `request` is only dereferenced by the ring that
// receives the piece; whoever built the piece guarantees the memory stays
// valid until the batch finishes (see `IoService::submit`).
unsafe impl Send for Piece {}

/// Where the result of a batch and its payload wait to be collected.
struct BatchState<T> {
    remaining: usize,
    error: Option<StorageError>,
    payload: Option<T>,
    waker: Option<Waker>,
    finished: bool,
}

/// Called once when a batch's last piece finishes, with whether all succeeded.
pub(crate) type FinishHook = Box<dyn FnOnce(bool) + Send>;

/// A group of pieces that completes when the last one does.
pub(crate) struct Batch<T> {
    state: Mutex<BatchState<T>>,
    ready: Condvar,
    on_finish: Mutex<Option<FinishHook>>,
}

impl<T: Send> Batch<T> {
    fn new(pieces: usize, payload: T, on_finish: Option<FinishHook>) -> Arc<Self> {
        let batch = Arc::new(Self {
            state: Mutex::new(BatchState {
                remaining: pieces,
                error: None,
                payload: Some(payload),
                waker: None,
                finished: false,
            }),
            ready: Condvar::new(),
            on_finish: Mutex::new(on_finish),
        });
        if pieces == 0 {
            batch.finish();
        }
        batch
    }

    /// Runs the finish hook (so waiters see its effects), then wakes waiters.
    fn finish(&self) {
        let succeeded = self.state.lock().expect("batch lock").error.is_none();
        if let Some(hook) = self.on_finish.lock().expect("batch hook lock").take() {
            hook(succeeded);
        }
        let mut state = self.state.lock().expect("batch lock");
        state.finished = true;
        if let Some(waker) = state.waker.take() {
            waker.wake();
        }
        self.ready.notify_all();
    }
}

impl<T> Batch<T> {
    /// Blocks until the last piece has finished.
    pub(crate) fn wait_finished(&self) {
        let mut state = self.state.lock().expect("batch lock");
        while !state.finished {
            state = self.ready.wait(state).expect("batch lock");
        }
    }
}

impl<T: Send> PieceSink for Batch<T> {
    fn piece_done(&self, result: Result<()>) {
        let last = {
            let mut state = self.state.lock().expect("batch lock");
            if let Err(err) = result
                && state.error.is_none()
            {
                state.error = Some(err);
            }
            state.remaining -= 1;
            state.remaining == 0
        };
        if last {
            self.finish();
        }
    }
}

/// The completion of a batch of transfers. `wait()` from a plain thread, or
/// `.await` it. Its payload (usually the buffer the batch moved) comes back
/// with the result, whether the transfers succeeded or not.
#[must_use = "a ticket must be waited on to learn whether the transfer succeeded"]
pub struct Ticket<T> {
    batch: Arc<Batch<T>>,
}

impl<T: Send> Ticket<T> {
    /// Blocks until every transfer of the batch has finished.
    pub fn wait(self) -> (T, Result<()>) {
        let mut state = self.batch.state.lock().expect("batch lock");
        while !state.finished {
            state = self.batch.ready.wait(state).expect("batch lock");
        }
        take_outcome(&mut state)
    }

    /// Whether every transfer has finished.
    pub fn is_done(&self) -> bool {
        self.batch.state.lock().expect("batch lock").finished
    }
}

fn take_outcome<T>(state: &mut BatchState<T>) -> (T, Result<()>) {
    let payload = state.payload.take().expect("ticket outcome taken twice");
    let result = match state.error.take() {
        None => Ok(()),
        Some(err) => Err(err),
    };
    (payload, result)
}

impl<T: Send> Future for Ticket<T> {
    type Output = (T, Result<()>);
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut state = self.batch.state.lock().expect("batch lock");
        if state.finished {
            return Poll::Ready(take_outcome(&mut state));
        }
        state.waker = Some(cx.waker().clone());
        Poll::Pending
    }
}

/// How the service's rings are built.
#[derive(Clone, Debug)]
pub struct ServiceConfig {
    /// Engine for every ring.
    pub engine: EngineKind,
    /// Rings, each on its own thread.
    pub rings: usize,
    /// Requests in flight per ring.
    pub queue_depth: usize,
    /// Bound on EAGAIN resubmissions of one request.
    pub retries_max: u32,
}

/// A factory for engines, so tests can wrap real ones (fault injection).
pub type EngineFactory = Arc<dyn Fn(usize, Box<dyn RawEngine>) -> Box<dyn RawEngine> + Send + Sync>;

/// Rings on worker threads over one table of files.
pub struct IoService {
    senders: Vec<mpsc::Sender<Piece>>,
    workers: Vec<JoinHandle<()>>,
    next_ring: AtomicUsize,
    kind: EngineKind,
}

impl IoService {
    /// Starts `config.rings` worker threads, each building its own engine over
    /// `fds`. `wrap` may decorate each ring's engine (fault injection).
    pub fn start(
        config: &ServiceConfig,
        fds: &[i32],
        paths: &[PathBuf],
        wrap: Option<EngineFactory>,
    ) -> Result<Self> {
        assert!(
            config.rings > 0 && config.queue_depth > 0,
            "rings and queue depth must be positive"
        );
        let mut senders = Vec::with_capacity(config.rings);
        let mut workers = Vec::with_capacity(config.rings);
        let first_path = paths.first().cloned().unwrap_or_default();
        for ring in 0..config.rings {
            let (sender, receiver) = mpsc::channel::<Piece>(config.queue_depth * 2);
            let (ready_tx, ready_rx) = std::sync::mpsc::channel::<Result<()>>();
            let (fds, paths, config, wrap) =
                (fds.to_vec(), paths.to_vec(), config.clone(), wrap.clone());
            let worker = std::thread::Builder::new()
                .name(format!("strata-ring-{ring}"))
                .spawn(move || {
                    let engine = match engine::build(config.engine, &fds, config.queue_depth) {
                        Ok(engine) => engine,
                        Err(err) => {
                            let _ = ready_tx.send(Err(StorageError::Os {
                                what: "starting an I/O engine over",
                                path: paths.first().cloned().unwrap_or_default(),
                                cause: err,
                            }));
                            return;
                        }
                    };
                    let engine = match &wrap {
                        Some(wrap) => wrap(ring, engine),
                        None => engine,
                    };
                    let _ = ready_tx.send(Ok(()));
                    ring_loop(IoQueue::new(engine, paths, config.retries_max), receiver);
                })
                .map_err(|err| StorageError::Os {
                    what: "spawning an I/O thread for",
                    path: first_path.clone(),
                    cause: err,
                })?;
            ready_rx
                .recv()
                .map_err(|_| StorageError::ServiceStopped)??;
            senders.push(sender);
            workers.push(worker);
        }
        Ok(Self {
            senders,
            workers,
            next_ring: AtomicUsize::new(0),
            kind: config.engine,
        })
    }

    /// The engine the rings run.
    pub fn kind(&self) -> EngineKind {
        self.kind
    }

    /// Number of rings.
    pub fn rings(&self) -> usize {
        self.senders.len()
    }

    fn ring_for_next(&self) -> &mpsc::Sender<Piece> {
        let index = self.next_ring.fetch_add(1, Ordering::Relaxed) % self.senders.len();
        &self.senders[index]
    }

    /// Creates the batch for `pieces` transfers carrying `payload`.
    pub(crate) fn batch<T: Send + 'static>(
        pieces: usize,
        payload: T,
        on_finish: Option<FinishHook>,
    ) -> (Arc<Batch<T>>, Ticket<T>) {
        let batch = Batch::new(pieces, payload, on_finish);
        (batch.clone(), Ticket { batch })
    }

    /// Sends one piece, blocking while its ring's queue is full. Must not be
    /// called from inside an async runtime (use [`IoService::send_async`]).
    pub(crate) fn send_blocking(&self, piece: Piece) {
        let sink = piece.sink.clone();
        if self.ring_for_next().blocking_send(piece).is_err() {
            sink.piece_done(Err(StorageError::ServiceStopped));
        }
    }

    /// Sends one piece, waiting asynchronously while its ring's queue is full.
    pub(crate) async fn send_async(&self, piece: Piece) {
        let sink = piece.sink.clone();
        if self.ring_for_next().send(piece).await.is_err() {
            sink.piece_done(Err(StorageError::ServiceStopped));
        }
    }

    /// Submits raw transfers as one batch, blocking on backpressure.
    ///
    /// # Safety
    /// Every request's memory must stay valid (writable for reads) and
    /// untouched until the returned ticket reports completion; keeping it
    /// inside `payload` is the usual way.
    pub unsafe fn submit<T: Send + 'static>(&self, requests: &[Request], payload: T) -> Ticket<T> {
        let (batch, ticket) = Self::batch(requests.len(), payload, None);
        for &request in requests {
            self.send_blocking(Piece {
                request,
                verify: None,
                sink: batch.clone(),
            });
        }
        ticket
    }
}

impl Drop for IoService {
    fn drop(&mut self) {
        self.senders.clear();
        for worker in self.workers.drain(..) {
            let _ = worker.join();
        }
    }
}

/// A ring thread: take pieces while there is room, submit, reap, report.
/// Reaped slots are refilled and resubmitted before the reaped reads are
/// verified, so the drive stays busy while the thread hashes.
fn ring_loop(mut queue: IoQueue, mut receiver: mpsc::Receiver<Piece>) {
    let depth = queue.depth_max();
    let mut ring = RingSlots {
        pieces: (0..depth).map(|_| None).collect(),
        free: (0..depth).rev().collect(),
        open: true,
    };
    let mut done: Vec<Completion> = Vec::with_capacity(depth);
    let mut finished: Vec<(Piece, Result<()>)> = Vec::with_capacity(depth);
    loop {
        ring.fill(&mut queue, &mut receiver, true);
        if queue.in_flight() == 0 {
            if ring.open {
                continue;
            }
            return;
        }
        queue.submit_and_wait(1, &mut done);
        loop {
            for completion in done.drain(..) {
                let slot = completion.tag as usize;
                let piece = ring.pieces[slot]
                    .take()
                    .expect("completion for an empty slot");
                ring.free.push(slot);
                finished.push((piece, completion.result));
            }
            if ring.fill(&mut queue, &mut receiver, false) == 0 {
                break;
            }
            queue.submit_and_wait(0, &mut done);
        }
        for (piece, result) in finished.drain(..) {
            let result = result.and_then(|()| verify(&piece));
            piece.sink.piece_done(result);
        }
    }
}

/// A ring's slots: the piece in each, and which are free.
struct RingSlots {
    pieces: Vec<Option<Piece>>,
    free: Vec<usize>,
    open: bool,
}

impl RingSlots {
    /// Pushes queued pieces into free slots. With `may_block`, waits for a
    /// piece when the ring is idle; never otherwise (finished pieces may still
    /// be waiting to be reported). Returns how many were pushed.
    fn fill(
        &mut self,
        queue: &mut IoQueue,
        receiver: &mut mpsc::Receiver<Piece>,
        may_block: bool,
    ) -> usize {
        let mut pushed = 0;
        while self.open && !self.free.is_empty() {
            let next = if may_block && queue.in_flight() == 0 {
                receiver.blocking_recv()
            } else {
                match receiver.try_recv() {
                    Ok(piece) => Some(piece),
                    Err(mpsc::error::TryRecvError::Empty) => break,
                    Err(mpsc::error::TryRecvError::Disconnected) => None,
                }
            };
            let Some(piece) = next else {
                self.open = false;
                break;
            };
            let slot = self.free.pop().expect("room checked");
            let mut request = piece.request;
            request.tag = slot as u64;
            // SAFETY: the piece's builder keeps its memory until the batch finishes.
            unsafe { queue.push(request) };
            self.pieces[slot] = Some(piece);
            pushed += 1;
        }
        pushed
    }
}

fn verify(piece: &Piece) -> Result<()> {
    let Some(check) = piece.verify else {
        return Ok(());
    };
    debug_assert_eq!(piece.request.op, Op::Read);
    // SAFETY: the read into this memory completed and the batch still owns it.
    let data = unsafe { std::slice::from_raw_parts(piece.request.ptr, piece.request.len as usize) };
    let actual = checksum(data);
    if actual == check.expected {
        Ok(())
    } else {
        Err(StorageError::ChecksumMismatch {
            extent: check.extent,
            offset: check.offset,
            len_bytes: u64::from(piece.request.len),
            expected: check.expected,
            actual,
        })
    }
}
