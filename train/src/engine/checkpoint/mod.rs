//! Checkpoints: the weights (bf16, or the f32 masters with
//! `[checkpoint] weights_dtype = "f32"`) as `model.safetensors`, or shards
//! past `[checkpoint] max_shard_size` with their index (the
//! architecture's Hugging Face tensor names and layouts; written group by
//! group as each is gathered, [`crate::hf::ShardWriter`]), beside
//! `config.json` (its Hugging Face config, [`crate::model::Model::hf_config`])
//! and `generation_config.json` (and the tokenizer's files of the folder
//! the run started from), so that a step directory opens in transformers
//! as it is, each rank's
//! optimizer shard (master weights and moments) as
//! `optimizer-rank{r}.safetensors`, `strata.toml` (the run's config, so
//! that `strata train --resume DIR` alone continues the run), and
//! `meta.json` (step, loss-scaler
//! state, the run's shape, a checksum of every file). A checkpoint is
//! written into a temporary directory, every file and the directory
//! fsynced, then renamed to `step-NNNNNNNN`, and only then does the
//! `latest` pointer (itself replaced by rename) name it: a write killed at
//! any point leaves the previous checkpoint whole and `latest` naming it.
//!
//! `publish.rs` is the crash-safe directory protocol (temporary, fsync,
//! rename, `latest`, pruning) and its crash model's tests; `save.rs` is
//! the engine's side: what a rank writes and reads back.

mod publish;
mod save;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Result, TrainError};

use super::config::{ModelConfig, StateDtype};
use publish::{hash_hex, io_fix};

fn nearest() -> String {
    "nearest".into()
}

/// `meta.rounding` of bf16 states: random bits from two AES rounds keyed
/// by the rounding seed and the Adam step, on each parameter's global index.
pub const ROUNDING_STOCHASTIC: &str = "stochastic-aes";

/// `meta.rounding` of bf16 states from older strata, whose random bits
/// differ from [`ROUNDING_STOCHASTIC`]'s: "stochastic" (a multiplicative
/// hash whose keys may have restarted at every host chunk of a group),
/// "stochastic-per-element" (the same hash keyed per element). A resume
/// goes on from their states but cannot replay the bits the old run would
/// have drawn; it warns.
const ROUNDING_STOCHASTIC_OLDER: [&str; 2] = ["stochastic", "stochastic-per-element"];

/// The layout version this code writes and reads. (`config.json` came
/// later within format 1: checkpoints without it still resume.)
pub const FORMAT: u32 = 1;

/// The Hugging Face config beside the weights.
const HF_CONFIG: &str = "config.json";
/// transformers' generation defaults beside it.
const GENERATION_CONFIG: &str = "generation_config.json";
/// A tokenizer's files, copied from the folder a run started from.
const TOKENIZER_FILES: [&str; 7] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
];
/// meta.json's own checksum (xxh3-64 of its bytes, hex), beside it: every
/// other file's checksum is in meta.json.
pub const META_HASH: &str = "meta.json.xxh3";

/// `meta.json`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CheckpointMeta {
    /// [`FORMAT`].
    pub format: u32,
    /// Steps run.
    pub step: u64,
    /// Optimizer steps taken (skipped steps do not count).
    pub optimizer_steps: u64,
    /// Data-parallel ranks of the run (each wrote one optimizer shard).
    pub ranks: usize,
    /// The run's seed.
    pub seed: u64,
    /// The model.
    pub model: ModelConfig,
    /// Loss scale, clean steps, overflows left.
    pub loss_scaler: (f32, u32, u32),
    /// How the optimizer states were kept (`optim.state_dtype`; absent in
    /// checkpoints from before it existed: fp32).
    #[serde(default)]
    pub state_dtype: StateDtype,
    /// How bf16 states were rounded: "nearest" (no bf16 state) or
    /// [`ROUNDING_STOCHASTIC`] ("stochastic" or "stochastic-per-element" in
    /// older checkpoints, whose random bits came from another hash; a
    /// resume warns).
    #[serde(default = "nearest")]
    pub rounding: String,
    /// `optim.rounding_seed` when the run set it (absent: the rounding was
    /// keyed by `seed`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rounding_seed: Option<u64>,
    /// Where the run stood in its data (absent in checkpoints from before
    /// the epoch order, whose runs drew random windows by step, and in
    /// those an engine wrote without a data reader).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<crate::engine::DataPosition>,
    /// xxh3-64 of each file, by name.
    pub files: HashMap<String, String>,
}

/// A checkpoint found on disk.
#[derive(Clone, Debug)]
pub struct Checkpoint {
    /// Its directory.
    pub dir: PathBuf,
    /// Its `meta.json`.
    pub meta: CheckpointMeta,
}

pub(super) fn problem(path: &Path, problem: impl ToString, fix: impl Into<String>) -> TrainError {
    TrainError::Checkpoint {
        path: path.to_path_buf(),
        problem: problem.to_string(),
        fix: fix.into(),
    }
}

impl Checkpoint {
    /// The checkpoint at `path`: a `step-*` directory, or a checkpoint
    /// root whose `latest` names one.
    pub fn open(path: &Path) -> Result<Checkpoint> {
        let dir = if path.join("meta.json").exists() {
            path.to_path_buf()
        } else if path.join("latest").exists() {
            let name = std::fs::read_to_string(path.join("latest")).map_err(|err| {
                problem(
                    &path.join("latest"),
                    format!("cannot read it: {err}"),
                    io_fix(&err),
                )
            })?;
            path.join(name.trim())
        } else {
            return Err(problem(
                path,
                "no checkpoint there (neither meta.json nor latest)",
                "give a checkpoint directory (step-NNNNNNNN) or the train.checkpoint_dir of a run",
            ));
        };
        let meta_path = dir.join("meta.json");
        let text = std::fs::read(&meta_path)
            .map_err(|err| problem(&meta_path, format!("cannot read it: {err}"), io_fix(&err)))?;
        let hash_path = dir.join(META_HASH);
        match std::fs::read_to_string(&hash_path) {
            Ok(recorded) if recorded.trim() != hash_hex(&text) => {
                return Err(problem(
                    &meta_path,
                    format!(
                        "checksum {} does not match {}'s {}: meta.json is corrupt",
                        hash_hex(&text),
                        META_HASH,
                        recorded.trim()
                    ),
                    "resume from another checkpoint",
                ));
            }
            Ok(_) => {}
            // Checkpoints from before meta.json's checksum was recorded.
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => {}
            Err(err) => {
                return Err(problem(
                    &hash_path,
                    format!("cannot read it: {err}"),
                    io_fix(&err),
                ));
            }
        }
        let meta: CheckpointMeta = serde_json::from_slice(&text).map_err(|err| {
            problem(
                &meta_path,
                format!("it is not a strata checkpoint's meta.json: {err}"),
                "resume from another checkpoint",
            )
        })?;
        if meta.format != FORMAT {
            return Err(problem(
                &meta_path,
                format!("format {} (this strata reads {FORMAT})", meta.format),
                "resume with the strata version that wrote it",
            ));
        }
        Ok(Checkpoint { dir, meta })
    }

    /// Checks every file meta.json lists against its checksum (meta.json's
    /// own was checked by [`Checkpoint::open`]) and that no other file lies
    /// beside them. Returns the files and their sizes, in name order.
    pub fn verify(&self) -> Result<Vec<(String, u64)>> {
        let mut names: Vec<&String> = self.meta.files.keys().collect();
        names.sort();
        let mut checked = Vec::with_capacity(names.len());
        for name in names {
            let len = self.check_file(name)?;
            checked.push((name.clone(), len));
        }
        let entries = std::fs::read_dir(&self.dir)
            .map_err(|err| problem(&self.dir, format!("cannot list it: {err}"), io_fix(&err)))?;
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if name != "meta.json" && name != META_HASH && !self.meta.files.contains_key(&name) {
                return Err(problem(
                    &entry.path(),
                    "meta.json lists no such file: it was added after the checkpoint was written",
                    "remove it, or resume from another checkpoint",
                ));
            }
        }
        Ok(checked)
    }

    /// Whether meta.json's own checksum was recorded (checkpoints written
    /// before strata recorded it have none).
    pub fn meta_checksummed(&self) -> bool {
        self.dir.join(META_HASH).exists()
    }

    /// Checks file `name` against its recorded checksum, reading it a
    /// piece at a time; its length.
    pub fn check_file(&self, name: &str) -> Result<u64> {
        let path = self.dir.join(name);
        let expected = self.meta.files.get(name).ok_or_else(|| {
            problem(
                &path,
                "meta.json lists no such file",
                "the checkpoint is incomplete: resume from another",
            )
        })?;
        let (found, len) = publish::file_hash_len(&crate::engine::durable::RealFs, &path)?;
        if &found != expected {
            return Err(problem(
                &path,
                format!(
                    "checksum {found} does not match meta.json's {expected}: the file is corrupt"
                ),
                "resume from another checkpoint",
            ));
        }
        Ok(len)
    }

    /// Maps file `name` after checking it against its recorded checksum (a
    /// piece at a time): read through the map, its pages dropped once read
    /// ([`crate::hf::MappedFile::release`]), it is never whole in memory.
    pub(crate) fn map_checked(&self, name: &str) -> Result<crate::hf::MappedFile> {
        self.check_file(name)?;
        let path = self.dir.join(name);
        std::fs::File::open(&path)
            .and_then(|file| crate::hf::MappedFile::map(&file))
            .map_err(|err| problem(&path, format!("cannot map it: {err}"), io_fix(&err)))
    }

    /// Reads file `name`, checking it against its recorded checksum.
    pub fn read_file(&self, name: &str) -> Result<Vec<u8>> {
        let path = self.dir.join(name);
        let bytes = std::fs::read(&path)
            .map_err(|err| problem(&path, format!("cannot read it: {err}"), io_fix(&err)))?;
        let expected = self.meta.files.get(name).ok_or_else(|| {
            problem(
                &path,
                "meta.json lists no such file",
                "the checkpoint is incomplete: resume from another",
            )
        })?;
        let found = hash_hex(&bytes);
        if &found != expected {
            return Err(problem(
                &path,
                format!(
                    "checksum {found} does not match meta.json's {expected}: the file is corrupt"
                ),
                "resume from another checkpoint",
            ));
        }
        Ok(bytes)
    }

    /// The config of the run that wrote it ([`crate::RUN_CONFIG`]), or
    /// None for a checkpoint from before it was written.
    pub fn run_config(&self) -> Result<Option<crate::TrainConfig>> {
        let name = crate::engine::config::RUN_CONFIG;
        if !self.meta.files.contains_key(name) {
            return Ok(None);
        }
        let bytes = self.read_file(name)?;
        let path = self.dir.join(name);
        let text = String::from_utf8(bytes).map_err(|_| {
            problem(
                &path,
                "it is not UTF-8 text",
                "resume from another checkpoint",
            )
        })?;
        // Parsed, not validated: the run validates the config it comes to
        // (with the flags given now) once.
        let mut table: toml::Table = toml::from_str(&text).map_err(|err| {
            problem(
                &path,
                format!("it is not TOML: {}", err.message()),
                "resume from another checkpoint",
            )
        })?;
        // A run from before the epoch order drew random windows by step;
        // its config says nothing of an order.
        let data = table
            .entry("data")
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        if let Some(data) = data.as_table_mut() {
            data.entry("order").or_insert_with(|| "random".into());
        }
        table.try_into().map(Some).map_err(|err: toml::de::Error| {
            problem(
                &path,
                format!("it is not a config this strata reads: {}", err.message()),
                "resume with the strata that wrote it, or pass --config with the run's config",
            )
        })
    }
}

/// The tensor `name` of a safetensors file, `len` elements, f32 or bf16
/// (widened exactly).
pub(crate) fn read_tensor(
    path: &Path,
    file: &safetensors::SafeTensors<'_>,
    name: &str,
    len: usize,
) -> Result<Vec<f32>> {
    let view = file.tensor(name).map_err(|err| {
        problem(
            path,
            format!("tensor {name}: {err}"),
            "the checkpoint does not match this run: resume from another",
        )
    })?;
    let elements: usize = view.shape().iter().product();
    let dtype = view.dtype();
    let width = match dtype {
        safetensors::Dtype::F32 => 4,
        safetensors::Dtype::BF16 => 2,
        _ => 0,
    };
    if width == 0 || elements != len {
        return Err(problem(
            path,
            format!("tensor {name} is {dtype:?} x {elements}, expected F32 or BF16 x {len}"),
            "the checkpoint does not match this run: resume from another",
        ));
    }
    let mut values = vec![0f32; len];
    crate::hf::widen(dtype, view.data(), 0, len, &mut values);
    Ok(values)
}
