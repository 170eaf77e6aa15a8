//! Stochastic rounding to bf16, with random bits that depend only on
//! (seed, step, stream, global element index): results are the same on any
//! number of threads, any split of a tensor, and after a resume.
//!
//! Round to nearest cannot keep Adam's second moment in bf16: with
//! beta2 = 0.999 a step changes v by 0.1%, less than half of bf16's
//! 0.78% spacing, so v never moves. Rounding up with probability equal to
//! the discarded fraction keeps every write unbiased, and v follows its
//! exact value on average.

use half::bf16;

use crate::Isa;
use crate::simd::{self, Kernel, Simd};
use crate::values::{Split, padded};

/// How an update writes bf16 states (moments, or master weights).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rounding {
    /// To nearest even.
    Nearest,
    /// Stochastically, with bits from a counter-based hash.
    Stochastic {
        /// The run's seed.
        seed: u64,
        /// The optimizer step (so no two steps share bits).
        step: u64,
        /// Global index of the first element of the slices given (a shard's
        /// offset in the whole parameter vector).
        first: u64,
    },
}

impl Split for Rounding {
    fn split_at(self, mid: usize) -> (Self, Self) {
        match self {
            Rounding::Nearest => (self, self),
            Rounding::Stochastic { seed, step, first } => (
                self,
                Rounding::Stochastic {
                    seed,
                    step,
                    first: first + mid as u64,
                },
            ),
        }
    }
}

/// Which state a stream of random bits rounds: moments (m takes the low 16
/// bits of each word, v the high 16) or master weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Stream {
    Moments = 1,
    Master = 2,
}

/// A bijective 32-bit mix (Wellons' lowbias32) of `key ^ counter`: distinct
/// counters under one key give distinct, well-spread words.
#[inline(always)]
pub(crate) fn hash32(key: u32, counter: u32) -> u32 {
    let mut x = key ^ counter;
    x ^= x >> 16;
    x = x.wrapping_mul(0x7feb_352d);
    x ^= x >> 15;
    x = x.wrapping_mul(0x846c_a68b);
    x ^ (x >> 16)
}

fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The key of elements `high << 32 ..` of `stream` at `step`.
pub(crate) fn key(seed: u64, step: u64, stream: Stream, high: u64) -> u32 {
    let mixed = splitmix64(seed ^ splitmix64(step ^ splitmix64(stream as u64 ^ (high << 8))));
    mixed as u32
}

/// The random word of global element `index`.
pub(crate) fn word(seed: u64, step: u64, stream: Stream, index: u64) -> u32 {
    hash32(key(seed, step, stream, index >> 32), index as u32)
}

/// f32 to bf16, rounding up with probability equal to the fraction of a
/// bf16 place that is cut off: `noise`'s low 16 bits are added below bf16's
/// last place, then the bits are cut. NaN stays NaN (quiet bit set), an
/// infinity stays one; values past bf16's largest finite may round to
/// infinity, as they would to nearest. The scalar reference for
/// [`crate::simd::Simd::store_bf16_sr`].
#[inline(always)]
pub fn round_bf16_stochastic(x: f32, noise: u32) -> bf16 {
    let bits = x.to_bits();
    if bits & 0x7fff_ffff > 0x7f80_0000 {
        return bf16::from_bits(((bits >> 16) | 0x40) as u16);
    }
    bf16::from_bits((bits.wrapping_add(noise & 0xffff) >> 16) as u16)
}

/// Random words for one stream, vector by vector: the key is recomputed
/// only when the index crosses into the next 2^32 elements, and a vector
/// that follows the one before it steps that one's counters on (one add,
/// where a fresh start broadcasts its index and the key).
pub(crate) struct Noise<S: Simd> {
    seed: u64,
    step: u64,
    stream: Stream,
    high: u64,
    /// The key of elements `high << 32 ..` in every lane.
    keys: S::U,
    /// The low 32 bits of the last vector's indices.
    counters: S::U,
    /// The index at which the next vector continues the last one (none
    /// where stepping on would wrap the low 32 bits).
    next: Option<u64>,
    /// The low 32 bits of the last pair's even-numbered indices
    /// ([`Noise::pair`]).
    evens: S::U,
    /// As `next`, for pairs.
    next_pair: Option<u64>,
}

impl<S: Simd> Noise<S> {
    pub(crate) fn new(s: S, seed: u64, step: u64, stream: Stream) -> Noise<S> {
        Noise {
            seed,
            step,
            stream,
            high: 0,
            keys: s.splat_word(key(seed, step, stream, 0)),
            counters: s.splat_word(0),
            next: None,
            evens: s.splat_word(0),
            next_pair: None,
        }
    }

    /// Keys the lanes for elements `high << 32 ..`. A new key ends both
    /// continuations: single vectors and pairs share it, and a run that
    /// stepped its counters on would hash with the other block's key.
    #[inline(always)]
    fn rekey(&mut self, s: S, high: u64) {
        if high != self.high {
            self.high = high;
            self.keys = s.splat_word(key(self.seed, self.step, self.stream, high));
            self.next = None;
            self.next_pair = None;
        }
    }

    /// The words of elements `index .. index + S::LANES`.
    #[inline(always)]
    pub(crate) fn lanes(&mut self, s: S, index: u64) -> S::U {
        let (high, low) = (index >> 32, index as u32);
        let lanes = S::LANES as u32;
        if self.next == Some(index) {
            self.counters = s.add_words(self.counters, s.splat_word(lanes));
        } else {
            if low.checked_add(lanes - 1).is_none() {
                // The vector straddles a 2^32 boundary: lane by lane.
                let mut words = [0u32; crate::simd::LANES_MAX];
                for (i, w) in words.iter_mut().take(S::LANES).enumerate() {
                    *w = word(self.seed, self.step, self.stream, index + i as u64);
                }
                self.next = None;
                return s.load_u32(&words);
            }
            self.rekey(s, high);
            self.counters = s.iota_words(low);
        }
        self.next = continues(index, lanes);
        s.mix_words(s.xor_words(self.counters, self.keys))
    }

    /// The words of elements `index .. index + 2 * S::LANES` in the layout
    /// of [`Simd::load_bf16_pair`]: those of the even-numbered elements
    /// (`index + 2i` in lane `i`), then the odd-numbered ones'. The same
    /// words as [`Noise::lanes`] gives those elements.
    #[inline(always)]
    pub(crate) fn pair(&mut self, s: S, index: u64) -> (S::U, S::U) {
        let (high, low) = (index >> 32, index as u32);
        let span = 2 * S::LANES as u32;
        if self.next_pair == Some(index) {
            self.evens = s.add_words(self.evens, s.splat_word(span));
        } else {
            if low.checked_add(span - 1).is_none() {
                // The pair straddles a 2^32 boundary: element by element.
                let mut words = [[0u32; crate::simd::LANES_MAX]; 2];
                for i in 0..S::LANES {
                    for (parity, w) in words.iter_mut().enumerate() {
                        let at = index + (2 * i + parity) as u64;
                        w[i] = word(self.seed, self.step, self.stream, at);
                    }
                }
                self.next_pair = None;
                return (s.load_u32(&words[0]), s.load_u32(&words[1]));
            }
            self.rekey(s, high);
            self.evens = s.iota_even_words(low);
        }
        self.next_pair = continues(index, span);
        let odds = s.add_words(self.evens, s.splat_word(1));
        (
            s.mix_words(s.xor_words(self.evens, self.keys)),
            s.mix_words(s.xor_words(odds, self.keys)),
        )
    }
}

/// Where counters that cover `span` elements from `index` continue, by
/// stepping on `span`: none where a step would wrap their low 32 bits.
#[inline(always)]
fn continues(index: u64, span: u32) -> Option<u64> {
    (index as u32)
        .checked_add(2 * span - 1)
        .map(|_| index + u64::from(span))
}

/// Narrows fp32 to bf16 rounding stochastically (`rounding` Stochastic:
/// the master-weight stream's words of each element's global index), or
/// to nearest even. The same bits on every instruction set and split.
pub fn narrow_stochastic(isa: Isa, source: &[f32], target: &mut [bf16], rounding: Rounding) {
    assert_eq!(
        source.len(),
        target.len(),
        "source and target differ in length"
    );
    let Rounding::Stochastic { seed, step, first } = rounding else {
        return crate::narrow(isa, source, crate::LowPrecisionMut::Bf16(target));
    };
    simd::dispatch(
        isa,
        NarrowSr {
            source,
            target,
            seed,
            step,
            first,
        },
    );
}

struct NarrowSr<'a> {
    source: &'a [f32],
    target: &'a mut [bf16],
    seed: u64,
    step: u64,
    first: u64,
}

impl Kernel for NarrowSr<'_> {
    type Output = ();

    #[inline(always)]
    fn run<S: Simd>(self, s: S) {
        let mut noise = Noise::new(s, self.seed, self.step, Stream::Master);
        let first = self.first;
        let n = S::LANES;
        let body = simd::body_len::<S>(self.source.len());
        let (target, target_tail) = self.target.split_at_mut(body);
        for (i, (t, x)) in target
            .chunks_exact_mut(n)
            .zip(self.source[..body].chunks_exact(n))
            .enumerate()
        {
            let (words, _) = s.halves(noise.lanes(s, first + (i * n) as u64));
            s.store_bf16_sr(t, s.load(x), words, false);
        }
        let rest = target_tail.len();
        if rest > 0 {
            let mut t = [bf16::ZERO; simd::LANES_MAX];
            let (words, _) = s.halves(noise.lanes(s, first + body as u64));
            s.store_bf16_sr(&mut t, s.load(&padded(&self.source[body..])), words, false);
            target_tail.copy_from_slice(&t[..rest]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_isa_rounds_as_the_scalar_reference_bit_for_bit() {
        // Ordinary values, specials, subnormals, values near bf16's largest
        // finite; a length with a tail; first indices with a vector that
        // straddles 2^32.
        let mut source: Vec<f32> = (0..1000u32)
            .map(|i| f32::from_bits(hash32(99, i)))
            .collect();
        source.extend([
            f32::NAN,
            -f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            0.0,
            -0.0,
            f32::from_bits(1),
            f32::from_bits(0x807f_ffff),
            f32::from_bits(0x7f7f_ffff),
            f32::from_bits(0xff7f_8000),
            1.0,
            -3.5,
            1e-3,
        ]);
        for first in [0u64, 12_345, (1 << 32) - 7, (5 << 32) + 3] {
            let rounding = Rounding::Stochastic {
                seed: 42,
                step: 9,
                first,
            };
            for isa in Isa::available() {
                let mut target = vec![bf16::ZERO; source.len()];
                narrow_stochastic(isa, &source, &mut target, rounding);
                for (i, (x, y)) in source.iter().zip(&target).enumerate() {
                    let expected =
                        round_bf16_stochastic(*x, word(42, 9, Stream::Master, first + i as u64));
                    assert_eq!(
                        y.to_bits(),
                        expected.to_bits(),
                        "{isa} {:#010x} at {i} from {first}",
                        x.to_bits()
                    );
                }
            }
        }
    }

    #[test]
    fn rounding_is_unbiased_and_its_error_stays_within_one_place() {
        // x sits 30% of a place above a bf16 value: it rounds up about 30%
        // of the time, and the mean of the rounded values is x.
        let low = bf16::from_f32(1.0);
        let place = f32::from_bits(0x3f81_0000) - 1.0;
        let x = 1.0 + 0.3 * place;
        let n = 200_000u64;
        let mut sum = 0.0f64;
        let mut ups = 0u64;
        let mut square_error = 0.0f64;
        for i in 0..n {
            let r = round_bf16_stochastic(x, word(7, 1, Stream::Moments, i));
            let value = f64::from(r.to_f32());
            assert!(r == low || r.to_bits() == low.to_bits() + 1, "{r} from {x}");
            ups += u64::from(r != low);
            sum += value;
            square_error += (value - f64::from(x)).powi(2);
        }
        let mean_error = sum / n as f64 - f64::from(x);
        // The mean's standard error is place * sqrt(0.21 / n), about 1e-3
        // of a place: 5 of them is far from any real bias.
        assert!(
            mean_error.abs() < 5e-3 * f64::from(place),
            "bias {mean_error}"
        );
        let fraction = ups as f64 / n as f64;
        assert!((fraction - 0.3).abs() < 0.005, "rounded up {fraction}");
        // Variance of a Bernoulli(0.3) place: 0.21 place^2.
        let variance = square_error / n as f64 / f64::from(place).powi(2);
        assert!(
            (variance - 0.21).abs() < 0.01,
            "variance {variance} place^2"
        );
    }

    #[test]
    fn special_values_survive() {
        for noise in [0, 0xffff, 0x1234_8000] {
            assert!(round_bf16_stochastic(f32::NAN, noise).is_nan());
            assert_eq!(round_bf16_stochastic(f32::INFINITY, noise), bf16::INFINITY);
            assert_eq!(
                round_bf16_stochastic(f32::NEG_INFINITY, noise),
                bf16::NEG_INFINITY
            );
            assert_eq!(round_bf16_stochastic(0.0, noise), bf16::ZERO);
            assert_eq!(round_bf16_stochastic(-2.0, noise), bf16::from_f32(-2.0));
        }
        // Negative values round in magnitude: -x is the mirror of x.
        let x = 1.0 + 0.7 * (f32::from_bits(0x3f81_0000) - 1.0);
        for noise in [0u32, 0x4000, 0x8000, 0xffff] {
            assert_eq!(
                round_bf16_stochastic(-x, noise).to_bits(),
                round_bf16_stochastic(x, noise).to_bits() | 0x8000
            );
        }
    }

    #[test]
    fn words_depend_on_seed_step_stream_and_index_only() {
        let a = word(1, 2, Stream::Moments, 3);
        assert_eq!(a, word(1, 2, Stream::Moments, 3));
        assert_ne!(a, word(2, 2, Stream::Moments, 3));
        assert_ne!(a, word(1, 3, Stream::Moments, 3));
        assert_ne!(a, word(1, 2, Stream::Master, 3));
        assert_ne!(a, word(1, 2, Stream::Moments, 4));
        assert_ne!(a, word(1, 2, Stream::Moments, 3 + (1 << 32)));
    }
}
