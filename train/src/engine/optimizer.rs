//! The optimizer's work: AdamW on each group's shard out of place, from
//! the gradient and the input states into the other set (on the pool's
//! threads, or the backend's fused kernel for fp32 states on the device),
//! and the job that describes one update. The lane that runs them is
//! `lane.rs`.

use std::time::Instant;

use strata_optim::{
    AdamCoefficients, LowPrecisionMut, Moments, MomentsRef, OutOfPlaceShard, Pool, PoolConfig,
    Rounding, Split, Values,
};
use strata_runtime::{Access, Guard, Runtime, TensorId, Tier};

use crate::error::Result;

use super::access::guard;

use super::config::StateDtype;
use super::tensors::Group;
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
/// cores (of the process's share) only with one rank in the process
/// (ranks' pools would share the same cores).
pub(super) fn optimizer_pool(threads: u32, ranks: usize) -> Result<Pool> {
    let threads = match threads {
        0 => default_threads(
            strata_optim::topology::CpuTopology::detect().core_count(),
            ranks,
        ),
        n => n as usize,
    };
    Ok(Pool::new(PoolConfig {
        threads: Some(threads),
        pin: ranks == 1 && threads > 1,
        ..PoolConfig::default()
    })?)
}

/// `optim.threads = 0`'s count for one of `ranks_here` ranks sharing a
/// machine of `cores` cores: two cores left to compute and I/O, the rest
/// divided evenly, at least one each.
pub(super) fn default_threads(cores: usize, ranks_here: usize) -> usize {
    (cores.saturating_sub(2) / ranks_here.max(1)).max(1)
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
fn adam_group_as<P: strata_optim::Master + bytemuck::Pod>(
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
