//! Applies the sections of a DeepSpeed config to a strata config, each
//! as DeepSpeed reads it.

use std::collections::BTreeSet;
use std::path::PathBuf;

use serde_json::{Map, Value};
use strata_storage::{ByteSize, StorageConfig};

use super::ds_error;
use super::reader::{Reader, Setting};
use crate::engine::config::{Placement, Schedule, TrainConfig, WarmupType};
use crate::error::Result;

/// What [`apply`] made of a config: the strata config (not yet
/// validated), the keys read, and where strata's run differs by design.
pub(super) struct Applied {
    pub(super) config: TrainConfig,
    pub(super) used: BTreeSet<String>,
    pub(super) notes: Vec<String>,
}

/// Applies every section of `root` to `config`, in [`super::KEYS`]' order.
pub(super) fn apply(root: &Map<String, Value>, config: TrainConfig) -> Result<Applied> {
    let mut mapper = Mapper {
        reader: Reader::new(root),
        config,
        notes: Vec::new(),
    };
    mapper.batch()?;
    mapper.clipping()?;
    mapper.precision()?;
    mapper.optimizer()?;
    mapper.scheduler()?;
    mapper.zero()?;
    mapper.aio()?;
    Ok(Applied {
        config: mapper.config,
        used: mapper.reader.into_used(),
        notes: mapper.notes,
    })
}

/// Applies the sections of a DeepSpeed config to a strata config.
struct Mapper<'a> {
    reader: Reader<'a>,
    config: TrainConfig,
    notes: Vec<String>,
}

impl Mapper<'_> {
    /// `train_batch_size`, `train_micro_batch_size_per_gpu` and
    /// `gradient_accumulation_steps`, derived and checked as DeepSpeed's
    /// `_set_batch_related_parameters` and `_batch_assertion` do.
    fn batch(&mut self) -> Result<()> {
        let t = &self.config.train;
        let world = t.ranks as u64;
        let micro = match self.reader.u64("train_micro_batch_size_per_gpu")? {
            Setting::Auto => Some(t.micro_batch as u64),
            Setting::Given(micro) => Some(micro),
            Setting::Absent => None,
        };
        let accumulation = match self.reader.u64("gradient_accumulation_steps")? {
            Setting::Auto => Some(t.grad_accumulation as u64),
            Setting::Given(steps) => Some(steps),
            Setting::Absent => None,
        };
        let total = match self.reader.u64("train_batch_size")? {
            Setting::Given(total) => Some(total),
            Setting::Auto | Setting::Absent => None,
        };
        let (micro, accumulation) = match (total, micro, accumulation) {
            (None, None, None) => return Ok(()),
            (Some(total), Some(micro), None) => (micro, total / micro.max(1) / world),
            (Some(total), None, Some(steps)) => (total / world / steps.max(1), steps),
            (Some(total), None, None) => (total / world, 1),
            (_, micro, steps) => (
                micro.unwrap_or(t.micro_batch as u64),
                steps.unwrap_or(t.grad_accumulation as u64),
            ),
        };
        if micro == 0 || accumulation == 0 {
            return Err(ds_error(
                "train_batch_size",
                total.unwrap_or(0),
                format!(
                    "it leaves {micro} sequences per micro-batch and {accumulation} micro-batches per step over {world} rank(s): give a train_batch_size of at least train.ranks x micro-batch"
                ),
            ));
        }
        let product = micro
            .checked_mul(accumulation)
            .and_then(|sequences| sequences.checked_mul(world));
        if let Some(total) = total
            && product != Some(total)
        {
            return Err(ds_error(
                "train_batch_size",
                total,
                format!(
                    "DeepSpeed needs train_micro_batch_size_per_gpu ({micro}) x gradient_accumulation_steps ({accumulation}) x world size (train.ranks = {world}) to equal it: fix one of them, or set train_batch_size to \"auto\""
                ),
            ));
        }
        let too_large = |key: &str, value: u64| {
            ds_error(
                key,
                value,
                "use a value this machine can count (below 2^32)",
            )
        };
        let t = &mut self.config.train;
        t.micro_batch = usize::try_from(micro)
            .map_err(|_| too_large("train_micro_batch_size_per_gpu", micro))?;
        t.grad_accumulation = usize::try_from(accumulation)
            .map_err(|_| too_large("gradient_accumulation_steps", accumulation))?;
        Ok(())
    }

    fn clipping(&mut self) -> Result<()> {
        let base = self.config.train.clip_norm;
        self.config.train.clip_norm = self.reader.f64("gradient_clipping")?.or(base, base);
        Ok(())
    }

    /// `bf16` (or `bfloat16`) and `fp16`: the loss scaler.
    fn precision(&mut self) -> Result<()> {
        let bf16_key = if self.reader.has("bf16") {
            "bf16.enabled"
        } else {
            "bfloat16.enabled"
        };
        let bf16 = self.reader.bool(bf16_key)?;
        let fp16 = self.reader.bool("fp16.enabled")?;
        let fp16_on = fp16 == Setting::Given(true);
        if fp16_on && bf16 == Setting::Given(true) {
            return Err(ds_error(
                "fp16.enabled",
                true,
                "bf16.enabled is true too, which DeepSpeed also refuses: enable one",
            ));
        }
        if fp16_on {
            return self.fp16();
        }
        self.reader.consume("fp16");
        match bf16 {
            Setting::Given(true) | Setting::Auto => {
                let t = &mut self.config.train;
                t.loss_scale = 1.0;
                t.loss_scale_dynamic = false;
            }
            Setting::Given(false) => {
                return Err(ds_error(
                    bf16_key,
                    false,
                    "with fp16 not enabled either, DeepSpeed would train in fp32, and strata computes in bf16 (with fp32 master weights): set bf16.enabled to true",
                ));
            }
            Setting::Absent => self.notes.push(
                "neither bf16 nor fp16 is enabled (DeepSpeed would train in fp32): strata computes in bf16 with the --config loss scaling".into(),
            ),
        }
        Ok(())
    }

    /// An enabled `fp16` section, whole: its omitted keys take DeepSpeed's
    /// defaults.
    fn fp16(&mut self) -> Result<()> {
        let r = &mut self.reader;
        let loss_scale = r.f64("fp16.loss_scale")?.or(0.0, 0.0);
        let power = r.u64("fp16.initial_scale_power")?.or(16, 16);
        let window = r.u64("fp16.loss_scale_window")?.or(1000, 1000);
        let hysteresis = r.u64("fp16.hysteresis")?.or(2, 2);
        let min_scale = r.f64("fp16.min_loss_scale")?.or(1.0, 1.0);
        if r.bool("fp16.consecutive_hysteresis")? == Setting::Given(true) {
            return Err(ds_error(
                "fp16.consecutive_hysteresis",
                true,
                "strata's loss scaler refills its hysteresis only when the scale changes: remove the key or set it to false",
            ));
        }
        if !(loss_scale >= 0.0 && loss_scale <= f64::from(f32::MAX)) {
            return Err(ds_error(
                "fp16.loss_scale",
                loss_scale,
                "use 0 (dynamic) or a positive static scale",
            ));
        }
        let t = &mut self.config.train;
        if loss_scale > 0.0 {
            t.loss_scale = loss_scale as f32;
            t.loss_scale_dynamic = false;
        } else {
            let power = i32::try_from(power)
                .ok()
                .filter(|power| *power <= 127)
                .ok_or_else(|| {
                    ds_error(
                        "fp16.initial_scale_power",
                        power,
                        "use 0 to 127 (2^power must be a finite fp32)",
                    )
                })?;
            t.loss_scale = 2f32.powi(power);
            t.loss_scale_dynamic = true;
            t.loss_scale_growth_interval = u32::try_from(window)
                .ok()
                .filter(|window| *window > 0)
                .ok_or_else(|| {
                    ds_error(
                        "fp16.loss_scale_window",
                        window,
                        "use 1 to 4294967295 clean steps",
                    )
                })?;
            t.loss_scale_hysteresis = u32::try_from(hysteresis)
                .ok()
                .filter(|hysteresis| *hysteresis > 0)
                .ok_or_else(|| {
                    ds_error(
                        "fp16.hysteresis",
                        hysteresis,
                        "use 1 to 4294967295 overflows",
                    )
                })?;
            if !(min_scale > 0.0 && min_scale <= f64::from(t.loss_scale)) {
                return Err(ds_error(
                    "fp16.min_loss_scale",
                    min_scale,
                    format!(
                        "use a scale above 0 and at most 2^initial_scale_power ({})",
                        t.loss_scale
                    ),
                ));
            }
            t.loss_scale_min = min_scale as f32;
        }
        self.notes.push(
            "fp16.enabled: strata's half-precision type is bf16, so the run computes in bf16 (with fp16's loss scaling)".into(),
        );
        Ok(())
    }

    /// An `optimizer` section, whole.
    fn optimizer(&mut self) -> Result<()> {
        if !self.reader.has("optimizer") {
            return Ok(());
        }
        let r = &mut self.reader;
        let kind = match r.string("optimizer.type")? {
            Setting::Given(kind) => kind,
            Setting::Auto | Setting::Absent => {
                return Err(ds_error(
                    "optimizer.type",
                    "(absent)",
                    "name the optimizer: \"AdamW\" or \"Adam\"",
                ));
            }
        };
        let adamw = match kind.to_lowercase().as_str() {
            "adam" => false,
            "adamw" => true,
            _ => {
                return Err(ds_error(
                    "optimizer.type",
                    format!("{kind:?}"),
                    "strata's optimizer is AdamW: use \"AdamW\" or \"Adam\" (DeepSpeed runs Adam as AdamW unless adam_w_mode is false)",
                ));
            }
        };
        let base = self.config.train.clone();
        let lr = r.f64("optimizer.params.lr")?.or(base.lr, 1e-3);
        let (beta1, beta2) = match r.raw("optimizer.params.betas")? {
            Setting::Absent => (0.9, 0.999),
            Setting::Auto => (base.beta1, base.beta2),
            Setting::Given(value) => match value.as_array().map(|a| a.as_slice()) {
                Some([beta1, beta2]) => match (beta1.as_f64(), beta2.as_f64()) {
                    (Some(beta1), Some(beta2)) => (beta1, beta2),
                    _ => {
                        return Err(ds_error(
                            "optimizer.params.betas",
                            value,
                            "give [beta1, beta2]",
                        ));
                    }
                },
                _ => {
                    return Err(ds_error(
                        "optimizer.params.betas",
                        value,
                        "give [beta1, beta2]",
                    ));
                }
            },
        };
        let eps = r.f64("optimizer.params.eps")?.or(base.eps, 1e-8);
        let weight_decay = r
            .f64("optimizer.params.weight_decay")?
            .or(base.weight_decay, 0.0);
        let adam_w_mode = r.bool("optimizer.params.adam_w_mode")?.or(true, true);
        if !adamw && !adam_w_mode && weight_decay != 0.0 {
            return Err(ds_error(
                "optimizer.params.adam_w_mode",
                false,
                "strata's optimizer decays weights decoupled (AdamW); L2-regularized Adam is not in strata: set adam_w_mode to true, or weight_decay to 0",
            ));
        }
        if r.bool("optimizer.params.bias_correction")? == Setting::Given(false) {
            return Err(ds_error(
                "optimizer.params.bias_correction",
                false,
                "strata's AdamW always corrects the moments' bias: remove the key or set it to true",
            ));
        }
        if r.bool("optimizer.params.amsgrad")? == Setting::Given(true) {
            return Err(ds_error(
                "optimizer.params.amsgrad",
                true,
                "AMSGrad is not in strata's AdamW: remove the key or set it to false",
            ));
        }
        let t = &mut self.config.train;
        if !self.reader.has("scheduler") && t.schedule == Schedule::Cosine && t.lr > 0.0 {
            // The base's own schedule stays: its floor keeps its ratio to
            // the peak.
            t.lr_min *= lr / t.lr;
        }
        (t.lr, t.beta1, t.beta2, t.eps, t.weight_decay) = (lr, beta1, beta2, eps, weight_decay);
        Ok(())
    }

    /// A `scheduler` section, whole.
    fn scheduler(&mut self) -> Result<()> {
        if !self.reader.has("scheduler") {
            return Ok(());
        }
        let kind = match self.reader.string("scheduler.type")? {
            Setting::Given(kind) => kind,
            Setting::Auto | Setting::Absent => {
                return Err(ds_error(
                    "scheduler.type",
                    "(absent)",
                    "name the scheduler: WarmupLR, WarmupDecayLR or WarmupCosineLR",
                ));
            }
        };
        let params: &[&str] = match kind.as_str() {
            "WarmupLR" => &[
                "warmup_min_lr",
                "warmup_max_lr",
                "warmup_num_steps",
                "warmup_type",
            ],
            "WarmupDecayLR" => &[
                "total_num_steps",
                "warmup_min_lr",
                "warmup_max_lr",
                "warmup_num_steps",
                "warmup_type",
            ],
            "WarmupCosineLR" => &[
                "total_num_steps",
                "warmup_min_ratio",
                "warmup_num_steps",
                "cos_min_ratio",
                "warmup_type",
            ],
            _ => {
                return Err(ds_error(
                    "scheduler.type",
                    format!("{kind:?}"),
                    "strata follows DeepSpeed's WarmupLR, WarmupDecayLR and WarmupCosineLR: use one of them, or drop the scheduler section to keep the --config schedule",
                ));
            }
        };
        self.check_scheduler_params(&kind, params)?;
        let r = &mut self.reader;
        let base = self.config.train.clone();
        let warmup_num_steps = r.u64("scheduler.params.warmup_num_steps")?.or(
            base.warmup_steps,
            crate::engine::config::WARMUP_NUM_STEPS_DEFAULT,
        );
        let warmup_type = match r.string("scheduler.params.warmup_type")? {
            // (The reader refuses "auto" here: KEYS gives it no meaning.)
            Setting::Absent | Setting::Auto => WarmupType::Log,
            Setting::Given(text) if text == "log" => WarmupType::Log,
            Setting::Given(text) if text == "linear" => WarmupType::Linear,
            Setting::Given(other) => {
                return Err(ds_error(
                    "scheduler.params.warmup_type",
                    format!("{other:?}"),
                    "use \"log\" or \"linear\"",
                ));
            }
        };
        let total_num_steps = if kind == "WarmupLR" {
            None
        } else {
            match r.u64("scheduler.params.total_num_steps")? {
                Setting::Given(total) => Some(total),
                Setting::Auto => None,
                Setting::Absent => {
                    return Err(ds_error(
                        "scheduler.params.total_num_steps",
                        "(absent)",
                        format!(
                            "{kind} needs it, as in DeepSpeed: give the steps, or \"auto\" to follow train.steps"
                        ),
                    ));
                }
            }
        };
        let schedule = if kind == "WarmupCosineLR" {
            Schedule::WarmupCosineLr {
                warmup_min_ratio: r.f64("scheduler.params.warmup_min_ratio")?.or(0.0, 0.0),
                cos_min_ratio: r.f64("scheduler.params.cos_min_ratio")?.or(
                    crate::engine::config::COS_MIN_RATIO_DEFAULT,
                    crate::engine::config::COS_MIN_RATIO_DEFAULT,
                ),
                warmup_num_steps,
                warmup_type,
                total_num_steps,
            }
        } else {
            let warmup_min_lr = r.f64("scheduler.params.warmup_min_lr")?.or(0.0, 0.0);
            let max_default = if kind == "WarmupLR" { base.lr } else { 1e-3 };
            self.config.train.lr = r
                .f64("scheduler.params.warmup_max_lr")?
                .or(base.lr, max_default);
            if kind == "WarmupLR" {
                Schedule::WarmupLr {
                    warmup_min_lr,
                    warmup_num_steps,
                    warmup_type,
                }
            } else {
                Schedule::WarmupDecayLr {
                    warmup_min_lr,
                    warmup_num_steps,
                    warmup_type,
                    total_num_steps,
                }
            }
        };
        self.config.train.schedule = schedule;
        Ok(())
    }

    /// Refuses params `kind`'s constructor does not take (DeepSpeed's
    /// would raise), and a `last_batch_iteration` other than -1.
    fn check_scheduler_params(&mut self, kind: &str, params: &[&str]) -> Result<()> {
        if let Some(Value::Object(given)) = self.reader.lookup("scheduler.params") {
            for name in given.keys() {
                if !params.contains(&name.as_str()) && name != "last_batch_iteration" {
                    return Err(ds_error(
                        &format!("scheduler.params.{name}"),
                        given[name].clone(),
                        format!(
                            "{kind} takes no {name} (DeepSpeed would refuse it too): remove it"
                        ),
                    ));
                }
            }
        }
        let last = self.reader.f64("scheduler.params.last_batch_iteration")?;
        if let Setting::Given(last) = last
            && last != -1.0
        {
            return Err(ds_error(
                "scheduler.params.last_batch_iteration",
                last,
                "strata starts schedules at the first step: remove it, and resume with --resume",
            ));
        }
        Ok(())
    }

    /// A `zero_optimization` section, whole: both placements and the NVMe
    /// directories.
    fn zero(&mut self) -> Result<()> {
        if !self.reader.has("zero_optimization") {
            return Ok(());
        }
        let stage = match self.reader.u64("zero_optimization.stage")? {
            Setting::Given(stage) if stage <= 3 => stage,
            // (The reader refuses "auto" here: KEYS gives it no meaning.)
            Setting::Absent | Setting::Auto => 0,
            Setting::Given(other) => {
                return Err(ds_error(
                    "zero_optimization.stage",
                    other,
                    "use 0, 1, 2 or 3",
                ));
            }
        };
        let params = self.offload("param")?;
        let optimizer = self.offload("optimizer")?;
        if stage < 3 && params.0 != Placement::Device {
            return Err(ds_error(
                "zero_optimization.offload_param.device",
                format!("{:?}", params.0).to_lowercase(),
                format!(
                    "DeepSpeed offloads parameters only at stage 3 (this config has stage {stage}): set zero_optimization.stage to 3, or offload_param.device to \"none\""
                ),
            ));
        }
        let ratio = self
            .reader
            .f64("zero_optimization.offload_optimizer.ratio")?
            .or(1.0, 1.0);
        if ratio != 1.0 {
            return Err(ds_error(
                "zero_optimization.offload_optimizer.ratio",
                ratio,
                "strata offloads all of the optimizer states or none of them: use 1, or offload_optimizer.device \"none\" to keep them all on the device",
            ));
        }
        for key in [
            "zero_optimization.offload_param.pin_memory",
            "zero_optimization.offload_optimizer.pin_memory",
        ] {
            self.reader.bool(key)?;
        }
        for key in ["pipeline_read", "pipeline_write"] {
            self.reader
                .bool(&format!("zero_optimization.offload_optimizer.{key}"))?;
        }
        // ZeRO++'s hpZ: its default of 1 keeps the states sharded over
        // every rank.
        self.config.parallel.shard_degree = match self
            .reader
            .u64("zero_optimization.zero_hpz_partition_size")?
        {
            Setting::Given(0) => {
                return Err(ds_error(
                    "zero_optimization.zero_hpz_partition_size",
                    0,
                    "give the ranks each state is sharded over (1: every rank)",
                ));
            }
            Setting::Given(1) | Setting::Absent | Setting::Auto => 0,
            Setting::Given(k) => usize::try_from(k).unwrap_or(usize::MAX),
        };
        let placement = &mut self.config.placement;
        placement.params = params.0;
        placement.optimizer = optimizer.0;
        let dirs: Vec<PathBuf> =
            [params.1, optimizer.1]
                .into_iter()
                .flatten()
                .fold(Vec::new(), |mut dirs, dir| {
                    if !dirs.contains(&dir) {
                        dirs.push(dir);
                    }
                    dirs
                });
        if !dirs.is_empty() {
            let nvme = self.config.nvme.get_or_insert_with(StorageConfig::default);
            nvme.dirs = dirs;
            // A path DeepSpeed's config names must exist (DeepSpeed would
            // create it: a typo or an unmounted drive would then swap to
            // whatever disk holds its parent).
            nvme.create_dirs = false;
        }
        Ok(())
    }

    /// `offload_param` or `offload_optimizer`: the placement and, on
    /// NVMe, the directory.
    fn offload(&mut self, what: &str) -> Result<(Placement, Option<PathBuf>)> {
        let device_key = format!("zero_optimization.offload_{what}.device");
        let path_key = format!("zero_optimization.offload_{what}.nvme_path");
        let placement = match self.reader.string(&device_key)? {
            Setting::Absent => Placement::Device,
            Setting::Given(device) => match device.as_str() {
                "none" => Placement::Device,
                "cpu" => Placement::Cpu,
                "nvme" => Placement::Nvme,
                _ => {
                    return Err(ds_error(
                        &device_key,
                        format!("{device:?}"),
                        "use \"none\", \"cpu\" or \"nvme\"",
                    ));
                }
            },
            Setting::Auto => {
                return Err(ds_error(
                    &device_key,
                    "\"auto\"",
                    "use \"none\", \"cpu\" or \"nvme\"",
                ));
            }
        };
        let path = match self.reader.string(&path_key)? {
            Setting::Given(path) if placement == Placement::Nvme => Some(PathBuf::from(path)),
            Setting::Given(_) => None,
            Setting::Absent if placement == Placement::Nvme => {
                return Err(ds_error(
                    &path_key,
                    "(absent)",
                    format!("offload_{what}.device is \"nvme\": name the directory to swap to"),
                ));
            }
            Setting::Absent | Setting::Auto => None,
        };
        Ok((placement, path))
    }

    /// An `aio` section, whole: the NVMe tier's requests.
    fn aio(&mut self) -> Result<()> {
        if !self.reader.has("aio") {
            return Ok(());
        }
        let r = &mut self.reader;
        let block_size = r.u64("aio.block_size")?.or(1 << 20, 1 << 20);
        let queue_depth = r.u64("aio.queue_depth")?.or(8, 8);
        let parallelism = r.u64("aio.intra_op_parallelism")?;
        let threads = r.u64("aio.thread_count")?;
        let rings = match (parallelism, threads) {
            (Setting::Given(a), Setting::Given(b)) if a != b => {
                return Err(ds_error(
                    "aio.thread_count",
                    b,
                    format!(
                        "it is the old name of aio.intra_op_parallelism, which says {a}: keep one"
                    ),
                ));
            }
            (Setting::Given(rings), _) | (_, Setting::Given(rings)) => rings,
            _ => 1,
        };
        r.bool("aio.single_submit")?;
        r.bool("aio.overlap_events")?;
        if r.bool("aio.use_gds")? == Setting::Given(true) {
            return Err(ds_error(
                "aio.use_gds",
                true,
                "GPUDirect Storage is not in strata today (NVMe moves stage through pinned host memory): set it to false",
            ));
        }
        if block_size == 0 || !block_size.is_multiple_of(4096) {
            return Err(ds_error(
                "aio.block_size",
                block_size,
                "use a multiple of 4096 bytes (O_DIRECT)",
            ));
        }
        let Some(nvme) = self.config.nvme.as_mut() else {
            self.notes
                .push("aio: nothing is placed on NVMe, so its settings are unused".into());
            return Ok(());
        };
        nvme.block_size = ByteSize(block_size);
        if !nvme.stripe_size.0.is_multiple_of(block_size) {
            nvme.stripe_size = ByteSize(block_size);
        }
        nvme.queue_depth = usize::try_from(queue_depth)
            .map_err(|_| ds_error("aio.queue_depth", queue_depth, "use a smaller queue"))?;
        nvme.rings = usize::try_from(rings)
            .map_err(|_| ds_error("aio.intra_op_parallelism", rings, "use fewer threads"))?;
        nvme.validate().map_err(|err| {
            ds_error(
                "aio",
                format!("block_size {block_size}, queue_depth {queue_depth}, intra_op_parallelism {rings}"),
                err.to_string(),
            )
        })?;
        Ok(())
    }
}
