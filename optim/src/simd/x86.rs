//! x86-64 back ends: AVX2 + FMA + F16C (8 lanes) and AVX-512F (16 lanes),
//! the latter optionally with VAES (512-bit AES rounds) and AVX512-BW, and
//! then also with AVX512-BF16's `vcvtneps2bf16` for narrowing and
//! AVX512-BW's word permute (`vpermw`) for bf16 loads and stores. Every back
//! end has AES-NI: stochastic rounding's random words are AES rounds.
//!
//! Every intrinsic here needs its CPU feature. The tokens [`Avx2`] and
//! [`Avx512`] are created only inside the `run_*` entries below, which are
//! compiled with those features and entered only after `dispatch` checked
//! the CPU has them; the token methods are `#[inline(always)]`, so they are
//! compiled into those entries. That is the argument every `SAFETY` comment
//! in this file refers to as "the token".

use std::arch::x86_64::*;

use half::{bf16, f16};

use super::{Kernel, Simd};

/// `vcvtps2ph` rounding for F16C (3-bit immediate): to nearest even.
const F16C_NEAREST_EVEN: i32 = _MM_FROUND_TO_NEAREST_INT;
/// `vcvtps2ph` rounding for AVX-512: to nearest even, no exceptions.
const AVX512_NEAREST_EVEN: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
/// An f32's exponent field.
const EXPONENT: i32 = 0x7f80_0000;

/// AVX2 + FMA + F16C + AES-NI.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Avx2 {
    _only_in_entries: (),
}

/// AVX-512F and AES-NI; with `VAES`, also VAES and AVX512-BW (whose byte
/// shuffle undoes ShiftRows on 512 bits); with `BF16` (which the entries
/// pair with `VAES`), also AVX512-VL and AVX512-BF16's conversion
/// instruction (every CPU with AVX512-BF16 has BW and VL).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Avx512<const VAES: bool, const BF16: bool> {
    _only_in_entries: (),
}

#[target_feature(enable = "avx2,fma,f16c,aes")]
fn entry_avx2<K: Kernel>(kernel: K) -> K::Output {
    kernel.run(Avx2 {
        _only_in_entries: (),
    })
}

#[target_feature(enable = "avx512f,aes")]
fn entry_avx512<K: Kernel>(kernel: K) -> K::Output {
    kernel.run(Avx512::<false, false> {
        _only_in_entries: (),
    })
}

#[target_feature(enable = "avx512f,avx512bw,vaes,aes")]
fn entry_avx512_vaes<K: Kernel>(kernel: K) -> K::Output {
    kernel.run(Avx512::<true, false> {
        _only_in_entries: (),
    })
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,vaes")]
fn entry_avx512_bf16<K: Kernel>(kernel: K) -> K::Output {
    kernel.run(Avx512::<true, true> {
        _only_in_entries: (),
    })
}

/// Runs `kernel` with AVX2. The caller (`dispatch`) checked the CPU.
pub(crate) fn run_avx2<K: Kernel>(kernel: K) -> K::Output {
    assert!(crate::Isa::Avx2.is_available());
    // SAFETY: the assertion above checked avx2, fma, f16c and aes at run time.
    unsafe { entry_avx2(kernel) }
}

/// Runs `kernel` with AVX-512F.
pub(crate) fn run_avx512<K: Kernel>(kernel: K) -> K::Output {
    assert!(crate::Isa::Avx512.is_available());
    // SAFETY: the assertion above checked avx512f and aes at run time.
    unsafe { entry_avx512(kernel) }
}

/// Runs `kernel` with AVX-512F, AVX512-BW and VAES.
pub(crate) fn run_avx512_vaes<K: Kernel>(kernel: K) -> K::Output {
    assert!(crate::Isa::Avx512Vaes.is_available());
    // SAFETY: the assertion above checked avx512f, avx512bw, vaes and aes at
    // run time.
    unsafe { entry_avx512_vaes(kernel) }
}

/// Runs `kernel` with AVX-512F and AVX512-BF16.
pub(crate) fn run_avx512_bf16<K: Kernel>(kernel: K) -> K::Output {
    assert!(crate::Isa::Avx512Bf16.is_available());
    // The assertion above checked avx512f, aes, avx512bw, vaes, avx512vl
    // and avx512bf16.
    // SAFETY: the features the entry point is compiled for are present (at run time).
    unsafe { entry_avx512_bf16(kernel) }
}

/// f32 bits to bf16 bits in 32-bit lanes, round to nearest even, NaN made
/// quiet: `(bits + 0x7fff + lsb) >> 16`, the same rule `half` applies.
macro_rules! bf16_round_bits {
    ($bits:expr, $set1:ident, $and:ident, $add:ident, $srli:ident, $or:ident) => {{
        let bits = $bits;
        let lsb = $and($srli::<16>(bits), $set1(1));
        let rounded = $srli::<16>($add($add(bits, $set1(0x7fff)), lsb));
        let quiet = $or($srli::<16>(bits), $set1(0x40));
        (rounded, quiet, $and(bits, $set1(0x7fff_ffff)))
    }};
}

/// The byte shuffle (within each 128-bit lane) that undoes ShiftRows: byte
/// `4c + r` (row r of column c) goes where ShiftRows takes row r of column c
/// from, so that `aesenc` after it is SubBytes and MixColumns on each 32-bit
/// column alone (`rounding::aes_column`), plus the round key.
const UNDO_SHIFT_ROWS: [u8; 16] = [0, 13, 10, 7, 4, 1, 14, 11, 8, 5, 2, 15, 12, 9, 6, 3];

/// `Simd::aes_rounds` on four lanes with AES-NI: the undoing shuffle and
/// `aesenc`, twice. Needs aes (and SSSE3, which AVX2 implies); called only
/// from the tokens' methods, whose entries enable it.
macro_rules! aes_rounds_xmm {
    ($x:expr, $first:expr, $second:expr) => {{
        let undo = _mm_loadu_si128(UNDO_SHIFT_ROWS.as_ptr().cast());
        let x = _mm_aesenc_si128(_mm_shuffle_epi8($x, undo), $first);
        _mm_aesenc_si128(_mm_shuffle_epi8(x, undo), $second)
    }};
}

impl Avx2 {
    /// 16 bf16 words as loaded to the pair layout of `load_bf16_pair`:
    /// word 2i is element 2i, the low half of lane i (shifted up), word
    /// 2i + 1 its high half (kept).
    #[inline(always)]
    fn widen_pair(self, words: __m256i) -> (__m256, __m256) {
        // SAFETY: the token.
        unsafe {
            let odd = _mm256_and_si256(words, _mm256_set1_epi32(0xffff_0000_u32 as i32));
            (
                _mm256_castsi256_ps(_mm256_slli_epi32::<16>(words)),
                _mm256_castsi256_ps(odd),
            )
        }
    }

    /// 8 lanes holding values <= 0xffff to 8 words.
    #[inline(always)]
    fn pack_words(self, words: __m256i) -> __m128i {
        // SAFETY: the token.
        unsafe {
            // Lanes hold values <= 0xffff, so the saturating pack is exact;
            // it packs within 128-bit halves, the permute joins them.
            let packed = _mm256_permute4x64_epi64::<0b1000>(_mm256_packus_epi32(words, words));
            _mm256_castsi256_si128(packed)
        }
    }

    /// f32 lanes to 8 bf16 words (round to nearest even, NaN quieted).
    #[inline(always)]
    fn bf16_words(self, v: __m256) -> __m128i {
        // SAFETY: the token.
        unsafe {
            let (rounded, quiet, magnitude) = bf16_round_bits!(
                _mm256_castps_si256(v),
                _mm256_set1_epi32,
                _mm256_and_si256,
                _mm256_add_epi32,
                _mm256_srli_epi32,
                _mm256_or_si256
            );
            let nan = _mm256_cmpgt_epi32(magnitude, _mm256_set1_epi32(0x7f80_0000));
            self.pack_words(_mm256_blendv_epi8(rounded, quiet, nan))
        }
    }
}

impl Simd for Avx2 {
    const LANES: usize = 8;
    type V = __m256;
    type Acc = (__m256d, __m256d);
    type U = __m256i;

    #[inline(always)]
    fn splat_word(self, x: u32) -> __m256i {
        // SAFETY: the token.
        unsafe { _mm256_set1_epi32(x as i32) }
    }
    #[inline(always)]
    fn iota_words(self, first: u32) -> __m256i {
        // SAFETY: the token.
        unsafe {
            _mm256_add_epi32(
                _mm256_set1_epi32(first as i32),
                _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
            )
        }
    }
    #[inline(always)]
    fn iota_even_words(self, first: u32) -> __m256i {
        // SAFETY: the token.
        unsafe {
            _mm256_add_epi32(
                _mm256_set1_epi32(first as i32),
                _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14),
            )
        }
    }
    #[inline(always)]
    fn add_words(self, a: __m256i, b: __m256i) -> __m256i {
        // SAFETY: the token.
        unsafe { _mm256_add_epi32(a, b) }
    }
    #[inline(always)]
    fn aes_rounds(self, x: __m256i, (first, second): (__m256i, __m256i)) -> __m256i {
        // SAFETY: the token (its entry enables aes); AES-NI works on
        // 128-bit halves.
        unsafe {
            let low = aes_rounds_xmm!(
                _mm256_castsi256_si128(x),
                _mm256_castsi256_si128(first),
                _mm256_castsi256_si128(second)
            );
            let high = aes_rounds_xmm!(
                _mm256_extracti128_si256::<1>(x),
                _mm256_extracti128_si256::<1>(first),
                _mm256_extracti128_si256::<1>(second)
            );
            _mm256_inserti128_si256::<1>(_mm256_castsi128_si256(low), high)
        }
    }
    #[inline(always)]
    fn load_u32(self, src: &[u32]) -> __m256i {
        assert!(src.len() >= 8);
        // SAFETY: the token; 8 u32 (32 bytes) are in bounds (asserted).
        unsafe { _mm256_loadu_si256(src.as_ptr().cast()) }
    }
    #[inline(always)]
    fn halves(self, u: __m256i) -> (__m256i, __m256i) {
        // SAFETY: the token.
        unsafe {
            (
                _mm256_and_si256(u, _mm256_set1_epi32(0xffff)),
                _mm256_srli_epi32::<16>(u),
            )
        }
    }
    #[inline(always)]
    fn xor_words(self, a: __m256i, b: __m256i) -> __m256i {
        // SAFETY: the token.
        unsafe { _mm256_xor_si256(a, b) }
    }
    #[inline(always)]
    fn add_noise(self, v: __m256, noise: __m256i) -> __m256 {
        // SAFETY: the token.
        unsafe { _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(v), noise)) }
    }
    #[inline(always)]
    fn clear_low_halves(self, v: __m256) -> __m256 {
        // SAFETY: the token.
        unsafe {
            let high = _mm256_set1_epi32(0xffff_0000_u32 as i32);
            _mm256_castsi256_ps(_mm256_and_si256(_mm256_castps_si256(v), high))
        }
    }
    #[inline(always)]
    fn nan_free(self, v: __m256) -> bool {
        // SAFETY: the token.
        unsafe { _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_UNORD_Q>(v, v)) == 0 }
    }
    #[inline(always)]
    fn nan_free_both(self, a: __m256, b: __m256) -> bool {
        // SAFETY: the token.
        unsafe { _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_UNORD_Q>(a, b)) == 0 }
    }
    #[inline(always)]
    fn quiet_nan_lanes(self, v: __m256, rounded: __m256) -> __m256 {
        // SAFETY: the token.
        unsafe {
            let nan = _mm256_cmp_ps::<_CMP_UNORD_Q>(v, v);
            let quiet = _mm256_or_si256(_mm256_castps_si256(v), _mm256_set1_epi32(0x0040_0000));
            _mm256_blendv_ps(
                rounded,
                self.clear_low_halves(_mm256_castsi256_ps(quiet)),
                nan,
            )
        }
    }
    #[inline(always)]
    fn store_bf16_exact(self, dst: &mut [bf16], v: __m256) {
        assert!(dst.len() >= 8);
        // SAFETY: the token; 8 bf16 (16 bytes) are in bounds (asserted).
        unsafe {
            let words = self.pack_words(_mm256_srli_epi32::<16>(_mm256_castps_si256(v)));
            _mm_storeu_si128(dst.as_mut_ptr().cast(), words)
        }
    }
    #[inline(always)]
    fn load_bf16_pair(self, src: &[bf16]) -> (__m256, __m256) {
        assert!(src.len() >= 16);
        // SAFETY: the token; 16 bf16 (32 bytes) are in bounds (asserted).
        self.widen_pair(unsafe { _mm256_loadu_si256(src.as_ptr().cast()) })
    }
    #[inline(always)]
    fn load_bf16_pair_flushed(self, src: &[bf16]) -> (__m256, __m256) {
        assert!(src.len() >= 16);
        // SAFETY: the token; 16 bf16 (32 bytes) are in bounds (asserted).
        unsafe {
            // Words whose exponent field is zero cleared before they are
            // widened: 3 instructions for 16 elements, where a flush of
            // each half takes 6.
            let words = _mm256_loadu_si256(src.as_ptr().cast());
            let exponent = _mm256_and_si256(words, _mm256_set1_epi16(0x7f80));
            let zero = _mm256_cmpeq_epi16(exponent, _mm256_setzero_si256());
            self.widen_pair(_mm256_andnot_si256(zero, words))
        }
    }
    #[inline(always)]
    fn store_bf16_pair_exact(self, dst: &mut [bf16], even: __m256, odd: __m256) {
        assert!(dst.len() >= 16);
        // SAFETY: the token; 16 bf16 (32 bytes) are in bounds (asserted).
        unsafe {
            // Even words from the even lanes' high halves, odd words from
            // the odd lanes' (in place already).
            let low = _mm256_srli_epi32::<16>(_mm256_castps_si256(even));
            let words = _mm256_blend_epi16::<0b1010_1010>(low, _mm256_castps_si256(odd));
            _mm256_storeu_si256(dst.as_mut_ptr().cast(), words)
        }
    }

    #[inline(always)]
    fn splat(self, x: f32) -> __m256 {
        // SAFETY: the token.
        unsafe { _mm256_set1_ps(x) }
    }
    #[inline(always)]
    fn load(self, src: &[f32]) -> __m256 {
        assert!(src.len() >= 8);
        // SAFETY: the token; 8 f32 in bounds (asserted); loadu needs no alignment.
        unsafe { _mm256_loadu_ps(src.as_ptr()) }
    }
    #[inline(always)]
    fn store(self, dst: &mut [f32], v: __m256) {
        assert!(dst.len() >= 8);
        // SAFETY: the token; 8 f32 are in bounds (asserted).
        unsafe { _mm256_storeu_ps(dst.as_mut_ptr(), v) }
    }
    #[inline(always)]
    fn load_bf16(self, src: &[bf16]) -> __m256 {
        assert!(src.len() >= 8);
        // SAFETY: the token; 8 bf16 (16 bytes) are in bounds (asserted).
        unsafe {
            let halves = _mm_loadu_si128(src.as_ptr().cast());
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(halves)))
        }
    }
    #[inline(always)]
    fn store_bf16(self, dst: &mut [bf16], v: __m256) {
        assert!(dst.len() >= 8);
        // SAFETY: the token; 8 bf16 (16 bytes) are in bounds (asserted).
        unsafe { _mm_storeu_si128(dst.as_mut_ptr().cast(), self.bf16_words(v)) }
    }
    #[inline(always)]
    fn stream_f32(self, dst: &mut [f32], v: __m256) {
        assert!(dst.len() >= 8 && (dst.as_ptr() as usize).is_multiple_of(32));
        // SAFETY: the token; 32 bytes in bounds, 32-byte aligned (asserted) for vmovntps.
        unsafe { _mm256_stream_ps(dst.as_mut_ptr(), v) }
    }
    #[inline(always)]
    fn stream_bf16(self, dst: &mut [bf16], v: __m256) {
        assert!(dst.len() >= 8 && (dst.as_ptr() as usize).is_multiple_of(16));
        // SAFETY: the token; 16 bytes in bounds, 16-byte aligned (asserted) for movntdq.
        unsafe { _mm_stream_si128(dst.as_mut_ptr().cast(), self.bf16_words(v)) }
    }
    #[inline(always)]
    fn load_f16(self, src: &[f16]) -> __m256 {
        assert!(src.len() >= 8);
        // SAFETY: the token; 8 f16 (16 bytes) are in bounds (asserted).
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(src.as_ptr().cast())) }
    }
    #[inline(always)]
    fn store_f16(self, dst: &mut [f16], v: __m256) {
        assert!(dst.len() >= 8);
        // SAFETY: the token; 8 f16 (16 bytes) are in bounds (asserted).
        unsafe {
            _mm_storeu_si128(
                dst.as_mut_ptr().cast(),
                _mm256_cvtps_ph::<F16C_NEAREST_EVEN>(v),
            )
        }
    }
    #[inline(always)]
    fn stream_f16(self, dst: &mut [f16], v: __m256) {
        assert!(dst.len() >= 8 && (dst.as_ptr() as usize).is_multiple_of(16));
        // SAFETY: the token; 16 bytes in bounds, 16-byte aligned (asserted) for movntdq.
        unsafe {
            _mm_stream_si128(
                dst.as_mut_ptr().cast(),
                _mm256_cvtps_ph::<F16C_NEAREST_EVEN>(v),
            )
        }
    }
    #[inline(always)]
    fn fence(self) {
        // SAFETY: sfence has no preconditions (SSE, part of the token).
        unsafe { _mm_sfence() }
    }
    #[inline(always)]
    fn add(self, a: __m256, b: __m256) -> __m256 {
        // SAFETY: the token.
        unsafe { _mm256_add_ps(a, b) }
    }
    #[inline(always)]
    fn sub(self, a: __m256, b: __m256) -> __m256 {
        // SAFETY: the token.
        unsafe { _mm256_sub_ps(a, b) }
    }
    #[inline(always)]
    fn mul(self, a: __m256, b: __m256) -> __m256 {
        // SAFETY: the token.
        unsafe { _mm256_mul_ps(a, b) }
    }
    #[inline(always)]
    fn div(self, a: __m256, b: __m256) -> __m256 {
        // SAFETY: the token.
        unsafe { _mm256_div_ps(a, b) }
    }
    #[inline(always)]
    fn sqrt(self, a: __m256) -> __m256 {
        // SAFETY: the token.
        unsafe { _mm256_sqrt_ps(a) }
    }
    #[inline(always)]
    fn mul_add(self, a: __m256, b: __m256, c: __m256) -> __m256 {
        // SAFETY: the token (fma is part of it).
        unsafe { _mm256_fmadd_ps(a, b, c) }
    }
    #[inline(always)]
    fn flush_subnormal(self, a: __m256) -> __m256 {
        // SAFETY: the token.
        unsafe {
            let exponent = _mm256_and_si256(_mm256_castps_si256(a), _mm256_set1_epi32(EXPONENT));
            let zero = _mm256_cmpeq_epi32(exponent, _mm256_setzero_si256());
            _mm256_andnot_ps(_mm256_castsi256_ps(zero), a)
        }
    }
    #[inline(always)]
    fn sign(self, a: __m256) -> __m256 {
        // SAFETY: the token.
        unsafe {
            let zero = _mm256_setzero_ps();
            let positive = _mm256_cmp_ps::<_CMP_GT_OQ>(a, zero);
            let negative = _mm256_cmp_ps::<_CMP_LT_OQ>(a, zero);
            let r = _mm256_blendv_ps(a, _mm256_set1_ps(1.0), positive);
            _mm256_blendv_ps(r, _mm256_set1_ps(-1.0), negative)
        }
    }
    #[inline(always)]
    fn acc_zero(self) -> Self::Acc {
        // SAFETY: the token.
        unsafe { (_mm256_setzero_pd(), _mm256_setzero_pd()) }
    }
    #[inline(always)]
    fn acc_add_square(self, acc: Self::Acc, v: __m256) -> Self::Acc {
        // SAFETY: the token.
        unsafe {
            let low = _mm256_cvtps_pd(_mm256_castps256_ps128(v));
            let high = _mm256_cvtps_pd(_mm256_extractf128_ps::<1>(v));
            (
                _mm256_fmadd_pd(low, low, acc.0),
                _mm256_fmadd_pd(high, high, acc.1),
            )
        }
    }
    #[inline(always)]
    fn acc_sum(self, acc: Self::Acc) -> f64 {
        let mut lanes = [0.0f64; 4];
        // SAFETY: the token; `lanes` holds the 4 f64 storeu writes.
        unsafe { _mm256_storeu_pd(lanes.as_mut_ptr(), _mm256_add_pd(acc.0, acc.1)) };
        lanes.iter().sum()
    }
}

impl<const VAES: bool, const BF16: bool> Avx512<VAES, BF16> {
    /// Word indices that gather each 32-bit lane's high half into the low 256
    /// bits (word `i` takes word `2i + 1`).
    #[inline(always)]
    fn high_words(self) -> __m512i {
        // SAFETY: the token (AVX-512F).
        unsafe {
            _mm512_setr_epi32(
                0x0003_0001,
                0x0007_0005,
                0x000b_0009,
                0x000f_000d,
                0x0013_0011,
                0x0017_0015,
                0x001b_0019,
                0x001f_001d,
                0,
                0,
                0,
                0,
                0,
                0,
                0,
                0,
            )
        }
    }

    /// Word indices that spread the low 16 words into the high halves of 32-bit
    /// lanes (word `2i + 1` takes word `i`) and fill the low halves from word
    /// 16, in the zeroed upper half.
    #[inline(always)]
    fn to_high_words(self) -> __m512i {
        // SAFETY: the token (AVX-512F).
        unsafe {
            _mm512_setr_epi32(
                0x0000_0010,
                0x0001_0010,
                0x0002_0010,
                0x0003_0010,
                0x0004_0010,
                0x0005_0010,
                0x0006_0010,
                0x0007_0010,
                0x0008_0010,
                0x0009_0010,
                0x000a_0010,
                0x000b_0010,
                0x000c_0010,
                0x000d_0010,
                0x000e_0010,
                0x000f_0010,
            )
        }
    }

    /// f32 lanes (as bits) to 16 bf16 words by the integer rule: round to
    /// nearest even, NaN quieted, subnormals kept.
    #[inline(always)]
    fn bf16_words_integer(self, bits: __m512i) -> __m256i {
        // SAFETY: the token.
        unsafe {
            let (rounded, quiet, magnitude) = bf16_round_bits!(
                bits,
                _mm512_set1_epi32,
                _mm512_and_si512,
                _mm512_add_epi32,
                _mm512_srli_epi32,
                _mm512_or_si512
            );
            let nan = _mm512_cmpgt_epi32_mask(magnitude, _mm512_set1_epi32(0x7f80_0000));
            _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rounded, quiet))
        }
    }

    /// f32 lanes to 16 bf16 words (round to nearest even, NaN quieted).
    #[inline(always)]
    fn bf16_words(self, v: __m512) -> __m256i {
        if !BF16 {
            // SAFETY: the token.
            return self.bf16_words_integer(unsafe { _mm512_castps_si512(v) });
        }
        // With BF16 the token includes avx512bw/vl/bf16.
        // SAFETY: the token's features; __m256bh and __m256i are both 32 plain bytes.
        unsafe {
            let bits = _mm512_castps_si512(v);
            // vcvtneps2bf16 rounds and quiets NaN like the integer rule but
            // treats subnormal inputs as zero; those lanes (exponent zero,
            // mantissa not) are rare, so they take a branch. (The bits go by
            // value: a closure borrowing them kept every vector's bits on
            // the stack.)
            let converted: __m256i = std::mem::transmute(_mm512_cvtneps_pbh(v));
            let exponent_zero = _mm512_testn_epi32_mask(bits, _mm512_set1_epi32(0x7f80_0000));
            let mantissa_set = _mm512_test_epi32_mask(bits, _mm512_set1_epi32(0x007f_ffff));
            let subnormal = exponent_zero & mantissa_set;
            if subnormal == 0 {
                converted
            } else {
                _mm256_mask_blend_epi16(subnormal, converted, self.bf16_words_integer(bits))
            }
        }
    }
}

impl<const VAES: bool, const BF16: bool> Simd for Avx512<VAES, BF16> {
    const LANES: usize = 16;
    type V = __m512;
    type Acc = (__m512d, __m512d);
    type U = __m512i;

    #[inline(always)]
    fn splat_word(self, x: u32) -> __m512i {
        // SAFETY: the token.
        unsafe { _mm512_set1_epi32(x as i32) }
    }
    #[inline(always)]
    fn iota_words(self, first: u32) -> __m512i {
        // SAFETY: the token.
        unsafe {
            _mm512_add_epi32(
                _mm512_set1_epi32(first as i32),
                _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
            )
        }
    }
    #[inline(always)]
    fn iota_even_words(self, first: u32) -> __m512i {
        // SAFETY: the token.
        unsafe {
            _mm512_add_epi32(
                _mm512_set1_epi32(first as i32),
                _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30),
            )
        }
    }
    #[inline(always)]
    fn add_words(self, a: __m512i, b: __m512i) -> __m512i {
        // SAFETY: the token.
        unsafe { _mm512_add_epi32(a, b) }
    }
    #[inline(always)]
    fn aes_rounds(self, x: __m512i, (first, second): (__m512i, __m512i)) -> __m512i {
        if VAES {
            // SAFETY: the token (with VAES its entry enables vaes and
            // avx512bw, which the 512-bit aesenc and byte shuffle need).
            unsafe {
                let undo = _mm512_broadcast_i32x4(_mm_loadu_si128(UNDO_SHIFT_ROWS.as_ptr().cast()));
                let x = _mm512_aesenc_epi128(_mm512_shuffle_epi8(x, undo), first);
                _mm512_aesenc_epi128(_mm512_shuffle_epi8(x, undo), second)
            }
        } else {
            // SAFETY: the token (its entry enables aes): AES-NI on each
            // 128-bit quarter.
            unsafe {
                // Quarter `i` of the lanes, with its quarter of each key.
                macro_rules! quarter {
                    ($i:literal) => {
                        aes_rounds_xmm!(
                            _mm512_extracti32x4_epi32::<$i>(x),
                            _mm512_extracti32x4_epi32::<$i>(first),
                            _mm512_extracti32x4_epi32::<$i>(second)
                        )
                    };
                }
                let y = _mm512_castsi128_si512(quarter!(0));
                let y = _mm512_inserti32x4::<1>(y, quarter!(1));
                let y = _mm512_inserti32x4::<2>(y, quarter!(2));
                _mm512_inserti32x4::<3>(y, quarter!(3))
            }
        }
    }
    #[inline(always)]
    fn load_u32(self, src: &[u32]) -> __m512i {
        assert!(src.len() >= 16);
        // SAFETY: the token; 16 u32 (64 bytes) are in bounds (asserted).
        unsafe { _mm512_loadu_si512(src.as_ptr().cast()) }
    }
    #[inline(always)]
    fn halves(self, u: __m512i) -> (__m512i, __m512i) {
        // SAFETY: the token.
        unsafe {
            (
                _mm512_and_si512(u, _mm512_set1_epi32(0xffff)),
                _mm512_srli_epi32::<16>(u),
            )
        }
    }
    #[inline(always)]
    fn xor_words(self, a: __m512i, b: __m512i) -> __m512i {
        // SAFETY: the token.
        unsafe { _mm512_xor_si512(a, b) }
    }
    #[inline(always)]
    fn add_noise(self, v: __m512, noise: __m512i) -> __m512 {
        // SAFETY: the token.
        unsafe { _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(v), noise)) }
    }
    #[inline(always)]
    fn clear_low_halves(self, v: __m512) -> __m512 {
        // SAFETY: the token.
        unsafe {
            let high = _mm512_set1_epi32(0xffff_0000_u32 as i32);
            _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), high))
        }
    }
    #[inline(always)]
    fn nan_free(self, v: __m512) -> bool {
        // SAFETY: the token.
        unsafe { _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v, v) == 0 }
    }
    #[inline(always)]
    fn nan_free_both(self, a: __m512, b: __m512) -> bool {
        // SAFETY: the token.
        unsafe { _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(a, b) == 0 }
    }
    #[inline(always)]
    fn quiet_nan_lanes(self, v: __m512, rounded: __m512) -> __m512 {
        // SAFETY: the token.
        unsafe {
            let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v, v);
            let quiet = _mm512_or_si512(_mm512_castps_si512(v), _mm512_set1_epi32(0x0040_0000));
            _mm512_mask_blend_ps(
                nan,
                rounded,
                self.clear_low_halves(_mm512_castsi512_ps(quiet)),
            )
        }
    }
    #[inline(always)]
    fn store_bf16_exact(self, dst: &mut [bf16], v: __m512) {
        assert!(dst.len() >= 16);
        // SAFETY: the token (with BF16 it includes avx512bw, which vpermw
        // needs); 16 bf16 (32 bytes) are in bounds (asserted).
        unsafe {
            let bits = _mm512_castps_si512(v);
            let words = if BF16 {
                // One word permute (BW) picks the high halves.
                _mm512_castsi512_si256(_mm512_permutexvar_epi16(self.high_words(), bits))
            } else {
                _mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(bits))
            };
            _mm256_storeu_si256(dst.as_mut_ptr().cast(), words)
        }
    }
    #[inline(always)]
    fn load_bf16_pair(self, src: &[bf16]) -> (__m512, __m512) {
        assert!(src.len() >= 32);
        // SAFETY: the token (AVX-512F); 32 bf16 (64 bytes) are in bounds (asserted).
        unsafe {
            // Word 2i of the load is element 2i: the low half of lane i.
            let words = _mm512_loadu_si512(src.as_ptr().cast());
            let odd = _mm512_and_si512(words, _mm512_set1_epi32(0xffff_0000_u32 as i32));
            (
                _mm512_castsi512_ps(_mm512_slli_epi32::<16>(words)),
                _mm512_castsi512_ps(odd),
            )
        }
    }
    #[inline(always)]
    fn load_bf16_pair_flushed(self, src: &[bf16]) -> (__m512, __m512) {
        assert!(src.len() >= 32);
        // SAFETY: the token (AVX-512F); 32 bf16 (64 bytes) are in bounds (asserted).
        unsafe {
            // One test per half and the widening zero-masked by it: two
            // instructions more than `load_bf16_pair`, where a flush of
            // each half takes four.
            let words = _mm512_loadu_si512(src.as_ptr().cast());
            let even_normal = _mm512_test_epi32_mask(words, _mm512_set1_epi32(0x7f80));
            let odd_normal = _mm512_test_epi32_mask(words, _mm512_set1_epi32(EXPONENT));
            let high = _mm512_set1_epi32(0xffff_0000_u32 as i32);
            (
                _mm512_castsi512_ps(_mm512_maskz_slli_epi32::<16>(even_normal, words)),
                _mm512_castsi512_ps(_mm512_maskz_and_epi32(odd_normal, words, high)),
            )
        }
    }
    #[inline(always)]
    fn store_bf16_pair_exact(self, dst: &mut [bf16], even: __m512, odd: __m512) {
        assert!(dst.len() >= 32);
        // SAFETY: the token (AVX-512F); 32 bf16 (64 bytes) are in bounds (asserted).
        unsafe {
            // (high & odd) | (!high & even >> 16): the odd lanes' high
            // halves stay, the even lanes' move down (0xca: a ? b : c).
            let high = _mm512_set1_epi32(0xffff_0000_u32 as i32);
            let low = _mm512_srli_epi32::<16>(_mm512_castps_si512(even));
            let words = _mm512_ternarylogic_epi32::<0xca>(high, _mm512_castps_si512(odd), low);
            _mm512_storeu_si512(dst.as_mut_ptr().cast(), words)
        }
    }

    #[inline(always)]
    fn splat(self, x: f32) -> __m512 {
        // SAFETY: the token.
        unsafe { _mm512_set1_ps(x) }
    }
    #[inline(always)]
    fn load(self, src: &[f32]) -> __m512 {
        assert!(src.len() >= 16);
        // SAFETY: the token; 16 f32 are in bounds (asserted).
        unsafe { _mm512_loadu_ps(src.as_ptr()) }
    }
    #[inline(always)]
    fn store(self, dst: &mut [f32], v: __m512) {
        assert!(dst.len() >= 16);
        // SAFETY: the token; 16 f32 are in bounds (asserted).
        unsafe { _mm512_storeu_ps(dst.as_mut_ptr(), v) }
    }
    #[inline(always)]
    fn load_bf16(self, src: &[bf16]) -> __m512 {
        assert!(src.len() >= 16);
        // SAFETY: the token (with BF16 it includes avx512bw, which vpermw
        // needs); 16 bf16 (32 bytes) are in bounds (asserted).
        unsafe {
            let halves = _mm256_loadu_si256(src.as_ptr().cast());
            if BF16 {
                // One word permute (BW) into the high halves, zeros below.
                return _mm512_castsi512_ps(_mm512_permutexvar_epi16(
                    self.to_high_words(),
                    _mm512_zextsi256_si512(halves),
                ));
            }
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(halves)))
        }
    }
    #[inline(always)]
    fn store_bf16(self, dst: &mut [bf16], v: __m512) {
        assert!(dst.len() >= 16);
        // SAFETY: the token; 16 bf16 (32 bytes) are in bounds (asserted).
        unsafe { _mm256_storeu_si256(dst.as_mut_ptr().cast(), self.bf16_words(v)) }
    }
    #[inline(always)]
    fn stream_f32(self, dst: &mut [f32], v: __m512) {
        assert!(dst.len() >= 16 && (dst.as_ptr() as usize).is_multiple_of(64));
        // SAFETY: the token; 64 bytes in bounds, 64-byte aligned (asserted) for vmovntps.
        unsafe { _mm512_stream_ps(dst.as_mut_ptr(), v) }
    }
    #[inline(always)]
    fn stream_bf16(self, dst: &mut [bf16], v: __m512) {
        assert!(dst.len() >= 16 && (dst.as_ptr() as usize).is_multiple_of(32));
        // SAFETY: the token; 32 bytes in bounds, 32-byte aligned (asserted) for vmovntdq.
        unsafe { _mm256_stream_si256(dst.as_mut_ptr().cast(), self.bf16_words(v)) }
    }
    #[inline(always)]
    fn load_f16(self, src: &[f16]) -> __m512 {
        assert!(src.len() >= 16);
        // SAFETY: the token; 16 f16 (32 bytes) are in bounds (asserted).
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(src.as_ptr().cast())) }
    }
    #[inline(always)]
    fn store_f16(self, dst: &mut [f16], v: __m512) {
        assert!(dst.len() >= 16);
        // SAFETY: the token; 16 f16 (32 bytes) are in bounds (asserted).
        unsafe {
            _mm256_storeu_si256(
                dst.as_mut_ptr().cast(),
                _mm512_cvtps_ph::<AVX512_NEAREST_EVEN>(v),
            )
        }
    }
    #[inline(always)]
    fn stream_f16(self, dst: &mut [f16], v: __m512) {
        assert!(dst.len() >= 16 && (dst.as_ptr() as usize).is_multiple_of(32));
        // SAFETY: the token; 32 bytes in bounds, 32-byte aligned (asserted) for vmovntdq.
        unsafe {
            _mm256_stream_si256(
                dst.as_mut_ptr().cast(),
                _mm512_cvtps_ph::<AVX512_NEAREST_EVEN>(v),
            )
        }
    }
    #[inline(always)]
    fn fence(self) {
        // SAFETY: sfence has no preconditions (SSE, part of the token).
        unsafe { _mm_sfence() }
    }
    #[inline(always)]
    fn add(self, a: __m512, b: __m512) -> __m512 {
        // SAFETY: the token.
        unsafe { _mm512_add_ps(a, b) }
    }
    #[inline(always)]
    fn sub(self, a: __m512, b: __m512) -> __m512 {
        // SAFETY: the token.
        unsafe { _mm512_sub_ps(a, b) }
    }
    #[inline(always)]
    fn mul(self, a: __m512, b: __m512) -> __m512 {
        // SAFETY: the token.
        unsafe { _mm512_mul_ps(a, b) }
    }
    #[inline(always)]
    fn div(self, a: __m512, b: __m512) -> __m512 {
        // SAFETY: the token.
        unsafe { _mm512_div_ps(a, b) }
    }
    #[inline(always)]
    fn sqrt(self, a: __m512) -> __m512 {
        // SAFETY: the token.
        unsafe { _mm512_sqrt_ps(a) }
    }
    #[inline(always)]
    fn mul_add(self, a: __m512, b: __m512, c: __m512) -> __m512 {
        // SAFETY: the token.
        unsafe { _mm512_fmadd_ps(a, b, c) }
    }
    #[inline(always)]
    fn flush_subnormal(self, a: __m512) -> __m512 {
        // SAFETY: the token.
        unsafe {
            let normal =
                _mm512_test_epi32_mask(_mm512_castps_si512(a), _mm512_set1_epi32(EXPONENT));
            _mm512_maskz_mov_ps(normal, a)
        }
    }
    #[inline(always)]
    fn sign(self, a: __m512) -> __m512 {
        // SAFETY: the token.
        unsafe {
            let zero = _mm512_setzero_ps();
            let positive = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(a, zero);
            let negative = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(a, zero);
            let r = _mm512_mask_blend_ps(positive, a, _mm512_set1_ps(1.0));
            _mm512_mask_blend_ps(negative, r, _mm512_set1_ps(-1.0))
        }
    }
    #[inline(always)]
    fn acc_zero(self) -> Self::Acc {
        // SAFETY: the token.
        unsafe { (_mm512_setzero_pd(), _mm512_setzero_pd()) }
    }
    #[inline(always)]
    fn acc_add_square(self, acc: Self::Acc, v: __m512) -> Self::Acc {
        // SAFETY: the token.
        unsafe {
            let low = _mm512_cvtps_pd(_mm512_castps512_ps256(v));
            let high_bits = _mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v));
            let high = _mm512_cvtps_pd(_mm256_castpd_ps(high_bits));
            (
                _mm512_fmadd_pd(low, low, acc.0),
                _mm512_fmadd_pd(high, high, acc.1),
            )
        }
    }
    #[inline(always)]
    fn acc_sum(self, acc: Self::Acc) -> f64 {
        // SAFETY: the token.
        unsafe { _mm512_reduce_add_pd(_mm512_add_pd(acc.0, acc.1)) }
    }
}

/// Asks for the cache line holding `at` in every cache level.
#[inline(always)]
pub(super) fn prefetch(at: *const i8) {
    // SAFETY: a prefetch is a hint that never faults, whatever the address;
    // SSE is part of every x86_64 CPU.
    unsafe { _mm_prefetch::<_MM_HINT_T0>(at) }
}
