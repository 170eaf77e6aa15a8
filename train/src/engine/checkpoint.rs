//! Checkpoints: the fp32 weights as `model.safetensors` (the
//! architecture's Hugging Face tensor names and layouts) beside
//! `config.json` (its Hugging Face config, [`crate::model::Model::hf_config`]),
//! so that a step directory opens in transformers as it is, each rank's
//! optimizer shard (master weights and moments) as
//! `optimizer-rank{r}.safetensors`, and `meta.json` (step, loss-scaler
//! state, the run's shape, a checksum of every file). A checkpoint is
//! written into a temporary directory, every file and the directory
//! fsynced, then renamed to `step-NNNNNNNN`, and only then does the
//! `latest` pointer (itself replaced by rename) name it: a write killed at
//! any point leaves the previous checkpoint whole and `latest` naming it.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use strata_device::{View, ViewMut};
use strata_runtime::Tier;

use crate::error::{Result, TrainError};
use crate::model::export_group;

use super::Engine;
use super::config::ModelConfig;
use super::config::StateDtype;
use super::durable::{Fs, RealFs, create_dir_all_durably};
use super::moves::read_f32;
use super::tensors::{LoadBuffers, decode_states, state_index, state_words};

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

fn problem(path: &Path, problem: impl ToString, fix: impl Into<String>) -> TrainError {
    TrainError::Checkpoint {
        path: path.to_path_buf(),
        problem: problem.to_string(),
        fix: fix.into(),
    }
}

fn io_fix(err: &std::io::Error) -> String {
    match err.raw_os_error() {
        Some(libc::ENOSPC) | Some(libc::EDQUOT) => {
            "free space on that disk or set train.checkpoint_dir elsewhere; the previous checkpoint is intact".into()
        }
        Some(libc::EACCES) | Some(libc::EPERM) | Some(libc::EROFS) => {
            "make the directory writable or set train.checkpoint_dir elsewhere".into()
        }
        _ => "check the path and the disk".into(),
    }
}

/// Writes `bytes` to `path` and fsyncs it.
pub(crate) fn write_synced(fs: &dyn Fs, path: &Path, bytes: &[u8]) -> Result<()> {
    fs.write_synced(path, bytes)
        .map_err(|err| problem(path, format!("cannot write it: {err}"), io_fix(&err)))
}

/// fsyncs a directory, so that the names in it last.
pub(crate) fn sync_dir(fs: &dyn Fs, dir: &Path) -> Result<()> {
    fs.sync_dir(dir)
        .map_err(|err| problem(dir, format!("cannot sync it: {err}"), io_fix(&err)))
}

/// Makes `root/.tmp-step{step}` afresh (and `root`, durably, if it is
/// missing), removing temporaries a killed write left behind.
pub(crate) fn begin(fs: &dyn Fs, root: &Path, step: u64) -> Result<PathBuf> {
    create_dir_all_durably(fs, root)
        .map_err(|err| problem(root, format!("cannot create it: {err}"), io_fix(&err)))?;
    let names = fs
        .list(root)
        .map_err(|err| problem(root, format!("cannot list it: {err}"), io_fix(&err)))?;
    for name in names {
        if name.starts_with(".tmp-") {
            let _ = fs.remove_dir_all(&root.join(name));
        }
    }
    let tmp = root.join(format!(".tmp-step{step}"));
    fs.create_dir(&tmp)
        .map_err(|err| problem(&tmp, format!("cannot create it: {err}"), io_fix(&err)))?;
    Ok(tmp)
}

/// Checksums the files, writes `meta.json`, and publishes the temporary
/// directory as `step-NNNNNNNN`, then points `latest` at it.
pub(crate) fn commit(
    fs: &dyn Fs,
    root: &Path,
    tmp: &Path,
    mut meta: CheckpointMeta,
) -> Result<PathBuf> {
    let names = fs
        .list(tmp)
        .map_err(|err| problem(tmp, format!("cannot list it: {err}"), io_fix(&err)))?;
    for name in names {
        let hash = file_hash(fs, &tmp.join(&name))?;
        meta.files.insert(name, hash);
    }
    let json = serde_json::to_vec_pretty(&meta).expect("meta serializes");
    write_synced(fs, &tmp.join("meta.json"), &json)?;
    write_synced(fs, &tmp.join(META_HASH), hash_hex(&json).as_bytes())?;
    sync_dir(fs, tmp)?;
    let name = format!("step-{:08}", meta.step);
    let done = root.join(&name);
    // A checkpoint of this step already there (a run started again with
    // --overwrite, or resumed from an older step) may be the one `latest`
    // names: the new one takes its place in one step, and the old one,
    // now under the temporary name, is removed once `latest` is written.
    let replaced = fs.exists(&done) && replace(fs, root, tmp, &done, &name)?;
    if !replaced {
        fs.rename(tmp, &done).map_err(|err| {
            problem(
                &done,
                format!("cannot rename {} to it: {err}", tmp.display()),
                io_fix(&err),
            )
        })?;
    }
    sync_dir(fs, root)?;
    let pointer = root.join(".latest.tmp");
    write_synced(fs, &pointer, name.as_bytes())?;
    fs.rename(&pointer, &root.join("latest")).map_err(|err| {
        problem(
            &root.join("latest"),
            format!("cannot replace it: {err}"),
            io_fix(&err),
        )
    })?;
    sync_dir(fs, root)?;
    if replaced {
        // The new checkpoint is published: a failure here leaves only a
        // temporary directory, which the next checkpoint's start removes.
        if let Err(err) = fs.remove_dir_all(tmp) {
            tracing::warn!(
                "checkpoint {}: the replaced checkpoint stays at {}: {err}",
                done.display(),
                tmp.display()
            );
        }
    }
    Ok(done)
}

/// Puts `tmp` in the place of the existing checkpoint `done` (named
/// `name`): swapped in one step where the file system can, so `done` is
/// at every moment the old checkpoint or the new one, whole. Where it
/// cannot, the old one is removed first, unless `latest` names it.
/// Whether the two were swapped (the old one is then at `tmp`).
fn replace(fs: &dyn Fs, root: &Path, tmp: &Path, done: &Path, name: &str) -> Result<bool> {
    let err = match fs.exchange(tmp, done) {
        Ok(()) => return Ok(true),
        Err(err) => err,
    };
    let named = fs
        .read(&root.join("latest"))
        .is_ok_and(|latest| String::from_utf8_lossy(&latest).trim() == name);
    if named {
        return Err(problem(
            done,
            format!(
                "cannot put the new checkpoint of this step in the place of the one `latest` \
                 names in one step ({err})"
            ),
            "set train.checkpoint_dir to a new directory (this file system cannot swap two \
             directories), or move this one away; it is intact",
        ));
    }
    fs.remove_dir_all(done)
        .map_err(|err| problem(done, format!("cannot replace it: {err}"), io_fix(&err)))?;
    Ok(false)
}

/// Removes all but the newest `kept` checkpoints under `root` (0: keep
/// all), never the one `latest` names.
pub(crate) fn prune(fs: &dyn Fs, root: &Path, kept: usize) -> Result<()> {
    if kept == 0 {
        return Ok(());
    }
    let latest = fs
        .read(&root.join("latest"))
        .map(|b| String::from_utf8_lossy(&b).into_owned())
        .unwrap_or_default();
    let names = fs
        .list(root)
        .map_err(|err| problem(root, format!("cannot list it: {err}"), io_fix(&err)))?;
    let mut steps: Vec<(u64, String)> = names
        .into_iter()
        .filter_map(|name| {
            let step = name.strip_prefix("step-")?.parse().ok()?;
            Some((step, name))
        })
        .collect();
    steps.sort_unstable_by_key(|&(step, _)| std::cmp::Reverse(step));
    for (_, name) in steps.into_iter().skip(kept) {
        if name == latest.trim() {
            continue;
        }
        let old = root.join(&name);
        let doomed = root.join(format!(".tmp-pruned-{name}"));
        fs.rename(&old, &doomed)
            .map_err(|err| problem(&old, format!("cannot remove it: {err}"), io_fix(&err)))?;
        // The rename is durable before the data goes: a crash never leaves
        // a half-deleted directory under a step-NNNNNNNN name.
        sync_dir(fs, root)?;
        fs.remove_dir_all(&doomed)
            .map_err(|err| problem(&old, format!("cannot remove it: {err}"), io_fix(&err)))?;
    }
    sync_dir(fs, root)
}

fn hash_hex(bytes: &[u8]) -> String {
    format!("{:016x}", xxhash_rust::xxh3::xxh3_64(bytes))
}

fn file_hash(fs: &dyn Fs, path: &Path) -> Result<String> {
    let bytes = fs
        .read(path)
        .map_err(|err| problem(path, format!("cannot read it: {err}"), io_fix(&err)))?;
    Ok(hash_hex(&bytes))
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
            let bytes = self.read_file(name)?;
            checked.push((name.clone(), bytes.len() as u64));
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
}

/// A named tensor for [`safetensors_bytes`]: its shape, its values, and
/// whether it is stored as bf16 (values that are bf16 already, as bf16
/// states are: stored exactly in half the bytes) rather than f32.
pub(crate) type Named = (String, Vec<usize>, Vec<f32>, bool);

/// Serializes named tensors as safetensors (f32, or bf16 where marked),
/// with transformers' `{"format": "pt"}` header (some of its versions
/// refuse a file without).
pub(crate) fn safetensors_bytes(path: &Path, tensors: &[Named]) -> Result<Vec<u8>> {
    let narrowed: Vec<Option<Vec<u8>>> = tensors
        .iter()
        .map(|(_, _, data, bf16)| {
            bf16.then(|| {
                data.iter()
                    .flat_map(|&x| {
                        let narrow = half::bf16::from_f32(x);
                        debug_assert!(x.is_nan() || narrow.to_f32() == x, "not a bf16 value");
                        narrow.to_le_bytes()
                    })
                    .collect()
            })
        })
        .collect();
    let views = tensors
        .iter()
        .zip(&narrowed)
        .map(|((name, shape, data, _), narrowed)| {
            let (dtype, bytes) = match narrowed {
                Some(bytes) => (safetensors::Dtype::BF16, &bytes[..]),
                None => (safetensors::Dtype::F32, bytemuck::cast_slice(data)),
            };
            safetensors::tensor::TensorView::new(dtype, shape.clone(), bytes)
                .map(|view| (name.clone(), view))
        })
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|err| problem(path, err, "this is a bug: report it"))?;
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize(views, Some(metadata))
        .map_err(|err| problem(path, err, "this is a bug: report it"))
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
    Ok(view
        .data()
        .chunks_exact(width)
        .map(|b| match b {
            [a, b, c, d] => f32::from_le_bytes([*a, *b, *c, *d]),
            _ => half::bf16::from_le_bytes([b[0], b[1]]).to_f32(),
        })
        .collect())
}

impl Engine {
    /// Writes a checkpoint of the state after the last step under `root`
    /// (see [`checkpoint`](self) for the layout); every rank calls it
    /// together. Returns the checkpoint's directory.
    pub fn save_checkpoint(&mut self, root: &Path) -> Result<PathBuf> {
        self.try_save_checkpoint(root)?
    }

    /// [`Engine::save_checkpoint`], telling the two kinds of failure
    /// apart. The outer error is the engine's (a state it could not read,
    /// a broken collective): training cannot go on. The inner one is the
    /// checkpoint's files (a full or failing disk): every rank gets it,
    /// the checkpoint before stays whole and `latest`, this one's
    /// temporary directory is removed, and training can go on.
    pub fn try_save_checkpoint(&mut self, root: &Path) -> Result<Result<PathBuf>> {
        self.flush()?;
        let (rank, world) = (self.collective.rank(), self.collective.world());
        let step = self.step;
        let tmp = root.join(format!(".tmp-step{step}"));
        let begun = if rank == 0 {
            begin(&RealFs, root, step).map(drop)
        } else {
            Ok(())
        };
        if let Err(err) = self.agree(begun)? {
            return Ok(Err(err));
        }
        let specs = self.model.groups();
        let mut shard = Vec::with_capacity(3 * self.groups.len());
        let mut weights = Vec::new();
        for g in 0..self.groups.len() {
            let n = self.groups[g].shard;
            let mut state = vec![0.0f32; 3 * n];
            self.read_state(g, &mut state)?;
            // On the host: the states are read there, and the weights go
            // to a file (a checkpoint, not the step path).
            let mut gathered = vec![0.0f32; self.groups[g].padded(world)];
            self.collective
                .all_gather(
                    View::host_slice(&state[..n]),
                    ViewMut::host_slice(&mut gathered),
                )?
                .wait()?;
            if rank == 0 {
                let exported = export_group(&specs[g], &gathered[..self.groups[g].params]);
                weights.extend(exported.into_iter().map(|(n, s, v)| (n, s, v, false)));
            }
            // Each state in the width it is kept in: bf16 states take half
            // the disk (exactly: their values are bf16).
            let name = &self.groups[g].name;
            let dtype = self.config.optim.state_dtype;
            let parts = [
                ("master", 0..n, dtype.master_bytes()),
                ("exp_avg", n..2 * n, dtype.moment_bytes()),
                ("exp_avg_sq", 2 * n..3 * n, dtype.moment_bytes()),
            ];
            for (part, range, width) in parts {
                shard.push((
                    format!("{name}.{part}"),
                    vec![n],
                    state[range].to_vec(),
                    width == 2,
                ));
            }
        }
        let written = (|| {
            let path = tmp.join(format!("optimizer-rank{rank}.safetensors"));
            write_synced(&RealFs, &path, &safetensors_bytes(&path, &shard)?)?;
            if rank == 0 {
                let path = tmp.join("model.safetensors");
                write_synced(&RealFs, &path, &safetensors_bytes(&path, &weights)?)?;
                let config =
                    serde_json::to_vec_pretty(&self.model.hf_config()).expect("serializes");
                write_synced(&RealFs, &tmp.join(HF_CONFIG), &config)?;
            }
            Ok(())
        })();
        if let Err(err) = self.agree(written)? {
            if rank == 0 {
                let _ = std::fs::remove_dir_all(&tmp);
            }
            return Ok(Err(err));
        }
        let committed = if rank == 0 {
            let meta = CheckpointMeta {
                format: FORMAT,
                step,
                optimizer_steps: self.optimizer_steps,
                ranks: world,
                seed: self.config.train.seed,
                model: self.config.model,
                loss_scaler: self.scaler.state(),
                state_dtype: self.config.optim.state_dtype,
                rounding: if self.config.optim.state_dtype.stochastic() {
                    ROUNDING_STOCHASTIC.into()
                } else {
                    nearest()
                },
                rounding_seed: self.config.optim.rounding_seed,
                files: Default::default(),
            };
            let committed = commit(&RealFs, root, &tmp, meta);
            if committed.is_err() {
                let _ = std::fs::remove_dir_all(&tmp);
            }
            committed.map(|_| {
                // The checkpoint is published: failing to remove old ones
                // loses nothing, so it is reported, not fatal.
                if let Err(err) = prune(&RealFs, root, self.config.train.checkpoints_kept) {
                    tracing::warn!("could not prune old checkpoints: {err}");
                }
            })
        } else {
            Ok(())
        };
        Ok(self
            .agree(committed)?
            .map(|()| root.join(format!("step-{step:08}"))))
    }

    /// Loads a checkpoint written by a run of the same model, ranks and
    /// seed: the next step computes what the uninterrupted run's did.
    pub fn resume(&mut self, checkpoint: &Checkpoint) -> Result<()> {
        self.usable()?;
        let meta = &checkpoint.meta;
        let rank = self.collective.rank();
        let path = checkpoint
            .dir
            .join(format!("optimizer-rank{rank}.safetensors"));
        let mismatch = |what: &str, found: String, here: String| TrainError::Checkpoint {
            path: checkpoint.dir.clone(),
            problem: format!("it was written with {what} {found}, this run has {here}"),
            fix: format!("resume with the {what} it was written with"),
        };
        if meta.model != self.config.model {
            // Named key by key, the ones that differ.
            let (a, b) = (&meta.model, &self.config.model);
            let fields = [
                ("vocab", a.vocab, b.vocab),
                ("seq", a.seq, b.seq),
                ("hidden", a.hidden, b.hidden),
                ("heads", a.heads, b.heads),
                ("layers", a.layers, b.layers),
            ];
            let differ = |pick: fn(&(&str, usize, usize)) -> usize| {
                fields
                    .iter()
                    .filter(|f| f.1 != f.2)
                    .map(|f| format!("model.{} = {}", f.0, pick(f)))
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            return Err(mismatch("[model]", differ(|f| f.1), differ(|f| f.2)));
        }
        if meta.ranks != self.collective.world() {
            return Err(mismatch(
                "train.ranks",
                meta.ranks.to_string(),
                self.collective.world().to_string(),
            ));
        }
        if meta.state_dtype != self.config.optim.state_dtype {
            return Err(mismatch(
                "optim.state_dtype",
                format!("{:?}", meta.state_dtype.name()),
                format!("{:?}", self.config.optim.state_dtype.name()),
            ));
        }
        if meta.seed != self.config.train.seed {
            return Err(mismatch(
                "train.seed",
                meta.seed.to_string(),
                self.config.train.seed.to_string(),
            ));
        }
        // The state dtypes agree (checked above); the rounding must be the
        // one they write.
        let stochastic = self.config.optim.state_dtype.stochastic();
        let expected = if stochastic {
            ROUNDING_STOCHASTIC
        } else {
            "nearest"
        };
        match meta.rounding.as_str() {
            r if r == expected => {}
            older if stochastic && ROUNDING_STOCHASTIC_OLDER.contains(&older) => {
                if rank == 0 {
                    tracing::warn!(
                        "{}: meta.json says rounding = {older:?}: it comes from an older strata, whose random bits for bf16 stochastic rounding differ from this one's ({ROUNDING_STOCHASTIC:?}); the run goes on from the checkpoint's states, unbiased, but does not replay the bits the old strata would have drawn",
                        checkpoint.dir.display()
                    );
                }
            }
            other => {
                return Err(TrainError::Checkpoint {
                    path: checkpoint.dir.join("meta.json"),
                    problem: format!(
                        "rounding = {other:?} is not what optim.state_dtype = {:?} writes ({expected:?})",
                        self.config.optim.state_dtype.name()
                    ),
                    fix: "resume it with the strata that wrote it, or from another checkpoint"
                        .into(),
                });
            }
        }
        let rounding_seed = meta.rounding_seed.unwrap_or(meta.seed);
        if self.config.optim.state_dtype.stochastic()
            && rounding_seed != self.config.rounding_seed()
        {
            return Err(mismatch(
                "optim.rounding_seed",
                rounding_seed.to_string(),
                self.config.rounding_seed().to_string(),
            ));
        }
        if meta.files.contains_key(HF_CONFIG) {
            checkpoint.read_file(HF_CONFIG)?;
        }
        let bytes = checkpoint.read_file(&format!("optimizer-rank{rank}.safetensors"))?;
        let file = safetensors::SafeTensors::deserialize(&bytes).map_err(|err| {
            TrainError::Checkpoint {
                path: path.clone(),
                problem: format!("not a safetensors file: {err}"),
                fix: "resume from another checkpoint".into(),
            }
        })?;
        let mut buffers = LoadBuffers::default();
        for g in 0..self.groups.len() {
            let (name, n) = (self.groups[g].name.clone(), self.groups[g].shard);
            let master = read_tensor(&path, &file, &format!("{name}.master"), n)?;
            let m = read_tensor(&path, &file, &format!("{name}.exp_avg"), n)?;
            let v = read_tensor(&path, &file, &format!("{name}.exp_avg_sq"), n)?;
            self.load_group(g, &master, Some((&m, &v)), &mut buffers)?;
        }
        self.scaler.restore(meta.loss_scaler)?;
        self.step = meta.step;
        self.optimizer_steps = meta.optimizer_steps;
        Ok(())
    }

    /// Group `g`'s current master weights and moments, read where they
    /// are and left at home.
    pub(super) fn read_state(&mut self, g: usize, out: &mut [f32]) -> Result<()> {
        let index = state_index(g, self.current);
        let id = self.slots[index].id.expect("states registered");
        let home = self.slots[index].home.expect("states have a home");
        let tier = if self.runtime.residency(id)?.contains(&Tier::Device) {
            Tier::Device
        } else {
            Tier::Host
        };
        let dtype = self.config.optim.state_dtype;
        let mut raw = vec![0f32; state_words(dtype, out.len() / 3)];
        read_f32(&self.runtime, id, tier, &mut raw)?;
        decode_states(dtype, bytemuck::cast_slice(&raw), out);
        if home == Tier::Nvme {
            self.runtime.move_to(id, Tier::Nvme)?.wait()?;
        }
        Ok(())
    }
}

/// Publishing under the crash model of [`super::durable`]: a power cut
/// after any operation, or a failure at any operation, leaves `latest`
/// naming a whole checkpoint, byte for byte the old one or the new one.
#[cfg(test)]
mod crash_tests {
    use super::super::durable::SimFs;
    use super::*;

    const ROOT: &str = "/ckpt";

    fn meta(step: u64) -> CheckpointMeta {
        CheckpointMeta {
            format: FORMAT,
            step,
            optimizer_steps: step,
            ranks: 1,
            seed: 7,
            model: ModelConfig::default(),
            loss_scaler: (1.0, 0, 0),
            state_dtype: StateDtype::Fp32,
            rounding: nearest(),
            rounding_seed: None,
            files: HashMap::new(),
        }
    }

    /// Writes and publishes the checkpoint of `step` (its files' bytes
    /// depend on the step), then prunes to one.
    fn publish(fs: &SimFs, step: u64) -> Result<PathBuf> {
        publish_salted(fs, step, 0)
    }

    /// [`publish`] with files whose bytes depend on `salt` too (another
    /// run's checkpoint of the same step).
    fn publish_salted(fs: &SimFs, step: u64, salt: u64) -> Result<PathBuf> {
        let root = Path::new(ROOT);
        let tmp = begin(fs, root, step)?;
        for (name, len) in [
            ("optimizer-rank0.safetensors", 300),
            ("model.safetensors", 500),
        ] {
            let bytes: Vec<u8> = (0..len)
                .map(|i| (i as u64 * 31 + step + 7 * salt) as u8)
                .collect();
            write_synced(fs, &tmp.join(name), &bytes)?;
        }
        let done = commit(fs, root, &tmp, meta(step))?;
        prune(fs, root, 1)?;
        Ok(done)
    }

    /// The files of the checkpoint `latest` names, checked against
    /// meta.json's checksums and meta.json against its own.
    /// A checkpoint's step and its files (name, bytes), in name order.
    type Published = (u64, Vec<(String, Vec<u8>)>);

    fn latest(fs: &SimFs) -> std::result::Result<Published, String> {
        let root = Path::new(ROOT);
        let name = fs
            .read(&root.join("latest"))
            .map_err(|e| format!("latest: {e}"))?;
        let dir = root.join(String::from_utf8_lossy(&name).trim());
        let json = fs
            .read(&dir.join("meta.json"))
            .map_err(|e| format!("meta: {e}"))?;
        let own = fs
            .read(&dir.join(META_HASH))
            .map_err(|e| format!("hash: {e}"))?;
        if own != hash_hex(&json).as_bytes() {
            return Err("meta.json does not match its checksum".into());
        }
        let meta: CheckpointMeta = serde_json::from_slice(&json).map_err(|e| e.to_string())?;
        let mut files = Vec::new();
        for (file, hash) in &meta.files {
            let bytes = fs
                .read(&dir.join(file))
                .map_err(|e| format!("{file}: {e}"))?;
            if &hash_hex(&bytes) != hash {
                return Err(format!("{file} does not match its checksum"));
            }
            files.push((file.clone(), bytes));
        }
        files.sort();
        Ok((meta.step, files))
    }

    #[test]
    fn a_crash_or_a_failure_at_any_operation_leaves_the_old_or_the_new_checkpoint_whole() {
        let first = SimFs::new();
        publish(&first, 1).unwrap();
        let old = latest(&first.crash()).expect("the first checkpoint is durable");
        let base = first.ops();
        let whole = first.clone();
        publish(&whole, 2).unwrap();
        let new = latest(&whole.crash()).expect("the second checkpoint is durable");
        let total = whole.ops() - base;
        assert!(total > 10, "{total} operations");
        let (mut saw_old, mut saw_new) = (0, 0);
        for k in 0..total {
            let mut fs = first.clone();
            fs.fail_at = Some(base + k);
            let failed = publish(&fs, 2);
            // Past the rename of `latest`, only pruning is left: the new
            // checkpoint is published even when a later operation fails.
            let live = latest(&fs).unwrap_or_else(|e| panic!("operation {k} failed: {e}"));
            assert!(
                live == old || live == new,
                "operation {k} failed: a mixed checkpoint"
            );
            if failed.is_ok() {
                panic!("operation {k} was to fail");
            }
            // A power cut right after the failed operation.
            let after = latest(&fs.crash()).unwrap_or_else(|e| panic!("crash after {k}: {e}"));
            if after == old {
                saw_old += 1;
            } else if after == new {
                saw_new += 1;
            } else {
                panic!("crash after {k}: a mixed checkpoint");
            }
        }
        eprintln!(
            "{total} operations publish and prune; a failure or power cut after each: {saw_old} left the old checkpoint, {saw_new} the new"
        );
        assert!(saw_old > 0 && saw_new > 0, "{saw_old} old, {saw_new} new");
    }

    /// A run started again with --overwrite (or resumed from an older
    /// step) publishes a checkpoint of the step `latest` names: at every
    /// failure and power cut `latest` still names a whole one, the old or
    /// the new. (Removing the old one before renaming the new one into its
    /// place lost it.)
    #[test]
    fn republishing_the_step_latest_names_keeps_a_whole_checkpoint_throughout() {
        let first = SimFs::new();
        publish(&first, 1).unwrap();
        let old = latest(&first.crash()).expect("the first checkpoint is durable");
        let base = first.ops();
        let whole = first.clone();
        publish_salted(&whole, 1, 1).unwrap();
        let new = latest(&whole.crash()).expect("the second checkpoint is durable");
        assert_ne!(old, new);
        let root = Path::new(ROOT);
        assert_eq!(fs_names(&whole, root), ["latest", "step-00000001"]);
        let total = whole.ops() - base;
        for k in 0..total {
            let mut fs = first.clone();
            fs.fail_at = Some(base + k);
            // (A failure removing the old checkpoint, after `latest` is
            // written, is only warned of.)
            let _ = publish_salted(&fs, 1, 1);
            for (when, fs) in [("failure", fs.clone()), ("power cut", fs.crash())] {
                let live = latest(&fs).unwrap_or_else(|e| panic!("{when} at {k}: {e}"));
                assert!(
                    live == old || live == new,
                    "{when} at {k}: a mixed checkpoint"
                );
            }
        }
        // Where the file system cannot swap, the checkpoint `latest` names
        // is refused by name and left as it is; another step's is replaced.
        let mut fs = first.clone();
        fs.no_exchange = true;
        let err = publish_salted(&fs, 1, 1).unwrap_err().to_string();
        assert!(
            err.contains("in one step") && err.contains("intact"),
            "{err}"
        );
        assert_eq!(latest(&fs.crash()).unwrap(), old);
        publish(&fs, 2).unwrap();
        publish_salted(&fs, 1, 1).unwrap();
        assert_eq!(latest(&fs.crash()).unwrap(), new);
    }

    fn fs_names(fs: &SimFs, dir: &Path) -> Vec<String> {
        let mut names = fs.list(dir).unwrap();
        names.sort();
        names
    }

    #[test]
    fn the_crash_model_catches_a_writer_that_skips_fsync() {
        let fs = SimFs::new();
        publish(&fs, 1).unwrap();
        let mut broken = fs.clone();
        broken.skip_file_sync = true;
        publish(&broken, 2).unwrap();
        assert!(latest(&broken).is_ok(), "whole before the power cut");
        let err = latest(&broken.crash()).expect_err("files never fsynced are lost");
        assert!(err.contains("checksum") || err.contains("meta"), "{err}");
    }
}
