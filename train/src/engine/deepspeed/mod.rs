//! `strata train --deepspeed ds_config.json`: a DeepSpeed config, as a
//! ZeRO-Offload or ZeRO-Infinity user writes it, mapped onto a
//! [`TrainConfig`] by [`from_deepspeed_json`].
//!
//! [`KEYS`] (in `keys.rs`) is the one description of the mapping: the mapper looks up
//! each key it reads there (a key's `"auto"` is accepted only where the
//! table gives it a meaning), the keys it marks ignored are what the
//! warning lists, and `docs/deepspeed-config.md` is [`table_markdown`]'s
//! output (a test keeps the two equal).
//!
//! Precedence: the base config (`--config`, or strata's defaults) first;
//! then every DeepSpeed key present overrides the fields it maps to (a
//! section present is taken whole: keys it leaves out take DeepSpeed's
//! defaults, not the base's); then the command line's flags.

//!
//! The parts: `keys.rs` (the table), `reader.rs` (reads keys, recording
//! which were read), `mapper.rs` (applies each section to the config).

mod keys;
mod mapper;
mod reader;

use serde_json::{Map, Value};

use super::config::TrainConfig;
use crate::error::{Result, TrainError};

pub use keys::KEYS;

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

pub(super) const fn row(
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

pub(super) const fn ignored(key: &'static str, how: &'static str) -> KeyRule {
    row(key, "-", how, "", Treatment::Ignored)
}

/// The DeepSpeed keys strata reads but that are not in [`KEYS`] fall here:
/// ignored, with a warning.
const UNKNOWN_IS_IGNORED: &str = "Any other key inside a section: no strata meaning; listed in the warning, one per line. A top-level key DeepSpeed itself does not read (a typo such as `zero_optimisation`, which would drop its section whole) is an error naming the nearest key DeepSpeed reads.";

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
    check_top_level(&root)?;
    let applied = mapper::apply(&root, base.cloned().unwrap_or_default())?;
    let mut leaves = Vec::new();
    collect_leaves(&root, "", &mut leaves);
    let ignored = leaves
        .into_iter()
        .filter(|key| !applied.used.contains(key))
        .collect();
    applied.config.validate()?;
    Ok(DeepSpeedMapping {
        config: applied.config,
        ignored,
        notes: applied.notes,
    })
}

/// Every top-level key DeepSpeed reads (its `runtime/constants.py` and the
/// sections other modules read): one outside it is a typo, and a typo at
/// the top drops a whole section, so it is an error, not a warning.
const DEEPSPEED_TOP_LEVEL: &[&str] = &[
    "activation_checkpointing",
    "aio",
    "amp",
    "autotuning",
    "bf16",
    "bfloat16",
    "checkpoint",
    "comet",
    "communication_data_type",
    "comms_logger",
    "compile",
    "compression_training",
    "csv_monitor",
    "curriculum_learning",
    "data_efficiency",
    "data_types",
    "dataloader_drop_last",
    "disable_allgather",
    "dump_state",
    "eigenvalue",
    "elasticity",
    "flops_profiler",
    "fp16",
    "gradient_accumulation_steps",
    "gradient_clipping",
    "gradient_predivide_factor",
    "graph_harvesting",
    "hybrid_engine",
    "memory_breakdown",
    "nebula",
    "optimizer",
    "pipeline",
    "prescale_gradients",
    "progressive_layer_drop",
    "quantize_training",
    "scheduler",
    "seq_parallel_comm_data_type",
    "sequence_parallel_size",
    "sparse_attention",
    "sparse_gradients",
    "steps_per_print",
    "tensor_parallel",
    "tensorboard",
    "timers",
    "torch_autocast",
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "use_data_before_expert_parallelism",
    "vocabulary_size",
    "wall_clock_breakdown",
    "wandb",
    "weight_quantization",
    "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer",
    "zero_optimization",
];

/// Refuses a top-level key DeepSpeed does not read, with the nearest one
/// it does.
fn check_top_level(root: &Map<String, Value>) -> Result<()> {
    for (key, value) in root {
        if DEEPSPEED_TOP_LEVEL.contains(&key.as_str()) {
            continue;
        }
        let nearest = DEEPSPEED_TOP_LEVEL
            .iter()
            .map(|known| (strsim::damerau_levenshtein(key, known), *known))
            .min()
            .filter(|(distance, known)| *distance <= (known.len() / 3).max(2));
        let shown: String = value.to_string().chars().take(60).collect();
        return Err(ds_error(
            key,
            shown,
            match nearest {
                Some((_, known)) => format!(
                    "DeepSpeed has no top-level key {key:?} (its section would be dropped whole): did you mean {known:?}?"
                ),
                None => format!(
                    "DeepSpeed has no top-level key {key:?}: remove it, or fix its name (docs/deepspeed-config.md lists the keys strata reads)"
                ),
            },
        ));
    }
    Ok(())
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
         <!-- Generated from train/src/engine/deepspeed/keys.rs (KEYS); do not edit.\n     \
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
pub(super) fn ds_error(key: &str, value: impl ToString, fix: impl Into<String>) -> TrainError {
    TrainError::DeepSpeed {
        key: key.to_string(),
        value: value.to_string(),
        fix: fix.into(),
    }
}

/// Every key with a scalar or array value, dotted (nulls are absent).
pub(super) fn collect_leaves(map: &Map<String, Value>, prefix: &str, leaves: &mut Vec<String>) {
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
