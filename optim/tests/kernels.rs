//! Every update rule on every instruction set against the float64 scalar
//! reference (`strata_optim::reference`), on random inputs that include
//! zeros, subnormals, very large and very small values.
//!
//! Tolerance: the fp32 result `x` of a rule must satisfy
//! `|x - reference| <= REL * magnitude + ABS`, where `magnitude` is the sum
//! of the absolute values of the terms that formed it (so cancellation is
//! judged against what was cancelled). REL = 2e-6 is about 32 fp32 ulps of
//! that magnitude; ABS = 1e-37 covers fp32 underflow of squares of tiny
//! gradients. bf16 moments are stored rounded, so they get REL = 2^-8.
//! Gradients whose squares overflow fp32 (|g| > 1.8e19) are outside fp32
//! Adam's range, as in PyTorch; `huge_gradients_saturate_without_nan` says
//! what happens to them.

use strata_optim::reference::{self, State64};
use strata_optim::{
    AdagradConfig, AdamConfig, Isa, LionConfig, LowPrecisionMut, Moments, StepDecision, Values,
    accumulate, adagrad_step, adam_step, bf16, decide_step, f16, grad_norm, lion_step,
};

const REL: f64 = 2e-6;
const ABS: f64 = 1e-37;

/// A seeded generator (SplitMix64) so failures replay.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }

    fn sign(&mut self) -> f32 {
        if self.next() & 1 == 0 { 1.0 } else { -1.0 }
    }

    /// Mostly ordinary magnitudes, with zeros, subnormals, very large and
    /// very small values mixed in. `max_exp10` caps the large ones.
    fn interesting(&mut self, max_exp10: f64) -> f32 {
        let sign = self.sign();
        match self.next() % 12 {
            0 => 0.0 * sign,
            1 => sign * f32::from_bits((self.next() as u32) & 0x007f_ffff),
            2 => sign * 10f64.powf(max_exp10 - 3.0 + 3.0 * self.unit()) as f32,
            3 => sign * 10f64.powf(-30.0 + 10.0 * self.unit()) as f32,
            _ => sign * 10f64.powf(-4.0 + 5.0 * self.unit()) as f32,
        }
    }

    fn values(&mut self, n: usize, max_exp10: f64) -> Vec<f32> {
        (0..n).map(|_| self.interesting(max_exp10)).collect()
    }
}

fn check(what: &str, isa: Isa, i: usize, actual: f32, expected: f64, magnitude: f64, rel: f64) {
    let error = (f64::from(actual) - expected).abs();
    let bound = rel * magnitude + ABS;
    assert!(
        error <= bound,
        "{isa} {what}[{i}]: got {actual:e}, reference {expected:e}, error {error:e} > bound {bound:e}"
    );
}

/// Gradients in each format, the f64 values the kernel will see.
enum GradFormat {
    F32,
    Bf16,
    F16,
}

struct Grads {
    f32s: Vec<f32>,
    bf16s: Vec<bf16>,
    f16s: Vec<f16>,
}

impl Grads {
    fn new(values: Vec<f32>) -> Grads {
        let bf16s = values.iter().map(|&x| bf16::from_f32(x)).collect();
        // fp16 gradients come from loss-scaled training that kept them in range.
        let f16s = values
            .iter()
            .map(|&x| f16::from_f32(x.clamp(-6e4, 6e4)))
            .collect();
        Grads {
            f32s: values,
            bf16s,
            f16s,
        }
    }

    fn view(&self, format: &GradFormat) -> Values<'_> {
        match format {
            GradFormat::F32 => Values::F32(&self.f32s),
            GradFormat::Bf16 => Values::Bf16(&self.bf16s),
            GradFormat::F16 => Values::F16(&self.f16s),
        }
    }

    fn seen(&self, format: &GradFormat, i: usize) -> f64 {
        match format {
            GradFormat::F32 => f64::from(self.f32s[i]),
            GradFormat::Bf16 => f64::from(self.bf16s[i].to_f32()),
            GradFormat::F16 => f64::from(self.f16s[i].to_f32()),
        }
    }
}

const LENGTHS: [usize; 4] = [1, 15, 67, 1000];

fn adam_case(
    isa: Isa,
    seed: u64,
    config: &AdamConfig,
    format: &GradFormat,
    bf16_moments: bool,
    n: usize,
) {
    let mut rng = Rng(seed);
    let step = 1 + rng.next() % 50;
    let grad_scale = 10f64.powf(-2.0 + 3.0 * rng.unit()) as f32;
    let grads = Grads::new(rng.values(n, 15.0));
    let mut p = rng.values(n, 12.0);
    let mut m = rng.values(n, 12.0);
    let mut v: Vec<f32> = rng.values(n, 20.0).iter().map(|x| x.abs()).collect();
    if bf16_moments {
        // Start from values bf16 can hold, so the reference sees them too.
        m.iter_mut()
            .chain(v.iter_mut())
            .for_each(|x| *x = bf16::from_f32(*x).to_f32());
    }
    let before: Vec<State64> = (0..n)
        .map(|i| State64 {
            p: p[i].into(),
            s1: m[i].into(),
            s2: v[i].into(),
        })
        .collect();
    let mut out = vec![bf16::ZERO; n];
    let c = config.coefficients(step, grad_scale).unwrap();
    let (mut m16, mut v16): (Vec<bf16>, Vec<bf16>) = (
        m.iter().map(|&x| bf16::from_f32(x)).collect(),
        v.iter().map(|&x| bf16::from_f32(x)).collect(),
    );
    let moments = match bf16_moments {
        true => Moments::Bf16 {
            m: &mut m16,
            v: &mut v16,
        },
        false => Moments::F32 {
            m: &mut m,
            v: &mut v,
        },
    };
    adam_step(
        isa,
        &c,
        &mut p,
        grads.view(format),
        moments,
        Some(LowPrecisionMut::Bf16(&mut out)),
    );
    if bf16_moments {
        m = m16.iter().map(|x| x.to_f32()).collect();
        v = v16.iter().map(|x| x.to_f32()).collect();
    }
    let moment_rel = if bf16_moments { 1.0 / 256.0 } else { REL };
    let (b1, b2) = (config.beta1, config.beta2);
    for i in 0..n {
        let g = grads.seen(format, i);
        let x = before[i];
        let r = reference::adam(config, step, grad_scale.into(), g, x);
        let g_eff = (g * f64::from(grad_scale)).abs()
            + if config.decoupled_weight_decay {
                0.0
            } else {
                config.weight_decay * x.p.abs()
            };
        check("m", isa, i, m[i], r.s1, x.s1.abs() + g_eff, moment_rel);
        check(
            "v",
            isa,
            i,
            v[i],
            r.s2,
            b2 * x.s2 + (1.0 - b2) * g_eff * g_eff,
            moment_rel,
        );
        let bias_correction1 = 1.0 - b1.powi(step as i32);
        let bias_correction2 = 1.0 - b2.powi(step as i32);
        let denominator = r.s2.sqrt() / bias_correction2.sqrt() + config.eps;
        let update_magnitude = config.lr / bias_correction1 * (x.s1.abs() + g_eff) / denominator;
        check("p", isa, i, p[i], r.p, x.p.abs() + update_magnitude, REL);
        assert_eq!(
            out[i],
            bf16::from_f32(p[i]),
            "{isa} out[{i}] is not p rounded to nearest even"
        );
    }
}

#[test]
fn adam_and_adamw_match_the_f64_reference_on_every_isa() {
    let configs = [
        AdamConfig::adamw(1e-3),
        AdamConfig {
            weight_decay: 0.1,
            ..AdamConfig::adam(3e-4)
        },
        AdamConfig {
            maximize: true,
            eps: 1e-6,
            ..AdamConfig::adamw(1e-2)
        },
        AdamConfig {
            bias_correction: false,
            ..AdamConfig::adamw(1e-3)
        },
    ];
    let formats = [GradFormat::F32, GradFormat::Bf16, GradFormat::F16];
    for isa in Isa::available() {
        for (seed, config) in configs.iter().enumerate() {
            for format in &formats {
                for bf16_moments in [false, true] {
                    for (k, &n) in LENGTHS.iter().enumerate() {
                        adam_case(
                            isa,
                            1000 * seed as u64 + k as u64,
                            config,
                            format,
                            bf16_moments,
                            n,
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn adagrad_matches_the_f64_reference_on_every_isa() {
    let config = AdagradConfig {
        lr_decay: 0.01,
        weight_decay: 0.05,
        ..AdagradConfig::new(1e-2)
    };
    for isa in Isa::available() {
        for (seed, &n) in LENGTHS.iter().enumerate() {
            let mut rng = Rng(77 + seed as u64);
            let step = 1 + rng.next() % 20;
            let grads = Grads::new(rng.values(n, 15.0));
            let mut p = rng.values(n, 12.0);
            let mut sum: Vec<f32> = rng.values(n, 20.0).iter().map(|x| x.abs()).collect();
            let before: Vec<State64> = (0..n)
                .map(|i| State64 {
                    p: p[i].into(),
                    s1: sum[i].into(),
                    s2: 0.0,
                })
                .collect();
            let c = config.coefficients(step, 0.5).unwrap();
            adagrad_step(
                isa,
                &c,
                &mut p,
                grads.view(&GradFormat::F32),
                &mut sum,
                None,
            );
            for i in 0..n {
                let x = before[i];
                let g = grads.seen(&GradFormat::F32, i);
                let r = reference::adagrad(&config, step, 0.5, g, x);
                let g_eff = (0.5 * g).abs() + config.weight_decay * x.p.abs();
                check("sum", isa, i, sum[i], r.s1, x.s1 + g_eff * g_eff, REL);
                let clr = config.lr / (1.0 + (step - 1) as f64 * config.lr_decay);
                check(
                    "p",
                    isa,
                    i,
                    p[i],
                    r.p,
                    x.p.abs() + clr * g_eff / (r.s1.sqrt() + config.eps),
                    REL,
                );
            }
        }
    }
}

#[test]
fn lion_matches_the_f64_reference_on_every_isa() {
    let config = LionConfig {
        weight_decay: 0.1,
        ..LionConfig::new(1e-4)
    };
    for isa in Isa::available() {
        for (seed, &n) in LENGTHS.iter().enumerate() {
            let mut rng = Rng(99 + seed as u64);
            let grads = Grads::new(rng.values(n, 15.0));
            let mut p = rng.values(n, 12.0);
            let mut m = rng.values(n, 12.0);
            let before: Vec<State64> = (0..n)
                .map(|i| State64 {
                    p: p[i].into(),
                    s1: m[i].into(),
                    s2: 0.0,
                })
                .collect();
            let c = config.coefficients(1, 1.0).unwrap();
            lion_step(isa, &c, &mut p, grads.view(&GradFormat::Bf16), &mut m, None);
            for i in 0..n {
                let x = before[i];
                let g = grads.seen(&GradFormat::Bf16, i);
                let r = reference::lion(&config, 1.0, g, x);
                check("m", isa, i, m[i], r.s1, x.s1.abs() + g.abs(), REL);
                // The sign is only well defined away from ties at zero; the
                // generator never produces an exact cancellation.
                check("p", isa, i, p[i], r.p, x.p.abs() + config.lr, REL);
            }
        }
    }
}

#[test]
fn grad_norm_matches_the_reference_and_flags_every_non_finite_value() {
    for isa in Isa::available() {
        for (seed, &n) in LENGTHS.iter().enumerate() {
            let mut rng = Rng(5 + seed as u64);
            let grads = Grads::new(rng.values(n, 18.0));
            for format in [GradFormat::F32, GradFormat::Bf16, GradFormat::F16] {
                let expected = reference::sum_squares((0..n).map(|i| grads.seen(&format, i)));
                let norm = grad_norm(isa, grads.view(&format));
                assert!(
                    (norm.sum_squares - expected).abs() <= 1e-12 * expected,
                    "{isa}: {norm:?} vs {expected}"
                );
            }
            for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                for position in [0, n / 2, n - 1] {
                    let mut values = grads.f32s.clone();
                    values[position] = bad;
                    let norm = grad_norm(isa, Values::F32(&values));
                    assert!(
                        !norm.is_finite(),
                        "{isa}: {bad} at {position} of {n} not flagged"
                    );
                    assert_eq!(decide_step(norm, 1024.0, Some(1.0)), StepDecision::Skip);
                }
            }
        }
    }
}

#[test]
fn fp16_overflow_is_detected_and_the_step_skipped_leaving_states_alone() {
    // A loss scale too high for fp16: one gradient overflowed to infinity.
    let n = 100;
    let mut grads: Vec<f16> = (0..n).map(|i| f16::from_f32(i as f32 * 10.0)).collect();
    grads[37] = f16::from_f32(1e6);
    assert!(grads[37].is_infinite());
    let (mut p, mut m, mut v) = (vec![1.0f32; n], vec![0.1f32; n], vec![0.2f32; n]);
    let (p0, m0, v0) = (p.clone(), m.clone(), v.clone());
    let config = AdamConfig::adamw(1e-3);
    for isa in Isa::available() {
        let norm = grad_norm(isa, Values::F16(&grads));
        match decide_step(norm, 65536.0, Some(1.0)) {
            StepDecision::Skip => {}
            step => panic!("{isa}: overflow not detected: {step:?}"),
        }
        assert_eq!((&p, &m, &v), (&p0, &m0, &v0));
    }
    // Stepping anyway would poison only that element, never its neighbours.
    let c = config.coefficients(1, 1.0).unwrap();
    adam_step(
        Isa::chosen(),
        &c,
        &mut p,
        Values::F16(&grads),
        Moments::F32 {
            m: &mut m,
            v: &mut v,
        },
        None,
    );
    assert!(
        p.iter()
            .enumerate()
            .all(|(i, x)| x.is_finite() == (i != 37)),
        "{p:?}"
    );
}

#[test]
fn clipping_and_unscaling_fold_into_one_grad_scale() {
    let grads = vec![3.0f32 * 1024.0, 4.0 * 1024.0];
    let norm = grad_norm(Isa::chosen(), Values::F32(&grads));
    let StepDecision::Step {
        grad_scale,
        grad_norm,
        clip_coefficient,
    } = decide_step(norm, 1024.0, Some(1.0))
    else {
        panic!("finite gradients skipped");
    };
    assert!((grad_norm - 5.0).abs() < 1e-12);
    assert!((f64::from(clip_coefficient) - 1.0 / (5.0 + 1e-6)).abs() < 1e-7);
    assert!((f64::from(grad_scale) * 1024.0 - f64::from(clip_coefficient)).abs() < 1e-9);
    let StepDecision::Step {
        clip_coefficient, ..
    } = decide_step(norm, 1024.0, Some(10.0))
    else {
        panic!()
    };
    assert_eq!(
        clip_coefficient, 1.0,
        "a norm under max_norm is not clipped"
    );
}

#[test]
fn huge_gradients_saturate_without_nan() {
    // g^2 overflows fp32: v becomes +inf, the update m / inf is 0, and the
    // parameter only decays - as in PyTorch's fp32 Adam.
    let (mut p, mut m, mut v) = (vec![1.0f32; 17], vec![0.0f32; 17], vec![0.0f32; 17]);
    let grads = vec![3e19f32; 17];
    let c = AdamConfig::adamw(1e-3).coefficients(1, 1.0).unwrap();
    for isa in Isa::available() {
        adam_step(
            isa,
            &c,
            &mut p,
            Values::F32(&grads),
            Moments::F32 {
                m: &mut m,
                v: &mut v,
            },
            None,
        );
        assert!(v.iter().all(|x| x.is_infinite()), "{isa}: {v:?}");
        assert!(p.iter().all(|x| x.is_finite()), "{isa}: {p:?}");
    }
}

#[test]
fn accumulation_is_exact_for_every_format() {
    let mut rng = Rng(3);
    for isa in Isa::available() {
        for &n in &LENGTHS {
            let grads = Grads::new(rng.values(n, 6.0));
            for format in [GradFormat::F32, GradFormat::Bf16, GradFormat::F16] {
                let start = rng.values(n, 6.0);
                let mut acc = start.clone();
                accumulate(isa, &mut acc, grads.view(&format));
                for i in 0..n {
                    let expected = (f64::from(start[i]) + grads.seen(&format, i)) as f32;
                    assert_eq!(acc[i].to_bits(), expected.to_bits(), "{isa} acc[{i}]");
                }
            }
        }
    }
}

/// Adam over `p` in 1000-element pieces: outputs that short never stream.
fn adam_in_pieces(
    isa: Isa,
    c: &strata_optim::AdamCoefficients,
    p: &mut [f32],
    grads: &[bf16],
) -> (Vec<f32>, Vec<f32>, Vec<bf16>) {
    let n = p.len();
    let (mut m, mut v, mut out) = (vec![0.0f32; n], vec![0.0f32; n], vec![bf16::ZERO; n]);
    for piece in (0..n).step_by(1000) {
        let r = piece..(piece + 1000).min(n);
        let moments = Moments::F32 {
            m: &mut m[r.clone()],
            v: &mut v[r.clone()],
        };
        let out = Some(LowPrecisionMut::Bf16(&mut out[r.clone()]));
        adam_step(
            isa,
            c,
            &mut p[r.clone()],
            Values::Bf16(&grads[r.clone()]),
            moments,
            out,
        );
    }
    (m, v, out)
}

#[test]
fn streamed_outputs_match_cached_ones_at_any_alignment() {
    // Outputs this long are written with non-temporal stores when one head
    // aligns both the parameters and the output; every parameter offset
    // against a few output offsets makes that happen on every instruction
    // set (and not happen, too). Both must give the bits of the cached
    // path.
    let n = 2_200_000;
    let grads: Vec<bf16> = Rng(11)
        .values(n, 3.0)
        .iter()
        .map(|&x| bf16::from_f32(x))
        .collect();
    let start = Rng(12).values(n, 3.0);
    let c = AdamConfig::adamw(1e-3).coefficients(4, 0.25).unwrap();
    let lion = LionConfig::new(1e-4).coefficients(1, 1.0).unwrap();
    for isa in Isa::available() {
        let mut p2 = start.clone();
        let (m2, v2, out2) = adam_in_pieces(isa, &c, &mut p2, &grads);
        for out_offset in [0, 3, 8] {
            for p_offset in 0..16 {
                let mut storage = vec![0.0f32; n + 16];
                storage[p_offset..p_offset + n].copy_from_slice(&start);
                let (mut m1, mut v1) = (vec![0.0f32; n], vec![0.0f32; n]);
                let mut out1 = vec![bf16::ZERO; n + 16];
                let moments = Moments::F32 {
                    m: &mut m1,
                    v: &mut v1,
                };
                let out = Some(LowPrecisionMut::Bf16(&mut out1[out_offset..out_offset + n]));
                adam_step(
                    isa,
                    &c,
                    &mut storage[p_offset..p_offset + n],
                    Values::Bf16(&grads),
                    moments,
                    out,
                );
                let same_states = storage[p_offset..p_offset + n] == p2[..] && m1 == m2 && v1 == v2;
                assert!(
                    same_states,
                    "{isa} params at +{p_offset}, output at +{out_offset}: states differ"
                );
                assert!(
                    out1[out_offset..out_offset + n] == out2[..],
                    "{isa} +{p_offset}/+{out_offset}: outputs differ"
                );
            }
        }
        let (mut q1, mut q2) = (start.clone(), start.clone());
        let (mut s1, mut s2) = (vec![0.0f32; n], vec![0.0f32; n]);
        let mut half1 = vec![f16::ZERO; n];
        let mut half2 = vec![f16::ZERO; n];
        lion_step(
            isa,
            &lion,
            &mut q1,
            Values::Bf16(&grads),
            &mut s1,
            Some(LowPrecisionMut::F16(&mut half1)),
        );
        for piece in (0..n).step_by(1000) {
            let r = piece..(piece + 1000).min(n);
            let out = Some(LowPrecisionMut::F16(&mut half2[r.clone()]));
            lion_step(
                isa,
                &lion,
                &mut q2[r.clone()],
                Values::Bf16(&grads[r.clone()]),
                &mut s2[r.clone()],
                out,
            );
        }
        assert!(
            q1 == q2 && s1 == s2 && half1 == half2,
            "{isa}: lion differs"
        );
    }
}
