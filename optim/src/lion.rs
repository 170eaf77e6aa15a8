//! Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"),
//! as the reference implementation and DeepSpeed's CPU Lion do it:
//!
//! ```text
//! g  = grad * grad_scale
//! u  = sign(beta1 * m + (1 - beta1) * g)
//! p  = p * (1 - lr * weight_decay) - lr * u
//! m  = beta2 * m + (1 - beta2) * g
//! ```

use crate::adam::{check, check_step};
use crate::simd::{Element, Simd};
use crate::single_state::{self, Rule};
use crate::values::{LowPrecisionMut, Values};
use crate::{Isa, OptimError};

/// Lion hyperparameters, the paper's names and the reference defaults.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LionConfig {
    /// Learning rate (typically 3-10x smaller than AdamW's).
    pub lr: f64,
    /// Interpolation for the update direction.
    pub beta1: f64,
    /// Momentum decay.
    pub beta2: f64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
}

impl LionConfig {
    /// The reference defaults (betas 0.9, 0.99; no weight decay) at this lr.
    pub fn new(lr: f64) -> LionConfig {
        LionConfig {
            lr,
            beta1: 0.9,
            beta2: 0.99,
            weight_decay: 0.0,
        }
    }

    /// Checks every hyperparameter's range.
    pub fn validate(&self) -> Result<(), OptimError> {
        check("lr", self.lr, self.lr >= 0.0, "finite and >= 0")?;
        check(
            "beta1",
            self.beta1,
            (0.0..=1.0).contains(&self.beta1),
            "in [0, 1]",
        )?;
        check(
            "beta2",
            self.beta2,
            (0.0..=1.0).contains(&self.beta2),
            "in [0, 1]",
        )?;
        check(
            "weight_decay",
            self.weight_decay,
            self.weight_decay >= 0.0,
            "finite and >= 0",
        )
    }

    /// The constants for step `step` (from 1) with gradients multiplied by
    /// `grad_scale`. Lion's sign makes the scale matter only through the
    /// momentum.
    pub fn coefficients(&self, step: u64, grad_scale: f32) -> Result<LionCoefficients, OptimError> {
        self.validate()?;
        check_step(step, grad_scale)?;
        Ok(LionCoefficients {
            grad_scale,
            beta1: self.beta1 as f32,
            beta2: self.beta2 as f32,
            one_minus_beta1: (1.0 - self.beta1) as f32,
            one_minus_beta2: (1.0 - self.beta2) as f32,
            decay: (1.0 - self.lr * self.weight_decay) as f32,
            neg_lr: -self.lr as f32,
        })
    }
}

/// One step's constants, from [`LionConfig::coefficients`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LionCoefficients {
    grad_scale: f32,
    beta1: f32,
    beta2: f32,
    one_minus_beta1: f32,
    one_minus_beta2: f32,
    decay: f32,
    neg_lr: f32,
}

/// One Lion step on the calling thread; `momentum` is Lion's one state.
/// See [`crate::adam_step`] for `out`.
///
/// # Panics
/// If the slices differ in length or `isa` is not available.
pub fn lion_step(
    isa: Isa,
    coefficients: &LionCoefficients,
    params: &mut [f32],
    grads: Values<'_>,
    momentum: &mut [f32],
    out: Option<LowPrecisionMut<'_>>,
) {
    let whole_len = params.len();
    single_state::step(isa, coefficients, params, grads, momentum, out, whole_len)
}

pub(crate) struct LionSplat<S: Simd> {
    grad_scale: S::V,
    beta1: S::V,
    beta2: S::V,
    one_minus_beta1: S::V,
    one_minus_beta2: S::V,
    decay: S::V,
    neg_lr: S::V,
}

impl Rule for LionCoefficients {
    type Splat<S: Simd> = LionSplat<S>;

    #[inline(always)]
    fn splat<S: Simd>(&self, s: S) -> LionSplat<S> {
        LionSplat {
            grad_scale: s.splat(self.grad_scale),
            beta1: s.splat(self.beta1),
            beta2: s.splat(self.beta2),
            one_minus_beta1: s.splat(self.one_minus_beta1),
            one_minus_beta2: s.splat(self.one_minus_beta2),
            decay: s.splat(self.decay),
            neg_lr: s.splat(self.neg_lr),
        }
    }

    #[inline(always)]
    fn update<S: Simd, G: Element>(
        k: &LionSplat<S>,
        s: S,
        p: &mut [f32],
        g: &[G],
        momentum: &mut [f32],
    ) -> S::V {
        let g = s.mul(G::load(s, g), k.grad_scale);
        let m0 = s.load(momentum);
        let direction = s.sign(s.mul_add(k.one_minus_beta1, g, s.mul(m0, k.beta1)));
        let p1 = s.mul_add(k.neg_lr, direction, s.mul(s.load(p), k.decay));
        s.store(
            momentum,
            s.mul_add(k.one_minus_beta2, g, s.mul(m0, k.beta2)),
        );
        s.store(p, p1);
        p1
    }
}
