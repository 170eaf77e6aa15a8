//! Property tests: random traces x random budgets x both policies. A plan
//! never exceeds a budget, every op finds its tensors on its tier, every
//! tensor is back home at the end, and the simulator runs it to the end
//! without going over a budget either.

use proptest::prelude::*;
use strata_scheduler::{
    Access, Link, Links, Mode, Op, PlanConfig, Policy, Processor, SchedulerError, SimConfig,
    TensorClass, TensorSpec, Tier, Trace, plan, simulate, verify,
};

const CLASSES: [TensorClass; 5] = [
    TensorClass::Param,
    TensorClass::Grad,
    TensorClass::OptimizerState,
    TensorClass::Activation,
    TensorClass::Other,
];

fn links() -> Links {
    let link = |gbps: f64| Link {
        bytes_per_s: gbps,
        latency_ns: 5,
    };
    Links {
        host_to_device: link(10.0),
        device_to_host: link(8.0),
        nvme_read: link(3.0),
        nvme_write: link(2.0),
        nvme_duplex: false,
    }
}

/// A valid random trace: tensors without a home are written first.
fn traces() -> impl Strategy<Value = Trace> {
    let tensors = prop::collection::vec((1u64..100, 0usize..4, 0usize..5), 1..12);
    let ops = prop::collection::vec(
        (
            any::<bool>(),
            prop::collection::vec((0usize..12, 0usize..3), 1..4),
            1u64..50,
            0u64..5,
            any::<bool>(),
        ),
        1..30,
    );
    (tensors, ops).prop_map(|(tensors, ops)| {
        let homes = [None, Some(Tier::Device), Some(Tier::Host), Some(Tier::Nvme)];
        let tensors: Vec<TensorSpec> = tensors
            .into_iter()
            .enumerate()
            .map(|(i, (bytes, home, class))| TensorSpec {
                name: format!("t{i}"),
                bytes,
                class: CLASSES[class],
                home: homes[home],
            })
            .collect();
        let mut written: Vec<bool> = tensors.iter().map(|t| t.home.is_some()).collect();
        let ops = ops
            .into_iter()
            .enumerate()
            .map(|(k, (gpu, accesses, compute_ns, reduce_ns, barrier))| {
                let mut list: Vec<Access> = Vec::new();
                for (tensor, mode) in accesses {
                    let tensor = tensor % tensors.len();
                    if list.iter().any(|a| a.tensor as usize == tensor) {
                        continue;
                    }
                    let mode = if written[tensor] {
                        [Mode::Read, Mode::Write, Mode::Update][mode]
                    } else {
                        Mode::Write
                    };
                    written[tensor] = true;
                    list.push(Access {
                        tensor: tensor as u32,
                        mode,
                    });
                }
                Op {
                    name: format!("op{k}"),
                    processor: if gpu { Processor::Gpu } else { Processor::Cpu },
                    accesses: list,
                    compute_ns,
                    gather_ns: if gpu { reduce_ns } else { 0 },
                    reduce_ns,
                    barrier: barrier && k % 5 == 0,
                }
            })
            .collect();
        Trace { tensors, ops }
    })
}

fn policies() -> impl Strategy<Value = Policy> {
    prop_oneof![
        (0u32..12, 0u32..6, prop_oneof![0u64..4096, Just(u64::MAX)])
            .prop_map(|(lookahead, horizon, bytes)| Policy::strata(lookahead, horizon, bytes)),
        (1u32..5, any::<bool>()).prop_map(|(step, pipelined)| Policy::deepspeed(step, pipelined)),
        Just(Policy::recording()),
    ]
}

/// Bytes a tier must hold at least: its largest op's tensors.
fn op_bytes_max(trace: &Trace, tier: Tier) -> u64 {
    (0..trace.ops.len())
        .filter(|&k| trace.ops[k].processor.tier() == tier)
        .map(|k| trace.op_bytes(k))
        .max()
        .unwrap_or(0)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn plans_stay_in_budget_and_feed_every_op(trace in traces(), slack in (0u64..300, 0u64..300), policy in policies()) {
        let home = |tier: Tier| trace.tensors.iter().filter(|t| t.home == Some(tier)).map(|t| t.bytes).sum::<u64>();
        let capacity = [
            home(Tier::Device).max(op_bytes_max(&trace, Tier::Device)) + slack.0,
            home(Tier::Host).max(op_bytes_max(&trace, Tier::Host)) + slack.1,
            trace.tensors.iter().map(|t| t.bytes).sum::<u64>() + home(Tier::Nvme),
        ];
        let config = PlanConfig { capacity_bytes: capacity, links: links(), policy };
        match plan(&trace, &config) {
            Ok(made) => {
                prop_assert_eq!(verify(&trace, &made, &capacity), Ok(()));
                for tier in Tier::ALL {
                    prop_assert!(made.peak_bytes[tier.index()] <= capacity[tier.index()]);
                }
                let sim = SimConfig { capacity_bytes: capacity, links: links(), gathers_ahead_max: 2, timeline_points_max: 50 };
                let report = simulate(&trace, &made, &sim);
                prop_assert!(report.is_ok(), "{:?}", report);
                let report = report.unwrap();
                for tier in Tier::ALL {
                    prop_assert!(report.peak_bytes[tier.index()] <= capacity[tier.index()]);
                }
            }
            // A tier full of tensors the step needs can leave no room for
            // a write-back (or a tier with none at all, where a tensor must
            // pass through it on its way home): the planner says so with
            // the numbers.
            Err(
                SchedulerError::DoesNotFit { needed_bytes, .. }
                | SchedulerError::StagingDoesNotFit { needed_bytes, .. },
            ) => {
                prop_assert!(needed_bytes > 0);
            }
            Err(other) => prop_assert!(false, "{other}"),
        }
    }

    #[test]
    fn with_room_for_everything_nothing_fails(trace in traces(), policy in policies()) {
        let total: u64 = trace.tensors.iter().map(|t| t.bytes).sum();
        let capacity = [total, total, total];
        let config = PlanConfig { capacity_bytes: capacity, links: links(), policy };
        let made = plan(&trace, &config);
        prop_assert!(made.is_ok(), "{:?}", made);
        let made = made.unwrap();
        prop_assert_eq!(verify(&trace, &made, &capacity), Ok(()));
        let sim = SimConfig { capacity_bytes: capacity, links: links(), gathers_ahead_max: 2, timeline_points_max: 50 };
        prop_assert!(simulate(&trace, &made, &sim).is_ok());
    }
}
