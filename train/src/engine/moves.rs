//! The move queue: the trace's tensors (their slots: runtime ids, homes,
//! moves in flight) and which of the two parameter and state sets is
//! current; the plan's actions issued at op boundaries, held while the CPU
//! optimizer thread uses or has yet to write their tensor or a move of it
//! is in flight, retried; writes of computed tensors; deferred
//! write-backs of cached states; every tensor returned home at the end of
//! a step; persistent tensors registered, loaded and read back.

use std::ops::Range;

use half::bf16;
use strata_runtime::RuntimeError;
use strata_runtime::{Access, Fill, TensorId, TensorMeta, Tier, Visit};
use strata_scheduler::{Action, ActionKind};

use crate::error::{Result, TrainError};

use super::env::Env;
use super::optimizer::{OptJob, Update};
use super::schedule::StepSchedule;
use super::steps::update_sets;
use super::tensors::{
    LoadBuffers, Slot, encode_states, grad_index, param_index, runtime_tier, state_index,
};

/// Elements of a group's shard loaded at a time from a Hugging Face
/// folder (16 MiB of f32): a load holds this much of a group, not the
/// group.
pub(super) const LOAD_PIECE: usize = 1 << 22;

/// Fills a range of a group's shard with master weights (a load's source).
pub(super) type Source<'a> = dyn FnMut(Range<usize>, &mut [f32]) -> Result<()> + 'a;

/// Bytes of a tensor placed on the host written at a time.
const PLACE_PIECE_BYTES: usize = 4 << 20;

/// What a persistent tensor holds when it is (re)created at home.
#[derive(Clone, Copy)]
enum Initial<'a> {
    /// All of its bytes.
    Bytes(&'a [u8]),
    /// Zeros.
    Zeros,
    /// Nothing yet: its first use writes it whole (on the host and device
    /// zeros all the same).
    Unwritten,
}

/// Whether an action releases a copy (issued after its op ran).
pub(super) fn release(action: &Action) -> bool {
    matches!(
        action.kind,
        ActionKind::Evict { .. } | ActionKind::Drop { .. }
    )
}

/// Where the step is when an action is issued: what the CPU thread has yet
/// to write, and the schedule's place (a tensor past its last use).
pub(super) struct Boundary<'a> {
    /// Per trace index, queued updates that write the tensor.
    pub(super) writing: &'a [u32],
    pub(super) schedule: &'a StepSchedule,
    /// The step, for the trace log.
    pub(super) step: u64,
}

/// The trace's tensors and the moves the plan asks of them.
pub(super) struct Moves {
    slots: Vec<Slot>,
    /// Which of the two parameter/state sets is current.
    current: usize,
    /// Groups `0..cache_groups` have their states in the state cache.
    cache_groups: usize,
    /// Planned actions that wait: on a tensor the CPU thread uses or has
    /// yet to write (a move before would carry stale bytes), or one with a
    /// move in flight. Retried at every boundary.
    held: Vec<Action>,
    /// `held` as it was when a retry began (its own buffer: no allocation).
    retry: Vec<Action>,
    /// Write-backs of fresh cached states, issued once the late updates
    /// are done (the drive reads the other states first).
    deferred: Vec<usize>,
}

impl Moves {
    /// The move queue of `slots` (none registered yet), states of groups
    /// `0..cache_groups` in the state cache.
    pub(super) fn new(slots: Vec<Slot>, cache_groups: usize, groups: usize) -> Moves {
        Moves {
            slots,
            current: 0,
            cache_groups,
            held: Vec::with_capacity(64),
            retry: Vec::with_capacity(64),
            deferred: Vec::with_capacity(groups),
        }
    }

    /// Which of the two parameter/state sets is current.
    pub(super) fn current(&self) -> usize {
        self.current
    }

    /// The other set becomes current (a step's update was kept).
    pub(super) fn flip(&mut self) {
        self.current = 1 - self.current;
    }

    /// The runtime tensor of slot `index` (registered).
    pub(super) fn id(&self, index: usize) -> TensorId {
        self.slots[index].id.expect("the tensor is registered")
    }

    /// The dtype slot `index` holds.
    pub(super) fn dtype(&self, index: usize) -> strata_device::Dtype {
        self.slots[index].meta.dtype
    }

    /// Trace tensors: how many.
    pub(super) fn len(&self) -> usize {
        self.slots.len()
    }

    /// Issues this boundary's planned `actions` of one kind: fetches and
    /// allocations before the op they were announced with runs (they
    /// overlap it), evictions and drops after it (it may still use what
    /// they release).
    pub(super) fn issue_planned(
        &mut self,
        env: &Env,
        releases: bool,
        at: &Boundary<'_>,
    ) -> Result<()> {
        for &action in at.schedule.actions() {
            if release(&action) == releases {
                self.issue(env, action, at)?;
            }
        }
        Ok(())
    }

    /// Whether any action is held.
    pub(super) fn has_held(&self) -> bool {
        !self.held.is_empty()
    }

    /// Issues the held actions again (those still waiting are held again).
    pub(super) fn retry_held(&mut self, env: &Env, at: &Boundary<'_>) -> Result<()> {
        std::mem::swap(&mut self.held, &mut self.retry);
        for k in 0..self.retry.len() {
            let action = self.retry[k];
            self.issue(env, action, at)?;
        }
        self.retry.clear();
        Ok(())
    }

    /// Carries out one planned action. The plan is advice: a tensor in use
    /// or already moving keeps its place, and the op that needs it fetches
    /// it on demand.
    fn issue(&mut self, env: &Env, action: Action, at: &Boundary<'_>) -> Result<()> {
        let runtime = env.runtime();
        let index = action.tensor as usize;
        let moving = self.slots[index]
            .pending
            .as_ref()
            .is_some_and(|(done, _)| !done.is_done());
        if at.writing[index] > 0 || moving {
            // After the update writes it, or the move in flight lands.
            self.held.push(action);
            return Ok(());
        }
        self.settle_pending(index)?;
        let Some(id) = self.slots[index].id else {
            return Ok(());
        };
        let outcome = match action.kind {
            // A copy, up or down: every other copy stays.
            ActionKind::Fetch { to, .. } => {
                let to = runtime_tier(to);
                runtime.copy_to(id, to).map(|done| {
                    self.slots[index].pending = Some((done, to));
                })
            }
            // Only the source copy goes: a copy above it stays in use. A
            // fresh cached state keeps its host copy for the next step's
            // update; its write-back waits for `write_back_deferred`.
            ActionKind::Evict { from, to } => {
                let to = runtime_tier(to);
                let from = runtime_tier(from);
                if self.slots[index].fresh && from == Tier::Host {
                    if !self.deferred.contains(&index) {
                        self.deferred.push(index);
                    }
                    Ok(())
                } else {
                    runtime.evict(id, from, to).map(|done| {
                        self.slots[index].pending = Some((done, to));
                    })
                }
            }
            ActionKind::Drop { tier } => {
                let tier = runtime_tier(tier);
                // One look: the other copy may be spilled by a mover between
                // a residency check and a release.
                match runtime.release_duplicate(id, tier) {
                    Ok(false)
                        if self.slots[index].home.is_none() && at.schedule.past_last_use(index) =>
                    {
                        // A tensor of the step after its last use.
                        self.slots[index].id = None;
                        runtime.free(id)
                    }
                    // The only copy otherwise stays.
                    outcome => outcome.map(|_| ()),
                }
            }
            ActionKind::Alloc { .. } => Ok(()),
        };
        tracing::trace!(
            "step {} op {}: {:?} {} -> {:?}",
            at.step,
            at.schedule.position(),
            action.kind,
            self.slots[index].meta.name,
            outcome.as_ref().err()
        );
        match outcome {
            Ok(()) => Ok(()),
            Err(RuntimeError::InUse { .. }) if release(&action) => {
                // The CPU optimizer still holds it: release it once done.
                self.held.push(action);
                Ok(())
            }
            Err(
                RuntimeError::InUse { .. }
                | RuntimeError::Moving { .. }
                | RuntimeError::NotResident { .. },
            ) => Ok(()),
            Err(err) => Err(err.into()),
        }
    }

    /// Starts writing the fresh cached states home, keeping their host
    /// copies. One in use or moving is left to `return_home`, which waits
    /// for its home copy.
    pub(super) fn write_back_deferred(&mut self, env: &Env) -> Result<()> {
        for k in 0..self.deferred.len() {
            let index = self.deferred[k];
            self.settle_pending(index)?;
            let id = self.slots[index].id.expect("written this step");
            match env.runtime().copy_to(id, Tier::Nvme) {
                Ok(done) => self.slots[index].pending = Some((done, Tier::Nvme)),
                Err(RuntimeError::InUse { .. } | RuntimeError::Moving { .. }) => {}
                Err(err) => return Err(err.into()),
            }
        }
        self.deferred.clear();
        Ok(())
    }

    fn settle_pending(&mut self, index: usize) -> Result<()> {
        match self.slots[index].pending.take() {
            Some((done, _)) => Ok(done.wait()?),
            None => Ok(()),
        }
    }

    /// Waits for a planned fetch of the tensor to `tier`, where an op is
    /// about to use it; a move elsewhere (a write-back) is left in flight.
    pub(super) fn settle_fetch(&mut self, index: usize, tier: Tier) -> Result<()> {
        match &self.slots[index].pending {
            Some((_, to)) if *to == tier => self.settle_pending(index),
            _ => Ok(()),
        }
    }

    /// The tensor of slot `index`, about to be written whole on the device
    /// (registered first, unfilled, when the step has none yet).
    pub(super) fn tensor_to_write(&mut self, env: &Env, index: usize) -> Result<TensorId> {
        self.settle_pending(index)?;
        Ok(match self.slots[index].id {
            Some(id) => id,
            None => {
                // Written whole by the caller: no zero fill first.
                let id = env
                    .runtime()
                    .register_unfilled(self.slots[index].meta.clone(), Tier::Device)?;
                self.slots[index].id = Some(id);
                id
            }
        })
    }

    /// Waits for moves in flight, frees the step's own tensors and puts
    /// every persistent one back home alone.
    pub(super) fn return_home(&mut self, env: &Env) -> Result<()> {
        let runtime = env.runtime();
        self.held.clear();
        self.deferred.clear();
        for index in 0..self.slots.len() {
            self.settle_pending(index)?;
        }
        for index in 0..self.slots.len() {
            let Some(id) = self.slots[index].id else {
                continue;
            };
            match self.slots[index].home {
                None => {
                    runtime.free(id)?;
                    self.slots[index].id = None;
                }
                Some(home) => {
                    let keep = std::mem::take(&mut self.slots[index].fresh);
                    if !runtime.residency(id)?.contains(&home) {
                        runtime.copy_to(id, home)?.wait()?;
                    }
                    for tier in runtime.residency(id)? {
                        if tier != home && !(keep && tier == Tier::Host) {
                            runtime.release(id, tier)?;
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// Group `g`'s update from one set into the other, on `tier`, for the
    /// optimizer lane: a late update's output among the cached groups is
    /// marked fresh (its host copy stays for the next step's update).
    pub(super) fn update_job(
        &mut self,
        env: &Env,
        g: usize,
        late: bool,
        tier: Tier,
        update: &Update,
    ) -> OptJob {
        let (from, to) = update_sets(self.current, late);
        self.slots[state_index(g, to)].fresh = late && g < self.cache_groups;
        let outputs = [state_index(g, to), param_index(g, to)];
        OptJob {
            group: g,
            late,
            outputs,
            tier,
            grad: self.id(grad_index(g)),
            state_in: self.id(state_index(g, from)),
            state_out: self.id(state_index(g, to)),
            param_out: self.id(param_index(g, to)),
            update: *update,
            state_dtype: env.config().optim.state_dtype,
            seed: env.config().rounding_seed(),
            grad_dtype: self.slots[grad_index(g)].meta.dtype,
        }
    }

    /// Registers every persistent tensor at home with its initial values:
    /// the model's initialization, or `model.init_from`'s weights, each
    /// rank reading only its shard of each group, one group at a time.
    pub(super) fn initialize(&mut self, env: &Env) -> Result<()> {
        let (shards, rank) = (env.shards(), env.shard_rank());
        let seed = env.config().train.seed;
        let folder = match &env.config().model.init_from {
            Some(dir) => {
                let folder = crate::hf::HfFolder::open(dir)?;
                folder.check(env.model())?;
                Some(folder)
            }
            None => None,
        };
        let specs = env.model().groups();
        let (mut values, mut buffers) = (Vec::new(), LoadBuffers::default());
        for (g, group) in env.groups().iter().enumerate() {
            match &folder {
                Some(folder) => {
                    // This rank's shard, a piece at a time straight from the
                    // mapped files (zero past the group's end): a group is
                    // never held whole.
                    let base = rank * group.shard;
                    let mut source = |range: Range<usize>, out: &mut [f32]| -> Result<()> {
                        let (start, end) = (
                            (base + range.start).min(group.params),
                            (base + range.end).min(group.params),
                        );
                        out.fill(0.0);
                        folder.read(&specs[g], start..end, &mut out[..end - start])
                    };
                    self.load_group_from(env, g, LOAD_PIECE, &mut source, None)?;
                    folder.release(&specs[g]);
                }
                None => {
                    values.clear();
                    values.resize(group.padded(shards), 0.0f32);
                    env.model().init(g, seed, &mut values[..group.params]);
                    let master = &values[rank * group.shard..(rank + 1) * group.shard];
                    self.load_group(env, g, master, None, &mut buffers)?;
                }
            }
            self.place_persistent(env, grad_index(g), Initial::Zeros)?;
        }
        Ok(())
    }

    /// [`Moves::load_group`] with the master weights from `source` (which
    /// fills any range of the shard), `piece` elements at a time, and the
    /// states as `states` writes them (any range of the state tensor's
    /// bytes before its padding: master, m and v as they are kept) or else
    /// the masters and zero moments: the same bytes, without the group's
    /// values in memory.
    pub(super) fn load_group_from(
        &mut self,
        env: &Env,
        g: usize,
        piece: usize,
        source: &mut Source<'_>,
        mut states: Option<&mut Fill<'_, TrainError>>,
    ) -> Result<()> {
        let n = env.groups()[g].shard;
        let dtype = env.config().optim.state_dtype;
        let piece = piece.clamp(1, n.max(1));
        let mut values = vec![0f32; piece];
        for set in 0..2 {
            let (p, s) = (param_index(g, set), state_index(g, set));
            if set != self.current {
                self.place_persistent(env, p, Initial::Unwritten)?;
                self.place_persistent(env, s, Initial::Unwritten)?;
                continue;
            }
            // The bf16 compute copy, as `load_group` narrows it.
            self.place_persistent_with(env, p, u64::MAX, &mut |at, out| {
                narrow_from(source, &mut values, at, out, 2)
            })?;
            if let Some(states) = states.as_mut() {
                let end = (n * (dtype.master_bytes() + 2 * dtype.moment_bytes())) as u64;
                self.place_persistent_with(env, s, end, states)?;
                continue;
            }
            // The states: the masters, then zero moments and padding (not
            // written on NVMe: the store zeroes them).
            let width = dtype.master_bytes();
            self.place_persistent_with(env, s, (n * width) as u64, &mut |at, out| {
                narrow_from(source, &mut values, at, out, width)
            })?;
        }
        Ok(())
    }

    /// Writes group `g`'s shard: master weights, moments (zero when none),
    /// and the bf16 compute copy, into the current set; the other set is
    /// registered at home, to be overwritten by the next update.
    pub(super) fn load_group(
        &mut self,
        env: &Env,
        g: usize,
        master: &[f32],
        moments: Option<(&[f32], &[f32])>,
        buffers: &mut LoadBuffers,
    ) -> Result<()> {
        debug_assert_eq!(master.len(), env.groups()[g].shard);
        encode_states(
            env.config().optim.state_dtype,
            master,
            moments,
            &mut buffers.state,
        );
        // The bf16 compute copy, to nearest even as `half` rounds, in SIMD.
        buffers.param.clear();
        buffers.param.resize(master.len(), bf16::ZERO);
        strata_optim::narrow(
            strata_optim::Isa::chosen(),
            master,
            strata_optim::LowPrecisionMut::Bf16(&mut buffers.param),
        );
        for set in 0..2 {
            let (p, s) = (param_index(g, set), state_index(g, set));
            if set != self.current {
                self.place_persistent(env, p, Initial::Unwritten)?;
                self.place_persistent(env, s, Initial::Unwritten)?;
                continue;
            }
            let param: &[u8] = bytemuck::cast_slice(&buffers.param);
            self.place_persistent(env, p, Initial::Bytes(param))?;
            self.place_persistent(env, s, Initial::Bytes(&buffers.state))?;
        }
        Ok(())
    }

    /// (Re)creates a persistent tensor at its home with the bytes
    /// `fill(offset, bytes)` writes before `zeros_from`, and zeros past
    /// it. On NVMe straight there, a chunk at a time (the tensor never
    /// whole in host memory, its zeros not written); on the host a piece at
    /// a time into its copy; on the device whole, then written.
    fn place_persistent_with(
        &mut self,
        env: &Env,
        index: usize,
        zeros_from: u64,
        fill: &mut Fill<'_, TrainError>,
    ) -> Result<()> {
        let runtime = env.runtime();
        let (home, meta) = self.free_slot(env, index)?;
        let len = meta.len_bytes();
        let filled = zeros_from.min(len) as usize;
        // The slot names the tensor as soon as it is registered: one that
        // fails to fill is freed with the rest.
        match home {
            Tier::Nvme => {
                let id = runtime.register_on_nvme(meta, zeros_from, fill)?;
                self.slots[index].id = Some(id);
            }
            Tier::Device => {
                let mut whole = vec![0u8; len as usize];
                fill(0, &mut whole[..filled])?;
                let id = runtime.register_unfilled(meta, Tier::Device)?;
                self.slots[index].id = Some(id);
                runtime
                    .acquire(id, Tier::Device, Access::Write)?
                    .write_from(&whole)?;
            }
            Tier::Host => {
                let id = runtime.register_unfilled(meta, Tier::Host)?;
                self.slots[index].id = Some(id);
                let mut guard = runtime.acquire(id, Tier::Host, Access::Write)?;
                let mut piece = vec![0u8; (PLACE_PIECE_BYTES as u64).min(len) as usize];
                let mut at = 0;
                while at < len as usize {
                    let n = (len as usize - at).min(piece.len());
                    let end = filled.clamp(at, at + n);
                    fill(at as u64, &mut piece[..end - at])?;
                    piece[end - at..n].fill(0);
                    guard.write_range(at as u64, &piece[..n])?;
                    at += n;
                }
            }
        }
        Ok(())
    }

    /// Frees slot `index`'s tensor, if any, for it to be registered anew:
    /// its home and description.
    fn free_slot(&mut self, env: &Env, index: usize) -> Result<(Tier, TensorMeta)> {
        if let Some(id) = self.slots[index].id.take() {
            env.runtime().free(id)?;
        }
        let slot = &self.slots[index];
        let home = slot.home.expect("persistent tensors have a home");
        Ok((home, slot.meta.clone()))
    }

    /// (Re)creates a persistent tensor at its home with `initial` contents.
    fn place_persistent(&mut self, env: &Env, index: usize, initial: Initial<'_>) -> Result<()> {
        match initial {
            Initial::Bytes(data) => {
                self.place_persistent_with(env, index, u64::MAX, &mut |at, bytes| {
                    bytes.copy_from_slice(&data[at as usize..at as usize + bytes.len()]);
                    Ok(())
                })
            }
            // Zeros on the host and device (a fill of every byte), written
            // by the store without their bytes on NVMe; the set an update
            // writes first is not written at all on NVMe, where a read
            // before that write fails rather than return stale bytes.
            Initial::Zeros | Initial::Unwritten => {
                let runtime = env.runtime();
                let (home, meta) = self.free_slot(env, index)?;
                let id = match (initial, home) {
                    (Initial::Unwritten, Tier::Nvme) => runtime.register_unfilled(meta, home)?,
                    _ => runtime.register(meta, home)?,
                };
                self.slots[index].id = Some(id);
                Ok(())
            }
        }
    }

    /// Group `g`'s current master weights and moments as they are kept
    /// (`encode_states`' bytes: master, m and v in the state dtype's
    /// formats, then padding), handed to `visit(offset, bytes)` in order
    /// and left at home: from the host copy where there is one, straight
    /// from the drive a chunk at a time where there is not (never whole in
    /// memory), whole from the device's.
    pub(super) fn stream_state(
        &self,
        env: &Env,
        g: usize,
        visit: &mut Visit<'_, TrainError>,
    ) -> Result<()> {
        let runtime = env.runtime();
        let id = self.id(state_index(g, self.current));
        let resident = runtime.residency(id)?;
        if resident.contains(&Tier::Host) {
            let guard = runtime.acquire(id, Tier::Host, Access::Read)?;
            let mut failed = None;
            guard.for_each_chunk(&mut |at, bytes| {
                if failed.is_none() {
                    failed = visit(at, bytes).err();
                }
            })?;
            return failed.map_or(Ok(()), Err);
        }
        if resident.contains(&Tier::Nvme) {
            return runtime.read_from_nvme(id, visit);
        }
        let guard = runtime.acquire(id, Tier::Device, Access::Read)?;
        let mut whole = vec![0u8; guard.len_bytes() as usize];
        guard.read_into(&mut whole)?;
        visit(0, &whole)
    }
}

/// Fills `out`, the bytes from `at` of a tensor of `width`-byte elements,
/// with master weights from `source` narrowed to `width` bytes, a piece of
/// `values`' length at a time.
fn narrow_from(
    source: &mut Source<'_>,
    values: &mut [f32],
    at: u64,
    out: &mut [u8],
    width: usize,
) -> Result<()> {
    let first = at as usize / width;
    for (k, out) in out.chunks_mut(width * values.len()).enumerate() {
        let start = first + k * values.len();
        let values = &mut values[..out.len() / width];
        source(start..start + values.len(), values)?;
        crate::hf::narrow(values, out);
    }
    Ok(())
}
