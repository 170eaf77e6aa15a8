//! strata: heterogeneous memory tiering for training models far larger than
//! GPU memory. This facade re-exports the workspace's crates; the `strata`
//! binary is the command line over them.
//!
//! - [`device`]: dtypes, device buffers and views, streams and fences,
//!   the CUDA context.
//! - [`storage`]: aligned buffers, io_uring and thread-pool engines, the
//!   checksummed swap store.
//! - [`optim`]: the CPU optimizers.
//! - [`runtime`]: tiers, budgets, pinned pools, devices as memory and copy
//!   engines, the tensor-residency manager.
//! - [`kernels`], [`comm`]: compute (the `Backend` trait, the CPU
//!   reference) and collectives (process groups, ranks as threads).
//! - [`scheduler`]: the step builder, planner and simulator.
//! - [`train`]: the model, the engine, checkpoints, `run`.
//!
//! ```no_run
//! use strata::storage::{StorageConfig, SwapStore};
//! let store = SwapStore::open(&StorageConfig::default())?;
//! println!("{} bytes of swap on {}", store.capacity_bytes(), store.engine());
//! # Ok::<(), strata::storage::StorageError>(())
//! ```

pub use strata_comm as comm;
pub use strata_device as device;
pub use strata_kernels as kernels;
pub use strata_optim as optim;
pub use strata_runtime as runtime;
pub use strata_scheduler as scheduler;
pub use strata_storage as storage;
pub use strata_train as train;
