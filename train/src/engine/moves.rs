//! The move queue: the plan's actions issued at op boundaries, held
//! while the CPU optimizer thread uses or has yet to write their tensor
//! or a move of it is in flight, retried; writes of computed tensors;
//! deferred write-backs; every tensor returned home at the end of a step.

use strata_device::View;
use strata_kernels::Backend;
use strata_runtime::RuntimeError;
use strata_runtime::{Access, Guard, Runtime, TensorId, Tier};
use strata_scheduler::{Action, ActionKind, Follow, Op};

use crate::error::Result;

use super::Engine;
use super::tensors::runtime_tier;

/// A guard on the tensor's copy in `tier`, fetching it there first when it
/// is not (a demand fetch: the plan did not bring it, or a spill took it).
pub(super) fn guard(runtime: &Runtime, id: TensorId, tier: Tier, access: Access) -> Result<Guard> {
    loop {
        match runtime.acquire(id, tier, access) {
            Ok(guard) => return Ok(guard),
            Err(RuntimeError::NotResident { .. }) => match runtime.move_to(id, tier) {
                Ok(done) => done.wait()?,
                Err(RuntimeError::Moving { .. }) => {}
                Err(err) => return Err(err.into()),
            },
            Err(err) => return Err(err.into()),
        }
    }
}

pub(super) fn read_f32(runtime: &Runtime, id: TensorId, tier: Tier, out: &mut [f32]) -> Result<()> {
    Ok(guard(runtime, id, tier, Access::Read)?.read_into(bytemuck::cast_slice_mut(out))?)
}

/// Engine tensors the backend reads or writes in place live on the device.
const ON_DEVICE: &str = "the engine computes on device-tier copies";

/// Runs `read` on the backend over the device copy of `id` (fetched there
/// first when it is not), ordered after the copy's arrival, and hands the
/// copy the fence of that work.
pub(super) fn with_device_view<R>(
    runtime: &Runtime,
    backend: &dyn Backend,
    id: TensorId,
    dtype: strata_device::Dtype,
    read: impl FnOnce(View<'_>) -> Result<R>,
) -> Result<R> {
    let mut held = guard(runtime, id, Tier::Device, Access::Read)?;
    backend.wait(held.ready())?;
    let out = read(held.device_view(dtype).expect(ON_DEVICE))?;
    held.used_until(backend.record()?);
    Ok(out)
}

/// Writes `source` (as many elements as the tensor holds of `dtype`) whole
/// into the tensor's device copy, device to device on the compute stream,
/// without reading its old bytes: copied, or cast (rounded to nearest
/// even) where `dtype` is not the source's.
pub(super) fn write_from_view(
    runtime: &Runtime,
    backend: &dyn Backend,
    id: TensorId,
    source: View<'_>,
    dtype: strata_device::Dtype,
) -> Result<()> {
    runtime.overwrite_with(id, Tier::Device, |held| -> Result<()> {
        backend.wait(held.ready())?;
        let target = held.device_view_mut(dtype).expect(ON_DEVICE);
        match source.dtype() == dtype {
            true => backend.copy(source, target)?,
            false => backend.cast(source, target)?,
        }
        held.used_until(backend.record()?);
        Ok(())
    })
}

/// Whether an action releases a copy (issued after its op ran).
pub(super) fn release(action: &Action) -> bool {
    matches!(
        action.kind,
        ActionKind::Evict { .. } | ActionKind::Drop { .. }
    )
}

impl Engine {
    /// Retries the held actions, then issues this boundary's planned ones
    /// of one kind: fetches and allocations before the op they were
    /// announced with runs (they overlap it), evictions and drops after it
    /// (it may still use what they release).
    pub(super) fn issue_actions(&mut self, releases: bool) -> Result<()> {
        self.retry_held()?;
        for k in 0..self.actions.len() {
            let action = self.actions[k];
            if release(&action) == releases {
                self.issue(action)?;
            }
        }
        Ok(())
    }

    /// Issues the held actions again (those still waiting are held again).
    pub(super) fn retry_held(&mut self) -> Result<()> {
        if self.held.is_empty() {
            return Ok(());
        }
        self.poll_worker();
        std::mem::swap(&mut self.held, &mut self.retry);
        for k in 0..self.retry.len() {
            let action = self.retry[k];
            self.issue(action)?;
        }
        self.retry.clear();
        Ok(())
    }

    /// Carries out one planned action. The plan is advice: a tensor in use
    /// or already moving keeps its place, and the op that needs it fetches
    /// it on demand.
    pub(super) fn issue(&mut self, action: Action) -> Result<()> {
        let index = action.tensor as usize;
        let moving = self.slots[index]
            .pending
            .as_ref()
            .is_some_and(|(done, _)| !done.is_done());
        if self.writing[index] > 0 || moving {
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
                self.runtime.copy_to(id, to).map(|done| {
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
                    self.runtime.evict(id, from, to).map(|done| {
                        self.slots[index].pending = Some((done, to));
                    })
                }
            }
            ActionKind::Drop { tier } => {
                let tier = runtime_tier(tier);
                // One look: the other copy may be spilled by a mover between
                // a residency check and a release.
                match self.runtime.release_duplicate(id, tier) {
                    Ok(false)
                        if self.slots[index].home.is_none()
                            && self.last_use[self.shape][index] <= self.position =>
                    {
                        // A tensor of the step after its last use.
                        self.slots[index].id = None;
                        self.runtime.free(id)
                    }
                    // The only copy otherwise stays.
                    outcome => outcome.map(|_| ()),
                }
            }
            ActionKind::Alloc { .. } => Ok(()),
        };
        tracing::trace!(
            "step {} op {}: {:?} {} -> {:?}",
            self.step,
            self.position,
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
    pub(super) fn write_back_deferred(&mut self) -> Result<()> {
        for k in 0..self.deferred.len() {
            let index = self.deferred[k];
            self.settle_pending(index)?;
            let id = self.slots[index].id.expect("written this step");
            match self.runtime.copy_to(id, Tier::Nvme) {
                Ok(done) => self.slots[index].pending = Some((done, Tier::Nvme)),
                Err(RuntimeError::InUse { .. } | RuntimeError::Moving { .. }) => {}
                Err(err) => return Err(err.into()),
            }
        }
        self.deferred.clear();
        Ok(())
    }

    pub(super) fn settle_pending(&mut self, index: usize) -> Result<()> {
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

    /// Tells the tracker the op starts and issues the plan's actions for
    /// the boundary after it.
    pub(super) fn announce(&mut self, op: &Op) -> Result<()> {
        self.position += 1;
        self.actions.clear();
        if let Follow::Plan(actions) = self.tracker.op(op)? {
            self.actions.extend_from_slice(actions);
        }
        self.issue_actions(false)
    }

    /// The tensor of slot `index`, about to be written whole on the device
    /// (registered first, unfilled, when the step has none yet).
    pub(super) fn tensor_to_write(&mut self, index: usize) -> Result<TensorId> {
        self.settle_pending(index)?;
        Ok(match self.slots[index].id {
            Some(id) => id,
            None => {
                // Written whole by the caller: no zero fill first.
                let id = self
                    .runtime
                    .register_unfilled(self.slots[index].meta.clone(), Tier::Device)?;
                self.slots[index].id = Some(id);
                id
            }
        })
    }

    /// Waits for moves in flight, frees the step's own tensors and puts
    /// every persistent one back home alone.
    pub(super) fn return_home(&mut self) -> Result<()> {
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
                    self.runtime.free(id)?;
                    self.slots[index].id = None;
                }
                Some(home) => {
                    let keep = std::mem::take(&mut self.slots[index].fresh);
                    if !self.runtime.residency(id)?.contains(&home) {
                        self.runtime.copy_to(id, home)?.wait()?;
                    }
                    for tier in self.runtime.residency(id)? {
                        if tier != home && !(keep && tier == Tier::Host) {
                            self.runtime.release(id, tier)?;
                        }
                    }
                }
            }
        }
        Ok(())
    }
}
