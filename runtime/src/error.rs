//! The one error type of strata-runtime.

use strata_storage::StorageError;

use crate::tier::{TensorId, Tier};

/// Everything that can go wrong in strata-runtime. Variants carry the
/// numbers needed to act, and messages say what to change.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    /// A tier's budget is spent and nothing in it can be spilled now.
    #[error(
        "{tier} budget exhausted: {needed_bytes} bytes needed, {available_bytes} free of {budget_bytes} \
         (largest free piece {largest_free_bytes}), {unevictable_bytes} held by tensors in use or moving; \
         drop guards, free tensors, or raise the {tier} budget"
    )]
    OutOfBudget {
        /// The tier that is full.
        tier: Tier,
        /// Bytes asked for.
        needed_bytes: u64,
        /// Bytes free in the tier.
        available_bytes: u64,
        /// Largest contiguous free piece (device) or free bytes of the
        /// buffer size that ran out (host).
        largest_free_bytes: u64,
        /// The tier's budget.
        budget_bytes: u64,
        /// Bytes of tensors that may not be evicted (guards held, moving).
        unevictable_bytes: u64,
    },
    /// The tier refused a placement although its budget had room, and
    /// nothing could be spilled to make more: an out-of-memory fault
    /// injected by a simulation ([`crate::MemoryFaults`]).
    #[error(
        "{tier} refused {needed_bytes} bytes: out of memory (an injected fault), and nothing could be spilled; retry the operation"
    )]
    OutOfMemory {
        /// The tier that refused.
        tier: Tier,
        /// Bytes asked for.
        needed_bytes: u64,
    },
    /// A tier is full and there is no tier below it to spill to.
    #[error(
        "{tier} budget exhausted ({needed_bytes} bytes needed, {available_bytes} free) and no NVMe tier is configured to spill to: add [nvme] dirs or raise the {tier} budget"
    )]
    NoSpillTier {
        /// The full tier.
        tier: Tier,
        /// Bytes asked for.
        needed_bytes: u64,
        /// Bytes free there.
        available_bytes: u64,
    },
    /// The NVMe tier failed (I/O error, disk full, checksum mismatch, ...).
    #[error(transparent)]
    Storage(#[from] StorageError),
    /// Moving a tensor failed; its source copy is intact, unless what failed
    /// was its checksum.
    #[error(
        "moving tensor {name} ({tensor}) from {source_tier} to {target_tier} failed: {cause}; {}",
        source_state(*source_tier, cause)
    )]
    Move {
        /// The tensor.
        tensor: TensorId,
        /// Its name.
        name: String,
        /// Where its data came from (still valid).
        source_tier: Tier,
        /// Where it was going.
        target_tier: Tier,
        /// Why it failed (in the message, so not also a source: it would
        /// print twice).
        cause: Box<RuntimeError>,
    },
    /// The device (memory, copy engines, CUDA) failed.
    #[error(transparent)]
    Device(#[from] strata_device::DeviceError),
    /// The host budget exceeds the memory the machine has available.
    #[error(
        "host budget of {budget_bytes} bytes (plus a CPU device arena of {arena_bytes}) exceeds the {available_bytes} bytes of memory available: lower host.budget or device.budget"
    )]
    HostMemory {
        /// Pinned pool bytes asked for.
        budget_bytes: u64,
        /// Bytes of the CPU device's arena, also host memory.
        arena_bytes: u64,
        /// What the process may still take (MemAvailable, or less under a
        /// cgroup memory limit or `ulimit -v`).
        available_bytes: u64,
    },
    /// A size class's region of the pinned pool could not be allocated or
    /// committed.
    #[error(
        "could not allocate the pinned host pool's region of {region_bytes} bytes (buffers of {buffer_bytes} bytes): {cause}; lower host.budget (or that class's bytes in host.classes)"
    )]
    HostPool {
        /// Bytes of the region.
        region_bytes: u64,
        /// Its buffer size.
        buffer_bytes: u64,
        /// What refused, as the allocator or the kernel said.
        cause: String,
    },
    /// Pinned memory was required but the memlock limit refused it.
    #[error(
        "could not page-lock {needed_bytes} bytes of host memory: RLIMIT_MEMLOCK is {limit_bytes} bytes; raise it (`ulimit -l unlimited`, a memlock line in /etc/security/limits.conf, or LimitMEMLOCK= for a systemd service) or set host.require_locked = false"
    )]
    MemlockLimit {
        /// Bytes that had to be locked.
        needed_bytes: u64,
        /// The limit (u64::MAX when unlimited).
        limit_bytes: u64,
    },
    /// No tensor has this id (never registered, or freed).
    #[error("no tensor {tensor}: it was never registered or has been freed")]
    UnknownTensor {
        /// The id.
        tensor: TensorId,
    },
    /// The tensor has no valid copy in the tier asked for.
    #[error(
        "tensor {name} ({tensor}) has no copy in {tier} (it is in {resident}); move it there first"
    )]
    NotResident {
        /// The tensor.
        tensor: TensorId,
        /// Its name.
        name: String,
        /// The tier asked for.
        tier: Tier,
        /// Where its valid copies are ("host, nvme").
        resident: String,
    },
    /// The tensor is in use and the request would evict or change it.
    #[error(
        "tensor {name} ({tensor}) is in use ({readers} reader(s), writer: {writer}): drop its guards first"
    )]
    InUse {
        /// The tensor.
        tensor: TensorId,
        /// Its name.
        name: String,
        /// Read guards held.
        readers: u32,
        /// Whether a write guard is held.
        writer: bool,
    },
    /// The tensor is already moving elsewhere.
    #[error("tensor {name} ({tensor}) is moving to {target_tier}: wait for that move first")]
    Moving {
        /// The tensor.
        tensor: TensorId,
        /// Its name.
        name: String,
        /// Where it is going.
        target_tier: Tier,
    },
    /// A configured limit was reached.
    #[error("{what} limit of {max} reached: raise {what}")]
    Limit {
        /// The limit's name (a config key).
        what: &'static str,
        /// Its value.
        max: u64,
    },
    /// A configuration value is out of range or inconsistent.
    #[error("invalid runtime setting {key} = {value}: {fix}")]
    Config {
        /// The key.
        key: &'static str,
        /// The value given.
        value: String,
        /// What would be valid.
        fix: String,
    },
    /// Data handed in does not have the tensor's size.
    #[error("tensor {name} ({tensor}) holds {tensor_bytes} bytes but {given_bytes} were given")]
    SizeMismatch {
        /// The tensor.
        tensor: TensorId,
        /// Its name.
        name: String,
        /// Its size.
        tensor_bytes: u64,
        /// The size of the data given.
        given_bytes: u64,
    },
    /// The runtime has shut down.
    #[error("the runtime has stopped; no more moves can be started")]
    Stopped,
    /// A wait was cancelled through the runtime's [`strata_device::Cancel`]
    /// (the run is being aborted).
    #[error(
        "cancelled: the run was aborted mid-step (a second signal, or --signal-grace ran out); what was in flight is dropped and the last whole checkpoint stays"
    )]
    Cancelled,
}

/// Result alias for strata-runtime.
pub type Result<T, E = RuntimeError> = std::result::Result<T, E>;

/// What a failed move left of its source: intact, unless the source's
/// checksum is what failed.
fn source_state(source_tier: Tier, cause: &RuntimeError) -> String {
    match cause {
        RuntimeError::Storage(StorageError::ChecksumMismatch { .. }) => format!(
            "the {source_tier} copy is corrupt and nothing was taken from it: resume from the last checkpoint"
        ),
        _ => format!("the {source_tier} copy is intact"),
    }
}
