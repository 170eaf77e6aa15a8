//! Adam and AdamW over fp32 master weights, with PyTorch's update rule:
//!
//! ```text
//! g  = grad * grad_scale            (unscale x clip; negated to maximize)
//! g += weight_decay * p             (Adam: L2 in the gradient)
//! p *= 1 - lr * weight_decay        (AdamW: decoupled decay)
//! m  = m + (1 - beta1) * (g - m)    (PyTorch's lerp)
//! v  = beta2 * v + (1 - beta2) * g^2
//! p -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
//! ```
//!
//! One departure: m and v are read as zero where they are subnormal (v only
//! where eps is at least [`FLUSH_V_EPS_MIN`]), because on x86 every
//! multiply that reads a subnormal takes a microcode assist, and under a
//! gradient that stays zero rounding never takes a moment to zero.
//!
//! The same pass can take bf16/fp16 gradients and write the bf16/fp16
//! compute copy of the updated parameters: that is the fused offload step.

use half::{bf16, f16};

use crate::rounding::{Noise, Rounding, Stream};
use crate::simd::{self, Element, Kernel, Simd};
use crate::values::{LowPrecisionMut, Moments, MomentsRef, Split, Values, padded};
use crate::{Isa, OptimError};

/// Adam/AdamW hyperparameters, PyTorch's names and defaults.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamConfig {
    /// Learning rate (set it per step for schedules).
    pub lr: f64,
    /// First-moment decay.
    pub beta1: f64,
    /// Second-moment decay.
    pub beta2: f64,
    /// Added to the denominator for stability.
    pub eps: f64,
    /// Weight decay: decoupled (AdamW) or L2 (Adam), see below.
    pub weight_decay: f64,
    /// `true`: AdamW's `p *= 1 - lr * wd`; `false`: Adam's `g += wd * p`.
    pub decoupled_weight_decay: bool,
    /// Ascend the gradient instead of descending it.
    pub maximize: bool,
    /// Divide the moments by `1 - beta^t` (PyTorch always does; DeepSpeed's
    /// CPUAdam lets it be turned off).
    pub bias_correction: bool,
}

impl AdamConfig {
    /// `torch.optim.AdamW` defaults (weight decay 0.01) at this lr.
    pub fn adamw(lr: f64) -> AdamConfig {
        AdamConfig {
            lr,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
            decoupled_weight_decay: true,
            maximize: false,
            bias_correction: true,
        }
    }

    /// `torch.optim.Adam` defaults (no weight decay) at this lr.
    pub fn adam(lr: f64) -> AdamConfig {
        AdamConfig {
            weight_decay: 0.0,
            decoupled_weight_decay: false,
            ..AdamConfig::adamw(lr)
        }
    }

    /// Checks every hyperparameter's range (PyTorch's checks).
    pub fn validate(&self) -> Result<(), OptimError> {
        check("lr", self.lr, self.lr >= 0.0, "finite and >= 0")?;
        check(
            "beta1",
            self.beta1,
            (0.0..1.0).contains(&self.beta1),
            "in [0, 1)",
        )?;
        check(
            "beta2",
            self.beta2,
            (0.0..1.0).contains(&self.beta2),
            "in [0, 1)",
        )?;
        check("eps", self.eps, self.eps >= 0.0, "finite and >= 0")?;
        check(
            "weight_decay",
            self.weight_decay,
            self.weight_decay >= 0.0,
            "finite and >= 0",
        )
    }

    /// The per-step constants the kernel uses, for step `step` (from 1)
    /// with gradients multiplied by `grad_scale` (1 / loss scale times the
    /// clip coefficient).
    pub fn coefficients(&self, step: u64, grad_scale: f32) -> Result<AdamCoefficients, OptimError> {
        self.validate()?;
        check_step(step, grad_scale)?;
        // Bias corrections in f64, as PyTorch computes them in Python floats.
        let exponent = i32::try_from(step).unwrap_or(i32::MAX);
        let (bias_correction1, bias_correction2) = match self.bias_correction {
            true => (
                1.0 - self.beta1.powi(exponent),
                1.0 - self.beta2.powi(exponent),
            ),
            false => (1.0, 1.0),
        };
        let (l2, decay) = match self.decoupled_weight_decay {
            true => (0.0, 1.0 - self.lr * self.weight_decay),
            false => (self.weight_decay, 1.0),
        };
        Ok(AdamCoefficients {
            grad_scale: if self.maximize {
                -grad_scale
            } else {
                grad_scale
            },
            l2: l2 as f32,
            decay: decay as f32,
            beta2: self.beta2 as f32,
            one_minus_beta1: (1.0 - self.beta1) as f32,
            one_minus_beta2: (1.0 - self.beta2) as f32,
            inv_sqrt_bias_correction2: (1.0 / bias_correction2.sqrt()) as f32,
            eps: self.eps as f32,
            neg_step_size: (-self.lr / bias_correction1) as f32,
        })
    }
}

pub(crate) fn check(
    name: &'static str,
    value: f64,
    ok: bool,
    expected: &'static str,
) -> Result<(), OptimError> {
    if ok && value.is_finite() {
        Ok(())
    } else {
        Err(OptimError::InvalidHyperparameter {
            name,
            value,
            expected,
        })
    }
}

pub(crate) fn check_step(step: u64, grad_scale: f32) -> Result<(), OptimError> {
    if step == 0 {
        return Err(OptimError::StepZero);
    }
    if !(grad_scale.is_finite() && grad_scale > 0.0) {
        return Err(OptimError::InvalidGradScale { grad_scale });
    }
    Ok(())
}

/// One step's constants, derived by [`AdamConfig::coefficients`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamCoefficients {
    grad_scale: f32,
    l2: f32,
    decay: f32,
    beta2: f32,
    one_minus_beta1: f32,
    one_minus_beta2: f32,
    inv_sqrt_bias_correction2: f32,
    eps: f32,
    neg_step_size: f32,
}

impl AdamCoefficients {
    /// The constants in the order a device kernel takes them (the fields
    /// of `AdamCoefficients` in strata-kernels' `ops.cu`): grad_scale, l2,
    /// decay, beta2, 1 - beta1, 1 - beta2, 1 / sqrt(bias correction 2),
    /// eps, -step size.
    pub fn to_array(&self) -> [f32; 9] {
        [
            self.grad_scale,
            self.l2,
            self.decay,
            self.beta2,
            self.one_minus_beta1,
            self.one_minus_beta2,
            self.inv_sqrt_bias_correction2,
            self.eps,
            self.neg_step_size,
        ]
    }
}

/// One Adam/AdamW step over `params` on the calling thread: `grads` in any
/// format, moments in fp32 or bf16, and optionally the updated parameters
/// also written to `out` as bf16/fp16 (round to nearest even) in the same
/// pass. Use [`crate::Pool::adam_step`] to spread large tensors over cores.
///
/// # Panics
/// If the slices differ in length or `isa` is not available.
pub fn adam_step(
    isa: Isa,
    coefficients: &AdamCoefficients,
    params: &mut [f32],
    grads: Values<'_>,
    moments: Moments<'_>,
    out: Option<LowPrecisionMut<'_>>,
) {
    adam_step_rounded(
        isa,
        coefficients,
        params,
        grads,
        moments,
        out,
        Rounding::Nearest,
    )
}

/// [`adam_step`] with bf16 moments written as `rounding` says:
/// [`Rounding::Stochastic`] keeps them unbiased (round to nearest freezes
/// the second moment at beta2 = 0.999), with random bits that depend on the
/// elements' global indices, so any split of the tensor gives the same
/// result. fp32 moments and the 16-bit output copy are not affected (the
/// copy is rounded to nearest).
///
/// # Panics
/// As [`adam_step`].
pub fn adam_step_rounded(
    isa: Isa,
    coefficients: &AdamCoefficients,
    params: &mut [f32],
    grads: Values<'_>,
    moments: Moments<'_>,
    out: Option<LowPrecisionMut<'_>>,
    rounding: Rounding,
) {
    let whole_len = params.len();
    adam_step_part(
        isa,
        coefficients,
        params,
        grads,
        moments,
        out,
        rounding,
        whole_len,
    )
}

/// [`adam_step_rounded`] of a part of an update `whole_len` elements long:
/// whether the 16-bit copy is streamed past the caches follows the whole
/// update's length, so any cut of a large update streams as the whole
/// would.
#[allow(clippy::too_many_arguments)]
pub(crate) fn adam_step_part(
    isa: Isa,
    coefficients: &AdamCoefficients,
    params: &mut [f32],
    grads: Values<'_>,
    moments: Moments<'_>,
    out: Option<LowPrecisionMut<'_>>,
    rounding: Rounding,
    whole_len: usize,
) {
    let call = Call {
        isa,
        coefficients,
        whole_len,
        params,
        out,
        rounding,
    };
    call.run(grads, moments, None)
}

/// One Adam/AdamW step with bf16 master weights (state dtype (b): bf16
/// master and moments, 14 bytes per parameter per step with bf16
/// gradients): the update is computed in f32 and written back rounded as
/// `rounding` says, masters and bf16 moments alike. There is no separate
/// 16-bit copy: the masters are it.
///
/// # Panics
/// If the slices differ in length or `isa` is not available.
pub fn adam_step_bf16_master(
    isa: Isa,
    coefficients: &AdamCoefficients,
    params: &mut [bf16],
    grads: Values<'_>,
    moments: Moments<'_>,
    rounding: Rounding,
) {
    let call = Call {
        isa,
        coefficients,
        whole_len: params.len(),
        params,
        out: None,
        rounding,
    };
    call.run(grads, moments, None)
}

/// One Adam/AdamW step out of place, as the training engine runs it: the
/// states are read from `params_in`/`moments_in` and the updated ones
/// written to `params_out`/`moments_out` (another buffer, so the inputs
/// stay intact until the step is committed), `out` as in [`adam_step`].
/// Large outputs are written with non-temporal stores: writing a buffer
/// the step did not read otherwise costs a read for ownership of each line
/// (about 12 more bytes per parameter with fp32 states).
///
/// Master weights are f32, or bf16 (state dtype (b)): bf16 masters are
/// rounded as `rounding` says, and the 16-bit copy `out` is then the
/// master as stored (bit for bit when it is bf16).
///
/// # Panics
/// If the slices differ in length, the moments in and out differ in
/// format, or `isa` is not available.
#[allow(clippy::too_many_arguments)]
pub fn adam_step_out_of_place<P: Master>(
    isa: Isa,
    coefficients: &AdamCoefficients,
    params_in: &[P],
    moments_in: MomentsRef<'_>,
    grads: Values<'_>,
    params_out: &mut [P],
    moments_out: Moments<'_>,
    out: Option<LowPrecisionMut<'_>>,
    rounding: Rounding,
) {
    let shard = OutOfPlaceShard {
        coefficients,
        params_in,
        moments_in,
        grads,
        params_out,
        moments_out,
        out,
        rounding,
    };
    let whole_len = shard.params_out.len();
    adam_step_out_of_place_part(isa, shard, whole_len)
}

/// One tensor, or one stretch of a tensor in host memory, of an
/// out-of-place step: the arguments of [`adam_step_out_of_place`], for
/// [`crate::Pool::adam_step_out_of_place_many`].
pub struct OutOfPlaceShard<'a, P> {
    /// Its coefficients (a group's runs differ by weight decay).
    pub coefficients: &'a AdamCoefficients,
    /// Master weights read.
    pub params_in: &'a [P],
    /// Moments read.
    pub moments_in: MomentsRef<'a>,
    /// Gradients.
    pub grads: Values<'a>,
    /// Master weights written.
    pub params_out: &'a mut [P],
    /// Moments written.
    pub moments_out: Moments<'a>,
    /// The 16-bit copy written, if any.
    pub out: Option<LowPrecisionMut<'a>>,
    /// How bf16 states are rounded (keyed by the shard's first element).
    pub rounding: Rounding,
}

impl<P> Split for OutOfPlaceShard<'_, P> {
    fn split_at(self, mid: usize) -> (Self, Self) {
        let (first, rest) = (
            self.params_in,
            self.moments_in,
            self.grads,
            self.params_out,
            self.moments_out,
            self.out,
            self.rounding,
        )
            .split_at(mid);
        let part = |(params_in, moments_in, grads, params_out, moments_out, out, rounding)| {
            OutOfPlaceShard {
                coefficients: self.coefficients,
                params_in,
                moments_in,
                grads,
                params_out,
                moments_out,
                out,
                rounding,
            }
        };
        (part(first), part(rest))
    }
}

/// [`adam_step_out_of_place`] of `shard`, a part of an update `whole_len`
/// elements long: whether its outputs are streamed past the caches follows
/// the whole update's length, so a large update walked stretch by stretch
/// (host chunks of a few hundred KiB) is streamed like one call.
pub(crate) fn adam_step_out_of_place_part<P: Master>(
    isa: Isa,
    shard: OutOfPlaceShard<'_, P>,
    whole_len: usize,
) {
    P::out_of_place_part(isa, shard, whole_len)
}

/// The element type of master weights in an out-of-place step: f32 or
/// bf16 (sealed, as [`Element`]).
///
/// Its one method is not generic, so each type's update, and the dozens of
/// kernels (gradient, moment and copy formats, times each instruction set)
/// that it dispatches to, are compiled once, in this crate. A generic
/// function that reached them directly would be compiled again in every
/// crate that calls it with a concrete type, and would double the build.
pub trait Master: Element {
    /// One part of [`adam_step_out_of_place`] (of an update `whole_len`
    /// elements long) for masters of this type.
    #[doc(hidden)]
    fn out_of_place_part(isa: Isa, shard: OutOfPlaceShard<'_, Self>, whole_len: usize);
}

macro_rules! master {
    ($($t:ty),*) => {$(
        impl Master for $t {
            #[inline(never)]
            fn out_of_place_part(isa: Isa, shard: OutOfPlaceShard<'_, Self>, whole_len: usize) {
                out_of_place_part(isa, shard, whole_len)
            }
        }
    )*};
}
master!(f32, bf16);

/// The body of [`adam_step_out_of_place_part`], reached through [`Master`].
fn out_of_place_part<P: Element>(isa: Isa, shard: OutOfPlaceShard<'_, P>, whole_len: usize) {
    let call = Call {
        isa,
        coefficients: shard.coefficients,
        whole_len,
        params: shard.params_out,
        out: shard.out,
        rounding: shard.rounding,
    };
    let src = Some((shard.params_in, shard.moments_in));
    call.run(shard.grads, shard.moments_out, src)
}

struct Call<'a, 'c, P> {
    isa: Isa,
    coefficients: &'c AdamCoefficients,
    /// The length of the update this call is part of (see
    /// [`adam_step_part`] and [`adam_step_out_of_place_part`]).
    whole_len: usize,
    params: &'a mut [P],
    out: Option<LowPrecisionMut<'a>>,
    rounding: Rounding,
}

impl<'a, P: Element> Call<'a, '_, P> {
    /// Checks every length against the parameters' and dispatches on the
    /// gradients' format.
    fn run(self, grads: Values<'a>, moments: Moments<'a>, src: Option<(&'a [P], MomentsRef<'a>)>) {
        let len = self.params.len();
        assert_eq!(grads.len(), len, "gradients and params differ in length");
        moments.assert_len(len);
        if let Some(out) = &self.out {
            assert_eq!(out.len(), len, "output copy and params differ in length");
        }
        if let Some((params_in, moments_in)) = &src {
            assert_eq!(params_in.len(), len, "params in and out differ in length");
            assert_eq!(
                moments_in.len(),
                len,
                "moments in and params differ in length"
            );
        }
        match grads {
            Values::F32(g) => self.with_sources(g, moments, src),
            Values::Bf16(g) => self.with_sources(g, moments, src),
            Values::F16(g) => self.with_sources(g, moments, src),
        }
    }

    fn with_sources<G: Element>(
        self,
        grads: &'a [G],
        moments: Moments<'a>,
        src: Option<(&'a [P], MomentsRef<'a>)>,
    ) {
        match (moments, src) {
            (Moments::F32 { m, v }, None) => self.with_moments(grads, m, v, None),
            (Moments::Bf16 { m, v }, None) => self.with_moments(grads, m, v, None),
            (Moments::F32 { m, v }, Some((p0, MomentsRef::F32 { m: m0, v: v0 }))) => {
                self.with_moments(grads, m, v, Some((p0, m0, v0)))
            }
            (Moments::Bf16 { m, v }, Some((p0, MomentsRef::Bf16 { m: m0, v: v0 }))) => {
                self.with_moments(grads, m, v, Some((p0, m0, v0)))
            }
            _ => panic!("moments in and out differ in format"),
        }
    }

    fn with_moments<G: Element, M: Element>(
        self,
        grads: &'a [G],
        m: &'a mut [M],
        v: &'a mut [M],
        src: Option<Sources<'a, P, M>>,
    ) {
        let (isa, coefficients, whole_len, params, rounding) = (
            self.isa,
            self.coefficients,
            self.whole_len,
            self.params,
            self.rounding,
        );
        match self.out {
            None => simd::dispatch(
                isa,
                AdamKernel::<P, G, M, bf16> {
                    coefficients,
                    whole_len,
                    params,
                    grads,
                    m,
                    v,
                    out: None,
                    rounding,
                    src,
                },
            ),
            Some(LowPrecisionMut::Bf16(out)) => simd::dispatch(
                isa,
                AdamKernel {
                    coefficients,
                    whole_len,
                    params,
                    grads,
                    m,
                    v,
                    out: Some(out),
                    rounding,
                    src,
                },
            ),
            Some(LowPrecisionMut::F16(out)) => simd::dispatch(
                isa,
                AdamKernel::<P, G, M, f16> {
                    coefficients,
                    whole_len,
                    params,
                    grads,
                    m,
                    v,
                    out: Some(out),
                    rounding,
                    src,
                },
            ),
        }
    }
}

struct AdamKernel<'a, P, G, M, O> {
    coefficients: &'a AdamCoefficients,
    /// Outputs are streamed past the caches when this is long (see
    /// [`adam_step_out_of_place_part`]).
    whole_len: usize,
    params: &'a mut [P],
    grads: &'a [G],
    m: &'a mut [M],
    v: &'a mut [M],
    out: Option<&'a mut [O]>,
    rounding: Rounding,
    /// Out of place: the states read (params, m, v); in place: None.
    src: Option<Sources<'a, P, M>>,
}

/// The states an out-of-place step reads: params, m, v.
type Sources<'a, P, M> = (&'a [P], &'a [M], &'a [M]);

/// The coefficients broadcast to vectors once per call.
struct Splat<S: Simd> {
    grad_scale: S::V,
    l2: S::V,
    decay: S::V,
    beta2: S::V,
    one_minus_beta1: S::V,
    one_minus_beta2: S::V,
    inv_sqrt_bias_correction2: S::V,
    eps: S::V,
    neg_step_size: S::V,
    /// Whether v is read through `flush_subnormal` (eps at least
    /// [`FLUSH_V_EPS_MIN`]).
    flush_v: bool,
}

/// The least eps with which a subnormal v is read as zero. The denominator
/// is sqrt(v) / sqrt(1 - beta2^t) + eps, and sqrt of a subnormal is below
/// 1.1e-19 (3.4e-18 with the first step's bias correction at beta2 =
/// 0.999), so from this eps up reading v as zero moves the denominator by
/// less than 3.4e-6 of itself. Below it (eps = 0 above all, where a zero
/// denominator would make the step infinite) v is read as it is.
pub const FLUSH_V_EPS_MIN: f32 = 1e-12;

impl<S: Simd> Splat<S> {
    #[inline(always)]
    fn new(s: S, c: &AdamCoefficients) -> Splat<S> {
        Splat {
            grad_scale: s.splat(c.grad_scale),
            l2: s.splat(c.l2),
            decay: s.splat(c.decay),
            beta2: s.splat(c.beta2),
            one_minus_beta1: s.splat(c.one_minus_beta1),
            one_minus_beta2: s.splat(c.one_minus_beta2),
            inv_sqrt_bias_correction2: s.splat(c.inv_sqrt_bias_correction2),
            eps: s.splat(c.eps),
            neg_step_size: s.splat(c.neg_step_size),
            flush_v: c.eps >= FLUSH_V_EPS_MIN,
        }
    }

    /// One vector of the update; returns the new parameters (with
    /// `master`, as stored). With `noise` (m's words, v's words), bf16
    /// moments are rounded stochastically; with `master`, bf16 master
    /// weights too.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    fn update<P: Element, G: Element, M: Element>(
        &self,
        s: S,
        p: &mut [P],
        g: &[G],
        m: &mut [M],
        v: &mut [M],
        src: Option<Sources<'_, P, M>>,
        nt: bool,
        (noise, master): Drawn<S>,
    ) -> S::V {
        let (p0, m0, v0) = match src {
            Some((p, m, v)) => (P::load(s, p), M::load(s, m), M::load(s, v)),
            None => (P::load(s, p), M::load(s, m), M::load(s, v)),
        };
        // Subnormal moments are read as zero (see `portable::flush_subnormal`).
        let m0 = s.flush_subnormal(m0);
        let v0 = if self.flush_v {
            s.flush_subnormal(v0)
        } else {
            v0
        };
        let (m1, v1, p1) = self.step(s, p0, G::load(s, g), m0, v0);
        // A NaN in m1 or v1 makes p1 NaN, so one check of p1 clears all
        // three roundings of their NaN checks.
        let nan_free = noise.is_some() && s.nan_free(p1);
        match noise {
            Some((noise_m, noise_v)) => {
                M::store_sr(s, m, m1, noise_m, nan_free);
                M::store_sr(s, v, v1, noise_v, nan_free);
            }
            None if nt => {
                M::stream(s, m, m1);
                M::stream(s, v, v1);
            }
            None => {
                M::store(s, m, m1);
                M::store(s, v, v1);
            }
        }
        match master {
            Some(master) => {
                // The value returned is the master as stored, so that a
                // 16-bit copy of it equals it.
                P::store_sr_value(s, p, p1, master, nan_free)
            }
            None if nt => {
                P::stream(s, p, p1);
                p1
            }
            None => {
                P::store(s, p, p1);
                p1
            }
        }
    }
}

impl<S: Simd> Splat<S> {
    /// The update of one vector of widened states: the new m, v and
    /// parameters, before any rounding.
    #[inline(always)]
    fn step(&self, s: S, p0: S::V, g: S::V, m0: S::V, v0: S::V) -> (S::V, S::V, S::V) {
        let g = s.mul_add(self.l2, p0, s.mul(g, self.grad_scale));
        let m1 = s.mul_add(self.one_minus_beta1, s.sub(g, m0), m0);
        let v1 = s.mul_add(s.mul(g, g), self.one_minus_beta2, s.mul(v0, self.beta2));
        let denominator = s.mul_add(s.sqrt(v1), self.inv_sqrt_bias_correction2, self.eps);
        let p1 = s.mul_add(
            self.neg_step_size,
            s.div(m1, denominator),
            s.mul(p0, self.decay),
        );
        (m1, v1, p1)
    }

    /// `2 * LANES` elements in place where every stream is bf16 and every
    /// write rounds stochastically (state dtype (b)): loaded as pairs of
    /// vectors, the even-numbered elements and the odd ones
    /// ([`Simd::load_bf16_pair`]), so that widening and narrowing are a
    /// shift or a mask where one vector of bf16 takes a word shuffle (on
    /// AVX-512, seven shuffles per 16 elements, all on one port). Bit for
    /// bit what [`Splat::update`] writes: each element is computed and
    /// rounded the same, with the same random word.
    ///
    /// Out of place, `src` holds the states read; `out` is a bf16 copy of
    /// the masters as stored (their bits).
    #[inline(always)]
    fn update_pair<P: Element, G: Element, M: Element, O: Element>(
        &self,
        s: S,
        (p, g, m, v): (&mut [P], &[G], &mut [M], &mut [M]),
        src: Option<Sources<'_, P, M>>,
        out: Option<&mut [O]>,
        [even, odd]: [Split3<S>; 2],
    ) {
        // Subnormal moments are read as zero, as in `update`.
        let (p_in, m_in, v_in) = match src {
            Some(states) => states,
            None => (&*p, &*m, &*v),
        };
        let (p0, m0) = (P::load_pair(s, p_in), M::load_pair_flushed(s, m_in));
        let v0 = match self.flush_v {
            true => M::load_pair_flushed(s, v_in),
            false => M::load_pair(s, v_in),
        };
        let g0 = G::load_pair(s, g);
        let new_even = self.step(s, p0.0, g0.0, m0.0, v0.0);
        let new_odd = self.step(s, p0.1, g0.1, m0.1, v0.1);
        // As in `update`: a NaN in m1 or v1 makes p1 NaN; one compare
        // checks both halves' parameters.
        let nan_free = s.nan_free_both(new_even.2, new_odd.2);
        let even = self.round_half(s, new_even, even, nan_free);
        let odd = self.round_half(s, new_odd, odd, nan_free);
        M::store_pair_exact(s, m, even.0, odd.0);
        M::store_pair_exact(s, v, even.1, odd.1);
        P::store_pair_exact(s, p, even.2, odd.2);
        if let Some(out) = out {
            O::store_pair_exact(s, out, even.2, odd.2);
        }
    }

    /// One half of [`Splat::update_pair`]: its new m, v and parameters
    /// with their high halves rounded with their noise (`nan_free`: no
    /// parameter of the pair is NaN). (A method, not a closure: a closure
    /// is compiled without the back end's features.)
    #[inline(always)]
    fn round_half(
        &self,
        s: S,
        (m1, v1, p1): (S::V, S::V, S::V),
        (noise_m, noise_v, noise_p): Split3<S>,
        nan_free: bool,
    ) -> (S::V, S::V, S::V) {
        (
            s.bf16_sr_high(m1, noise_m, nan_free),
            s.bf16_sr_high(v1, noise_v, nan_free),
            s.bf16_sr_high(p1, noise_p, nan_free),
        )
    }
}

/// One vector's noise words (each below 2^16): the moments' (m's, v's)
/// and the master weights'.
type Drawn<S> = (
    Option<(<S as Simd>::U, <S as Simd>::U)>,
    Option<<S as Simd>::U>,
);

/// The five streams of one call, cut together with [`Split`].
type Streams<'a, P, G, M, O> = (
    &'a mut [P],
    &'a [G],
    &'a mut [M],
    &'a mut [M],
    Option<&'a mut [O]>,
    Option<Sources<'a, P, M>>,
);

impl<S: Simd> Splat<S> {
    /// Fewer than `LANES` elements (a head or tail) through the same vector
    /// code, by way of zero-padded stack copies.
    #[inline(always)]
    fn padded<P: Element, G: Element, M: Element, O: Element>(
        &self,
        s: S,
        (p, g, m, v, out, src): Streams<'_, P, G, M, O>,
        noise: Drawn<S>,
    ) {
        let rest = p.len();
        if rest == 0 {
            return;
        }
        let (mut p1, g1, mut m1, mut v1) = (padded(p), padded(g), padded(m), padded(v));
        let src = src.map(|(p, m, v)| (padded(p), padded(m), padded(v)));
        let src = src.as_ref().map(|(p, m, v)| (&p[..], &m[..], &v[..]));
        let new = self.update(s, &mut p1, &g1, &mut m1, &mut v1, src, false, noise);
        p.copy_from_slice(&p1[..rest]);
        m.copy_from_slice(&m1[..rest]);
        v.copy_from_slice(&v1[..rest]);
        if let Some(out) = out {
            let mut o = [O::default(); simd::LANES_MAX];
            O::store(s, &mut o, new);
            out.copy_from_slice(&o[..rest]);
        }
    }
}

/// Elements of an out-of-place step computed into the cache before they are
/// streamed out (1 KiB of each fp32 state, 16 lines; 8 of a 16-bit one). On the
/// 2-core development machine, 64M parameters on 2 threads, the
/// engine-shaped step ran at 0.78-0.82x the roofline kernel with 256, 0.68x
/// with 1024 and 0.59x with 4096: shorter bursts of one output's
/// non-temporal stores leave the loads less time waiting.
const TILE_ELEMS: usize = 256;

const _: () = assert!(TILE_ELEMS.is_multiple_of(simd::LANES_MAX));

/// An out-of-place step's outputs for one tile, in the cache.
struct Tile<P, M, O> {
    p: [P; TILE_ELEMS],
    m: [M; TILE_ELEMS],
    v: [M; TILE_ELEMS],
    out: [O; TILE_ELEMS],
}

impl<P: Element, M: Element, O: Element> Tile<P, M, O> {
    fn new() -> Self {
        Tile {
            p: [P::default(); TILE_ELEMS],
            m: [M::default(); TILE_ELEMS],
            v: [M::default(); TILE_ELEMS],
            out: [O::default(); TILE_ELEMS],
        }
    }
}

/// Copies a tile to `dst` with non-temporal stores wherever `dst` has
/// whole aligned vectors (as [`Simd::stream_bf16`] requires), and ordinary
/// stores before and after them: each output streams at its own alignment,
/// so a stretch of host memory that starts anywhere still goes past the
/// caches. 16-bit values pass through f32 unchanged.
#[inline(always)]
fn stream_out<S: Simd, T: Element>(s: S, src: &[T], dst: &mut [T]) {
    assert_eq!(
        src.len(),
        dst.len(),
        "a tile and its output differ in length"
    );
    let head = simd::align_head::<S, T>(dst);
    let body = simd::body_len::<S>(dst.len() - head);
    let (dst_head, rest) = dst.split_at_mut(head);
    let (dst_body, dst_tail) = rest.split_at_mut(body);
    dst_head.copy_from_slice(&src[..head]);
    for (d, x) in dst_body
        .chunks_exact_mut(S::LANES)
        .zip(src[head..].chunks_exact(S::LANES))
    {
        T::stream(s, d, T::load(s, x));
    }
    dst_tail.copy_from_slice(&src[head + body..]);
}

/// Random words for stochastic rounding: one word per element from the
/// moments' stream (m rounds with its low half, v with its high half, a bf16
/// master with the two halves xored, for no second hash), and the global
/// index of the call's first element. The three 16-bit words are pairwise
/// independent, not mutually (they xor to zero): each rounding is unbiased
/// on its own, which is what the states need.
struct Words<S: Simd> {
    moments: Noise<S>,
    master: bool,
    first: u64,
}

impl<S: Simd> Words<S> {
    /// The words of the vector at `offset` in the call, when rounding
    /// stochastically.
    #[inline(always)]
    fn at(words: &mut Option<Words<S>>, s: S, offset: usize) -> Drawn<S> {
        match words {
            None => (None, None),
            Some(w) => {
                let (low, high, master) = split(s, w.moments.lanes(s, w.first + offset as u64));
                (Some((low, high)), w.master.then_some(master))
            }
        }
    }

    /// The words of the pair at `offset` in the call ([`Noise::pair`]):
    /// the even-numbered elements', then the odd-numbered ones', each split
    /// as [`Words::at`] splits a vector's.
    ///
    /// # Panics
    /// When not rounding stochastically (pairs always do).
    #[inline(always)]
    fn pair(words: &mut Option<Words<S>>, s: S, offset: usize) -> [Split3<S>; 2] {
        let w = words.as_mut().expect("pairs round stochastically");
        let (even, odd) = w.moments.pair(s, w.first + offset as u64);
        [split(s, even), split(s, odd)]
    }
}

/// One vector's noise words for m, v and a bf16 master.
type Split3<S> = (<S as Simd>::U, <S as Simd>::U, <S as Simd>::U);

/// A random word's noise: m rounds with its low half, v with its high
/// half, a bf16 master with the two xored. (A function, not a closure: a
/// closure is compiled without the back end's features.)
#[inline(always)]
fn split<S: Simd>(s: S, word: S::U) -> Split3<S> {
    let (low, high) = s.halves(word);
    (low, high, s.xor_words(low, high))
}

impl<P: Element, G: Element, M: Element, O: Element> Kernel for AdamKernel<'_, P, G, M, O> {
    type Output = ();

    #[inline(always)]
    fn run<S: Simd>(self, s: S) {
        let k = Splat::new(s, self.coefficients);
        // Only 16-bit states take noise: with fp32 masters and moments a
        // stochastic step draws none.
        let sixteen = std::mem::size_of::<M>() < 4 || std::mem::size_of::<P>() < 4;
        let mut words = match self.rounding {
            Rounding::Stochastic { seed, step, first } if sixteen => Some(Words {
                moments: Noise::new(s, seed, step, Stream::Moments),
                // fp32 masters are stored as they are.
                master: std::mem::size_of::<P>() < 4,
                first,
            }),
            _ => None,
        };
        let n = S::LANES;
        let len = self.params.len();
        // A short head runs through the padded path so the body's
        // parameters are aligned (one vector per cache line). In place,
        // a large 16-bit copy goes out with non-temporal stores, which need
        // it aligned too: when one head cannot align both, it is stored
        // normally.
        let head = simd::align_head::<S, P>(self.params);
        let long = self.whole_len >= simd::STREAM_ELEMS_MIN;
        let stream = long
            && self
                .out
                .as_ref()
                .is_some_and(|out| simd::align_head::<S, O>(out) == head);
        // Out of place, the outputs are computed into a tile in the cache
        // and each streamed from there at its own alignment.
        let nt = self.src.is_some() && long;
        // bf16 gradients, moments and masters rounded stochastically (state
        // dtype (b)), any copy bf16 too: pairs of vectors
        // (Splat::update_pair).
        let pairs = P::PAIRS
            && G::PAIRS
            && M::PAIRS
            && (self.out.is_none() || O::PAIRS)
            && words.as_ref().is_some_and(|w| w.master);
        simd::note_streamed(if self.src.is_some() { nt } else { stream });
        let streams = (self.params, self.grads, self.m, self.v, self.out, self.src);
        let (head_part, rest) = streams.split_at(head);
        let body_len = simd::body_len::<S>(len - head);
        let (body, tail) = rest.split_at(body_len);
        k.padded(s, head_part, Words::at(&mut words, s, 0));
        let (p, g, m, v, mut out, src) = body;
        // Each vector asks for the lines its streams' later vectors will
        // read (simd::PREFETCH_ELEMS_DEFAULT).
        let ahead = simd::Ahead::get();
        let bases = (p.as_ptr(), g.as_ptr(), m.as_ptr(), v.as_ptr());
        let touch = |at: usize| {
            let i = at - head;
            ahead.touch(bases.0, i);
            ahead.touch(bases.1, i);
            ahead.touch(bases.2, i);
            ahead.touch(bases.3, i);
        };
        if let Some((p0, m0, v0)) = src {
            // Out of place the streams read are the sources and the gradient.
            let touch_sources = |i: usize| {
                ahead.touch(p0.as_ptr(), i);
                ahead.touch(m0.as_ptr(), i);
                ahead.touch(v0.as_ptr(), i);
                ahead.touch(g.as_ptr(), i);
            };
            if !nt {
                let paired = if pairs {
                    body_len / (2 * n) * (2 * n)
                } else {
                    0
                };
                for i in (0..paired).step_by(2 * n) {
                    touch_sources(i);
                    touch_sources(i + n);
                    let noise = Words::pair(&mut words, s, head + i);
                    let src = Some((&p0[i..], &m0[i..], &v0[i..]));
                    let streams = (&mut p[i..], &g[i..], &mut m[i..], &mut v[i..]);
                    let o = out.as_deref_mut().map(|o| &mut o[i..]);
                    k.update_pair(s, streams, src, o, noise);
                }
                for i in (paired..body_len).step_by(n) {
                    touch_sources(i);
                    let noise = Words::at(&mut words, s, head + i);
                    let src = Some((&p0[i..], &m0[i..], &v0[i..]));
                    let (p, m, v) = (&mut p[i..], &mut m[i..], &mut v[i..]);
                    let new = k.update(s, p, &g[i..], m, v, src, false, noise);
                    if let Some(out) = out.as_deref_mut() {
                        O::store(s, &mut out[i..], new);
                    }
                }
            } else {
                // A tile is computed into the cache, then each output is
                // streamed out whole, one after another: four streams
                // written at once would compete with the loads for the
                // core's line fill buffers and flush lines half written.
                let mut tile = Tile::<P, M, O>::new();
                for start in (0..body_len).step_by(TILE_ELEMS) {
                    let len = TILE_ELEMS.min(body_len - start);
                    let paired = if pairs { len / (2 * n) * (2 * n) } else { 0 };
                    for j in (0..paired).step_by(2 * n) {
                        let i = start + j;
                        touch_sources(i);
                        touch_sources(i + n);
                        let noise = Words::pair(&mut words, s, head + i);
                        let src = Some((&p0[i..], &m0[i..], &v0[i..]));
                        let (tp, tm, tv) = (&mut tile.p[j..], &mut tile.m[j..], &mut tile.v[j..]);
                        let tout = out.is_some().then_some(&mut tile.out[j..]);
                        k.update_pair(s, (tp, &g[i..], tm, tv), src, tout, noise);
                    }
                    for j in (paired..len).step_by(n) {
                        let i = start + j;
                        touch_sources(i);
                        let noise = Words::at(&mut words, s, head + i);
                        let src = Some((&p0[i..], &m0[i..], &v0[i..]));
                        let (tp, tm, tv) = (&mut tile.p[j..], &mut tile.m[j..], &mut tile.v[j..]);
                        let new = k.update(s, tp, &g[i..], tm, tv, src, false, noise);
                        O::store(s, &mut tile.out[j..], new);
                    }
                    let range = start..start + len;
                    stream_out(s, &tile.p[..len], &mut p[range.clone()]);
                    stream_out(s, &tile.m[..len], &mut m[range.clone()]);
                    stream_out(s, &tile.v[..len], &mut v[range.clone()]);
                    if let Some(out) = out.as_deref_mut() {
                        stream_out(s, &tile.out[..len], &mut out[range]);
                    }
                }
                s.fence();
            }
            k.padded(s, tail, Words::at(&mut words, s, head + body_len));
            return;
        }
        // In place, with no copy (the masters are it).
        if pairs && out.is_none() {
            // One vector first where that lines the pairs up with the
            // parameters' cache lines.
            let lead = if (p.as_ptr() as usize).is_multiple_of(2 * n * std::mem::size_of::<P>()) {
                0
            } else {
                n.min(body_len)
            };
            let paired = (body_len - lead) / (2 * n) * (2 * n);
            let (p, p_rest) = p.split_at_mut(lead + paired);
            let (g, g_rest) = g.split_at(lead + paired);
            let (m, m_rest) = m.split_at_mut(lead + paired);
            let (v, v_rest) = v.split_at_mut(lead + paired);
            if lead > 0 {
                let noise = Words::at(&mut words, s, head);
                k.update(s, p, g, m, v, None, false, noise);
            }
            for i in (lead..lead + paired).step_by(2 * n) {
                touch(head + i);
                touch(head + i + n);
                let noise = Words::pair(&mut words, s, head + i);
                let streams = (&mut p[i..], &g[i..], &mut m[i..], &mut v[i..]);
                k.update_pair::<P, G, M, O>(s, streams, None, None, noise);
            }
            // A last whole vector, then the tail.
            if body_len > lead + paired {
                let at = head + lead + paired;
                let noise = Words::at(&mut words, s, at);
                k.update(s, p_rest, g_rest, m_rest, v_rest, None, false, noise);
            }
            k.padded(s, tail, Words::at(&mut words, s, head + body_len));
            return;
        }
        let vectors = p
            .chunks_exact_mut(n)
            .zip(g.chunks_exact(n))
            .zip(m.chunks_exact_mut(n))
            .zip(v.chunks_exact_mut(n))
            .enumerate()
            .map(|(i, x)| (head + i * n, x));
        match out {
            Some(out) if stream => {
                for ((at, (((p, g), m), v)), o) in vectors.zip(out.chunks_exact_mut(n)) {
                    let noise = Words::at(&mut words, s, at);
                    touch(at);
                    O::stream(s, o, k.update(s, p, g, m, v, None, false, noise));
                }
                s.fence();
            }
            Some(out) => {
                for ((at, (((p, g), m), v)), o) in vectors.zip(out.chunks_exact_mut(n)) {
                    let noise = Words::at(&mut words, s, at);
                    touch(at);
                    O::store(s, o, k.update(s, p, g, m, v, None, false, noise));
                }
            }
            None => {
                for (at, (((p, g), m), v)) in vectors {
                    let noise = Words::at(&mut words, s, at);
                    touch(at);
                    k.update(s, p, g, m, v, None, false, noise);
                }
            }
        }
        k.padded(s, tail, Words::at(&mut words, s, head + body_len));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// bf16 masters out of place, as the engine runs state dtype (b): with
    /// bf16 gradients the tile path takes pairs of vectors, with fp32
    /// gradients holding the same values single ones. The same bits, NaN
    /// payloads included, at any length, alignment and first index, with
    /// and without the bf16 copy; streamed through the tile (a `whole_len`
    /// that makes small slices stream as a part of a long update does) and
    /// not.
    #[test]
    fn out_of_place_pairs_write_what_single_vectors_write() {
        let value = |i: usize, salt: u32| -> bf16 {
            let x = ((i as u32).wrapping_mul(2_654_435_761) ^ salt) % 2000;
            bf16::from_f32(x as f32 * 1e-3 - 1.0)
        };
        let coefficients = AdamConfig::adamw(1e-2).coefficients(4, 1.0).unwrap();
        for isa in Isa::available() {
            for len in [0usize, 1, 16, 17, 32, 33, 255, 256, 257, 300, 1000] {
                for offset in [0usize, 1, 8, 17] {
                    for (first, copy, whole_len) in [
                        (0u64, true, simd::STREAM_ELEMS_MIN),
                        ((1 << 32) - 40, true, simd::STREAM_ELEMS_MIN),
                        (9, false, simd::STREAM_ELEMS_MIN),
                        (0, true, len),
                        ((1 << 32) - 40, false, len),
                    ] {
                        let n = offset + len;
                        let mut g: Vec<bf16> = (0..n).map(|i| value(i, 1)).collect();
                        let mut p0: Vec<bf16> = (0..n).map(|i| value(i, 2)).collect();
                        let mut m0: Vec<bf16> = (0..n).map(|i| value(i, 3)).collect();
                        let mut v0: Vec<bf16> = (0..n)
                            .map(|i| bf16::from_f32(value(i, 4).to_f32().abs() * 1e-3))
                            .collect();
                        // NaN and infinity in both halves of pairs, and a
                        // subnormal.
                        if n > 40 {
                            g[n / 2] = bf16::NAN;
                            g[n / 2 + 17] = bf16::NAN;
                            p0[n - 3] = bf16::INFINITY;
                            v0[n - 30] = bf16::INFINITY;
                            m0[n - 33] = bf16::from_bits(1);
                        }
                        let wide: Vec<f32> = g.iter().map(|x| x.to_f32()).collect();
                        let run = |grads: Values<'_>| {
                            let (mut p, mut m, mut v, mut out) = (
                                vec![bf16::ZERO; n],
                                vec![bf16::ZERO; n],
                                vec![bf16::ZERO; n],
                                vec![bf16::ZERO; n],
                            );
                            let shard = OutOfPlaceShard {
                                coefficients: &coefficients,
                                params_in: &p0[offset..],
                                moments_in: MomentsRef::Bf16 {
                                    m: &m0[offset..],
                                    v: &v0[offset..],
                                },
                                grads,
                                params_out: &mut p[offset..],
                                moments_out: Moments::Bf16 {
                                    m: &mut m[offset..],
                                    v: &mut v[offset..],
                                },
                                out: copy.then(|| LowPrecisionMut::Bf16(&mut out[offset..])),
                                rounding: Rounding::Stochastic {
                                    seed: 3,
                                    step: 4,
                                    first,
                                },
                            };
                            adam_step_out_of_place_part(isa, shard, whole_len);
                            [p, m, v, out]
                                .map(|x| x.iter().map(|x| x.to_bits()).collect::<Vec<_>>())
                        };
                        let pairs = run(Values::Bf16(&g[offset..]));
                        let single = run(Values::F32(&wide[offset..]));
                        assert!(
                            pairs == single,
                            "{isa} len {len} offset {offset} first {first} copy {copy} whole {whole_len}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn bad_hyperparameters_are_named() {
        let error = AdamConfig {
            beta2: 1.0,
            ..AdamConfig::adamw(1e-3)
        }
        .validate()
        .unwrap_err();
        assert!(error.to_string().contains("beta2 = 1"), "{error}");
        let error = AdamConfig {
            lr: f64::NAN,
            ..AdamConfig::adamw(1e-3)
        }
        .validate()
        .unwrap_err();
        assert!(error.to_string().contains("lr"), "{error}");
        assert!(matches!(
            AdamConfig::adam(1e-3).coefficients(0, 1.0),
            Err(OptimError::StepZero)
        ));
        let error = AdamConfig::adam(1e-3)
            .coefficients(1, f32::INFINITY)
            .unwrap_err();
        assert!(
            matches!(error, OptimError::InvalidGradScale { .. }),
            "{error}"
        );
    }

    #[test]
    fn tails_and_bodies_agree_elementwise() {
        // The same element must get the same bits whether it sits in a
        // whole vector or in the padded tail.
        let isa = Isa::chosen();
        let c = AdamConfig::adamw(1e-2).coefficients(3, 0.5).unwrap();
        let make = |n: usize| {
            let p: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
            let g: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos()).collect();
            (p, g, vec![0.01f32; n], vec![0.02f32; n])
        };
        let (mut p_long, g_long, mut m_long, mut v_long) = make(35);
        adam_step(
            isa,
            &c,
            &mut p_long,
            Values::F32(&g_long),
            Moments::F32 {
                m: &mut m_long,
                v: &mut v_long,
            },
            None,
        );
        for n in 1..35 {
            let (mut p, g, mut m, mut v) = make(n);
            adam_step(
                isa,
                &c,
                &mut p,
                Values::F32(&g),
                Moments::F32 {
                    m: &mut m,
                    v: &mut v,
                },
                None,
            );
            assert_eq!(p, p_long[..n], "n = {n}");
            assert_eq!(m, m_long[..n]);
            assert_eq!(v, v_long[..n]);
        }
    }
}
