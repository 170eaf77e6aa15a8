//! The optimizer lane: the CPU thread that runs AdamW on each group's
//! shard out of place (its speculative and late paths), how updates are
//! queued to it and waited for, and the step's decision (global norm,
//! overflow skip, clip).

use std::sync::Arc;
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::thread::JoinHandle;
use std::time::Instant;

use half::bf16;
use strata_optim::{
    AdamCoefficients, GradNorm, Isa, LowPrecisionMut, Moments, StepDecision, Values, adam_step,
    decide_step,
};
use strata_runtime::RuntimeError;
use strata_runtime::{Access, Guard, Runtime, TensorId, Tier};

use crate::error::{Result, TrainError, os};

use super::Engine;
use super::moves::guard;
use strata_scheduler::StepOp;

use super::steps::{optimizer_label, update_sets};
use super::tensors::Group;
use super::tensors::{grad_index, param_index, state_index};

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
    pub(super) coefficients: [AdamCoefficients; 2],
}

/// Elements of a shard the optimizer updates at once: its buffers (about
/// 300 KiB) stay in cache between reading the inputs, the update and
/// writing the outputs, so memory sees each byte of the shard once.
pub(super) const OPT_PIECE_ELEMS: usize = 16 * 1024;

/// The optimizer's buffers for one piece of a shard.
pub(super) struct OptScratch {
    pub(super) master: Vec<f32>,
    pub(super) m: Vec<f32>,
    pub(super) v: Vec<f32>,
    pub(super) grad: Vec<f32>,
    pub(super) param: Vec<bf16>,
}

impl OptScratch {
    pub(super) fn new() -> OptScratch {
        OptScratch {
            master: vec![0.0; OPT_PIECE_ELEMS],
            m: vec![0.0; OPT_PIECE_ELEMS],
            v: vec![0.0; OPT_PIECE_ELEMS],
            grad: vec![0.0; OPT_PIECE_ELEMS],
            param: vec![bf16::ZERO; OPT_PIECE_ELEMS],
        }
    }
}

/// Group `job.group`'s update, streamed piece by piece from the gradient
/// and the input states' copies in `job.tier` straight into the outputs'.
/// The outputs are written whole: nothing of their old bytes is read or
/// fetched.
pub(super) fn run_optimizer(
    runtime: &Runtime,
    isa: Isa,
    groups: &[Group],
    scratch: &mut OptScratch,
    job: &OptJob,
) -> Result<()> {
    let inputs = [
        guard(runtime, job.grad, job.tier, Access::Read)?,
        guard(runtime, job.state_in, job.tier, Access::Read)?,
    ];
    runtime.overwrite_with(job.param_out, job.tier, |param_out| {
        runtime.overwrite_with(job.state_out, job.tier, |state_out| {
            let outputs = [state_out, param_out];
            adam_pieces(isa, &groups[job.group], job, scratch, &inputs, outputs)
        })
    })
}

/// One shard's AdamW in pieces of [`OPT_PIECE_ELEMS`]: `[grad, states in]`
/// to `[states out, params out]`. States are master, m and v, each
/// `shard` f32, one after another; params are `shard` bf16.
pub(super) fn adam_pieces(
    isa: Isa,
    group: &Group,
    job: &OptJob,
    scratch: &mut OptScratch,
    [grad, state_in]: &[Guard; 2],
    [state_out, param_out]: [&mut Guard; 2],
) -> Result<()> {
    let n = group.shard as u64;
    for (run, decays) in &group.runs {
        let coefficients = &job.coefficients[usize::from(*decays)];
        for start in run.clone().step_by(OPT_PIECE_ELEMS) {
            let len = OPT_PIECE_ELEMS.min(run.end - start);
            let at = start as u64 * 4;
            let master = &mut scratch.master[..len];
            let m = &mut scratch.m[..len];
            let v = &mut scratch.v[..len];
            let g = &mut scratch.grad[..len];
            let param = &mut scratch.param[..len];
            grad.read_range(at, bytemuck::cast_slice_mut(g))?;
            state_in.read_range(at, bytemuck::cast_slice_mut(master))?;
            state_in.read_range(at + 4 * n, bytemuck::cast_slice_mut(m))?;
            state_in.read_range(at + 8 * n, bytemuck::cast_slice_mut(v))?;
            adam_step(
                isa,
                coefficients,
                master,
                Values::F32(g),
                Moments::F32 { m, v },
                Some(LowPrecisionMut::Bf16(param)),
            );
            state_out.write_range(at, bytemuck::cast_slice(master))?;
            state_out.write_range(at + 4 * n, bytemuck::cast_slice(m))?;
            state_out.write_range(at + 8 * n, bytemuck::cast_slice(v))?;
            param_out.write_range(start as u64 * 2, bytemuck::cast_slice(param))?;
        }
    }
    Ok(())
}

/// A finished update: its group, the trace indices it wrote, the outcome.
pub(super) type Done = (usize, [usize; 2], Result<()>);

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
}

impl CpuWorker {
    pub(super) fn start(
        runtime: Arc<Runtime>,
        isa: Isa,
        groups: Arc<Vec<Group>>,
    ) -> Result<CpuWorker> {
        let outstanding = vec![0; groups.len()];
        let bound = groups.len() * UPDATES_PER_GROUP_MAX as usize;
        let (jobs, receiver) = sync_channel::<OptJob>(bound);
        let (results, done) = sync_channel(bound);
        let thread = std::thread::Builder::new()
            .name("strata-cpu-optim".into())
            .spawn(move || {
                strata_runtime::set_caller_lane(strata_runtime::OPTIMIZER_LANE);
                let mut scratch = OptScratch::new();
                for job in receiver {
                    let started = Instant::now();
                    let result = run_optimizer(&runtime, isa, &groups, &mut scratch, &job);
                    runtime.record_compute(
                        optimizer_label(job.late),
                        job.group as u32,
                        None,
                        started,
                    );
                    if results.send((job.group, job.outputs, result)).is_err() {
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
        })
    }

    /// Books a finished update: no longer outstanding, its outputs (counts
    /// per trace index in `writing`) written, its error kept if first.
    pub(super) fn book(
        &mut self,
        (group, outputs, result): Done,
        writing: &mut [u32],
        first_error: &mut Option<TrainError>,
    ) {
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
        update: &[AdamCoefficients; 2],
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
            coefficients: *update,
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
            None => run_optimizer(
                &self.runtime,
                self.isa,
                &self.groups,
                &mut self.inline,
                &job,
            ),
        }
    }

    /// Takes the results of the updates the CPU thread has finished,
    /// without waiting.
    pub(super) fn poll_worker(&mut self) {
        let Some(worker) = &mut self.worker else {
            return;
        };
        while let Ok(done) = worker.done.try_recv() {
            worker.book(done, &mut self.writing, &mut self.worker_error);
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
            worker.book(done, &mut self.writing, &mut self.worker_error);
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
