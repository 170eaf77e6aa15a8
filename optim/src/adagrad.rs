//! Adagrad with PyTorch's update rule:
//!
//! ```text
//! g    = grad * grad_scale + weight_decay * p   (negated first to maximize)
//! clr  = lr / (1 + (t - 1) * lr_decay)
//! sum += g^2
//! p   -= clr * g / (sqrt(sum) + eps)
//! ```
//!
//! Start the state at `initial_accumulator_value` (PyTorch's default 0).

use crate::adam::{check, check_step};
use crate::simd::{Element, Simd};
use crate::single_state::{self, Rule};
use crate::values::{LowPrecisionMut, Values};
use crate::{Isa, OptimError};

/// Adagrad hyperparameters, PyTorch's names and defaults.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdagradConfig {
    /// Learning rate.
    pub lr: f64,
    /// Learning-rate decay per step.
    pub lr_decay: f64,
    /// L2 weight decay (added to the gradient).
    pub weight_decay: f64,
    /// Added to the denominator for stability.
    pub eps: f64,
    /// Ascend the gradient instead of descending it.
    pub maximize: bool,
}

impl AdagradConfig {
    /// `torch.optim.Adagrad` defaults at this lr.
    pub fn new(lr: f64) -> AdagradConfig {
        AdagradConfig {
            lr,
            lr_decay: 0.0,
            weight_decay: 0.0,
            eps: 1e-10,
            maximize: false,
        }
    }

    /// Checks every hyperparameter's range.
    pub fn validate(&self) -> Result<(), OptimError> {
        check("lr", self.lr, self.lr >= 0.0, "finite and >= 0")?;
        check(
            "lr_decay",
            self.lr_decay,
            self.lr_decay >= 0.0,
            "finite and >= 0",
        )?;
        check(
            "weight_decay",
            self.weight_decay,
            self.weight_decay >= 0.0,
            "finite and >= 0",
        )?;
        check("eps", self.eps, self.eps >= 0.0, "finite and >= 0")
    }

    /// The constants for step `step` (from 1) with gradients multiplied by
    /// `grad_scale`.
    pub fn coefficients(
        &self,
        step: u64,
        grad_scale: f32,
    ) -> Result<AdagradCoefficients, OptimError> {
        self.validate()?;
        check_step(step, grad_scale)?;
        let clr = self.lr / (1.0 + (step - 1) as f64 * self.lr_decay);
        Ok(AdagradCoefficients {
            grad_scale: if self.maximize {
                -grad_scale
            } else {
                grad_scale
            },
            weight_decay: self.weight_decay as f32,
            neg_clr: -clr as f32,
            eps: self.eps as f32,
        })
    }
}

/// One step's constants, from [`AdagradConfig::coefficients`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdagradCoefficients {
    grad_scale: f32,
    weight_decay: f32,
    neg_clr: f32,
    eps: f32,
}

/// One Adagrad step on the calling thread; `state` is the running sum of
/// squared gradients. See [`crate::adam_step`] for `out`.
///
/// # Panics
/// If the slices differ in length or `isa` is not available.
pub fn adagrad_step(
    isa: Isa,
    coefficients: &AdagradCoefficients,
    params: &mut [f32],
    grads: Values<'_>,
    state: &mut [f32],
    out: Option<LowPrecisionMut<'_>>,
) {
    let whole_len = params.len();
    single_state::step(isa, coefficients, params, grads, state, out, whole_len)
}

pub(crate) struct AdagradSplat<S: Simd> {
    grad_scale: S::V,
    weight_decay: S::V,
    neg_clr: S::V,
    eps: S::V,
}

impl Rule for AdagradCoefficients {
    type Splat<S: Simd> = AdagradSplat<S>;

    #[inline(always)]
    fn splat<S: Simd>(&self, s: S) -> AdagradSplat<S> {
        AdagradSplat {
            grad_scale: s.splat(self.grad_scale),
            weight_decay: s.splat(self.weight_decay),
            neg_clr: s.splat(self.neg_clr),
            eps: s.splat(self.eps),
        }
    }

    #[inline(always)]
    fn update<S: Simd, G: Element>(
        k: &AdagradSplat<S>,
        s: S,
        p: &mut [f32],
        g: &[G],
        state: &mut [f32],
    ) -> S::V {
        let p0 = s.load(p);
        let g = s.mul_add(k.weight_decay, p0, s.mul(G::load(s, g), k.grad_scale));
        let sum = s.mul_add(g, g, s.load(state));
        s.store(state, sum);
        let denominator = s.add(s.sqrt(sum), k.eps);
        let p1 = s.mul_add(k.neg_clr, s.div(g, denominator), p0);
        s.store(p, p1);
        p1
    }
}
