//! The one error type of strata-storage.

use std::io;
use std::path::PathBuf;

/// Direction of a transfer, named in errors and reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Op {
    /// File to host buffer.
    Read,
    /// Host buffer to file.
    Write,
}

impl std::fmt::Display for Op {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Op::Read => "read",
            Op::Write => "write",
        })
    }
}

/// Everything that can go wrong in strata-storage. Each variant carries the
/// numbers needed to act on it, and its message says what to change.
#[derive(Debug, thiserror::Error)]
pub enum StorageError {
    /// A directory a run would own is another run's, or cannot be locked.
    #[error("{what} {}: {problem}; {fix}", dir.display())]
    Ownership {
        /// The setting it came from (`train.checkpoint_dir`, `nvme_path`).
        what: String,
        /// The directory.
        dir: PathBuf,
        /// What stands in the way, with the holder named.
        problem: String,
        /// What to do.
        fix: String,
    },
    /// The kernel failed a transfer.
    #[error("{op} of {len_bytes} bytes at offset {offset} in {} failed: {cause}", path.display())]
    Io {
        /// Direction.
        op: Op,
        /// File the transfer addressed.
        path: PathBuf,
        /// Byte offset in that file.
        offset: u64,
        /// Bytes still to transfer when it failed.
        len_bytes: u64,
        /// The kernel's error.
        cause: io::Error,
    },
    /// A write hit ENOSPC or EDQUOT.
    #[error(
        "disk full: writing {len_bytes} bytes at offset {offset} in {} failed ({cause}); free space on that drive or lower the swap capacity",
        path.display()
    )]
    DiskFull {
        /// File being written.
        path: PathBuf,
        /// Byte offset in that file.
        offset: u64,
        /// Bytes that could not be written.
        len_bytes: u64,
        /// ENOSPC or EDQUOT.
        cause: io::Error,
    },
    /// A filesystem has too little free space for what was asked.
    #[error(
        "{} has {available_bytes} bytes free but {needed_bytes} are needed: free space there, pick another directory, or ask for less",
        path.display()
    )]
    NoSpace {
        /// Directory checked.
        path: PathBuf,
        /// Bytes asked for.
        needed_bytes: u64,
        /// Bytes free for an unprivileged user.
        available_bytes: u64,
    },
    /// Data read back does not match the checksum recorded when it was written.
    #[error(
        "checksum mismatch in extent {extent} at extent bytes {offset}..{}: expected {expected:#018x}, read {actual:#018x}; the data on disk is corrupt and was not returned as good",
        offset + len_bytes
    )]
    ChecksumMismatch {
        /// Extent id.
        extent: u64,
        /// Byte offset of the bad chunk inside the extent.
        offset: u64,
        /// Length of the bad chunk.
        len_bytes: u64,
        /// Checksum recorded at write time.
        expected: u64,
        /// Checksum of what was read.
        actual: u64,
    },
    /// A read returned end-of-file before the request was satisfied.
    #[error(
        "short read: {} ended at offset {offset} with {missing_bytes} bytes of the request unread; the file is shorter than expected (truncated or stale)",
        path.display()
    )]
    UnexpectedEof {
        /// File read.
        path: PathBuf,
        /// Offset where data ran out.
        offset: u64,
        /// Bytes that could not be read.
        missing_bytes: u64,
    },
    /// A transfer kept failing with EAGAIN/EINTR.
    #[error(
        "{op} at offset {offset} in {} still failed with {cause} after {retries} retries; the device is overloaded: lower the queue depth or request size",
        path.display()
    )]
    RetriesExhausted {
        /// Direction.
        op: Op,
        /// File addressed.
        path: PathBuf,
        /// Byte offset.
        offset: u64,
        /// Retries made.
        retries: u32,
        /// The last error.
        cause: io::Error,
    },
    /// The swap store has no free extent large enough.
    #[error(
        "swap store full: {needed_bytes} bytes needed, {free_bytes} free of {capacity_bytes} (largest free extent {largest_free_bytes}); raise the swap capacity or add a directory"
    )]
    OutOfSpace {
        /// Bytes asked for (after rounding to the alignment).
        needed_bytes: u64,
        /// Free bytes in all.
        free_bytes: u64,
        /// Largest contiguous free extent.
        largest_free_bytes: u64,
        /// Store capacity.
        capacity_bytes: u64,
    },
    /// A size or offset breaks the direct-I/O alignment.
    #[error(
        "{what} of {value} bytes is not a multiple of the direct-I/O alignment {align_bytes}: use a multiple of {align_bytes}"
    )]
    Misaligned {
        /// What was misaligned (for example "block size").
        what: &'static str,
        /// The offending value.
        value: u64,
        /// The alignment it must respect.
        align_bytes: u64,
    },
    /// A directory that must exist does not.
    #[error("directory {} does not exist: create it (mkdir -p) or choose another", path.display())]
    DirMissing {
        /// The directory.
        path: PathBuf,
    },
    /// A directory or file cannot be created or opened for writing.
    #[error("{} is not writable ({cause}): fix its permissions or choose another directory", path.display())]
    NotWritable {
        /// The path.
        path: PathBuf,
        /// Why.
        cause: io::Error,
    },
    /// A host buffer is smaller than the transfer asked of it.
    #[error(
        "buffer of {buffer_bytes} bytes is too small for extent {extent} of {extent_bytes} bytes"
    )]
    BufferTooSmall {
        /// Extent id.
        extent: u64,
        /// Extent length.
        extent_bytes: u64,
        /// Buffer length.
        buffer_bytes: u64,
    },
    /// An extent was read before any write to it succeeded.
    #[error(
        "extent {extent} holds no data (never written, or its last write failed): write it before reading"
    )]
    ExtentNotWritten {
        /// Extent id.
        extent: u64,
    },
    /// An extent has a transfer in flight that conflicts with the one asked for.
    #[error(
        "extent {extent} is busy: a {busy_with} is in flight; wait for it before starting a {requested}"
    )]
    ExtentBusy {
        /// Extent id.
        extent: u64,
        /// The transfer in flight.
        busy_with: Op,
        /// The transfer refused.
        requested: Op,
    },
    /// The I/O service has shut down (its rings are gone).
    #[error("the I/O service has stopped; no more transfers can be submitted")]
    ServiceStopped,
    /// Host memory could not be allocated.
    #[error(
        "could not allocate {len_bytes} bytes of host memory aligned to {align_bytes} ({cause}): lower the buffer or pool size"
    )]
    HostAlloc {
        /// Bytes asked for.
        len_bytes: usize,
        /// Alignment asked for.
        align_bytes: usize,
        /// What refused: the allocator, or the kernel's errno.
        cause: String,
    },
    /// A configuration value is out of range or inconsistent.
    #[error("invalid storage setting {key} = {value}: {fix}")]
    Config {
        /// The key.
        key: &'static str,
        /// The value given.
        value: String,
        /// What would be valid.
        fix: String,
    },
    /// io_uring was asked for explicitly but cannot run here.
    #[error("io_uring is unavailable: {reason}; use engine = \"threads\" (or \"auto\")")]
    UringUnavailable {
        /// Why the probe failed.
        reason: String,
    },
    /// Any other operating-system failure outside a transfer (open, fallocate, statx).
    #[error("{what} {} failed: {cause}", path.display())]
    Os {
        /// What was attempted.
        what: &'static str,
        /// Path involved.
        path: PathBuf,
        /// The error.
        cause: io::Error,
    },
}

/// Result alias for strata-storage.
pub type Result<T, E = StorageError> = std::result::Result<T, E>;
