//! Run ownership: a directory (a checkpoint directory, a swap directory)
//! belongs to one live run at a time. The run holds an exclusive lock on
//! `.strata-lock` in it for its whole life (released by the kernel when the
//! process dies, however it dies) and writes who it is into the file; a
//! second run is refused with the holder's pid, host, start time and run
//! id. The release of a dead holder's lock can lag its death (unpinning a
//! large pool at exit takes seconds): a run waits for it, at most the
//! caller's bound (`strata train`'s `train.lock_wait_s`, strata.torch's
//! `lock_wait_s`). Used by `strata train` and by the Python optimizer
//! alike, so that either refuses a directory the other is using.

use std::fs::{File, OpenOptions, TryLockError};
use std::io::{Read, Seek, Write};
use std::path::Path;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::error::{Result, StorageError};

/// The lock file's name in each owned directory.
pub const LOCK_FILE: &str = ".strata-lock";

/// How often a run looks again at a dead holder's lock.
const POLL: Duration = Duration::from_millis(10);

/// Who holds a directory: written into its lock file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Holder {
    /// The process.
    pub pid: u32,
    /// The machine.
    pub host: String,
    /// When the run started, seconds since the Unix epoch.
    pub started_unix_s: u64,
    /// The run's id (random per run).
    pub run_id: String,
}

impl Holder {
    /// This process's run, as of now.
    pub fn this_run() -> Holder {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        let pid = std::process::id();
        let seed = now.as_nanos() as u64 ^ (u64::from(pid) << 32);
        Holder {
            pid,
            host: host_name(),
            started_unix_s: now.as_secs(),
            run_id: format!("{:016x}", xxhash_rust::xxh3::xxh3_64(&seed.to_le_bytes())),
        }
    }

    fn describe(&self) -> String {
        format!(
            "run {} (pid {} on {}, started {})",
            self.run_id,
            self.pid,
            self.host,
            local_time(self.started_unix_s)
        )
    }

    /// Whether the holder is a process of this machine that has exited.
    fn exited(&self) -> bool {
        if self.host != host_name() {
            return false;
        }
        !Path::new(&format!("/proc/{}", self.pid)).exists()
    }
}

/// A Unix time as this machine's local date and time, ISO-style
/// (`2026-11-29 12:04:31 CET`); the raw number where it cannot be one.
pub fn local_time(unix_s: u64) -> String {
    i64::try_from(unix_s)
        .ok()
        .and_then(|s| jiff::Timestamp::from_second(s).ok())
        .map(|t| {
            t.to_zoned(jiff::tz::TimeZone::system())
                .strftime("%Y-%m-%d %H:%M:%S %Z")
                .to_string()
        })
        .unwrap_or_else(|| format!("at Unix time {unix_s}"))
}

fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "unknown host".into())
}

/// A directory this run owns until it is dropped.
#[derive(Debug)]
pub struct DirLock {
    /// The open, locked lock file (closing it releases the lock).
    _file: File,
}

/// How long to wait for an exited holder's lock, and the setting that
/// raises it (named in the error).
#[derive(Clone, Copy, Debug)]
pub struct LockWait<'a> {
    /// The bound.
    pub wait: Duration,
    /// The setting, e.g. `train.lock_wait_s`.
    pub setting: &'a str,
}

/// Takes `dir` (created if missing, durably) for `holder`, `what` naming
/// the setting it came from. A live holder is refused at once; a holder
/// that has exited is waited for, at most `wait.wait`.
pub fn lock_dir(dir: &Path, what: &str, holder: &Holder, wait: LockWait<'_>) -> Result<DirLock> {
    let fail = |problem: String, fix: &str| StorageError::Ownership {
        what: what.to_string(),
        dir: dir.to_path_buf(),
        problem,
        fix: fix.to_string(),
    };
    create_dir_all_durably(dir).map_err(|err| {
        fail(
            format!("cannot create it: {err}"),
            "choose a writable directory",
        )
    })?;
    let path = dir.join(LOCK_FILE);
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(|err| {
            fail(
                format!("cannot open {LOCK_FILE} in it: {err}"),
                "make the directory writable or choose another",
            )
        })?;
    let started = Instant::now();
    loop {
        match file.try_lock() {
            Ok(()) => break,
            Err(TryLockError::WouldBlock) => {
                let other = read_holder(&mut file);
                let dead = other.as_ref().is_some_and(Holder::exited);
                if dead && started.elapsed() < wait.wait {
                    std::thread::sleep(POLL);
                    continue;
                }
                let who = other.map_or_else(|| "another run".to_string(), |h| h.describe());
                return Err(if dead {
                    fail(
                        format!(
                            "{who} holds it; that process has exited but its lock was not released within {:.1} s",
                            wait.wait.as_secs_f64()
                        ),
                        &format!("wait a little and start again, or raise {}", wait.setting),
                    )
                } else {
                    fail(
                        format!("{who} is using it"),
                        "wait for that run to finish or stop it, or give this run another directory",
                    )
                });
            }
            Err(TryLockError::Error(err)) => {
                return Err(fail(
                    format!("cannot lock {LOCK_FILE} in it: {err}"),
                    "use a local filesystem that supports file locks",
                ));
            }
        }
    }
    let record = serde_json::to_vec(holder).expect("holder serializes");
    let written = file
        .set_len(0)
        .and_then(|()| file.rewind())
        .and_then(|()| file.write_all(&record))
        .and_then(|()| file.flush());
    written.map_err(|err| {
        fail(
            format!("cannot write {LOCK_FILE} in it: {err}"),
            "free space on that disk or choose another directory",
        )
    })?;
    Ok(DirLock { _file: file })
}

/// Creates `dir` and its missing parents, each new entry synced into its
/// parent directory (a crash right after cannot lose it).
fn create_dir_all_durably(dir: &Path) -> std::io::Result<()> {
    let missing: Vec<&Path> = dir.ancestors().take_while(|a| !a.exists()).collect();
    std::fs::create_dir_all(dir)?;
    for made in missing {
        let parent = match made.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        File::open(parent)?.sync_all()?;
    }
    Ok(())
}

/// The holder recorded in a lock file (none while it is being written).
fn read_holder(file: &mut File) -> Option<Holder> {
    let mut text = String::new();
    file.rewind().ok()?;
    file.read_to_string(&mut text).ok()?;
    serde_json::from_str(&text).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    const NO_WAIT: LockWait<'static> = LockWait {
        wait: Duration::ZERO,
        setting: "train.lock_wait_s",
    };

    fn wait(wait: Duration) -> LockWait<'static> {
        LockWait {
            wait,
            setting: "train.lock_wait_s",
        }
    }

    /// Lock messages say when a holder started as a local date and time.
    #[test]
    fn a_start_time_reads_as_a_local_date_and_time() {
        let shown = local_time(1_795_925_183);
        let date = &shown[..10];
        assert!(
            ["2026-11-28", "2026-11-29"].contains(&date) && shown.as_bytes()[13] == b':',
            "{shown}"
        );
        assert!(!shown.contains("Unix"), "{shown}");
    }

    #[test]
    fn a_second_holder_is_refused_by_name_and_the_lock_goes_with_the_first() {
        let dir = tempfile::tempdir().unwrap();
        let first = Holder::this_run();
        let lock = lock_dir(dir.path(), "train.checkpoint_dir", &first, NO_WAIT).unwrap();
        let second = Holder {
            run_id: "other".into(),
            ..Holder::this_run()
        };
        let err = lock_dir(dir.path(), "train.checkpoint_dir", &second, NO_WAIT)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("train.checkpoint_dir")
                && err.contains(&first.run_id)
                && err.contains(&format!("pid {}", first.pid))
                && err.contains("is using it"),
            "{err}"
        );
        drop(lock);
        lock_dir(dir.path(), "train.checkpoint_dir", &second, NO_WAIT).unwrap();
    }

    #[test]
    fn an_exited_holder_is_waited_for_within_the_bound() {
        let dir = tempfile::tempdir().unwrap();
        // A holder that has exited (no such pid) whose lock is still held,
        // as when the kernel has not yet released it.
        let dead = Holder {
            pid: u32::MAX,
            ..Holder::this_run()
        };
        let lock = lock_dir(dir.path(), "nvme.dirs entry", &dead, NO_WAIT).unwrap();
        let started = Instant::now();
        let err = lock_dir(
            dir.path(),
            "nvme.dirs entry",
            &Holder::this_run(),
            wait(Duration::from_millis(100)),
        )
        .unwrap_err()
        .to_string();
        assert!(started.elapsed() >= Duration::from_millis(100));
        assert!(
            err.contains("has exited") && err.contains("train.lock_wait_s"),
            "{err}"
        );
        // Released while the next run waits: it gets the directory.
        let releaser = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            drop(lock);
        });
        lock_dir(
            dir.path(),
            "nvme.dirs entry",
            &Holder::this_run(),
            wait(Duration::from_secs(10)),
        )
        .unwrap();
        releaser.join().unwrap();
    }
}
