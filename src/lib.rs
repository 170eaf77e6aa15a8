//! strata: heterogeneous memory tiering for training models far larger than
//! GPU memory. This facade re-exports the workspace's crates; the `strata`
//! binary is the command line over them.
//!
//! - [`storage`]: aligned buffers, io_uring and thread-pool engines, the
//!   checksummed swap store.
//! - [`runtime`], [`scheduler`], [`optim`]: the tensor-residency manager,
//!   the planner and the CPU optimizers.
//!
//! ```no_run
//! use strata::storage::{StorageConfig, SwapStore};
//! let store = SwapStore::open(&StorageConfig::default())?;
//! println!("{} bytes of swap on {}", store.capacity_bytes(), store.engine());
//! # Ok::<(), strata::storage::StorageError>(())
//! ```

pub use strata_optim as optim;
pub use strata_runtime as runtime;
pub use strata_scheduler as scheduler;
pub use strata_storage as storage;
