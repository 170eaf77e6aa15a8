//! bf16 moments with stochastic rounding: the second moment follows its
//! exact value where round-to-nearest freezes it, and the result does not
//! depend on the thread count, the split or the instruction set's vector
//! width.

use strata_optim::{
    AdamConfig, Isa, Moments, Pool, PoolConfig, Rounding, Values, adam_step_bf16_master,
    adam_step_rounded, bf16,
};

const N: usize = 4096;

/// Mean of v over all elements after each phase of `steps` steps of a
/// constant gradient 1, then as many of gradient 0; and the f64 EMA.
fn v_track(rounding: impl Fn(u64) -> Rounding, steps: u64) -> Vec<(f64, f64)> {
    let isa = Isa::chosen();
    let config = AdamConfig::adamw(1e-6);
    let mut params = vec![0.0f32; N];
    let (mut m, mut v) = (vec![bf16::ZERO; N], vec![bf16::ZERO; N]);
    let (ones, zeros) = (vec![1.0f32; N], vec![0.0f32; N]);
    let mut exact = 0.0f64;
    let mut checkpoints = Vec::new();
    for step in 1..=2 * steps {
        let g = if step <= steps { 1.0 } else { 0.0 };
        exact = 0.999 * exact + 0.001 * g * g;
        let coefficients = config.coefficients(step, 1.0).unwrap();
        let grads = if step <= steps { &ones } else { &zeros };
        adam_step_rounded(
            isa,
            &coefficients,
            &mut params,
            Values::F32(grads),
            Moments::Bf16 {
                m: &mut m,
                v: &mut v,
            },
            None,
            rounding(step),
        );
        if step % 500 == 0 {
            let mean = v.iter().map(|x| f64::from(x.to_f32())).sum::<f64>() / N as f64;
            checkpoints.push((mean, exact));
        }
    }
    checkpoints
}

#[test]
fn the_second_moment_tracks_its_exact_ema_for_5000_steps_where_nearest_freezes() {
    let stochastic = v_track(
        |step| Rounding::Stochastic {
            seed: 3,
            step,
            first: 0,
        },
        2500,
    );
    for (i, (mean, exact)) in stochastic.iter().enumerate() {
        let error = (mean - exact).abs() / exact;
        assert!(
            error < 0.01,
            "stochastic rounding: after {} steps mean v {mean} against {exact} ({error})",
            (i + 1) * 500
        );
    }
    // The same run rounded to nearest stalls: the test can tell.
    let nearest = v_track(|_| Rounding::Nearest, 2500);
    let worst = nearest
        .iter()
        .map(|(mean, exact)| (mean - exact).abs() / exact)
        .fold(0.0, f64::max);
    assert!(
        worst > 0.2,
        "round to nearest followed the EMA within {worst}"
    );
}

/// Parameters, m and v.
type States = (Vec<f32>, Vec<bf16>, Vec<bf16>);

/// One AdamW step over `n` elements with bf16 moments, rounded
/// stochastically, on `pool`; the states after it.
fn step_on(pool: &Pool, n: usize, first: u64) -> States {
    let mut params: Vec<f32> = (0..n).map(|i| ((i % 97) as f32 - 48.0) * 1e-2).collect();
    let grads: Vec<f32> = (0..n).map(|i| ((i % 89) as f32 - 44.0) * 1e-3).collect();
    let mut m: Vec<bf16> = (0..n)
        .map(|i| bf16::from_f32((i % 13) as f32 * 1e-3))
        .collect();
    let mut v: Vec<bf16> = (0..n)
        .map(|i| bf16::from_f32((i % 7) as f32 * 1e-5))
        .collect();
    let coefficients = AdamConfig::adamw(1e-3).coefficients(11, 1.0).unwrap();
    pool.adam_step_rounded(
        &coefficients,
        &mut params,
        Values::F32(&grads),
        Moments::Bf16 {
            m: &mut m,
            v: &mut v,
        },
        None,
        Rounding::Stochastic {
            seed: 5,
            step: 11,
            first,
        },
    );
    (params, m, v)
}

#[test]
fn results_do_not_depend_on_threads_or_split() {
    let n = (1 << 16) + 37;
    let pool = |threads| {
        Pool::new(PoolConfig {
            threads: Some(threads),
            pin: false,
            parallel_elems_min: 1024,
            piece_elems_min: 1024,
            isa: None,
        })
        .unwrap()
    };
    let one = step_on(&pool(1), n, 1000);
    let two = step_on(&pool(2), n, 1000);
    let three = step_on(&pool(3), n, 1000);
    assert!(
        one == two && one == three,
        "thread count changed the result"
    );
    // A different first index draws other bits.
    let moved = step_on(&pool(1), n, 1001);
    assert_ne!(one.2, moved.2);
}

#[test]
fn every_isa_agrees_within_one_bf16_place() {
    // Instruction sets differ in FMA (the portable one rounds twice), so
    // an f32 value may differ in its last bits, and its rounding by one
    // place; the random bits are the same.
    let n = 10_000;
    let results: Vec<(Isa, States)> = Isa::available()
        .into_iter()
        .map(|isa| {
            let pool = Pool::new(PoolConfig {
                threads: Some(1),
                pin: false,
                parallel_elems_min: usize::MAX,
                piece_elems_min: strata_optim::PIECE_ELEMS_MIN,
                isa: Some(isa),
            })
            .unwrap();
            (isa, step_on(&pool, n, 77))
        })
        .collect();
    let (_, reference) = &results[0];
    for (isa, result) in &results[1..] {
        for (what, a, b) in [
            ("m", &reference.1, &result.1),
            ("v", &reference.2, &result.2),
        ] {
            for (i, (x, y)) in a.iter().zip(b.iter()).enumerate() {
                let places = (i32::from(x.to_bits() as i16) - i32::from(y.to_bits() as i16)).abs();
                assert!(places <= 1, "{isa} {what}[{i}]: {x} against {y}");
            }
        }
    }
}

/// Mean parameter over `N` elements after `steps` steps of gradient 1 on
/// bf16 masters rounded as `rounding(step)` says, and on fp32 masters.
fn master_drift(rounding: impl Fn(u64) -> Rounding, steps: u64) -> (f64, f64) {
    let isa = Isa::chosen();
    // Each step moves a parameter of 1.0 by about lr = 1e-4, an eighth
    // of bf16's spacing at 1 (2^-7): to nearest, nothing ever moves.
    let config = AdamConfig {
        weight_decay: 0.0,
        ..AdamConfig::adamw(1e-4)
    };
    let grads = vec![1.0f32; N];
    let mut master = vec![bf16::ONE; N];
    let mut master32 = vec![1.0f32; N];
    let (mut m, mut v) = (vec![bf16::ZERO; N], vec![bf16::ZERO; N]);
    let (mut m32, mut v32) = (vec![0.0f32; N], vec![0.0f32; N]);
    for step in 1..=steps {
        let coefficients = config.coefficients(step, 1.0).unwrap();
        strata_optim::adam_step_bf16_master(
            isa,
            &coefficients,
            &mut master,
            Values::F32(&grads),
            Moments::Bf16 {
                m: &mut m,
                v: &mut v,
            },
            rounding(step),
        );
        strata_optim::adam_step(
            isa,
            &coefficients,
            &mut master32,
            Values::F32(&grads),
            Moments::F32 {
                m: &mut m32,
                v: &mut v32,
            },
            None,
        );
    }
    let mean = master.iter().map(|x| f64::from(x.to_f32())).sum::<f64>() / N as f64;
    (mean, f64::from(master32[0]))
}

#[test]
fn bf16_masters_rounded_stochastically_follow_updates_below_half_a_place() {
    let (mean, exact) = master_drift(
        |step| Rounding::Stochastic {
            seed: 8,
            step,
            first: 0,
        },
        1000,
    );
    // 1000 steps of about 1e-4: the parameter falls by about 0.1.
    let moved = 1.0 - exact;
    assert!(moved > 0.09, "fp32 masters moved {moved}");
    let error = ((1.0 - mean) - moved).abs() / moved;
    assert!(
        error < 0.02,
        "bf16 masters moved {} against {moved}",
        1.0 - mean
    );
    let (nearest, _) = master_drift(|_| Rounding::Nearest, 1000);
    assert_eq!(
        nearest, 1.0,
        "to nearest, an eighth of a place is lost every step"
    );
}

#[test]
fn bf16_masters_do_not_depend_on_threads() {
    let n = (1 << 16) + 5;
    let run = |threads| {
        let pool = Pool::new(PoolConfig {
            threads: Some(threads),
            pin: false,
            parallel_elems_min: 1024,
            piece_elems_min: 1024,
            isa: None,
        })
        .unwrap();
        let mut master: Vec<bf16> = (0..n).map(|i| bf16::from_f32(i as f32 * 1e-4)).collect();
        let grads: Vec<bf16> = (0..n)
            .map(|i| bf16::from_f32(((i % 31) as f32 - 15.0) * 1e-2))
            .collect();
        let (mut m, mut v) = (vec![bf16::ZERO; n], vec![bf16::ZERO; n]);
        for step in 1..=3 {
            let coefficients = AdamConfig::adamw(1e-3).coefficients(step, 1.0).unwrap();
            pool.adam_step_bf16_master(
                &coefficients,
                &mut master,
                Values::Bf16(&grads),
                Moments::Bf16 {
                    m: &mut m,
                    v: &mut v,
                },
                Rounding::Stochastic {
                    seed: 2,
                    step,
                    first: 40,
                },
            );
        }
        (master, m, v)
    };
    let one = run(1);
    assert!(
        one == run(2) && one == run(3),
        "thread count changed the result"
    );
}

/// What a value is: NaN, an infinity (with its sign), or finite.
fn class(x: f32) -> &'static str {
    if x.is_nan() {
        "NaN"
    } else if x == f32::INFINITY {
        "+inf"
    } else if x == f32::NEG_INFINITY {
        "-inf"
    } else {
        "finite"
    }
}

#[test]
fn non_finite_values_stay_what_they_are_on_every_isa() {
    // The vector paths check a whole vector for NaN once and then add the
    // noise unchecked; a NaN whose payload fills the mantissa would carry
    // into the exponent and sign (becoming a zero or an infinity) if a NaN
    // got through. Every element must come out as the scalar reference has
    // it, with bf16 moments (fp32 masters) and with bf16 masters.
    let n = 203;
    let specials = [
        f32::from_bits(0x7fff_ffff),
        f32::from_bits(0xffff_ffff),
        f32::from_bits(0x7f80_0001),
        f32::from_bits(0x7fc0_ffff),
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::MAX,
        -3.3e38,
    ];
    let mut grads: Vec<f32> = (0..n).map(|i| ((i % 31) as f32 - 15.0) * 1e-3).collect();
    for (k, x) in specials.iter().enumerate() {
        // In heads, bodies and tails, alone and beside each other.
        for at in [k, 17 + k * 13, n - 1 - k, 100 + k] {
            grads[at] = *x;
        }
    }
    let m0: Vec<bf16> = (0..n)
        .map(|i| match i {
            60 => bf16::from_bits(0x7fff),
            61 => bf16::INFINITY,
            _ => bf16::from_f32((i % 13) as f32 * 1e-3),
        })
        .collect();
    let v0: Vec<bf16> = (0..n)
        .map(|i| match i {
            70 => bf16::from_bits(0xffff),
            71 => bf16::INFINITY,
            _ => bf16::from_f32((i % 7) as f32 * 1e-5),
        })
        .collect();
    let coefficients = AdamConfig::adamw(1e-3).coefficients(3, 1.0).unwrap();
    let rounding = Rounding::Stochastic {
        seed: 8,
        step: 3,
        first: 11,
    };
    let run = |isa: Isa| {
        let (mut p, mut m, mut v) = (
            (0..n).map(|i| (i % 5) as f32 - 2.0).collect::<Vec<f32>>(),
            m0.clone(),
            v0.clone(),
        );
        adam_step_rounded(
            isa,
            &coefficients,
            &mut p,
            Values::F32(&grads),
            Moments::Bf16 {
                m: &mut m,
                v: &mut v,
            },
            None,
            rounding,
        );
        let (mut master, mut m2, mut v2) = (
            (0..n)
                .map(|i| bf16::from_f32((i % 5) as f32 - 2.0))
                .collect::<Vec<bf16>>(),
            m0.clone(),
            v0.clone(),
        );
        adam_step_bf16_master(
            isa,
            &coefficients,
            &mut master,
            Values::F32(&grads),
            Moments::Bf16 {
                m: &mut m2,
                v: &mut v2,
            },
            rounding,
        );
        let widen = |x: &[bf16]| x.iter().map(|x| x.to_f32()).collect::<Vec<f32>>();
        [
            p,
            widen(&m),
            widen(&v),
            widen(&master),
            widen(&m2),
            widen(&v2),
        ]
    };
    let reference = run(Isa::Portable);
    let nans = reference[1].iter().filter(|x| x.is_nan()).count();
    assert!(nans >= 4 * specials.len() / 2, "{nans} NaN moments");
    for isa in Isa::available() {
        let result = run(isa);
        for (what, (a, b)) in ["params", "m", "v", "masters", "m (masters)", "v (masters)"]
            .iter()
            .zip(reference.iter().zip(&result))
        {
            for (i, (x, y)) in a.iter().zip(b).enumerate() {
                assert_eq!(
                    class(*x),
                    class(*y),
                    "{isa} {what}[{i}]: {y} against the reference's {x} (gradient {})",
                    grads[i]
                );
            }
        }
    }
}

/// bf16 masters with bf16 gradients take the pair path (even- and
/// odd-numbered elements in two vectors); fp32 gradients holding the same
/// values take the single-vector path. Both must write the same bits, NaN
/// payloads included, at lengths, offsets and first indices around vector,
/// pair and 2^32 boundaries, on every instruction set.
#[test]
fn bf16_pairs_write_what_single_vectors_write_bit_for_bit() {
    let specials = [
        f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        0.0,
        -0.0,
        // bf16 subnormals, and bf16's largest finite.
        f32::from_bits(0x0001_0000),
        f32::from_bits(0x807f_0000),
        f32::from_bits(0x7f7f_0000),
        1e30,
    ];
    let value = |i: usize, salt: u32| -> f32 {
        let x = strata_optim::bf16::from_f32(
            (((i as u32).wrapping_mul(2_654_435_761) ^ salt) % 2000) as f32 * 1e-3 - 1.0,
        );
        x.to_f32()
    };
    let config = AdamConfig::adamw(1e-2);
    for isa in Isa::available() {
        for len in [
            0usize, 1, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100, 257, 1000,
        ] {
            for offset in [0usize, 1, 8, 16, 17] {
                for first in [0u64, 77, (1 << 32) - 40, (1 << 32) - 16] {
                    let n = offset + len;
                    let mut grads: Vec<bf16> =
                        (0..n).map(|i| bf16::from_f32(value(i, 1) * 0.1)).collect();
                    let mut p: Vec<bf16> = (0..n).map(|i| bf16::from_f32(value(i, 2))).collect();
                    let mut m: Vec<bf16> =
                        (0..n).map(|i| bf16::from_f32(value(i, 3) * 1e-2)).collect();
                    let mut v: Vec<bf16> = (0..n)
                        .map(|i| bf16::from_f32(value(i, 4).abs() * 1e-4))
                        .collect();
                    // Every special in every stream (v's NaN and infinity
                    // included), in the slice at an even and at an odd
                    // distance from its start, so that each lands in both
                    // halves of a pair wherever the pairs begin.
                    for (k, x) in specials.iter().enumerate() {
                        for (j, stream) in
                            [&mut grads, &mut p, &mut m, &mut v].into_iter().enumerate()
                        {
                            for at in [7 * k + 3 * j, 7 * k + 3 * j + 33] {
                                if at < len {
                                    stream[offset + at] = bf16::from_f32(*x);
                                }
                            }
                        }
                    }
                    let wide: Vec<f32> = grads.iter().map(|g| g.to_f32()).collect();
                    let coefficients = config.coefficients(3, 1.0).unwrap();
                    let rounding = Rounding::Stochastic {
                        seed: 7,
                        step: 3,
                        first,
                    };
                    let run = |grads: Values<'_>| {
                        let (mut p, mut m, mut v) = (p.clone(), m.clone(), v.clone());
                        adam_step_bf16_master(
                            isa,
                            &coefficients,
                            &mut p[offset..],
                            grads,
                            Moments::Bf16 {
                                m: &mut m[offset..],
                                v: &mut v[offset..],
                            },
                            rounding,
                        );
                        let bits =
                            |x: Vec<bf16>| x.into_iter().map(bf16::to_bits).collect::<Vec<_>>();
                        (bits(p), bits(m), bits(v))
                    };
                    let pairs = run(Values::Bf16(&grads[offset..]));
                    let single = run(Values::F32(&wide[offset..]));
                    assert!(
                        pairs == single,
                        "{isa} len {len} offset {offset} first {first}: pairs differ from single vectors"
                    );
                }
            }
        }
    }
}
