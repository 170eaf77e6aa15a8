//! The engine's side of a checkpoint: every rank's optimizer shard, the
//! model's weights gathered group by group into its Hugging Face tensors
//! on rank 0, `meta.json`; and resuming from one, refused by name where
//! it does not match the run.

use std::path::{Path, PathBuf};

use strata_device::{View, ViewMut};

use crate::engine::durable::RealFs;
use crate::engine::tensors::LoadBuffers;
use crate::engine::{DataPosition, Engine};
use crate::error::{Result, TrainError};
use crate::hf::{Planned, ShardWriter, WeightsDtype};
use crate::model::Model;

use super::publish::{begin, commit, prune, write_synced};
use super::{
    Checkpoint, CheckpointMeta, FORMAT, GENERATION_CONFIG, HF_CONFIG, ROUNDING_STOCHASTIC,
    ROUNDING_STOCHASTIC_OLDER, TOKENIZER_FILES, nearest, read_tensor,
};

impl Engine {
    /// Writes a checkpoint of the state after the last step under `root`
    /// (see [`checkpoint`](self) for the layout); every rank calls it
    /// together. Returns the checkpoint's directory.
    pub fn save_checkpoint(&mut self, root: &Path) -> Result<PathBuf> {
        self.try_save_checkpoint(root, None)?
    }

    /// [`Engine::save_checkpoint`], telling the two kinds of failure
    /// apart. The outer error is the engine's (a state it could not read,
    /// a broken collective): training cannot go on. The inner one is the
    /// checkpoint's files (a full or failing disk): every rank gets it,
    /// the checkpoint before stays whole and `latest`, this one's
    /// temporary directory is removed, and training can go on. `data` is
    /// where the run stands in its data, recorded in `meta.json` for a
    /// resume to go on from.
    pub fn try_save_checkpoint(
        &mut self,
        root: &Path,
        data: Option<&DataPosition>,
    ) -> Result<Result<PathBuf>> {
        self.flush()?;
        let env = &self.env;
        let rank = env.rank();
        let (config, groups) = (env.config(), env.groups());
        let step = self.state.steps();
        let tmp = root.join(format!(".tmp-step{step}"));
        let begun = if rank == 0 {
            begin(&RealFs, root, step).map(drop)
        } else {
            Ok(())
        };
        if let Err(err) = env.agree(begun)? {
            return Ok(Err(err));
        }
        let specs = env.model().groups();
        // Each rank writes its optimizer shard, and rank 0 the weights,
        // group by group as they are read and gathered: no rank holds more
        // than one group's. A failed write is kept and agreed on after the
        // loop (the gathers go on: every rank takes part in each).
        let dtype = config.optim.state_dtype;
        let width = |bytes: usize| match bytes {
            2 => WeightsDtype::Bf16,
            _ => WeightsDtype::F32,
        };
        let parts = [
            ("master", width(dtype.master_bytes())),
            ("exp_avg", width(dtype.moment_bytes())),
            ("exp_avg_sq", width(dtype.moment_bytes())),
        ];
        let planned = groups
            .iter()
            .flat_map(|group| {
                parts.iter().map(|(part, dtype)| Planned {
                    name: format!("{}.{part}", group.name),
                    shape: vec![group.shard],
                    dtype: *dtype,
                })
            })
            .collect();
        // One copy of the shards is written: hybrid sharding's replicas
        // hold the same ones.
        let mut shard = (env.replica() == 0).then(|| {
            let name = format!("optimizer-rank{}", env.shard_rank());
            ShardWriter::new(&tmp, &name, planned, u64::MAX)
        });
        let mut weights = (rank == 0).then(|| {
            let c = &config.checkpoint;
            let planned = specs
                .iter()
                .flat_map(|g| &g.tensors)
                .map(|t| Planned {
                    name: t.name.clone(),
                    shape: t.shape.clone(),
                    dtype: c.weights_dtype,
                })
                .collect();
            ShardWriter::new(&tmp, "model", planned, c.max_shard_size.0)
        });
        let mut failed: Option<TrainError> = None;
        let mut piece = Vec::new();
        for g in 0..groups.len() {
            self.save_group(g, &mut shard, &mut weights, &mut failed, &mut piece)?;
        }
        let written = (|| {
            if let Some(err) = failed {
                return Err(err);
            }
            if let Some(shard) = shard {
                shard.finish()?;
            }
            if let Some(writer) = weights {
                writer.finish()?;
                // The side files come from the folder the run started from,
                // or, resumed, from its newest checkpoint (which has them).
                // (Only a checkpoint of this model, before this step: one
                // of another run left in the directory is not this run's.)
                let source = config.model.init_from.clone().or_else(|| {
                    let mine = |m: &crate::ModelConfig| crate::ModelConfig {
                        init_from: None,
                        ..m.clone()
                    };
                    Checkpoint::open(root)
                        .ok()
                        .filter(|c| {
                            c.meta.step < step && mine(&c.meta.model) == mine(&config.model)
                        })
                        .map(|latest| latest.dir)
                });
                write_hf_files(config, env.model(), source.as_deref(), &tmp)?;
                // The run's own config: `--resume DIR` alone starts from it.
                let run_config = match &self.run_config {
                    Some(text) => text.clone(),
                    None => config.to_toml()?,
                };
                write_synced(
                    &RealFs,
                    &tmp.join(crate::engine::config::RUN_CONFIG),
                    run_config.as_bytes(),
                )?;
            }
            Ok(())
        })();
        if let Err(err) = env.agree(written)? {
            if rank == 0 {
                let _ = std::fs::remove_dir_all(&tmp);
            }
            return Ok(Err(err));
        }
        let committed = if rank == 0 {
            let meta = CheckpointMeta {
                format: FORMAT,
                step,
                optimizer_steps: self.state.optimizer_steps(),
                // The shards' files: one per rank of a shard group.
                ranks: env.shards(),
                seed: config.train.seed,
                model: config.model.clone(),
                loss_scaler: self.loss.scaler_state(),
                state_dtype: config.optim.state_dtype,
                rounding: if config.optim.state_dtype.stochastic() {
                    ROUNDING_STOCHASTIC.into()
                } else {
                    nearest()
                },
                rounding_seed: config.optim.rounding_seed,
                data: data.cloned(),
                files: Default::default(),
            };
            let committed = commit(&RealFs, root, &tmp, meta);
            if committed.is_err() {
                let _ = std::fs::remove_dir_all(&tmp);
            }
            committed.map(|_| {
                // The checkpoint is published: failing to remove old ones
                // loses nothing, so it is reported, not fatal.
                if let Err(err) = prune(&RealFs, root, config.train.checkpoints_kept) {
                    tracing::warn!("could not prune old checkpoints: {err}");
                }
            })
        } else {
            Ok(())
        };
        Ok(env
            .agree(committed)?
            .map(|()| root.join(format!("step-{step:08}"))))
    }

    /// Loads a checkpoint written by a run of the same model, ranks and
    /// seed: the next step computes what the uninterrupted run's did.
    pub fn resume(&mut self, checkpoint: &Checkpoint) -> Result<()> {
        self.state.usable()?;
        let meta = &checkpoint.meta;
        let env = &self.env;
        // The shard this rank holds, of how many.
        let (config, rank, shards) = (env.config(), env.shard_rank(), env.shards());
        let world = env.world();
        let path = checkpoint
            .dir
            .join(format!("optimizer-rank{rank}.safetensors"));
        let mismatch = |what: &str, found: String, here: String| TrainError::Checkpoint {
            path: checkpoint.dir.clone(),
            problem: format!("it was written with {what} {found}, this run has {here}"),
            fix: format!("resume with the {what} it was written with"),
        };
        if meta.model.arch != config.model.arch {
            return Err(mismatch(
                "[model]",
                format!("model.arch = {:?}", meta.model.arch.name()),
                format!("model.arch = {:?}", config.model.arch.name()),
            ));
        }
        // Where the run's first weights came from does not matter once it
        // has a checkpoint.
        let started = |m: &crate::ModelConfig| crate::ModelConfig {
            init_from: None,
            ..m.clone()
        };
        if started(&meta.model) != started(&config.model) {
            // Named key by key, every one that differs (a key left out
            // shows as its default's absence).
            let as_map = |m: &crate::ModelConfig| match serde_json::to_value(started(m)) {
                Ok(serde_json::Value::Object(map)) => map,
                _ => unreachable!("a model config serializes as an object"),
            };
            let (a, b) = (as_map(&meta.model), as_map(&config.model));
            let mut keys: Vec<&String> = a.keys().chain(b.keys()).collect();
            keys.sort();
            keys.dedup();
            let show = |map: &serde_json::Map<String, serde_json::Value>| {
                keys.iter()
                    .filter(|k| a.get(**k) != b.get(**k))
                    .map(|k| match map.get(*k) {
                        Some(v) => format!("model.{k} = {v}"),
                        None => format!("no model.{k}"),
                    })
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            return Err(mismatch("[model]", show(&a), show(&b)));
        }
        // Other shards only with the global batch held, which the
        // checkpoint's place in the data tells (sequences per step).
        let t = &config.train;
        let global = (world * t.micro_batch * t.grad_accumulation) as u64;
        let held = match &meta.data {
            Some(data) if meta.step > 0 => Some(data.samples / meta.step),
            _ => None,
        };
        // (With its own shards, a resume needs no data record: `strata
        // eval` reads a checkpoint at another micro-batch.)
        let reshard = meta.ranks != shards;
        let unknown = held.is_none() && reshard;
        if meta.ranks == 0 || unknown || (reshard && held.is_some_and(|held| held != global)) {
            return Err(TrainError::Checkpoint {
                path: checkpoint.dir.clone(),
                problem: format!(
                    "its states are in {} shards, {}, and this run has {shards} shards over {world} ranks of {} x {} sequences a step ({global})",
                    meta.ranks,
                    match held {
                        Some(held) => format!("{held} sequences a step"),
                        None => "with no record of its sequences a step".into(),
                    },
                    t.micro_batch,
                    t.grad_accumulation
                ),
                fix: "resume with the global batch (train.ranks x train.micro_batch x train.grad_accumulation) it was written with".into(),
            });
        }
        if meta.state_dtype != config.optim.state_dtype {
            return Err(mismatch(
                "optim.state_dtype",
                format!("{:?}", meta.state_dtype.name()),
                format!("{:?}", config.optim.state_dtype.name()),
            ));
        }
        if meta.seed != config.train.seed {
            return Err(mismatch(
                "train.seed",
                meta.seed.to_string(),
                config.train.seed.to_string(),
            ));
        }
        // The state dtypes agree (checked above); the rounding must be the
        // one they write.
        let stochastic = config.optim.state_dtype.stochastic();
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
                        config.optim.state_dtype.name()
                    ),
                    fix: "resume it with the strata that wrote it, or from another checkpoint"
                        .into(),
                });
            }
        }
        let rounding_seed = meta.rounding_seed.unwrap_or(meta.seed);
        if config.optim.state_dtype.stochastic() && rounding_seed != config.rounding_seed() {
            return Err(mismatch(
                "optim.rounding_seed",
                rounding_seed.to_string(),
                config.rounding_seed().to_string(),
            ));
        }
        if meta.files.contains_key(HF_CONFIG) {
            checkpoint.read_file(HF_CONFIG)?;
        }
        let mut buffers = LoadBuffers::default();
        let dtype = config.optim.state_dtype;
        if meta.ranks == shards {
            // Mapped, each group's states streamed from the file into
            // their home tier and its pages dropped after: never whole in
            // memory.
            let file_name = format!("optimizer-rank{rank}.safetensors");
            let mapped = checkpoint.map_checked(&file_name)?;
            let file = open_shard(&path, &mapped)?;
            let widths = [
                ("master", dtype.master_bytes()),
                ("exp_avg", dtype.moment_bytes()),
                ("exp_avg_sq", dtype.moment_bytes()),
            ];
            for (g, group) in env.groups().iter().enumerate() {
                let (name, n) = (&group.name, group.shard);
                let mut parts = Vec::with_capacity(3);
                for (state, width) in widths {
                    let name = format!("{name}.{state}");
                    parts.push(state_bytes(&path, &file, &name, n, width)?);
                }
                let mut source = |range: std::ops::Range<usize>, out: &mut [f32]| -> Result<()> {
                    let width = dtype.master_bytes();
                    decode_master(
                        dtype,
                        &parts[0][range.start * width..range.end * width],
                        out,
                    );
                    Ok(())
                };
                let mut states = |at: u64, out: &mut [u8]| -> Result<()> {
                    let (mut at, mut done) = (at as usize, 0);
                    for part in &parts {
                        if done == out.len() {
                            break;
                        }
                        if at >= part.len() {
                            at -= part.len();
                            continue;
                        }
                        let n = (part.len() - at).min(out.len() - done);
                        out[done..done + n].copy_from_slice(&part[at..at + n]);
                        (done, at) = (done + n, 0);
                    }
                    Ok(())
                };
                self.moves.load_group_from(
                    env,
                    g,
                    crate::engine::moves::LOAD_PIECE,
                    &mut source,
                    Some(&mut states),
                )?;
                for part in &parts {
                    mapped.release_slice(part);
                }
            }
        } else {
            // Written by another number of ranks: this rank's shard of each
            // group is cut anew from the old ranks' shards by the elements'
            // place in the group (its padding past the parameters zero).
            let old = meta.ranks;
            let mut files: Vec<Option<crate::hf::MappedFile>> = (0..old).map(|_| None).collect();
            for (g, group) in env.groups().iter().enumerate() {
                let (name, n) = (&group.name, group.shard);
                let old_shard = group.params.div_ceil(old);
                let begin = rank * n;
                let end = (begin + n).min(group.params);
                let mut parts = [vec![0f32; n], vec![0f32; n], vec![0f32; n]];
                let mut at = begin;
                while at < end {
                    let q = at / old_shard;
                    let upto = ((q + 1) * old_shard).min(end);
                    let file_name = format!("optimizer-rank{q}.safetensors");
                    if files[q].is_none() {
                        files[q] = Some(checkpoint.map_checked(&file_name)?);
                    }
                    let q_path = checkpoint.dir.join(&file_name);
                    let mapped = files[q].as_ref().expect("mapped above");
                    let file = open_shard(&q_path, mapped)?;
                    for (part, state) in parts.iter_mut().zip(["master", "exp_avg", "exp_avg_sq"]) {
                        let name = format!("{name}.{state}");
                        let values = read_tensor(&q_path, &file, &name, old_shard)?;
                        let from = at - q * old_shard;
                        part[at - begin..upto - begin]
                            .copy_from_slice(&values[from..from + (upto - at)]);
                        // Read once: its pages go (checked by read_tensor).
                        let read = file.tensor(&name).expect("read above");
                        mapped.release_slice(read.data());
                    }
                    at = upto;
                }
                let [master, m, v] = &parts;
                self.moves
                    .load_group(env, g, master, Some((m, v)), &mut buffers)?;
            }
            if env.rank() == 0 {
                tracing::info!(
                    "resumed a checkpoint of {old} shards at {shards}: each rank's shards cut anew from the old ranks'"
                );
            }
        }
        self.loss.restore(meta.loss_scaler)?;
        self.state.restore(meta.step, meta.optimizer_steps);
        Ok(())
    }
}

/// A rank's optimizer shard file, parsed.
fn open_shard<'a>(path: &Path, bytes: &'a [u8]) -> Result<safetensors::SafeTensors<'a>> {
    safetensors::SafeTensors::deserialize(bytes).map_err(|err| TrainError::Checkpoint {
        path: path.to_path_buf(),
        problem: format!("not a safetensors file: {err}"),
        fix: "resume from another checkpoint".into(),
    })
}

/// Tensor `name` of a mapped optimizer shard as it is kept: `len`
/// elements of `width` bytes (F32 or BF16, the state dtype's), refused by
/// name otherwise.
fn state_bytes<'a>(
    path: &Path,
    file: &safetensors::SafeTensors<'a>,
    name: &str,
    len: usize,
    width: usize,
) -> Result<&'a [u8]> {
    let mismatch = |found: String| TrainError::Checkpoint {
        path: path.to_path_buf(),
        problem: format!(
            "tensor {name} is {found}, expected {} x {len}",
            if width == 4 { "F32" } else { "BF16" }
        ),
        fix: "the checkpoint does not match this run: resume from another".into(),
    };
    let view = file.tensor(name).map_err(|err| mismatch(err.to_string()))?;
    let elements: usize = view.shape().iter().product();
    let dtype = match width {
        4 => safetensors::Dtype::F32,
        _ => safetensors::Dtype::BF16,
    };
    if view.dtype() != dtype || elements != len {
        return Err(mismatch(format!("{:?} x {elements}", view.dtype())));
    }
    Ok(view.data())
}

/// The Hugging Face files beside the weights: `config.json` (with the
/// weights' dtype and `source`'s special tokens), `generation_config.json`,
/// and `source`'s tokenizer files, when it has them (`source`: the folder
/// the run started from, or a checkpoint of the run).
fn write_hf_files(
    config: &crate::TrainConfig,
    model: &dyn Model,
    source: Option<&Path>,
    dir: &Path,
) -> Result<()> {
    let mut hf_config = model.hf_config();
    let dtype = config.checkpoint.weights_dtype.torch();
    hf_config["torch_dtype"] = dtype.into();
    hf_config["dtype"] = dtype.into();
    // The special tokens of the model the run started from (what
    // generation stops at), as its config.json gives them.
    if let Some(from) = source {
        let path = from.join(HF_CONFIG);
        let theirs: serde_json::Value = std::fs::read(&path)
            .ok()
            .and_then(|bytes| serde_json::from_slice(&bytes).ok())
            .ok_or_else(|| TrainError::Checkpoint {
                path: path.clone(),
                problem: "cannot read it back".into(),
                fix: "keep the folder the run started from (model.init_from) readable".into(),
            })?;
        for key in SPECIAL_TOKENS {
            if let Some(id) = theirs.get(key) {
                hf_config[key] = id.clone();
            }
        }
    }
    let json = serde_json::to_vec_pretty(&hf_config).expect("serializes");
    write_synced(&RealFs, &dir.join(HF_CONFIG), &json)?;
    let generation = serde_json::json!({
        "_from_model_config": true,
        "bos_token_id": hf_config.get("bos_token_id"),
        "eos_token_id": hf_config.get("eos_token_id"),
        "pad_token_id": hf_config.get("pad_token_id"),
    });
    let json = serde_json::to_vec_pretty(&generation).expect("serializes");
    write_synced(&RealFs, &dir.join(GENERATION_CONFIG), &json)?;
    if let Some(from) = source {
        // The source's generation settings replace the ones made above.
        for name in TOKENIZER_FILES.iter().chain(&[GENERATION_CONFIG]) {
            let source = from.join(name);
            if source.is_file() {
                let bytes = std::fs::read(&source).map_err(|err| TrainError::Checkpoint {
                    path: source.clone(),
                    problem: format!("cannot read the tokenizer file: {err}"),
                    fix: "keep the folder the run started from (model.init_from) readable".into(),
                })?;
                write_synced(&RealFs, &dir.join(name), &bytes)?;
            }
        }
    }
    Ok(())
}

// The states' bytes are native-endian (`encode_states`) and go into the
// checkpoint as they are: safetensors is little-endian.
const _: () = assert!(
    cfg!(target_endian = "little"),
    "checkpoints are little-endian"
);

/// The special token ids a checkpoint's config.json carries over from the
/// folder the run started from.
const SPECIAL_TOKENS: [&str; 3] = ["bos_token_id", "eos_token_id", "pad_token_id"];

/// Master weights sent from a rank to rank 0 at a time (16 MiB).
const SAVE_PIECE: usize = 1 << 22;

impl Engine {
    /// Group `g` into the checkpoint: each rank of the first replica
    /// streams its current states (master, m, v as they are kept) into its
    /// optimizer shard, from the drive a chunk at a time when they live
    /// there, and its master weights to rank 0 a piece at a time, rank by
    /// rank, which writes them into the model's tensors in order: no rank
    /// holds a group's states or weights whole. A failed write is kept in
    /// `failed` and the exchange goes on (every rank takes part in each);
    /// a failed read or exchange ends the save.
    fn save_group(
        &self,
        g: usize,
        shard: &mut Option<ShardWriter>,
        weights: &mut Option<ShardWriter>,
        failed: &mut Option<TrainError>,
        piece: &mut Vec<f32>,
    ) -> Result<()> {
        let env = &self.env;
        if env.replica() != 0 {
            return Ok(());
        }
        let group = &env.groups()[g];
        let (n, dtype) = (group.shard, env.config().optim.state_dtype);
        let (ranks, me) = (env.shards(), env.shard_rank());
        let width = dtype.master_bytes();
        let masters_end = (n * width) as u64;
        let states_end = masters_end + 2 * (n * dtype.moment_bytes()) as u64;
        // Once a write failed no more are tried (the files are dropped);
        // the exchange goes on, every rank taking part.
        let write = |failed: &mut Option<TrainError>,
                     writer: &mut Option<ShardWriter>,
                     bytes: Bytes<'_>| {
            if let (None, Some(writer)) = (&failed, writer.as_mut()) {
                let written = match bytes {
                    Bytes::Raw(bytes) => writer.append_bytes(bytes),
                    Bytes::Values(values) => writer.append(values),
                };
                *failed = written.err();
            }
        };
        for r in 0..ranks {
            // Rank r's shard covers the group's elements from r * n; past
            // the group's end it is padding, not written.
            let real = ((r + 1) * n).min(group.params).saturating_sub(r * n);
            // Rank 0 writes rank r's masters `done` elements in.
            let mut deliver = |piece: &[f32], done: usize, failed: &mut Option<TrainError>| {
                let upto = real.saturating_sub(done).min(piece.len());
                write(failed, weights, Bytes::Values(&piece[..upto]));
            };
            if r == me {
                let mut sent = 0;
                piece.clear();
                let mut flush = |piece: &mut Vec<f32>, failed: &mut Option<TrainError>| {
                    if me == 0 {
                        deliver(piece, sent, failed);
                    } else {
                        env.shard_group().send(0, View::host_slice(piece))?.wait()?;
                    }
                    sent += piece.len();
                    piece.clear();
                    Ok::<(), TrainError>(())
                };
                self.moves.stream_state(env, g, &mut |at, bytes| {
                    let end = at + bytes.len() as u64;
                    let upto = end.min(states_end).saturating_sub(at) as usize;
                    write(failed, shard, Bytes::Raw(&bytes[..upto]));
                    let upto = end.min(masters_end).saturating_sub(at) as usize;
                    let mut word = &bytes[..upto];
                    while !word.is_empty() {
                        let take = (SAVE_PIECE - piece.len()).min(word.len() / width);
                        assert!(take > 0, "state chunks end on whole master weights");
                        let start = piece.len();
                        piece.resize(start + take, 0.0);
                        decode_master(dtype, &word[..take * width], &mut piece[start..]);
                        word = &word[take * width..];
                        if piece.len() == SAVE_PIECE {
                            flush(piece, failed)?;
                        }
                    }
                    Ok(())
                })?;
                if !piece.is_empty() {
                    flush(piece, failed)?;
                }
            } else if me == 0 {
                // Rank r's pieces, as it cut them.
                let mut done = 0;
                while done < n {
                    let len = (n - done).min(SAVE_PIECE);
                    piece.clear();
                    piece.resize(len, 0.0);
                    env.shard_group()
                        .recv(r, ViewMut::host_slice(piece))?
                        .wait()?;
                    deliver(piece, done, failed);
                    done += len;
                }
            }
        }
        Ok(())
    }
}

/// What [`Engine::save_group`] hands a shard writer: bytes as they are
/// kept, or f32 values to narrow.
enum Bytes<'a> {
    Raw(&'a [u8]),
    Values(&'a [f32]),
}

/// Master weights as a state dtype keeps them into f32.
fn decode_master(dtype: crate::StateDtype, bytes: &[u8], out: &mut [f32]) {
    let kept = match dtype.master_bytes() {
        4 => safetensors::Dtype::F32,
        _ => safetensors::Dtype::BF16,
    };
    crate::hf::widen(kept, bytes, 0, out.len(), out);
}
