//! strata-runtime owns tensors, tiers and devices: the tensor-residency
//! manager that moves parameters, gradients, optimizer states and
//! activations between device memory, pinned host RAM and NVMe (through
//! [`strata_storage`]), carrying out the moves its caller decides (the
//! training engine, from the scheduler's plans). It knows no op, model or
//! rank, and names no CUDA type: devices come from `strata-device`.
//!
//! The main types:
//! - [`Runtime`]: the registry of tensors and their copies per [`Tier`], the
//!   movers that carry out [`Runtime::move_to`] (returning a [`Completion`]),
//!   automatic spill when a budget is hit, and the accounting ([`Stats`]) and
//!   Chrome trace.
//! - [`Guard`]: a use of a tensor's copy; a copy in use is never evicted.
//! - [`Device`]: [`CpuDevice`] (a budgeted host arena, everywhere) or
//!   [`CudaDevice`] (cudarc, loaded at run time).
//!
//! ```no_run
//! use strata_runtime::{Access, Dtype, Runtime, RuntimeConfig, TensorKind, TensorMeta, Tier};
//! let runtime = Runtime::new(&RuntimeConfig::default())?;
//! let meta = TensorMeta::new("block3.mlp.weight", TensorKind::Param, Dtype::F32, &[1024, 4096]);
//! let id = runtime.register(meta, Tier::Host)?;
//! let done = runtime.move_to(id, Tier::Device)?;   // returns at once
//! done.wait()?;
//! let guard = runtime.acquire(id, Tier::Device, Access::Read)?;
//! # drop(guard);
//! # Ok::<(), strata_runtime::RuntimeError>(())
//! ```

pub mod bench;
mod config;
pub mod device;
mod error;
mod guard;
mod host_pool;
mod residency;
mod state;
mod stats;
mod tier;

pub use config::{
    CLASSES_MAX, ClassConfig, DeviceChoice, DeviceConfig, HOST_BUFFER_ALIGN_BYTES, HostConfig,
    LimitsConfig, MOVERS_MAX, RuntimeConfig,
};
pub use device::{CpuDevice, CudaDevice, Device, DeviceKind};
pub use error::{Result, RuntimeError};
pub use guard::{Guard, RangeOf, zip_ranges};
pub use host_pool::{Chunk, FreeLists, HostPool, Slot, Spread, commit_spread};
pub use residency::{Completion, DEVICE_ALIGN_BYTES, Fill, Runtime, Visit};
pub use state::{Access, MemoryFaults};
pub use stats::{
    CALLER_LANE, COLLECTIVE_LANE, EventKind, LinkStats, OPTIMIZER_LANE, Stats, TierStats, Trace,
    TraceEvent, set_caller_lane,
};
pub use tier::{Dtype, Link, Owner, TensorId, TensorKind, TensorMeta, Tier};

pub use strata_storage as storage;
