//! Evaluation: a model's mean loss and perplexity over every window of a
//! corpus (held-out data), forward only. [`Engine::evaluate`] runs it with
//! the parameters where training keeps them, during a run (`[eval]`) or
//! on a checkpoint ([`evaluate`], `strata eval`); the windows are read in
//! file order, each once, with the marks training reads (loss masks,
//! packed documents kept apart), and the loss is the mean over the
//! targets counted.
//!
//! [`Engine::evaluate`]: crate::Engine::evaluate

pub use crate::engine::evaluate;

use crate::engine::TierBytes;

/// What an evaluation measured.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Evaluation {
    /// Windows read (sequences of `seq + 1` tokens).
    pub windows: u64,
    /// Targets the loss counted.
    pub targets: u64,
    /// The mean cross-entropy over them (nats).
    pub loss: f64,
    /// `exp(loss)`.
    pub perplexity: f64,
    /// Seconds the forward passes took.
    pub seconds: f64,
    /// Tokens (inputs) read a second.
    pub tokens_per_s: f64,
    /// Rank 0's peak bytes per tier so far (device including the compute
    /// workspace): during a run, the run's.
    pub peak_bytes: TierBytes,
}
