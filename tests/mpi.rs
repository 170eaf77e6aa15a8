//! Ranks as processes: `strata train` under `mpirun` (a build with
//! `--features mpi`) against the same run as threads of one process - the
//! same losses, bit for bit, checkpoints and resume included; a rank
//! killed with SIGKILL, which every other rank reports by number within
//! `[comm] timeout_s` plus 10 s, the last checkpoint whole; SIGTERM to
//! every rank, which stops them all at one step boundary with one final
//! checkpoint that resumes bit for bit; and a launcher's world that a
//! config's `train.ranks` contradicts, refused by name. Skipped, saying
//! why, without `mpirun` (failed instead with `STRATA_REQUIRE_MPI=1`).

#![cfg(feature = "mpi")]

mod ranks;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use ranks::{TAG, config, losses, strata, summary, text, wait_for_checkpoint};

/// mpirun of `processes` strata processes with `args`, or None (skipped)
/// where there is no mpirun.
fn mpirun(dir: &Path, processes: usize, extra: &[&str], args: &[&str]) -> Option<Command> {
    if Command::new("mpirun").arg("--version").output().is_err() {
        if std::env::var_os("STRATA_REQUIRE_MPI").is_some_and(|v| v == "1") {
            panic!("STRATA_REQUIRE_MPI=1 and no mpirun on PATH (apt-get install openmpi-bin)");
        }
        eprintln!("skipped: no mpirun on PATH (apt-get install openmpi-bin libopenmpi-dev)");
        return None;
    }
    let mut command = Command::new("mpirun");
    command
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env("STRATA_LOG", "warn")
        .current_dir(dir)
        .args(["--oversubscribe", "-n", &processes.to_string()])
        .args(extra)
        .arg(env!("CARGO_BIN_EXE_strata"))
        .args(args);
    Some(command)
}

#[test]
fn processes_under_mpirun_train_the_bits_of_threads_and_resume_them() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let dir = dir.path();
    config(dir, 2, 8, 4);
    let threads = losses(
        &strata(dir)
            .args(["train", "--config", "r2.toml", "--json"])
            .output()
            .unwrap(),
    );
    let Some(mut first) = mpirun(
        dir,
        2,
        &[],
        &[
            "train",
            "--config",
            "r2.toml",
            "--checkpoint-dir",
            "ck",
            "--stop-after",
            "4",
            "--json",
        ],
    ) else {
        return;
    };
    let mut processes = losses(&first.output().unwrap());
    assert!(
        dir.join("ck/step-00000004/optimizer-rank1.safetensors")
            .exists()
    );
    let mut resumed = mpirun(dir, 2, &[], &["train", "--resume", "ck", "--json"]).unwrap();
    processes.extend(losses(&resumed.output().unwrap()));
    assert_eq!(
        processes, threads,
        "two processes (4 steps, resumed for 4) against two threads"
    );
    // Hybrid sharding (states over pairs of four ranks): four processes
    // give the four threads' bits.
    config(dir, 4, 8, 100);
    let hybrid = std::fs::read_to_string(dir.join("r4.toml"))
        .unwrap()
        .replace("micro_batch = 4", "micro_batch = 2")
        + "\n[parallel]\nshard_degree = 2\n";
    std::fs::write(dir.join("hybrid.toml"), hybrid).unwrap();
    let threads = losses(
        &strata(dir)
            .args(["train", "--config", "hybrid.toml", "--json"])
            .output()
            .unwrap(),
    );
    let out = mpirun(dir, 4, &[], &["train", "--config", "hybrid.toml", "--json"])
        .unwrap()
        .output()
        .unwrap();
    assert_eq!(
        losses(&out),
        threads,
        "hybrid sharding: four processes against four threads"
    );
    // A config of other ranks than the launcher's is refused by name.
    config(dir, 3, 8, 4);
    let out = mpirun(dir, 2, &[], &["train", "--config", "r3.toml"])
        .unwrap()
        .output()
        .unwrap();
    assert!(!out.status.success());
    let said = text(&out);
    assert!(
        said.contains("train.ranks") && said.contains("2 processes"),
        "{said}"
    );
    // One rank's own failure (its swap directory is a file) ends every
    // rank at once with its message, not a timeout later.
    config(dir, 2, 8, 4);
    let slow = std::fs::read_to_string(dir.join("r2.toml"))
        .unwrap()
        .replace("timeout_s = 3", "timeout_s = 120");
    std::fs::write(dir.join("r2.toml"), slow).unwrap();
    let _ = std::fs::remove_dir_all(dir.join("strata-train-swap/rank1"));
    std::fs::create_dir_all(dir.join("strata-train-swap")).unwrap();
    std::fs::write(dir.join("strata-train-swap/rank1"), "not a directory").unwrap();
    let started = Instant::now();
    let out = mpirun(dir, 2, &[], &["train", "--config", "r2.toml"])
        .unwrap()
        .output()
        .unwrap();
    let said = text(&out);
    eprintln!(
        "one rank's own failure: {:.1} s\n{said}",
        started.elapsed().as_secs_f64()
    );
    assert!(!out.status.success(), "{said}");
    assert!(
        said.contains("rank 1 of 2") && said.contains("rank1"),
        "{said}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(60),
        "{:?}",
        started.elapsed()
    );
}

/// `ranks::ranks_of` for the ranks mpirun starts.
fn ranks_of(processes: usize, tag: &str) -> Vec<(usize, u32)> {
    ranks::ranks_of(processes, tag, "OMPI_COMM_WORLD_RANK")
}

#[test]
fn a_killed_rank_is_named_by_the_others_and_sigterm_stops_every_rank_at_one_step() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let dir = dir.path();
    // Four processes of one rank each, a checkpoint every 2 steps.
    config(dir, 1, 100_000, 2);
    let Some(mut run) = mpirun(
        dir,
        4,
        &["--enable-recovery"],
        &["train", "--config", "r1.toml", "--checkpoint-dir", "ck"],
    ) else {
        return;
    };
    let child = run
        .env(TAG, "kill")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let ranks = ranks_of(4, "kill");
    wait_for_checkpoint(dir);
    let killed = Instant::now();
    let status = Command::new("kill")
        .args(["-KILL", &ranks[2].1.to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let out = child.wait_with_output().unwrap();
    let took = killed.elapsed();
    let said = text(&out);
    eprintln!(
        "after SIGKILL of rank 2: {:.1} s\n{said}",
        took.as_secs_f64()
    );
    for rank in [0, 1, 3] {
        assert!(
            said.contains(&format!("rank {rank} of 4"))
                && said.contains("no answer from rank(s) [2]"),
            "rank {rank}:\n{said}"
        );
    }
    assert!(took < Duration::from_secs(3 + 10), "{took:?}");
    let verify = strata(dir)
        .args(["checkpoint", "verify", "ck"])
        .output()
        .unwrap();
    assert!(verify.status.success(), "{}", text(&verify));
    // SIGTERM to every rank: one boundary, one final checkpoint, 143.
    std::fs::remove_dir_all(dir.join("ck")).unwrap();
    let mut run = mpirun(
        dir,
        4,
        &[],
        &[
            "train",
            "--config",
            "r1.toml",
            "--checkpoint-dir",
            "ck",
            "--json",
        ],
    )
    .unwrap();
    let child = run
        .env(TAG, "term")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let ranks = ranks_of(4, "term");
    wait_for_checkpoint(dir);
    for (_, pid) in &ranks {
        Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status()
            .unwrap();
    }
    let out = child.wait_with_output().unwrap();
    let said = text(&out);
    assert_eq!(out.status.code(), Some(143), "{said}");
    let latest = std::fs::read_to_string(dir.join("ck/latest")).unwrap();
    let step: u64 = latest.trim().trim_start_matches("step-").parse().unwrap();
    let stopped = summary(&out);
    assert_eq!(stopped["last_step"], step, "{said}");
    // Resumed for two more steps: the bits of four threads run straight.
    let resumed = mpirun(
        dir,
        4,
        &[],
        &[
            "train",
            "--resume",
            "ck",
            "--stop-after",
            &(step + 2).to_string(),
            "--json",
        ],
    )
    .unwrap()
    .output()
    .unwrap();
    ranks::stopped_and_resumed_match_four_threads(dir, &stopped, losses(&resumed), step + 2);
}
