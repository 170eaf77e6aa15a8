//! Every fp32 bit pattern through every narrowing path, and every 16-bit
//! pattern through every widening path, bit-exact against the `half` crate
//! (round to nearest even; NaN stays NaN with its quiet bit set; subnormals
//! kept, not flushed). Widening bf16 is a bit shift, fp16 is `half`'s.

use strata_optim::{Isa, LowPrecisionMut, Values, bf16, f16, narrow, widen};

/// fp32 patterns per batch: big enough to amortize dispatch, small enough
/// to stay in cache.
const BATCH: u32 = 1 << 16;

fn narrow_all_patterns_matches_half(isa: Isa, to_bf16: bool) {
    let mut source = vec![0f32; BATCH as usize];
    let mut bf = vec![bf16::ZERO; BATCH as usize];
    let mut fp = vec![f16::ZERO; BATCH as usize];
    // Odd lengths as well, so tails are covered: the last batch is cut short.
    for start in (0..=u32::MAX).step_by(BATCH as usize) {
        let len = if start == u32::MAX - BATCH + 1 {
            BATCH as usize - 13
        } else {
            BATCH as usize
        };
        for (i, x) in source[..len].iter_mut().enumerate() {
            *x = f32::from_bits(start + i as u32);
        }
        if to_bf16 {
            narrow(isa, &source[..len], LowPrecisionMut::Bf16(&mut bf[..len]));
            for (x, y) in source[..len].iter().zip(&bf[..len]) {
                let expected = bf16::from_f32(*x);
                assert_eq!(
                    y.to_bits(),
                    expected.to_bits(),
                    "{isa} bf16 of {:#010x}",
                    x.to_bits()
                );
            }
        } else {
            narrow(isa, &source[..len], LowPrecisionMut::F16(&mut fp[..len]));
            for (x, y) in source[..len].iter().zip(&fp[..len]) {
                let expected = f16::from_f32(*x);
                assert_eq!(
                    y.to_bits(),
                    expected.to_bits(),
                    "{isa} f16 of {:#010x}",
                    x.to_bits()
                );
            }
        }
    }
}

#[test]
fn bf16_narrowing_is_bit_exact_on_every_fp32_pattern() {
    for isa in Isa::available() {
        narrow_all_patterns_matches_half(isa, true);
    }
}

#[test]
fn f16_narrowing_is_bit_exact_on_every_fp32_pattern() {
    for isa in Isa::available() {
        narrow_all_patterns_matches_half(isa, false);
    }
}

#[test]
fn widening_is_exact_on_every_16_bit_pattern() {
    let bf: Vec<bf16> = (0..=u16::MAX).map(bf16::from_bits).collect();
    let fp: Vec<f16> = (0..=u16::MAX).map(f16::from_bits).collect();
    let mut out = vec![0f32; bf.len()];
    for isa in Isa::available() {
        widen(isa, Values::Bf16(&bf), &mut out);
        for (x, y) in bf.iter().zip(&out) {
            // A bit shift, as PyTorch widens bf16 (half's to_f32 would
            // quiet signaling NaNs).
            let expected = u32::from(x.to_bits()) << 16;
            assert_eq!(y.to_bits(), expected, "{isa} bf16 {:#06x}", x.to_bits());
        }
        widen(isa, Values::F16(&fp), &mut out);
        for (x, y) in fp.iter().zip(&out) {
            assert_eq!(
                y.to_bits(),
                x.to_f32().to_bits(),
                "{isa} f16 {:#06x}",
                x.to_bits()
            );
        }
    }
}
