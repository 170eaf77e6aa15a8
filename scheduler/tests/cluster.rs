//! Cluster estimates against DeepSpeed's published formula, the
//! ZeRO-Infinity / ZeRO-Offload headline configurations, and the
//! DeepSpeed-like baseline where NVMe bandwidth is tight.

use strata_scheduler::{
    Checkpointing, Estimate, Hardware, Model, Parallelism, Policies, Tier, cluster,
    deepspeed_zero3_estimate,
};

fn run(
    preset: &str,
    gpus_per_node: Option<u32>,
    params: f64,
    micro_batch: u64,
    offload: (Tier, Tier),
    accumulation: u32,
    policy: Policies,
) -> Estimate {
    let mut hardware = Hardware::preset(preset).unwrap();
    if let Some(gpus) = gpus_per_node {
        hardware.gpus_per_node = gpus;
    }
    let mut model = Model::for_params(params).unwrap();
    model.micro_batch = micro_batch;
    let mut parallelism = Parallelism::zero3_offload(&hardware, offload.0, offload.1);
    parallelism.grad_accumulation = accumulation;
    cluster::estimate(&model, &parallelism, &hardware, policy).unwrap()
}

#[test]
fn strata_is_at_least_1_3x_the_baseline_where_nvme_is_tight() {
    // 66B on a DGX A100 (4 drives for 8 GPUs), everything on NVMe, 8
    // micro-batches per step: DeepSpeed re-reads every parameter from NVMe
    // for each forward and backward; strata keeps them in pinned memory
    // and overlaps the rest.
    let nvme = (Tier::Nvme, Tier::Nvme);
    let strata = run("dgx-a100", None, 66e9, 1, nvme, 8, Policies::Strata);
    for pipelined in [false, true] {
        let baseline = run(
            "dgx-a100",
            None,
            66e9,
            1,
            nvme,
            8,
            Policies::DeepSpeed { pipelined },
        );
        let speedup = baseline.step_time_s.unwrap() / strata.step_time_s.unwrap();
        assert!(
            speedup >= 1.3,
            "strata {:?} s, deepspeed {:?} s: {speedup:.2}x",
            strata.step_time_s,
            baseline.step_time_s
        );
    }
    assert_eq!(strata.bottleneck, "nvme");
}

#[test]
fn zero3_cpu_offload_model_states_match_deepspeeds_formula() {
    let hardware = Hardware::preset("dgx-a100").unwrap();
    let model = Model::for_params(13e9).unwrap();
    let estimate = run(
        "dgx-a100",
        None,
        13e9,
        1,
        (Tier::Host, Tier::Host),
        1,
        Policies::Strata,
    );
    assert!(estimate.fits, "{:?}", estimate.reason);
    assert_eq!(estimate.tiles, 1);
    let (gpu, cpu) = deepspeed_zero3_estimate(
        model.params(),
        model.largest_layer_params(),
        hardware.gpus_per_node,
        1,
        true,
        true,
    );
    assert_eq!(estimate.deepspeed_formula_bytes, Some((gpu, cpu)));
    let states: u64 = estimate
        .memory
        .iter()
        .filter(|p| p.tier == Tier::Host && p.name.contains("model states"))
        .map(|p| p.per_node_bytes)
        .sum();
    let ratio = states as f64 / cpu as f64;
    assert!(
        (0.999..1.001).contains(&ratio),
        "strata {states} B of model states per node, DeepSpeed {cpu} B: {ratio}"
    );
    let gathered = estimate
        .memory
        .iter()
        .find(|p| p.name.contains("4 x largest layer"))
        .unwrap();
    assert_eq!(gathered.per_gpu_bytes, gpu, "4 x largest layer on the GPU");
    // What strata models beyond the formula is listed separately.
    for part in ["activations", "gradient", "framework reserve"] {
        assert!(
            estimate.memory.iter().any(|p| p.name.contains(part)),
            "no {part} part"
        );
    }
}

#[test]
fn zero_infinity_headline_configurations() {
    let nvme = (Tier::Nvme, Tier::Nvme);
    let cpu = (Tier::Host, Tier::Host);
    // 1T on one DGX-2 fits only with model states on NVMe (18 TB of them).
    let trillion = run("dgx2", None, 1e12, 4, nvme, 4, Policies::Strata);
    assert!(trillion.fits, "{:?}", trillion.reason);
    let tflops = trillion.tflops_per_gpu.unwrap();
    assert!(
        (25.0..62.5).contains(&tflops),
        "1T on a DGX-2: {tflops} TFLOP/s per GPU"
    );
    let on_cpu = run("dgx2", None, 1e12, 1, cpu, 1, Policies::Strata);
    assert!(
        !on_cpu.fits && on_cpu.reason.as_deref().unwrap().contains("host"),
        "{:?}",
        on_cpu.reason
    );
    // ZeRO-Infinity at scale: 20T on 32 DGX-2 nodes (512 V100s), model
    // states on NVMe. The paper reports over 25 PFLOPS, 49 TFLOP/s per GPU
    // counting recomputation; these are model FLOPs, without it (6 of 8).
    let mut hardware = Hardware::preset("dgx2").unwrap();
    hardware.nodes = 32;
    let model = Model::for_params(20e12).unwrap();
    let parallelism = Parallelism::zero3_offload(&hardware, Tier::Nvme, Tier::Nvme);
    let twenty = cluster::estimate(&model, &parallelism, &hardware, Policies::Strata).unwrap();
    assert!(twenty.fits, "{:?}", twenty.reason);
    let tflops = twenty.tflops_per_gpu.unwrap();
    assert!(
        (35.0..62.5).contains(&tflops),
        "20T on 512 V100s: {tflops} TFLOP/s per GPU"
    );
    // ZeRO-3 Offload: 40B on one 32 GB V100 with 1.5 TB of RAM.
    let forty = run("dgx2", Some(1), 40e9, 4, cpu, 1, Policies::Strata);
    assert!(forty.fits, "{:?}", forty.reason);
    assert!(
        forty.tflops_per_gpu.unwrap() > 30.0,
        "{:?}",
        forty.tflops_per_gpu
    );
}

#[test]
fn estimates_are_deterministic() {
    let a = run(
        "dgx-h100",
        None,
        30e9,
        2,
        (Tier::Host, Tier::Nvme),
        2,
        Policies::Strata,
    );
    let b = run(
        "dgx-h100",
        None,
        30e9,
        2,
        (Tier::Host, Tier::Nvme),
        2,
        Policies::Strata,
    );
    assert_eq!(a, b);
}

/// One point of the never-slower grid.
struct Case {
    preset: &'static str,
    gpus_per_node: Option<u32>,
    params: f64,
    offload: (Tier, Tier),
    micro_batch: u64,
    accumulation: u32,
    grad_clip: bool,
}

#[test]
fn strata_is_never_slower_than_the_baseline() {
    // Every preset (and one V100 alone, as in ZeRO-Offload), three sizes,
    // parameters and optimizer states in five placements, one and four
    // sequences per micro-batch, one and four micro-batches per step, with
    // and without clipping: against the baseline with and without
    // pipelined optimizer swaps.
    let machines = [
        ("dgx2", Some(1)),
        ("dgx2", None),
        ("dgx-a100", None),
        ("dgx-h100", None),
    ];
    let offloads = [
        (Tier::Device, Tier::Host),
        (Tier::Host, Tier::Host),
        (Tier::Host, Tier::Nvme),
        (Tier::Device, Tier::Nvme),
        (Tier::Nvme, Tier::Nvme),
    ];
    let mut cases = Vec::new();
    for (preset, gpus_per_node) in machines {
        for params in [1.3e9, 13e9, 40e9] {
            for offload in offloads {
                for micro_batch in [1, 4] {
                    for accumulation in [1, 4] {
                        for grad_clip in [true, false] {
                            cases.push(Case {
                                preset,
                                gpus_per_node,
                                params,
                                offload,
                                micro_batch,
                                accumulation,
                                grad_clip,
                            });
                        }
                    }
                }
            }
        }
    }
    let compared = std::sync::atomic::AtomicUsize::new(0);
    let check = |case: &Case| {
        let mut hardware = Hardware::preset(case.preset).unwrap();
        if let Some(gpus) = case.gpus_per_node {
            hardware.gpus_per_node = gpus;
        }
        let mut model = Model::for_params(case.params).unwrap();
        model.micro_batch = case.micro_batch;
        let mut parallelism = Parallelism::zero3_offload(&hardware, case.offload.0, case.offload.1);
        parallelism.grad_accumulation = case.accumulation;
        parallelism.grad_clip = case.grad_clip;
        let estimate = |policy| cluster::estimate(&model, &parallelism, &hardware, policy).unwrap();
        let strata = estimate(Policies::Strata);
        let name = format!(
            "{} x{:?} {:e} {:?} mb{} ga{} clip {}",
            case.preset,
            case.gpus_per_node,
            case.params,
            case.offload,
            case.micro_batch,
            case.accumulation,
            case.grad_clip
        );
        for pipelined in [false, true] {
            let baseline = estimate(Policies::DeepSpeed { pipelined });
            assert_eq!(strata.fits, baseline.fits, "{name}");
            let (Some(ours), Some(theirs)) = (strata.step_time_s, baseline.step_time_s) else {
                continue;
            };
            assert!(
                ours <= theirs * (1.0 + 1e-9),
                "{name}, pipelined {pipelined}: strata {ours:.3} s, deepspeed {theirs:.3} s"
            );
            compared.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    };
    let workers = std::thread::available_parallelism().map_or(1, |n| n.get());
    std::thread::scope(|scope| {
        for worker in 0..workers {
            let (cases, check) = (&cases, &check);
            scope.spawn(move || cases.iter().skip(worker).step_by(workers).for_each(check));
        }
    });
    // Most of the grid fits, so the comparison is not vacuous.
    let compared = compared.into_inner();
    assert!(compared >= cases.len(), "only {compared} comparisons");
}

/// bf16 optimizer states: the states' bytes follow the state dtype (12,
/// 8, 6 bytes per parameter, plus the 4-byte fp32 gradient), and the CPU
/// optimizer's time its bytes per step (28, 20, 16).
#[test]
fn state_dtype_sets_the_states_bytes_and_the_cpu_optimizers_time() {
    use strata_scheduler::StateDtype;
    let hardware = Hardware::preset("dgx-a100").unwrap();
    let model = Model::for_params(13e9).unwrap();
    let estimate = |state_dtype| {
        let mut parallelism = Parallelism::zero3_offload(&hardware, Tier::Host, Tier::Host);
        parallelism.state_dtype = state_dtype;
        cluster::estimate(&model, &parallelism, &hardware, Policies::Strata).unwrap()
    };
    let cpu = |e: &Estimate| {
        let resource = e.resources.iter().find(|r| r.name == "cpu-optimizer");
        resource.expect("a cpu-optimizer resource").busy_s
    };
    let fp32 = estimate(StateDtype::Fp32);
    for (dtype, bytes, traffic) in [
        (StateDtype::Bf16Moments, 8.0, 20.0),
        (StateDtype::Bf16, 6.0, 16.0),
    ] {
        let e = estimate(dtype);
        let ratio = states(&e) / states(&fp32);
        let want = (bytes + 4.0) / 16.0;
        assert!(
            (ratio - want).abs() < 0.01,
            "{dtype:?}: states x{ratio}, want x{want}"
        );
        let ratio = cpu(&e) / cpu(&fp32);
        let want = traffic / 28.0;
        assert!(
            (ratio - want).abs() < 0.01,
            "{dtype:?}: cpu time x{ratio}, want x{want}"
        );
        assert!(e.step_time_s <= fp32.step_time_s, "{dtype:?}");
    }
}

/// The H100 shape (hidden 4096, seq 1024, micro-batch 8, 4
/// micro-batches per step) on one 80 GB GPU with 512 GB of host memory,
/// `layers` blocks, parameters and optimizer states on the host.
/// Bytes of optimizer states (master weights, moments, fp32 gradients)
/// per node.
fn states(e: &Estimate) -> f64 {
    let part = e
        .memory
        .iter()
        .find(|p| p.name.starts_with("master weights"));
    part.expect("a states part").per_node_bytes as f64
}

fn h100(layers: u32, checkpoint: Checkpointing) -> Estimate {
    let mut hardware = Hardware::preset("dgx-h100").unwrap();
    hardware.gpus_per_node = 1;
    hardware.host_memory_bytes = 512 << 30;
    hardware.pcie_bytes_per_s = 54e9;
    let model = Model {
        micro_batch: 8,
        ..Model::dense(layers, 4096, 32, 1024, 50304)
    };
    let mut parallelism = Parallelism::zero3_offload(&hardware, Tier::Host, Tier::Host);
    parallelism.grad_accumulation = 4;
    parallelism.checkpoint_activations = checkpoint;
    cluster::estimate(&model, &parallelism, &hardware, Policies::Strata).unwrap()
}

#[test]
fn auto_recompute_keeps_the_last_blocks_whole_and_beats_both_extremes() {
    // The 4 micro-batches run block by block, so keeping every block's
    // activations (2.5 GB per block and micro-batch) would take 120 GB at
    // 12 blocks: most go to the host and PCIe becomes the bottleneck.
    // `auto` keeps the last blocks whole, as many as pay, and its step is
    // faster than either extreme.
    for layers in [12, 24] {
        let auto = h100(layers, Checkpointing::Auto);
        let every = h100(layers, Checkpointing::Every);
        let none = h100(layers, Checkpointing::Never);
        assert!(
            auto.fits && every.fits,
            "{:?} {:?}",
            auto.reason,
            every.reason
        );
        assert_eq!(every.activations.recomputed_layers, layers);
        let recomputed = auto.activations.recomputed_layers;
        assert!(
            0 < recomputed && recomputed < layers,
            "{layers}: {recomputed}"
        );
        let (auto_s, every_s) = (auto.step_time_s.unwrap(), every.step_time_s.unwrap());
        assert!(
            auto_s < every_s && auto_s < none.step_time_s.unwrap_or(f64::INFINITY),
            "{layers} blocks: auto {auto_s} s ({recomputed} recompute), every {every_s} s, none {:?} s",
            none.step_time_s
        );
    }
}

/// Hybrid sharding: the shards are cut over `shard_degree` GPUs (their
/// states per GPU grow by the replicas' count, the CPU optimizer's work
/// with them), the all-gather runs within the shard group (NVLink when it
/// is a node) and the gradients also cross the replicas; a shard degree of
/// every GPU is full sharding, and one that does not divide them is
/// refused by name.
#[test]
fn hybrid_sharding_counts_its_shards_and_the_replicas_all_reduce() {
    let mut hardware = Hardware::preset("dgx-a100").unwrap();
    hardware.nodes = 4;
    let model = Model::for_params(13e9).unwrap();
    let estimate = |shard_degree, optimizer| {
        let mut parallelism = Parallelism::zero3_offload(&hardware, optimizer, optimizer);
        parallelism.shard_degree = shard_degree;
        cluster::estimate(&model, &parallelism, &hardware, Policies::Strata).unwrap()
    };
    let busy = |e: &Estimate, name: &str| {
        let resource = e.resources.iter().find(|r| r.name == name);
        resource
            .unwrap_or_else(|| panic!("no {name} in {:?}", e.resources))
            .busy_s
    };
    let full = estimate(0, Tier::Host);
    assert_eq!(estimate(32, Tier::Host), full, "every GPU is full sharding");
    let hybrid = estimate(8, Tier::Host);
    let ratio = states(&hybrid) / states(&full);
    assert!((ratio - 4.0).abs() < 0.01, "states x{ratio}, want x4");
    let ratio = busy(&hybrid, "cpu-optimizer") / busy(&full, "cpu-optimizer");
    assert!((ratio - 4.0).abs() < 0.05, "cpu time x{ratio}, want x4");
    // Everything on the GPUs: the collectives are what differs. Within a
    // node the shard group gathers over NVLink; the replicas' all-reduce
    // crosses the network.
    let (full, hybrid) = (estimate(0, Tier::Device), estimate(8, Tier::Device));
    let (within, across) = (busy(&hybrid, "nvlink+network"), busy(&full, "network"));
    assert!(within > 0.0 && across > 0.0, "{within} {across}");
    // Shards of one GPU: every GPU holds the whole states (DDP's memory),
    // the gradients all-reduced across all of them.
    let (hybrid, replicated) = (estimate(8, Tier::Host), estimate(1, Tier::Host));
    assert!(replicated.fits, "{:?}", replicated.reason);
    let ratio = states(&replicated) / states(&hybrid);
    assert!((ratio - 8.0).abs() < 0.05, "states x{ratio}, want x8");
    assert!(busy(&replicated, "nvlink+network") > 0.0);
    let mut parallelism = Parallelism::zero3_offload(&hardware, Tier::Host, Tier::Host);
    parallelism.shard_degree = 5;
    let err = parallelism.validate(&model, &hardware).unwrap_err();
    assert!(err.to_string().contains("--shard-degree 5"), "{err}");
}
