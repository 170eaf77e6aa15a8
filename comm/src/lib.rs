//! strata-comm: collectives between ranks. The [`Collective`] trait
//! carries device buffers of any dtype ([`strata_device::View`]s), so the
//! same call moves fp32 gradients on the host or bf16 shards on a GPU;
//! [`ProcessGroups`] gives a rank its data-, tensor- and pipeline-parallel
//! groups; [`InProcess`] is ranks as threads of one process; ranks as
//! processes exchange over [`Tcp`] (torchrun, srun, `strata train
//! --nproc`) or `Mpi` (mpirun and PMI launchers; feature `mpi`), both
//! through [`Pairwise`]'s plans; [`Nccl`] carries GPUs' device buffers
//! over NCCL, built on one of those host groups.
//!
//! Sums run in rank order, so a result is the same bits whatever the
//! threads' timing. Every call returns a [`strata_device::Fence`]: the
//! in-process backend finishes before returning ([`Fence::ready`]); a
//! stream-ordered backend returns the point the next user waits for.
//!
//! ```
//! use strata_comm::{Collective, InProcess};
//! use strata_device::{View, ViewMut};
//! let ranks = InProcess::group(2, 1024);
//! std::thread::scope(|scope| {
//!     for rank in &ranks {
//!         scope.spawn(move || {
//!             let shard = [rank.rank() as f32; 4];
//!             let mut full = [0.0f32; 8];
//!             rank.all_gather(View::host_slice(&shard), ViewMut::host_slice(&mut full))?.wait()?;
//!             assert_eq!(full, [0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0]);
//!             Ok::<(), strata_comm::CommError>(())
//!         });
//!     }
//! });
//! ```
//!
//! [`Fence::ready`]: strata_device::Fence::ready

pub mod conformance;
mod error;
mod in_process;
#[cfg(feature = "mpi")]
mod mpi;
mod nccl;
mod pairwise;
mod sum;
mod tcp;

pub use error::{CommError, Result};
pub use in_process::{InProcess, SCALARS_MAX};
#[cfg(feature = "mpi")]
pub use mpi::{Comparison, Mpi, MpiLinks, MpiWorld};
pub use nccl::{Nccl, nccl_version};
pub use pairwise::{Pairwise, Transfer, Transport};
pub use tcp::{Rendezvous, Tcp, TcpLinks, TcpWorld, free_port};

use strata_device::{Fence, View, ViewMut};

/// What data, tensor and pipeline parallelism need from a group of ranks.
/// Operands are contiguous views of one dtype; every rank passes the same
/// sizes.
pub trait Collective: Send + Sync {
    /// This rank, `0..world()`.
    fn rank(&self) -> usize;
    /// Ranks in the group.
    fn world(&self) -> usize;
    /// Ranks of the group in this process (they share its cores): all of
    /// them for ranks as threads, this one alone for ranks as processes.
    fn ranks_in_process(&self) -> usize {
        1
    }
    /// The group's cancellation, which ends its waits (a backend built on
    /// this group shares it); `None` where the group has none.
    fn cancellation(&self) -> Option<strata_device::Cancel> {
        None
    }
    /// Every rank's `shard` (all the same length), concatenated in rank
    /// order into `out` (`world() * shard.len()` elements).
    fn all_gather(&self, shard: View<'_>, out: ViewMut<'_>) -> Result<Fence>;
    /// Sums `full` (`world() * shard.len()` elements on every rank) across
    /// ranks and leaves this rank's part of the sum in `shard`. Floats only;
    /// 16-bit floats are summed in fp32 and rounded once.
    fn reduce_scatter(&self, full: View<'_>, shard: ViewMut<'_>) -> Result<Fence>;
    /// Sums `values` across ranks, in place.
    fn all_reduce(&self, values: ViewMut<'_>) -> Result<Fence>;
    /// Sums a few host scalars across ranks (norms, loss, overflow counts),
    /// at most [`SCALARS_MAX`].
    fn all_reduce_scalars(&self, values: &mut [f64]) -> Result<()>;
    /// Copies rank `root`'s `values` into every other rank's.
    fn broadcast(&self, root: usize, values: ViewMut<'_>) -> Result<Fence>;
    /// Sends `values` to rank `peer`, which receives them with
    /// [`Collective::recv`] (pipeline stages).
    fn send(&self, peer: usize, values: View<'_>) -> Result<Fence>;
    /// Receives what rank `peer` sent into `values` (the same length).
    fn recv(&self, peer: usize, values: ViewMut<'_>) -> Result<Fence>;
    /// This rank's member of the group of `members` (ranks of this group,
    /// in increasing order, this one among them), whose rank `i` is
    /// `members[i]`: every member calls it with the same list, in the same
    /// order as its other splits. The subgroup shares this group's
    /// cancellation and limits.
    fn split(&self, members: &[usize]) -> Result<Box<dyn Collective>>;
}

/// `Limit` unless an exchange of `elems` fits the buffers sized at start
/// for `elems_max`.
pub(crate) fn within_limit(elems: usize, elems_max: usize) -> Result<()> {
    if elems > elems_max {
        return Err(CommError::Limit {
            what: "collective_elems_max",
            max: elems_max as u64,
            requested: elems as u64,
        });
    }
    Ok(())
}

/// `Peer` unless `peer` is a rank of a group of `world`.
pub(crate) fn in_group(op: &'static str, peer: usize, world: usize) -> Result<()> {
    match peer < world {
        true => Ok(()),
        false => Err(CommError::Peer { op, peer, world }),
    }
}

/// `Peer` unless `peer` is another rank than `rank` of a group of `world`.
pub(crate) fn other_rank(op: &'static str, peer: usize, rank: usize, world: usize) -> Result<()> {
    if peer >= world || peer == rank {
        return Err(CommError::Peer { op, peer, world });
    }
    Ok(())
}

/// `Split` unless `members` is increasing, within `0..world`, and holds
/// `rank`; this rank's index in it.
pub(crate) fn member_index(members: &[usize], rank: usize, world: usize) -> Result<usize> {
    let increasing = members.windows(2).all(|w| w[0] < w[1]);
    let inside = members.last().is_some_and(|&last| last < world);
    match members.iter().position(|&m| m == rank) {
        Some(index) if increasing && inside => Ok(index),
        _ => Err(CommError::Split {
            members: members.to_vec(),
            rank,
            world,
        }),
    }
}

/// A rank's groups: the ranks it shares data-parallel shards with, the
/// ranks its tensor-parallel layers are split over, and its pipeline.
pub struct ProcessGroups {
    /// Data parallel (ZeRO shards, gradient reduction).
    pub data: Box<dyn Collective>,
    /// Tensor parallel (split layers).
    pub tensor: Box<dyn Collective>,
    /// Pipeline parallel (stages; `send`/`recv` between neighbours).
    pub pipeline: Box<dyn Collective>,
}

impl ProcessGroups {
    /// One rank alone in each group, with buffers for `elems_max`.
    pub fn single(elems_max: usize) -> ProcessGroups {
        InProcess::grid(1, 1, 1, elems_max)
            .pop()
            .expect("a grid of one")
    }

    /// This rank's global index: tensor rank fastest, then data, then
    /// pipeline (Megatron's order, so a tensor group shares a node).
    pub fn global_rank(&self) -> usize {
        (self.pipeline.rank() * self.data.world() + self.data.rank()) * self.tensor.world()
            + self.tensor.rank()
    }

    /// Ranks over all groups.
    pub fn world(&self) -> usize {
        self.data.world() * self.tensor.world() * self.pipeline.world()
    }
}
