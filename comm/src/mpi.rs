//! Ranks as processes over MPI (the `mpi` crate over the system's Open
//! MPI or MPICH), for CPU ranks under `mpirun` or a PMI launcher (srun's
//! ranks meet over TCP instead: `crate::Tcp`). Every operation is `crate::pairwise`'s point-to-point transfers
//! between pairs of ranks, carried as non-blocking requests polled against
//! the group's [`Cancel`](strata_device::Cancel) and a deadline: a collective never blocks on a
//! dead peer, and the error names the ranks not heard from.
//!
//! [`MpiWorld::init`] initializes MPI once per process (with
//! `MPI_THREAD_MULTIPLE`) and finalizes it when dropped. A collective cut
//! short by the deadline or the cancel leaves its requests with MPI (their
//! receives cancelled; sends to a peer that is gone cannot be): the group
//! refuses every later call ([`CommError::Abandoned`]) and the world is
//! not finalized (finalizing would wait for the peer), so the process
//! exits with the error.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use mpi::request::{LocalScope, Request, scope};
use mpi::topology::{Communicator, SimpleCommunicator};
use mpi::traits::{Destination, Source};
use strata_device::{View, ViewMut};

use crate::Collective;
use crate::error::{CommError, Result};
use crate::pairwise::{Health, Pairwise, Transfer, Transport};

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
        let links = MpiLinks {
            comm: Comm(SimpleCommunicator::world()),
            timeout,
            health: Health::of(&self.abandoned),
        };
        Pairwise::new(links, self.rank, self.world, elems_max)
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

/// This process's member of an MPI group ([`MpiWorld::group`]).
pub type Mpi = Pairwise<MpiLinks>;

/// What carries an [`Mpi`] group's transfers: MPI's non-blocking
/// point-to-point requests on the world communicator.
pub struct MpiLinks {
    comm: Comm,
    timeout: Duration,
    health: Health,
}

/// Whether a pending request receives (from its peer) or sends.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Way {
    Receive,
    Send,
}

type Pending<'a, 's> = Vec<Option<(Request<'a, [u8], &'s LocalScope<'a>>, usize, Way)>>;

impl Transport for MpiLinks {
    fn health(&self) -> &Health {
        &self.health
    }

    fn sibling(&self) -> MpiLinks {
        MpiLinks {
            comm: Comm(SimpleCommunicator::world()),
            timeout: self.timeout,
            health: self.health.sibling(),
        }
    }

    fn exchange(
        &self,
        op: &'static str,
        bytes: usize,
        transfers: &mut [Transfer<'_>],
    ) -> Result<()> {
        // Pipeline stages' messages apart from the collectives'.
        let tag = match op {
            "send" | "recv" => TAG_P2P,
            _ => TAG_COLLECTIVE,
        };
        scope(|scope| {
            let mut pending = Vec::with_capacity(2 * transfers.len());
            for transfer in transfers.iter_mut() {
                if !transfer.recv.is_empty() {
                    self.receive_from(scope, &mut pending, transfer.peer, transfer.recv, tag);
                }
                if !transfer.send.is_empty() {
                    self.send_to(scope, &mut pending, transfer.peer, transfer.send, tag);
                }
            }
            self.complete(op, bytes, pending)
        })
    }
}

impl MpiLinks {
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
            let cancelled = self.health.cancel.is_cancelled();
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
        self.health.abandon();
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
    /// multiple of the world), `rounds` times, for this group or `ours`
    /// (another backend's member of the same ranks, in the same order);
    /// every rank calls it together.
    pub fn compare_with_mpi(
        &self,
        ours: Option<&dyn Collective>,
        full_elems: usize,
        rounds: usize,
    ) -> Result<Comparison> {
        use mpi::collective::{CommunicatorCollectives, SystemOperation};
        let ours: &dyn Collective = ours.unwrap_or(self);
        let (rank, world) = (self.rank(), self.world());
        assert_eq!(
            (ours.rank(), ours.world()),
            (rank, world),
            "the same ranks in the same order"
        );
        assert!(
            full_elems.is_multiple_of(world) && rounds > 0,
            "a full buffer of whole shards, and a round"
        );
        let shard_elems = full_elems / world;
        let shard: Vec<f32> = (0..shard_elems).map(|i| (rank + i) as f32).collect();
        let mut full = vec![0f32; full_elems];
        let mut part = vec![0f32; shard_elems];
        let mut times = [[Vec::new(), Vec::new()], [Vec::new(), Vec::new()]];
        let comm = &self.links().comm.0;
        let timed = |run: &mut dyn FnMut() -> Result<()>| -> Result<f64> {
            comm.barrier();
            let started = Instant::now();
            run()?;
            Ok(started.elapsed().as_secs_f64())
        };
        for _ in 0..rounds {
            let t = timed(&mut || {
                ours.all_gather(View::host_slice(&shard), ViewMut::host_slice(&mut full))?
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
                ours.reduce_scatter(View::host_slice(&full), ViewMut::host_slice(&mut part))?
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
