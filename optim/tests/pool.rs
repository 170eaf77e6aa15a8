//! The pool splits tensors at vector-aligned points, so every kernel gives
//! the same bits on any number of threads as on the calling thread alone.

mod common;

use common::PageAligned;
use proptest::prelude::*;
use strata_optim::{
    AdagradConfig, AdamConfig, LionConfig, LowPrecisionMut, Moments, OptimError, Pool, PoolConfig,
    Rounding, THREADS_MAX, Values, adagrad_step, adam_step, adam_step_rounded, bf16, grad_norm,
    lion_step,
};

fn pool(threads: usize) -> Pool {
    Pool::new(PoolConfig {
        threads: Some(threads),
        parallel_elems_min: 0,
        // Several pieces per thread even at these lengths, as large calls.
        piece_elems_min: 256,
        ..PoolConfig::default()
    })
    .unwrap()
}

fn data(n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| {
            ((i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) % 2001) as f32 * 1e-3 - 1.0
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn pooled_kernels_match_the_calling_thread_bit_for_bit(n in 0usize..5000, threads in 1usize..5, seed in any::<u32>()) {
        let pool = pool(threads);
        let isa = pool.isa();
        let grads: Vec<bf16> = data(n, seed ^ 1).iter().map(|&x| bf16::from_f32(x)).collect();
        let c = AdamConfig::adamw(1e-2).coefficients(2, 0.5).unwrap();

        let (mut p1, mut m1, mut v1, mut o1) = (data(n, seed), data(n, seed ^ 2), vec![0.1f32; n], vec![bf16::ZERO; n]);
        let (mut p2, mut m2, mut v2, mut o2) = (p1.clone(), m1.clone(), v1.clone(), o1.clone());
        adam_step(isa, &c, &mut p1, Values::Bf16(&grads), Moments::F32 { m: &mut m1, v: &mut v1 }, Some(LowPrecisionMut::Bf16(&mut o1)));
        pool.adam_step(&c, &mut p2, Values::Bf16(&grads), Moments::F32 { m: &mut m2, v: &mut v2 }, Some(LowPrecisionMut::Bf16(&mut o2)));
        prop_assert_eq!(&p1, &p2);
        prop_assert_eq!(&m1, &m2);
        prop_assert_eq!(&v1, &v2);
        prop_assert_eq!(&o1, &o2);

        let single = pool_one_thread_results(n, seed);
        let pooled = pool_results(&pool, n, seed);
        prop_assert_eq!(single, pooled);

        let norm = pool.grad_norm(&[Values::Bf16(&grads), Values::Bf16(&grads)]);
        let expected = 2.0 * grad_norm(isa, Values::Bf16(&grads)).sum_squares;
        prop_assert!((norm.sum_squares - expected).abs() <= 1e-12 * expected.max(1e-300));
    }
}

/// One parameter tensor of a multi-tensor step: params, bf16 or f32
/// gradients, two states (bf16 moments for Adam when `bf16_moments`).
#[derive(Clone, Debug, PartialEq)]
struct Tensors {
    p: Vec<f32>,
    g: Vec<f32>,
    g16: Option<Vec<bf16>>,
    m: Vec<f32>,
    v: Vec<f32>,
    m16: Option<(Vec<bf16>, Vec<bf16>)>,
    copy: Option<Vec<bf16>>,
}

fn tensors(lens: &[(usize, u8)], seed: u32) -> Vec<Tensors> {
    lens.iter()
        .enumerate()
        .map(|(i, &(n, kind))| {
            let seed = seed.wrapping_add(i as u32 * 7919);
            let to16 = |x: Vec<f32>| x.into_iter().map(bf16::from_f32).collect::<Vec<_>>();
            Tensors {
                p: data(n, seed),
                g: data(n, seed ^ 1),
                g16: (kind & 1 != 0).then(|| to16(data(n, seed ^ 1))),
                m: data(n, seed ^ 2),
                v: vec![0.25; n],
                m16: (kind & 2 != 0)
                    .then(|| (to16(data(n, seed ^ 2)), vec![bf16::from_f32(0.25); n])),
                copy: (kind & 4 != 0).then(|| vec![bf16::ZERO; n]),
            }
        })
        .collect()
}

/// Each tensor's rounding: stochastic, keyed by its first element's index
/// in all of them (as a model's parameters are).
fn roundings(tensors: &[Tensors], seed: u64, step: u64) -> Vec<Rounding> {
    let mut first = 0;
    tensors
        .iter()
        .map(|t| {
            let rounding = Rounding::Stochastic { seed, step, first };
            first += t.p.len() as u64;
            rounding
        })
        .collect()
}

impl Tensors {
    /// Adam's shard, its bf16 moments (if any) rounded by `rounding`.
    fn adam_parts(&mut self, rounding: Rounding) -> strata_optim::AdamShard<'_> {
        let grads = match &self.g16 {
            Some(g) => Values::Bf16(g),
            None => Values::F32(&self.g),
        };
        let moments = match &mut self.m16 {
            Some((m, v)) => Moments::Bf16 { m, v },
            None => Moments::F32 {
                m: &mut self.m,
                v: &mut self.v,
            },
        };
        (
            &mut self.p,
            grads,
            moments,
            self.copy.as_deref_mut().map(LowPrecisionMut::Bf16),
            rounding,
        )
    }

    fn state_parts(&mut self) -> strata_optim::StateShard<'_> {
        let grads = match &self.g16 {
            Some(g) => Values::Bf16(g),
            None => Values::F32(&self.g),
        };
        (
            &mut self.p,
            grads,
            &mut self.v,
            self.copy.as_deref_mut().map(LowPrecisionMut::Bf16),
        )
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// A step over many tensors in one call leaves each as the one-tensor
    /// kernel on the calling thread does, whatever the lengths, formats and
    /// thread count (tensors are cut across threads mid-way).
    #[test]
    fn many_tensor_steps_match_one_tensor_at_a_time(
        lens in prop::collection::vec((0usize..3000, 0u8..8), 0..8),
        threads in 1usize..5,
        seed in any::<u32>(),
    ) {
        let pool = pool(threads);
        let isa = pool.isa();
        let adam = AdamConfig::adamw(1e-2).coefficients(3, 0.5).unwrap();
        let adagrad = AdagradConfig::new(1e-2).coefficients(2, 1.0).unwrap();
        let lion = LionConfig::new(1e-3).coefficients(1, 1.0).unwrap();

        // Nearest, then stochastic rounding of the bf16 moments keyed by
        // each tensor's place among them.
        let mut expected = tensors(&lens, seed);
        let mut got = tensors(&lens, seed);
        for stochastic in [false, true] {
            let rounding = match stochastic {
                true => roundings(&expected, u64::from(seed), 3),
                false => vec![Rounding::Nearest; expected.len()],
            };
            for (t, &r) in expected.iter_mut().zip(&rounding) {
                let (p, g, m, o, r) = t.adam_parts(r);
                adam_step_rounded(isa, &adam, p, g, m, o, r);
            }
            let shards = got.iter_mut().zip(&rounding).map(|(t, &r)| t.adam_parts(r)).collect();
            pool.adam_step_many(&adam, shards);
            prop_assert_eq!(&got, &expected, "stochastic {}", stochastic);
        }

        for t in &mut expected {
            let (p, g, s, o) = t.state_parts();
            adagrad_step(isa, &adagrad, p, g, s, o);
        }
        pool.adagrad_step_many(&adagrad, got.iter_mut().map(Tensors::state_parts).collect());
        prop_assert_eq!(&got, &expected);

        for t in &mut expected {
            let (p, g, s, o) = t.state_parts();
            lion_step(isa, &lion, p, g, s, o);
        }
        pool.lion_step_many(&lion, got.iter_mut().map(Tensors::state_parts).collect());
        prop_assert_eq!(&got, &expected);
    }
}

/// Large calls are cut into several pieces per thread (shared out as the
/// threads go): still the calling thread's bits, for one tensor and many.
#[test]
fn calls_cut_into_many_pieces_per_thread_keep_the_bits() {
    let lens = [
        (700_001, 0),
        (3, 1),
        (300_000, 3),
        (65_537, 5),
        (0, 0),
        (1 << 18, 6),
    ];
    let isa = pool(1).isa();
    let adam = AdamConfig::adamw(1e-2).coefficients(7, 0.25).unwrap();
    let mut expected = tensors(&lens, 11);
    let rounding = roundings(&expected, 5, 7);
    for (t, &r) in expected.iter_mut().zip(&rounding) {
        let (p, g, m, o, r) = t.adam_parts(r);
        adam_step_rounded(isa, &adam, p, g, m, o, r);
    }
    for threads in [2, 3] {
        let pool = pool(threads);
        let mut got = tensors(&lens, 11);
        let shards = got
            .iter_mut()
            .zip(&rounding)
            .map(|(t, &r)| t.adam_parts(r))
            .collect();
        pool.adam_step_many(&adam, shards);
        assert_eq!(got, expected, "{threads} threads, many tensors");
        let mut one = tensors(&lens[..1], 11);
        let (p, g, m, o, r) = one[0].adam_parts(rounding[0]);
        pool.adam_step_rounded(&adam, p, g, m, o, r);
        assert_eq!(one[0], expected[0], "{threads} threads, one tensor");
    }
}

/// A call long enough to stream its 16-bit copy past the caches does so
/// from every piece, however short (the kernels decide by the whole call's
/// length): the bits are those of short calls that store it normally.
#[test]
fn pieces_of_a_long_call_stream_the_copy_and_keep_the_bits() {
    // 12 pieces of about 175K elements on 3 threads, each far below the
    // 2M-element streaming length that the whole call passes.
    let n = (1 << 21) + 4099;
    let pool = Pool::new(PoolConfig {
        threads: Some(3),
        pin: false,
        parallel_elems_min: 0,
        ..PoolConfig::default()
    })
    .unwrap();
    let isa = pool.isa();
    let grads: Vec<bf16> = data(n, 9).iter().map(|&x| bf16::from_f32(x)).collect();
    let adam = AdamConfig::adamw(1e-2).coefficients(4, 0.5).unwrap();
    let adagrad = AdagradConfig::new(1e-2).coefficients(3, 1.0).unwrap();
    let lion = LionConfig::new(1e-3).coefficients(2, 1.0).unwrap();
    // Parameters and copies start on pages, so one head aligns both (the
    // in-place kernels stream only then).
    let filled = |seed: u32| {
        let mut p = PageAligned::new(n, 0, 0.0f32);
        p.get_mut().copy_from_slice(&data(n, seed));
        p
    };
    // Adagrad's sum of squares is never negative.
    let state = || {
        let mut s = filled(2);
        s.get_mut().iter_mut().for_each(|x| *x = x.abs());
        s
    };
    // Calls of 1M elements and a short last one: under 2M, stored normally.
    let stored = 1 << 20;
    for rule in ["adam", "adagrad", "lion"] {
        let run = |whole: bool| {
            let (mut p, mut s1, mut out) = (filled(1), state(), PageAligned::new(n, 0, bf16::ZERO));
            let mut s2 = vec![0.25f32; n];
            // The pool's one call, or calls short enough to store normally.
            let cuts: Vec<usize> = match whole {
                true => vec![0, n],
                false => (0..n).step_by(stored).chain([n]).collect(),
            };
            for w in cuts.windows(2) {
                let r = w[0]..w[1];
                let (p, s1, out) = (
                    &mut p.get_mut()[r.clone()],
                    &mut s1.get_mut()[r.clone()],
                    &mut out.get_mut()[r.clone()],
                );
                let (g, o) = (
                    Values::Bf16(&grads[r.clone()]),
                    Some(LowPrecisionMut::Bf16(out)),
                );
                match (rule, whole) {
                    ("adam", true) => pool.adam_step(
                        &adam,
                        p,
                        g,
                        Moments::F32 {
                            m: s1,
                            v: &mut s2[r],
                        },
                        o,
                    ),
                    ("adam", false) => adam_step(
                        isa,
                        &adam,
                        p,
                        g,
                        Moments::F32 {
                            m: s1,
                            v: &mut s2[r],
                        },
                        o,
                    ),
                    ("adagrad", true) => pool.adagrad_step(&adagrad, p, g, s1, o),
                    ("adagrad", false) => adagrad_step(isa, &adagrad, p, g, s1, o),
                    (_, true) => pool.lion_step(&lion, p, g, s1, o),
                    (_, false) => lion_step(isa, &lion, p, g, s1, o),
                }
            }
            (p.get().to_vec(), s1.get().to_vec(), s2, out.get().to_vec())
        };
        // Bits, so that a NaN would differ from nothing but itself.
        let bits = |(p, s1, s2, out): (Vec<f32>, Vec<f32>, Vec<f32>, Vec<bf16>)| {
            let f = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
            (
                f(p),
                f(s1),
                f(s2),
                out.into_iter().map(bf16::to_bits).collect::<Vec<_>>(),
            )
        };
        assert!(bits(run(true)) == bits(run(false)), "{rule}");
    }
}

/// Adagrad, Lion, accumulate and the roofline through a pool.
fn pool_results(pool: &Pool, n: usize, seed: u32) -> Vec<Vec<f32>> {
    let grads = data(n, seed ^ 7);
    let (mut pa, mut sa) = (data(n, seed), vec![0.5f32; n]);
    pool.adagrad_step(
        &AdagradConfig::new(1e-2).coefficients(3, 1.0).unwrap(),
        &mut pa,
        Values::F32(&grads),
        &mut sa,
        None,
    );
    let (mut pl, mut ml) = (data(n, seed), data(n, seed ^ 3));
    pool.lion_step(
        &LionConfig::new(1e-3).coefficients(1, 1.0).unwrap(),
        &mut pl,
        Values::F32(&grads),
        &mut ml,
        None,
    );
    let mut acc = data(n, seed ^ 4);
    pool.accumulate(&mut acc, Values::F32(&grads));
    let (mut a, mut c, mut d) = (data(n, 1), data(n, 2), data(n, 3));
    pool.roofline_4r3w(&mut a, &grads, &mut c, &mut d);
    vec![pa, sa, pl, ml, acc, a, c, d]
}

fn pool_one_thread_results(n: usize, seed: u32) -> Vec<Vec<f32>> {
    pool_results(&pool(1), n, seed)
}

#[test]
fn thread_counts_out_of_range_are_refused_by_name() {
    for threads in [0, THREADS_MAX + 1] {
        let error = Pool::new(PoolConfig {
            threads: Some(threads),
            ..PoolConfig::default()
        })
        .unwrap_err();
        assert!(matches!(error, OptimError::Threads { .. }), "{error}");
        assert!(error.to_string().contains(&threads.to_string()), "{error}");
    }
}

#[test]
fn the_default_pool_has_one_pinned_thread_per_core() {
    let pool = Pool::new(PoolConfig::default()).unwrap();
    let topology = strata_optim::topology::CpuTopology::detect();
    assert_eq!(pool.threads(), topology.core_count());
    assert_eq!(pool.cpus().len(), pool.threads());
}
