//! Seeded initial values, for architectures' [`super::Model::init`]:
//! normal deviates drawn in order from one SplitMix64 stream, the same
//! values whatever the machine's cores.

use strata_storage::engine::SplitMix64;

/// `scale` times normal deviates into `out`, as one thread drawing them in
/// order from `rng` would (a pair of elements from two draws), cut over the
/// machine's cores (a 2.6B-parameter model took minutes on one); `rng` ends
/// past them.
pub(crate) fn fill_normal(out: &mut [f32], scale: f32, rng: &mut SplitMix64) {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    fill_normal_on(out, scale, rng, threads);
}

/// Elements below which a piece of [`fill_normal`] is not worth a thread.
const PIECE_MIN: usize = 1 << 20;

/// [`fill_normal`] on at most `threads` threads.
fn fill_normal_on(out: &mut [f32], scale: f32, rng: &mut SplitMix64, threads: usize) {
    let threads = threads.max(1);
    // Pieces start on a pair, so each takes the draws of whole pairs.
    let piece = out
        .len()
        .div_ceil(threads)
        .max(PIECE_MIN)
        .next_multiple_of(2);
    let start = rng.clone();
    *rng = start.jumped(out.len().next_multiple_of(2) as u64);
    let fill = |k: usize, part: &mut [f32]| {
        let mut local = start.jumped((k * piece) as u64);
        for pair in part.chunks_mut(2) {
            let (a, b) = normal_pair(&mut local);
            pair[0] = scale * a;
            if let Some(second) = pair.get_mut(1) {
                *second = scale * b;
            }
        }
    };
    std::thread::scope(|s| {
        let mut parts = out.chunks_mut(piece).enumerate();
        let first = parts.next();
        for (k, part) in parts {
            s.spawn(move || fill(k, part));
        }
        if let Some((k, part)) = first {
            fill(k, part);
        }
    });
}

/// Two independent normal deviates by Box-Muller (its cosine and its sine)
/// from two draws of the shared seeded generator.
pub(crate) fn normal_pair(rng: &mut SplitMix64) -> (f32, f32) {
    // Uniforms in (0, 1], so the logarithm is finite.
    let mut uniform = || ((rng.next_u64() >> 11) + 1) as f64 / (1u64 << 53) as f64;
    let (u, v) = (uniform(), uniform());
    // In f64, rounded once to f32 at the end: one libm's last-place
    // differences from another's then almost never reach the weights, so a
    // seed gives the same model on other platforms too (the f32 functions
    // took a further 20% off the time, without that).
    let radius = (-2.0 * u.ln()).sqrt();
    let (sin, cos) = (2.0 * std::f64::consts::PI * v).sin_cos();
    ((radius * cos) as f32, (radius * sin) as f32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_halves_of_a_pair_are_standard_normal_and_uncorrelated() {
        let mut rng = SplitMix64(11);
        let n = 200_000;
        let pairs: Vec<(f64, f64)> = (0..n)
            .map(|_| normal_pair(&mut rng))
            .map(|(a, b)| (f64::from(a), f64::from(b)))
            .collect();
        let mean = |f: &dyn Fn(&(f64, f64)) -> f64| pairs.iter().map(f).sum::<f64>() / n as f64;
        // Standard errors at n = 200k: 0.0022 for a mean, 0.0032 for a
        // variance, 0.0022 for a correlation; the bounds are 4.5 of them.
        for (name, half) in [("cosine", 0), ("sine", 1)] {
            let x = |p: &(f64, f64)| if half == 0 { p.0 } else { p.1 };
            let m = mean(&|p| x(p));
            let var = mean(&|p| x(p) * x(p)) - m * m;
            let tail = mean(&|p| f64::from(u8::from(x(p).abs() > 1.96)));
            assert!(m.abs() < 0.01, "{name}: mean {m}");
            assert!((var - 1.0).abs() < 0.015, "{name}: variance {var}");
            assert!(
                (tail - 0.05).abs() < 0.003,
                "{name}: P(|x| > 1.96) = {tail}"
            );
        }
        let correlation = mean(&|p| p.0 * p.1);
        assert!(correlation.abs() < 0.01, "correlation {correlation}");
    }

    #[test]
    fn parallel_normals_are_the_sequential_draws() {
        // Empty, one element, around one piece, and several pieces with a
        // ragged end, on one thread and on several.
        let lens = [
            0,
            1,
            2,
            PIECE_MIN - 1,
            PIECE_MIN + 1,
            3 * PIECE_MIN + 12_345,
        ];
        for len in lens {
            let mut sequential = SplitMix64(7);
            let expected: Vec<u32> = (0..len.div_ceil(2))
                .flat_map(|_| {
                    let (a, b) = normal_pair(&mut sequential);
                    [a, b]
                })
                .take(len)
                .map(|x| (0.02 * x).to_bits())
                .collect();
            let after = sequential.next_u64();
            for threads in [1, 2, 3, 16] {
                let mut rng = SplitMix64(7);
                let mut out = vec![0.0f32; len];
                fill_normal_on(&mut out, 0.02, &mut rng, threads);
                assert!(
                    out.iter().map(|x| x.to_bits()).eq(expected.iter().copied()),
                    "{len} on {threads}"
                );
                assert_eq!(rng.next_u64(), after, "{len} on {threads}");
            }
        }
    }
}
