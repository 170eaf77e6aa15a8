//! A persistent thread pool, one thread per physical core and pinned to it,
//! that splits large tensors into a few contiguous pieces per thread, which
//! the threads share out as they go (so a thread slowed by a neighbour on
//! its core does not hold the others up). Small
//! tensors stay on the calling thread: waking workers costs more than it
//! saves below [`PoolConfig::parallel_elems_min`]. The `*_many` steps take
//! a whole list of tensors (a model's parameters) and cut all their
//! elements into one set of pieces, so the threads wake once per step
//! rather than once per tensor.
//!
//! Splits fall on multiples of [`SPLIT_ALIGN_ELEMS`], a whole number of
//! vectors on every back end, so results do not depend on the thread count.

use std::sync::{Arc, Mutex};

use half::bf16;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::adagrad::AdagradCoefficients;
use crate::adam::{
    AdamCoefficients, Master, OutOfPlaceShard, adam_step_bf16_master, adam_step_out_of_place_part,
    adam_step_part,
};
use crate::grads::{self, GradNorm};
use crate::lion::LionCoefficients;
use crate::rounding::Rounding;
use crate::single_state;
use crate::topology::{CpuTopology, pin_current_thread};
use crate::values::{LowPrecisionMut, Moments, MomentsRef, Split, Values};
use crate::{Isa, OptimError};

/// Most threads a pool may have.
pub const THREADS_MAX: usize = 256;

/// Pieces are cut at multiples of this many elements (a cache line of fp32
/// four times over; a whole number of vectors for every back end).
pub const SPLIT_ALIGN_ELEMS: usize = 64;

const _: () = assert!(SPLIT_ALIGN_ELEMS.is_multiple_of(crate::simd::LANES_MAX));

/// One tensor of [`Pool::adam_step_many`]: parameters, gradients,
/// moments, the optional 16-bit copy of the updated parameters, and how
/// its bf16 moments round ([`Rounding::Stochastic`]'s `first`: the global
/// index of the tensor's first element, so that no two tensors of a model
/// draw the same words).
pub type AdamShard<'a> = (
    &'a mut [f32],
    Values<'a>,
    Moments<'a>,
    Option<LowPrecisionMut<'a>>,
    Rounding,
);

/// One tensor of [`Pool::adagrad_step_many`] or [`Pool::lion_step_many`]:
/// parameters, gradients, the one fp32 state and the optional 16-bit copy.
pub type StateShard<'a> = (
    &'a mut [f32],
    Values<'a>,
    &'a mut [f32],
    Option<LowPrecisionMut<'a>>,
);

/// Pieces per thread a large call is cut into: the threads share them out
/// as they go (work stealing), so one slowed thread delays the call by a
/// piece, not by half of it.
pub const PIECES_PER_THREAD: usize = 4;

/// The default [`PoolConfig::piece_elems_min`]: 64K elements, some 20 us
/// of one core's work. No kernel decides anything by a piece's length
/// (whether outputs are streamed past the caches follows the whole call's),
/// so only the hand-off bounds the cut. Fine pieces let the caller start at
/// once and take over pieces while a sleeping worker wakes (tens of
/// microseconds on a VM): a 1M-parameter step cut into one piece per thread
/// waits for that wake-up with half the work still to do; and a large call
/// on many threads is cut into [`PIECES_PER_THREAD`] pieces per thread, not
/// one or two long ones.
pub const PIECE_ELEMS_MIN: usize = 1 << 16;

/// The longest [`Pool::wake`] keeps the threads spinning for a call that
/// does not come.
pub const WAKE_MAX: Duration = Duration::from_millis(20);

/// How to build a [`Pool`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolConfig {
    /// Threads; `None` means one per physical core this process may use.
    pub threads: Option<usize>,
    /// Pin each thread to its own core.
    pub pin: bool,
    /// Tensors shorter than this run on the calling thread.
    pub parallel_elems_min: usize,
    /// No call is cut into pieces shorter than this, beyond one per thread
    /// ([`PIECE_ELEMS_MIN`] by default).
    pub piece_elems_min: usize,
    /// Instruction set; `None` means [`Isa::chosen`].
    pub isa: Option<Isa>,
}

impl Default for PoolConfig {
    fn default() -> PoolConfig {
        PoolConfig {
            threads: None,
            pin: true,
            parallel_elems_min: 1 << 18,
            piece_elems_min: PIECE_ELEMS_MIN,
            isa: None,
        }
    }
}

/// The optimizer's threads, and the parallel form of every kernel.
pub struct Pool {
    isa: Isa,
    threads: usize,
    parallel_elems_min: usize,
    piece_elems_min: usize,
    /// `None` with one thread: everything runs on the caller.
    workers: Option<rayon::ThreadPool>,
    cpus: Vec<usize>,
    /// Parallel calls begun: threads kept awake by [`Pool::wake`] stop
    /// spinning when it moves.
    calls: Arc<AtomicU64>,
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
            piece_elems_min: config.piece_elems_min.max(1),
            workers,
            cpus,
            calls: Arc::new(AtomicU64::new(0)),
        })
    }

    /// Wakes the threads ahead of a call over `elems` elements about to
    /// come (its inputs still on their way), as OpenMP's active wait keeps
    /// its threads spinning: each spins until the pool's next parallel call
    /// begins, or for [`WAKE_MAX`], and this returns at once. A
    /// sleeping thread takes tens to hundreds of microseconds to run again
    /// (longest on a virtual machine's idle vCPU), which an update of a
    /// few million parameters would otherwise pay per call. The spinning
    /// threads take their cores: only for a pool whose cores nothing else
    /// needs meanwhile, woken by the one thread that makes its calls (they
    /// spin ahead of any call, another thread's too).
    pub fn wake(&self, elems: usize) {
        let Some(workers) = &self.workers else { return };
        if elems < self.parallel_elems_min {
            // Such a call runs on the caller alone.
            return;
        }
        self.spin_until_next_call(workers, Instant::now() + WAKE_MAX);
    }

    /// Keeps every thread of `workers` spinning until the next parallel
    /// call begins or `deadline` passes, without waiting for them.
    fn spin_until_next_call(&self, workers: &rayon::ThreadPool, deadline: Instant) {
        let calls = self.calls.clone();
        let seen = calls.load(Ordering::Acquire);
        workers.spawn_broadcast(move |_| {
            let mut spins = 0u32;
            while calls.load(Ordering::Acquire) == seen {
                std::hint::spin_loop();
                spins = spins.wrapping_add(1);
                if spins.is_multiple_of(64) && Instant::now() >= deadline {
                    return;
                }
            }
        });
    }

    /// Marks a parallel call's start: threads spinning in [`Pool::wake`]
    /// stop, and take its work.
    fn begin_call(&self) {
        self.calls.fetch_add(1, Ordering::Release);
    }

    /// The instruction set every kernel of this pool runs with.
    pub fn isa(&self) -> Isa {
        self.isa
    }

    /// Threads (1 means the calling thread only).
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Runs `work(i)` once on each of the pool's threads `i` in
    /// `0..threads()`, all at once (in a one-thread pool, once on the
    /// caller), and returns when every call has: for work that must happen
    /// on the threads themselves, such as committing the memory they will
    /// update, so that it lands on their NUMA nodes.
    pub fn on_each_thread(&self, work: &(dyn Fn(usize) + Sync)) {
        match &self.workers {
            Some(workers) => {
                self.begin_call();
                workers.broadcast(|context| work(context.index()));
            }
            None => work(0),
        }
    }

    /// The CPU each thread is pinned to (empty when not pinned).
    pub fn cpus(&self) -> &[usize] {
        &self.cpus
    }

    /// [`crate::adam_step`] over the pool.
    pub fn adam_step(
        &self,
        coefficients: &AdamCoefficients,
        params: &mut [f32],
        grads: Values<'_>,
        moments: Moments<'_>,
        out: Option<LowPrecisionMut<'_>>,
    ) {
        self.adam_step_rounded(coefficients, params, grads, moments, out, Rounding::Nearest)
    }

    /// [`crate::adam_step_rounded`] over the pool: each piece's random
    /// words come from its elements' global indices, so the result is the
    /// same on any number of threads.
    pub fn adam_step_rounded(
        &self,
        coefficients: &AdamCoefficients,
        params: &mut [f32],
        grads: Values<'_>,
        moments: Moments<'_>,
        out: Option<LowPrecisionMut<'_>>,
        rounding: Rounding,
    ) {
        let (isa, whole_len) = (self.isa, params.len());
        self.split(
            whole_len,
            (params, grads, moments, out, rounding),
            &|(p, g, m, o, r)| adam_step_part(isa, coefficients, p, g, m, o, r, whole_len),
        );
    }

    /// [`crate::adam_step_out_of_place`] over the pool.
    #[allow(clippy::too_many_arguments)]
    pub fn adam_step_out_of_place<P: Master>(
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
        let whole_len = params_out.len();
        let shard = OutOfPlaceShard {
            coefficients,
            params_in,
            moments_in,
            grads,
            params_out,
            moments_out,
            out,
            rounding,
        };
        self.split(whole_len, shard, &|s| {
            adam_step_out_of_place_part(isa, s, whole_len)
        });
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

    /// [`crate::adagrad_step`] over the pool.
    pub fn adagrad_step(
        &self,
        coefficients: &AdagradCoefficients,
        params: &mut [f32],
        grads: Values<'_>,
        state: &mut [f32],
        out: Option<LowPrecisionMut<'_>>,
    ) {
        let (isa, whole_len) = (self.isa, params.len());
        self.split(whole_len, (params, grads, state, out), &|(p, g, s, o)| {
            single_state::step(isa, coefficients, p, g, s, o, whole_len)
        });
    }

    /// [`crate::lion_step`] over the pool.
    pub fn lion_step(
        &self,
        coefficients: &LionCoefficients,
        params: &mut [f32],
        grads: Values<'_>,
        momentum: &mut [f32],
        out: Option<LowPrecisionMut<'_>>,
    ) {
        let (isa, whole_len) = (self.isa, params.len());
        self.split(whole_len, (params, grads, momentum, out), &|(
            p,
            g,
            m,
            o,
        )| {
            single_state::step(isa, coefficients, p, g, m, o, whole_len)
        });
    }

    /// [`crate::adam_step_rounded`] over many tensors in one call (a
    /// model's parameters): the threads wake once for all of them. Each
    /// tensor ends as [`Pool::adam_step_rounded`] would leave it with its
    /// rounding, bit for bit, on any number of threads; whether the
    /// 16-bit copies are streamed past the caches follows the whole call's
    /// length.
    pub fn adam_step_many(&self, coefficients: &AdamCoefficients, shards: Vec<AdamShard<'_>>) {
        let isa = self.isa;
        let whole_len = shards.iter().map(|s| s.0.len()).sum();
        self.split_many(shards, |s| s.0.len(), &|(p, g, m, o, r)| {
            adam_step_part(isa, coefficients, p, g, m, o, r, whole_len)
        });
    }

    /// [`crate::adam_step_out_of_place`] over many tensors, or many stretches of
    /// host memory, in one call, as [`Pool::adam_step_many`]: the training
    /// engine's update of a group whose states lie in host chunks of a few
    /// hundred KiB. Whether the outputs are streamed past the caches
    /// follows the whole call's length, not a stretch's.
    pub fn adam_step_out_of_place_many<P: Master>(&self, shards: Vec<OutOfPlaceShard<'_, P>>) {
        let isa = self.isa;
        let whole_len = shards.iter().map(|s| s.params_out.len()).sum();
        self.split_many(shards, |s| s.params_out.len(), &|s| {
            adam_step_out_of_place_part(isa, s, whole_len)
        });
    }

    /// [`crate::adagrad_step`] over many tensors in one call, as
    /// [`Pool::adam_step_many`].
    pub fn adagrad_step_many(
        &self,
        coefficients: &AdagradCoefficients,
        shards: Vec<StateShard<'_>>,
    ) {
        self.state_step_many(coefficients, shards)
    }

    /// [`crate::lion_step`] over many tensors in one call, as
    /// [`Pool::adam_step_many`] (the state is the momentum).
    pub fn lion_step_many(&self, coefficients: &LionCoefficients, shards: Vec<StateShard<'_>>) {
        self.state_step_many(coefficients, shards)
    }

    fn state_step_many<R: single_state::Rule>(&self, rule: &R, shards: Vec<StateShard<'_>>) {
        let isa = self.isa;
        let whole_len = shards.iter().map(|s| s.0.len()).sum();
        self.split_many(shards, |s| s.0.len(), &|(p, g, s, o)| {
            single_state::step(isa, rule, p, g, s, o, whole_len)
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

    /// How many pieces `len` elements are cut into: [`PIECES_PER_THREAD`]
    /// per thread, so that threads which finish early take over pieces
    /// from one slowed down (by a core it shares with torch's OpenMP
    /// threads spinning after their last parallel region, say), but none
    /// shorter than [`PoolConfig::piece_elems_min`], and at least one per
    /// thread.
    fn pieces(&self, len: usize) -> usize {
        (self.threads * PIECES_PER_THREAD)
            .min(len / self.piece_elems_min)
            .max(self.threads)
    }

    /// Runs `kernel` over every shard, the elements of all of them cut
    /// into runs of about equal length ([`Pool::pieces`]; a shard may be
    /// cut, at a multiple of [`SPLIT_ALIGN_ELEMS`]): the threads wake once
    /// for the whole list, and small shards share the threads too.
    /// `len` gives a shard's length.
    fn split_many<A: Split + Send>(
        &self,
        shards: Vec<A>,
        len: fn(&A) -> usize,
        kernel: &(dyn Fn(A) + Sync),
    ) {
        let total = shards.iter().map(len).sum::<usize>();
        match &self.workers {
            Some(workers) if total >= self.parallel_elems_min => {
                // An unpinned pool's caller takes runs too, beside threads - 1
                // workers (as an OpenMP master does): it would only wait
                // otherwise, and no wake-up chain stands between the call and
                // the work. A pinned pool keeps one thread per core: every
                // worker takes runs and the caller waits.
                self.begin_call();
                let caller_works = self.cpus.is_empty();
                let pieces = self.pieces(total);
                let runs = cut_runs(shards, len, total, pieces);
                let queue = Mutex::new(runs.into_iter());
                let drain = || loop {
                    // The lock is released before the run starts.
                    let next = queue.lock().unwrap_or_else(|p| p.into_inner()).next();
                    match next {
                        Some(run) => run.into_iter().for_each(kernel),
                        None => break,
                    }
                };
                workers.in_place_scope(|scope| {
                    for _ in usize::from(caller_works)..self.threads {
                        scope.spawn(|_| drain());
                    }
                    if caller_works {
                        drain();
                    }
                });
            }
            _ => shards.into_iter().for_each(kernel),
        }
    }

    /// Runs `kernel` over one shard of `len` elements in pieces.
    fn split<A: Split + Send>(&self, len: usize, args: A, kernel: &(dyn Fn(A) + Sync)) {
        self.split_reduce(len, args, kernel, |(), ()| ())
    }

    /// Runs `kernel` on [`Pool::pieces`] pieces and folds the results.
    fn split_reduce<A: Split + Send, R: Send>(
        &self,
        len: usize,
        args: A,
        kernel: &(dyn Fn(A) -> R + Sync),
        combine: fn(R, R) -> R,
    ) -> R {
        match &self.workers {
            Some(workers) if len >= self.parallel_elems_min => {
                self.begin_call();
                workers.install(|| split_into(args, len, self.pieces(len), kernel, combine))
            }
            _ => kernel(args),
        }
    }
}

/// Halves `args` until there are `pieces` pieces, each half on its own
/// rayon task (join runs on the stack; nothing is allocated); idle threads
/// steal the halves not yet started.
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

/// Deals `shards` (`total` elements) into `runs` runs in order, each ending
/// at about `total * (i + 1) / runs` elements; a shard that crosses a run's
/// end is cut there (rounded down to [`SPLIT_ALIGN_ELEMS`]).
fn cut_runs<A: Split>(
    shards: Vec<A>,
    len: impl Fn(&A) -> usize,
    total: usize,
    runs: usize,
) -> Vec<Vec<A>> {
    let mut out: Vec<Vec<A>> = (0..runs).map(|_| Vec::new()).collect();
    let (mut run, mut dealt) = (0, 0);
    for mut shard in shards {
        let mut left = len(&shard);
        loop {
            let room = (total * (run + 1) / runs).saturating_sub(dealt);
            if left <= room || run + 1 == runs {
                out[run].push(shard);
                dealt += left;
                break;
            }
            let take = room / SPLIT_ALIGN_ELEMS * SPLIT_ALIGN_ELEMS;
            if take > 0 {
                let (head, tail) = shard.split_at(take);
                out[run].push(head);
                (shard, dealt, left) = (tail, dealt + take, left - take);
            }
            run += 1;
        }
    }
    out
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

#[cfg(test)]
mod tests {
    use super::*;

    /// `threads` unpinned threads that take any call in parallel.
    fn unpinned(threads: usize) -> Pool {
        Pool::new(PoolConfig {
            threads: Some(threads),
            pin: false,
            parallel_elems_min: 0,
            ..PoolConfig::default()
        })
        .unwrap()
    }

    /// Threads spinning ahead of a call stop when it begins, whichever way
    /// the call enters the pool (a broadcast, one tensor's split, a list's
    /// runs), not at their deadline (10 s away, so a call that had to wait
    /// for them would take it), and a woken pool's results are the calling
    /// thread's.
    #[test]
    fn a_call_stops_the_threads_woken_for_it() {
        let pool = unpinned(3);
        let workers = pool.workers.as_ref().expect("3 threads");
        let n = 10_000;
        let c = crate::AdamConfig::adamw(1e-3).coefficients(1, 1.0).unwrap();
        let grads: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
        let states = || (vec![0.5f32; n], vec![0.0f32; n], vec![0.0f32; n]);
        let calls: [&dyn Fn(); 3] = [
            &|| {
                let seen = std::sync::atomic::AtomicUsize::new(0);
                pool.on_each_thread(&|_| {
                    seen.fetch_add(1, Ordering::Relaxed);
                });
                assert_eq!(seen.load(Ordering::Relaxed), 3);
            },
            &|| {
                let (mut p, mut m, mut v) = states();
                let moments = Moments::F32 {
                    m: &mut m,
                    v: &mut v,
                };
                pool.adam_step(&c, &mut p, Values::F32(&grads), moments, None);
            },
            &|| {
                let (mut p, mut m, mut v) = states();
                let moments = Moments::F32 {
                    m: &mut m,
                    v: &mut v,
                };
                pool.adam_step_many(
                    &c,
                    vec![(
                        &mut p,
                        Values::F32(&grads),
                        moments,
                        None,
                        Rounding::Nearest,
                    )],
                );
            },
        ];
        for (k, call) in calls.iter().enumerate() {
            let started = Instant::now();
            pool.spin_until_next_call(workers, started + Duration::from_secs(10));
            call();
            assert!(
                started.elapsed() < Duration::from_secs(5),
                "call {k} waited for the spinners"
            );
        }
        let run = |wake: bool| {
            let (mut p, mut m, mut v) = states();
            if wake {
                pool.wake(n);
            }
            let moments = Moments::F32 {
                m: &mut m,
                v: &mut v,
            };
            pool.adam_step(&c, &mut p, Values::F32(&grads), moments, None);
            (p, m, v)
        };
        assert_eq!(run(true), run(false));
    }

    /// The runs of `cut_runs` over slices of the given lengths: (start
    /// address offset, length) of each piece, per run.
    fn runs(lens: &[usize], threads: usize) -> Vec<Vec<(usize, usize)>> {
        let data = vec![0u8; lens.iter().sum()];
        let mut shards = Vec::new();
        let mut rest = &data[..];
        for &n in lens {
            let (shard, tail) = rest.split_at(n);
            shards.push(shard);
            rest = tail;
        }
        let total = data.len();
        let base = data.as_ptr() as usize;
        cut_runs(shards, |s| s.len(), total, threads)
            .into_iter()
            .map(|run| {
                run.iter()
                    .map(|s| (s.as_ptr() as usize - base, s.len()))
                    .collect()
            })
            .collect()
    }

    #[test]
    fn calls_are_cut_into_pieces_per_thread_down_to_the_minimum() {
        let pool = |threads| {
            Pool::new(PoolConfig {
                threads: Some(threads),
                pin: false,
                ..PoolConfig::default()
            })
            .unwrap()
        };
        // A 1M-element step on 2 threads: four pieces per thread.
        assert_eq!(pool(2).pieces(1 << 20), 2 * PIECES_PER_THREAD);
        // 64M elements on 16 threads: four each too (with 3M-element
        // pieces, when the 16-bit copy streamed by a piece's length, 21
        // pieces left 5 threads two each and the rest idle half the time).
        assert_eq!(pool(16).pieces(64 << 20), 16 * PIECES_PER_THREAD);
        // No piece under the minimum beyond one per thread.
        assert_eq!(pool(2).pieces(3 * PIECE_ELEMS_MIN + 5), 3);
        assert_eq!(pool(4).pieces(PIECE_ELEMS_MIN), 4);
    }

    /// `n` copies of `fill` starting on a page boundary (with what holds them).
    fn on_page<T: Copy>(n: usize, fill: T) -> (Vec<T>, usize) {
        let size = std::mem::size_of::<T>();
        let storage = vec![fill; n + 4096 / size];
        let address = storage.as_ptr() as usize;
        let start = (address.next_multiple_of(4096) - address) / size;
        (storage, start)
    }

    #[test]
    fn every_piece_of_a_long_call_streams_and_no_short_call_does() {
        use crate::{AdagradConfig, AdamConfig, LionConfig};
        // 12 pieces of about 175K elements on 3 threads.
        let n = (1 << 21) + 4099;
        let pool = unpinned(3);
        let pieces = pool.pieces(n);
        assert_eq!(pieces, 12);
        let streamed = || {
            let total = Mutex::new(crate::simd::take_streamed());
            pool.on_each_thread(&|_| *total.lock().unwrap() += crate::simd::take_streamed());
            total.into_inner().unwrap()
        };
        streamed();
        let (mut p, at) = on_page(n, 0.5f32);
        let (mut out, at_out) = on_page(n, bf16::ZERO);
        let (p, out) = (&mut p[at..at + n], &mut out[at_out..at_out + n]);
        let (mut s1, mut s2, g) = (vec![0.25f32; n], vec![0.25f32; n], vec![bf16::ONE; n]);
        let adam = AdamConfig::adamw(1e-3).coefficients(1, 1.0).unwrap();
        fn copy(out: &mut [bf16]) -> Option<LowPrecisionMut<'_>> {
            Some(LowPrecisionMut::Bf16(out))
        }
        let moments = Moments::F32 {
            m: &mut s1,
            v: &mut s2,
        };
        pool.adam_step(&adam, p, Values::Bf16(&g), moments, copy(out));
        assert_eq!(streamed(), pieces, "adam");
        let adagrad = AdagradConfig::new(1e-2).coefficients(1, 1.0).unwrap();
        pool.adagrad_step(&adagrad, p, Values::Bf16(&g), &mut s1, copy(out));
        assert_eq!(streamed(), pieces, "adagrad");
        let lion = LionConfig::new(1e-3).coefficients(1, 1.0).unwrap();
        pool.lion_step(&lion, p, Values::Bf16(&g), &mut s1, copy(out));
        assert_eq!(streamed(), pieces, "lion");
        // One call of 1M elements on this thread: too short to stream.
        let short = 1 << 20;
        let moments = Moments::F32 {
            m: &mut s1[..short],
            v: &mut s2[..short],
        };
        let g = Values::Bf16(&g[..short]);
        crate::adam_step(
            pool.isa(),
            &adam,
            &mut p[..short],
            g,
            moments,
            copy(&mut out[..short]),
        );
        assert_eq!(streamed(), 0);
    }

    #[test]
    fn work_on_each_thread_runs_once_on_every_thread_of_the_pool() {
        for threads in [1, 2, 3] {
            let pool = Pool::new(PoolConfig {
                threads: Some(threads),
                pin: false,
                ..PoolConfig::default()
            })
            .unwrap();
            let seen = Mutex::new(Vec::new());
            pool.on_each_thread(&|i| {
                let name = std::thread::current().name().map(str::to_string);
                seen.lock().unwrap().push((i, name));
            });
            let mut seen = seen.into_inner().unwrap();
            seen.sort();
            assert_eq!(
                seen.iter().map(|(i, _)| *i).collect::<Vec<_>>(),
                (0..threads).collect::<Vec<_>>()
            );
            if threads > 1 {
                // Each index on the pool's thread of that index.
                for (i, name) in &seen {
                    assert_eq!(name.as_deref(), Some(format!("strata-optim-{i}").as_str()));
                }
            }
        }
    }

    #[test]
    fn runs_cover_every_element_once_in_order_and_about_evenly() {
        for (lens, threads) in [
            (vec![1 << 20; 8], 2),
            (vec![1 << 20; 8], 3),
            (vec![5_000_000, 3, 0, 700_001, 64, 1 << 18], 4),
            (vec![100; 50], 7),
            (vec![10], 4),
            (vec![], 2),
        ] {
            let runs = runs(&lens, threads);
            assert_eq!(runs.len(), threads);
            let pieces: Vec<(usize, usize)> = runs.iter().flatten().copied().collect();
            let mut next = 0;
            for &(at, len) in &pieces {
                assert_eq!(
                    at, next,
                    "{lens:?} on {threads}: pieces in order, no gap or overlap"
                );
                next += len;
            }
            let total: usize = lens.iter().sum();
            assert_eq!(next, total);
            for run in &runs {
                let len: usize = run.iter().map(|p| p.1).sum();
                // Each run ends within one alignment step of its share.
                assert!(
                    len.abs_diff(total / threads) <= 2 * SPLIT_ALIGN_ELEMS,
                    "{lens:?} on {threads}: a run of {len}"
                );
            }
            // A shard is cut only at aligned points inside it.
            for &(at, len) in &pieces {
                let shard_start = lens
                    .iter()
                    .scan(0, |s, &n| {
                        let a = *s;
                        *s += n;
                        Some(a)
                    })
                    .filter(|&s| s <= at)
                    .last()
                    .unwrap_or(0);
                assert_eq!(
                    (at - shard_start) % SPLIT_ALIGN_ELEMS,
                    0,
                    "{lens:?}: piece at {at}+{len}"
                );
            }
        }
    }
}
