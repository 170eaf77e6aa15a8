//! Ranks as processes over TCP: `strata train --nproc N` (and torchrun,
//! where it is on PATH) against the same run as threads of one process -
//! the same losses, bit for bit, checkpoints and resume included; a rank
//! killed with SIGKILL, which every other rank names within `[comm]
//! timeout_s` plus 10 s (its sockets close), the last checkpoint whole and
//! no swap files left by the ranks that exited; SIGTERM, passed on to
//! every rank, which stop at one step boundary with one final checkpoint
//! that resumes bit for bit; a config whose `train.ranks` contradicts
//! `--nproc`, refused by name; one rank's own failure, which ends every
//! rank at once with its message.

mod ranks;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use ranks::{TAG, config, losses, strata, summary, text, wait_for_checkpoint};

/// `ranks::ranks_of` for the ranks `--nproc` starts (torchrun's `RANK`).
fn ranks_of(processes: usize, tag: &str) -> Vec<(usize, u32)> {
    ranks::ranks_of(processes, tag, "RANK")
}

#[test]
fn nproc_ranks_train_the_bits_of_threads_and_resume_them() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let dir = dir.path();
    config(dir, 2, 8, 4);
    let threads = losses(
        &strata(dir)
            .args(["train", "--config", "r2.toml", "--json"])
            .output()
            .unwrap(),
    );
    let first = strata(dir)
        .args([
            "train",
            "--nproc",
            "2",
            "--config",
            "r2.toml",
            "--checkpoint-dir",
            "ck",
            "--stop-after",
            "4",
            "--json",
        ])
        .output()
        .unwrap();
    let mut processes = losses(&first);
    assert!(
        dir.join("ck/step-00000004/optimizer-rank1.safetensors")
            .exists()
    );
    let resumed = strata(dir)
        .args(["train", "--nproc=2", "--resume", "ck", "--json"])
        .output()
        .unwrap();
    processes.extend(losses(&resumed));
    assert_eq!(
        processes, threads,
        "two processes (4 steps, resumed for 4) against two threads"
    );
    // A config of other ranks than --nproc's is refused by name.
    config(dir, 3, 8, 4);
    let out = strata(dir)
        .args(["train", "--nproc", "2", "--config", "r3.toml"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let said = text(&out);
    assert!(
        said.contains("train.ranks = 3") && said.contains("--nproc 2"),
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
    let out = strata(dir)
        .args(["train", "--nproc", "2", "--config", "r2.toml"])
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

/// The swap files of `rank`.
fn swap_files(dir: &Path, rank: usize) -> Vec<String> {
    let owned = dir.join(format!("strata-train-swap/rank{rank}/strata-swap"));
    std::fs::read_dir(owned)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect()
}

#[test]
fn a_killed_rank_is_named_by_the_others_and_sigterm_stops_every_rank_at_one_step() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let dir = dir.path();
    // Four processes of one rank each, a checkpoint every 2 steps.
    config(dir, 1, 100_000, 2);
    let child = strata(dir)
        .args([
            "train",
            "--nproc",
            "4",
            "--config",
            "r1.toml",
            "--checkpoint-dir",
            "ck",
        ])
        .env(TAG, "kill")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let ranks = ranks_of(4, "kill");
    wait_for_checkpoint(dir);
    assert!(!swap_files(dir, 2).is_empty(), "rank 2 swaps");
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
    assert!(!out.status.success(), "{said}");
    // Each survivor names rank 2, at first hand or from the rank that
    // saw it go.
    for rank in [0, 1, 3] {
        assert!(
            said.lines()
                .any(|l| l.contains(&format!("rank {rank} of 4: step "))
                    && l.contains("rank 2 closed its connection")),
            "rank {rank}:\n{said}"
        );
    }
    assert!(took < Duration::from_secs(3 + 10), "{took:?}");
    // Only the killed rank's stay (the next run there removes them).
    for rank in [0, 1, 3] {
        assert_eq!(swap_files(dir, rank), Vec::<String>::new(), "rank {rank}");
    }
    assert!(!swap_files(dir, 2).is_empty(), "rank 2's, left by SIGKILL");
    let verify = strata(dir)
        .args(["checkpoint", "verify", "ck"])
        .output()
        .unwrap();
    assert!(verify.status.success(), "{}", text(&verify));
    // SIGTERM to `strata train --nproc`, passed on to every rank: one
    // boundary, one final checkpoint, 143.
    std::fs::remove_dir_all(dir.join("ck")).unwrap();
    let child = strata(dir)
        .args([
            "train",
            "--nproc",
            "4",
            "--config",
            "r1.toml",
            "--checkpoint-dir",
            "ck",
            "--json",
        ])
        .env(TAG, "term")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    ranks_of(4, "term");
    wait_for_checkpoint(dir);
    Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let said = text(&out);
    assert_eq!(out.status.code(), Some(143), "{said}");
    let latest = std::fs::read_to_string(dir.join("ck/latest")).unwrap();
    let step: u64 = latest.trim().trim_start_matches("step-").parse().unwrap();
    let stopped = summary(&out);
    assert_eq!(stopped["last_step"], step, "{said}");
    // Resumed for two more steps: the bits of four threads run straight.
    let resumed = strata(dir)
        .args([
            "train",
            "--nproc",
            "4",
            "--resume",
            "ck",
            "--stop-after",
            &(step + 2).to_string(),
            "--json",
        ])
        .output()
        .unwrap();
    ranks::stopped_and_resumed_match_four_threads(dir, &stopped, losses(&resumed), step + 2);
}

#[test]
fn a_rank_killed_while_checkpoints_are_written_leaves_the_last_one_whole() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let dir = dir.path();
    // A checkpoint every step, so that a kill lands in one often: rank 0
    // or rank 1 killed at a different moment of the checkpoint cycle each
    // time (the single-process crash model of `checkpoint::publish` takes
    // every operation in turn; this takes the processes).
    config(dir, 1, 100_000, 1);
    for (round, (victim, delay_ms)) in [(1, 0), (0, 13), (1, 29), (0, 41), (1, 57), (0, 71)]
        .into_iter()
        .enumerate()
    {
        let _ = std::fs::remove_dir_all(dir.join("ck"));
        let tag = format!("crash{round}");
        let child = strata(dir)
            .args([
                "train",
                "--nproc",
                "2",
                "--config",
                "r1.toml",
                "--checkpoint-dir",
                "ck",
            ])
            .env(TAG, &tag)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let ranks = ranks_of(2, &tag);
        wait_for_checkpoint(dir);
        std::thread::sleep(Duration::from_millis(delay_ms));
        Command::new("kill")
            .args(["-KILL", &ranks[victim].1.to_string()])
            .status()
            .unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(!out.status.success(), "round {round}: {}", text(&out));
        let verify = strata(dir)
            .args(["checkpoint", "verify", "ck"])
            .output()
            .unwrap();
        assert!(verify.status.success(), "round {round}: {}", text(&verify));
        // And it resumes (a step past it), as a restarted job would.
        let latest = std::fs::read_to_string(dir.join("ck/latest")).unwrap();
        let step: u64 = latest.trim().trim_start_matches("step-").parse().unwrap();
        let resumed = strata(dir)
            .args([
                "train",
                "--nproc",
                "2",
                "--resume",
                "ck",
                "--stop-after",
                &(step + 1).to_string(),
                "--json",
            ])
            .output()
            .unwrap();
        assert_eq!(losses(&resumed).len(), 1, "round {round}");
    }
}

#[test]
fn a_rank_that_crashes_at_any_checkpoint_operation_leaves_the_last_whole_one() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let dir = dir.path();
    // Two ranks of one layer, two steps, a checkpoint after each.
    config(dir, 1, 2, 1);
    let small = std::fs::read_to_string(dir.join("r1.toml"))
        .unwrap()
        .replace("layers = 4", "layers = 1");
    std::fs::write(dir.join("r1.toml"), small).unwrap();
    let train = |extra: &[&str], crash: Option<String>| {
        let mut command = strata(dir);
        command.args([
            "train",
            "--nproc",
            "2",
            "--config",
            "r1.toml",
            "--checkpoint-dir",
            "ck",
        ]);
        command.args(extra);
        if let Some(at) = crash {
            command.env("STRATA_CRASH_AT", at);
        }
        command.output().unwrap()
    };
    // Every operation of each rank: rank 1's shard files, around the
    // agreements; rank 0's weights, side files and publishing (each of
    // whose operations the single process's crash model in
    // `checkpoint::publish` also takes, with power cuts).
    for (victim, stride) in [(1, 1usize), (0, 1)] {
        let mut n = 1;
        let ops = loop {
            let _ = std::fs::remove_dir_all(dir.join("ck"));
            let out = train(&[], Some(format!("{victim}:{n}")));
            if out.status.success() {
                break n - 1;
            }
            let said = text(&out);
            assert!(
                said.contains("aborting at checkpoint operation"),
                "rank {victim}, operation {n}:\n{said}"
            );
            if dir.join("ck/latest").exists() {
                let verify = strata(dir)
                    .args(["checkpoint", "verify", "ck"])
                    .output()
                    .unwrap();
                assert!(
                    verify.status.success(),
                    "rank {victim}, operation {n}: {}",
                    text(&verify)
                );
            }
            // Started again as a launcher restarts a job: it goes on to the
            // end from the last whole checkpoint, or from the start.
            // (A crash after the last checkpoint was published: it says the
            // run is finished.)
            let again = train(&["--resume", "auto", "--json"], None);
            let said = text(&again);
            assert!(
                again.status.success(),
                "rank {victim}, operation {n}: {said}"
            );
            if !said.contains("it is finished") {
                assert_eq!(summary(&again)["last_step"], 2, "{said}");
            }
            n += stride;
            assert!(n < 1000, "rank {victim} never finished");
        };
        eprintln!(
            "rank {victim}: crashed at {} of its {ops} checkpoint operations",
            ops.div_ceil(stride)
        );
        assert!(ops > 8, "rank {victim}: {ops} operations");
    }
}

/// The largest relative difference between two loss curves of one length.
fn worst(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| ((x - y) / x).abs())
        .fold(0.0, f64::max)
}

#[test]
fn a_checkpoint_resumes_at_another_number_of_ranks_with_the_global_batch_held() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let dir = dir.path();
    config(dir, 2, 20, 100);
    // Four ranks of half the micro-batch: the same global batch of 8.
    let four = std::fs::read_to_string(dir.join("r2.toml"))
        .unwrap()
        .replace("ranks = 2", "ranks = 4")
        .replace("micro_batch = 4", "micro_batch = 2");
    std::fs::write(dir.join("r4.toml"), four).unwrap();
    let run = |args: &[&str]| {
        losses(
            &strata(dir)
                .args(["train", "--json"])
                .args(args)
                .output()
                .unwrap(),
        )
    };
    for (from, to, processes) in [("r2.toml", "r4.toml", true), ("r4.toml", "r2.toml", false)] {
        let _ = std::fs::remove_dir_all(dir.join("ck"));
        let straight = run(&["--config", from]);
        let mut resumed = run(&[
            "--config",
            from,
            "--checkpoint-dir",
            "ck",
            "--stop-after",
            "10",
        ]);
        let mut rest = vec!["--config", to, "--resume", "ck"];
        if processes {
            rest.extend(["--nproc", "4"]);
        }
        resumed.extend(run(&rest));
        let worst = worst(&straight, &resumed);
        eprintln!("{from} resumed at {to}: worst relative loss difference {worst:.2e}");
        assert!(worst < 1e-5, "{from} -> {to}: {worst}");
    }
    // A global batch that changes is refused, naming it.
    let _ = std::fs::remove_dir_all(dir.join("ck"));
    run(&[
        "--config",
        "r2.toml",
        "--checkpoint-dir",
        "ck",
        "--stop-after",
        "2",
    ]);
    let out = strata(dir)
        .args([
            "train",
            "--config",
            "r2.toml",
            "--resume",
            "ck",
            "--micro-batch",
            "2",
        ])
        .output()
        .unwrap();
    let said = text(&out);
    assert!(!out.status.success(), "{said}");
    assert!(
        said.contains("the global batch")
            && said.contains("2 x 4 x 1 = 8")
            && said.contains("2 x 2 x 1 = 4"),
        "{said}"
    );
}

#[test]
fn hybrid_sharding_trains_as_full_sharding_and_processes_as_threads() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let dir = dir.path();
    config(dir, 2, 20, 100);
    // Four ranks of two sequences; states sharded over pairs of them.
    let four = std::fs::read_to_string(dir.join("r2.toml"))
        .unwrap()
        .replace("ranks = 2", "ranks = 4")
        .replace("micro_batch = 4", "micro_batch = 2");
    std::fs::write(dir.join("full.toml"), &four).unwrap();
    std::fs::write(
        dir.join("hybrid.toml"),
        four.clone() + "\n[parallel]\nshard_degree = 2\n",
    )
    .unwrap();
    std::fs::write(
        dir.join("bad.toml"),
        four + "\n[parallel]\nshard_degree = 3\n",
    )
    .unwrap();
    let run = |args: &[&str]| {
        losses(
            &strata(dir)
                .args(["train", "--json"])
                .args(args)
                .output()
                .unwrap(),
        )
    };
    let full = run(&["--config", "full.toml"]);
    let hybrid = run(&["--config", "hybrid.toml"]);
    // The gradients are summed in pairs, then across the pairs: another
    // order than every rank in turn, so close rather than equal.
    let apart = worst(&full, &hybrid);
    eprintln!("shard_degree = 2 against full sharding, 4 ranks, 20 steps: {apart:.2e}");
    assert!(apart < 1e-5, "{apart}");
    assert_ne!(full, hybrid, "the sums' order differs, so some bits do");
    // As processes: the threads' bits.
    assert_eq!(run(&["--config", "hybrid.toml", "--nproc", "4"]), hybrid);
    // Checkpointed at 10 and resumed: the same bits; resumed fully sharded
    // (4 shards from 2): close.
    let mut resumed = run(&[
        "--config",
        "hybrid.toml",
        "--checkpoint-dir",
        "ck",
        "--stop-after",
        "10",
    ]);
    assert!(
        dir.join("ck/step-00000010/optimizer-rank1.safetensors")
            .exists()
    );
    assert!(
        !dir.join("ck/step-00000010/optimizer-rank2.safetensors")
            .exists()
    );
    let halves = resumed.clone();
    resumed.extend(run(&["--resume", "ck", "--checkpoint-dir", "ck2"]));
    assert_eq!(resumed, hybrid);
    let mut unsharded = halves;
    unsharded.extend(run(&[
        "--config",
        "full.toml",
        "--resume",
        "ck",
        "--checkpoint-dir",
        "ck3",
    ]));
    assert!(worst(&unsharded, &hybrid) < 1e-5);
    // A degree that does not divide the ranks is refused by name.
    let out = strata(dir)
        .args(["train", "--config", "bad.toml"])
        .output()
        .unwrap();
    let said = text(&out);
    assert!(
        !out.status.success()
            && said.contains("parallel.shard_degree")
            && said.contains("train.ranks = 4"),
        "{said}"
    );
}

/// A process's `Cpus_allowed_list`.
fn cpus_of(pid: u32) -> String {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .unwrap()
        .trim()
        .to_string()
}

#[test]
fn each_local_rank_is_bound_to_its_own_cores() {
    let cores = strata_optim::topology::CpuTopology::detect().core_count();
    if cores < 2 {
        eprintln!("skipped: {cores} core(s), no two shares to give");
        return;
    }
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let dir = dir.path();
    config(dir, 1, 100_000, 0);
    let child = strata(dir)
        .args(["train", "--nproc", "2", "--config", "r1.toml"])
        .env(TAG, "bind")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let ranks = ranks_of(2, "bind");
    // Bound before the engine starts: wait for the first step's line.
    let started = Instant::now();
    let shares = loop {
        let shares: Vec<String> = ranks.iter().map(|&(_, pid)| cpus_of(pid)).collect();
        if shares[0] != shares[1] || started.elapsed() > Duration::from_secs(30) {
            break shares;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(143), "{}", text(&out));
    assert_ne!(shares[0], shares[1], "two local ranks on the same CPUs");
    let parse = |list: &str| -> Vec<usize> {
        list.split(',')
            .flat_map(|part| match part.split_once('-') {
                Some((a, b)) => (a.parse().unwrap()..=b.parse().unwrap()).collect::<Vec<_>>(),
                None => vec![part.parse().unwrap()],
            })
            .collect()
    };
    let (a, b) = (parse(&shares[0]), parse(&shares[1]));
    assert!(a.iter().all(|cpu| !b.contains(cpu)), "{shares:?}");
}

#[test]
fn srun_ranks_train_the_bits_of_threads() {
    // What srun gives each task (no Slurm here): its rank, the job's
    // tasks, the node's, the node list and the job and step ids.
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let dir = dir.path();
    config(dir, 2, 6, 100);
    let threads = losses(
        &strata(dir)
            .args(["train", "--config", "r2.toml", "--json"])
            .output()
            .unwrap(),
    );
    let job = std::process::id().to_string();
    let tasks: Vec<_> = (0..2)
        .map(|rank| {
            strata(dir)
                .args(["train", "--config", "r2.toml", "--json"])
                .env("SLURM_PROCID", rank.to_string())
                .env("SLURM_NTASKS", "2")
                .env("SLURM_LOCALID", rank.to_string())
                .env("SLURM_NTASKS_PER_NODE", "2")
                .env("SLURM_STEP_NODELIST", "localhost")
                .env("SLURM_JOB_ID", &job)
                .env("SLURM_STEP_ID", "0")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let outs: Vec<_> = tasks
        .into_iter()
        .map(|t| t.wait_with_output().unwrap())
        .collect();
    assert!(outs[1].status.success(), "{}", text(&outs[1]));
    assert_eq!(losses(&outs[0]), threads, "srun's two tasks");
}

#[test]
fn torchrun_ranks_train_the_bits_of_threads() {
    let found = Command::new("torchrun").arg("--help").output();
    if !found.is_ok_and(|out| out.status.success()) {
        if std::env::var_os("STRATA_REQUIRE_TORCHRUN").is_some_and(|v| v == "1") {
            panic!("STRATA_REQUIRE_TORCHRUN=1 and no torchrun on PATH (pip install torch)");
        }
        eprintln!("skipped: no torchrun on PATH (pip install torch)");
        return;
    }
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let dir = dir.path();
    config(dir, 2, 6, 100);
    let threads = losses(
        &strata(dir)
            .args(["train", "--config", "r2.toml", "--json"])
            .output()
            .unwrap(),
    );
    // Through torchrun's agent store, as torchrun runs by default.
    let out = Command::new("torchrun")
        .args(["--standalone", "--nproc-per-node", "2", "--no-python"])
        .arg(env!("CARGO_BIN_EXE_strata"))
        .args(["train", "--config", "r2.toml", "--json"])
        .env("STRATA_LOG", "warn")
        .current_dir(dir)
        .output()
        .unwrap();
    assert_eq!(losses(&out), threads, "torchrun's two processes");
}
