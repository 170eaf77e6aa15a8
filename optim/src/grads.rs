//! What happens to gradients around the step: the global L2 norm over many
//! shards fused with non-finite detection, the clip coefficient, the skip
//! decision, accumulation, format conversions, and the roofline kernel the
//! benchmark measures the others against.

use crate::Isa;
use crate::simd::{self, Element, Kernel, Simd};
use crate::values::{LowPrecisionMut, Split, Values, padded};

/// A sum of squared gradients, accumulated over shards (and, in
/// data-parallel training, all-reduced across ranks by summing
/// `sum_squares`). Kept in f64, so no finite fp32 gradient can overflow it:
/// the sum is finite exactly when every gradient was.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct GradNorm {
    /// The sum of squares of every gradient seen.
    pub sum_squares: f64,
}

/// Sums of two sets of shards.
impl std::ops::Add for GradNorm {
    type Output = GradNorm;

    fn add(self, other: GradNorm) -> GradNorm {
        GradNorm {
            sum_squares: self.sum_squares + other.sum_squares,
        }
    }
}

impl GradNorm {
    /// The L2 norm.
    pub fn norm(&self) -> f64 {
        self.sum_squares.sqrt()
    }

    /// False when any gradient was NaN or infinite (an fp16 overflow): skip
    /// the step and back off the loss scale.
    pub fn is_finite(&self) -> bool {
        self.sum_squares.is_finite()
    }
}

/// Sums the squares of `grads` on the calling thread (one read pass; NaN or
/// infinity anywhere makes the result non-finite).
pub fn grad_norm(isa: Isa, grads: Values<'_>) -> GradNorm {
    let sum_squares = match grads {
        Values::F32(g) => simd::dispatch(isa, SumSquares(g)),
        Values::Bf16(g) => simd::dispatch(isa, SumSquares(g)),
        Values::F16(g) => simd::dispatch(isa, SumSquares(g)),
    };
    GradNorm { sum_squares }
}

/// PyTorch's `clip_grad_norm_` coefficient: `max_norm / (norm + 1e-6)`,
/// capped at 1.
pub fn clip_coefficient(norm: f64, max_norm: f64) -> f32 {
    (max_norm / (norm + 1e-6)).min(1.0) as f32
}

/// Whether and how to step after the norm pass.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum StepDecision {
    /// A gradient was NaN or infinite: leave parameters and states alone.
    Skip,
    /// Step with gradients multiplied by `grad_scale`.
    Step {
        /// `clip_coefficient / loss_scale`: pass it to the step kernels.
        grad_scale: f32,
        /// The unscaled global gradient norm.
        grad_norm: f64,
        /// The clip coefficient applied (1 when not clipped).
        clip_coefficient: f32,
    },
}

/// Decides the step from the global norm of gradients that were multiplied
/// by `loss_scale`, clipping to `max_norm` when given.
pub fn decide_step(norm: GradNorm, loss_scale: f32, max_norm: Option<f64>) -> StepDecision {
    if !norm.is_finite() {
        return StepDecision::Skip;
    }
    assert!(
        loss_scale.is_finite() && loss_scale > 0.0,
        "loss scale {loss_scale} must be finite and > 0"
    );
    let grad_norm = norm.norm() / f64::from(loss_scale);
    let clip = max_norm.map_or(1.0, |max_norm| clip_coefficient(grad_norm, max_norm));
    StepDecision::Step {
        grad_scale: clip / loss_scale,
        grad_norm,
        clip_coefficient: clip,
    }
}

/// `acc += incoming` on the calling thread (gradient accumulation; bf16 or
/// fp16 incoming gradients are widened exactly).
///
/// # Panics
/// If the lengths differ or `isa` is not available.
pub fn accumulate(isa: Isa, acc: &mut [f32], incoming: Values<'_>) {
    assert_eq!(
        acc.len(),
        incoming.len(),
        "accumulator and gradients differ in length"
    );
    match incoming {
        Values::F32(x) => simd::dispatch(isa, Accumulate { acc, incoming: x }),
        Values::Bf16(x) => simd::dispatch(isa, Accumulate { acc, incoming: x }),
        Values::F16(x) => simd::dispatch(isa, Accumulate { acc, incoming: x }),
    }
}

/// Narrows fp32 to bf16/fp16, round to nearest even (bit-exact with the
/// `half` crate on every input).
pub fn narrow(isa: Isa, source: &[f32], target: LowPrecisionMut<'_>) {
    assert_eq!(
        source.len(),
        target.len(),
        "source and target differ in length"
    );
    match target {
        LowPrecisionMut::Bf16(t) => simd::dispatch(isa, Convert { source, target: t }),
        LowPrecisionMut::F16(t) => simd::dispatch(isa, Convert { source, target: t }),
    }
}

/// Widens any format to fp32 (exact).
pub fn widen(isa: Isa, source: Values<'_>, target: &mut [f32]) {
    assert_eq!(
        source.len(),
        target.len(),
        "source and target differ in length"
    );
    match source {
        Values::F32(s) => target.copy_from_slice(s),
        Values::Bf16(s) => simd::dispatch(isa, Convert { source: s, target }),
        Values::F16(s) => simd::dispatch(isa, Convert { source: s, target }),
    }
}

/// The memory roofline for Adam's traffic: reads four fp32 streams and
/// writes three with one multiply-add each, nothing else. An Adam step that
/// runs as fast as this is limited by memory, not arithmetic.
pub fn roofline_4r3w(isa: Isa, a: &mut [f32], b: &[f32], c: &mut [f32], d: &mut [f32]) {
    let len = a.len();
    assert!(
        b.len() == len && c.len() == len && d.len() == len,
        "roofline streams differ in length"
    );
    simd::dispatch(isa, Roofline { a, b, c, d })
}

struct SumSquares<'a, G>(&'a [G]);

impl<G: Element> Kernel for SumSquares<'_, G> {
    type Output = f64;

    #[inline(always)]
    fn run<S: Simd>(self, s: S) -> f64 {
        let n = S::LANES;
        let body = simd::body_len::<S>(self.0.len());
        // Two accumulators hide the FMA latency.
        let (mut even, mut odd) = (s.acc_zero(), s.acc_zero());
        let mut pairs = self.0[..body].chunks_exact(2 * n);
        for pair in &mut pairs {
            even = s.acc_add_square(even, G::load(s, &pair[..n]));
            odd = s.acc_add_square(odd, G::load(s, &pair[n..]));
        }
        for single in pairs.remainder().chunks_exact(n) {
            even = s.acc_add_square(even, G::load(s, single));
        }
        if body < self.0.len() {
            odd = s.acc_add_square(odd, G::load(s, &padded(&self.0[body..])));
        }
        s.acc_sum(even) + s.acc_sum(odd)
    }
}

struct Accumulate<'a, G> {
    acc: &'a mut [f32],
    incoming: &'a [G],
}

impl<G: Element> Kernel for Accumulate<'_, G> {
    type Output = ();

    #[inline(always)]
    fn run<S: Simd>(self, s: S) {
        let n = S::LANES;
        let body = simd::body_len::<S>(self.acc.len());
        let (acc, acc_tail) = self.acc.split_at_mut(body);
        for (a, x) in acc
            .chunks_exact_mut(n)
            .zip(self.incoming[..body].chunks_exact(n))
        {
            s.store(a, s.add(s.load(a), G::load(s, x)));
        }
        for (a, x) in acc_tail.iter_mut().zip(&self.incoming[body..]) {
            *a += x.to_f32();
        }
    }
}

struct Convert<'a, A, B> {
    source: &'a [A],
    target: &'a mut [B],
}

impl<A: Element, B: Element> Kernel for Convert<'_, A, B> {
    type Output = ();

    #[inline(always)]
    fn run<S: Simd>(self, s: S) {
        let n = S::LANES;
        let body = simd::body_len::<S>(self.source.len());
        let (target, target_tail) = self.target.split_at_mut(body);
        for (t, x) in target
            .chunks_exact_mut(n)
            .zip(self.source[..body].chunks_exact(n))
        {
            B::store(s, t, A::load(s, x));
        }
        let rest = target_tail.len();
        if rest > 0 {
            let mut t = [B::default(); simd::LANES_MAX];
            B::store(s, &mut t, A::load(s, &padded(&self.source[body..])));
            target_tail.copy_from_slice(&t[..rest]);
        }
    }
}

struct Roofline<'a> {
    a: &'a mut [f32],
    b: &'a [f32],
    c: &'a mut [f32],
    d: &'a mut [f32],
}

impl Kernel for Roofline<'_> {
    type Output = ();

    #[inline(always)]
    fn run<S: Simd>(self, s: S) {
        let n = S::LANES;
        let k = s.splat(1e-6);
        // Aligned like the optimizer kernels' bodies, so it is their peer.
        let head = simd::align_head::<S, f32>(self.a);
        let (head_part, rest) = (self.a, self.b, self.c, self.d).split_at(head);
        let body = simd::body_len::<S>(rest.0.len());
        let ((a, b, c, d), tail_part) = rest.split_at(body);
        let ahead = simd::Ahead::get();
        let bases = (a.as_ptr(), b.as_ptr(), c.as_ptr(), d.as_ptr());
        let streams = a
            .chunks_exact_mut(n)
            .zip(b.chunks_exact(n))
            .zip(c.chunks_exact_mut(n))
            .zip(d.chunks_exact_mut(n));
        for (i, (((a, b), c), d)) in streams.enumerate() {
            // Prefetched as the Adam kernels are, so it stays their peer.
            ahead.touch(bases.0, i * n);
            ahead.touch(bases.1, i * n);
            ahead.touch(bases.2, i * n);
            ahead.touch(bases.3, i * n);
            let b = s.load(b);
            s.store(a, s.mul_add(b, k, s.load(a)));
            s.store(c, s.mul_add(b, k, s.load(c)));
            s.store(d, s.mul_add(b, k, s.load(d)));
        }
        for (a, b, c, d) in [head_part, tail_part] {
            for (((a, b), c), d) in a.iter_mut().zip(b).zip(c.iter_mut()).zip(d.iter_mut()) {
                *a += b * 1e-6;
                *c += b * 1e-6;
                *d += b * 1e-6;
            }
        }
    }
}
