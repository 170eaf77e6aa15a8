//! The one error type of strata-kernels.

use strata_device::{DeviceError, DeviceKind, Dtype};

/// What can go wrong when an op is enqueued. Shapes that disagree are the
/// caller's to fix, and say which operand and which numbers.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    /// An operand's size does not fit the op.
    #[error("{op}: {operand} has {actual} but {expected} was needed")]
    Shape {
        /// The op.
        op: &'static str,
        /// The operand.
        operand: &'static str,
        /// What it has ("12 x 64").
        actual: String,
        /// What it needed.
        expected: String,
    },
    /// A dtype combination this backend does not run.
    #[error("{op} on the {backend} backend does not take {dtype} for {operand}; {fix}")]
    Dtype {
        /// The op.
        op: &'static str,
        /// The backend's name.
        backend: &'static str,
        /// The operand.
        operand: &'static str,
        /// Its dtype.
        dtype: Dtype,
        /// What to do.
        fix: &'static str,
    },
    /// An operand lives on another device than the backend computes on.
    #[error("{op}: {operand} is on {actual:?} but the backend computes on {expected:?}")]
    Device {
        /// The op.
        op: &'static str,
        /// The operand.
        operand: &'static str,
        /// Where it is.
        actual: DeviceKind,
        /// Where the backend computes.
        expected: DeviceKind,
    },
    /// A size passes the index type a kernel uses.
    #[error("{op}: {what} = {value} passes the kernel's index limit {max}")]
    Index {
        /// The op.
        op: &'static str,
        /// The size.
        what: &'static str,
        /// Its value.
        value: u64,
        /// The limit.
        max: u64,
    },
    /// An op (or a form of one) this backend has no kernel for yet.
    #[error("{op} on the {backend} backend: {what} has no kernel there yet; {fix}")]
    Unsupported {
        /// The op.
        op: &'static str,
        /// The backend's name.
        backend: &'static str,
        /// What is missing ("grouped-query heads").
        what: &'static str,
        /// What to do.
        fix: &'static str,
    },
    /// A token id outside the vocabulary.
    #[error(
        "{op}: token {token} at position {position} is outside the vocabulary of {vocab}; use a model whose vocab covers the data"
    )]
    Token {
        /// The op.
        op: &'static str,
        /// The id.
        token: u32,
        /// Where it is.
        position: usize,
        /// The vocabulary size.
        vocab: usize,
    },
    /// A token id outside the vocabulary, found on the device (where the
    /// id itself is not read back).
    #[error(
        "{op}: the token at position {position} is outside the vocabulary of {vocab}; use a model whose vocab covers the data"
    )]
    TokenAt {
        /// The op.
        op: &'static str,
        /// Where it is.
        position: u64,
        /// The vocabulary size.
        vocab: u64,
    },
    /// More readbacks in flight than the backend has slots for.
    #[error(
        "{in_flight} readbacks are in flight, the most this backend holds; read them (Readback::get) before asking for more"
    )]
    Readbacks {
        /// The slots.
        in_flight: usize,
    },
    /// A CUDA C source did not compile (or compiled with warnings).
    #[error("NVRTC could not compile {source_name}.cu for sm_{arch}: {log}")]
    Compile {
        /// The source's name.
        source_name: &'static str,
        /// The architecture (90 for sm_90).
        arch: u32,
        /// NVRTC's log, or the failing call.
        log: String,
    },
    /// A GPU architecture strata has no kernels for.
    #[error("no kernels are built for sm_{arch}; strata compiles for {supported}")]
    Arch {
        /// The architecture asked for.
        arch: u32,
        /// The ones strata compiles for.
        supported: String,
    },
    /// The device failed (errors of enqueued work surface at fences).
    #[error(transparent)]
    Failed(#[from] DeviceError),
}

/// Results of strata-kernels.
pub type Result<T> = std::result::Result<T, KernelError>;

/// `Shape` unless an operand holds the `expected` number of elements.
pub(crate) fn same_len<N: PartialEq + std::fmt::Display>(
    op: &'static str,
    operand: &'static str,
    actual: N,
    expected: N,
) -> Result<()> {
    if actual != expected {
        return Err(KernelError::Shape {
            op,
            operand,
            actual: format!("{actual} elements"),
            expected: format!("{expected} elements"),
        });
    }
    Ok(())
}
