//! Publishing a checkpoint so that a crash or a failure at any point
//! leaves `latest` naming a whole one: written into a temporary directory,
//! every file and the directory fsynced, renamed to `step-NNNNNNNN` (a
//! checkpoint of the step `latest` names swapped in with
//! `renameat2(RENAME_EXCHANGE)`), and only then `latest` replaced by
//! rename; older ones pruned once a new one is whole.

use std::path::{Path, PathBuf};

use crate::engine::durable::{Fs, create_dir_all_durably};
use crate::error::Result;

use super::{CheckpointMeta, META_HASH, problem};

pub(super) fn io_fix(err: &std::io::Error) -> String {
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

pub(super) fn hash_hex(bytes: &[u8]) -> String {
    format!("{:016x}", xxhash_rust::xxh3::xxh3_64(bytes))
}

/// [`hash_hex`] of the file at `path`, read a piece at a time.
pub(super) fn file_hash(fs: &dyn Fs, path: &Path) -> Result<String> {
    Ok(file_hash_len(fs, path)?.0)
}

/// [`file_hash`] and the file's length.
pub(super) fn file_hash_len(fs: &dyn Fs, path: &Path) -> Result<(String, u64)> {
    let mut hasher = xxhash_rust::xxh3::Xxh3::new();
    let len = fs
        .read_pieces(path, &mut |piece| hasher.update(piece))
        .map_err(|err| problem(path, format!("cannot read it: {err}"), io_fix(&err)))?;
    Ok((format!("{:016x}", hasher.digest()), len))
}

/// Publishing under the crash model of [`crate::engine::durable`]: a power cut
/// after any operation, or a failure at any operation, leaves `latest`
/// naming a whole checkpoint, byte for byte the old one or the new one.
#[cfg(test)]
mod crash_tests {
    use std::collections::HashMap;

    use super::super::{FORMAT, nearest};
    use super::*;
    use crate::engine::config::{ModelConfig, StateDtype};
    use crate::engine::durable::SimFs;

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
            data: None,
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
