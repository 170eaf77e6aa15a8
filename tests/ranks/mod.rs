//! What the tests of ranks as processes share (`tests/nproc.rs`,
//! `tests/mpi.rs`): the two-rank example's config, the binary, a run's
//! output and losses, and the launched ranks by pid.

// Each test file uses its own part of these.
#![allow(dead_code)]

use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

/// The variable a test sets on the ranks it launches, to find them.
pub const TAG: &str = "STRATA_RANKS_TEST_TAG";

/// The two-rank example's model and placement, `ranks` ranks, `steps`
/// steps, a checkpoint every `every`, collectives given up after 3 s.
pub fn config(dir: &Path, ranks: usize, steps: u64, every: u64) {
    let text = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/configs/zero3-2rank.toml"),
    )
    .unwrap()
    .replace("ranks = 2", &format!("ranks = {ranks}"))
    .replace(
        "steps = 20",
        &format!("steps = {steps}\ncheckpoint_every = {every}"),
    ) + "\n[comm]\ntimeout_s = 3\n";
    std::fs::write(dir.join(format!("r{ranks}.toml")), text).unwrap();
}

pub fn strata(dir: &Path) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_strata"));
    command.env("STRATA_LOG", "warn").current_dir(dir);
    command
}

pub fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// The summary (the last JSON line of rank 0's output).
pub fn summary(out: &Output) -> serde_json::Value {
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout
        .lines()
        .rev()
        .find(|l| l.starts_with('{'))
        .unwrap_or_else(|| panic!("no summary: {}", text(out)));
    serde_json::from_str(line).unwrap()
}

/// The summary's losses, of a run that succeeded.
pub fn losses(out: &Output) -> Vec<f64> {
    assert!(out.status.success(), "{}", text(out));
    summary(out)["losses"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect()
}

/// The launched ranks (processes whose environment has [`TAG`] = `tag`
/// and the rank in `rank_var`), by rank, once all `processes` are up.
pub fn ranks_of(processes: usize, tag: &str, rank_var: &str) -> Vec<(usize, u32)> {
    let started = Instant::now();
    loop {
        let mut found = Vec::new();
        for entry in std::fs::read_dir("/proc").unwrap().flatten() {
            let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
                continue;
            };
            let Ok(environ) = std::fs::read(entry.path().join("environ")) else {
                continue;
            };
            let vars: Vec<&[u8]> = environ.split(|&b| b == 0).collect();
            let has = |prefix: &str| vars.iter().find_map(|v| v.strip_prefix(prefix.as_bytes()));
            if has(&format!("{TAG}={tag}")).is_none() {
                continue;
            }
            if let Some(rank) = has(&format!("{rank_var}=")) {
                let rank = String::from_utf8_lossy(rank).parse().unwrap();
                found.push((rank, pid));
            }
        }
        if found.len() == processes {
            found.sort();
            return found;
        }
        assert!(started.elapsed() < Duration::from_secs(60), "{found:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Waits until the checkpoint directory `ck` publishes a step.
pub fn wait_for_checkpoint(dir: &Path) {
    let started = Instant::now();
    while !dir.join("ck/latest").exists() {
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "no checkpoint"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Asserts that the losses of a run stopped after step `step` (its
/// summary `stopped`) and then resumed (`after`) are those of four threads
/// run straight to the same step, bit for bit.
pub fn stopped_and_resumed_match_four_threads(
    dir: &Path,
    stopped: &serde_json::Value,
    after: Vec<f64>,
    step: u64,
) {
    config(dir, 4, 100_000, 2);
    let straight = losses(
        &strata(dir)
            .args([
                "train",
                "--config",
                "r4.toml",
                "--stop-after",
                &step.to_string(),
                "--json",
            ])
            .output()
            .unwrap(),
    );
    let before: Vec<f64> = stopped["losses"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect();
    assert_eq!([before, after].concat(), straight);
}
