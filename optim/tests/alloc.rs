//! Steps allocate nothing: a counting allocator watches the kernels on the
//! calling thread (zero allocations) and through the pool (only rayon's
//! job-queue blocks, a few per thousand calls; measured here so a change
//! that allocates per step fails).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};

use strata_optim::{
    AdamConfig, Isa, LowPrecisionMut, Moments, Pool, PoolConfig, Values, adam_step, bf16,
};

struct Counting;

static ALLOCATIONS: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    /// This thread's allocations: the calling-thread check counts only its
    /// own (the test harness's other thread may allocate meanwhile).
    static MINE: Cell<usize> = const { Cell::new(0) };
}

// SAFETY: forwards every call to the system allocator unchanged; counting
// has no effect on the memory handed out.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        let _ = MINE.try_with(|mine| mine.set(mine.get() + 1));
        // SAFETY: the caller's layout contract is passed on as is.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `System.alloc` with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

#[test]
fn steps_do_not_allocate() {
    let n = 1 << 20;
    let grads = vec![bf16::from_f32(0.01); n];
    let (mut p, mut m, mut v, mut out) = (
        vec![0.5f32; n],
        vec![0.0f32; n],
        vec![0.0f32; n],
        vec![bf16::ZERO; n],
    );
    let c = AdamConfig::adamw(1e-3).coefficients(1, 1.0).unwrap();
    let calls = 1000;
    for isa in Isa::available() {
        let before = MINE.with(Cell::get);
        for _ in 0..calls {
            let moments = Moments::F32 {
                m: &mut m[..4096],
                v: &mut v[..4096],
            };
            let out = Some(LowPrecisionMut::Bf16(&mut out[..4096]));
            adam_step(
                isa,
                &c,
                &mut p[..4096],
                Values::Bf16(&grads[..4096]),
                moments,
                out,
            );
        }
        assert_eq!(
            MINE.with(Cell::get) - before,
            0,
            "{isa}: a step on the calling thread allocated"
        );
    }
    // Started only now: its threads allocate as they start.
    let pool = Pool::new(PoolConfig {
        threads: Some(2),
        parallel_elems_min: 0,
        // Cut into several pieces per thread, as large calls are.
        piece_elems_min: 256,
        ..PoolConfig::default()
    })
    .unwrap();
    // Warm the pool's queues, then count.
    let step = |p: &mut [f32], m: &mut [f32], v: &mut [f32], out: &mut [bf16]| {
        let moments = Moments::F32 { m, v };
        pool.adam_step(
            &c,
            p,
            Values::Bf16(&grads[..p.len()]),
            moments,
            Some(LowPrecisionMut::Bf16(out)),
        );
    };
    for _ in 0..100 {
        step(
            &mut p[..8192],
            &mut m[..8192],
            &mut v[..8192],
            &mut out[..8192],
        );
    }
    let before = ALLOCATIONS.load(Ordering::Relaxed);
    for _ in 0..calls {
        step(
            &mut p[..8192],
            &mut m[..8192],
            &mut v[..8192],
            &mut out[..8192],
        );
    }
    let pooled = ALLOCATIONS.load(Ordering::Relaxed) - before;
    println!("{pooled} allocations in {calls} pooled steps");
    assert!(
        pooled * 20 <= calls,
        "{pooled} allocations in {calls} pooled steps"
    );
}
