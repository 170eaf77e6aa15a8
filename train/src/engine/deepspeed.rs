//! `strata train --deepspeed ds_config.json`: a DeepSpeed config, as a
//! ZeRO-Offload or ZeRO-Infinity user writes it, mapped onto a
//! [`TrainConfig`] by [`from_deepspeed_json`].
//!
//! [`KEYS`] is the one description of the mapping: the mapper looks up
//! each key it reads there (a key's `"auto"` is accepted only where the
//! table gives it a meaning), the keys it marks ignored are what the
//! warning lists, and `docs/deepspeed-config.md` is [`table_markdown`]'s
//! output (a test keeps the two equal).
//!
//! Precedence: the base config (`--config`, or strata's defaults) first;
//! then every DeepSpeed key present overrides the fields it maps to (a
//! section present is taken whole: keys it leaves out take DeepSpeed's
//! defaults, not the base's); then the command line's flags.

use std::collections::BTreeSet;
use std::path::PathBuf;

use serde_json::{Map, Value};
use strata_storage::{ByteSize, StorageConfig};

use super::config::{Placement, Schedule, TrainConfig, WarmupType};
use crate::error::{Result, TrainError};

/// What [`from_deepspeed_json`] made of a DeepSpeed config.
#[derive(Clone, Debug, PartialEq)]
pub struct DeepSpeedMapping {
    /// The strata config: the base with the DeepSpeed keys applied,
    /// validated.
    pub config: TrainConfig,
    /// Keys present that have no strata meaning, dotted, sorted: the
    /// caller warns once, listing them.
    pub ignored: Vec<String>,
    /// Where strata's run differs from DeepSpeed's by design (fp16 runs in
    /// bf16, for one), one sentence each.
    pub notes: Vec<String>,
}

/// How strata treats a DeepSpeed key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Treatment {
    /// Sets the strata fields named; values strata cannot honor are an
    /// error naming the key.
    Mapped,
    /// Accepted with no field to set: strata always behaves this way.
    Inherent,
    /// No strata meaning: listed in the warning, otherwise unused.
    Ignored,
}

/// One row of the mapping: a DeepSpeed key, what it becomes, and what
/// `"auto"` (Hugging Face's placeholder) means for it.
#[derive(Clone, Copy, Debug)]
pub struct KeyRule {
    /// The dotted DeepSpeed key; a final `.*` stands for a whole section.
    pub key: &'static str,
    /// The strata TOML keys it sets (`-` for none).
    pub strata: &'static str,
    /// How the value maps, its DeepSpeed default within a present section,
    /// and the values that are an error.
    pub how: &'static str,
    /// What `"auto"` means; empty: `"auto"` is an error.
    pub auto: &'static str,
    /// Mapped, inherent or ignored.
    pub treatment: Treatment,
}

const fn row(
    key: &'static str,
    strata: &'static str,
    how: &'static str,
    auto: &'static str,
    treatment: Treatment,
) -> KeyRule {
    KeyRule {
        key,
        strata,
        how,
        auto,
        treatment,
    }
}

const fn ignored(key: &'static str, how: &'static str) -> KeyRule {
    row(key, "-", how, "", Treatment::Ignored)
}

use Treatment::{Inherent, Mapped};

/// Base value for "auto".
const AUTO_BASE: &str = "the --config value (strata's default without one)";

/// The mapping, in the order the mapper applies it.
pub static KEYS: &[KeyRule] = &[
    row(
        "train_batch_size",
        "train.micro_batch, train.grad_accumulation",
        "Checked: must equal micro-batch x accumulation x train.ranks (DeepSpeed's world size). Given with only one of the other two, derives it as DeepSpeed does (integer division); given alone, micro-batch = it / ranks and accumulation = 1.",
        "micro-batch x accumulation x ranks (treated as absent)",
        Mapped,
    ),
    row(
        "train_micro_batch_size_per_gpu",
        "train.micro_batch",
        "Sequences per rank per micro-batch.",
        AUTO_BASE,
        Mapped,
    ),
    row(
        "gradient_accumulation_steps",
        "train.grad_accumulation",
        "Micro-batches per step (1 to 1024).",
        AUTO_BASE,
        Mapped,
    ),
    row(
        "gradient_clipping",
        "train.clip_norm",
        "Global L2 norm to clip to; 0 turns clipping off (as in DeepSpeed). Absent: the base value (strata's default clips at 1.0; DeepSpeed's does not clip).",
        AUTO_BASE,
        Mapped,
    ),
    row(
        "bf16.enabled",
        "train.loss_scale = 1, train.loss_scale_dynamic = false",
        "true: strata's bf16 compute with DeepSpeed's bf16 numerics, no loss scaling (a static scale of 1; overflowed steps are skipped). Old name `bfloat16.enabled` also read. Both bf16 and fp16 true is an error, as in DeepSpeed; false with fp16 not enabled (fp32 training) is an error: strata computes in bf16.",
        "true, unless fp16.enabled is true",
        Mapped,
    ),
    row(
        "bfloat16.enabled",
        "(as bf16.enabled)",
        "DeepSpeed's old name for bf16.enabled (read when bf16 is absent).",
        "as bf16.enabled",
        Mapped,
    ),
    row(
        "fp16.enabled",
        "train.loss_scale*",
        "true: dynamic (or static) loss scaling as the fp16.* keys below say; strata's half-precision type is bf16, so the run computes in bf16 (a note says so). false or absent: the fp16.* keys are unused.",
        "false (strata computes in bf16)",
        Mapped,
    ),
    row(
        "fp16.loss_scale",
        "train.loss_scale, train.loss_scale_dynamic",
        "0 (default): dynamic scaling; above 0: a static scale of this value (overflowed steps are still skipped).",
        "0 (dynamic)",
        Mapped,
    ),
    row(
        "fp16.initial_scale_power",
        "train.loss_scale",
        "Dynamic scaling starts at 2^power (default 16; 0 to 127).",
        "16",
        Mapped,
    ),
    row(
        "fp16.loss_scale_window",
        "train.loss_scale_growth_interval",
        "The scale doubles after this many clean steps (default 1000). DeepSpeed's first doubling, at the start and after each overflow, comes one clean step later than strata's.",
        "1000",
        Mapped,
    ),
    row(
        "fp16.hysteresis",
        "train.loss_scale_hysteresis",
        "Overflows before the scale halves (default 2). After halving, strata waits for `hysteresis` overflows again; DeepSpeed halves at every further overflow until the scale next grows.",
        "2",
        Mapped,
    ),
    row(
        "fp16.min_loss_scale",
        "train.loss_scale_min",
        "The scale's floor (default 1; at most the initial scale).",
        "1",
        Mapped,
    ),
    row(
        "fp16.consecutive_hysteresis",
        "-",
        "false (default) only: strata's scaler does not refill the hysteresis on every clean step; true is an error.",
        "",
        Mapped,
    ),
    row(
        "optimizer.type",
        "-",
        "`Adam` (which DeepSpeed runs as AdamW unless `adam_w_mode` is false) or `AdamW`, in any case: strata's CPU AdamW. Any other type is an error. A present optimizer section sets all of lr, betas, eps and weight_decay, with DeepSpeed's CPU Adam defaults for those it omits (1e-3, [0.9, 0.999], 1e-8, 0).",
        "",
        Mapped,
    ),
    row(
        "optimizer.params.lr",
        "train.lr",
        "The optimizer's learning rate (the peak; a scheduler's warmup_max_lr overrides it). Without a scheduler section the base's schedule stays; strata's own cosine keeps train.lr_min in the same ratio to train.lr.",
        AUTO_BASE,
        Mapped,
    ),
    row(
        "optimizer.params.betas",
        "train.beta1, train.beta2",
        "[beta1, beta2].",
        AUTO_BASE,
        Mapped,
    ),
    row(
        "optimizer.params.eps",
        "train.eps",
        "Adam's epsilon.",
        AUTO_BASE,
        Mapped,
    ),
    row(
        "optimizer.params.weight_decay",
        "train.weight_decay",
        "Decoupled weight decay. strata decays weight matrices and embeddings only, never biases or norm gains.",
        AUTO_BASE,
        Mapped,
    ),
    row(
        "optimizer.params.adam_w_mode",
        "-",
        "true (default): AdamW. false (L2-regularized Adam) is an error unless weight_decay is 0, where the two agree.",
        "",
        Mapped,
    ),
    row(
        "optimizer.params.bias_correction",
        "-",
        "true (default) only; false is an error.",
        "",
        Mapped,
    ),
    row(
        "optimizer.params.amsgrad",
        "-",
        "false (default) only; true is an error.",
        "",
        Mapped,
    ),
    ignored(
        "optimizer.params.torch_adam",
        "Which implementation DeepSpeed calls; strata has one (same math).",
    ),
    ignored(
        "optimizer.params.fp32_optimizer_states",
        "strata's state dtype is optim.state_dtype.",
    ),
    row(
        "scheduler.type",
        "train.schedule.kind",
        "`WarmupLR` -> `warmup_lr`, `WarmupDecayLR` -> `warmup_decay_lr`, `WarmupCosineLR` -> `warmup_cosine_lr`, computing DeepSpeed's learning rate at every step (step s runs at the rate DeepSpeed's scheduler holds after s - 1 `step()` calls: its first step runs at warmup_min_lr, or at 0 for WarmupCosineLR). Other types (LRRangeTest, OneCycle, torch schedulers) are an error; so are unknown params, as DeepSpeed's constructors refuse them.",
        "",
        Mapped,
    ),
    row(
        "scheduler.params.warmup_min_lr",
        "train.schedule.warmup_min_lr",
        "WarmupLR, WarmupDecayLR: the rate warmup starts from (default 0).",
        "0 (Hugging Face's value)",
        Mapped,
    ),
    row(
        "scheduler.params.warmup_max_lr",
        "train.lr",
        "WarmupLR, WarmupDecayLR: the rate warmup ends at. Default: WarmupLR the optimizer lr (train.lr), WarmupDecayLR 0.001.",
        "train.lr (the optimizer's lr)",
        Mapped,
    ),
    row(
        "scheduler.params.warmup_num_steps",
        "train.schedule.warmup_num_steps",
        "Warmup steps (default 1000; DeepSpeed uses at least 2).",
        "train.warmup_steps of the base",
        Mapped,
    ),
    row(
        "scheduler.params.warmup_type",
        "train.schedule.warmup_type",
        "`log` (default) or `linear`; other values are an error (DeepSpeed would fall back to log).",
        "",
        Mapped,
    ),
    row(
        "scheduler.params.total_num_steps",
        "train.schedule.total_num_steps",
        "WarmupDecayLR, WarmupCosineLR: where the decay ends (required, as in DeepSpeed).",
        "unset: follows train.steps (and --steps)",
        Mapped,
    ),
    row(
        "scheduler.params.warmup_min_ratio",
        "train.schedule.warmup_min_ratio",
        "WarmupCosineLR: the ratio of train.lr warmup starts from (default 0).",
        "0",
        Mapped,
    ),
    row(
        "scheduler.params.cos_min_ratio",
        "train.schedule.cos_min_ratio",
        "WarmupCosineLR: the ratio of train.lr the cosine ends at (default 0.0001).",
        "0.0001",
        Mapped,
    ),
    row(
        "scheduler.params.last_batch_iteration",
        "-",
        "-1 (default) only; resume with `--resume` instead.",
        "",
        Mapped,
    ),
    row(
        "zero_optimization.stage",
        "placement.params",
        "0 to 3 (default 0). strata always shards parameters, gradients and optimizer states over ranks (ZeRO-3; the same arithmetic as stages 0-2). Stages 0-2 keep the parameters on the device, like DeepSpeed; stage 3 places them as offload_param says. A present zero_optimization section sets both placements.",
        "",
        Mapped,
    ),
    row(
        "zero_optimization.offload_param.device",
        "placement.params",
        "`none` (default) -> device, `cpu` -> cpu, `nvme` -> nvme. Not `none` below stage 3 is an error.",
        "",
        Mapped,
    ),
    row(
        "zero_optimization.offload_param.nvme_path",
        "nvme.dirs",
        "With device nvme (then required): a swap directory, which must exist (DeepSpeed creates a missing one; strata refuses it, so that a typo or an unmounted drive does not swap to the disk holding its parent). The nvme_paths in use become nvme.dirs; strata stripes every tensor over them.",
        "",
        Mapped,
    ),
    row(
        "zero_optimization.offload_param.pin_memory",
        "-",
        "Either value: strata's host pool is always pinned when the memlock limit allows (host.require_locked makes failing to pin an error).",
        "",
        Inherent,
    ),
    ignored(
        "zero_optimization.offload_param.buffer_count",
        "strata stages NVMe reads in its pinned pool, sized by host.budget.",
    ),
    ignored(
        "zero_optimization.offload_param.buffer_size",
        "strata stages NVMe reads in its pinned pool, sized by host.budget.",
    ),
    ignored(
        "zero_optimization.offload_param.max_in_cpu",
        "strata's plan keeps in host memory what host.budget holds.",
    ),
    row(
        "zero_optimization.offload_optimizer.device",
        "placement.optimizer",
        "`none` (default) -> device, `cpu` -> cpu, `nvme` -> nvme. The optimizer runs on the CPU unless device.",
        "",
        Mapped,
    ),
    row(
        "zero_optimization.offload_optimizer.nvme_path",
        "nvme.dirs",
        "As offload_param.nvme_path.",
        "",
        Mapped,
    ),
    row(
        "zero_optimization.offload_optimizer.pin_memory",
        "-",
        "As offload_param.pin_memory.",
        "",
        Inherent,
    ),
    ignored(
        "zero_optimization.offload_optimizer.buffer_count",
        "strata stages NVMe reads in its pinned pool, sized by host.budget.",
    ),
    row(
        "zero_optimization.offload_optimizer.pipeline_read",
        "-",
        "Either value: strata always overlaps the optimizer's reads with compute (the plan prefetches).",
        "",
        Inherent,
    ),
    row(
        "zero_optimization.offload_optimizer.pipeline_write",
        "-",
        "Either value: strata always overlaps the optimizer's writes with compute.",
        "",
        Inherent,
    ),
    row(
        "zero_optimization.offload_optimizer.ratio",
        "-",
        "1 (default) only: strata offloads all of the optimizer or none of it; below 1 is an error.",
        "",
        Mapped,
    ),
    ignored(
        "zero_optimization.offload_optimizer.fast_init",
        "strata initializes its swap store at start either way.",
    ),
    ignored(
        "zero_optimization.stage3_prefetch_bucket_size",
        "strata's plan prefetches placement.prefetch_ops ops ahead within the tier budgets, not a number of elements.",
    ),
    ignored(
        "zero_optimization.stage3_max_live_parameters",
        "strata's plan bounds the parameters on the device by device.budget, not a number of elements.",
    ),
    ignored(
        "zero_optimization.stage3_param_persistence_threshold",
        "strata's plan keeps resident whatever fits device.budget, whatever a tensor's size.",
    ),
    ignored(
        "zero_optimization.overlap_comm",
        "strata's plan overlaps collectives.",
    ),
    ignored(
        "zero_optimization.contiguous_gradients",
        "strata's gradients are contiguous shards.",
    ),
    ignored(
        "zero_optimization.reduce_bucket_size",
        "strata reduce-scatters a parameter group at a time.",
    ),
    ignored(
        "zero_optimization.allgather_bucket_size",
        "strata all-gathers a parameter group at a time.",
    ),
    ignored(
        "zero_optimization.sub_group_size",
        "strata's optimizer runs a parameter group at a time.",
    ),
    ignored(
        "zero_optimization.stage3_gather_16bit_weights_on_model_save",
        "strata's checkpoints hold the full states.",
    ),
    row(
        "aio.block_size",
        "nvme.block_size (and nvme.stripe_size when not a multiple)",
        "Bytes per request (default 1048576; a multiple of 4096).",
        "",
        Mapped,
    ),
    row(
        "aio.queue_depth",
        "nvme.queue_depth",
        "Requests in flight per ring (default 8).",
        "",
        Mapped,
    ),
    row(
        "aio.intra_op_parallelism",
        "nvme.rings",
        "Threads that split each transfer: strata's rings, each on its thread (default 1).",
        "",
        Mapped,
    ),
    row(
        "aio.thread_count",
        "nvme.rings",
        "The old name of intra_op_parallelism; both given and different is an error.",
        "",
        Mapped,
    ),
    row(
        "aio.single_submit",
        "-",
        "Either value: strata submits requests in batches.",
        "",
        Inherent,
    ),
    row(
        "aio.overlap_events",
        "-",
        "Either value: strata reaps completions as it submits.",
        "",
        Inherent,
    ),
    row(
        "aio.use_gds",
        "-",
        "false (default) only: GPUDirect Storage is not in strata today; true is an error.",
        "",
        Mapped,
    ),
    ignored("steps_per_print", "strata prints every step."),
    ignored("wall_clock_breakdown", "use `strata train --trace`."),
    ignored(
        "zero_allow_untested_optimizer",
        "strata's optimizer is AdamW.",
    ),
    ignored(
        "zero_force_ds_cpu_optimizer",
        "strata's optimizer is AdamW.",
    ),
    ignored(
        "prescale_gradients",
        "strata averages gradients in its reduce-scatter.",
    ),
    ignored(
        "gradient_predivide_factor",
        "strata averages gradients in its reduce-scatter.",
    ),
    ignored(
        "communication_data_type",
        "strata's collectives move bf16 parameters and fp32 gradients.",
    ),
    ignored(
        "fp16.auto_cast",
        "strata's model is written in its compute dtype.",
    ),
    ignored(
        "bf16.immediate_grad_update",
        "strata writes each gradient down as soon as it is produced.",
    ),
    ignored(
        "bf16.check_grad_overflow",
        "strata always skips steps with non-finite gradients.",
    ),
    ignored(
        "activation_checkpointing.*",
        "see train.checkpoint_activations.",
    ),
    ignored("tensorboard.*", "strata prints and writes --json."),
    ignored("wandb.*", "strata prints and writes --json."),
    ignored("csv_monitor.*", "strata prints and writes --json."),
    ignored("flops_profiler.*", "use `strata train --trace`."),
    ignored("comms_logger.*", "use `strata train --trace`."),
];

/// The DeepSpeed keys strata reads but that are not in [`KEYS`] fall here:
/// ignored, with a warning.
const UNKNOWN_IS_IGNORED: &str = "Any other key: no strata meaning; listed in the warning.";

/// Maps a DeepSpeed config (`text`, JSON) onto `base` (strata's defaults
/// when `None`): see the module documentation for the precedence, and
/// [`KEYS`] for each key. The result is validated.
pub fn from_deepspeed_json(text: &str, base: Option<&TrainConfig>) -> Result<DeepSpeedMapping> {
    let root: Value = serde_json::from_str(text).map_err(|err| {
        ds_error(
            "(file)",
            format!("line {} column {}", err.line(), err.column()),
            format!("fix the JSON: {err}"),
        )
    })?;
    let Value::Object(root) = root else {
        return Err(ds_error(
            "(file)",
            "not an object",
            "a DeepSpeed config is a JSON object",
        ));
    };
    let mut mapper = Mapper {
        reader: Reader {
            root: &root,
            used: BTreeSet::new(),
        },
        config: base.cloned().unwrap_or_default(),
        notes: Vec::new(),
    };
    mapper.batch()?;
    mapper.clipping()?;
    mapper.precision()?;
    mapper.optimizer()?;
    mapper.scheduler()?;
    mapper.zero()?;
    mapper.aio()?;
    let mut leaves = Vec::new();
    collect_leaves(&root, "", &mut leaves);
    let ignored = leaves
        .into_iter()
        .filter(|key| !mapper.reader.used.contains(key))
        .collect();
    mapper.config.validate()?;
    Ok(DeepSpeedMapping {
        config: mapper.config,
        ignored,
        notes: mapper.notes,
    })
}

/// The rule for `key`: its row, or the section row (`prefix.*`) it
/// falls under.
pub fn rule(key: &str) -> Option<&'static KeyRule> {
    KEYS.iter().find(|rule| match rule.key.strip_suffix(".*") {
        Some(section) => key == section || key.starts_with(&format!("{section}.")),
        None => rule.key == key,
    })
}

/// `docs/deepspeed-config.md`: the precedence, the meaning of `"auto"`
/// and [`KEYS`] as a table.
pub fn table_markdown() -> String {
    let mut text = String::from(
        "# DeepSpeed configs in strata\n\n\
         <!-- Generated from train/src/engine/deepspeed.rs (KEYS); do not edit.\n     \
         Regenerate: STRATA_BLESS=1 cargo test -p strata-train --test deepspeed -->\n\n\
         `strata train --deepspeed ds_config.json` reads a DeepSpeed config and runs it as \
         the strata config it maps to; `--print-config` prints that config as TOML instead \
         of training.\n\n\
         Precedence: the `--config` TOML (or strata's defaults) first; then each DeepSpeed \
         key present overrides the strata fields it maps to; then the command line's flags \
         (`--steps`, `--checkpoint-dir`). A DeepSpeed section present (`optimizer`, \
         `scheduler`, an enabled `fp16`, `zero_optimization`, `aio`) is taken whole: the \
         keys it leaves out take DeepSpeed's defaults, not the `--config` values. \
         DeepSpeed's world size is `train.ranks`.\n\n\
         `\"auto\"` (Hugging Face's placeholder) means what the last column says; where it \
         is empty, `\"auto\"` is an error. Keys with no strata meaning are listed in one \
         warning; values strata cannot honor are an error naming the key.\n\n\
         | DeepSpeed key | strata key | how | `\"auto\"` |\n\
         |---|---|---|---|\n",
    );
    for rule in KEYS {
        let how = match rule.treatment {
            Treatment::Ignored => format!("Ignored (warning): {}", rule.how),
            Treatment::Inherent | Treatment::Mapped => rule.how.to_string(),
        };
        text.push_str(&format!(
            "| `{}` | {} | {} | {} |\n",
            rule.key,
            if rule.strata == "-" {
                "-".to_string()
            } else {
                format!("`{}`", rule.strata)
            },
            how.replace('|', "\\|"),
            if rule.auto.is_empty() {
                "error"
            } else {
                rule.auto
            },
        ));
    }
    text.push_str(&format!("\n{UNKNOWN_IS_IGNORED}\n"));
    text
}

/// A DeepSpeed config error naming `key`.
fn ds_error(key: &str, value: impl ToString, fix: impl Into<String>) -> TrainError {
    TrainError::DeepSpeed {
        key: key.to_string(),
        value: value.to_string(),
        fix: fix.into(),
    }
}

/// Every key with a scalar or array value, dotted (nulls are absent).
fn collect_leaves(map: &Map<String, Value>, prefix: &str, leaves: &mut Vec<String>) {
    for (key, value) in map {
        let path = if prefix.is_empty() {
            key.clone()
        } else {
            format!("{prefix}.{key}")
        };
        match value {
            Value::Object(inner) => collect_leaves(inner, &path, leaves),
            Value::Null => {}
            _ => leaves.push(path),
        }
    }
}

/// A DeepSpeed setting as read: absent (or null), `"auto"`, or a value.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Setting<T> {
    Absent,
    Auto,
    Given(T),
}

impl<T> Setting<T> {
    /// The value, `auto` for `"auto"`, `absent` when absent.
    fn or(self, auto: T, absent: T) -> T {
        match self {
            Setting::Absent => absent,
            Setting::Auto => auto,
            Setting::Given(value) => value,
        }
    }
}

/// Reads keys of the config, recording which were read.
struct Reader<'a> {
    root: &'a Map<String, Value>,
    used: BTreeSet<String>,
}

impl Reader<'_> {
    /// Whether a section (or key) is present, without reading it.
    fn has(&self, key: &str) -> bool {
        self.lookup(key).is_some()
    }

    fn lookup(&self, key: &str) -> Option<&Value> {
        let mut parts = key.split('.');
        let mut value = self.root.get(parts.next()?)?;
        for part in parts {
            value = value.as_object()?.get(part)?;
        }
        (!value.is_null()).then_some(value)
    }

    /// The raw value of `key`, marked read; `"auto"` is checked against
    /// the table.
    fn raw(&mut self, key: &str) -> Result<Setting<Value>> {
        let rule = rule(key);
        debug_assert!(
            rule.is_some_and(|rule| rule.treatment != Treatment::Ignored),
            "the mapper reads {key}, which KEYS does not map"
        );
        let Some(value) = self.lookup(key).cloned() else {
            return Ok(Setting::Absent);
        };
        self.used.insert(key.to_string());
        if value.as_str() == Some("auto") {
            if rule.is_none_or(|rule| rule.auto.is_empty()) {
                return Err(ds_error(
                    key,
                    "\"auto\"",
                    "\"auto\" has no meaning for this key in strata: give a value (see docs/deepspeed-config.md)",
                ));
            }
            return Ok(Setting::Auto);
        }
        Ok(Setting::Given(value))
    }

    /// Marks every key under `section` read (a disabled section's).
    fn consume(&mut self, section: &str) {
        if let Some(Value::Object(map)) = self.lookup(section) {
            let mut leaves = Vec::new();
            collect_leaves(map, section, &mut leaves);
            self.used.extend(leaves);
        }
    }

    fn f64(&mut self, key: &str) -> Result<Setting<f64>> {
        Ok(match self.raw(key)? {
            Setting::Given(value) => match value.as_f64() {
                Some(number) if number.is_finite() => Setting::Given(number),
                _ => return Err(ds_error(key, value, "give a number")),
            },
            Setting::Auto => Setting::Auto,
            Setting::Absent => Setting::Absent,
        })
    }

    /// A whole number, also written as a float (`5e8`).
    fn u64(&mut self, key: &str) -> Result<Setting<u64>> {
        Ok(match self.raw(key)? {
            Setting::Given(value) => match json_u64(&value) {
                Some(number) => Setting::Given(number),
                None => return Err(ds_error(key, value, "give a whole number >= 0")),
            },
            Setting::Auto => Setting::Auto,
            Setting::Absent => Setting::Absent,
        })
    }

    fn bool(&mut self, key: &str) -> Result<Setting<bool>> {
        Ok(match self.raw(key)? {
            Setting::Given(Value::Bool(flag)) => Setting::Given(flag),
            Setting::Given(value) => return Err(ds_error(key, value, "give true or false")),
            Setting::Auto => Setting::Auto,
            Setting::Absent => Setting::Absent,
        })
    }

    fn string(&mut self, key: &str) -> Result<Setting<String>> {
        Ok(match self.raw(key)? {
            Setting::Given(Value::String(text)) => Setting::Given(text),
            Setting::Given(value) => return Err(ds_error(key, value, "give a string")),
            Setting::Auto => Setting::Auto,
            Setting::Absent => Setting::Absent,
        })
    }
}

fn json_u64(value: &Value) -> Option<u64> {
    if let Some(number) = value.as_u64() {
        return Some(number);
    }
    let float = value.as_f64()?;
    // Integral floats below 2^53 convert exactly.
    (float >= 0.0 && float.fract() == 0.0 && float < 9.007_199_254_740_992e15)
        .then_some(float as u64)
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
        let warmup_num_steps = r
            .u64("scheduler.params.warmup_num_steps")?
            .or(base.warmup_steps, super::config::WARMUP_NUM_STEPS_DEFAULT);
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
                    super::config::COS_MIN_RATIO_DEFAULT,
                    super::config::COS_MIN_RATIO_DEFAULT,
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
