//! Float64 scalar references for every update rule: the ground truth every
//! instruction-set path is tested against. Straight transcriptions of the
//! PyTorch formulas, one element at a time, no fusion, no vectors, but for
//! one rule of strata's: Adam reads subnormal moments as zero ([`adam`]).

use crate::{AdagradConfig, AdamConfig, LionConfig};

/// One element's optimizer state, in f64.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct State64 {
    /// The parameter.
    pub p: f64,
    /// First state (Adam's m, Adagrad's sum, Lion's momentum).
    pub s1: f64,
    /// Second state (Adam's v; unused otherwise).
    pub s2: f64,
}

/// Adam/AdamW for one element at step `step` with `grad` already multiplied
/// by `grad_scale` by the caller's convention: here `grad` is the raw value.
/// One departure from PyTorch: a moment read below f32's smallest normal
/// (1.18e-38 in magnitude) is taken as zero, as the kernels read it (on x86
/// every step that reads a subnormal takes microcode assists); v only where
/// eps is at least [`crate::FLUSH_V_EPS_MIN`].
pub fn adam(config: &AdamConfig, step: u64, grad_scale: f64, grad: f64, x: State64) -> State64 {
    let mut g = grad * grad_scale;
    if config.maximize {
        g = -g;
    }
    let mut p = x.p;
    if config.decoupled_weight_decay {
        p *= 1.0 - config.lr * config.weight_decay;
    } else {
        g += config.weight_decay * p;
    }
    let m = flush_subnormal(x.s1);
    let v = match config.eps as f32 >= crate::FLUSH_V_EPS_MIN {
        true => flush_subnormal(x.s2),
        false => x.s2,
    };
    let m = m + (1.0 - config.beta1) * (g - m);
    let v = config.beta2 * v + (1.0 - config.beta2) * g * g;
    let t = step as i32;
    let (bias_correction1, bias_correction2) = match config.bias_correction {
        true => (1.0 - config.beta1.powi(t), 1.0 - config.beta2.powi(t)),
        false => (1.0, 1.0),
    };
    let denominator = v.sqrt() / bias_correction2.sqrt() + config.eps;
    p -= config.lr / bias_correction1 * m / denominator;
    State64 { p, s1: m, s2: v }
}

/// `x`, or zero where it is below f32's smallest normal in magnitude.
fn flush_subnormal(x: f64) -> f64 {
    match x.abs() < f64::from(f32::MIN_POSITIVE) {
        true => 0.0,
        false => x,
    }
}

/// Adagrad for one element (`s1` is the sum of squares).
pub fn adagrad(
    config: &AdagradConfig,
    step: u64,
    grad_scale: f64,
    grad: f64,
    x: State64,
) -> State64 {
    let mut g = grad * grad_scale;
    if config.maximize {
        g = -g;
    }
    g += config.weight_decay * x.p;
    let clr = config.lr / (1.0 + (step - 1) as f64 * config.lr_decay);
    let sum = x.s1 + g * g;
    let p = x.p - clr * g / (sum.sqrt() + config.eps);
    State64 {
        p,
        s1: sum,
        s2: 0.0,
    }
}

/// Lion for one element (`s1` is the momentum). The sign of zero is zero.
pub fn lion(config: &LionConfig, grad_scale: f64, grad: f64, x: State64) -> State64 {
    let g = grad * grad_scale;
    let c = config.beta1 * x.s1 + (1.0 - config.beta1) * g;
    let direction = if c > 0.0 {
        1.0
    } else if c < 0.0 {
        -1.0
    } else {
        0.0
    };
    let p = x.p * (1.0 - config.lr * config.weight_decay) - config.lr * direction;
    let m = config.beta2 * x.s1 + (1.0 - config.beta2) * g;
    State64 { p, s1: m, s2: 0.0 }
}

/// The sum of squares of some values, in f64.
pub fn sum_squares(values: impl IntoIterator<Item = f64>) -> f64 {
    values.into_iter().map(|x| x * x).sum()
}
