//! The optimizer lane: the CPU thread (`strata-cpu-optim`) that runs each
//! group's update on the optimizer pool as it is queued (or, with states
//! on the device, the update run inline), how many queued updates will
//! write each tensor (moves of it wait), what the lane reports (its rate,
//! what compute waited for it) and the first error it met.

use std::sync::Arc;
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::thread::JoinHandle;
use std::time::Instant;

use strata_optim::Pool;
use strata_runtime::{Runtime, RuntimeError};

use crate::error::{Result, TrainError, os};

use super::config::StateDtype;
use super::env::Env;
use super::optimizer::{OptJob, run_optimizer, run_optimizer_on_backend};
use super::steps::optimizer_label;
use super::tensors::Group;

/// The optimizer lane of one rank.
pub(super) struct Lane {
    /// The CPU thread, when the states live off the device.
    worker: Option<CpuWorker>,
    /// The pool of updates run inline (states on the device).
    inline: Pool,
    /// The inline updates' rate since the last step report.
    inline_rate: LaneRate,
    /// Per trace index, queued updates that write the tensor.
    writing: Vec<u32>,
    /// The first error the CPU thread reported, not yet returned.
    worker_error: Option<TrainError>,
    /// Nanoseconds compute waited for the CPU thread this step.
    wait_ns: u64,
}

impl Lane {
    /// A lane that runs updates inline on `inline`, for a trace of
    /// `tensors` tensors; [`Lane::start`] gives it the CPU thread.
    pub(super) fn new(inline: Pool, tensors: usize) -> Lane {
        Lane {
            worker: None,
            inline,
            inline_rate: LaneRate::default(),
            writing: vec![0; tensors],
            worker_error: None,
            wait_ns: 0,
        }
    }

    /// Starts the CPU thread, updating on `pool` (woken as each update
    /// arrives when `wake`).
    pub(super) fn start(
        &mut self,
        runtime: Arc<Runtime>,
        pool: Pool,
        groups: Arc<Vec<Group>>,
        wake: bool,
    ) -> Result<()> {
        self.worker = Some(CpuWorker::start(runtime, pool, groups, wake)?);
        Ok(())
    }

    /// Whether updates run on the CPU thread, overlapped with compute.
    pub(super) fn overlapped(&self) -> bool {
        self.worker.is_some()
    }

    /// Stops the CPU thread after a step that failed part way: whatever it
    /// still holds is dropped with it.
    pub(super) fn stop(&mut self) {
        self.worker = None;
    }

    /// Per trace index, queued updates that write the tensor.
    pub(super) fn writing(&self) -> &[u32] {
        &self.writing
    }

    /// Queues `job` on the CPU thread, or runs it now when there is none.
    pub(super) fn submit(&mut self, env: &Env, job: OptJob) -> Result<()> {
        let g = job.group;
        match &mut self.worker {
            Some(worker) => {
                assert!(
                    worker.outstanding[g] < UPDATES_PER_GROUP_MAX,
                    "group {g} has {} updates outstanding",
                    worker.outstanding[g]
                );
                let outputs = job.outputs;
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
                let groups = env.groups();
                let started = match job.state_dtype {
                    StateDtype::Fp32 => {
                        let started = Instant::now();
                        run_optimizer_on_backend(env.runtime(), env.backend(), groups, &job)?;
                        started
                    }
                    _ => run_optimizer(env.runtime(), &self.inline, groups, &job)?,
                };
                self.inline_rate.params += groups[g].shard as u64;
                self.inline_rate.busy_ns += started.elapsed().as_nanos() as u64;
                Ok(())
            }
        }
    }

    /// Takes the results of the updates the CPU thread has finished,
    /// without waiting.
    pub(super) fn poll(&mut self, groups: &[Group]) {
        let Some(worker) = &mut self.worker else {
            return;
        };
        while let Ok(done) = worker.done.try_recv() {
            let shard = groups[done.0].shard;
            worker.book(done, shard, &mut self.writing, &mut self.worker_error);
        }
    }

    /// Whether the CPU thread has an update of group `g` (any group with
    /// None) outstanding.
    pub(super) fn busy(&self, g: Option<usize>) -> bool {
        self.worker.as_ref().is_some_and(|worker| match g {
            Some(g) => worker.outstanding[g] > 0,
            None => worker.outstanding.iter().any(|&n| n > 0),
        })
    }

    /// Waits for the CPU thread's next finished update and books it.
    pub(super) fn book_next(&mut self, groups: &[Group]) -> Result<()> {
        let worker = self.worker.as_mut().expect("busy: the thread runs");
        let done = worker.done.recv().map_err(|_| RuntimeError::Stopped)?;
        let shard = groups[done.0].shard;
        worker.book(done, shard, &mut self.writing, &mut self.worker_error);
        Ok(())
    }

    /// Counts compute's wait for the lane since `started`.
    pub(super) fn waited(&mut self, started: Instant) {
        self.wait_ns += started.elapsed().as_nanos() as u64;
    }

    /// The first error the CPU thread reported since the last call.
    pub(super) fn take_error(&mut self) -> Result<()> {
        self.worker_error.take().map_or(Ok(()), Err)
    }

    /// Seconds compute waited for the lane since the last call.
    pub(super) fn take_wait_s(&mut self) -> f64 {
        std::mem::take(&mut self.wait_ns) as f64 / 1e9
    }

    /// The lane's rate since the last call: parameters per second of its
    /// busy time (0: none finished).
    pub(super) fn take_rate(&mut self) -> f64 {
        match &mut self.worker {
            Some(worker) => worker.lane.take(),
            None => self.inline_rate.take(),
        }
    }
}

/// A finished update: its group, the trace indices it wrote, the outcome,
/// and the nanoseconds it took.
type Done = (usize, [usize; 2], Result<()>, u64);

/// Updates of one group sent to the CPU thread and not yet booked: its
/// update of the step before (late, in this step's forward) and this
/// step's. The channels both ways hold this many per group, so neither
/// side ever blocks on a full one.
const UPDATES_PER_GROUP_MAX: u32 = 2;

/// The CPU optimizer thread.
struct CpuWorker {
    jobs: Option<SyncSender<OptJob>>,
    done: Receiver<Done>,
    thread: Option<JoinHandle<()>>,
    /// Updates sent and not yet reported back, per group.
    outstanding: Vec<u32>,
    /// Parameters updated and time spent updating them since the last
    /// step report (the lane's rate).
    lane: LaneRate,
}

/// Parameters the optimizer lane updated and the time it spent on them.
#[derive(Clone, Copy, Debug, Default)]
struct LaneRate {
    params: u64,
    busy_ns: u64,
}

impl LaneRate {
    /// Parameters per second (0 when nothing ran), and a reset.
    fn take(&mut self) -> f64 {
        let rate = std::mem::take(self);
        if rate.busy_ns == 0 {
            0.0
        } else {
            rate.params as f64 / (rate.busy_ns as f64 / 1e9)
        }
    }
}

impl CpuWorker {
    fn start(
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
    fn book(
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
