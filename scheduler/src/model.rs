//! Model, parallelism and hardware descriptions, and DeepSpeed's published
//! memory formula for comparison.

use serde::{Deserialize, Serialize};

use crate::recompute::Checkpointing;

use crate::error::SchedulerError;
use crate::trace::Tier;

/// A decoder-only transformer as the planners see it: `layers` blocks of
/// attention and an MLP, embeddings, an LM head. Each architecture of
/// strata-train describes itself as one (its widths, its MLP's gate, its
/// norms, a tied or separate head); [`Model::dense`] is the classic dense
/// shape (a 4x MLP without a gate, LayerNorms, biases, learned positions, a
/// tied head).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Model {
    /// Transformer blocks.
    pub layers: u32,
    /// Hidden size.
    pub hidden: u64,
    /// Attention heads (query heads).
    pub heads: u32,
    /// Key/value heads: `heads`, or fewer with grouped-query attention.
    pub kv_heads: u32,
    /// The MLP's inner width.
    pub ffn: u64,
    /// Whether the MLP is gated (gate and up projections, then down: three
    /// matrices) or not (two).
    pub gated_mlp: bool,
    /// Whether the linear layers have biases.
    pub biases: bool,
    /// Whether the query, key and value projections have biases where the
    /// other layers have none.
    pub qkv_biases: bool,
    /// Parameters of one norm: `2 x hidden` for a LayerNorm, `hidden` for
    /// an RMSNorm.
    pub norm_params: u64,
    /// Whether the embeddings include a learned position table (`seq x
    /// hidden`).
    pub learned_positions: bool,
    /// Whether the LM head is the token embedding (tied) or a matrix of
    /// its own.
    pub tied_head: bool,
    /// Sequence length.
    pub seq: u64,
    /// Sequences per micro-batch per GPU.
    pub micro_batch: u64,
    /// Vocabulary.
    pub vocab: u64,
}

/// The most blocks a model may have.
pub const LAYERS_MAX: u32 = 1 << 12;
/// The largest hidden size.
pub const HIDDEN_MAX: u64 = 1 << 20;
/// The longest sequence.
pub const SEQ_MAX: u64 = 1 << 22;
/// The most sequences in one micro-batch.
pub const MICRO_BATCH_MAX: u64 = 1 << 16;
/// The largest vocabulary.
pub const VOCAB_MAX: u64 = 1 << 24;
/// The largest model `--params` shapes (a quadrillion).
pub const PARAMS_MAX: f64 = 1e15;
/// The most micro-batches accumulated into one step.
pub const GRAD_ACCUMULATION_MAX: u32 = 1024;
/// The most (block, micro-batch) pairs one rank's step may hold: the
/// plan's ops, and so its time and memory, grow with them (at this bound
/// a plan takes seconds and tens of MB).
pub const MICRO_BLOCKS_MAX: u64 = 1 << 13;

/// Standard dense shapes by size: (parameters, layers, hidden, heads), as
/// published for models of 125M to 175B parameters, Megatron-Turing's 530B
/// and the ZeRO-Infinity paper's 1T to 20T models.
const SHAPES: [(f64, u32, u64, u32); 13] = [
    (125e6, 12, 768, 12),
    (350e6, 24, 1024, 16),
    (1.3e9, 24, 2048, 16),
    (2.7e9, 32, 2560, 32),
    (6.7e9, 32, 4096, 32),
    (13e9, 40, 5120, 40),
    (30e9, 48, 7168, 56),
    (66e9, 64, 9216, 72),
    (175e9, 96, 12288, 96),
    (530e9, 105, 20480, 128),
    (1e12, 128, 25600, 160),
    (10e12, 195, 65536, 512),
    (20e12, 390, 65536, 512),
];

impl Model {
    /// The classic dense shape ([`Model`]) of `layers` blocks of `hidden`
    /// with `heads` heads.
    pub fn dense(layers: u32, hidden: u64, heads: u32, seq: u64, vocab: u64) -> Model {
        Model {
            layers,
            hidden,
            heads,
            kv_heads: heads,
            ffn: 4 * hidden,
            gated_mlp: false,
            biases: true,
            qkv_biases: false,
            norm_params: 2 * hidden,
            learned_positions: true,
            tied_head: true,
            seq,
            micro_batch: 1,
            vocab,
        }
    }

    /// A standard dense shape ([`Model::dense`]) for about `params`
    /// parameters (2048 tokens, a micro-batch of 1, a 50257-token
    /// vocabulary): the table's shape within 15%, else layers and hidden
    /// grown at the 1T model's aspect (hidden = 200 x layers) to match.
    pub fn for_params(params: f64) -> Result<Model, SchedulerError> {
        if !(params.is_finite() && (50e6..=PARAMS_MAX).contains(&params)) {
            return Err(SchedulerError::Config {
                what: "model",
                reason: format!(
                    "--params {params:e} is not a size strata can shape (50M to {PARAMS_MAX:e})"
                ),
            });
        }
        let shape = SHAPES
            .iter()
            .find(|s| (s.0 / params - 1.0).abs() <= 0.15)
            .copied();
        let (layers, hidden, heads) = match shape {
            Some((_, layers, hidden, heads)) => (layers, hidden, heads),
            None => {
                let layers = (params / (12.0 * 200.0 * 200.0)).cbrt().round().max(2.0) as u32;
                let hidden_exact = (params / (12.0 * f64::from(layers))).sqrt();
                let hidden = ((hidden_exact / 128.0).round() as u64).max(1) * 128;
                (layers, hidden, (hidden / 128) as u32)
            }
        };
        Ok(Model::dense(layers, hidden, heads, 2048, 50257))
    }

    /// Checks the shape.
    pub fn validate(&self) -> Result<(), SchedulerError> {
        let bad = |reason: String| {
            Err(SchedulerError::Config {
                what: "model",
                reason,
            })
        };
        if self.layers == 0
            || self.hidden == 0
            || self.heads == 0
            || self.seq == 0
            || self.micro_batch == 0
            || self.vocab == 0
        {
            return bad("--layers, --hidden, --heads, --seq, --micro-batch and the vocabulary must all be positive".into());
        }
        if !self.hidden.is_multiple_of(u64::from(self.heads)) {
            return bad(format!(
                "--hidden {} is not a multiple of --heads {}",
                self.hidden, self.heads
            ));
        }
        if self.kv_heads == 0 || !self.heads.is_multiple_of(self.kv_heads) || self.ffn == 0 {
            return bad(format!(
                "{} key/value heads must divide the {} heads, and the MLP's width ({}) be positive",
                self.kv_heads, self.heads, self.ffn
            ));
        }
        for (flag, value, max) in [
            ("--layers", u64::from(self.layers), u64::from(LAYERS_MAX)),
            ("--hidden", self.hidden, HIDDEN_MAX),
            ("--seq", self.seq, SEQ_MAX),
            ("--micro-batch", self.micro_batch, MICRO_BATCH_MAX),
            ("the vocabulary (--vocab)", self.vocab, VOCAB_MAX),
        ] {
            if value > max {
                return bad(format!(
                    "{flag} {value} is above the most strata plans, {max}"
                ));
            }
        }
        Ok(())
    }

    /// Parameters of one block's linear layers, by sub-module: qkv (and
    /// the attention after it), the attention projection, and the MLP's
    /// layers (weights and biases): `fc1` and `fc2`, or with a gate
    /// `gate_up` (both input projections) and `down`.
    pub fn block_params(&self) -> Vec<(&'static str, u64)> {
        let (h, f) = (self.hidden, self.ffn);
        let kv = h / u64::from(self.heads) * u64::from(self.kv_heads);
        let b = u64::from(self.biases);
        let qkv_b = u64::from(self.biases || self.qkv_biases);
        let mut modules = vec![
            ("qkv", h * (h + 2 * kv) + qkv_b * (h + 2 * kv)),
            ("proj", h * h + b * h),
        ];
        if self.gated_mlp {
            modules.extend([("gate_up", 2 * h * f + b * 2 * f), ("down", f * h + b * h)]);
        } else {
            modules.extend([("fc1", h * f + b * f), ("fc2", f * h + b * h)]);
        }
        modules
    }

    /// The norms of one block (kept with the block, too small to move).
    pub fn block_norm_params(&self) -> u64 {
        2 * self.norm_params
    }

    /// The embeddings: the token table and any learned positions.
    pub fn embedding_params(&self) -> u64 {
        let positions = if self.learned_positions { self.seq } else { 0 };
        (self.vocab + positions) * self.hidden
    }

    /// The LM head's own matrix (none when it is the token embedding).
    pub fn head_params(&self) -> u64 {
        if self.tied_head {
            0
        } else {
            self.vocab * self.hidden
        }
    }

    /// All parameters.
    pub fn params(&self) -> u64 {
        let block: u64 =
            self.block_params().iter().map(|p| p.1).sum::<u64>() + self.block_norm_params();
        u64::from(self.layers) * block
            + self.embedding_params()
            + self.head_params()
            + self.norm_params
    }

    /// The largest single module (what ZeRO-3 gathers at once).
    pub fn largest_layer_params(&self) -> u64 {
        self.block_params()
            .iter()
            .map(|p| p.1)
            .max()
            .unwrap_or(0)
            .max(self.vocab * self.hidden)
    }

    /// Tokens per micro-batch per GPU.
    pub fn tokens(&self) -> u64 {
        self.seq * self.micro_batch
    }

    /// Forward FLOPs of one block per micro-batch: matrix products plus
    /// attention scores and their use of values.
    pub fn block_forward_flops(&self) -> f64 {
        self.block_linear_flops() + 2.0 * self.block_attention_flops()
    }

    /// Forward FLOPs of one block's matrix products per micro-batch.
    pub fn block_linear_flops(&self) -> f64 {
        let linear: u64 = self.block_params().iter().map(|p| p.1).sum();
        2.0 * self.tokens() as f64 * linear as f64
    }

    /// Forward FLOPs of one block's causal attention per micro-batch, as
    /// FlashAttention counts them (`4 b h s^2 d / 2`: the masked half not
    /// counted; its backward 2.5x).
    pub fn block_attention_flops(&self) -> f64 {
        2.0 * self.tokens() as f64 * self.seq as f64 * self.hidden as f64
    }

    /// Model FLOPs of one micro-batch (forward and backward, no recompute):
    /// what TFLOP/s figures count.
    pub fn model_flops_per_micro_batch(&self) -> f64 {
        let head = 2.0 * self.tokens() as f64 * (self.vocab * self.hidden) as f64;
        3.0 * (f64::from(self.layers) * self.block_forward_flops() + head)
    }

    /// Bytes of one block's saved input (the checkpoint).
    pub fn checkpoint_bytes(&self) -> u64 {
        2 * self.tokens() * self.hidden
    }

    /// Bytes of one block's activations kept for backward without
    /// checkpointing, 16-bit (Korthikanti et al.'s 34sbh + 5as^2b for the
    /// dense shape): attention 11sbh with keys and values at their heads'
    /// share (7sbh + 4sbh x kv/heads), the norms 4sbh, the MLP 3sbh and
    /// 4 bytes of its width per token (6 with a gate: gate, up and their
    /// product).
    pub fn block_activation_bytes(&self) -> u64 {
        let (tokens, h) = (self.tokens(), self.hidden);
        let attention = 7 * h + 4 * h * u64::from(self.kv_heads) / u64::from(self.heads);
        let mlp = 3 * h + if self.gated_mlp { 6 } else { 4 } * self.ffn;
        tokens * (attention + 4 * h + mlp)
            + 5 * u64::from(self.heads) * self.seq * self.seq * self.micro_batch
    }
}

/// How the optimizer states are kept (`optim.state_dtype` in the
/// engine's config, `--state-dtype` in `strata plan`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum StateDtype {
    /// fp32 master weights and moments: 12 bytes per parameter.
    #[default]
    Fp32,
    /// fp32 master weights, bf16 moments rounded stochastically (random
    /// bits from the run's seed, the step and each parameter's index): 8
    /// bytes per parameter, 20 read and written per step instead of 28.
    Bf16Moments,
    /// bf16 master weights and moments, all rounded stochastically: 6
    /// bytes per parameter. The bf16 parameter copy is the master as
    /// stored.
    Bf16,
}

impl StateDtype {
    /// Bytes of one master weight.
    pub fn master_bytes(self) -> usize {
        match self {
            StateDtype::Fp32 | StateDtype::Bf16Moments => 4,
            StateDtype::Bf16 => 2,
        }
    }

    /// Bytes of one moment.
    pub fn moment_bytes(self) -> usize {
        match self {
            StateDtype::Fp32 => 4,
            StateDtype::Bf16Moments | StateDtype::Bf16 => 2,
        }
    }

    /// Bytes of one parameter's states: master weight and two moments.
    pub fn bytes_per_param(self) -> usize {
        self.master_bytes() + 2 * self.moment_bytes()
    }

    /// Whether bf16 states are written with stochastic rounding.
    pub fn stochastic(self) -> bool {
        self != StateDtype::Fp32
    }

    /// The name in configs and `meta.json`.
    pub fn name(self) -> &'static str {
        match self {
            StateDtype::Fp32 => "fp32",
            StateDtype::Bf16Moments => "bf16-moments",
            StateDtype::Bf16 => "bf16",
        }
    }
}

impl StateDtype {
    /// Every state dtype, in the order of their names in messages.
    pub const ALL: [StateDtype; 3] = [StateDtype::Fp32, StateDtype::Bf16Moments, StateDtype::Bf16];

    /// Bytes one out-of-place optimizer step reads and writes per
    /// parameter: a bf16 gradient, the states in and out, and the bf16
    /// parameter copy (28 with fp32 states, 20 with bf16 moments, 16 with
    /// bf16 masters).
    pub fn step_bytes_per_param(self) -> usize {
        2 + 2 * self.bytes_per_param() + 2
    }
}

impl std::str::FromStr for StateDtype {
    type Err = String;

    fn from_str(s: &str) -> Result<StateDtype, String> {
        StateDtype::ALL
            .into_iter()
            .find(|d| d.name() == s)
            .ok_or_else(|| {
                let names: Vec<_> = StateDtype::ALL.iter().map(|d| d.name()).collect();
                format!(
                    "unknown state dtype {s:?}: choose one of {}",
                    names.join(", ")
                )
            })
    }
}

/// How the model is split and where its states live.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Parallelism {
    /// Data-parallel degree (ZeRO shards over it).
    pub data: u32,
    /// Hybrid sharding (FSDP2's HSDP, DeepSpeed's hpZ, strata's
    /// `[parallel] shard_degree`): the ZeRO shards are cut over groups of
    /// this many neighbouring data-parallel ranks and replicated across
    /// the groups; gradients are reduce-scattered within a group, then
    /// all-reduced across the replicas. 0: over all `data` ranks.
    pub shard_degree: u32,
    /// Tensor-parallel degree.
    pub tensor: u32,
    /// Pipeline-parallel degree.
    pub pipeline: u32,
    /// ZeRO stage: 0 replicates everything, 1 shards optimizer states, 2
    /// also gradients, 3 also parameters.
    pub zero_stage: u8,
    /// Where the 16-bit parameters live between uses.
    pub offload_param: Tier,
    /// Where fp32 master weights, moments and fp32 gradients live (and so
    /// where the optimizer runs: GPU for device, CPU otherwise).
    pub offload_optimizer: Tier,
    /// Micro-batches per optimizer step.
    pub grad_accumulation: u32,
    /// Gradient clipping by global norm: the optimizer waits for the whole
    /// backward pass.
    pub grad_clip: bool,
    /// Which blocks keep only their input and recompute the rest in
    /// backward: every one, none, or those [`crate::recompute::choose`]
    /// picks for the device and host room.
    pub checkpoint_activations: Checkpointing,
    /// How the optimizer states are kept: their bytes, and the CPU
    /// optimizer's time (memory-bound: in proportion to the bytes a step
    /// reads and writes).
    pub state_dtype: StateDtype,
}

impl Parallelism {
    /// Data-parallel ranks each ZeRO shard is cut over (`shard_degree`, or
    /// all of them).
    pub fn shards(&self) -> u32 {
        match self.shard_degree {
            0 => self.data,
            k => k.min(self.data),
        }
    }

    /// Copies of each shard (1 without hybrid sharding).
    pub fn replicas(&self) -> u32 {
        self.data / self.shards().max(1)
    }

    /// ZeRO-3 over every GPU with the given offload targets, checkpointing
    /// on, clipping on, one micro-batch per step.
    pub fn zero3_offload(
        hardware: &Hardware,
        offload_param: Tier,
        offload_optimizer: Tier,
    ) -> Parallelism {
        Parallelism {
            data: hardware.nodes * hardware.gpus_per_node,
            shard_degree: 0,
            tensor: 1,
            pipeline: 1,
            zero_stage: 3,
            offload_param,
            offload_optimizer,
            grad_accumulation: 1,
            grad_clip: true,
            checkpoint_activations: Checkpointing::Every,
            state_dtype: StateDtype::Fp32,
        }
    }

    /// Checks the degrees against the model and hardware, and the offload
    /// targets against the ZeRO stage; errors name the options.
    pub fn validate(&self, model: &Model, hardware: &Hardware) -> Result<(), SchedulerError> {
        let bad = |reason: String| {
            Err(SchedulerError::Config {
                what: "parallelism",
                reason,
            })
        };
        let gpus = u64::from(hardware.nodes) * u64::from(hardware.gpus_per_node);
        if self.data == 0 || self.tensor == 0 || self.pipeline == 0 || self.grad_accumulation == 0 {
            return bad("--data-parallel, --tensor-parallel, --pipeline-parallel and --grad-accumulation must be positive".into());
        }
        let product = u64::from(self.data) * u64::from(self.tensor) * u64::from(self.pipeline);
        if product != gpus {
            return bad(format!(
                "data {} x tensor {} x pipeline {} = {product} GPUs, but {} nodes x {} GPUs = {gpus}; make the product match",
                self.data, self.tensor, self.pipeline, hardware.nodes, hardware.gpus_per_node
            ));
        }
        if self.shard_degree > self.data || !self.data.is_multiple_of(self.shard_degree.max(1)) {
            return bad(format!(
                "--shard-degree {} does not divide the {} data-parallel GPUs: give a divisor (0: shard over all of them)",
                self.shard_degree, self.data
            ));
        }
        if self.grad_accumulation > GRAD_ACCUMULATION_MAX {
            return bad(format!(
                "--grad-accumulation {} is above the most strata plans, {GRAD_ACCUMULATION_MAX}",
                self.grad_accumulation
            ));
        }
        let micro_blocks = u64::from(model.layers.div_ceil(self.pipeline.max(1)))
            * u64::from(self.grad_accumulation);
        if micro_blocks > MICRO_BLOCKS_MAX {
            return bad(format!(
                "{} layers per stage x --grad-accumulation {} = {micro_blocks} block passes per step, above the {MICRO_BLOCKS_MAX} a plan holds: plan with a smaller --grad-accumulation",
                model.layers.div_ceil(self.pipeline.max(1)),
                self.grad_accumulation
            ));
        }
        if self.zero_stage > 3 {
            return bad(format!(
                "--zero-stage {} (choose 0, 1, 2 or 3)",
                self.zero_stage
            ));
        }
        if self.offload_param != Tier::Device && self.zero_stage != 3 {
            return bad(format!(
                "--offload-param {} needs --zero-stage 3 (only stage 3 partitions parameters)",
                self.offload_param
            ));
        }
        let on_nvme = [self.offload_param, self.offload_optimizer].contains(&Tier::Nvme);
        if on_nvme && hardware.nvme_drives == 0 {
            return bad(
                "--offload-param/--offload-optimizer nvme with --nvme-drives 0: give the node drives or offload to cpu"
                    .into(),
            );
        }
        if self.pipeline > 1 && self.zero_stage > 1 {
            return bad(format!(
                "--pipeline-parallel {} needs --zero-stage 0 or 1 (stages 2 and 3 shard what pipeline stages keep)",
                self.pipeline
            ));
        }
        if !u64::from(model.heads).is_multiple_of(u64::from(self.tensor)) {
            return bad(format!(
                "--tensor-parallel {} does not divide --heads {}",
                self.tensor, model.heads
            ));
        }
        if !model.layers.is_multiple_of(self.pipeline) {
            return bad(format!(
                "--pipeline-parallel {} does not divide --layers {}",
                self.pipeline, model.layers
            ));
        }
        if self.tensor > hardware.gpus_per_node {
            return bad(format!(
                "--tensor-parallel {} spans nodes ({} GPUs per node); keep it within a node",
                self.tensor, hardware.gpus_per_node
            ));
        }
        Ok(())
    }
}

/// A cluster: nodes of identical GPUs, host RAM, NVMe drives and CPUs.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Hardware {
    /// Preset name or "custom".
    pub name: String,
    /// Nodes.
    pub nodes: u32,
    /// GPUs per node.
    pub gpus_per_node: u32,
    /// Peak dense 16-bit FLOP/s per GPU.
    pub gpu_flops: f64,
    /// Fraction of peak large matrix products reach.
    pub gpu_efficiency: f64,
    /// HBM per GPU.
    pub gpu_memory_bytes: u64,
    /// HBM bandwidth per GPU (optimizer on the GPU).
    pub gpu_memory_bytes_per_s: f64,
    /// Host RAM per node.
    pub host_memory_bytes: u64,
    /// PCIe bandwidth per GPU, each direction.
    pub pcie_bytes_per_s: f64,
    /// NVLink bandwidth per GPU, each direction.
    pub nvlink_bytes_per_s: f64,
    /// Network bandwidth per node, each direction.
    pub network_bytes_per_s: f64,
    /// NVMe drives per node.
    pub nvme_drives: u32,
    /// Read bandwidth per drive.
    pub nvme_read_bytes_per_s: f64,
    /// Write bandwidth per drive.
    pub nvme_write_bytes_per_s: f64,
    /// Capacity per drive.
    pub nvme_bytes: u64,
    /// CPU optimizer (Adam) throughput per node.
    pub cpu_optimizer_params_per_s: f64,
    /// Measured causal attention rates, forward and backward, FLOP/s in
    /// FlashAttention's count (`strata bench kernels`); None: attention is
    /// costed as matrix products, its full (unmasked) count at
    /// `gpu_flops x gpu_efficiency`.
    pub attention_flops_per_s: Option<(f64, f64)>,
}

const GB: f64 = 1e9;

impl Hardware {
    /// Names of the presets.
    pub const PRESETS: [&'static str; 3] = ["dgx2", "dgx-a100", "dgx-h100"];

    /// A preset machine, one node: `dgx2` (16x V100 32 GB, 1.5 TB RAM,
    /// 8x 3.84 TB NVMe), `dgx-a100` (8x A100 80 GB, 2 TB, 4x 3.84 TB),
    /// `dgx-h100` (8x H100 80 GB, 2 TB, 8x 3.84 TB).
    pub fn preset(name: &str) -> Result<Hardware, SchedulerError> {
        let (gpus, flops, hbm, hbm_bw, host, pcie, nvlink, net, drives, read, write, adam) =
            match name {
                "dgx2" => (
                    16, 125e12, 32e9, 900e9, 1.5e12, 12e9, 150e9, 100e9, 8, 3.1e9, 2.0e9, 5e9,
                ),
                "dgx-a100" => (
                    8, 312e12, 80e9, 2.0e12, 2.0e12, 25e9, 300e9, 200e9, 4, 6.8e9, 4.0e9, 8e9,
                ),
                "dgx-h100" => (
                    8, 989e12, 80e9, 3.35e12, 2.0e12, 50e9, 450e9, 400e9, 8, 6.8e9, 4.0e9, 12e9,
                ),
                _ => {
                    return Err(SchedulerError::Config {
                        what: "hardware",
                        reason: format!(
                            "unknown preset {name:?} (choose {})",
                            Hardware::PRESETS.join(", ")
                        ),
                    });
                }
            };
        Ok(Hardware {
            name: name.into(),
            nodes: 1,
            gpus_per_node: gpus,
            gpu_flops: flops,
            gpu_efficiency: 0.55,
            gpu_memory_bytes: hbm as u64,
            gpu_memory_bytes_per_s: hbm_bw,
            host_memory_bytes: host as u64,
            pcie_bytes_per_s: pcie,
            nvlink_bytes_per_s: nvlink,
            network_bytes_per_s: net,
            nvme_drives: drives,
            nvme_read_bytes_per_s: read,
            nvme_write_bytes_per_s: write,
            nvme_bytes: (3.84 * 1e12) as u64,
            cpu_optimizer_params_per_s: adam,
            attention_flops_per_s: None,
        })
    }

    /// Checks that every number is positive.
    pub fn validate(&self) -> Result<(), SchedulerError> {
        let speeds = [
            ("--gpu-tflops", self.gpu_flops),
            ("--gpu-efficiency", self.gpu_efficiency),
            ("--pcie-gbps", self.pcie_bytes_per_s),
            ("--nvlink-gbps", self.nvlink_bytes_per_s),
            ("--network-gbps", self.network_bytes_per_s),
            ("--nvme-read-gbps", self.nvme_read_bytes_per_s),
            ("--nvme-write-gbps", self.nvme_write_bytes_per_s),
            ("--cpu-adam-params-per-s", self.cpu_optimizer_params_per_s),
            ("HBM bandwidth", self.gpu_memory_bytes_per_s),
            (
                "the attention's forward rate",
                self.attention_flops_per_s.map_or(1.0, |r| r.0),
            ),
            (
                "the attention's backward rate",
                self.attention_flops_per_s.map_or(1.0, |r| r.1),
            ),
        ];
        for (name, value) in speeds {
            if !(value.is_finite() && value > 0.0) {
                return Err(SchedulerError::Config {
                    what: "hardware",
                    reason: format!("{name} must be positive (got {value})"),
                });
            }
        }
        if self.gpu_efficiency > 1.0 {
            return Err(SchedulerError::Config {
                what: "hardware",
                reason: format!("--gpu-efficiency {} is over 1", self.gpu_efficiency),
            });
        }
        if self.nodes == 0
            || self.gpus_per_node == 0
            || self.gpu_memory_bytes == 0
            || self.host_memory_bytes == 0
        {
            return Err(SchedulerError::Config {
                what: "hardware",
                reason: "--nodes, --gpus-per-node, --gpu-memory and --host-memory must be positive"
                    .into(),
            });
        }
        Ok(())
    }

    /// NVMe capacity per node.
    pub fn nvme_bytes_per_node(&self) -> u64 {
        self.nvme_bytes * u64::from(self.nvme_drives)
    }

    /// A short description.
    pub fn describe(&self) -> String {
        format!(
            "{} x {}: {} GPUs of {:.0} GB at {:.0} TFLOP/s, {:.2} TB RAM, {} NVMe at {:.1}/{:.1} GB/s",
            self.nodes,
            self.name,
            self.gpus_per_node,
            self.gpu_memory_bytes as f64 / GB,
            self.gpu_flops / 1e12,
            self.host_memory_bytes as f64 / 1e12,
            self.nvme_drives,
            self.nvme_read_bytes_per_s * f64::from(self.nvme_drives) / GB,
            self.nvme_write_bytes_per_s * f64::from(self.nvme_drives) / GB
        ) + &match self.attention_flops_per_s {
            Some((forward, backward)) => format!(
                "; measured: GEMMs {:.0} TFLOP/s, attention {:.0}/{:.0} TFLOP/s forward/backward",
                self.gpu_flops * self.gpu_efficiency / 1e12,
                forward / 1e12,
                backward / 1e12
            ),
            None => String::new(),
        }
    }
}

/// DeepSpeed's `estimate_zero3_model_states_mem_needs` with
/// `zero_init=True` and its buffer factor 1: (bytes per GPU, bytes of CPU
/// RAM per node). With everything offloaded the GPU holds 4 bytes per
/// parameter of the largest layer (its 16-bit parameters and gradients)
/// and each node 18 bytes per parameter it shares (16-bit parameters, fp32
/// master weights, moments and gradients); with only the optimizer
/// offloaded, the 16-bit parameters stay on the GPUs.
pub fn deepspeed_zero3_estimate(
    params: u64,
    largest_layer_params: u64,
    gpus_per_node: u32,
    nodes: u32,
    offload_optimizer: bool,
    offload_params: bool,
) -> (u64, u64) {
    let gpus = u64::from(gpus_per_node * nodes);
    let largest = 4 * largest_layer_params;
    let per_node = |bytes_per_param: u64| params * bytes_per_param / u64::from(nodes);
    match (offload_optimizer, offload_params) {
        (true, true) => (largest, per_node(18)),
        (true, false) => (largest + 2 * params / gpus, per_node(16)),
        _ => (largest + 18 * params / gpus, 0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn standard_sizes_come_out_near_their_names() {
        for (params, ..) in SHAPES {
            let model = Model::for_params(params).unwrap();
            let ratio = model.params() as f64 / params;
            assert!(
                (0.85..1.15).contains(&ratio),
                "{params:e}: {} params",
                model.params()
            );
        }
        let odd = Model::for_params(4e12).unwrap();
        let ratio = odd.params() as f64 / 4e12;
        assert!((0.9..1.1).contains(&ratio), "{ratio}");
        odd.validate().unwrap();
    }

    #[test]
    fn a_gated_mlp_grouped_heads_and_an_untied_head_are_counted() {
        // A published 7B shape with a gated MLP and an untied head:
        // 6,738,415,616 parameters by its own count.
        let gated = Model {
            kv_heads: 32,
            ffn: 11008,
            gated_mlp: true,
            biases: false,
            qkv_biases: false,
            norm_params: 4096,
            learned_positions: false,
            tied_head: false,
            ..Model::dense(32, 4096, 32, 4096, 32000)
        };
        gated.validate().unwrap();
        assert_eq!(gated.params(), 6_738_415_616);
        assert_eq!(gated.head_params(), 32000 * 4096);
        // Fewer key/value heads shrink qkv and the kept activations.
        let grouped = Model {
            kv_heads: 8,
            ..gated.clone()
        };
        assert_eq!(
            gated.block_params()[0].1 - grouped.block_params()[0].1,
            2 * 4096 * (4096 - 1024)
        );
        assert!(grouped.block_activation_bytes() < gated.block_activation_bytes());
        // The dense shape keeps Korthikanti et al.'s 34sbh + 5as^2b.
        let dense = Model::dense(2, 64, 4, 16, 100);
        assert_eq!(
            dense.block_activation_bytes(),
            34 * 16 * 64 + 5 * 4 * 16 * 16
        );
        let bad = Model {
            kv_heads: 3,
            ..dense
        };
        assert!(
            bad.validate()
                .unwrap_err()
                .to_string()
                .contains("key/value heads")
        );
    }

    #[test]
    fn deepspeed_formula_matches_its_documented_example() {
        // DeepSpeed's docs: 2851M params, 32M largest layer, 1 node x 8
        // GPUs, params and optimizer on CPU: 71.7 GB (GiB) per CPU with the
        // 1.5 factor, 0.12 per GPU.
        let (gpu, cpu) = deepspeed_zero3_estimate(2_851_000_000, 32_000_000, 8, 1, true, true);
        let gib = 1024f64.powi(3);
        assert_eq!(format!("{:.2}", gpu as f64 / gib), "0.12");
        assert_eq!(format!("{:.1}", cpu as f64 * 1.5 / gib), "71.7");
    }
}
