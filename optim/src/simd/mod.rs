//! One vector interface, several instruction sets. Kernels are written once
//! against [`Simd`] and instantiated per back end; [`dispatch`] is the single
//! point where the instruction set chosen at start is turned into code.
//!
//! The back ends are zero-sized tokens: an AVX-512 token exists only inside
//! a function compiled with AVX-512 enabled and entered after the CPU was
//! checked, which is what makes their safe methods sound.

mod portable;
#[cfg(target_arch = "x86_64")]
mod x86;

use half::{bf16, f16};

use crate::Isa;

pub(crate) use portable::Portable;

/// The widest vector any back end uses, in f32 lanes; stack buffers for
/// tails are this long.
pub(crate) const LANES_MAX: usize = 16;

/// Vector operations over f32 lanes, the element conversions the kernels
/// need, and an f64 accumulator for norms.
///
/// Loads and stores take slices at least [`Simd::LANES`] long and touch the
/// first `LANES` elements (they panic on shorter slices).
pub trait Simd: Copy + Send + Sync {
    /// f32 lanes per vector.
    const LANES: usize;
    /// A vector of `LANES` f32.
    type V: Copy;
    /// A sum of squares kept in f64 lanes.
    type Acc: Copy;
    /// A vector of `LANES` u32 (random words for stochastic rounding).
    type U: Copy;

    fn splat(self, x: f32) -> Self::V;
    fn load(self, src: &[f32]) -> Self::V;
    fn store(self, dst: &mut [f32], v: Self::V);
    /// bf16 to f32: a bit shift (exact; signaling NaNs stay signaling).
    fn load_bf16(self, src: &[bf16]) -> Self::V;
    /// f32 to bf16, round to nearest even, NaN kept NaN (quiet bit set).
    fn store_bf16(self, dst: &mut [bf16], v: Self::V);
    /// fp16 to f32 (exact).
    fn load_f16(self, src: &[f16]) -> Self::V;
    /// f32 to fp16, round to nearest even, subnormals kept.
    fn store_f16(self, dst: &mut [f16], v: Self::V);
    /// `store` with a non-temporal store; `dst` must start on a
    /// `4 * LANES`-byte boundary (panics otherwise).
    fn stream_f32(self, dst: &mut [f32], v: Self::V);
    /// `store_bf16` with a non-temporal store (no read for ownership, no
    /// cache pollution). `dst` must start on a `2 * LANES`-byte boundary
    /// (panics otherwise); call [`Simd::fence`] before the data is handed on.
    fn stream_bf16(self, dst: &mut [bf16], v: Self::V);
    /// `store_f16` with a non-temporal store; as [`Simd::stream_bf16`].
    fn stream_f16(self, dst: &mut [f16], v: Self::V);
    /// Orders earlier non-temporal stores before later stores.
    fn fence(self);

    /// Every lane `x`.
    fn splat_word(self, x: u32) -> Self::U;
    /// Lane `i`: `first + i` (wrapping).
    fn iota_words(self, first: u32) -> Self::U;
    /// Lane `i`: `first + 2 * i` (wrapping): the indices of the
    /// even-numbered elements of a pair ([`Simd::load_bf16_pair`]).
    fn iota_even_words(self, first: u32) -> Self::U;
    /// Lanewise wrapping sum.
    fn add_words(self, a: Self::U, b: Self::U) -> Self::U;
    /// Lane `i`: two keyed AES rounds on the column `x[i]`, less
    /// ShiftRows: `aes_column(aes_column(x[i]) ^ rounds.0[i]) ^ rounds.1[i]`
    /// (`rounding::hash` of a counter whose added key `x` holds).
    fn aes_rounds(self, x: Self::U, rounds: (Self::U, Self::U)) -> Self::U;
    /// u32 lanes from `src` (at least `LANES` long).
    fn load_u32(self, src: &[u32]) -> Self::U;
    /// Each lane's low 16 bits and its high 16 bits shifted down: two
    /// noise words for stochastic rounding from one random word.
    fn halves(self, u: Self::U) -> (Self::U, Self::U);
    /// Lanewise xor; of the two halves, a third noise word, pairwise
    /// independent of each half.
    fn xor_words(self, a: Self::U, b: Self::U) -> Self::U;
    /// Whether no lane is NaN.
    fn nan_free(self, v: Self::V) -> bool;
    /// Whether no lane of `a` or `b` is NaN (one compare of the two).
    fn nan_free_both(self, a: Self::V, b: Self::V) -> bool;
    /// f32 lanes rounded to bf16 stochastically with each lane's `noise`
    /// (below 2^16), as `rounding::round_bf16_stochastic`, and returned as
    /// f32 (exactly the bf16 values: low halves zero, NaN quieted).
    /// `nan_free`: the caller has checked that no lane is NaN (otherwise
    /// the lanes are checked here).
    #[inline(always)]
    fn round_bf16_sr(self, v: Self::V, noise: Self::U, nan_free: bool) -> Self::V {
        let rounded = self.clear_low_halves(self.add_noise(v, noise));
        if nan_free || self.nan_free(v) {
            return rounded;
        }
        self.quiet_nan_lanes(v, rounded)
    }
    /// `rounded` with every lane where `v` is NaN replaced by that NaN,
    /// quieted and cut to bf16 (the rare path of [`Simd::round_bf16_sr`]).
    fn quiet_nan_lanes(self, v: Self::V, rounded: Self::V) -> Self::V;
    /// Stores each lane's high 16 bits as a bf16: the value itself when the
    /// low ones are zero (as [`Simd::round_bf16_sr`] returns them), cut
    /// otherwise.
    fn store_bf16_exact(self, dst: &mut [bf16], v: Self::V);
    /// `2 * LANES` bf16 (from a slice at least that long) widened to f32 as
    /// two vectors: the even-numbered elements (element `2i` in lane `i`)
    /// and the odd-numbered ones (element `2i + 1`). Each is one shift or
    /// one mask of the 32-bit words loaded, where [`Simd::load_bf16`] of
    /// one vector moves words across the register.
    fn load_bf16_pair(self, src: &[bf16]) -> (Self::V, Self::V);
    /// [`Simd::load_bf16_pair`] with subnormals (and zeros) as +0, as
    /// [`Simd::flush_subnormal`] of each half.
    #[inline(always)]
    fn load_bf16_pair_flushed(self, src: &[bf16]) -> (Self::V, Self::V) {
        let (even, odd) = self.load_bf16_pair(src);
        (self.flush_subnormal(even), self.flush_subnormal(odd))
    }
    /// Stores `2 * LANES` bf16 from two vectors in the layout of
    /// [`Simd::load_bf16_pair`], each lane's high 16 bits as they are (as
    /// [`Simd::store_bf16_exact`]).
    fn store_bf16_pair_exact(self, dst: &mut [bf16], even: Self::V, odd: Self::V);
    /// Each lane's bits plus its `noise`, as f32 lanes (the sum before its
    /// low halves are cut).
    fn add_noise(self, v: Self::V, noise: Self::U) -> Self::V;
    /// Each lane's low 16 bits cleared.
    fn clear_low_halves(self, v: Self::V) -> Self::V;
    /// f32 to bf16, rounding stochastically with each lane's `noise` (below
    /// 2^16), as `rounding::round_bf16_stochastic`; `nan_free` as for
    /// [`Simd::round_bf16_sr`]. Where no lane is NaN, the high halves of
    /// bits + noise are stored as they are: their low halves need no
    /// clearing.
    #[inline(always)]
    fn store_bf16_sr(self, dst: &mut [bf16], v: Self::V, noise: Self::U, nan_free: bool) {
        self.store_bf16_exact(dst, self.bf16_sr_high(v, noise, nan_free))
    }
    /// Lanes whose high 16 bits are `v` rounded to bf16 stochastically, as
    /// [`Simd::store_bf16_sr`] stores them (the low 16 bits are left as
    /// they fall): for [`Simd::store_bf16_exact`] and
    /// [`Simd::store_bf16_pair_exact`].
    #[inline(always)]
    fn bf16_sr_high(self, v: Self::V, noise: Self::U, nan_free: bool) -> Self::V {
        if nan_free || self.nan_free(v) {
            return self.add_noise(v, noise);
        }
        self.round_bf16_sr(v, noise, false)
    }
    /// [`Simd::store_bf16_sr`], returning the values stored (as f32).
    #[inline(always)]
    fn store_bf16_sr_value(
        self,
        dst: &mut [bf16],
        v: Self::V,
        noise: Self::U,
        nan_free: bool,
    ) -> Self::V {
        if nan_free || self.nan_free(v) {
            let sum = self.add_noise(v, noise);
            self.store_bf16_exact(dst, sum);
            return self.clear_low_halves(sum);
        }
        let rounded = self.round_bf16_sr(v, noise, false);
        self.store_bf16_exact(dst, rounded);
        rounded
    }

    fn add(self, a: Self::V, b: Self::V) -> Self::V;
    fn sub(self, a: Self::V, b: Self::V) -> Self::V;
    fn mul(self, a: Self::V, b: Self::V) -> Self::V;
    fn div(self, a: Self::V, b: Self::V) -> Self::V;
    fn sqrt(self, a: Self::V) -> Self::V;
    /// `a * b + c`, fused where the back end has FMA.
    fn mul_add(self, a: Self::V, b: Self::V, c: Self::V) -> Self::V;
    /// 1 for positive, -1 for negative, the input itself for zeros and NaN.
    fn sign(self, a: Self::V) -> Self::V;
    /// Lanes whose exponent field is zero (subnormals and zeros) as +0;
    /// the rest unchanged (as `portable::flush_subnormal`).
    fn flush_subnormal(self, a: Self::V) -> Self::V;

    fn acc_zero(self) -> Self::Acc;
    /// `acc + v * v`, each lane widened to f64 first so no square overflows.
    fn acc_add_square(self, acc: Self::Acc, v: Self::V) -> Self::Acc;
    fn acc_sum(self, acc: Self::Acc) -> f64;
}

/// An element type kernels read and write: f32, bf16 or fp16. Sealed: the
/// vector loads and stores live on [`Lanes`], which only this crate
/// implements.
pub trait Element: Lanes + Copy + Default + Send + Sync + 'static {
    /// One element to f32 (exact).
    fn to_f32(self) -> f32;
    /// One f32 to this type, round to nearest even.
    fn from_f32(x: f32) -> Self;
}

/// Vector loads and stores of an [`Element`] (crate-private: the module is
/// not exported).
pub trait Lanes: Sized {
    /// Widens `LANES` elements to f32 lanes.
    fn load<S: Simd>(s: S, src: &[Self]) -> S::V;
    /// Narrows f32 lanes into `LANES` elements (round to nearest even).
    fn store<S: Simd>(s: S, dst: &mut [Self], v: S::V);
    /// [`Lanes::store`] bypassing the caches where the back end can; `dst`
    /// aligned as [`Simd::stream_bf16`] requires.
    fn stream<S: Simd>(s: S, dst: &mut [Self], v: S::V);
    /// [`Lanes::store`] rounding stochastically with each lane's `noise`
    /// (below 2^16) where the type is narrower than f32 and supports it
    /// (bf16); exactly `store` otherwise. `nan_free` as for
    /// [`Simd::round_bf16_sr`].
    #[inline(always)]
    fn store_sr<S: Simd>(s: S, dst: &mut [Self], v: S::V, noise: S::U, nan_free: bool) {
        let _ = (noise, nan_free);
        Self::store(s, dst, v)
    }
    /// Whether `2 * LANES` elements load as a pair of vectors, the
    /// even-numbered elements and the odd ones ([`Simd::load_bf16_pair`]),
    /// without moving words across the register: bf16 only. Kernels take
    /// their pair paths only where every stream has it.
    const PAIRS: bool = false;
    /// [`Simd::load_bf16_pair`] for this type.
    ///
    /// # Panics
    /// Where the type has no pair layout (`PAIRS` is false).
    #[inline(always)]
    fn load_pair<S: Simd>(s: S, src: &[Self]) -> (S::V, S::V) {
        let _ = (s, src);
        unreachable!("only an element type with PAIRS loads in pairs")
    }
    /// [`Lanes::load_pair`] with subnormals as +0
    /// ([`Simd::load_bf16_pair_flushed`]).
    ///
    /// # Panics
    /// Where the type has no pair layout (`PAIRS` is false).
    #[inline(always)]
    fn load_pair_flushed<S: Simd>(s: S, src: &[Self]) -> (S::V, S::V) {
        let _ = (s, src);
        unreachable!("only an element type with PAIRS loads in pairs")
    }
    /// [`Simd::store_bf16_pair_exact`] for this type.
    ///
    /// # Panics
    /// Where the type has no pair layout (`PAIRS` is false).
    #[inline(always)]
    fn store_pair_exact<S: Simd>(s: S, dst: &mut [Self], even: S::V, odd: S::V) {
        let _ = (s, dst, even, odd);
        unreachable!("only an element type with PAIRS stores in pairs")
    }
    /// [`Lanes::store_sr`], returning the values as stored (widened to f32
    /// exactly): what a load of `dst` would give.
    #[inline(always)]
    fn store_sr_value<S: Simd>(
        s: S,
        dst: &mut [Self],
        v: S::V,
        noise: S::U,
        nan_free: bool,
    ) -> S::V {
        Self::store_sr(s, dst, v, noise, nan_free);
        Self::load(s, dst)
    }
}

macro_rules! element {
    ($t:ty, $load:ident, $store:ident, $stream:ident, $to:expr, $from:expr $(, $store_sr:ident, $store_sr_value:ident, $load_pair:ident, $load_pair_flushed:ident, $store_pair:ident)?) => {
        impl Element for $t {
            fn to_f32(self) -> f32 {
                $to(self)
            }
            fn from_f32(x: f32) -> Self {
                $from(x)
            }
        }
        impl Lanes for $t {
            #[inline(always)]
            fn load<S: Simd>(s: S, src: &[Self]) -> S::V {
                s.$load(src)
            }
            #[inline(always)]
            fn store<S: Simd>(s: S, dst: &mut [Self], v: S::V) {
                s.$store(dst, v)
            }
            #[inline(always)]
            fn stream<S: Simd>(s: S, dst: &mut [Self], v: S::V) {
                s.$stream(dst, v)
            }
            $(
            #[inline(always)]
            fn store_sr<S: Simd>(s: S, dst: &mut [Self], v: S::V, noise: S::U, nan_free: bool) {
                s.$store_sr(dst, v, noise, nan_free)
            }
            #[inline(always)]
            fn store_sr_value<S: Simd>(
                s: S,
                dst: &mut [Self],
                v: S::V,
                noise: S::U,
                nan_free: bool,
            ) -> S::V {
                s.$store_sr_value(dst, v, noise, nan_free)
            }
            const PAIRS: bool = true;
            #[inline(always)]
            fn load_pair<S: Simd>(s: S, src: &[Self]) -> (S::V, S::V) {
                s.$load_pair(src)
            }
            #[inline(always)]
            fn load_pair_flushed<S: Simd>(s: S, src: &[Self]) -> (S::V, S::V) {
                s.$load_pair_flushed(src)
            }
            #[inline(always)]
            fn store_pair_exact<S: Simd>(s: S, dst: &mut [Self], even: S::V, odd: S::V) {
                s.$store_pair(dst, even, odd)
            }
            )?
        }
    };
}

element!(f32, load, store, stream_f32, |x| x, |x| x);
element!(
    bf16,
    load_bf16,
    store_bf16,
    stream_bf16,
    portable::widen_bf16,
    bf16::from_f32,
    store_bf16_sr,
    store_bf16_sr_value,
    load_bf16_pair,
    load_bf16_pair_flushed,
    store_bf16_pair_exact
);
element!(
    f16,
    load_f16,
    store_f16,
    stream_f16,
    f16::to_f32,
    f16::from_f32
);

/// A kernel body, generic over the back end. `run` is inlined into the
/// per-instruction-set entry that [`dispatch`] calls, so it is compiled once
/// per back end with that back end's features enabled.
pub trait Kernel {
    type Output;
    fn run<S: Simd>(self, s: S) -> Self::Output;
}

/// Runs `kernel` on the back end for `isa`.
///
/// # Panics
/// If `isa` is not available on this CPU: asking for it is a caller bug,
/// since [`Isa::detect`] and [`Isa::available`] say what is.
#[inline]
pub(crate) fn dispatch<K: Kernel>(isa: Isa, kernel: K) -> K::Output {
    assert!(
        isa.is_available(),
        "instruction set {isa} is not available on this CPU"
    );
    match isa {
        Isa::Portable => kernel.run(Portable),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => x86::run_avx2(kernel),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => x86::run_avx512(kernel),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512Vaes => x86::run_avx512_vaes(kernel),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512Bf16 => x86::run_avx512_bf16(kernel),
        #[cfg(not(target_arch = "x86_64"))]
        _ => unreachable!("is_available is false for x86 back ends elsewhere"),
    }
}

#[cfg(test)]
thread_local! {
    static STREAMED: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Counts, in this crate's tests, the kernel runs on this thread that chose
/// to stream their outputs past the caches ([`take_streamed`]); nothing
/// otherwise.
#[inline(always)]
pub(crate) fn note_streamed(streams: bool) {
    #[cfg(test)]
    if streams {
        STREAMED.with(|count| count.set(count.get() + 1));
    }
    #[cfg(not(test))]
    let _ = streams;
}

/// The kernel runs on this thread that streamed since the last call.
#[cfg(test)]
pub(crate) fn take_streamed() -> usize {
    STREAMED.with(|count| count.replace(0))
}

/// Outputs of a call at least this long (the whole call, of which a
/// kernel may run one piece: a pool's split, or a host stretch) are written
/// with non-temporal stores: with the ~28 bytes per element of state a step
/// streams, that much no longer fits in a last-level cache, and the output
/// is read next by a copy to the device, so reading its lines in first (for
/// ownership) would only cost bandwidth.
pub(crate) const STREAM_ELEMS_MIN: usize = 1 << 21;

/// Elements before `dst` starts on a whole-vector boundary (`LANES`
/// elements of `T`): the head a kernel runs through its padded path so that
/// the body's loads and stores do not straddle cache lines, and so that
/// [`Simd::stream_bf16`]'s alignment holds.
#[inline(always)]
pub(crate) fn align_head<S: Simd, T>(dst: &[T]) -> usize {
    let align = S::LANES * std::mem::size_of::<T>();
    let misaligned = dst.as_ptr() as usize % align;
    match misaligned {
        0 => 0,
        m => ((align - m) / std::mem::size_of::<T>()).min(dst.len()),
    }
}

/// Splits `len` into the part whole vectors cover and the tail.
#[inline(always)]
pub(crate) fn body_len<S: Simd>(len: usize) -> usize {
    len / S::LANES * S::LANES
}

/// How far ahead of its loads, in elements of each stream (4 KiB of an fp32
/// stream), a streaming kernel asks for the lines it will read: the
/// hardware's prefetchers stop at each 4 KiB page, and a core reading four
/// streams otherwise keeps too few lines in flight to reach its share of a
/// server's bandwidth. On the 16-core host of an H200 machine (2026-11-26,
/// 64M parameters, medians of two interleaved sweeps) no prefetch, 256, 512 and 1024 gave
/// AdamW fp32 4.73, 5.11, 5.23 and 5.37 G params/s at 16 threads and 4.72,
/// 4.88, 4.83 and 5.24 at 14; on the 2-core development machine 1024 gained
/// 7-16% at 2 threads and 2048 no more.
pub(crate) const PREFETCH_ELEMS_DEFAULT: usize = 1024;

/// The most `STRATA_PREFETCH_ELEMS` may ask for (256 KiB of an fp32 stream,
/// beyond any use).
pub(crate) const PREFETCH_ELEMS_MAX: usize = 1 << 16;

/// The prefetch distance of [`PREFETCH_ELEMS_DEFAULT`], or
/// `STRATA_PREFETCH_ELEMS` (0 turns prefetching off), read once.
#[derive(Clone, Copy)]
pub(crate) struct Ahead(usize);

impl Ahead {
    pub(crate) fn get() -> Ahead {
        static AHEAD: std::sync::OnceLock<Ahead> = std::sync::OnceLock::new();
        *AHEAD.get_or_init(|| {
            // Only x86_64 has a prefetch instruction here: elsewhere the
            // distance is 0, as reported.
            if cfg!(not(target_arch = "x86_64")) {
                return Ahead(0);
            }
            // A value that is not UTF-8 reads as one that is not a number.
            let value =
                std::env::var_os("STRATA_PREFETCH_ELEMS").map(|v| v.to_string_lossy().into_owned());
            Ahead(
                parse_prefetch_elems(value.as_deref()).unwrap_or_else(|problem| {
                    tracing::warn!(
                        "{problem}; prefetching {PREFETCH_ELEMS_DEFAULT} elements ahead"
                    );
                    PREFETCH_ELEMS_DEFAULT
                }),
            )
        })
    }

    /// Asks for the cache line of `base + i` plus the distance (a hint that
    /// never faults, whatever the address; nothing with the distance 0).
    #[inline(always)]
    pub(crate) fn touch<T>(self, base: *const T, i: usize) {
        if self.0 == 0 {
            return;
        }
        #[cfg(target_arch = "x86_64")]
        x86::prefetch(base.wrapping_add(i.wrapping_add(self.0)).cast());
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (base, i);
    }
}

/// How many elements ahead of their loads the kernels prefetch (0: they do
/// not): [`PREFETCH_ELEMS_DEFAULT`] or `STRATA_PREFETCH_ELEMS` on x86_64, 0
/// elsewhere.
pub fn prefetch_elems() -> usize {
    Ahead::get().0
}

/// `STRATA_PREFETCH_ELEMS`'s value as a distance, or what is wrong with it.
fn parse_prefetch_elems(value: Option<&str>) -> Result<usize, String> {
    let Some(value) = value else {
        return Ok(PREFETCH_ELEMS_DEFAULT);
    };
    match value.trim().parse::<usize>() {
        Ok(elems) if elems <= PREFETCH_ELEMS_MAX => Ok(elems),
        _ => Err(format!(
            "STRATA_PREFETCH_ELEMS={value:?} is not a count of elements from 0 (off) to \
             {PREFETCH_ELEMS_MAX}: set it to one, or unset it"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn a_prefetch_distance_from_the_environment_is_checked() {
        assert_eq!(parse_prefetch_elems(None), Ok(PREFETCH_ELEMS_DEFAULT));
        assert_eq!(parse_prefetch_elems(Some("0")), Ok(0));
        assert_eq!(parse_prefetch_elems(Some(" 2048 ")), Ok(2048));
        for bad in ["-1", "4k", "", "65537"] {
            let problem = parse_prefetch_elems(Some(bad)).unwrap_err();
            assert!(
                problem.contains(&format!("STRATA_PREFETCH_ELEMS={bad:?}"))
                    && problem.contains("65536"),
                "{problem}"
            );
        }
    }
}
