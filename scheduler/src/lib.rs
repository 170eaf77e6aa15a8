//! strata-scheduler builds steps, plans and simulates. [`build_step`] is the
//! one step builder: the ordered ops of a step (forward, backward, updates,
//! per micro-batch and block) that the training engine runs and `strata
//! plan` simulates. From a training step's access
//! [`Trace`], tier capacities and link speeds, [`plan`] computes when to
//! issue each transfer and what to evict to where (a [`Plan`]);
//! [`simulate`] runs a plan against a hardware model and predicts step
//! time, busy time per link and memory per tier; [`cluster`] builds traces
//! for decoder-only transformers on whole clusters and compares strata's policy with
//! a DeepSpeed-like baseline. It is pure and deterministic: no I/O, no
//! clock, no threads.
//!
//! ```
//! use strata_scheduler::{cluster, Hardware, Model, Parallelism, Policies, Tier};
//! let hardware = Hardware::preset("dgx-a100")?;
//! let model = Model::for_params(13e9)?;
//! let parallelism = Parallelism::zero3_offload(&hardware, Tier::Host, Tier::Host);
//! let estimate = cluster::estimate(&model, &parallelism, &hardware, Policies::Strata)?;
//! assert!(estimate.fits);
//! println!("{:.2?} s per step, bottleneck {}", estimate.step_time_s, estimate.bottleneck);
//! # Ok::<(), strata_scheduler::SchedulerError>(())
//! ```

mod builder;
pub mod cluster;
mod error;
mod model;
mod plan;
pub mod recompute;
mod sim;
mod step;
mod tier;
mod trace;

pub use builder::{
    OpCost, StepModel, StepOp, StepShape, Updates, Work, build_forward_only, build_step,
};
pub use cluster::{Estimate, Policies};
pub use error::{SchedulerError, gib};
pub use model::{Hardware, Model, Parallelism, StateDtype, deepspeed_zero3_estimate};
pub use plan::{
    Action, ActionKind, ClassRule, Eviction, Lane, Link, Links, Plan, PlanConfig, Policy, plan,
    replay_peak_bytes, verify,
};
pub use recompute::{Checkpointing, Held, RecomputeChoice, RecomputeInput};
pub use sim::{SimConfig, SimReport, TimelinePoint, simulate};
pub use step::{Follow, PlanCache, StepTracker};
pub use trace::{Access, Mode, Op, Processor, TensorClass, TensorSpec, Tier, Trace, TraceRecorder};
