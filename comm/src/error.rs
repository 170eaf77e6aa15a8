//! The one error type of strata-comm.

use strata_device::{DeviceError, Dtype};

/// Everything that can go wrong in a collective. Variants carry the
/// numbers; messages say what to change.
#[derive(Debug, thiserror::Error)]
pub enum CommError {
    /// A rank left the group (it returned, failed or panicked): the
    /// collective cannot complete.
    #[error("rank {rank} left the group (it failed or stopped); its own error says why")]
    PeerLeft {
        /// The rank that left.
        rank: usize,
    },
    /// The group's [`strata_device::Cancel`] was cancelled (the run is
    /// being aborted).
    #[error("cancelled: the run was aborted while this rank waited for its peers")]
    Cancelled,
    /// An exchange is larger than the buffers sized at start.
    #[error("a collective of {requested} elements exceeds {what} ({max}); raise it")]
    Limit {
        /// The limit's name.
        what: &'static str,
        /// Its value.
        max: u64,
        /// What was asked for.
        requested: u64,
    },
    /// Operands whose sizes do not fit the collective.
    #[error("{op}: {what} holds {actual} elements but {expected} were needed")]
    Shape {
        /// The collective.
        op: &'static str,
        /// The operand.
        what: &'static str,
        /// Elements needed.
        expected: usize,
        /// Elements given.
        actual: usize,
    },
    /// A dtype the collective cannot carry (sums of integers), or operands
    /// of different dtypes.
    #[error("{op} cannot carry {dtype} here: {why}")]
    Dtype {
        /// The collective.
        op: &'static str,
        /// The dtype.
        dtype: Dtype,
        /// Why not.
        why: &'static str,
    },
    /// A peer rank outside the group.
    #[error("{op} names rank {peer}, but the group has ranks 0..{world}")]
    Peer {
        /// The collective.
        op: &'static str,
        /// The rank named.
        peer: usize,
        /// Ranks in the group.
        world: usize,
    },
    /// A buffer on a device this backend cannot reach (device memory for
    /// the in-process backend).
    #[error("{op}: the in-process backend reaches host memory only, and {what} is on {kind:?}")]
    Unreachable {
        /// The collective.
        op: &'static str,
        /// The operand.
        what: &'static str,
        /// Its device.
        kind: strata_device::DeviceKind,
    },
    /// An operation's peers did not answer within the group's timeout (a
    /// rank that died, hung or is stuck far behind).
    #[error(
        "{op} of {bytes} bytes: no answer from rank(s) {peers:?} after {waited_s:.1} s (the peer died, hung, or is far behind): the run stops; raise [comm] timeout_s if the ranks are only slow"
    )]
    Timeout {
        /// The operation.
        op: &'static str,
        /// Its bytes on this rank.
        bytes: u64,
        /// The ranks it still waited for.
        peers: Vec<usize>,
        /// Seconds waited.
        waited_s: f64,
    },
    /// An earlier operation of the group was given up (timeout or
    /// cancel): the group cannot be used again.
    #[error(
        "{op}: an earlier operation of this group was given up (a timeout or a cancel), so it cannot be used again"
    )]
    Abandoned {
        /// The operation refused.
        op: &'static str,
    },
    /// A subgroup asked for with members that are not increasing ranks of
    /// the group holding this one.
    #[error(
        "a subgroup of {members:?}: it must be increasing ranks of 0..{world} that hold this rank ({rank})"
    )]
    Split {
        /// The members asked for.
        members: Vec<usize>,
        /// This rank.
        rank: usize,
        /// Ranks in the group split.
        world: usize,
    },
    /// A peer's socket closed mid-operation: its process exited or was
    /// killed.
    #[error(
        "{op} of {bytes} bytes: rank {rank} closed its connection (its process exited or was killed): the run stops; rank {rank}'s own output says why, if it could"
    )]
    Closed {
        /// The operation.
        op: &'static str,
        /// Its bytes on this rank.
        bytes: u64,
        /// The rank that went away.
        rank: usize,
    },
    /// A socket to a peer failed otherwise.
    #[error("{op}: the socket to rank {rank} failed: {error}")]
    Socket {
        /// The operation.
        op: &'static str,
        /// The peer.
        rank: usize,
        /// The OS's words.
        error: String,
    },
    /// A peer's message was not the one this rank's operation expects:
    /// the ranks called different collectives.
    #[error(
        "rank {rank} sent {got} where this rank expected {expected}: the ranks called different collectives (ranks of two runs, or a bug: report it)"
    )]
    Disagree {
        /// The peer.
        rank: usize,
        /// What this rank's operation expected.
        expected: String,
        /// What came.
        got: String,
    },
    /// The ranks could not find each other.
    #[error("rendezvous: {problem}; {fix}")]
    Rendezvous {
        /// What went wrong.
        problem: String,
        /// What to do.
        fix: String,
    },
    /// MPI could not be set up.
    #[error("MPI: {problem}; {fix}")]
    Mpi {
        /// What went wrong.
        problem: String,
        /// What to do.
        fix: String,
    },
    /// What a backend cannot do (yet), with the reason and the fix.
    #[error("{op}: {why}")]
    Unsupported {
        /// The operation.
        op: &'static str,
        /// Why not, and what to do.
        why: String,
    },
    /// NCCL refused or failed a call (the communicator is aborted).
    #[error("NCCL {op} failed: {code}{}", if detail.is_empty() { String::new() } else { format!(" ({detail})") })]
    Nccl {
        /// The call.
        op: &'static str,
        /// NCCL's result code.
        code: String,
        /// `ncclGetLastError`'s words.
        detail: String,
    },
    /// The device failed.
    #[error(transparent)]
    Device(#[from] DeviceError),
}

/// Results of strata-comm.
pub type Result<T> = std::result::Result<T, CommError>;
