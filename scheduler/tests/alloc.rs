//! Following a plan allocates nothing: a counting allocator watches a
//! tracker run steps that match their primed plan (so a change that
//! records or clones ops per step fails here).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use strata_scheduler::{
    Access, Follow, Link, Links, Mode, Op, PlanConfig, Policy, Processor, StepTracker, TensorClass,
    TensorSpec, Tier, Trace,
};

struct Counting;

static ALLOCATIONS: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards every call to the system allocator unchanged; counting
// has no effect on the memory handed out.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
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
fn steps_that_follow_their_plan_do_not_allocate() {
    let link = Link {
        bytes_per_s: 1e9,
        latency_ns: 10,
    };
    let config = PlanConfig {
        capacity_bytes: [200, 1000, 10_000],
        links: Links {
            host_to_device: link,
            device_to_host: link,
            nvme_read: link,
            nvme_write: link,
            nvme_duplex: false,
        },
        policy: Policy::strata(4, 2, 200),
    };
    let tensors: Vec<TensorSpec> = (0..8)
        .map(|i| TensorSpec {
            name: format!("t{i}"),
            bytes: 60,
            class: TensorClass::Param,
            home: Some(Tier::Nvme),
        })
        .collect();
    let ops: Vec<Op> = (0..16)
        .map(|k| {
            let access = Access {
                tensor: (k % 8) as u32,
                mode: Mode::Read,
            };
            Op::new(format!("op{k}"), Processor::Gpu, vec![access], 1000)
        })
        .collect();
    let mut tracker = StepTracker::new(config, tensors.len(), 64, 4);
    for spec in &tensors {
        tracker.tensor(spec.clone()).unwrap();
    }
    tracker
        .prime(&Trace {
            tensors: tensors.clone(),
            ops: ops.clone(),
        })
        .unwrap();
    let mut actions = 0;
    let mut step = |tracker: &mut StepTracker| {
        if let Follow::Plan(issued) = tracker.begin_step_with(&ops[0]) {
            actions += issued.len();
        }
        for op in &ops {
            match tracker.op(op).unwrap() {
                Follow::Plan(issued) => actions += issued.len(),
                Follow::Demand => panic!("{} departed from its plan", op.name),
            }
        }
        assert!(!tracker.end_step().unwrap(), "nothing new to plan");
    };
    step(&mut tracker);
    let before = ALLOCATIONS.load(Ordering::Relaxed);
    for _ in 0..100 {
        step(&mut tracker);
    }
    let allocations = ALLOCATIONS.load(Ordering::Relaxed) - before;
    assert_eq!(allocations, 0, "100 followed steps allocated");
    assert!(actions > 0, "the plan moves tensors");
}
