//! Ranks as processes over MPI (the `mpi` crate over the system's Open
//! MPI or MPICH), for CPU ranks under `mpirun`, `srun` or any launcher MPI
//! knows. Every operation is point-to-point between pairs of ranks, its
//! requests non-blocking and polled against the group's [`Cancel`] and a
//! deadline: a collective never blocks on a dead peer, and the error names
//! the ranks not heard from. Sums are made here, in rank order, as ranks
//! as threads make them (`crate::sum`): a result is the same bits on
//! either backend, whatever the timing. Data goes straight from the
//! caller's views to the peers' (a reduce-scatter's incoming parts land in
//! buffers sized at start); nothing is allocated per call.
//!
//! [`MpiWorld::init`] initializes MPI once per process (with
//! `MPI_THREAD_MULTIPLE`) and finalizes it when dropped. A collective cut
//! short by the deadline or the cancel leaves its requests with MPI (their
//! receives cancelled; sends to a peer that is gone cannot be): the group
//! refuses every later call ([`CommError::Abandoned`]) and the world is
//! not finalized (finalizing would wait for the peer), so the process
//! exits with the error.

use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use mpi::request::{LocalScope, Request, scope};
use mpi::topology::{Communicator, SimpleCommunicator};
use mpi::traits::{Destination, Source};
use strata_device::{Cancel, Fence, View, ViewMut};

use crate::error::{CommError, Result};
use crate::in_process::{reach, same_dtype, view_bytes, world_times};
use crate::sum::{sum_in_rank_order, summable};
use crate::{Collective, SCALARS_MAX};

/// Bytes of one MPI message at most (its count is a C int); larger
/// transfers go as several, in order.
const MESSAGE_BYTES_MAX: usize = 1 << 30;
/// The tag of collectives' messages, and of `send`/`recv`'s.
const TAG_COLLECTIVE: i32 = 0x5354;
const TAG_P2P: i32 = 0x5355;
/// Polls of a pending operation spent spinning before it sleeps between
/// polls (short exchanges finish within them).
const SPINS: u32 = 2_000;
/// The sleep between polls after the spins.
const POLL_SLEEP: Duration = Duration::from_micros(200);

/// MPI, initialized for this process: its rank and size in the world.
pub struct MpiWorld {
    universe: Option<mpi::environment::Universe>,
    rank: usize,
    world: usize,
    abandoned: Arc<AtomicBool>,
}

impl MpiWorld {
    /// Initializes MPI with `MPI_THREAD_MULTIPLE` (the engine's threads
    /// may call it at once). Fails if MPI was initialized before in this
    /// process or the library does not give that level.
    pub fn init() -> Result<MpiWorld> {
        let (universe, threading) = mpi::initialize_with_threading(mpi::Threading::Multiple)
            .ok_or_else(|| CommError::Mpi {
                problem: "MPI was already initialized in this process".into(),
                fix: "initialize it once: one MpiWorld per process".into(),
            })?;
        if threading != mpi::Threading::Multiple {
            return Err(CommError::Mpi {
                problem: format!(
                    "the MPI library gives threading level {threading:?}, not Multiple"
                ),
                fix: "use an MPI built with MPI_THREAD_MULTIPLE (Debian's Open MPI is)".into(),
            });
        }
        let comm = universe.world();
        let (rank, world) = (comm.rank() as usize, comm.size() as usize);
        Ok(MpiWorld {
            universe: Some(universe),
            rank,
            world,
            abandoned: Arc::new(AtomicBool::new(false)),
        })
    }

    /// This process's rank in the world.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Processes in the world.
    pub fn world(&self) -> usize {
        self.world
    }

    /// Ends every process of the job at once (`MPI_Abort`, exit status
    /// `code`): for a rank whose own failure the others would otherwise
    /// wait a timeout for. Say why first.
    pub fn abort(&self, code: i32) -> ! {
        SimpleCommunicator::world().abort(code)
    }

    /// This process's member of the world group, exchanging at most
    /// `elems_max` elements (of up to 4 bytes) a call, each operation
    /// given up after `timeout`. Its buffers are allocated here, once.
    pub fn group(&self, elems_max: usize, timeout: Duration) -> Mpi {
        Mpi {
            comm: Comm(SimpleCommunicator::world()),
            rank: self.rank,
            world: self.world,
            elems_max,
            timeout,
            cancel: Cancel::new(),
            abandoned: Arc::clone(&self.abandoned),
            scratch: Mutex::new(Scratch {
                parts: vec![0u32; elems_max + self.world],
                scalars: vec![0f64; SCALARS_MAX * self.world],
            }),
        }
    }
}

impl Drop for MpiWorld {
    fn drop(&mut self) {
        if self.abandoned.load(Ordering::SeqCst) {
            // Finalizing waits for the requests left with MPI, to a peer
            // that may be gone: the process ends without it.
            std::mem::forget(self.universe.take());
        }
    }
}

/// The world communicator, shared by the engine's threads.
struct Comm(SimpleCommunicator);

// SAFETY: MPI is initialized with MPI_THREAD_MULTIPLE (MpiWorld::init
// refuses less), so any thread may call it; the world communicator is a
// process-wide handle that is never freed.
unsafe impl Send for Comm {}
// SAFETY: as above; concurrent calls on one communicator are MPI's to
// order, and each call here completes its own requests.
unsafe impl Sync for Comm {}

struct Scratch {
    /// Every rank's incoming part of a reduction, in 4-byte words.
    parts: Vec<u32>,
    /// Every rank's scalars.
    scalars: Vec<f64>,
}

/// This process's member of an MPI group ([`MpiWorld::group`]).
pub struct Mpi {
    comm: Comm,
    rank: usize,
    world: usize,
    elems_max: usize,
    timeout: Duration,
    cancel: Cancel,
    abandoned: Arc<AtomicBool>,
    scratch: Mutex<Scratch>,
}

/// Whether a pending request receives (from its peer) or sends.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Way {
    Receive,
    Send,
}

type Pending<'a, 's> = Vec<Option<(Request<'a, [u8], &'s LocalScope<'a>>, usize, Way)>>;

impl Mpi {
    /// The group's cancellation token: cancelling it ends every wait in
    /// an operation within a poll with [`CommError::Cancelled`].
    pub fn cancel_token(&self) -> Cancel {
        self.cancel.clone()
    }

    fn usable(&self, op: &'static str) -> Result<()> {
        if self.abandoned.load(Ordering::SeqCst) {
            return Err(CommError::Abandoned { op });
        }
        if self.cancel.is_cancelled() {
            return Err(CommError::Cancelled);
        }
        Ok(())
    }

    fn limit(&self, elems: usize) -> Result<()> {
        if elems > self.elems_max {
            return Err(CommError::Limit {
                what: "collective_elems_max",
                max: self.elems_max as u64,
                requested: elems as u64,
            });
        }
        Ok(())
    }

    fn peers(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.world).filter(move |&p| p != self.rank)
    }

    /// Posts `bytes` to `peer` (in messages of at most
    /// [`MESSAGE_BYTES_MAX`]).
    fn send_to<'a, 's>(
        &self,
        scope: &'s LocalScope<'a>,
        pending: &mut Pending<'a, 's>,
        peer: usize,
        bytes: &'a [u8],
        tag: i32,
    ) {
        let process = self.comm.0.process_at_rank(peer as i32);
        for piece in bytes.chunks(MESSAGE_BYTES_MAX) {
            pending.push(Some((
                process.immediate_send_with_tag(scope, piece, tag),
                peer,
                Way::Send,
            )));
        }
    }

    /// Posts the receive of `bytes` from `peer`.
    fn receive_from<'a, 's>(
        &self,
        scope: &'s LocalScope<'a>,
        pending: &mut Pending<'a, 's>,
        peer: usize,
        bytes: &'a mut [u8],
        tag: i32,
    ) {
        let process = self.comm.0.process_at_rank(peer as i32);
        for piece in bytes.chunks_mut(MESSAGE_BYTES_MAX) {
            let request = process.immediate_receive_into_with_tag(scope, piece, tag);
            pending.push(Some((request, peer, Way::Receive)));
        }
    }

    /// Polls every pending request to completion, or gives up at the
    /// deadline or the cancel (then the group is abandoned).
    fn complete(&self, op: &'static str, bytes: usize, mut pending: Pending<'_, '_>) -> Result<()> {
        let started = Instant::now();
        let mut polls = 0u32;
        loop {
            let mut left = 0;
            for slot in pending.iter_mut() {
                if let Some((request, peer, way)) = slot.take() {
                    match request.test() {
                        Ok(_) => {}
                        Err(request) => {
                            *slot = Some((request, peer, way));
                            left += 1;
                        }
                    }
                }
            }
            if left == 0 {
                return Ok(());
            }
            let cancelled = self.cancel.is_cancelled();
            let waited = started.elapsed();
            if cancelled || waited >= self.timeout {
                let mut silent: Vec<usize> =
                    pending.iter().flatten().map(|&(_, peer, _)| peer).collect();
                silent.sort_unstable();
                silent.dedup();
                self.abandon(pending);
                return Err(match cancelled {
                    true => CommError::Cancelled,
                    false => CommError::Timeout {
                        op,
                        bytes: bytes as u64,
                        peers: silent,
                        waited_s: waited.as_secs_f64(),
                    },
                });
            }
            polls += 1;
            if polls < SPINS {
                std::hint::spin_loop();
            } else {
                std::thread::sleep(POLL_SLEEP);
            }
        }
    }

    /// Leaves the pending requests with MPI: receives cancelled, sends
    /// forgotten; the group refuses every later call.
    fn abandon(&self, pending: Pending<'_, '_>) {
        self.abandoned.store(true, Ordering::SeqCst);
        for (request, _, way) in pending.into_iter().flatten() {
            if way == Way::Receive {
                request.cancel();
            }
            // A cancelled receive writes nothing more; a send reads its
            // buffer only when the peer posts the matching receive, which
            // the peer waited for has not done (it is gone or stalled past
            // the deadline); the process ends with this error, without
            // finalizing MPI (MpiWorld's drop).
            // SAFETY: so the request, unregistered, is never completed.
            let _ = unsafe { request.into_raw() };
        }
    }

    /// `Peer` unless `peer` is another rank of the group.
    fn other(&self, op: &'static str, peer: usize) -> Result<()> {
        if peer >= self.world || peer == self.rank {
            return Err(CommError::Peer {
                op,
                peer,
                world: self.world,
            });
        }
        Ok(())
    }

    /// Sums into `out` (this rank's part of a reduce-scatter) the parts
    /// the peers sent into `parts`, one of `out`'s length per rank in rank
    /// order, and this rank's own `mine`, in rank order.
    fn sum_parts(
        &self,
        op: &'static str,
        parts: &[u32],
        mine: &[u8],
        out: &mut ViewMut<'_>,
    ) -> Result<()> {
        let width = out.dtype().bytes() as usize;
        let part_bytes = out.len() * width;
        let bytes: &[u8] = bytemuck::cast_slice(parts);
        sum_in_rank_order(op, self.world, out, &|rank, from, len, add| {
            let part = match rank == self.rank {
                true => mine,
                false => &bytes[rank * part_bytes..(rank + 1) * part_bytes],
            };
            add(&part[from * width..(from + len) * width]);
        })
    }
}

impl Collective for Mpi {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn all_gather(&self, shard: View<'_>, out: ViewMut<'_>) -> Result<Fence> {
        const OP: &str = "all_gather";
        self.usable(OP)?;
        same_dtype(OP, shard.dtype(), out.dtype())?;
        world_times(OP, "output", (out.len(), shard.len(), self.world))?;
        self.limit(shard.len())?;
        reach(OP, "output", out.raw())?;
        let mine = view_bytes(OP, "input", &shard)?;
        let target = out
            .into_host_bytes()
            .expect("checked: contiguous host memory");
        if mine.is_empty() {
            return Ok(Fence::ready());
        }
        let mut parts: Vec<&mut [u8]> = target.chunks_exact_mut(mine.len()).collect();
        parts[self.rank].copy_from_slice(mine);
        scope(|scope| {
            let mut pending = Vec::with_capacity(2 * self.world);
            for (peer, part) in parts.into_iter().enumerate() {
                if peer != self.rank {
                    self.receive_from(scope, &mut pending, peer, part, TAG_COLLECTIVE);
                    self.send_to(scope, &mut pending, peer, mine, TAG_COLLECTIVE);
                }
            }
            self.complete(OP, mine.len() * self.world, pending)
        })?;
        Ok(Fence::ready())
    }

    fn reduce_scatter(&self, full: View<'_>, mut shard: ViewMut<'_>) -> Result<Fence> {
        const OP: &str = "reduce_scatter";
        self.usable(OP)?;
        same_dtype(OP, full.dtype(), shard.dtype())?;
        world_times(OP, "input", (full.len(), shard.len(), self.world))?;
        self.limit(full.len())?;
        summable(OP, full.dtype())?;
        reach(OP, "output", shard.raw())?;
        let bytes = view_bytes(OP, "input", &full)?;
        let part_bytes = bytes.len() / self.world;
        if part_bytes == 0 {
            return Ok(Fence::ready());
        }
        let mut scratch = self.scratch.lock().expect("scratch");
        let parts = &mut scratch.parts[..(self.world * part_bytes).div_ceil(4)];
        {
            let incoming: &mut [u8] = bytemuck::cast_slice_mut(&mut *parts);
            let mut slots: Vec<&mut [u8]> = incoming[..self.world * part_bytes]
                .chunks_exact_mut(part_bytes)
                .collect();
            scope(|scope| {
                let mut pending = Vec::with_capacity(2 * self.world);
                for (peer, slot) in slots.iter_mut().enumerate() {
                    if peer != self.rank {
                        self.receive_from(scope, &mut pending, peer, slot, TAG_COLLECTIVE);
                        let theirs = &bytes[peer * part_bytes..(peer + 1) * part_bytes];
                        self.send_to(scope, &mut pending, peer, theirs, TAG_COLLECTIVE);
                    }
                }
                self.complete(OP, bytes.len(), pending)
            })?;
        }
        let mine = &bytes[self.rank * part_bytes..(self.rank + 1) * part_bytes];
        self.sum_parts(OP, parts, mine, &mut shard)?;
        Ok(Fence::ready())
    }

    fn all_reduce(&self, mut values: ViewMut<'_>) -> Result<Fence> {
        const OP: &str = "all_reduce";
        self.usable(OP)?;
        self.limit(values.len())?;
        summable(OP, values.dtype())?;
        reach(OP, "values", values.raw())?;
        let (n, width) = (values.len(), values.dtype().bytes() as usize);
        // Rank r sums elements r * chunk.. of every rank's values, then
        // every rank gathers every sum.
        let chunk = n.div_ceil(self.world);
        let range = |rank: usize| (rank * chunk).min(n)..((rank + 1) * chunk).min(n);
        let mine = range(self.rank);
        let part_bytes = mine.len() * width;
        let stride = chunk * width;
        let mut scratch = self.scratch.lock().expect("scratch");
        let parts = &mut scratch.parts[..(self.world * stride).div_ceil(4)];
        {
            let bytes: &[u8] = values
                .reborrow()
                .into_host_bytes()
                .expect("checked: contiguous host memory");
            let incoming: &mut [u8] = bytemuck::cast_slice_mut(&mut *parts);
            let mut slots: Vec<&mut [u8]> = incoming
                .chunks_exact_mut(stride.max(1))
                .take(self.world)
                .map(|slot| &mut slot[..part_bytes])
                .collect();
            // This rank's own part is summed from a copy: its sum
            // overwrites the values it reads.
            slots[self.rank].copy_from_slice(&bytes[mine.start * width..mine.end * width]);
            scope(|scope| {
                let mut pending = Vec::with_capacity(2 * self.world);
                for (peer, slot) in slots.iter_mut().enumerate() {
                    if peer == self.rank {
                        continue;
                    }
                    if part_bytes > 0 {
                        self.receive_from(scope, &mut pending, peer, slot, TAG_COLLECTIVE);
                    }
                    let theirs = range(peer);
                    if !theirs.is_empty() {
                        let out = &bytes[theirs.start * width..theirs.end * width];
                        self.send_to(scope, &mut pending, peer, out, TAG_COLLECTIVE);
                    }
                }
                self.complete(OP, bytes.len(), pending)
            })?;
        }
        {
            let incoming: &[u8] = bytemuck::cast_slice(&*parts);
            let mut sums = values.reborrow().range(mine.clone());
            sum_in_rank_order(OP, self.world, &mut sums, &|rank, from, len, add| {
                let part = &incoming[rank * stride..rank * stride + part_bytes];
                add(&part[from * width..(from + len) * width]);
            })?;
        }
        drop(scratch);
        // Every rank's sums to every rank.
        let bytes = values
            .into_host_bytes()
            .expect("checked: contiguous host memory");
        let mut pieces: Vec<&mut [u8]> = Vec::with_capacity(self.world);
        let mut rest: &mut [u8] = bytes;
        for rank in 0..self.world {
            let (piece, after) = rest.split_at_mut(range(rank).len() * width);
            pieces.push(piece);
            rest = after;
        }
        let own: &mut [u8] = std::mem::take(&mut pieces[self.rank]);
        let own: &[u8] = own;
        scope(|scope| {
            let mut pending = Vec::with_capacity(2 * self.world);
            for (peer, piece) in pieces.into_iter().enumerate() {
                if peer == self.rank {
                    continue;
                }
                if !piece.is_empty() {
                    self.receive_from(scope, &mut pending, peer, piece, TAG_COLLECTIVE);
                }
                if !own.is_empty() {
                    self.send_to(scope, &mut pending, peer, own, TAG_COLLECTIVE);
                }
            }
            self.complete(OP, n * width, pending)
        })?;
        Ok(Fence::ready())
    }

    fn all_reduce_scalars(&self, values: &mut [f64]) -> Result<()> {
        const OP: &str = "all_reduce_scalars";
        self.usable(OP)?;
        if values.len() > SCALARS_MAX {
            return Err(CommError::Limit {
                what: "collective scalars (SCALARS_MAX)",
                max: SCALARS_MAX as u64,
                requested: values.len() as u64,
            });
        }
        let n = values.len();
        let mut scratch = self.scratch.lock().expect("scratch");
        let all = &mut scratch.scalars[..n * self.world];
        all[self.rank * n..(self.rank + 1) * n].copy_from_slice(values);
        {
            let mine: &[u8] = bytemuck::cast_slice(&*values);
            let mut slots: Vec<&mut [f64]> = all.chunks_exact_mut(n.max(1)).collect();
            scope(|scope| {
                let mut pending = Vec::with_capacity(2 * self.world);
                for (peer, slot) in slots.iter_mut().enumerate() {
                    if peer != self.rank && n > 0 {
                        let slot: &mut [u8] = bytemuck::cast_slice_mut(slot);
                        self.receive_from(scope, &mut pending, peer, slot, TAG_COLLECTIVE);
                        self.send_to(scope, &mut pending, peer, mine, TAG_COLLECTIVE);
                    }
                }
                self.complete(OP, mine.len() * self.world, pending)
            })?;
        }
        // In rank order from zero, as ranks as threads add them.
        values.fill(0.0);
        for part in all.chunks_exact(n.max(1)) {
            for (v, s) in values.iter_mut().zip(part) {
                *v += s;
            }
        }
        Ok(())
    }

    fn broadcast(&self, root: usize, values: ViewMut<'_>) -> Result<Fence> {
        const OP: &str = "broadcast";
        self.usable(OP)?;
        if root >= self.world {
            return Err(CommError::Peer {
                op: OP,
                peer: root,
                world: self.world,
            });
        }
        self.limit(values.len())?;
        reach(OP, "values", values.raw())?;
        let bytes = values
            .into_host_bytes()
            .expect("checked: contiguous host memory");
        if bytes.is_empty() {
            return Ok(Fence::ready());
        }
        let total = bytes.len();
        scope(|scope| {
            let mut pending = Vec::with_capacity(self.world);
            if self.rank == root {
                let shared: &[u8] = bytes;
                for peer in self.peers() {
                    self.send_to(scope, &mut pending, peer, shared, TAG_COLLECTIVE);
                }
            } else {
                self.receive_from(scope, &mut pending, root, bytes, TAG_COLLECTIVE);
            }
            self.complete(OP, total, pending)
        })?;
        Ok(Fence::ready())
    }

    fn send(&self, peer: usize, values: View<'_>) -> Result<Fence> {
        const OP: &str = "send";
        self.usable(OP)?;
        self.other(OP, peer)?;
        self.limit(values.len())?;
        let bytes = view_bytes(OP, "values", &values)?;
        scope(|scope| {
            let mut pending = Vec::with_capacity(1);
            self.send_to(scope, &mut pending, peer, bytes, TAG_P2P);
            self.complete(OP, bytes.len(), pending)
        })?;
        Ok(Fence::ready())
    }

    fn recv(&self, peer: usize, values: ViewMut<'_>) -> Result<Fence> {
        const OP: &str = "recv";
        self.usable(OP)?;
        self.other(OP, peer)?;
        reach(OP, "values", values.raw())?;
        let bytes = values
            .into_host_bytes()
            .expect("checked: contiguous host memory");
        let total = bytes.len();
        scope(|scope| {
            let mut pending = Vec::with_capacity(1);
            self.receive_from(scope, &mut pending, peer, bytes, TAG_P2P);
            self.complete(OP, total, pending)
        })?;
        Ok(Fence::ready())
    }
}

/// Per-call seconds (medians over the rounds, on this rank) of this
/// backend's all-gather and reduce-scatter and of MPI's own collectives
/// on the same buffers, interleaved round by round: what `benches/mpi.rs`
/// prints, and the tests run tiny.
#[derive(Clone, Debug, PartialEq)]
pub struct Comparison {
    /// Bytes of the full (gathered, or reduced) f32 buffer.
    pub bytes: u64,
    /// Rounds measured.
    pub rounds: usize,
    /// This backend's all-gather, and `MPI_Allgather`'s.
    pub all_gather_s: [f64; 2],
    /// This backend's reduce-scatter, and `MPI_Reduce_scatter_block`'s.
    pub reduce_scatter_s: [f64; 2],
}

impl Mpi {
    /// Measures [`Comparison`] on a full buffer of `full_elems` f32 (a
    /// multiple of the world), `rounds` times; every rank calls it
    /// together.
    pub fn compare_with_mpi(&self, full_elems: usize, rounds: usize) -> Result<Comparison> {
        use mpi::collective::{CommunicatorCollectives, SystemOperation};
        assert!(
            full_elems.is_multiple_of(self.world) && rounds > 0,
            "a full buffer of whole shards, and a round"
        );
        let shard_elems = full_elems / self.world;
        let shard: Vec<f32> = (0..shard_elems).map(|i| (self.rank + i) as f32).collect();
        let mut full = vec![0f32; full_elems];
        let mut part = vec![0f32; shard_elems];
        let mut times = [[Vec::new(), Vec::new()], [Vec::new(), Vec::new()]];
        let comm = &self.comm.0;
        let timed = |run: &mut dyn FnMut() -> Result<()>| -> Result<f64> {
            comm.barrier();
            let started = Instant::now();
            run()?;
            Ok(started.elapsed().as_secs_f64())
        };
        for _ in 0..rounds {
            let t = timed(&mut || {
                self.all_gather(View::host_slice(&shard), ViewMut::host_slice(&mut full))?
                    .wait()?;
                Ok(())
            })?;
            times[0][0].push(t);
            let t = timed(&mut || {
                comm.all_gather_into(&shard[..], &mut full[..]);
                Ok(())
            })?;
            times[0][1].push(t);
            let t = timed(&mut || {
                self.reduce_scatter(View::host_slice(&full), ViewMut::host_slice(&mut part))?
                    .wait()?;
                Ok(())
            })?;
            times[1][0].push(t);
            let t = timed(&mut || {
                comm.reduce_scatter_block_into(&full[..], &mut part[..], SystemOperation::sum());
                Ok(())
            })?;
            times[1][1].push(t);
        }
        let median = |v: &mut Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        let [[mut a, mut b], [mut c, mut d]] = times;
        Ok(Comparison {
            bytes: (full_elems * 4) as u64,
            rounds,
            all_gather_s: [median(&mut a), median(&mut b)],
            reduce_scatter_s: [median(&mut c), median(&mut d)],
        })
    }
}
