//! Adam reads subnormal moments as zero, on every instruction set and every
//! kind of step (in place and out of place, fp32 and bf16 states, round to
//! nearest and stochastic): a moment that decays below f32's smallest
//! normal is written once as it falls and read as zero from then on, so
//! a parameter whose gradient stays zero (an embedding row of a token not
//! seen for ~800 steps) costs one slow step, not every step from then on
//! (rounding to nearest never takes such a moment to zero): on x86 every
//! multiply that reads a subnormal takes a microcode assist (14-26 times
//! the cost of a step in cache).

use strata_optim::{
    AdamCoefficients, AdamConfig, Isa, Moments, MomentsRef, Rounding, Values,
    adam_step_bf16_master, adam_step_out_of_place, adam_step_rounded, bf16,
};

const N: usize = 1000;

/// The kinds of step.
#[derive(Clone, Copy, Debug)]
enum Path {
    InPlaceFp32,
    InPlaceBf16Moments,
    InPlaceBf16Masters,
    OutOfPlaceFp32,
    OutOfPlaceBf16,
}

const PATHS: [Path; 5] = [
    Path::InPlaceFp32,
    Path::InPlaceBf16Moments,
    Path::InPlaceBf16Masters,
    Path::OutOfPlaceFp32,
    Path::OutOfPlaceBf16,
];

/// Element `i`'s class, by `i % 4`, all with zero gradients but the last:
/// 0 falls below the smallest normal in the first step, 1 arrives
/// subnormal (as from an older checkpoint), 2 arrives as -0, 3 is an
/// ordinary element.
fn inputs(n: usize) -> (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>) {
    let sign = |i: usize| if i % 8 < 4 { 1.0 } else { -1.0 };
    let mut x = (vec![0.5f32; n], vec![0.0f32; n], vec![0.0; n], vec![0.0; n]);
    for i in 0..n {
        (x.2[i], x.3[i]) = match i % 4 {
            // 0.9 m and 0.999 v fall below 1.1755e-38.
            0 => (sign(i) * 1.25e-38, 1.1756e-38),
            1 => (sign(i) * 1e-39, 1e-40),
            2 => (-0.0, 0.0),
            _ => (sign(i) * 1e-3, 1e-6),
        };
        if i % 4 == 3 {
            x.1[i] = sign(i) * 1e-3;
            x.0[i] = 0.25;
        }
    }
    (x.0, x.1, x.2, x.3)
}

fn widen(x: &[bf16]) -> Vec<f32> {
    x.iter().map(|x| x.to_f32()).collect()
}

fn narrow(x: &[f32]) -> Vec<bf16> {
    x.iter().map(|&x| bf16::from_f32(x)).collect()
}

/// One step of `path` from (p, m, v) with gradient `g` (bf16 states and
/// gradients are the values narrowed); the new (p, m, v) widened to f32.
fn step(
    path: Path,
    isa: Isa,
    c: &AdamCoefficients,
    rounding: Rounding,
    (p, g, m, v): (&[f32], &[f32], &[f32], &[f32]),
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (pb, gb, mb, vb) = (narrow(p), narrow(g), narrow(m), narrow(v));
    let n = p.len();
    match path {
        Path::InPlaceFp32 => {
            let (mut p1, mut m1, mut v1) = (p.to_vec(), m.to_vec(), v.to_vec());
            let moments = Moments::F32 {
                m: &mut m1,
                v: &mut v1,
            };
            adam_step_rounded(isa, c, &mut p1, Values::F32(g), moments, None, rounding);
            (p1, m1, v1)
        }
        Path::InPlaceBf16Moments => {
            let (mut p1, mut m1, mut v1) = (p.to_vec(), mb, vb);
            let moments = Moments::Bf16 {
                m: &mut m1,
                v: &mut v1,
            };
            adam_step_rounded(isa, c, &mut p1, Values::Bf16(&gb), moments, None, rounding);
            (p1, widen(&m1), widen(&v1))
        }
        Path::InPlaceBf16Masters => {
            let (mut p1, mut m1, mut v1) = (pb, mb, vb);
            let moments = Moments::Bf16 {
                m: &mut m1,
                v: &mut v1,
            };
            adam_step_bf16_master(isa, c, &mut p1, Values::Bf16(&gb), moments, rounding);
            (widen(&p1), widen(&m1), widen(&v1))
        }
        Path::OutOfPlaceFp32 => {
            let (mut p1, mut m1, mut v1) = (vec![0.0f32; n], vec![1.0f32; n], vec![1.0f32; n]);
            let moments_in = MomentsRef::F32 { m, v };
            let moments = Moments::F32 {
                m: &mut m1,
                v: &mut v1,
            };
            let grads = Values::Bf16(&gb);
            adam_step_out_of_place(
                isa, c, p, moments_in, grads, &mut p1, moments, None, rounding,
            );
            (p1, m1, v1)
        }
        Path::OutOfPlaceBf16 => {
            let (mut p1, mut m1, mut v1) =
                (vec![bf16::ZERO; n], vec![bf16::ONE; n], vec![bf16::ONE; n]);
            let moments_in = MomentsRef::Bf16 { m: &mb, v: &vb };
            let moments = Moments::Bf16 {
                m: &mut m1,
                v: &mut v1,
            };
            let grads = Values::Bf16(&gb);
            adam_step_out_of_place(
                isa, c, &pb, moments_in, grads, &mut p1, moments, None, rounding,
            );
            (widen(&p1), widen(&m1), widen(&v1))
        }
    }
}

/// Checks moments after a step: class 3 is normal, and the others are +0
/// bit for bit where `zero` says so.
fn check(what: &str, zero: impl Fn(usize, usize) -> bool, m: &[f32], v: &[f32]) {
    for i in 0..m.len() {
        for (k, (name, x)) in [("m", m[i]), ("v", v[i])].into_iter().enumerate() {
            if i % 4 == 3 {
                assert!(x.is_normal(), "{what}: {name}[{i}] = {x:e}, not normal");
            } else if zero(i, k) {
                assert_eq!(x.to_bits(), 0, "{what}: {name}[{i}] = {x:e}, not +0");
            }
        }
    }
}

/// Two steps of each of `paths` from [`inputs`] of length `n`, checked.
fn two_steps(n: usize, paths: &[Path]) {
    let c = AdamConfig::adamw(1e-3).coefficients(3, 1.0).unwrap();
    let stochastic = Rounding::Stochastic {
        seed: 7,
        step: 3,
        first: 0,
    };
    let (p, g, m, v) = inputs(n);
    for isa in Isa::available() {
        for rounding in [Rounding::Nearest, stochastic] {
            for &path in paths {
                let what = format!("{isa:?} {path:?} {rounding:?}");
                let (p1, m1, v1) = step(path, isa, &c, rounding, (&p, &g, &m, &v));
                // Read as zero: the subnormal ones and the zeros are +0.
                check(
                    &format!("{what}, step 1"),
                    |i, _| !i.is_multiple_of(4),
                    &m1,
                    &v1,
                );
                // Those that fell below are written subnormal (in fp32; a
                // bf16 write may round up to the smallest normal), and read
                // as zero in the next step.
                let fell = |i: usize, k: usize| [m1[i], v1[i]][k].is_subnormal();
                if matches!(path, Path::InPlaceFp32 | Path::OutOfPlaceFp32) {
                    assert!(
                        (0..n).step_by(4).all(|i| fell(i, 0) && fell(i, 1)),
                        "{what}"
                    );
                }
                let (_, m2, v2) = step(path, isa, &c, rounding, (&p1, &g, &m1, &v1));
                let zero = |i: usize, k: usize| !i.is_multiple_of(4) || fell(i, k);
                check(&format!("{what}, step 2"), zero, &m2, &v2);
            }
        }
    }
}

#[test]
fn subnormal_moments_are_read_as_zero_by_every_step() {
    two_steps(N, &PATHS);
}

/// Out of place from 2M elements up the outputs are computed a tile at a
/// time and streamed past the caches: another loop, read the same way.
#[test]
fn the_streamed_out_of_place_step_reads_them_as_zero_too() {
    two_steps(
        (1 << 21) + 37,
        &[Path::OutOfPlaceFp32, Path::OutOfPlaceBf16],
    );
}

/// With eps below `FLUSH_V_EPS_MIN` (eps = 0 above all) v is read as it is:
/// read as zero, the denominator would be zero and the step infinite.
#[test]
fn with_eps_zero_a_subnormal_v_is_read_as_it_is() {
    let config = AdamConfig {
        eps: 0.0,
        ..AdamConfig::adamw(1e-3)
    };
    let c = config.coefficients(3, 1.0).unwrap();
    let (p, g) = (vec![0.5f32; N], vec![0.0f32; N]);
    let (m, v) = (vec![1e-3f32; N], vec![1e-39f32; N]);
    let stochastic = Rounding::Stochastic {
        seed: 7,
        step: 3,
        first: 0,
    };
    for isa in Isa::available() {
        for rounding in [Rounding::Nearest, stochastic] {
            for path in PATHS {
                let (p1, _, v1) = step(path, isa, &c, rounding, (&p, &g, &m, &v));
                for i in 0..N {
                    let what = format!("{isa:?} {path:?} {rounding:?}: [{i}]");
                    assert!(p1[i].is_finite(), "{what} p = {}", p1[i]);
                    assert!(v1[i] > 0.0, "{what} v = {:e}", v1[i]);
                }
            }
        }
    }
}
