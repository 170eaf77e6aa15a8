//! The portable back end: four f32 lanes as an array (one SSE2 or NEON
//! register), each operation a fixed-length loop the compiler vectorizes
//! for the target's baseline. Four, not eight: every kernel is compiled
//! once per back end, and this one, unrolled lane by lane, was the largest
//! part of the crate's build. No FMA: `mul_add` rounds twice, since
//! a fused multiply-add without hardware support is a slow libm call.
//! Conversions go through `half`, the reference the SIMD paths are tested
//! against.

use half::{bf16, f16};

use super::Simd;
use crate::rounding::{aes_column, round_bf16_stochastic};

const LANES: usize = 4;

/// `x`, or +0 where its exponent field is zero (a subnormal or a zero): the
/// scalar rule of [`Simd::flush_subnormal`]. Adam reads its moments through
/// it. Under a gradient that stays zero (an embedding row whose token is
/// not seen) m falls below f32's smallest normal after about 800 steps, v
/// after tens of thousands, and neither reaches zero: rounding to nearest
/// stops the decay at a few subnormal units (m at 4 x 2^-149 for beta1 =
/// 0.9, v at 500 x 2^-149 for beta2 = 0.999). On x86 every multiply that
/// reads a subnormal takes a microcode assist, so every later step costs
/// 14-26 times an ordinary one in cache. Read as zero, a moment costs one
/// slow step (the one whose result first falls below); the moments move by
/// less than 1.2e-38 and a parameter by less than lr x 1.2e-25.
#[inline(always)]
pub(crate) fn flush_subnormal(x: f32) -> f32 {
    // The same lanes as an exponent test (NaN compares false), in a form
    // the compiler turns into a compare and a mask.
    if x.abs() < f32::MIN_POSITIVE { 0.0 } else { x }
}

/// The portable back end (always available).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Portable;

/// bf16 to f32 as a bit shift, the way hardware and PyTorch widen: every
/// pattern kept, signaling NaNs included (`half` would quiet them).
#[inline(always)]
pub(crate) fn widen_bf16(x: bf16) -> f32 {
    f32::from_bits(u32::from(x.to_bits()) << 16)
}

#[inline(always)]
fn map(a: [f32; LANES], f: impl Fn(f32) -> f32) -> [f32; LANES] {
    std::array::from_fn(|i| f(a[i]))
}

#[inline(always)]
fn zip(a: [f32; LANES], b: [f32; LANES], f: impl Fn(f32, f32) -> f32) -> [f32; LANES] {
    std::array::from_fn(|i| f(a[i], b[i]))
}

impl Simd for Portable {
    const LANES: usize = LANES;
    type V = [f32; LANES];
    type Acc = [f64; LANES];
    type U = [u32; LANES];

    #[inline(always)]
    fn splat_word(self, x: u32) -> Self::U {
        [x; LANES]
    }
    #[inline(always)]
    fn iota_words(self, first: u32) -> Self::U {
        std::array::from_fn(|i| first.wrapping_add(i as u32))
    }
    #[inline(always)]
    fn iota_even_words(self, first: u32) -> Self::U {
        std::array::from_fn(|i| first.wrapping_add(2 * i as u32))
    }
    #[inline(always)]
    fn add_words(self, a: Self::U, b: Self::U) -> Self::U {
        std::array::from_fn(|i| a[i].wrapping_add(b[i]))
    }
    #[inline(always)]
    fn aes_rounds(self, x: Self::U, (first, second): (Self::U, Self::U)) -> Self::U {
        std::array::from_fn(|i| aes_column(aes_column(x[i]) ^ first[i]) ^ second[i])
    }
    #[inline(always)]
    fn load_u32(self, src: &[u32]) -> Self::U {
        std::array::from_fn(|i| src[i])
    }
    #[inline(always)]
    fn halves(self, u: Self::U) -> (Self::U, Self::U) {
        (u.map(|w| w & 0xffff), u.map(|w| w >> 16))
    }
    #[inline(always)]
    fn xor_words(self, a: Self::U, b: Self::U) -> Self::U {
        std::array::from_fn(|i| a[i] ^ b[i])
    }
    #[inline(always)]
    fn add_noise(self, v: Self::V, noise: Self::U) -> Self::V {
        std::array::from_fn(|i| f32::from_bits(v[i].to_bits().wrapping_add(noise[i])))
    }
    #[inline(always)]
    fn clear_low_halves(self, v: Self::V) -> Self::V {
        v.map(|x| f32::from_bits(x.to_bits() & 0xffff_0000))
    }
    #[inline(always)]
    fn nan_free(self, v: Self::V) -> bool {
        !v.iter().any(|x| x.is_nan())
    }
    #[inline(always)]
    fn nan_free_both(self, a: Self::V, b: Self::V) -> bool {
        self.nan_free(a) && self.nan_free(b)
    }
    #[inline(always)]
    fn quiet_nan_lanes(self, v: Self::V, rounded: Self::V) -> Self::V {
        std::array::from_fn(|i| match v[i].is_nan() {
            true => widen_bf16(round_bf16_stochastic(v[i], 0)),
            false => rounded[i],
        })
    }
    #[inline(always)]
    fn store_bf16_exact(self, dst: &mut [bf16], v: Self::V) {
        for (d, x) in dst[..LANES].iter_mut().zip(v) {
            *d = bf16::from_bits((x.to_bits() >> 16) as u16);
        }
    }
    #[inline(always)]
    fn load_bf16_pair(self, src: &[bf16]) -> (Self::V, Self::V) {
        let src = &src[..2 * LANES];
        (
            std::array::from_fn(|i| widen_bf16(src[2 * i])),
            std::array::from_fn(|i| widen_bf16(src[2 * i + 1])),
        )
    }
    #[inline(always)]
    fn store_bf16_pair_exact(self, dst: &mut [bf16], even: Self::V, odd: Self::V) {
        for (d, (e, o)) in dst[..2 * LANES]
            .chunks_exact_mut(2)
            .zip(even.into_iter().zip(odd))
        {
            d[0] = bf16::from_bits((e.to_bits() >> 16) as u16);
            d[1] = bf16::from_bits((o.to_bits() >> 16) as u16);
        }
    }

    #[inline(always)]
    fn splat(self, x: f32) -> Self::V {
        [x; LANES]
    }
    #[inline(always)]
    fn load(self, src: &[f32]) -> Self::V {
        std::array::from_fn(|i| src[i])
    }
    #[inline(always)]
    fn store(self, dst: &mut [f32], v: Self::V) {
        dst[..LANES].copy_from_slice(&v);
    }
    #[inline(always)]
    fn load_bf16(self, src: &[bf16]) -> Self::V {
        std::array::from_fn(|i| widen_bf16(src[i]))
    }
    #[inline(always)]
    fn store_bf16(self, dst: &mut [bf16], v: Self::V) {
        for (d, x) in dst[..LANES].iter_mut().zip(v) {
            *d = bf16::from_f32(x);
        }
    }
    #[inline(always)]
    fn load_f16(self, src: &[f16]) -> Self::V {
        std::array::from_fn(|i| src[i].to_f32())
    }
    #[inline(always)]
    fn store_f16(self, dst: &mut [f16], v: Self::V) {
        for (d, x) in dst[..LANES].iter_mut().zip(v) {
            *d = f16::from_f32(x);
        }
    }
    #[inline(always)]
    fn stream_f32(self, dst: &mut [f32], v: Self::V) {
        // A plain store, with the alignment the vector back ends need
        // asserted as they assert it, so that a caller's alignment is
        // tested on every back end.
        assert!((dst.as_ptr() as usize).is_multiple_of(4 * LANES));
        self.store(dst, v)
    }
    #[inline(always)]
    fn stream_bf16(self, dst: &mut [bf16], v: Self::V) {
        assert!((dst.as_ptr() as usize).is_multiple_of(2 * LANES));
        self.store_bf16(dst, v)
    }
    #[inline(always)]
    fn stream_f16(self, dst: &mut [f16], v: Self::V) {
        assert!((dst.as_ptr() as usize).is_multiple_of(2 * LANES));
        self.store_f16(dst, v)
    }
    #[inline(always)]
    fn fence(self) {}
    #[inline(always)]
    fn add(self, a: Self::V, b: Self::V) -> Self::V {
        zip(a, b, |x, y| x + y)
    }
    #[inline(always)]
    fn sub(self, a: Self::V, b: Self::V) -> Self::V {
        zip(a, b, |x, y| x - y)
    }
    #[inline(always)]
    fn mul(self, a: Self::V, b: Self::V) -> Self::V {
        zip(a, b, |x, y| x * y)
    }
    #[inline(always)]
    fn div(self, a: Self::V, b: Self::V) -> Self::V {
        zip(a, b, |x, y| x / y)
    }
    #[inline(always)]
    fn sqrt(self, a: Self::V) -> Self::V {
        map(a, f32::sqrt)
    }
    #[inline(always)]
    fn mul_add(self, a: Self::V, b: Self::V, c: Self::V) -> Self::V {
        std::array::from_fn(|i| a[i] * b[i] + c[i])
    }
    #[inline(always)]
    fn flush_subnormal(self, a: Self::V) -> Self::V {
        map(a, flush_subnormal)
    }
    #[inline(always)]
    fn sign(self, a: Self::V) -> Self::V {
        map(a, |x| {
            if x > 0.0 {
                1.0
            } else if x < 0.0 {
                -1.0
            } else {
                x
            }
        })
    }
    #[inline(always)]
    fn acc_zero(self) -> Self::Acc {
        [0.0; LANES]
    }
    #[inline(always)]
    fn acc_add_square(self, acc: Self::Acc, v: Self::V) -> Self::Acc {
        std::array::from_fn(|i| {
            let x = f64::from(v[i]);
            acc[i] + x * x
        })
    }
    #[inline(always)]
    fn acc_sum(self, acc: Self::Acc) -> f64 {
        acc.iter().sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rounding::{Noise, Stream, keys, word};
    use crate::simd::Simd;

    /// `len` words from `first` as `Noise` draws them on a back end, a
    /// vector or a pair at a time (pairs put back in element order).
    struct DrawWords {
        first: u64,
        len: usize,
        pairs: bool,
    }

    impl crate::simd::Kernel for DrawWords {
        type Output = Vec<u32>;

        fn run<S: Simd>(self, s: S) -> Vec<u32> {
            let bits = |w: S::U| {
                let mut lanes = [0f32; crate::simd::LANES_MAX];
                s.store(&mut lanes, s.add_noise(s.splat(0.0), w));
                lanes.map(f32::to_bits)
            };
            let mut noise = Noise::new(s, 3, 7, Stream::Moments);
            let (n, mut words) = (S::LANES, Vec::new());
            while words.len() < self.len {
                let at = self.first + words.len() as u64;
                if self.pairs {
                    let (even, odd) = noise.pair(s, at);
                    let (even, odd) = (bits(even), bits(odd));
                    words.extend((0..n).flat_map(|i| [even[i], odd[i]]));
                } else {
                    words.extend_from_slice(&bits(noise.lanes(s, at))[..n]);
                }
            }
            words
        }
    }

    /// The counters hold `index + keys.add`, which wraps past 2^32 where
    /// the index does not: inside a vector, between vectors that step on,
    /// and inside a pair. Every element still gets its own word, on every
    /// back end. (Here rather than in `simd`'s tests, which naming
    /// `rounding` would tie into a module cycle.)
    #[test]
    fn keyed_counters_that_wrap_give_every_element_its_word() {
        for high in [0u64, 5] {
            let add = keys(3, 7, Stream::Moments, high).add;
            // The index whose keyed counter is 2^32 - 1, less a few.
            let wraps = (high << 32) | u64::from(u32::MAX.wrapping_sub(add));
            for offset in [0u64, 3, 16, 21, 40] {
                let Some(first) = wraps.checked_sub(offset).filter(|f| f >> 32 == high) else {
                    continue;
                };
                for isa in crate::Isa::available() {
                    for pairs in [false, true] {
                        let drawn = crate::simd::dispatch(
                            isa,
                            DrawWords {
                                first,
                                len: 96,
                                pairs,
                            },
                        );
                        for (i, w) in drawn.iter().enumerate() {
                            let index = first + i as u64;
                            assert_eq!(
                                *w,
                                word(3, 7, Stream::Moments, index),
                                "{isa} pairs {pairs}: index {index} ({offset} before the wrap)"
                            );
                        }
                    }
                }
            }
        }
    }

    /// The patterns of [`every_back_end_flushes_as_the_scalar_rule`] through a
    /// back end: each f32 through `flush_subnormal`, and each pattern's
    /// high and low halves as a pair of bf16 through
    /// `load_bf16_pair_flushed` (the bf16 values' bits, in order).
    struct Flush {
        bits: Vec<u32>,
    }

    impl crate::simd::Kernel for Flush {
        type Output = (Vec<u32>, Vec<u16>);

        fn run<S: Simd>(self, s: S) -> (Vec<u32>, Vec<u16>) {
            let mut lanes = [0f32; crate::simd::LANES_MAX];
            let mut flushed = Vec::new();
            for chunk in self.bits.chunks(S::LANES) {
                for (lane, bits) in lanes.iter_mut().zip(chunk) {
                    *lane = f32::from_bits(*bits);
                }
                let flushed_lanes = s.flush_subnormal(s.load(&lanes));
                s.store(&mut lanes, flushed_lanes);
                flushed.extend(lanes[..chunk.len()].iter().map(|x| x.to_bits()));
            }
            let words: Vec<bf16> = (self.bits.iter())
                .flat_map(|b| {
                    [
                        bf16::from_bits((b >> 16) as u16),
                        bf16::from_bits(*b as u16),
                    ]
                })
                .collect();
            let (mut buffer, mut pairs) = ([bf16::ZERO; 2 * crate::simd::LANES_MAX], Vec::new());
            let mut halves = (
                [0f32; crate::simd::LANES_MAX],
                [0f32; crate::simd::LANES_MAX],
            );
            for chunk in words.chunks(2 * S::LANES) {
                buffer[..chunk.len()].copy_from_slice(chunk);
                let (even, odd) = s.load_bf16_pair_flushed(&buffer);
                s.store(&mut halves.0, even);
                s.store(&mut halves.1, odd);
                let high = |x: f32| (x.to_bits() >> 16) as u16;
                let both = (0..S::LANES).flat_map(|i| [high(halves.0[i]), high(halves.1[i])]);
                pairs.extend(both.take(chunk.len()));
            }
            (flushed, pairs)
        }
    }

    /// Every back end flushes as the scalar rule: zeros and subnormals of
    /// either sign to +0, normals, infinities and NaNs (payloads and all)
    /// as they are; in f32 and in bf16 pairs, each half.
    #[test]
    fn every_back_end_flushes_as_the_scalar_rule() {
        let mut bits = vec![
            0,
            0x8000_0000,
            1,
            0x8000_0001,
            0x0040_0000,
            0x007f_ffff,
            0x807f_ffff,
            0x0080_0000,
            0x8080_0000,
            0x3f80_0000,
            0xbf80_0000,
            0x7f7f_ffff,
            0x7f80_0000,
            0xff80_0000,
            0x7fc0_0001,
            0xffa0_0000,
            // bf16 halves: a subnormal over a normal, and the other way.
            0x0001_3f80,
            0x3f80_0001,
            0x8040_807f,
            0x0080_7f80,
        ];
        // Every exponent with a few mantissas, both signs.
        for e in 0..256u32 {
            for m in [0u32, 1, 0x40_0000, 0x7f_ffff] {
                bits.push((e << 23) | m);
                bits.push(0x8000_0000 | (e << 23) | m ^ 0x15_5555);
            }
        }
        let expect_f32: Vec<u32> = bits
            .iter()
            .map(|b| flush_subnormal(f32::from_bits(*b)).to_bits())
            .collect();
        let expect_bf16: Vec<u16> = (bits.iter())
            .flat_map(|b| [(b >> 16) as u16, *b as u16])
            .map(|w| (flush_subnormal(f32::from_bits(u32::from(w) << 16)).to_bits() >> 16) as u16)
            .collect();
        assert_eq!(expect_f32[1], 0, "the rule: -0 is +0");
        assert_eq!(expect_f32[14], 0x7fc0_0001, "the rule: NaN as it is");
        for isa in crate::Isa::available() {
            let (f32s, bf16s) = crate::simd::dispatch(isa, Flush { bits: bits.clone() });
            for (i, (got, want)) in f32s.iter().zip(&expect_f32).enumerate() {
                assert_eq!(got, want, "{isa}: f32 {:#010x}", bits[i]);
            }
            for (i, (got, want)) in bf16s.iter().zip(&expect_bf16).enumerate() {
                assert_eq!(got, want, "{isa}: bf16 word {i} of {:#010x}", bits[i / 2]);
            }
            assert_eq!((f32s.len(), bf16s.len()), (bits.len(), 2 * bits.len()));
        }
    }

    /// A bf16 master rounds with its word's halves xored, m and v with the
    /// halves themselves: each pair of the three 16-bit words must look
    /// independent (uniform, uncorrelated, rounding up together a quarter
    /// of the time at one half).
    #[test]
    fn the_folded_word_is_pairwise_independent_of_the_halves() {
        let s = Portable;
        const N: usize = 1 << 18;
        let (mut sums, mut both_up) = ([[0f64; 3]; 3], [[0usize; 3]; 3]);
        let mut means = [0f64; 3];
        // Neighbouring indices under several seeds and steps.
        let keys = [(5, 11), (6, 11), (5, 12), (1 << 40, 1)];
        let lanes = Portable::LANES;
        for vector in 0..N / lanes {
            let (seed, step) = keys[vector % keys.len()];
            let first = (vector / keys.len() * lanes) as u64;
            let words =
                crate::rounding::Noise::new(s, seed, step, crate::rounding::Stream::Moments)
                    .lanes(s, first);
            let (low, high) = s.halves(words);
            let folded = s.xor_words(low, high);
            for (w, f) in words.iter().zip(folded.iter()) {
                let x = [w & 0xffff, w >> 16, f & 0xffff].map(|h| (f64::from(h) + 0.5) / 65536.0);
                for a in 0..3 {
                    means[a] += x[a] / N as f64;
                    for b in 0..3 {
                        sums[a][b] += (x[a] - 0.5) * (x[b] - 0.5) / N as f64;
                        both_up[a][b] += usize::from(x[a] < 0.5 && x[b] < 0.5);
                    }
                }
            }
        }
        for a in 0..3 {
            assert!(
                (means[a] - 0.5).abs() < 0.005,
                "word {a}: mean {}",
                means[a]
            );
            assert!(
                (sums[a][a] - 1.0 / 12.0).abs() < 0.002,
                "word {a}: variance {}",
                sums[a][a]
            );
            for b in (a + 1)..3 {
                let correlation = sums[a][b] * 12.0;
                assert!(
                    correlation.abs() < 0.01,
                    "words {a}, {b}: correlation {correlation}"
                );
                let joint = both_up[a][b] as f64 / N as f64;
                assert!(
                    (joint - 0.25).abs() < 0.005,
                    "words {a}, {b}: both below one half {joint}"
                );
            }
        }
    }

    /// Single vectors and pairs share one key: calls that take turns
    /// across 2^32 blocks still give every element its own word.
    #[test]
    fn single_vectors_and_pairs_interleaved_across_blocks_give_each_element_its_word() {
        let s = Portable;
        let n = Portable::LANES as u64;
        let mut noise = Noise::new(s, 4, 2, Stream::Moments);
        let far = 1u64 << 32;
        let calls = [
            (false, 100),
            (true, far + 64),
            (false, 100 + n),
            (true, 96),
            (false, far + 64 + 2 * n),
            (true, 96 + 2 * n),
            (true, far - n),
            (false, far + 64 + 3 * n),
        ];
        for (pair, index) in calls {
            let expected = |i: u64| word(4, 2, Stream::Moments, i);
            if pair {
                let (even, odd) = noise.pair(s, index);
                for i in 0..n as usize {
                    let at = index + 2 * i as u64;
                    assert_eq!(even[i], expected(at), "pair at {index}, element {at}");
                    assert_eq!(
                        odd[i],
                        expected(at + 1),
                        "pair at {index}, element {}",
                        at + 1
                    );
                }
            } else {
                let words = noise.lanes(s, index);
                for (i, w) in words.iter().enumerate() {
                    assert_eq!(
                        *w,
                        expected(index + i as u64),
                        "vector at {index}, lane {i}"
                    );
                }
            }
        }
    }
}
