//! The pool splits tensors at vector-aligned points, so every kernel gives
//! the same bits on any number of threads as on the calling thread alone.

use proptest::prelude::*;
use strata_optim::{
    AdagradConfig, AdamConfig, LionConfig, LowPrecisionMut, Moments, OptimError, Pool, PoolConfig,
    THREADS_MAX, Values, adam_step, bf16, grad_norm,
};

fn pool(threads: usize) -> Pool {
    Pool::new(PoolConfig {
        threads: Some(threads),
        parallel_elems_min: 0,
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
