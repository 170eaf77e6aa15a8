//! strata-storage moves bytes between host buffers and files, at the drive's
//! full speed, and never hands back a wrong byte as good. It knows nothing of
//! tensors or GPUs.
//!
//! The main types:
//! - [`AlignedBuf`]: aligned (optionally page-locked) host memory for direct I/O.
//! - [`IoQueue`] over a [`RawEngine`] ([`UringEngine`], [`ThreadEngine`], or a
//!   [`FaultEngine`] around either): one thread's submission queue, which
//!   resubmits short transfers and EAGAIN and types every error.
//! - [`IoService`]: rings on worker threads with bounded queues; [`Ticket`]s
//!   are waited on from threads or awaited from async code.
//! - [`IoHandle`]: DeepNVMe's verbs - a whole buffer read from or written
//!   to (path, offset) asynchronously, split over worker rings.
//! - [`SwapStore`]: preallocated swap files striped over drives, an extent
//!   allocator and per-chunk checksums kept apart from the data.
//!
//! ```no_run
//! use strata_storage::{AlignedBuf, StorageConfig, SwapStore};
//! let config = StorageConfig { dirs: vec!["/nvme0".into(), "/nvme1".into()], ..Default::default() };
//! let store = SwapStore::open(&config)?;
//! let extent = store.allocate(64 << 20)?;
//! let buf = AlignedBuf::new_locked(64 << 20, store.align_bytes() as usize)?;
//! let ticket = store.write_start(&extent, buf);   // returns at once
//! let (buf, result) = ticket.wait();               // or `.await`
//! result?;
//! # drop(buf);
//! # Ok::<(), strata_storage::StorageError>(())
//! ```

mod alloc;
pub mod bench;
mod buffer;
mod checksum;
mod config;
pub mod engine;
mod error;
mod file;
mod handle;
mod ownership;
mod queue;
mod service;
mod size;
mod store;
pub mod sys;

pub use alloc::ExtentAllocator;
pub use buffer::{AlignedBuf, HUGE_PAGE_BYTES, PAGE_BYTES, commit_pages};
pub use checksum::checksum;
pub use config::{
    BLOCK_BYTES_MAX, DIRS_MAX, EngineChoice, QUEUE_DEPTH_MAX, RINGS_MAX, StorageConfig,
};
pub use engine::{
    EngineKind, FaultCounts, FaultEngine, FaultRates, RawEngine, ThreadEngine, UringEngine,
    probe_uring,
};
pub use error::{Op, Result, StorageError};
pub use file::{AlignSource, IoFile, check_dir_writable};
pub use handle::{
    HANDLE_BLOCK_BYTES_MAX, HANDLE_PENDING_MAX, HANDLE_QUEUE_DEPTH_MAX, HANDLE_THREADS_MAX,
    HandleConfig, IoHandle,
};
pub use ownership::{DirLock, Holder, LOCK_FILE, LockWait, local_time, lock_dir};
pub use queue::{Completion, IoQueue, QueueStats, RETRIES_MAX_DEFAULT, Request};
pub use service::{EngineFactory, IoService, ServiceConfig, Ticket};
pub use size::{ByteSize, round_up};
pub use store::{Extent, OWNED_DIR, SwapStore};
