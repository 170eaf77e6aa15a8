//! The crate's one error type. Kernels themselves do not fail: a slice of
//! the wrong length is a caller bug and panics. Errors come from
//! configuration (hyperparameters, instruction sets, thread pools).

/// What went wrong configuring or preparing an optimizer step.
#[derive(Debug, thiserror::Error)]
pub enum OptimError {
    /// A hyperparameter is out of its valid range.
    #[error("invalid {name} = {value}: it must be {expected}")]
    InvalidHyperparameter {
        /// The hyperparameter, as named in configs (`lr`, `beta1`, ...).
        name: &'static str,
        /// The value given.
        value: f64,
        /// The valid range, in words.
        expected: &'static str,
    },
    /// Steps are counted from 1 (bias correction divides by `1 - beta^step`).
    #[error("optimizer step 0 is invalid: steps count from 1")]
    StepZero,
    /// A gradient scale (unscale x clip factor) that is zero, negative or
    /// not finite would corrupt every parameter.
    #[error("gradient scale {grad_scale} is invalid: it must be finite and > 0")]
    InvalidGradScale {
        /// The scale given.
        grad_scale: f32,
    },
    /// `STRATA_ISA` or `--isa` named no instruction set strata knows.
    #[error(
        "unknown instruction set {name:?}: choose portable, avx2, avx512, avx512vaes or avx512bf16"
    )]
    UnknownIsa {
        /// The name given.
        name: String,
    },
    /// The CPU lacks the asked-for instruction set.
    #[error("this CPU does not support {isa}; available: {available}")]
    IsaUnavailable {
        /// What was asked for.
        isa: &'static str,
        /// What this CPU supports, comma-separated.
        available: String,
    },
    /// A thread count of 0 or above the limit.
    #[error("{threads} optimizer threads asked for: choose 1 to {threads_max}")]
    Threads {
        /// The count given.
        threads: usize,
        /// `crate::THREADS_MAX`.
        threads_max: usize,
    },
    /// The thread pool could not start.
    #[error("cannot start the optimizer thread pool: {reason}")]
    Pool {
        /// rayon's message.
        reason: String,
    },
}
