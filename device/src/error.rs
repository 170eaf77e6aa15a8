//! The one error type of strata-device.

use crate::Dtype;

/// Everything that can go wrong with a device, its buffers and its
/// streams. Variants carry the numbers; messages say what to change.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    /// A CUDA call failed.
    #[error("CUDA {op} failed: {cause}")]
    Cuda {
        /// The call.
        op: &'static str,
        /// The driver's message.
        cause: String,
    },
    /// A CUDA device was asked for and none can be used.
    #[error(
        "no CUDA device can be used: {reason}; set device.kind = \"cpu\" (or \"auto\") to run on the CPU device"
    )]
    CudaUnavailable {
        /// Why.
        reason: String,
    },
    /// A CUDA library that a feature needs is not installed where the
    /// loader looks.
    #[error(
        "the CUDA library {library} ({purpose}) was not found (looked for {candidates}); install it or put its directory on LD_LIBRARY_PATH, and where only a versioned file is installed (lib{library}.so.N, as pip's wheels ship them) link it as lib{library}.so there (benches/cuda-env.sh does)"
    )]
    LibraryMissing {
        /// Its short name ("nvrtc").
        library: &'static str,
        /// What strata needs it for.
        purpose: &'static str,
        /// The file names the loader tried.
        candidates: String,
    },
    /// The device has less free memory than the device budget.
    #[error(
        "the device has {free_bytes} bytes free but the device budget is {budget_bytes}: lower device.budget"
    )]
    DeviceMemory {
        /// Budget asked for.
        budget_bytes: u64,
        /// Free device memory.
        free_bytes: u64,
    },
    /// Host memory for a buffer could not be had.
    #[error("could not allocate {len_bytes} bytes of host memory for {what}: {cause}")]
    HostAlloc {
        /// What the memory was for.
        what: &'static str,
        /// Bytes asked for.
        len_bytes: u64,
        /// Why.
        cause: String,
    },
    /// A thread the device needs (a copy engine) could not be started.
    #[error("could not start the {thread} thread: {cause}")]
    Thread {
        /// The thread's name.
        thread: &'static str,
        /// The OS's answer.
        cause: String,
    },
    /// A size does not fit the index type of the buffers (`usize` bytes).
    #[error(
        "a buffer of {elems} {dtype} elements does not fit in memory's index type; use fewer elements"
    )]
    Size {
        /// Elements asked for.
        elems: u64,
        /// Their type.
        dtype: Dtype,
    },
    /// A view or an operand does not have the dtype an operation needs.
    #[error("{what} holds {actual} but {expected} was needed")]
    Dtype {
        /// The operand.
        what: &'static str,
        /// What it holds.
        actual: Dtype,
        /// What was needed.
        expected: Dtype,
    },
    /// A view reaches past the end of its buffer.
    #[error(
        "a view of {rows} x {cols} {dtype} (row stride {row_stride}, offset {offset}) reaches element {end} of a buffer of {len}"
    )]
    ViewBounds {
        /// Rows.
        rows: usize,
        /// Columns.
        cols: usize,
        /// Elements between row starts.
        row_stride: usize,
        /// First element.
        offset: usize,
        /// One past the last element it reaches.
        end: usize,
        /// Elements in the buffer.
        len: usize,
        /// The buffer's type.
        dtype: Dtype,
    },
    /// A view cannot be read as another element type.
    #[error(
        "{bytes} bytes of {from} at address {address:#x} cannot be read as {to}: the bytes and the address must be multiples of its size, and the view contiguous"
    )]
    ViewDtype {
        /// The view's type.
        from: Dtype,
        /// The type asked for.
        to: Dtype,
        /// Bytes in the view.
        bytes: u64,
        /// Its first byte's address.
        address: u64,
    },
    /// Work that waits on other parties (a collective) was stopped: a
    /// peer failed, the run was cancelled, or its deadline passed.
    #[error("work on the {stream} stream was stopped: {cause}")]
    Stopped {
        /// Which stream.
        stream: &'static str,
        /// Why, in the watcher's words.
        cause: String,
    },
    /// Enqueued work failed; the device may be lost.
    #[error("work enqueued on the {stream} stream failed: {cause}; the device may be lost")]
    Enqueued {
        /// Which stream.
        stream: &'static str,
        /// The driver's message.
        cause: String,
    },
}

/// Results of strata-device.
pub type Result<T> = std::result::Result<T, DeviceError>;
