//! The collectives of every backend whose ranks are processes (MPI, TCP):
//! each operation is a set of point-to-point transfers between this rank
//! and each peer - what goes to the peer, and room for what comes back -
//! which a [`Transport`] carries and completes (or gives up on at its
//! deadline or cancel, naming the peers not heard from). The plans are
//! here once, so every such backend sends the same bytes to the same
//! peers, and its sums are made here, in rank order, as ranks as threads
//! make them (`crate::sum`): a result is the same bits on every backend,
//! whatever the timing. Data goes straight from the caller's views to the
//! peers'; a reduction's incoming parts land in buffers sized at start.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use strata_device::{Cancel, Fence, View, ViewMut};

use crate::error::{CommError, Result};
use crate::in_process::{reach, same_dtype, view_bytes, world_times};
use crate::sum::{sum_in_rank_order, summable};
use crate::{Collective, SCALARS_MAX};

/// One peer's part of an operation: the bytes this rank sends it and the
/// room for the bytes it sends this rank (either may be empty: nothing
/// goes that way, on both ends alike).
pub struct Transfer<'a> {
    /// The peer, `0..world`, not this rank.
    pub peer: usize,
    /// What goes to it.
    pub send: &'a [u8],
    /// What comes from it, exactly this many bytes.
    pub recv: &'a mut [u8],
}

/// Whether a process backend's group may still be used: its
/// cancellation, and whether an operation of its world was given up (its
/// messages left out of step), which every group of the world shares.
pub struct Health {
    /// Cancelling it ends every wait in an operation of the group with
    /// [`CommError::Cancelled`].
    pub(crate) cancel: Cancel,
    /// Set once an operation was given up.
    pub(crate) abandoned: Arc<AtomicBool>,
}

impl Health {
    /// A fresh cancel over the world's `abandoned`.
    pub(crate) fn of(abandoned: &Arc<AtomicBool>) -> Health {
        Health {
            cancel: Cancel::new(),
            abandoned: Arc::clone(abandoned),
        }
    }

    /// `Abandoned` (or `Cancelled`) when the group can no longer be used.
    pub(crate) fn usable(&self, op: &'static str) -> Result<()> {
        if self.abandoned.load(Ordering::SeqCst) {
            return Err(CommError::Abandoned { op });
        }
        if self.cancel.is_cancelled() {
            return Err(CommError::Cancelled);
        }
        Ok(())
    }

    /// The same cancellation and world, for a subgroup.
    pub(crate) fn sibling(&self) -> Health {
        Health {
            cancel: self.cancel.clone(),
            abandoned: Arc::clone(&self.abandoned),
        }
    }

    /// Marks the world's groups unusable.
    pub(crate) fn abandon(&self) {
        self.abandoned.store(true, Ordering::SeqCst);
    }
}

/// What carries a process backend's transfers.
pub trait Transport: Send + Sync {
    /// The group's cancellation and whether its world gave up.
    fn health(&self) -> &Health;
    /// Another handle on the same links for a subgroup, sharing this
    /// one's cancellation and timeout.
    fn sibling(&self) -> Self
    where
        Self: Sized;
    /// Completes every transfer both ways, or gives up (deadline, cancel,
    /// a peer gone), naming the peers still waited for. A transfer's peer
    /// is a rank of the transport's own world. `bytes` is the operation's
    /// size on this rank, for messages.
    fn exchange(
        &self,
        op: &'static str,
        bytes: usize,
        transfers: &mut [Transfer<'_>],
    ) -> Result<()>;
}

struct Scratch {
    /// Every rank's incoming part of a reduction, in 4-byte words.
    parts: Vec<u32>,
    /// Every rank's scalars.
    scalars: Vec<f64>,
}

/// This process's member of a group whose ranks are processes, over the
/// transport `T` ([`crate::Mpi`], [`crate::Tcp`]).
pub struct Pairwise<T> {
    links: T,
    rank: usize,
    world: usize,
    /// Each rank of this group as a rank of the transport's world.
    members: Vec<usize>,
    elems_max: usize,
    scratch: Mutex<Scratch>,
}

impl<T: Transport> Pairwise<T> {
    /// Rank `rank` of `world` over `links`, exchanging at most `elems_max`
    /// elements (of up to 4 bytes) a call; its buffers are allocated here,
    /// once.
    pub(crate) fn new(links: T, rank: usize, world: usize, elems_max: usize) -> Pairwise<T> {
        Pairwise::of(links, rank, (0..world).collect(), elems_max)
    }

    /// Rank `rank` of the group `members` (ranks of the transport's
    /// world).
    fn of(links: T, rank: usize, members: Vec<usize>, elems_max: usize) -> Pairwise<T> {
        let world = members.len();
        Pairwise {
            links,
            rank,
            world,
            members,
            elems_max,
            scratch: Mutex::new(Scratch {
                parts: vec![0u32; elems_max + world],
                scalars: vec![0f64; SCALARS_MAX * world],
            }),
        }
    }

    /// The group's cancellation token: cancelling it ends every wait in an
    /// operation with [`CommError::Cancelled`].
    pub fn cancel_token(&self) -> Cancel {
        self.links.health().cancel.clone()
    }

    #[cfg(feature = "mpi")]
    pub(crate) fn links(&self) -> &T {
        &self.links
    }

    /// Completes `transfers` (their peers ranks of this group) over the
    /// transport.
    fn exchange(
        &self,
        op: &'static str,
        bytes: usize,
        transfers: &mut [Transfer<'_>],
    ) -> Result<()> {
        for transfer in transfers.iter_mut() {
            transfer.peer = self.members[transfer.peer];
        }
        self.links.exchange(op, bytes, transfers)
    }

    fn limit(&self, elems: usize) -> Result<()> {
        crate::within_limit(elems, self.elems_max)
    }

    /// `Peer` unless `peer` is another rank of the group.
    fn other(&self, op: &'static str, peer: usize) -> Result<()> {
        crate::other_rank(op, peer, self.rank, self.world)
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

impl<T: Transport + 'static> Collective for Pairwise<T> {
    fn cancellation(&self) -> Option<strata_device::Cancel> {
        Some(self.cancel_token())
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn split(&self, members: &[usize]) -> Result<Box<dyn Collective>> {
        let index = crate::member_index(members, self.rank, self.world)?;
        let members = members.iter().map(|&m| self.members[m]).collect();
        Ok(Box::new(Pairwise::of(
            self.links.sibling(),
            index,
            members,
            self.elems_max,
        )))
    }

    fn world(&self) -> usize {
        self.world
    }

    fn all_gather(&self, shard: View<'_>, out: ViewMut<'_>) -> Result<Fence> {
        const OP: &str = "all_gather";
        self.links.health().usable(OP)?;
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
        let mut transfers: Vec<Transfer<'_>> = parts
            .into_iter()
            .enumerate()
            .filter(|&(peer, _)| peer != self.rank)
            .map(|(peer, recv)| Transfer {
                peer,
                send: mine,
                recv,
            })
            .collect();
        self.exchange(OP, mine.len() * self.world, &mut transfers)?;
        Ok(Fence::ready())
    }

    fn reduce_scatter(&self, full: View<'_>, mut shard: ViewMut<'_>) -> Result<Fence> {
        const OP: &str = "reduce_scatter";
        self.links.health().usable(OP)?;
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
            let mut transfers: Vec<Transfer<'_>> = incoming[..self.world * part_bytes]
                .chunks_exact_mut(part_bytes)
                .enumerate()
                .filter(|&(peer, _)| peer != self.rank)
                .map(|(peer, recv)| Transfer {
                    peer,
                    send: &bytes[peer * part_bytes..(peer + 1) * part_bytes],
                    recv,
                })
                .collect();
            self.exchange(OP, bytes.len(), &mut transfers)?;
        }
        let mine = &bytes[self.rank * part_bytes..(self.rank + 1) * part_bytes];
        self.sum_parts(OP, parts, mine, &mut shard)?;
        Ok(Fence::ready())
    }

    fn all_reduce(&self, mut values: ViewMut<'_>) -> Result<Fence> {
        const OP: &str = "all_reduce";
        self.links.health().usable(OP)?;
        self.limit(values.len())?;
        summable(OP, values.dtype())?;
        reach(OP, "values", values.raw())?;
        let (n, width) = (values.len(), values.dtype().bytes() as usize);
        if n == 0 {
            return Ok(Fence::ready());
        }
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
            let mut transfers: Vec<Transfer<'_>> = slots
                .into_iter()
                .enumerate()
                .filter(|&(peer, _)| peer != self.rank)
                .map(|(peer, recv)| {
                    let theirs = range(peer);
                    Transfer {
                        peer,
                        send: &bytes[theirs.start * width..theirs.end * width],
                        recv,
                    }
                })
                .collect();
            self.exchange(OP, bytes.len(), &mut transfers)?;
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
        let mut transfers: Vec<Transfer<'_>> = pieces
            .into_iter()
            .enumerate()
            .filter(|&(peer, _)| peer != self.rank)
            .map(|(peer, recv)| Transfer {
                peer,
                send: own,
                recv,
            })
            .collect();
        self.exchange(OP, n * width, &mut transfers)?;
        Ok(Fence::ready())
    }

    fn all_reduce_scalars(&self, values: &mut [f64]) -> Result<()> {
        const OP: &str = "all_reduce_scalars";
        self.links.health().usable(OP)?;
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
        if n > 0 {
            let mine: &[u8] = bytemuck::cast_slice(&*values);
            let mut transfers: Vec<Transfer<'_>> = all
                .chunks_exact_mut(n)
                .enumerate()
                .filter(|&(peer, _)| peer != self.rank)
                .map(|(peer, slot)| Transfer {
                    peer,
                    send: mine,
                    recv: bytemuck::cast_slice_mut(slot),
                })
                .collect();
            self.exchange(OP, mine.len() * self.world, &mut transfers)?;
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
        self.links.health().usable(OP)?;
        crate::in_group(OP, root, self.world)?;
        self.limit(values.len())?;
        reach(OP, "values", values.raw())?;
        let bytes = values
            .into_host_bytes()
            .expect("checked: contiguous host memory");
        if bytes.is_empty() {
            return Ok(Fence::ready());
        }
        let total = bytes.len();
        if self.rank == root {
            let shared: &[u8] = bytes;
            let mut transfers: Vec<Transfer<'_>> = (0..self.world)
                .filter(|&peer| peer != self.rank)
                .map(|peer| Transfer {
                    peer,
                    send: shared,
                    recv: &mut [],
                })
                .collect();
            self.exchange(OP, total, &mut transfers)?;
        } else {
            let mut transfers = [Transfer {
                peer: root,
                send: &[],
                recv: bytes,
            }];
            self.exchange(OP, total, &mut transfers)?;
        }
        Ok(Fence::ready())
    }

    fn send(&self, peer: usize, values: View<'_>) -> Result<Fence> {
        const OP: &str = "send";
        self.links.health().usable(OP)?;
        self.other(OP, peer)?;
        self.limit(values.len())?;
        let bytes = view_bytes(OP, "values", &values)?;
        let mut transfers = [Transfer {
            peer,
            send: bytes,
            recv: &mut [],
        }];
        self.exchange(OP, bytes.len(), &mut transfers)?;
        Ok(Fence::ready())
    }

    fn recv(&self, peer: usize, values: ViewMut<'_>) -> Result<Fence> {
        const OP: &str = "recv";
        self.links.health().usable(OP)?;
        self.other(OP, peer)?;
        reach(OP, "values", values.raw())?;
        let bytes = values
            .into_host_bytes()
            .expect("checked: contiguous host memory");
        let total = bytes.len();
        let mut transfers = [Transfer {
            peer,
            send: &[],
            recv: bytes,
        }];
        self.exchange(OP, total, &mut transfers)?;
        Ok(Fence::ready())
    }
}
