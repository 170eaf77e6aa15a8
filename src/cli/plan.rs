//! `strata plan`: will a run fit, where does its memory go, how fast will
//! it step, and what limits it; strata's policy or the DeepSpeed-like
//! baseline, simulated on a machine preset with every number overridable.

use std::path::PathBuf;

use anyhow::{Context, bail};
use clap::{Args, ValueEnum};
use serde::Serialize;
use strata_scheduler::cluster::{self, Estimate};
use strata_scheduler::{Checkpointing, Hardware, Model, Parallelism, Policies, StateDtype, Tier};

/// Where a model state lives.
#[derive(ValueEnum, Clone, Copy, Debug)]
pub enum Offload {
    /// GPU memory (no offload; "none" also works).
    #[value(alias = "none")]
    Device,
    /// Pinned host RAM ("host" also works).
    #[value(alias = "host")]
    Cpu,
    /// NVMe.
    Nvme,
}

impl Offload {
    fn tier(self) -> Tier {
        match self {
            Offload::Device => Tier::Device,
            Offload::Cpu => Tier::Host,
            Offload::Nvme => Tier::Nvme,
        }
    }
}

/// Which policy plans the step.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq)]
pub enum PolicyChoice {
    /// strata's planner.
    Strata,
    /// DeepSpeed ZeRO-3 / ZeRO-Infinity as it behaves.
    Deepspeed,
}

/// Options of `strata plan`.
#[derive(Args, Debug)]
pub struct PlanArgs {
    /// Machine preset: dgx2, dgx-a100 or dgx-h100.
    #[arg(long, default_value = "dgx2")]
    preset: String,
    /// Nodes.
    #[arg(long, default_value_t = 1)]
    nodes: u32,
    /// The architecture (a name `[model] arch` takes; `strata train
    /// --print-config` shows the default).
    #[arg(long)]
    arch: Option<String>,
    /// Model size (1T, 175B, 13B, 350M or 1.3e9): picks the
    /// architecture's standard shape of that size. Give it or
    /// --layers/--hidden/--heads.
    #[arg(long, value_parser = parse_count)]
    params: Option<f64>,
    /// Transformer blocks (exact shape, with --hidden and --heads).
    #[arg(long)]
    layers: Option<u32>,
    /// Hidden size.
    #[arg(long)]
    hidden: Option<u64>,
    /// Attention heads.
    #[arg(long)]
    heads: Option<u32>,
    /// Sequence length.
    #[arg(long, default_value_t = 2048)]
    seq: u64,
    /// Sequences per micro-batch per GPU.
    #[arg(long, default_value_t = 1)]
    micro_batch: u64,
    /// Vocabulary size (default: the architecture's own).
    #[arg(long)]
    vocab: Option<u64>,
    /// Micro-batches per optimizer step.
    #[arg(long, default_value_t = 1)]
    grad_accumulation: u32,
    /// ZeRO stage (0-3).
    #[arg(long, default_value_t = 3)]
    zero_stage: u8,
    /// Hybrid sharding: the ZeRO shards cut over groups of this many
    /// neighbouring data-parallel GPUs, replicated across the groups
    /// (gradients all-reduced across them); 0: over all of them.
    #[arg(long, default_value_t = 0)]
    shard_degree: u32,
    /// Tensor-parallel degree.
    #[arg(long, default_value_t = 1)]
    tensor_parallel: u32,
    /// Pipeline-parallel degree.
    #[arg(long, default_value_t = 1)]
    pipeline_parallel: u32,
    /// Where 16-bit parameters live: device, cpu or nvme.
    #[arg(long, value_enum, default_value = "cpu")]
    offload_param: Offload,
    /// Where the optimizer states live (and so where Adam runs).
    #[arg(long, value_enum, default_value = "cpu")]
    offload_optimizer: Offload,
    /// No gradient clipping (lets strata overlap the optimizer with
    /// backward).
    #[arg(long)]
    no_grad_clip: bool,
    /// Which blocks recompute their forward in backward: every, none, or
    /// auto (the last blocks keep their activations as the device and
    /// host room and the PCIe time allow).
    #[arg(long, default_value = "every")]
    checkpoint: Checkpointing,
    /// The same as `--checkpoint none`.
    #[arg(long, conflicts_with = "checkpoint")]
    no_checkpoint: bool,
    /// Optimizer states: fp32 (12 bytes per parameter), bf16-moments (8)
    /// or bf16 (6); the CPU optimizer's time follows its bytes per step.
    #[arg(long, default_value = "fp32")]
    state_dtype: StateDtype,
    /// Planning policy.
    #[arg(long, value_enum, default_value = "strata")]
    policy: PolicyChoice,
    /// The baseline with pipeline_read/pipeline_write on.
    #[arg(long)]
    deepspeed_pipelined: bool,
    /// Also run the other policy and print the speedup.
    #[arg(long)]
    compare: bool,
    /// GPUs per node.
    #[arg(long)]
    gpus_per_node: Option<u32>,
    /// HBM per GPU: a size (80GB, 141GiB; a plain number is GB).
    #[arg(long, alias = "gpu-memory-gb", value_name = "SIZE", value_parser = size_gb)]
    gpu_memory: Option<u64>,
    /// Peak dense 16-bit TFLOP/s per GPU.
    #[arg(long)]
    gpu_tflops: Option<f64>,
    /// Fraction of peak large matrix products reach (0-1).
    #[arg(long)]
    gpu_efficiency: Option<f64>,
    /// Compute rates measured on the GPU: the JSON of `strata bench
    /// kernels --json` (its GEMM's TFLOP/s for matrix products, its
    /// attention's forward and backward for attention, at their measured
    /// rates instead of --gpu-tflops x --gpu-efficiency).
    #[arg(long, conflicts_with_all = ["gpu_tflops", "gpu_efficiency"])]
    kernels: Option<PathBuf>,
    /// Host RAM per node: a size (512GiB, 2TB; a plain number is GB).
    #[arg(long, alias = "host-memory-gb", value_name = "SIZE", value_parser = size_gb)]
    host_memory: Option<u64>,
    /// PCIe GB/s per GPU, each direction.
    #[arg(long)]
    pcie_gbps: Option<f64>,
    /// NVLink GB/s per GPU, each direction.
    #[arg(long)]
    nvlink_gbps: Option<f64>,
    /// Network GB/s per node, each direction.
    #[arg(long)]
    network_gbps: Option<f64>,
    /// NVMe drives per node.
    #[arg(long)]
    nvme_drives: Option<u32>,
    /// Read GB/s per drive.
    #[arg(long)]
    nvme_read_gbps: Option<f64>,
    /// Write GB/s per drive.
    #[arg(long)]
    nvme_write_gbps: Option<f64>,
    /// Capacity per drive: a size (4TB, 3.5TiB; a plain number is TB).
    #[arg(long, alias = "nvme-capacity-tb", value_name = "SIZE", value_parser = size_tb)]
    nvme_capacity: Option<u64>,
    /// CPU Adam throughput per node, parameters/s.
    #[arg(long, value_parser = parse_count)]
    cpu_adam_params_per_s: Option<f64>,
    /// Draw the memory timeline and resource use as an SVG chart.
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

/// The GEMM's, the attention forward's and its backward's FLOP/s from a
/// `strata bench kernels --json` report.
fn measured_rates(path: &std::path::Path) -> anyhow::Result<[f64; 3]> {
    let fix = "write it on the GPU with `strata bench kernels --json > FILE`";
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading --kernels {}: {fix}", path.display()))?;
    let report: serde_json::Value = serde_json::from_str(&text).with_context(|| {
        format!(
            "--kernels {} is not a JSON report of strata bench kernels: {fix}",
            path.display()
        )
    })?;
    let rows = report["results"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or(&[]);
    let rate = |op: &str| -> anyhow::Result<f64> {
        let tflops = rows
            .iter()
            .find(|row| row["op"] == op)
            .and_then(|row| row["tflops"].as_f64());
        match tflops {
            Some(t) if t.is_finite() && t > 0.0 => Ok(t * 1e12),
            Some(t) => bail!("--kernels {}: {op} has {t} TFLOP/s; {fix}", path.display()),
            None => bail!(
                "--kernels {} has no {op} result with its TFLOP/s; {fix}",
                path.display()
            ),
        }
    };
    Ok([
        rate("gemm")?,
        rate("attention_forward")?,
        rate("attention_backward")?,
    ])
}

/// "1T", "175B", "350M", "13e9" -> a count.
/// A size with its unit (`512GiB`, `4TB`), or a plain number of `unit`
/// bytes (the flags' older form).
fn size_in(text: &str, unit: f64, name: &str) -> Result<u64, String> {
    if let Ok(value) = text.trim().parse::<f64>() {
        return if value.is_finite() && value > 0.0 {
            Ok((value * unit) as u64)
        } else {
            Err(format!("{text:?} is not a size: give a positive one"))
        };
    }
    match text.parse::<strata_storage::ByteSize>() {
        Ok(size) if size.0 > 0 => Ok(size.0),
        Ok(_) => Err(format!("{text:?} is not a size: give a positive one")),
        Err(err) => Err(format!("{err} (a plain number is {name})")),
    }
}

fn size_gb(text: &str) -> Result<u64, String> {
    size_in(text, 1e9, "GB")
}

fn size_tb(text: &str) -> Result<u64, String> {
    size_in(text, 1e12, "TB")
}

fn parse_count(text: &str) -> Result<f64, String> {
    let text = text.trim();
    let (number, scale) = match text.char_indices().last() {
        Some((at, 'T' | 't')) => (&text[..at], 1e12),
        Some((at, 'B' | 'b' | 'G' | 'g')) => (&text[..at], 1e9),
        Some((at, 'M' | 'm')) => (&text[..at], 1e6),
        Some((at, 'K' | 'k')) => (&text[..at], 1e3),
        _ => (text, 1.0),
    };
    match number.parse::<f64>() {
        Ok(value) if value.is_finite() && value > 0.0 => Ok(value * scale),
        _ => Err(format!(
            "{text:?} is not a count: write e.g. 1T, 175B, 350M or 1.3e9"
        )),
    }
}

impl PlanArgs {
    fn hardware(&self) -> anyhow::Result<Hardware> {
        let mut hardware = Hardware::preset(&self.preset)?;
        hardware.nodes = self.nodes;
        let gb = |v: f64| v * 1e9;
        if let Some(v) = self.gpus_per_node {
            hardware.gpus_per_node = v;
        }
        if let Some(bytes) = self.gpu_memory {
            hardware.gpu_memory_bytes = bytes;
        }
        if let Some(v) = self.gpu_tflops {
            hardware.gpu_flops = v * 1e12;
        }
        if let Some(v) = self.gpu_efficiency {
            hardware.gpu_efficiency = v;
        }
        if let Some(path) = &self.kernels {
            let [gemm, forward, backward] = measured_rates(path)?;
            hardware.gpu_flops = gemm;
            hardware.gpu_efficiency = 1.0;
            hardware.attention_flops_per_s = Some((forward, backward));
        }
        if let Some(bytes) = self.host_memory {
            hardware.host_memory_bytes = bytes;
        }
        let speeds = [
            (self.pcie_gbps, &mut hardware.pcie_bytes_per_s),
            (self.nvlink_gbps, &mut hardware.nvlink_bytes_per_s),
            (self.network_gbps, &mut hardware.network_bytes_per_s),
            (self.nvme_read_gbps, &mut hardware.nvme_read_bytes_per_s),
            (self.nvme_write_gbps, &mut hardware.nvme_write_bytes_per_s),
        ];
        for (value, field) in speeds {
            if let Some(v) = value {
                *field = gb(v);
            }
        }
        if let Some(v) = self.nvme_drives {
            hardware.nvme_drives = v;
        }
        if let Some(bytes) = self.nvme_capacity {
            hardware.nvme_bytes = bytes;
        }
        if let Some(v) = self.cpu_adam_params_per_s {
            hardware.cpu_optimizer_params_per_s = v;
        }
        Ok(hardware)
    }

    fn model(&self) -> anyhow::Result<(Model, strata_train::ModelConfig)> {
        let exact = [
            self.layers.is_some(),
            self.hidden.is_some(),
            self.heads.is_some(),
        ];
        let arch = strata_train::model::architecture(
            self.arch
                .as_deref()
                .unwrap_or(strata_train::model::default_arch()),
        )
        .context("--arch")?;
        let mut config = match (self.params, exact) {
            (Some(_), e) if e.iter().any(|&x| x) => {
                bail!(
                    "--params picks the shape; give either --params or --layers, --hidden and --heads, not both"
                )
            }
            (Some(params), _) => (arch.for_params)(params)?,
            (None, [true, true, true]) => strata_train::ModelConfig {
                arch: strata_train::model::Arch::named(arch.name)?,
                // The architecture's standard vocabulary (its shapes').
                vocab: (arch.for_params)(1e9)?.vocab,
                layers: self.layers.unwrap_or_default() as usize,
                hidden: self.hidden.unwrap_or_default() as usize,
                heads: self.heads.unwrap_or_default() as usize,
                ..strata_train::ModelConfig::default()
            },
            (None, [false, false, false]) => {
                bail!("say which model: --params (e.g. 1T) or --layers, --hidden and --heads")
            }
            (None, _) => bail!("an exact shape needs all of --layers, --hidden and --heads"),
        };
        config.seq = self.seq as usize;
        if let Some(vocab) = self.vocab {
            config.vocab = vocab as usize;
        }
        // The flags' own limits first, named by flag.
        strata_scheduler::Model {
            micro_batch: self.micro_batch,
            ..strata_scheduler::Model::dense(
                config.layers as u32,
                config.hidden as u64,
                config.heads as u32,
                self.seq,
                config.vocab as u64,
            )
        }
        .validate()?;
        let model = config.build()?.cost_model(self.micro_batch);
        model.validate()?;
        Ok((model, config))
    }

    /// Whether strata's engine can hold this run, by the count `strata
    /// train` refuses a config with ([`strata_train::TrainConfig::check_needs`]):
    /// each GPU a rank, the host's memory and the drives' room shared by
    /// a node's GPUs. None when it fits, or for a run the engine does not
    /// train (ZeRO stages below 3, tensor or pipeline parallelism).
    fn engine_shortfall(
        &self,
        model: &strata_train::ModelConfig,
        parallelism: &Parallelism,
        hardware: &Hardware,
    ) -> anyhow::Result<Option<String>> {
        if parallelism.zero_stage != 3 || parallelism.tensor * parallelism.pipeline > 1 {
            return Ok(None);
        }
        let place = |offload: Offload| match offload {
            Offload::Device => strata_train::Placement::Device,
            Offload::Cpu => strata_train::Placement::Cpu,
            Offload::Nvme => strata_train::Placement::Nvme,
        };
        let mut config = strata_train::TrainConfig {
            model: model.clone(),
            ..strata_train::TrainConfig::default()
        };
        config.train.micro_batch = self.micro_batch as usize;
        config.train.grad_accumulation = self.grad_accumulation as usize;
        config.train.ranks = parallelism.data as usize;
        config.parallel.shard_degree = parallelism.shard_degree as usize;
        config.train.compute_dtype = strata_train::ComputeDtype::Bf16;
        config.device.kind = strata_runtime::DeviceChoice::Cuda;
        config.placement.params = place(self.offload_param);
        config.placement.optimizer = place(self.offload_optimizer);
        config.optim.state_dtype = self.state_dtype;
        let gpus = u64::from(hardware.gpus_per_node.max(1));
        let budgets = [
            ("--gpu-memory", hardware.gpu_memory_bytes),
            (
                "the host memory per GPU (--host-memory / --gpus-per-node)",
                hardware.host_memory_bytes / gpus,
            ),
            (
                "the NVMe room per GPU (--nvme-capacity x --nvme-drives / --gpus-per-node)",
                hardware.nvme_bytes_per_node() / gpus,
            ),
        ];
        let keys = strata_train::Keys {
            params: "--offload-param",
            optimizer: "--offload-optimizer",
            ranks: "data-parallel GPUs:",
            ranks_max: 1 << 16,
            micro_batch: "--micro-batch",
            config: false,
        };
        Ok(config.check_needs(&budgets, &keys).err().map(|err| {
            format!("strata's engine cannot hold it (the count `strata train` checks a config with): {err}")
        }))
    }

    fn parallelism(&self, hardware: &Hardware) -> anyhow::Result<Parallelism> {
        let gpus = hardware.nodes * hardware.gpus_per_node;
        let split = self.tensor_parallel * self.pipeline_parallel;
        if split == 0 || !gpus.is_multiple_of(split) {
            bail!(
                "--tensor-parallel {} x --pipeline-parallel {} does not divide the {gpus} GPUs ({} nodes x {})",
                self.tensor_parallel,
                self.pipeline_parallel,
                hardware.nodes,
                hardware.gpus_per_node
            );
        }
        Ok(Parallelism {
            data: gpus / split,
            shard_degree: self.shard_degree,
            tensor: self.tensor_parallel,
            pipeline: self.pipeline_parallel,
            zero_stage: self.zero_stage,
            offload_param: self.offload_param.tier(),
            offload_optimizer: self.offload_optimizer.tier(),
            grad_accumulation: self.grad_accumulation,
            grad_clip: !self.no_grad_clip,
            checkpoint_activations: if self.no_checkpoint {
                Checkpointing::Never
            } else {
                self.checkpoint
            },
            state_dtype: self.state_dtype,
        })
    }

    fn policy(&self, choice: PolicyChoice) -> Policies {
        match choice {
            PolicyChoice::Strata => Policies::Strata,
            PolicyChoice::Deepspeed => Policies::DeepSpeed {
                pipelined: self.deepspeed_pipelined,
            },
        }
    }
}

#[derive(Serialize)]
struct Output<'a> {
    #[serde(flatten)]
    estimate: &'a Estimate,
    hardware: &'a Hardware,
    model: &'a Model,
    parallelism: &'a Parallelism,
    #[serde(skip_serializing_if = "Option::is_none")]
    baseline: Option<&'a Estimate>,
    #[serde(skip_serializing_if = "Option::is_none")]
    speedup: Option<f64>,
}

/// Plans, simulates and prints.
pub fn run(args: PlanArgs) -> anyhow::Result<()> {
    if let Some(path) = &args.plot {
        super::chart::check_plot_path(path)?;
    }
    if args.deepspeed_pipelined && args.policy == PolicyChoice::Strata && !args.compare {
        bail!("--deepspeed-pipelined applies to --policy deepspeed (or --compare)");
    }
    let hardware = args.hardware()?;
    let (model, config) = args.model()?;
    let parallelism = args.parallelism(&hardware)?;
    let mut estimate =
        cluster::estimate(&model, &parallelism, &hardware, args.policy(args.policy))?;
    // The step's plan may fit where the engine's own count does not: the
    // engine's count decides (what `strata train` would refuse).
    if args.policy == PolicyChoice::Strata
        && let Some(reason) = args.engine_shortfall(&config, &parallelism, &hardware)?
    {
        estimate.fits = false;
        estimate.reason = Some(reason);
    }
    let other = match args.policy {
        PolicyChoice::Strata => PolicyChoice::Deepspeed,
        PolicyChoice::Deepspeed => PolicyChoice::Strata,
    };
    let baseline = if args.compare {
        Some(cluster::estimate(
            &model,
            &parallelism,
            &hardware,
            args.policy(other),
        )?)
    } else {
        None
    };
    let speedup = baseline
        .as_ref()
        .and_then(|b| Some(b.step_time_s? / estimate.step_time_s?));
    let draw = || -> anyhow::Result<()> {
        match &args.plot {
            Some(path) => super::chart::plan_chart(path, &estimate)
                .with_context(|| format!("drawing {}", path.display())),
            None => Ok(()),
        }
    };
    if args.json {
        let output = Output {
            estimate: &estimate,
            hardware: &hardware,
            model: &model,
            parallelism: &parallelism,
            baseline: baseline.as_ref(),
            speedup,
        };
        println!("{}", serde_json::to_string(&output)?);
        return draw();
    }
    print_human(&estimate, &hardware, &model, &parallelism);
    if let (Some(baseline), Some(speedup)) = (&baseline, speedup) {
        println!(
            "\n{}: {:.2} s per step ({:.1} TFLOP/s per GPU, bottleneck {}); {} is {speedup:.2}x faster",
            baseline.policy,
            baseline.step_time_s.unwrap_or(f64::NAN),
            baseline.tflops_per_gpu.unwrap_or(f64::NAN),
            baseline.bottleneck,
            estimate.policy
        );
    }
    draw()?;
    if let Some(path) = &args.plot {
        println!("chart: {}", path.display());
    }
    Ok(())
}

fn gb(bytes: u64) -> String {
    format!("{:.1} GB", bytes as f64 / 1e9)
}

fn print_human(estimate: &Estimate, hardware: &Hardware, model: &Model, parallelism: &Parallelism) {
    println!("machine: {}", hardware.describe());
    let data = match parallelism.replicas() {
        1 => parallelism.data.to_string(),
        replicas => format!(
            "{} (sharded over {}, {replicas} replicas)",
            parallelism.data,
            parallelism.shards()
        ),
    };
    println!(
        "model:   {:.3e} params ({} layers, hidden {}, {} heads, seq {}, micro-batch {}), ZeRO-{}, dp {} x tp {} x pp {}, grad accumulation {}",
        estimate.params as f64,
        model.layers,
        model.hidden,
        model.heads,
        model.seq,
        model.micro_batch,
        parallelism.zero_stage,
        data,
        parallelism.tensor,
        parallelism.pipeline,
        parallelism.grad_accumulation
    );
    println!(
        "policy:  {}; parameters on {}, optimizer on {} ({} states)",
        estimate.policy,
        parallelism.offload_param,
        parallelism.offload_optimizer,
        parallelism.state_dtype.name()
    );
    match &estimate.reason {
        None => println!("fits:    yes"),
        Some(reason) => println!("fits:    NO - {reason}"),
    }
    println!(
        "\nmemory (tier totals are peaks; each part's own peak is listed, and parts peak at different times)"
    );
    println!("    {:<70} {:>10} {:>12}", "", "per GPU", "per node");
    for tier in Tier::ALL {
        let capacity = estimate.capacity_bytes[tier.index()];
        let used = match tier {
            Tier::Device => estimate.device_bytes_per_gpu,
            Tier::Host => estimate.host_bytes_per_node,
            Tier::Nvme => estimate.nvme_bytes_per_node,
        };
        println!(
            "  {tier}: {} of {} {}",
            gb(used),
            gb(capacity),
            if tier == Tier::Device {
                "per GPU"
            } else {
                "per node"
            }
        );
        for part in estimate.memory.iter().filter(|p| p.tier == tier) {
            println!(
                "    {:<70} {:>10} {:>12}",
                part.name,
                gb(part.per_gpu_bytes),
                gb(part.per_node_bytes)
            );
        }
    }
    if let Some((gpu, cpu)) = estimate.deepspeed_formula_bytes {
        println!(
            "  DeepSpeed's estimate_zero3_model_states_mem_needs (factor 1): {} per GPU, {} CPU per node (x1.5 = {})",
            gb(gpu),
            gb(cpu),
            gb(cpu * 3 / 2)
        );
    }
    let a = &estimate.activations;
    println!(
        "\nactivations: {} blocks recompute their forward (the first ones), the largest keeps {} per micro-batch, {} blocks moved off the device, prefetched {} blocks ahead; linear layers tiled {}x",
        a.recomputed_layers,
        gb(a.bytes_per_layer),
        a.offloaded_layers,
        a.horizon_layers,
        estimate.tiles
    );
    let (Some(step), Some(tflops)) = (estimate.step_time_s, estimate.tflops_per_gpu) else {
        return;
    };
    println!(
        "\nstep:    {step:.2} s ({tflops:.1} TFLOP/s per GPU); first step {:.2} s",
        estimate.first_step_time_s.unwrap_or(f64::NAN)
    );
    println!("bottleneck: {}", estimate.bottleneck);
    for r in &estimate.resources {
        println!(
            "  {:<14} busy {:>9.2} s  {:>5.1}%  {}",
            r.name,
            r.busy_s,
            100.0 * r.utilisation,
            if r.bytes > 0 {
                gb(r.bytes)
            } else {
                String::new()
            }
        );
    }
}
