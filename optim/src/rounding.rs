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

/// The AES S-box (FIPS-197 5.1.1): the multiplicative inverse in GF(2^8)
/// (0 to 0), then the affine map. Computed at compile time.
const SBOX: [u8; 256] = {
    let mut table = [0u8; 256];
    let mut x = 0;
    while x < 256 {
        // x^254 is x's inverse (and 0 for 0): square and multiply.
        let (mut inverse, mut power, mut exponent) = (1u8, x as u8, 254u32);
        while exponent > 0 {
            if exponent & 1 == 1 {
                inverse = gf_mul(inverse, power);
            }
            power = gf_mul(power, power);
            exponent >>= 1;
        }
        let b = inverse;
        table[x] =
            b ^ b.rotate_left(1) ^ b.rotate_left(2) ^ b.rotate_left(3) ^ b.rotate_left(4) ^ 0x63;
        x += 1;
    }
    table
};

/// Multiplication in AES's GF(2^8) (modulo x^8 + x^4 + x^3 + x + 1).
const fn gf_mul(mut a: u8, mut b: u8) -> u8 {
    let mut product = 0;
    while b != 0 {
        if b & 1 == 1 {
            product ^= a;
        }
        a = (a << 1) ^ if a & 0x80 != 0 { 0x1b } else { 0 };
        b >>= 1;
    }
    product
}

/// MixColumns of a column holding `SBOX[a]` in row 0 and zeros elsewhere:
/// (2s, s, s, 3s), row r in byte r. A byte in row r gives the same column
/// rotated left by 8r bits.
const COLUMN: [u32; 256] = {
    let mut table = [0u32; 256];
    let mut a = 0;
    while a < 256 {
        let s = SBOX[a];
        table[a] = u32::from_le_bytes([gf_mul(s, 2), s, s, gf_mul(s, 3)]);
        a += 1;
    }
    table
};

/// One AES round on one 32-bit column, less ShiftRows (the one step that
/// mixes columns) and the round key: SubBytes, then MixColumns, with row r
/// in byte r (bits 8r..8r+8), as a column of an AES state sits in memory.
/// The scalar reference of the back ends' `aesenc` after a byte shuffle
/// that undoes ShiftRows' move.
#[inline(always)]
pub(crate) fn aes_column(x: u32) -> u32 {
    COLUMN[(x & 0xff) as usize]
        ^ COLUMN[(x >> 8 & 0xff) as usize].rotate_left(8)
        ^ COLUMN[(x >> 16 & 0xff) as usize].rotate_left(16)
        ^ COLUMN[(x >> 24) as usize].rotate_left(24)
}

/// The keys of one stream's elements `high << 32 ..` at one step: a word
/// added to the counter, then the two rounds' keys.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Keys {
    pub(crate) add: u32,
    pub(crate) rounds: [u32; 2],
}

/// The random word of counter `counter` under `keys`: two keyed AES rounds
/// on the 32-bit column `counter + keys.add` (SubBytes and MixColumns each,
/// [`aes_column`]). A bijection of the counter; one changed input bit
/// reaches every output bit through two S-box layers (MixColumns' branch
/// number is 5, so any two inputs differ in at least five S-boxes). A
/// statistical hash, not a cipher. Four instructions a vector with VAES (a
/// byte shuffle and `aesenc`, twice), where the multiplicative hash it
/// replaced (lowbias32) took eleven, two of them slow multiplies; AES-NI
/// without VAES works on 128 bits at a time, so 256- and 512-bit vectors
/// are cut and joined around it.
#[inline(always)]
pub(crate) fn hash(keys: Keys, counter: u32) -> u32 {
    let x = aes_column(counter.wrapping_add(keys.add)) ^ keys.rounds[0];
    aes_column(x) ^ keys.rounds[1]
}

fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The keys of elements `high << 32 ..` of `stream` at `step`.
pub(crate) fn keys(seed: u64, step: u64, stream: Stream, high: u64) -> Keys {
    let mixed = splitmix64(seed ^ splitmix64(step ^ splitmix64(stream as u64 ^ (high << 8))));
    let more = splitmix64(mixed);
    Keys {
        add: mixed as u32,
        rounds: [(mixed >> 32) as u32, more as u32],
    }
}

/// The random word of global element `index`.
pub(crate) fn word(seed: u64, step: u64, stream: Stream, index: u64) -> u32 {
    hash(keys(seed, step, stream, index >> 32), index as u32)
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

/// Random words for one stream, vector by vector: the keys are recomputed
/// only when the index crosses into the next 2^32 elements, and a vector
/// that follows the one before it steps that one's counters on (one add,
/// where a fresh start broadcasts its index). The counters hold the added
/// key already (`index + keys.add`), so a vector's words cost the add and
/// the two rounds.
pub(crate) struct Noise<S: Simd> {
    seed: u64,
    step: u64,
    stream: Stream,
    high: u64,
    /// The key added to the counters of elements `high << 32 ..`.
    add: u32,
    /// Their round keys, in every lane.
    rounds: (S::U, S::U),
    /// The low 32 bits of the last vector's indices plus `add`.
    counters: S::U,
    /// The index at which the next vector continues the last one (none
    /// where stepping on would wrap the low 32 bits).
    next: Option<u64>,
    /// The low 32 bits of the last pair's even-numbered indices plus `add`
    /// ([`Noise::pair`]).
    evens: S::U,
    /// As `next`, for pairs.
    next_pair: Option<u64>,
}

impl<S: Simd> Noise<S> {
    pub(crate) fn new(s: S, seed: u64, step: u64, stream: Stream) -> Noise<S> {
        let (add, rounds) = lane_keys(s, keys(seed, step, stream, 0));
        Noise {
            seed,
            step,
            stream,
            high: 0,
            add,
            rounds,
            counters: s.splat_word(0),
            next: None,
            evens: s.splat_word(0),
            next_pair: None,
        }
    }

    /// Keys the lanes for elements `high << 32 ..`. New keys end both
    /// continuations: single vectors and pairs share them, and a run that
    /// stepped its counters on would hash with the other block's keys.
    #[inline(always)]
    fn rekey(&mut self, s: S, high: u64) {
        if high != self.high {
            self.high = high;
            (self.add, self.rounds) = lane_keys(s, keys(self.seed, self.step, self.stream, high));
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
            self.counters = s.iota_words(low.wrapping_add(self.add));
        }
        self.next = continues(index, lanes);
        s.aes_rounds(self.counters, self.rounds)
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
            self.evens = s.iota_even_words(low.wrapping_add(self.add));
        }
        self.next_pair = continues(index, span);
        let odds = s.add_words(self.evens, s.splat_word(1));
        (
            s.aes_rounds(self.evens, self.rounds),
            s.aes_rounds(odds, self.rounds),
        )
    }
}

/// `keys` as [`Noise`] holds them: the added key, and the round keys in
/// every lane.
#[inline(always)]
fn lane_keys<S: Simd>(s: S, keys: Keys) -> (u32, (S::U, S::U)) {
    let [first, second] = keys.rounds;
    (keys.add, (s.splat_word(first), s.splat_word(second)))
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
        let mut source: Vec<f32> = (0..1000u64)
            .map(|i| f32::from_bits(word(99, 0, Stream::Master, i)))
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
    fn the_sbox_is_aes() {
        // FIPS-197 figure 7.
        for (x, y) in [
            (0x00, 0x63),
            (0x01, 0x7c),
            (0x53, 0xed),
            (0x9a, 0xb8),
            (0xff, 0x16),
        ] {
            assert_eq!(SBOX[x], y, "S-box at {x:#04x}");
        }
        // FIPS-197 5.1.3: a column's MixColumns, (db, 13, 53, 45) to (8e,
        // 4d, a1, bc), through the table (whose entries include SubBytes).
        let inverse = |y: u8| SBOX.iter().position(|&s| s == y).unwrap() as u8;
        let column = u32::from_le_bytes([0xdb, 0x13, 0x53, 0x45].map(inverse));
        assert_eq!(aes_column(column).to_le_bytes(), [0x8e, 0x4d, 0xa1, 0xbc]);
    }

    #[test]
    fn noise_is_uniform_and_independent_of_neighbours_and_steps() {
        // One million consecutive indices at two steps: each 16-bit noise
        // (m's low half, v's high half, the master's xor) fills 256
        // buckets as evenly as chance does, and neither neighbours (1 to
        // 2^16 apart), the halves nor the steps correlate.
        let n = 1usize << 20;
        let noises = |step: u64| -> [Vec<f64>; 3] {
            let words: Vec<u32> = (0..n as u64)
                .map(|i| word(5, step, Stream::Moments, (3 << 32) - 1000 + i))
                .collect();
            [
                words.iter().map(|w| f64::from(w & 0xffff)).collect(),
                words.iter().map(|w| f64::from(w >> 16)).collect(),
                words
                    .iter()
                    .map(|w| f64::from((w ^ (w >> 16)) & 0xffff))
                    .collect(),
            ]
        };
        let correlation = |a: &[f64], b: &[f64]| {
            let mean = |x: &[f64]| x.iter().sum::<f64>() / x.len() as f64;
            let (ma, mb) = (mean(a), mean(b));
            let (mut ab, mut aa, mut bb) = (0.0, 0.0, 0.0);
            for (x, y) in a.iter().zip(b) {
                ab += (x - ma) * (y - mb);
                aa += (x - ma).powi(2);
                bb += (y - mb).powi(2);
            }
            ab / (aa * bb).sqrt()
        };
        // Six standard errors.
        let bound = 6.0 / (n as f64).sqrt();
        let [low, high, xor] = noises(8);
        let [next_low, next_high, _] = noises(9);
        for (name, noise) in [("low", &low), ("high", &high), ("xor", &xor)] {
            let mut buckets = [0f64; 256];
            for x in noise.iter() {
                buckets[*x as usize >> 8] += 1.0;
            }
            let expected = n as f64 / 256.0;
            let chi2: f64 = buckets
                .iter()
                .map(|b| (b - expected).powi(2) / expected)
                .sum();
            // 255 degrees of freedom: mean 255, standard deviation 22.6;
            // too even a fill fails too.
            assert!(
                (chi2 - 255.0).abs() < 6.0 * 22.6,
                "{name}: chi-square {chi2}"
            );
            for lag in [1, 2, 16, 256, 1 << 16] {
                let r = correlation(&noise[lag..], &noise[..n - lag]);
                assert!(r.abs() < bound, "{name}: words {lag} apart correlate {r}");
            }
        }
        for (name, a, b) in [
            ("low and high", &low, &high),
            ("low across steps", &low, &next_low),
            ("high across steps", &high, &next_high),
        ] {
            let r = correlation(a, b);
            assert!(r.abs() < bound, "{name}: {r}");
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
