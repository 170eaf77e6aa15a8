//! The out-of-place step (the engine's: one state set read, the other
//! written, streamed past the caches when large) against the in-place one,
//! bit for bit, at any alignment, on every instruction set and thread count.

mod common;

use common::PageAligned;
use strata_optim::{
    AdamCoefficients, AdamConfig, Isa, LowPrecisionMut, Master, Moments, MomentsRef,
    OutOfPlaceShard, Pool, PoolConfig, Rounding, Values, adam_step_out_of_place, adam_step_rounded,
    bf16,
};

fn value(i: usize, salt: usize, scale: f32) -> f32 {
    (((i * 2_654_435_761 + salt * 97) % 2001) as f32 / 1000.0 - 1.0) * scale
}

/// In place and out of place from the same inputs, `offset` elements into
/// page-aligned buffers (so the heads differ); bf16 moments when `bf16`.
fn compare(isa: Isa, len: usize, offset: usize, bf16_moments: bool, rounding: Rounding) {
    let n = len + offset;
    let p: Vec<f32> = (0..n).map(|i| value(i, 1, 1.0)).collect();
    let g: Vec<bf16> = (0..n).map(|i| bf16::from_f32(value(i, 2, 1e-2))).collect();
    let m: Vec<f32> = (0..n).map(|i| value(i, 3, 1e-3)).collect();
    let v: Vec<f32> = (0..n).map(|i| value(i, 4, 1e-6).abs()).collect();
    let c = AdamConfig::adamw(1e-3).coefficients(3, 0.5).unwrap();
    let r = offset..n;
    // In place.
    let (mut p1, mut m1, mut v1) = (p.clone(), m.clone(), v.clone());
    let (mut mb1, mut vb1): (Vec<bf16>, Vec<bf16>) = (
        m.iter().map(|&x| bf16::from_f32(x)).collect(),
        v.iter().map(|&x| bf16::from_f32(x)).collect(),
    );
    let mut out1 = vec![bf16::ZERO; n];
    let moments = if bf16_moments {
        Moments::Bf16 {
            m: &mut mb1[r.clone()],
            v: &mut vb1[r.clone()],
        }
    } else {
        Moments::F32 {
            m: &mut m1[r.clone()],
            v: &mut v1[r.clone()],
        }
    };
    adam_step_rounded(
        isa,
        &c,
        &mut p1[r.clone()],
        Values::Bf16(&g[r.clone()]),
        moments,
        Some(LowPrecisionMut::Bf16(&mut out1[r.clone()])),
        rounding,
    );
    // Out of place, from untouched inputs into fresh buffers.
    let (mb, vb): (Vec<bf16>, Vec<bf16>) = (
        m.iter().map(|&x| bf16::from_f32(x)).collect(),
        v.iter().map(|&x| bf16::from_f32(x)).collect(),
    );
    let (mut p2, mut m2, mut v2) = (vec![0.0; n], vec![0.0; n], vec![0.0; n]);
    let (mut mb2, mut vb2) = (vec![bf16::ZERO; n], vec![bf16::ZERO; n]);
    let mut out2 = vec![bf16::ZERO; n];
    let (moments_in, moments_out) = if bf16_moments {
        (
            MomentsRef::Bf16 {
                m: &mb[r.clone()],
                v: &vb[r.clone()],
            },
            Moments::Bf16 {
                m: &mut mb2[r.clone()],
                v: &mut vb2[r.clone()],
            },
        )
    } else {
        (
            MomentsRef::F32 {
                m: &m[r.clone()],
                v: &v[r.clone()],
            },
            Moments::F32 {
                m: &mut m2[r.clone()],
                v: &mut v2[r.clone()],
            },
        )
    };
    adam_step_out_of_place(
        isa,
        &c,
        &p[r.clone()],
        moments_in,
        Values::Bf16(&g[r.clone()]),
        &mut p2[r.clone()],
        moments_out,
        Some(LowPrecisionMut::Bf16(&mut out2[r.clone()])),
        rounding,
    );
    let what = format!("{isa} len {len} offset {offset} bf16 moments {bf16_moments}");
    assert!(p1[r.clone()] == p2[r.clone()], "params differ: {what}");
    assert!(out1[r.clone()] == out2[r.clone()], "copies differ: {what}");
    if bf16_moments {
        assert!(
            mb1[r.clone()] == mb2[r.clone()] && vb1[r.clone()] == vb2[r.clone()],
            "{what}"
        );
    } else {
        assert!(
            m1[r.clone()] == m2[r.clone()] && v1[r.clone()] == v2[r],
            "moments differ: {what}"
        );
    }
}

/// [`adam_step_out_of_place`] over `r` of masters `p` and bf16 m, v and
/// gradients, into masters `p2`, bf16 m, v and the bf16 copy.
fn step_bf16_range<P: Master>(
    isa: Isa,
    coefficients: &AdamCoefficients,
    (p, [m, v, g]): (&[P], [&[bf16]; 3]),
    (p2, [m2, v2, out]): (&mut [P], [&mut [bf16]; 3]),
    r: std::ops::Range<usize>,
    rounding: Rounding,
) {
    adam_step_out_of_place(
        isa,
        coefficients,
        &p[r.clone()],
        MomentsRef::Bf16 {
            m: &m[r.clone()],
            v: &v[r.clone()],
        },
        Values::Bf16(&g[r.clone()]),
        &mut p2[r.clone()],
        Moments::Bf16 {
            m: &mut m2[r.clone()],
            v: &mut v2[r.clone()],
        },
        Some(LowPrecisionMut::Bf16(&mut out[r.clone()])),
        rounding,
    );
}

#[test]
fn out_of_place_matches_in_place_bit_for_bit() {
    let stochastic = Rounding::Stochastic {
        seed: 4,
        step: 3,
        first: 1 << 20,
    };
    for isa in Isa::available() {
        for len in [0, 1, 15, 16, 17, 1000, 4099] {
            for offset in [0, 1, 3, 8] {
                compare(isa, len, offset, false, Rounding::Nearest);
                compare(isa, len, offset, true, Rounding::Nearest);
                compare(isa, len, offset, true, stochastic);
            }
        }
        // Long enough for the streamed (non-temporal) path, aligned and
        // misaligned (each output then streams from its own first aligned
        // vector).
        for offset in [0, 5] {
            compare(isa, (1 << 21) + 37, offset, false, Rounding::Nearest);
        }
        compare(isa, (1 << 21) + 37, 0, true, stochastic);
    }
}

#[test]
fn the_pool_splits_the_out_of_place_step_without_changing_it() {
    let n = (1 << 17) + 11;
    let run = |threads| {
        let pool = Pool::new(PoolConfig {
            threads: Some(threads),
            pin: false,
            parallel_elems_min: 1024,
            piece_elems_min: 1024,
            isa: None,
        })
        .unwrap();
        let p: Vec<f32> = (0..n).map(|i| value(i, 1, 1.0)).collect();
        let g: Vec<f32> = (0..n).map(|i| value(i, 2, 1e-2)).collect();
        let m: Vec<f32> = (0..n).map(|i| value(i, 3, 1e-3)).collect();
        let v: Vec<f32> = (0..n).map(|i| value(i, 4, 1e-6).abs()).collect();
        let (mut p2, mut m2, mut v2) = (vec![0.0; n], vec![0.0; n], vec![0.0; n]);
        let c = AdamConfig::adamw(1e-3).coefficients(1, 1.0).unwrap();
        pool.adam_step_out_of_place(
            &c,
            &p,
            MomentsRef::F32 { m: &m, v: &v },
            Values::F32(&g),
            &mut p2,
            Moments::F32 {
                m: &mut m2,
                v: &mut v2,
            },
            None,
            Rounding::Nearest,
        );
        (p2, m2, v2)
    };
    let one = run(1);
    assert!(one == run(2) && one == run(4));
}

/// bf16 masters (state dtype (b)) out of place: the same bits as the
/// in-place bf16-master step, and the 16-bit copy equal to the master.
#[test]
fn bf16_masters_out_of_place_match_in_place_and_their_copy() {
    let stochastic = Rounding::Stochastic {
        seed: 9,
        step: 7,
        first: 3 << 30,
    };
    let c = AdamConfig::adamw(1e-3).coefficients(7, 1.0).unwrap();
    for isa in Isa::available() {
        for (len, offset) in [(1, 0), (17, 3), (4099, 1), ((1 << 21) + 37, 0)] {
            let n = len + offset;
            let r = offset..n;
            let bf = |salt, scale: f32| -> Vec<bf16> {
                (0..n)
                    .map(|i| bf16::from_f32(value(i, salt, scale)))
                    .collect()
            };
            let (p, g, m) = (bf(1, 1.0), bf(2, 1e-2), bf(3, 1e-3));
            let v: Vec<bf16> = bf(4, 1e-6)
                .iter()
                .map(|x| bf16::from_f32(x.to_f32().abs()))
                .collect();
            let (mut p1, mut m1, mut v1) = (p.clone(), m.clone(), v.clone());
            strata_optim::adam_step_bf16_master(
                isa,
                &c,
                &mut p1[r.clone()],
                Values::Bf16(&g[r.clone()]),
                Moments::Bf16 {
                    m: &mut m1[r.clone()],
                    v: &mut v1[r.clone()],
                },
                stochastic,
            );
            let (mut p2, mut m2, mut v2) = (
                vec![bf16::ZERO; n],
                vec![bf16::ZERO; n],
                vec![bf16::ZERO; n],
            );
            let mut out = vec![bf16::ZERO; n];
            step_bf16_range(
                isa,
                &c,
                (&p, [&m, &v, &g]),
                (&mut p2, [&mut m2, &mut v2, &mut out]),
                r.clone(),
                stochastic,
            );
            let what = format!("{isa} len {len} offset {offset}");
            assert!(p1[r.clone()] == p2[r.clone()], "masters differ: {what}");
            assert!(
                m1[r.clone()] == m2[r.clone()] && v1[r.clone()] == v2[r.clone()],
                "moments differ: {what}"
            );
            assert!(
                out[r.clone()] == p2[r.clone()],
                "copy differs from the master: {what}"
            );
            // A step moves a bf16 master by a fraction of a place: some
            // of a long run must have moved.
            assert!(
                len < 1000 || p2[r].iter().zip(&p[offset..]).any(|(a, b)| a != b),
                "nothing moved: {what}"
            );
        }
    }
}

/// The engine's form: one update walked as many stretches (host chunks),
/// runs of them with other coefficients, in one pool call. The same bits
/// as one call per stretch on the calling thread, though the call streams
/// its outputs by its whole length and cuts pieces across stretches.
#[test]
fn many_stretches_in_one_pool_call_match_one_call_per_stretch() {
    let n = (1 << 21) + 37;
    // Stretches of uneven lengths, as chunk boundaries of the tensors
    // make them; every third one not weight-decayed.
    let mut cuts = vec![0];
    while *cuts.last().unwrap() < n {
        let at = *cuts.last().unwrap();
        cuts.push((at + 50_000 + (at * 7) % 30_011).min(n));
    }
    let decayed = AdamConfig::adamw(1e-3).coefficients(5, 0.5).unwrap();
    let plain = AdamConfig {
        weight_decay: 0.0,
        ..AdamConfig::adamw(1e-3)
    }
    .coefficients(5, 0.5)
    .unwrap();
    let coefficients = |k: usize| if k % 3 == 2 { &plain } else { &decayed };
    let p: Vec<f32> = (0..n).map(|i| value(i, 1, 1.0)).collect();
    let g: Vec<bf16> = (0..n).map(|i| bf16::from_f32(value(i, 2, 1e-2))).collect();
    let m: Vec<bf16> = (0..n).map(|i| bf16::from_f32(value(i, 3, 1e-3))).collect();
    let v: Vec<bf16> = (0..n)
        .map(|i| bf16::from_f32(value(i, 4, 1e-6).abs()))
        .collect();
    let first = 1u64 << 33;
    let rounding = |at: usize| Rounding::Stochastic {
        seed: 3,
        step: 5,
        first: first + at as u64,
    };
    // Outputs a few elements past page boundaries, each by another count
    // (as a group's master, m and v lie in one state set), so that each
    // streams after a head of its own.
    let outputs = || {
        (
            PageAligned::new(n, 0, 0.0f32),
            PageAligned::new(n, 3, bf16::ZERO),
            PageAligned::new(n, 5, bf16::ZERO),
            PageAligned::new(n, 7, bf16::ZERO),
        )
    };
    let isa = Isa::chosen();
    let mut expected = outputs();
    {
        let (p2, m2, v2, out) = &mut expected;
        let (p2, m2, v2, out) = (p2.get_mut(), m2.get_mut(), v2.get_mut(), out.get_mut());
        for (k, w) in cuts.windows(2).enumerate() {
            let r = w[0]..w[1];
            step_bf16_range(
                isa,
                coefficients(k),
                (&p, [&m, &v, &g]),
                (p2, [m2, v2, out]),
                r.clone(),
                rounding(r.start),
            );
        }
    }
    for threads in [1, 2, 3] {
        let pool = Pool::new(PoolConfig {
            threads: Some(threads),
            pin: false,
            ..PoolConfig::default()
        })
        .unwrap();
        let mut got = outputs();
        let (p2, m2, v2, out) = &mut got;
        let mut shards = Vec::new();
        let (mut p_rest, mut m_rest, mut v_rest, mut out_rest) =
            (p2.get_mut(), m2.get_mut(), v2.get_mut(), out.get_mut());
        for (k, w) in cuts.windows(2).enumerate() {
            let (r, len) = (w[0]..w[1], w[1] - w[0]);
            let (p_here, p_next) = std::mem::take(&mut p_rest).split_at_mut(len);
            let (m_here, m_next) = std::mem::take(&mut m_rest).split_at_mut(len);
            let (v_here, v_next) = std::mem::take(&mut v_rest).split_at_mut(len);
            let (out_here, out_next) = std::mem::take(&mut out_rest).split_at_mut(len);
            (p_rest, m_rest, v_rest, out_rest) = (p_next, m_next, v_next, out_next);
            shards.push(OutOfPlaceShard {
                coefficients: coefficients(k),
                params_in: &p[r.clone()],
                moments_in: MomentsRef::Bf16 {
                    m: &m[r.clone()],
                    v: &v[r.clone()],
                },
                grads: Values::Bf16(&g[r.clone()]),
                params_out: p_here,
                moments_out: Moments::Bf16 {
                    m: m_here,
                    v: v_here,
                },
                out: Some(LowPrecisionMut::Bf16(out_here)),
                rounding: rounding(r.start),
            });
        }
        pool.adam_step_out_of_place_many(shards);
        assert!(got == expected, "{threads} threads");
    }
}
