//! A persistent thread pool, one thread per physical core and pinned to it,
//! that splits large tensors into one contiguous piece per thread. Small
//! tensors stay on the calling thread: waking workers costs more than it
//! saves below [`PoolConfig::parallel_elems_min`].
//!
//! Splits fall on multiples of [`SPLIT_ALIGN_ELEMS`], a whole number of
//! vectors on every back end, so results do not depend on the thread count.

use std::sync::Arc;

use half::bf16;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::adagrad::{AdagradCoefficients, adagrad_step};
use crate::adam::{
    AdamCoefficients, adam_step, adam_step_bf16_master, adam_step_out_of_place, adam_step_rounded,
};
use crate::grads::{self, GradNorm};
use crate::lion::{LionCoefficients, lion_step};
use crate::rounding::Rounding;
use crate::topology::{CpuTopology, pin_current_thread};
use crate::values::{LowPrecisionMut, Moments, MomentsRef, Split, Values};
use crate::{Element, Isa, OptimError};

/// Most threads a pool may have.
pub const THREADS_MAX: usize = 256;

/// Pieces are cut at multiples of this many elements (a cache line of fp32
/// four times over; a whole number of vectors for every back end).
pub const SPLIT_ALIGN_ELEMS: usize = 64;

const _: () = assert!(SPLIT_ALIGN_ELEMS.is_multiple_of(crate::simd::LANES_MAX));

/// How to build a [`Pool`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolConfig {
    /// Threads; `None` means one per physical core this process may use.
    pub threads: Option<usize>,
    /// Pin each thread to its own core.
    pub pin: bool,
    /// Tensors shorter than this run on the calling thread.
    pub parallel_elems_min: usize,
    /// Instruction set; `None` means [`Isa::chosen`].
    pub isa: Option<Isa>,
}

impl Default for PoolConfig {
    fn default() -> PoolConfig {
        PoolConfig {
            threads: None,
            pin: true,
            parallel_elems_min: 1 << 18,
            isa: None,
        }
    }
}

/// The optimizer's threads, and the parallel form of every kernel.
pub struct Pool {
    isa: Isa,
    threads: usize,
    parallel_elems_min: usize,
    /// `None` with one thread: everything runs on the caller.
    workers: Option<rayon::ThreadPool>,
    cpus: Vec<usize>,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field("isa", &self.isa)
            .field("threads", &self.threads)
            .field("cpus", &self.cpus)
            .finish()
    }
}

impl Pool {
    /// Starts the threads (once; they live as long as the pool).
    pub fn new(config: PoolConfig) -> Result<Pool, OptimError> {
        let topology = CpuTopology::detect();
        let threads = config.threads.unwrap_or(topology.core_count());
        if threads == 0 || threads > THREADS_MAX {
            return Err(OptimError::Threads {
                threads,
                threads_max: THREADS_MAX,
            });
        }
        let isa = config.isa.unwrap_or_else(Isa::chosen);
        let cpus: Vec<usize> = match config.pin {
            true => (0..threads).map(|i| topology.cpu_for_thread(i)).collect(),
            false => Vec::new(),
        };
        let workers = match threads {
            1 => None,
            _ => Some(start_workers(threads, cpus.clone())?),
        };
        tracing::debug!(threads, %isa, ?cpus, source = topology.source, "optimizer pool started");
        Ok(Pool {
            isa,
            threads,
            parallel_elems_min: config.parallel_elems_min,
            workers,
            cpus,
        })
    }

    /// The instruction set every kernel of this pool runs with.
    pub fn isa(&self) -> Isa {
        self.isa
    }

    /// Threads (1 means the calling thread only).
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// The CPU each thread is pinned to (empty when not pinned).
    pub fn cpus(&self) -> &[usize] {
        &self.cpus
    }

    /// [`adam_step`] over the pool.
    pub fn adam_step(
        &self,
        coefficients: &AdamCoefficients,
        params: &mut [f32],
        grads: Values<'_>,
        moments: Moments<'_>,
        out: Option<LowPrecisionMut<'_>>,
    ) {
        let isa = self.isa;
        self.split(params.len(), (params, grads, moments, out), &|(
            p,
            g,
            m,
            o,
        )| {
            adam_step(isa, coefficients, p, g, m, o)
        });
    }

    /// [`adam_step_rounded`] over the pool: each piece's random words come
    /// from its elements' global indices, so the result is the same on any
    /// number of threads.
    pub fn adam_step_rounded(
        &self,
        coefficients: &AdamCoefficients,
        params: &mut [f32],
        grads: Values<'_>,
        moments: Moments<'_>,
        out: Option<LowPrecisionMut<'_>>,
        rounding: Rounding,
    ) {
        let isa = self.isa;
        self.split(
            params.len(),
            (params, grads, moments, out, rounding),
            &|(p, g, m, o, r)| adam_step_rounded(isa, coefficients, p, g, m, o, r),
        );
    }

    /// [`adam_step_out_of_place`] over the pool.
    #[allow(clippy::too_many_arguments)]
    pub fn adam_step_out_of_place<P: Element>(
        &self,
        coefficients: &AdamCoefficients,
        params_in: &[P],
        moments_in: MomentsRef<'_>,
        grads: Values<'_>,
        params_out: &mut [P],
        moments_out: Moments<'_>,
        out: Option<LowPrecisionMut<'_>>,
        rounding: Rounding,
    ) {
        let isa = self.isa;
        self.split(
            params_out.len(),
            (
                params_in,
                moments_in,
                grads,
                params_out,
                moments_out,
                out,
                rounding,
            ),
            &|(p0, m0, g, p, m, o, r)| {
                adam_step_out_of_place(isa, coefficients, p0, m0, g, p, m, o, r)
            },
        );
    }

    /// [`adam_step_bf16_master`] over the pool (the same result on any
    /// number of threads).
    pub fn adam_step_bf16_master(
        &self,
        coefficients: &AdamCoefficients,
        params: &mut [bf16],
        grads: Values<'_>,
        moments: Moments<'_>,
        rounding: Rounding,
    ) {
        let isa = self.isa;
        self.split(
            params.len(),
            (params, grads, moments, rounding),
            &|(p, g, m, r)| adam_step_bf16_master(isa, coefficients, p, g, m, r),
        );
    }

    /// [`adagrad_step`] over the pool.
    pub fn adagrad_step(
        &self,
        coefficients: &AdagradCoefficients,
        params: &mut [f32],
        grads: Values<'_>,
        state: &mut [f32],
        out: Option<LowPrecisionMut<'_>>,
    ) {
        let isa = self.isa;
        self.split(params.len(), (params, grads, state, out), &|(
            p,
            g,
            s,
            o,
        )| {
            adagrad_step(isa, coefficients, p, g, s, o)
        });
    }

    /// [`lion_step`] over the pool.
    pub fn lion_step(
        &self,
        coefficients: &LionCoefficients,
        params: &mut [f32],
        grads: Values<'_>,
        momentum: &mut [f32],
        out: Option<LowPrecisionMut<'_>>,
    ) {
        let isa = self.isa;
        self.split(params.len(), (params, grads, momentum, out), &|(
            p,
            g,
            m,
            o,
        )| {
            lion_step(isa, coefficients, p, g, m, o)
        });
    }

    /// [`grads::grad_norm`] over the pool, summed over every shard given.
    pub fn grad_norm(&self, shards: &[Values<'_>]) -> GradNorm {
        let isa = self.isa;
        shards.iter().fold(GradNorm::default(), |total, &shard| {
            total
                + (self.split_reduce(
                    shard.len(),
                    shard,
                    &|g| grads::grad_norm(isa, g),
                    std::ops::Add::add,
                ))
        })
    }

    /// [`grads::accumulate`] over the pool.
    pub fn accumulate(&self, acc: &mut [f32], incoming: Values<'_>) {
        let isa = self.isa;
        self.split(acc.len(), (acc, incoming), &|(a, x)| {
            grads::accumulate(isa, a, x)
        });
    }

    /// [`grads::narrow`] over the pool.
    pub fn narrow(&self, source: &[f32], target: LowPrecisionMut<'_>) {
        let isa = self.isa;
        self.split(source.len(), (source, target), &|(s, t)| {
            grads::narrow(isa, s, t)
        });
    }

    /// [`grads::widen`] over the pool.
    pub fn widen(&self, source: Values<'_>, target: &mut [f32]) {
        let isa = self.isa;
        self.split(target.len(), (source, target), &|(s, t)| {
            grads::widen(isa, s, t)
        });
    }

    /// [`grads::roofline_4r3w`] over the pool.
    pub fn roofline_4r3w(&self, a: &mut [f32], b: &[f32], c: &mut [f32], d: &mut [f32]) {
        let isa = self.isa;
        self.split(a.len(), (a, b, c, d), &|(a, b, c, d)| {
            grads::roofline_4r3w(isa, a, b, c, d)
        });
    }

    fn split<A: Split + Send>(&self, len: usize, args: A, kernel: &(dyn Fn(A) + Sync)) {
        self.split_reduce(len, args, kernel, |(), ()| ())
    }

    /// Runs `kernel` on one piece per thread and folds the results.
    fn split_reduce<A: Split + Send, R: Send>(
        &self,
        len: usize,
        args: A,
        kernel: &(dyn Fn(A) -> R + Sync),
        combine: fn(R, R) -> R,
    ) -> R {
        match &self.workers {
            Some(workers) if len >= self.parallel_elems_min => {
                workers.install(|| split_into(args, len, self.threads, kernel, combine))
            }
            _ => kernel(args),
        }
    }
}

/// Halves `args` until there are `pieces` pieces, each half on its own
/// rayon task (join runs on the stack; nothing is allocated).
fn split_into<A: Split + Send, R: Send>(
    args: A,
    len: usize,
    pieces: usize,
    kernel: &(dyn Fn(A) -> R + Sync),
    combine: fn(R, R) -> R,
) -> R {
    if pieces <= 1 || len < 2 * SPLIT_ALIGN_ELEMS {
        return kernel(args);
    }
    let left_pieces = pieces / 2;
    let mid = (len * left_pieces / pieces) / SPLIT_ALIGN_ELEMS * SPLIT_ALIGN_ELEMS;
    let (left, right) = args.split_at(mid);
    let (a, b) = rayon::join(
        || split_into(left, mid, left_pieces, kernel, combine),
        || split_into(right, len - mid, pieces - left_pieces, kernel, combine),
    );
    combine(a, b)
}

fn start_workers(threads: usize, cpus: Vec<usize>) -> Result<rayon::ThreadPool, OptimError> {
    let warned = Arc::new(AtomicBool::new(false));
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|index| format!("strata-optim-{index}"))
        .start_handler(move |index| {
            let Some(&cpu) = cpus.get(index) else { return };
            if let Err(error) = pin_current_thread(cpu)
                && !warned.swap(true, Ordering::Relaxed)
            {
                tracing::warn!("cannot pin optimizer threads to cores ({error}); running unpinned");
            }
        })
        .build()
        .map_err(|error| OptimError::Pool {
            reason: error.to_string(),
        })
}
