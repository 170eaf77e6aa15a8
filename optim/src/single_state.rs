//! The loop shared by optimizers with one fp32 state per parameter (Adagrad's
//! sum of squares, Lion's momentum): parameters, gradients in any format,
//! the state, and optionally a bf16/fp16 copy of the updated parameters.
//! Adam keeps its own loop of the same shape (`adam.rs`): its two moments
//! have a generic element type, and folding both into one driver would need
//! a state-bundle abstraction with lifetimes over stack buffers in the hot
//! loop, which costs more to read than the repeat.

use half::{bf16, f16};

use crate::Isa;
use crate::simd::{self, Element, Kernel, Simd};
use crate::values::{LowPrecisionMut, Split, Values, padded};

/// An update rule over one vector of lanes.
pub(crate) trait Rule: Sync {
    /// The rule's constants broadcast to vectors.
    type Splat<S: Simd>;
    fn splat<S: Simd>(&self, s: S) -> Self::Splat<S>;
    /// Updates `p` and `state` for one vector; returns the new parameters.
    fn update<S: Simd, G: Element>(
        k: &Self::Splat<S>,
        s: S,
        p: &mut [f32],
        g: &[G],
        state: &mut [f32],
    ) -> S::V;
}

/// Runs `rule` over every element on the calling thread: a part of an
/// update `whole_len` elements long, whose length decides whether the
/// 16-bit copy is streamed past the caches (so that any cut of a large
/// update streams as the whole would).
pub(crate) fn step<R: Rule>(
    isa: Isa,
    rule: &R,
    params: &mut [f32],
    grads: Values<'_>,
    state: &mut [f32],
    out: Option<LowPrecisionMut<'_>>,
    whole_len: usize,
) {
    let len = params.len();
    assert_eq!(grads.len(), len, "gradients and params differ in length");
    assert_eq!(
        state.len(),
        len,
        "optimizer state and params differ in length"
    );
    if let Some(out) = &out {
        assert_eq!(out.len(), len, "output copy and params differ in length");
    }
    let call = (rule, params, state, out, whole_len);
    match grads {
        Values::F32(g) => with_grads(isa, g, call),
        Values::Bf16(g) => with_grads(isa, g, call),
        Values::F16(g) => with_grads(isa, g, call),
    }
}

/// A call's rule, parameters, state, 16-bit copy and whole length.
type Call<'a, 'r, R> = (
    &'r R,
    &'a mut [f32],
    &'a mut [f32],
    Option<LowPrecisionMut<'a>>,
    usize,
);

fn with_grads<R: Rule, G: Element>(isa: Isa, grads: &[G], call: Call<'_, '_, R>) {
    let (rule, params, state, out, whole_len) = call;
    match out {
        None => simd::dispatch(
            isa,
            StateKernel::<R, G, bf16> {
                rule,
                params,
                grads,
                state,
                out: None,
                whole_len,
            },
        ),
        Some(LowPrecisionMut::Bf16(out)) => simd::dispatch(
            isa,
            StateKernel {
                rule,
                params,
                grads,
                state,
                out: Some(out),
                whole_len,
            },
        ),
        Some(LowPrecisionMut::F16(out)) => simd::dispatch(
            isa,
            StateKernel::<R, G, f16> {
                rule,
                params,
                grads,
                state,
                out: Some(out),
                whole_len,
            },
        ),
    }
}

struct StateKernel<'a, R, G, O> {
    rule: &'a R,
    params: &'a mut [f32],
    grads: &'a [G],
    state: &'a mut [f32],
    out: Option<&'a mut [O]>,
    /// The length of the update this call is part of (see [`step`]).
    whole_len: usize,
}

/// The four streams of one call, cut together with [`Split`].
type Streams<'a, G, O> = (&'a mut [f32], &'a [G], &'a mut [f32], Option<&'a mut [O]>);

/// Fewer than `LANES` elements through the same vector code, by way of
/// zero-padded stack copies.
#[inline(always)]
fn padded_update<R: Rule, S: Simd, G: Element, O: Element>(
    k: &R::Splat<S>,
    s: S,
    (p, g, state, out): Streams<'_, G, O>,
) {
    let rest = p.len();
    if rest == 0 {
        return;
    }
    let (mut p1, g1, mut state1) = (padded(p), padded(g), padded(state));
    let new = R::update(k, s, &mut p1, &g1, &mut state1);
    p.copy_from_slice(&p1[..rest]);
    state.copy_from_slice(&state1[..rest]);
    if let Some(out) = out {
        let mut o = [O::default(); simd::LANES_MAX];
        O::store(s, &mut o, new);
        out.copy_from_slice(&o[..rest]);
    }
}

impl<R: Rule, G: Element, O: Element> Kernel for StateKernel<'_, R, G, O> {
    type Output = ();

    #[inline(always)]
    fn run<S: Simd>(self, s: S) {
        let k = self.rule.splat(s);
        let n = S::LANES;
        let len = self.params.len();
        // As in Adam: an aligned body; large outputs streamed past the
        // caches when the same head aligns them.
        let head = simd::align_head::<S, f32>(self.params);
        let stream = self.whole_len >= simd::STREAM_ELEMS_MIN
            && self
                .out
                .as_ref()
                .is_some_and(|out| simd::align_head::<S, O>(out) == head);
        simd::note_streamed(stream);
        let (head_part, rest) = (self.params, self.grads, self.state, self.out).split_at(head);
        let (body, tail) = rest.split_at(simd::body_len::<S>(len - head));
        padded_update::<R, S, G, O>(&k, s, head_part);
        let (p, g, state, out) = body;
        // Each vector asks for its streams' lines ahead, as in Adam.
        let ahead = simd::Ahead::get();
        let bases = (p.as_ptr(), g.as_ptr(), state.as_ptr());
        let vectors = p
            .chunks_exact_mut(n)
            .zip(g.chunks_exact(n))
            .zip(state.chunks_exact_mut(n))
            .enumerate()
            .inspect(|&(i, _)| {
                ahead.touch(bases.0, i * n);
                ahead.touch(bases.1, i * n);
                ahead.touch(bases.2, i * n);
            })
            .map(|(_, x)| x);
        match out {
            Some(out) if stream => {
                for (((p, g), state), o) in vectors.zip(out.chunks_exact_mut(n)) {
                    O::stream(s, o, R::update(&k, s, p, g, state));
                }
                s.fence();
            }
            Some(out) => {
                for (((p, g), state), o) in vectors.zip(out.chunks_exact_mut(n)) {
                    O::store(s, o, R::update(&k, s, p, g, state));
                }
            }
            None => {
                for ((p, g), state) in vectors {
                    R::update(&k, s, p, g, state);
                }
            }
        }
        padded_update::<R, S, G, O>(&k, s, tail);
    }
}
