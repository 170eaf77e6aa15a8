//! The optimizer lane: the CPU thread that runs AdamW on each group's
//! shard out of place (its speculative and late paths), how updates are
//! queued to it and waited for, and the step's decision (global norm,
//! overflow skip, clip).

use std::sync::Arc;
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::thread::JoinHandle;
use std::time::Instant;

use strata_optim::{
    AdamCoefficients, GradNorm, LowPrecisionMut, Moments, MomentsRef, OutOfPlaceShard, Pool,
    PoolConfig, Rounding, Split, StepDecision, Values, decide_step,
};
use strata_runtime::RuntimeError;
use strata_runtime::{Access, Guard, Runtime, TensorId, Tier};

use crate::error::{Result, TrainError, os};

use super::Engine;
use super::moves::guard;
use strata_scheduler::StepOp;

use super::config::StateDtype;
use super::steps::{optimizer_label, update_sets};
use super::tensors::Group;
use super::tensors::{grad_index, param_index, state_index};
use half::bf16;

/// An optimizer step of one group, for the CPU thread (or run inline when
/// the optimizer states live on the device).
pub(super) struct OptJob {
    pub(super) group: usize,
    /// The last step's update, run in this step's forward.
    pub(super) late: bool,
    /// Trace indices of the tensors it writes.
    pub(super) outputs: [usize; 2],
    pub(super) tier: Tier,
    pub(super) grad: TensorId,
    pub(super) state_in: TensorId,
    pub(super) state_out: TensorId,
    pub(super) param_out: TensorId,
    pub(super) update: Update,
    /// How the states are kept, and the seed of their rounding.
    pub(super) state_dtype: StateDtype,
    pub(super) seed: u64,
    /// The gradients' dtype (f32, or bf16 into the fused step).
    pub(super) grad_dtype: strata_device::Dtype,
}

/// One optimizer step's coefficients (without and with weight decay) and
/// its Adam step number, which also keys the stochastic rounding's bits.
#[derive(Clone, Copy, Debug)]
pub(super) struct Update {
    pub(super) coefficients: [AdamCoefficients; 2],
    pub(super) adam_step: u64,
}

/// The optimizer's threads for one rank: `threads` (0: the physical cores
/// this process may use, less two for the kernel-launch thread and the
/// movers, shared among `ranks` in-process ranks; at least one). Pinned to
/// cores only with one rank (ranks' pools would share the same cores).
pub(super) fn optimizer_pool(threads: u32, ranks: usize) -> Result<Pool> {
    let threads = match threads {
        0 => {
            let cores = strata_optim::topology::CpuTopology::detect().core_count();
            (cores.saturating_sub(2) / ranks.max(1)).max(1)
        }
        n => n as usize,
    };
    Ok(Pool::new(PoolConfig {
        threads: Some(threads),
        pin: ranks == 1 && threads > 1,
        ..PoolConfig::default()
    })?)
}

/// The optimizer pool's threads, lent to the runtime to commit the pinned
/// pool they will update ([`strata_runtime::commit_spread`]).
pub(super) struct PoolSpread<'a>(pub(super) &'a Pool);

impl strata_runtime::Spread for PoolSpread<'_> {
    fn threads(&self) -> usize {
        self.0.threads()
    }

    fn each(&self, work: &(dyn Fn(usize) + Sync)) {
        self.0.on_each_thread(work)
    }
}

/// Group `job.group`'s update, straight from the gradient and the input
/// states' copies in `job.tier` into the outputs': out of place, every
/// stretch of host memory in one pool call. The outputs are written whole:
/// nothing of their old bytes is read or fetched. Returns when the update
/// itself began: every input and output at hand (a gradient still on its
/// way from the device is waited for before, and is not the lane's time).
pub(super) fn run_optimizer(
    runtime: &Runtime,
    pool: &Pool,
    groups: &[Group],
    job: &OptJob,
) -> Result<Instant> {
    let inputs = [
        guard(runtime, job.grad, job.tier, Access::Read)?,
        guard(runtime, job.state_in, job.tier, Access::Read)?,
    ];
    runtime.overwrite_with(job.param_out, job.tier, |param_out| {
        runtime.overwrite_with(job.state_out, job.tier, |state_out| {
            adam_group(
                pool,
                &groups[job.group],
                job,
                &inputs,
                [state_out, param_out],
            )
        })
    })
}

/// An update of a group whose fp32 states live on the device, run by the
/// backend on the device copies (the engine's inline optimizer): the input
/// states copied to the output set, then AdamW in place there per run of
/// equal weight decay, writing the bf16 parameters. The same arithmetic as
/// [`adam_group`]'s, element by element; on a GPU, one compute stream and
/// no host copy.
pub(super) fn run_optimizer_on_backend(
    runtime: &Runtime,
    backend: &dyn strata_kernels::Backend,
    groups: &[Group],
    job: &OptJob,
) -> Result<()> {
    use strata_device::Dtype;
    const ON_DEVICE: &str = "inline updates run on device-tier copies";
    assert_eq!(
        job.state_dtype,
        StateDtype::Fp32,
        "device updates keep fp32 states"
    );
    let group = &groups[job.group];
    let n = group.shard;
    let mut grad = guard(runtime, job.grad, Tier::Device, Access::Read)?;
    let mut state_in = guard(runtime, job.state_in, Tier::Device, Access::Read)?;
    backend.wait(grad.ready())?;
    backend.wait(state_in.ready())?;
    runtime.overwrite_with(job.param_out, Tier::Device, |param_out| -> Result<()> {
        runtime.overwrite_with(job.state_out, Tier::Device, |state_out| -> Result<()> {
            backend.wait(param_out.ready())?;
            backend.wait(state_out.ready())?;
            {
                let grads = grad.device_view(Dtype::F32).expect(ON_DEVICE);
                let mut params = param_out.device_view_mut(Dtype::Bf16).expect(ON_DEVICE);
                let mut states = state_out.device_view_mut(Dtype::F32).expect(ON_DEVICE);
                backend.copy(
                    state_in.device_view(Dtype::F32).expect(ON_DEVICE),
                    states.reborrow(),
                )?;
                let [mut master, mut m, mut v] = states.split_parts([n, n, n]);
                for (run, decays) in &group.runs {
                    backend.adamw(
                        &job.update.coefficients[usize::from(*decays)],
                        grads.range(run.clone()),
                        master.reborrow().range(run.clone()),
                        m.reborrow().range(run.clone()),
                        v.reborrow().range(run.clone()),
                        params.reborrow().range(run.clone()),
                    )?;
                }
            }
            let done = backend.record()?;
            state_out.used_until(done.clone());
            param_out.used_until(done);
            Ok(())
        })
    })?;
    let done = backend.record()?;
    grad.used_until(done.clone());
    state_in.used_until(done);
    Ok(())
}

/// One shard's AdamW: `[grad, states in]` to `[states out, params out]`.
/// States are master weights (f32, or bf16), then m and v (f32, or bf16),
/// each `shard` long, in `job.state_dtype`'s formats; params are `shard`
/// bf16. bf16 states are rounded stochastically. Returns when the update
/// began, after every copy it reads or writes was ready.
pub(super) fn adam_group(
    pool: &Pool,
    group: &Group,
    job: &OptJob,
    inputs: &[Guard; 2],
    outputs: [&mut Guard; 2],
) -> Result<Instant> {
    // The masters are f32 or bf16 by the state dtype.
    match job.state_dtype.master_bytes() {
        4 => adam_group_as::<f32>(pool, group, job, inputs, outputs),
        _ => adam_group_as::<bf16>(pool, group, job, inputs, outputs),
    }
}

/// [`adam_group`] with masters of type `P`: every stretch of host memory
/// in which the gradient and all the states are contiguous, cut again
/// where the weight decay changes, goes to the pool in one call, which
/// cuts the group's elements across its threads (the stretches are host
/// chunks, far shorter than a call the pool would split on its own) and
/// streams the outputs past the caches by the group's whole length.
fn adam_group_as<P: strata_optim::Element + bytemuck::Pod>(
    pool: &Pool,
    group: &Group,
    job: &OptJob,
    [grad, state_in]: &[Guard; 2],
    mut outputs: [&mut Guard; 2],
) -> Result<Instant> {
    let n = group.shard as u64;
    let dtype = job.state_dtype;
    let (master, moment) = (std::mem::size_of::<P>() as u64, dtype.moment_bytes() as u64);
    let grad_bytes = job.grad_dtype.bytes();
    let (m_at, v_at) = (master * n, (master + moment) * n);
    let mut shards: Vec<OutOfPlaceShard<'_, P>> = Vec::new();
    let mut run = 0;
    strata_runtime::zip_ranges(
        [
            (grad, 0, grad_bytes),
            (state_in, 0, master),
            (state_in, m_at, moment),
            (state_in, v_at, moment),
        ],
        &mut outputs,
        [
            (0, 0, master),
            (0, m_at, moment),
            (0, v_at, moment),
            (1, 0, 2),
        ],
        n,
        |first, [g, p0, m0, v0], [p, m, v, out]| {
            let (moments_in, moments_out) = moment_views(moment, [m0, v0], [m, v]);
            let stretch = OutOfPlaceShard {
                coefficients: &job.update.coefficients[0],
                params_in: bytemuck::cast_slice(p0),
                moments_in,
                grads: match grad_bytes {
                    4 => Values::F32(bytemuck::cast_slice(g)),
                    _ => Values::Bf16(bytemuck::cast_slice(g)),
                },
                params_out: bytemuck::cast_slice_mut(p),
                moments_out,
                out: Some(LowPrecisionMut::Bf16(bytemuck::cast_slice_mut(out))),
                rounding: match dtype.stochastic() {
                    false => Rounding::Nearest,
                    true => Rounding::Stochastic {
                        seed: job.seed,
                        step: job.update.adam_step,
                        first: group.first + first,
                    },
                },
            };
            cut_at_decay_runs(stretch, first as usize, group, job, &mut run, &mut shards);
        },
    )?;
    let began = Instant::now();
    pool.adam_step_out_of_place_many(shards);
    Ok(began)
}

/// The moments read and written, as f32 (`moment` 4 bytes) or bf16.
fn moment_views<'a>(
    moment: u64,
    [m0, v0]: [&'a [u8]; 2],
    [m, v]: [&'a mut [u8]; 2],
) -> (MomentsRef<'a>, Moments<'a>) {
    if moment == 4 {
        (
            MomentsRef::F32 {
                m: bytemuck::cast_slice(m0),
                v: bytemuck::cast_slice(v0),
            },
            Moments::F32 {
                m: bytemuck::cast_slice_mut(m),
                v: bytemuck::cast_slice_mut(v),
            },
        )
    } else {
        (
            MomentsRef::Bf16 {
                m: bytemuck::cast_slice(m0),
                v: bytemuck::cast_slice(v0),
            },
            Moments::Bf16 {
                m: bytemuck::cast_slice_mut(m),
                v: bytemuck::cast_slice_mut(v),
            },
        )
    }
}

/// Pushes `stretch` (the group's elements from `first` on) to `shards`,
/// cut where the weight decay changes, each part with its coefficients.
/// The runs cover the shard in order, and the stretches come in order:
/// `run` is the run the last stretch ended in.
fn cut_at_decay_runs<'a, P>(
    mut stretch: OutOfPlaceShard<'a, P>,
    first: usize,
    group: &Group,
    job: &'a OptJob,
    run: &mut usize,
    shards: &mut Vec<OutOfPlaceShard<'a, P>>,
) {
    let (mut at, end) = (first, first + stretch.params_out.len());
    loop {
        while group.runs[*run].0.end <= at {
            *run += 1;
        }
        let (range, decays) = &group.runs[*run];
        stretch.coefficients = &job.update.coefficients[usize::from(*decays)];
        if range.end >= end {
            shards.push(stretch);
            return;
        }
        let (here, rest) = stretch.split_at(range.end - at);
        shards.push(here);
        (stretch, at) = (rest, range.end);
    }
}

/// A finished update: its group, the trace indices it wrote, the outcome,
/// and the nanoseconds it took.
pub(super) type Done = (usize, [usize; 2], Result<()>, u64);

/// Updates of one group sent to the CPU thread and not yet booked: its
/// update of the step before (late, in this step's forward) and this
/// step's. The channels both ways hold this many per group, so neither
/// side ever blocks on a full one.
pub(super) const UPDATES_PER_GROUP_MAX: u32 = 2;

/// The CPU optimizer thread.
pub(super) struct CpuWorker {
    pub(super) jobs: Option<SyncSender<OptJob>>,
    pub(super) done: Receiver<Done>,
    pub(super) thread: Option<JoinHandle<()>>,
    /// Updates sent and not yet reported back, per group.
    pub(super) outstanding: Vec<u32>,
    /// Parameters updated and time spent updating them since the last
    /// step report (the lane's rate).
    pub(super) lane: LaneRate,
}

/// Parameters the optimizer lane updated and the time it spent on them.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct LaneRate {
    pub(super) params: u64,
    pub(super) busy_ns: u64,
}

impl LaneRate {
    /// Parameters per second (0 when nothing ran), and a reset.
    pub(super) fn take(&mut self) -> f64 {
        let rate = std::mem::take(self);
        if rate.busy_ns == 0 {
            0.0
        } else {
            rate.params as f64 / (rate.busy_ns as f64 / 1e9)
        }
    }
}

impl CpuWorker {
    pub(super) fn start(
        runtime: Arc<Runtime>,
        pool: Pool,
        groups: Arc<Vec<Group>>,
        wake: bool,
    ) -> Result<CpuWorker> {
        let outstanding = vec![0; groups.len()];
        let bound = groups.len() * UPDATES_PER_GROUP_MAX as usize;
        let (jobs, receiver) = sync_channel::<OptJob>(bound);
        let (results, done) = sync_channel(bound);
        let thread = std::thread::Builder::new()
            .name("strata-cpu-optim".into())
            .spawn(move || {
                strata_runtime::set_caller_lane(strata_runtime::OPTIMIZER_LANE);
                let cancel = runtime.cancel_token();
                for job in receiver {
                    if wake {
                        // Awake by the time the gradient is at hand.
                        pool.wake(groups[job.group].shard);
                    }
                    // The lane's time runs from the update's start, its
                    // inputs at hand (a gradient still on its way from the
                    // device is the pipeline's wait, not the lane's work).
                    let started = Instant::now();
                    // An aborted run's queued updates are dropped unrun.
                    let (result, started) = match cancel.is_cancelled() {
                        false => match run_optimizer(&runtime, &pool, &groups, &job) {
                            Ok(began) => (Ok(()), began),
                            Err(err) => (Err(err), started),
                        },
                        true => (Err(RuntimeError::Cancelled.into()), started),
                    };
                    runtime.record_update(
                        optimizer_label(job.late),
                        job.group as u32,
                        groups[job.group].shard as u64,
                        started,
                    );
                    let busy_ns = started.elapsed().as_nanos() as u64;
                    if results
                        .send((job.group, job.outputs, result, busy_ns))
                        .is_err()
                    {
                        return;
                    }
                }
            })
            .map_err(|err| {
                os(
                    "start the CPU optimizer thread",
                    err,
                    "raise the process or thread limit (ulimit -u)",
                )
            })?;
        Ok(CpuWorker {
            jobs: Some(jobs),
            done,
            thread: Some(thread),
            outstanding,
            lane: LaneRate::default(),
        })
    }

    /// Books a finished update: no longer outstanding, its outputs (counts
    /// per trace index in `writing`) written, its error kept if first.
    pub(super) fn book(
        &mut self,
        (group, outputs, result, busy_ns): Done,
        shard: usize,
        writing: &mut [u32],
        first_error: &mut Option<TrainError>,
    ) {
        self.lane.params += shard as u64;
        self.lane.busy_ns += busy_ns;
        self.outstanding[group] -= 1;
        for o in outputs {
            writing[o] -= 1;
        }
        if let Err(err) = result {
            first_error.get_or_insert(err);
        }
    }
}

impl Drop for CpuWorker {
    fn drop(&mut self) {
        self.jobs = None;
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Engine {
    /// Starts (on the CPU thread) or runs group `g`'s update from one set
    /// into the other, on `tier`.
    pub(super) fn update_group(
        &mut self,
        g: usize,
        late: bool,
        tier: Tier,
        update: &Update,
    ) -> Result<()> {
        let (from, to) = update_sets(self.current, late);
        self.slots[state_index(g, to)].fresh = late && g < self.cache_groups;
        let outputs = [state_index(g, to), param_index(g, to)];
        let id = |index: usize| {
            self.slots[index]
                .id
                .expect("persistent tensors are registered")
        };
        let job = OptJob {
            group: g,
            late,
            outputs,
            tier,
            grad: id(grad_index(g)),
            state_in: id(state_index(g, from)),
            state_out: id(state_index(g, to)),
            param_out: id(param_index(g, to)),
            update: *update,
            state_dtype: self.config.optim.state_dtype,
            seed: self.config.rounding_seed(),
            grad_dtype: self.slots[grad_index(g)].meta.dtype,
        };
        match &mut self.worker {
            Some(worker) => {
                assert!(
                    worker.outstanding[g] < UPDATES_PER_GROUP_MAX,
                    "group {g} has {} updates outstanding",
                    worker.outstanding[g]
                );
                worker
                    .jobs
                    .as_ref()
                    .expect("open while the engine lives")
                    .send(job)
                    .map_err(|_| RuntimeError::Stopped)?;
                worker.outstanding[g] += 1;
                for o in outputs {
                    self.writing[o] += 1;
                }
                Ok(())
            }
            None => {
                // fp32 states on the device: the backend runs the update
                // there (on a GPU the only way; on the CPU device the same
                // bits as the pool's kernel); bf16 states: the pool, timed
                // from when its inputs were at hand, as the lane's.
                let started = match job.state_dtype {
                    StateDtype::Fp32 => {
                        let started = Instant::now();
                        run_optimizer_on_backend(
                            &self.runtime,
                            &*self.backend,
                            &self.groups,
                            &job,
                        )?;
                        started
                    }
                    _ => run_optimizer(&self.runtime, &self.inline, &self.groups, &job)?,
                };
                self.inline_rate.params += self.groups[g].shard as u64;
                self.inline_rate.busy_ns += started.elapsed().as_nanos() as u64;
                Ok(())
            }
        }
    }

    /// Takes the results of the updates the CPU thread has finished,
    /// without waiting.
    pub(super) fn poll_worker(&mut self) {
        let Some(worker) = &mut self.worker else {
            return;
        };
        while let Ok(done) = worker.done.try_recv() {
            let shard = self.groups[done.0].shard;
            worker.book(done, shard, &mut self.writing, &mut self.worker_error);
        }
    }

    /// Waits until the CPU thread has no update of group `g` (every group
    /// with None) outstanding; returns the first error it reported.
    pub(super) fn wait_worker(&mut self, g: Option<usize>) -> Result<()> {
        let started = Instant::now();
        let mut waited = false;
        while let Some(worker) = &mut self.worker {
            let busy = match g {
                Some(g) => worker.outstanding[g] > 0,
                None => worker.outstanding.iter().any(|&n| n > 0),
            };
            if !busy {
                break;
            }
            waited = true;
            let done = worker.done.recv().map_err(|_| RuntimeError::Stopped)?;
            let shard = self.groups[done.0].shard;
            worker.book(done, shard, &mut self.writing, &mut self.worker_error);
            // The moves held for this update go now, not at the next
            // boundary: a long wait (the commit's) would otherwise keep
            // every finished update's inputs and outputs on the host.
            self.retry_held()?;
        }
        if waited {
            self.optimizer_wait_ns += started.elapsed().as_nanos() as u64;
            // (A commit's wait is its whole span already.)
            if let Some(g) = g {
                self.runtime
                    .record_compute("wait for optimizer", g as u32, None, started);
            }
        }
        self.worker_error.take().map_or(Ok(()), Err)
    }

    /// The barrier: every update is in, the global norm and the overflow
    /// check decide what happens to them.
    pub(super) fn decide(&mut self, step_op: &StepOp, loss_scale: f32) -> Result<StepDecision> {
        self.announce(&step_op.op)?;
        self.read_scalars()?;
        let mut sums = [self.sum_squares.iter().sum::<f64>(), self.loss_sum];
        self.collective.all_reduce_scalars(&mut sums)?;
        self.loss_sum = sums[1];
        self.issue_actions(true)?;
        let clip = self.config.train.clip_norm;
        Ok(decide_step(
            GradNorm {
                sum_squares: sums[0],
            },
            loss_scale,
            (clip > 0.0).then_some(clip),
        ))
    }
}
