//! strata-optim holds the numeric kernels of CPU-side training for
//! ZeRO-Offload: Adam, AdamW, Adagrad and Lion over fp32 master weights, the
//! fused offload step (bf16/fp16 gradients in, unscale and clip, AdamW, the
//! bf16/fp16 compute copy out, in one pass over memory), the global gradient
//! norm fused with overflow detection, accumulation and conversions.
//!
//! Kernels are free functions over slices ([`adam_step`], [`grad_norm`],
//! ...) that run on the calling thread with an instruction set ([`Isa`])
//! chosen once at start; [`Pool`] runs the same kernels over one pinned
//! thread per core. Nothing here allocates inside a step or knows where the
//! slices came from.
//!
//! ```
//! use strata_optim::{AdamConfig, Isa, LowPrecisionMut, Moments, Values, adam_step, grad_norm};
//! use half::bf16;
//!
//! let n = 1000;
//! let (mut params, mut m, mut v) = (vec![0.5f32; n], vec![0.0f32; n], vec![0.0f32; n]);
//! let grads = vec![bf16::from_f32(0.25); n];
//! let mut compute_copy = vec![bf16::ZERO; n];
//!
//! let isa = Isa::chosen();
//! let norm = grad_norm(isa, Values::Bf16(&grads));
//! assert!(norm.is_finite());
//! let coefficients = AdamConfig::adamw(1e-3).coefficients(1, 1.0)?;
//! adam_step(
//!     isa,
//!     &coefficients,
//!     &mut params,
//!     Values::Bf16(&grads),
//!     Moments::F32 { m: &mut m, v: &mut v },
//!     Some(LowPrecisionMut::Bf16(&mut compute_copy)),
//! );
//! assert!(params[0] < 0.5);
//! assert_eq!(compute_copy[0], bf16::from_f32(params[0]));
//! # Ok::<(), strata_optim::OptimError>(())
//! ```

mod adagrad;
mod adam;
pub mod bench;
mod error;
mod grads;
mod isa;
mod lion;
mod pool;
pub mod reference;
mod rounding;
mod scaler;
mod simd;
mod single_state;
pub mod topology;
mod values;

pub use adagrad::{AdagradCoefficients, AdagradConfig, adagrad_step};
pub use adam::{
    AdamCoefficients, AdamConfig, FLUSH_V_EPS_MIN, Master, OutOfPlaceShard, adam_step,
    adam_step_bf16_master, adam_step_out_of_place, adam_step_rounded,
};
pub use error::OptimError;
pub use grads::{
    GradNorm, StepDecision, accumulate, clip_coefficient, decide_step, grad_norm, narrow,
    roofline_4r3w, widen,
};
pub use half::{bf16, f16};
pub use isa::Isa;
pub use lion::{LionCoefficients, LionConfig, lion_step};
pub use pool::{
    AdamShard, PIECE_ELEMS_MIN, PIECES_PER_THREAD, Pool, PoolConfig, SPLIT_ALIGN_ELEMS, StateShard,
    THREADS_MAX, WAKE_MAX,
};
pub use rounding::{Rounding, narrow_stochastic, round_bf16_stochastic};
pub use scaler::{LossScaler, LossScalerConfig};
pub use simd::{Element, prefetch_elems};
pub use values::{LowPrecisionMut, Moments, MomentsRef, Split, Values};
