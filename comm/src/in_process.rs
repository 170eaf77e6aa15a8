//! Ranks as threads of one process, exchanging through per-rank buffers
//! sized at start between two waits at a gate (a barrier a rank can
//! leave).

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};

use strata_device::{Cancel, DeviceKind, Dtype, Fence, Raw, View, ViewMut};

use crate::error::{CommError, Result};
use crate::sum::sum_in_rank_order;
use crate::{Collective, ProcessGroups};

/// Scalars one [`Collective::all_reduce_scalars`] may carry.
pub const SCALARS_MAX: usize = 64;

struct Shared {
    gate: Gate,
    /// Per rank: its posted bytes, in 4-byte words (aligned for any dtype).
    slots: Vec<Mutex<Vec<u32>>>,
    scalars: Vec<Mutex<Vec<f64>>>,
    /// `world x world` mailboxes, `[from * world + to]`, for send/recv.
    mail: Vec<Mutex<Option<Vec<u32>>>>,
    mail_changed: Condvar,
    elems_max: usize,
    /// The subgroups split from this one, by members and how many splits
    /// of those members came before: the first member to ask makes it.
    subgroups: Mutex<HashMap<SplitKey, Arc<Shared>>>,
}

/// A subgroup's members, and how many splits of them came before it.
type SplitKey = (Vec<usize>, usize);

impl Shared {
    fn new(
        world: usize,
        elems_max: usize,
        cancel: Cancel,
        parent: Option<(Weak<Shared>, Vec<usize>)>,
    ) -> Shared {
        Shared {
            gate: Gate {
                state: Mutex::new(GateState {
                    arrived: 0,
                    generation: 0,
                    left: None,
                }),
                turned: Condvar::new(),
                world,
                cancel,
                parent,
            },
            slots: (0..world)
                .map(|_| Mutex::new(Vec::with_capacity(elems_max)))
                .collect(),
            scalars: (0..world)
                .map(|_| Mutex::new(Vec::with_capacity(SCALARS_MAX)))
                .collect(),
            mail: (0..world * world).map(|_| Mutex::new(None)).collect(),
            mail_changed: Condvar::new(),
            elems_max,
            subgroups: Mutex::new(HashMap::new()),
        }
    }
}

/// A barrier that a rank can leave: the ranks waiting at it, or arriving
/// later, get [`CommError::PeerLeft`] instead of waiting forever for a
/// rank that failed or stopped, and [`CommError::Cancelled`] once the
/// group's [`Cancel`] is cancelled.
struct Gate {
    state: Mutex<GateState>,
    turned: Condvar,
    world: usize,
    cancel: Cancel,
    /// A subgroup's: the group it was split from (a rank that left it
    /// fails this one's waits too; weak, as the group holds its subgroups)
    /// and each member's rank there.
    parent: Option<(Weak<Shared>, Vec<usize>)>,
}

struct GateState {
    arrived: usize,
    generation: u64,
    left: Option<usize>,
}

impl Gate {
    fn lock(&self) -> MutexGuard<'_, GateState> {
        // Nothing panics while holding it.
        self.state.lock().expect("collective gate")
    }

    fn check(&self, state: &GateState) -> Result<()> {
        if self.cancel.is_cancelled() {
            return Err(CommError::Cancelled);
        }
        if let Some(parent) = self.parent.as_ref().and_then(|(p, _)| p.upgrade()) {
            // (Locks taken child first, parent after: never the other way.)
            parent.gate.check(&parent.gate.lock())?;
        }
        match state.left {
            Some(rank) => Err(CommError::PeerLeft {
                rank: match &self.parent {
                    Some((_, members)) => members[rank],
                    None => rank,
                },
            }),
            None => Ok(()),
        }
    }

    fn wait(&self) -> Result<()> {
        let mut state = self.lock();
        self.check(&state)?;
        let generation = state.generation;
        state.arrived += 1;
        if state.arrived == self.world {
            state.arrived = 0;
            state.generation += 1;
            self.turned.notify_all();
            return Ok(());
        }
        // Passed once the last rank arrives, even if one leaves after.
        while state.generation == generation {
            if let Err(err) = self.check(&state) {
                // Not waiting any more: a later arrival must not count it.
                state.arrived -= 1;
                return Err(err);
            }
            state = Cancel::sleep(&self.turned, state);
        }
        Ok(())
    }

    fn leave(&self, rank: usize) {
        self.lock().left.get_or_insert(rank);
        self.turned.notify_all();
    }
}

/// One rank of an in-process group; [`InProcess::group`] makes them all.
/// Dropping it (the rank returned, failed or panicked) fails the others'
/// collectives from then on rather than leaving them waiting.
pub struct InProcess {
    rank: usize,
    shared: Arc<Shared>,
    /// Splits this rank asked for, by members.
    splits: Mutex<HashMap<Vec<usize>, usize>>,
}

impl InProcess {
    /// A group of `world` ranks exchanging at most `elems_max` elements
    /// (of up to 4 bytes) per rank and call; buffers are allocated here,
    /// once.
    pub fn group(world: usize, elems_max: usize) -> Vec<InProcess> {
        assert!(world > 0, "a group needs a rank");
        let shared = Arc::new(Shared::new(world, elems_max, Cancel::new(), None));
        (0..world)
            .map(|rank| InProcess::member(rank, Arc::clone(&shared)))
            .collect()
    }

    fn member(rank: usize, shared: Arc<Shared>) -> InProcess {
        InProcess {
            rank,
            shared,
            splits: Mutex::new(HashMap::new()),
        }
    }

    /// The group's cancellation token: cancelling it ends every rank's
    /// wait in a collective or a receive within [`Cancel::POLL`] with
    /// [`CommError::Cancelled`], and fails every later collective at once.
    pub fn cancel_token(&self) -> Cancel {
        self.shared.gate.cancel.clone()
    }

    /// Every rank's groups for `data x tensor x pipeline` ranks, in global
    /// rank order (see [`ProcessGroups::global_rank`]).
    pub fn grid(
        data: usize,
        tensor: usize,
        pipeline: usize,
        elems_max: usize,
    ) -> Vec<ProcessGroups> {
        let world = data * tensor * pipeline;
        let index = |p: usize, d: usize, t: usize| (p * data + d) * tensor + t;
        let mut slots: Vec<[Option<InProcess>; 3]> =
            (0..world).map(|_| [None, None, None]).collect();
        for p in 0..pipeline {
            for t in 0..tensor {
                for (d, member) in InProcess::group(data, elems_max).into_iter().enumerate() {
                    slots[index(p, d, t)][0] = Some(member);
                }
            }
            for d in 0..data {
                for (t, member) in InProcess::group(tensor, elems_max).into_iter().enumerate() {
                    slots[index(p, d, t)][1] = Some(member);
                }
            }
        }
        for d in 0..data {
            for t in 0..tensor {
                for (p, member) in InProcess::group(pipeline, elems_max)
                    .into_iter()
                    .enumerate()
                {
                    slots[index(p, d, t)][2] = Some(member);
                }
            }
        }
        slots
            .into_iter()
            .map(|[data, tensor, pipeline]| ProcessGroups {
                data: Box::new(data.expect("every rank has a data group")),
                tensor: Box::new(tensor.expect("every rank has a tensor group")),
                pipeline: Box::new(pipeline.expect("every rank has a pipeline group")),
            })
            .collect()
    }

    fn check(&self, elems: usize) -> Result<()> {
        crate::within_limit(elems, self.shared.elems_max)
    }

    /// Once every rank has posted: sums their posts' elements from `start`
    /// into `out` in rank order, then waits for every rank to have read.
    fn sum_posted(&self, op: &'static str, start: usize, out: &mut ViewMut<'_>) -> Result<Fence> {
        let width = out.dtype().bytes() as usize;
        let slots = &self.shared.slots;
        let summed = sum_in_rank_order(op, slots.len(), out, &|rank, from, len, add| {
            let slot = slots[rank].lock().expect("collective slot");
            let bytes: &[u8] = bytemuck::cast_slice(&slot);
            add(&bytes[(start + from) * width..(start + from + len) * width]);
        });
        self.shared.gate.wait()?;
        summed.map(|()| Fence::ready())
    }

    fn post(&self, op: &'static str, values: &View<'_>) -> Result<()> {
        let bytes = view_bytes(op, "input", values)?;
        pack(bytes, &mut self.slot(self.rank));
        Ok(())
    }

    fn slot(&self, rank: usize) -> MutexGuard<'_, Vec<u32>> {
        self.shared.slots[rank].lock().expect("collective slot")
    }

    fn peer(&self, op: &'static str, peer: usize) -> Result<()> {
        if peer >= self.world() || peer == self.rank {
            return Err(CommError::Peer {
                op,
                peer,
                world: self.world(),
            });
        }
        Ok(())
    }

    fn mailbox(&self, from: usize, to: usize) -> &Mutex<Option<Vec<u32>>> {
        &self.shared.mail[from * self.world() + to]
    }

    /// Waits on the mailbox until `ready` holds, failing if a rank left.
    fn wait_mail(
        &self,
        mailbox: &Mutex<Option<Vec<u32>>>,
        mut ready: impl FnMut(&mut Option<Vec<u32>>) -> bool,
    ) -> Result<()> {
        let mut held = mailbox.lock().expect("mailbox");
        loop {
            if ready(&mut held) {
                self.shared.mail_changed.notify_all();
                return Ok(());
            }
            self.shared.gate.check(&self.shared.gate.lock())?;
            held = Cancel::sleep(&self.shared.mail_changed, held);
        }
    }
}

impl Drop for InProcess {
    fn drop(&mut self) {
        self.shared.gate.leave(self.rank);
        self.shared.mail_changed.notify_all();
    }
}

/// The bytes of a contiguous host view.
pub(crate) fn view_bytes<'a>(
    op: &'static str,
    what: &'static str,
    view: &View<'a>,
) -> Result<&'a [u8]> {
    reach(op, what, view.raw())?;
    Ok(view.host_bytes().expect("checked: contiguous host memory"))
}

/// `bytes` packed into 4-byte words (so any dtype can be read back
/// aligned), the last word padded with zeros.
fn pack(bytes: &[u8], words: &mut Vec<u32>) {
    words.clear();
    words.resize(bytes.len().div_ceil(4), 0);
    bytemuck::cast_slice_mut::<u32, u8>(words)[..bytes.len()].copy_from_slice(bytes);
}

/// Bytes of a contiguous host view, or why it cannot be reached.
pub(crate) fn reach(op: &'static str, what: &'static str, raw: Raw) -> Result<usize> {
    if raw.kind != DeviceKind::Cpu {
        return Err(CommError::Unreachable {
            op,
            what,
            kind: raw.kind,
        });
    }
    contiguous(op, what, &raw)?;
    Ok(raw.len() * raw.dtype.bytes() as usize)
}

/// `Shape` unless the view's rows follow one another with no gap.
pub(crate) fn contiguous(op: &'static str, what: &'static str, raw: &Raw) -> Result<()> {
    if !raw.is_contiguous() {
        return Err(CommError::Shape {
            op,
            what,
            expected: raw.extent(),
            actual: raw.len(),
        });
    }
    Ok(())
}

pub(crate) fn same_dtype(op: &'static str, a: Dtype, b: Dtype) -> Result<()> {
    if a != b {
        return Err(CommError::Dtype {
            op,
            dtype: b,
            why: "the operands' dtypes differ",
        });
    }
    Ok(())
}

/// Writes `words` (as bytes) into the host view `out`.
fn copy_out(op: &'static str, words: &[u32], out: ViewMut<'_>) -> Result<()> {
    let bytes = reach(op, "output", out.raw())?;
    let source: &[u8] = bytemuck::cast_slice(words);
    let target = out
        .into_host_bytes()
        .expect("checked: contiguous host memory");
    target.copy_from_slice(&source[..bytes]);
    Ok(())
}

/// `Shape` unless the full buffer (`what`, `full` elements) holds one
/// shard of `shard` elements for each of `world` ranks.
pub(crate) fn world_times(
    op: &'static str,
    what: &'static str,
    (full, shard, world): (usize, usize, usize),
) -> Result<()> {
    let expected = shard * world;
    if full != expected {
        return Err(CommError::Shape {
            op,
            what,
            expected,
            actual: full,
        });
    }
    Ok(())
}

impl Collective for InProcess {
    fn cancellation(&self) -> Option<Cancel> {
        Some(self.cancel_token())
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn split(&self, members: &[usize]) -> Result<Box<dyn Collective>> {
        let index = crate::member_index(members, self.rank, self.world())?;
        let nth = {
            let mut splits = self.splits.lock().expect("splits");
            let count = splits.entry(members.to_vec()).or_insert(0);
            *count += 1;
            *count - 1
        };
        let shared = Arc::clone(
            self.shared
                .subgroups
                .lock()
                .expect("subgroups")
                .entry((members.to_vec(), nth))
                .or_insert_with(|| {
                    Arc::new(Shared::new(
                        members.len(),
                        self.shared.elems_max,
                        self.shared.gate.cancel.clone(),
                        Some((Arc::downgrade(&self.shared), members.to_vec())),
                    ))
                }),
        );
        Ok(Box::new(InProcess::member(index, shared)))
    }

    fn ranks_in_process(&self) -> usize {
        self.shared.gate.world
    }

    fn world(&self) -> usize {
        self.shared.slots.len()
    }

    fn all_gather(&self, shard: View<'_>, out: ViewMut<'_>) -> Result<Fence> {
        const OP: &str = "all_gather";
        same_dtype(OP, shard.dtype(), out.dtype())?;
        world_times(OP, "output", (out.len(), shard.len(), self.world()))?;
        self.check(shard.len())?;
        reach(OP, "output", out.raw())?;
        self.post(OP, &shard)?;
        self.shared.gate.wait()?;
        let part_bytes = shard.len() * shard.dtype().bytes() as usize;
        let target = out
            .into_host_bytes()
            .expect("checked: contiguous host memory");
        for (rank, part) in target.chunks_exact_mut(part_bytes.max(1)).enumerate() {
            let slot = self.slot(rank);
            let bytes: &[u8] = bytemuck::cast_slice(&slot);
            assert_eq!(
                slot.len(),
                part_bytes.div_ceil(4),
                "ranks disagree on the shard size"
            );
            part.copy_from_slice(&bytes[..part_bytes]);
        }
        self.shared.gate.wait()?;
        Ok(Fence::ready())
    }

    fn reduce_scatter(&self, full: View<'_>, mut shard: ViewMut<'_>) -> Result<Fence> {
        const OP: &str = "reduce_scatter";
        same_dtype(OP, full.dtype(), shard.dtype())?;
        world_times(OP, "input", (full.len(), shard.len(), self.world()))?;
        self.check(full.len())?;
        reach(OP, "output", shard.raw())?;
        self.post(OP, &full)?;
        self.shared.gate.wait()?;
        self.sum_posted(OP, self.rank * shard.len(), &mut shard)
    }

    fn all_reduce(&self, mut values: ViewMut<'_>) -> Result<Fence> {
        const OP: &str = "all_reduce";
        self.check(values.len())?;
        reach(OP, "values", values.raw())?;
        self.post(OP, &values.view())?;
        self.shared.gate.wait()?;
        self.sum_posted(OP, 0, &mut values)
    }

    fn all_reduce_scalars(&self, values: &mut [f64]) -> Result<()> {
        if values.len() > SCALARS_MAX {
            return Err(CommError::Limit {
                what: "collective scalars (SCALARS_MAX)",
                max: SCALARS_MAX as u64,
                requested: values.len() as u64,
            });
        }
        {
            let mut slot = self.shared.scalars[self.rank]
                .lock()
                .expect("collective slot");
            slot.clear();
            slot.extend_from_slice(values);
        }
        self.shared.gate.wait()?;
        values.fill(0.0);
        for slot in &self.shared.scalars {
            let slot = slot.lock().expect("collective slot");
            for (v, s) in values.iter_mut().zip(slot.iter()) {
                *v += s;
            }
        }
        self.shared.gate.wait()?;
        Ok(())
    }

    fn broadcast(&self, root: usize, values: ViewMut<'_>) -> Result<Fence> {
        const OP: &str = "broadcast";
        crate::in_group(OP, root, self.world())?;
        self.check(values.len())?;
        reach(OP, "values", values.raw())?;
        if self.rank == root {
            self.post(OP, &values.view())?;
        }
        self.shared.gate.wait()?;
        if self.rank != root {
            let slot = self.slot(root).clone();
            copy_out(OP, &slot, values)?;
        }
        self.shared.gate.wait()?;
        Ok(Fence::ready())
    }

    fn send(&self, peer: usize, values: View<'_>) -> Result<Fence> {
        const OP: &str = "send";
        self.peer(OP, peer)?;
        self.check(values.len())?;
        let mut words = Vec::new();
        pack(view_bytes(OP, "values", &values)?, &mut words);
        let mut message = Some(words);
        self.wait_mail(self.mailbox(self.rank, peer), |held| {
            if held.is_some() {
                return false;
            }
            *held = message.take();
            true
        })?;
        Ok(Fence::ready())
    }

    fn recv(&self, peer: usize, values: ViewMut<'_>) -> Result<Fence> {
        const OP: &str = "recv";
        self.peer(OP, peer)?;
        let bytes = reach(OP, "values", values.raw())?;
        let mut message = None;
        self.wait_mail(self.mailbox(peer, self.rank), |held| {
            message = held.take();
            message.is_some()
        })?;
        let message = message.expect("taken when ready");
        if message.len() != bytes.div_ceil(4) {
            return Err(CommError::Shape {
                op: OP,
                what: "values",
                expected: message.len() * 4 / values.dtype().bytes() as usize,
                actual: values.len(),
            });
        }
        copy_out(OP, &message, values)?;
        Ok(Fence::ready())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    fn run<T: Send>(world: usize, f: impl Fn(&InProcess) -> T + Sync) -> Vec<T> {
        let ranks = InProcess::group(world, 64);
        std::thread::scope(|scope| {
            let handles: Vec<_> = ranks.iter().map(|r| scope.spawn(|| f(r))).collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    fn gather(c: &InProcess, shard: &[f32], out: &mut [f32]) -> Result<()> {
        c.all_gather(View::host_slice(shard), ViewMut::host_slice(out))?
            .wait()?;
        Ok(())
    }

    /// A rank that leaves the group before a subgroup is split fails the
    /// subgroup's waits too, named by its rank in the group.
    #[test]
    fn a_rank_gone_from_the_group_fails_its_subgroups() {
        let mut ranks = InProcess::group(3, 64);
        drop(ranks.pop());
        let sub = ranks[1].split(&[1, 2]).unwrap();
        let started = std::time::Instant::now();
        let mut values = [1f32; 4];
        match sub.all_reduce(ViewMut::host_slice(&mut values)) {
            Err(CommError::PeerLeft { rank: 2 }) => {}
            other => panic!("{other:?}"),
        }
        assert!(started.elapsed() < std::time::Duration::from_secs(2));
    }

    /// Subgroups split from ranks as threads pass it too.
    #[test]
    fn subgroups_of_threads_pass_the_conformance_suite() {
        for world in 1..=4 {
            let elems_max = 4 * 1031 + 8;
            let ranks = InProcess::group(world, elems_max);
            std::thread::scope(|scope| {
                let handles: Vec<_> = ranks
                    .iter()
                    .map(|r| scope.spawn(move || crate::conformance::check_splits(r, elems_max)))
                    .collect();
                for (rank, h) in handles.into_iter().enumerate() {
                    assert_eq!(h.join().unwrap(), Ok(()), "rank {rank} of {world}");
                }
            });
        }
    }

    /// The suite every backend passes, for 1 to 4 ranks as threads.
    #[test]
    fn ranks_as_threads_pass_the_conformance_suite() {
        for world in 1..=4 {
            let elems_max = 4 * 1031 + 8;
            let ranks = InProcess::group(world, elems_max);
            let failures: Vec<String> = std::thread::scope(|scope| {
                let handles: Vec<_> = ranks
                    .iter()
                    .map(|r| scope.spawn(move || crate::conformance::check(r, elems_max)))
                    .collect();
                handles
                    .into_iter()
                    .filter_map(|h| h.join().unwrap().err())
                    .collect()
            });
            assert!(failures.is_empty(), "{world} ranks: {failures:?}");
        }
    }

    #[test]
    fn gather_concatenates_in_rank_order() {
        for out in run(3, |c| {
            let shard = [c.rank() as f32; 2];
            let mut out = [0.0; 6];
            gather(c, &shard, &mut out).unwrap();
            out
        }) {
            assert_eq!(out, [0.0, 0.0, 1.0, 1.0, 2.0, 2.0]);
        }
    }

    #[test]
    fn bf16_shards_gather_and_sum_in_fp32_rounded_once() {
        let out = run(3, |c| {
            let shard = [bf16::from_f32(c.rank() as f32 + 0.5); 2];
            let mut full = [bf16::ZERO; 6];
            c.all_gather(View::host_slice(&shard), ViewMut::host_slice(&mut full))
                .unwrap()
                .wait()
                .unwrap();
            // Rank 0 gives 1, the others 2^-8: in fp32 the sum is 1 + 2^-7,
            // a bf16; summed in bf16, each 1 + 2^-8 would round back to 1.
            let value = if c.rank() == 0 { 1.0 } else { 1.0 / 256.0 };
            let full_in = [bf16::from_f32(value); 6];
            let mut part = [bf16::ZERO; 2];
            c.reduce_scatter(View::host_slice(&full_in), ViewMut::host_slice(&mut part))
                .unwrap()
                .wait()
                .unwrap();
            (full, part)
        });
        let expected_part = bf16::from_f32(1.0 + 1.0 / 128.0);
        for (full, part) in out {
            assert_eq!(full.map(f32::from), [0.5, 0.5, 1.5, 1.5, 2.5, 2.5]);
            assert_eq!(part, [expected_part; 2]);
        }
    }

    #[test]
    fn reduce_scatter_sums_each_part_in_rank_order() {
        let shards = run(2, |c| {
            let full: Vec<f32> = (0..4).map(|i| (i + 10 * c.rank()) as f32).collect();
            let mut shard = [0.0; 2];
            c.reduce_scatter(View::host_slice(&full), ViewMut::host_slice(&mut shard))
                .unwrap()
                .wait()
                .unwrap();
            shard
        });
        assert_eq!(shards, vec![[10.0, 12.0], [14.0, 16.0]]);
        // Repeated calls reuse the buffers and give the same bits.
        let again = run(4, |c| {
            let full: Vec<f32> = (0..8).map(|i| 0.1 * (i + c.rank()) as f32).collect();
            let mut sums = Vec::new();
            for _ in 0..50 {
                let mut shard = [0.0; 2];
                c.reduce_scatter(View::host_slice(&full), ViewMut::host_slice(&mut shard))
                    .unwrap()
                    .wait()
                    .unwrap();
                let mut norm = [f64::from(shard[0]), 1.0];
                c.all_reduce_scalars(&mut norm).unwrap();
                sums.push((shard, norm));
            }
            sums
        });
        for rank in &again {
            assert!(rank.iter().all(|s| s == &rank[0]));
            assert_eq!(rank[0].1[1], 4.0);
        }
    }

    #[test]
    fn all_reduce_broadcast_and_send_recv_move_buffers() {
        let out = run(3, |c| {
            let mut sum = [c.rank() as f32, 1.0];
            c.all_reduce(ViewMut::host_slice(&mut sum))
                .unwrap()
                .wait()
                .unwrap();
            let mut root = [c.rank() as u32 * 7; 3];
            c.broadcast(1, ViewMut::host_slice(&mut root))
                .unwrap()
                .wait()
                .unwrap();
            // A pipeline of three: 0 -> 1 -> 2.
            let mut passed = [0.0f32; 2];
            if c.rank() == 0 {
                c.send(1, View::host_slice(&[4.0f32, 5.0]))
                    .unwrap()
                    .wait()
                    .unwrap();
            } else {
                c.recv(c.rank() - 1, ViewMut::host_slice(&mut passed))
                    .unwrap()
                    .wait()
                    .unwrap();
                if c.rank() == 1 {
                    let next = [passed[0] * 2.0, passed[1] * 2.0];
                    c.send(2, View::host_slice(&next)).unwrap().wait().unwrap();
                }
            }
            (sum, root, passed)
        });
        for (rank, (sum, root, passed)) in out.into_iter().enumerate() {
            assert_eq!(sum, [3.0, 3.0]);
            assert_eq!(root, [7; 3]);
            let expected = [[0.0, 0.0], [4.0, 5.0], [8.0, 10.0]][rank];
            assert_eq!(passed, expected);
        }
        let errors = run(2, |c| {
            let integers = [1u32; 2];
            let mut part = [0u32; 1];
            let sum = c
                .reduce_scatter(View::host_slice(&integers), ViewMut::host_slice(&mut part))
                .unwrap_err();
            let peer = c.send(5, View::host_slice(&integers)).unwrap_err();
            (sum.to_string(), peer.to_string())
        });
        assert!(
            errors[0].0.contains("integers are gathered"),
            "{}",
            errors[0].0
        );
        assert!(errors[0].1.contains("rank 5"), "{}", errors[0].1);
    }

    #[test]
    fn a_grid_gives_each_rank_its_data_tensor_and_pipeline_groups() {
        let grid = InProcess::grid(2, 2, 2, 16);
        let sums = std::thread::scope(|scope| {
            let handles: Vec<_> = grid
                .iter()
                .map(|groups| {
                    scope.spawn(move || {
                        let me = groups.global_rank() as f64;
                        let mut each = [[me], [me], [me]];
                        for (group, value) in [&groups.data, &groups.tensor, &groups.pipeline]
                            .into_iter()
                            .zip(&mut each)
                        {
                            group.all_reduce_scalars(value).unwrap();
                        }
                        (groups.global_rank(), each.map(|v| v[0]))
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap())
                .collect::<Vec<_>>()
        });
        for (rank, [data, tensor, pipeline]) in sums {
            let (p, d, t) = (rank / 4, (rank / 2) % 2, rank % 2);
            let at = |p: usize, d: usize, t: usize| ((p * 2 + d) * 2 + t) as f64;
            assert_eq!(data, at(p, 0, t) + at(p, 1, t), "rank {rank}");
            assert_eq!(tensor, at(p, d, 0) + at(p, d, 1), "rank {rank}");
            assert_eq!(pipeline, at(0, d, t) + at(1, d, t), "rank {rank}");
        }
        assert_eq!(grid[5].world(), 8);
    }

    #[test]
    fn a_rank_that_leaves_fails_the_others_collectives_instead_of_hanging() {
        let mut ranks = InProcess::group(3, 64);
        let gone = ranks.pop().expect("three ranks");
        let errors = std::thread::scope(|scope| {
            let handles: Vec<_> = ranks
                .iter()
                .map(|c| {
                    scope.spawn(move || {
                        let mut values = [1.0];
                        // Both survivors pass one exchange with the third...
                        c.all_reduce_scalars(&mut values)?;
                        // ...which leaves while they wait at the next.
                        c.all_reduce_scalars(&mut values).map(|_| values[0])
                    })
                })
                .collect();
            let mut values = [1.0];
            gone.all_reduce_scalars(&mut values).unwrap();
            assert_eq!(values[0], 3.0);
            drop(gone);
            handles
                .into_iter()
                .map(|h| h.join().unwrap().unwrap_err().to_string())
                .collect::<Vec<_>>()
        });
        for err in errors {
            assert!(err.contains("rank 2") && err.contains("left"), "{err}");
        }
        // A receiver whose sender left is told so too, not left waiting.
        let mut pair = InProcess::group(2, 8);
        let sender = pair.pop().expect("two ranks");
        drop(sender);
        let mut values = [0.0f32; 2];
        let err = pair[0]
            .recv(1, ViewMut::host_slice(&mut values))
            .unwrap_err();
        assert!(matches!(err, CommError::PeerLeft { rank: 1 }), "{err}");
    }

    #[test]
    fn cancelling_ends_waits_in_collectives_and_receives_within_a_bound() {
        // Rank 2 never joins: rank 0 waits at the gate, rank 1 for mail.
        let ranks = InProcess::group(3, 64);
        let cancel = ranks[2].cancel_token();
        let bound = std::time::Duration::from_secs(1);
        std::thread::scope(|scope| {
            let gate = scope.spawn(|| {
                let mut values = [1.0];
                ranks[0].all_reduce_scalars(&mut values).map(drop)
            });
            let mail = scope.spawn(|| {
                let mut values = [0.0f32; 2];
                ranks[1].recv(2, ViewMut::host_slice(&mut values)).map(drop)
            });
            std::thread::sleep(std::time::Duration::from_millis(200));
            assert!(!gate.is_finished() && !mail.is_finished(), "both wait");
            let cancelled_at = std::time::Instant::now();
            cancel.cancel();
            for outcome in [gate.join().unwrap(), mail.join().unwrap()] {
                assert!(matches!(outcome, Err(CommError::Cancelled)), "{outcome:?}");
            }
            assert!(
                cancelled_at.elapsed() < bound,
                "{:?}",
                cancelled_at.elapsed()
            );
        });
        // Later collectives fail at once, on every rank.
        let mut values = [1.0];
        let err = ranks[2].all_reduce_scalars(&mut values).unwrap_err();
        assert!(err.to_string().contains("aborted"), "{err}");
    }

    #[test]
    fn oversized_exchanges_name_the_limit() {
        let errors = run(1, |c| {
            let mut out = vec![0.0; 65];
            gather(c, &[0.0; 65], &mut out).unwrap_err().to_string()
        });
        assert!(errors[0].contains("collective_elems_max"), "{}", errors[0]);
    }
}
