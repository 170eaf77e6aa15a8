//! The `strata` binary end to end, every bench in a tiny mode.

use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// The binary with warnings-only logs.
fn strata_command() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_strata"));
    command.env("STRATA_LOG", "warn");
    command
}

fn strata(args: &[&str]) -> Output {
    strata_command().args(args).output().expect("strata runs")
}

fn tempdir() -> tempfile::TempDir {
    // Under target/, on the real disk: /tmp may be tmpfs, which the bench refuses.
    tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap()
}

/// Stdout of a run that must succeed (the failure shows both streams).
fn stdout_text(output: &Output) -> String {
    let text = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "strata failed: {text}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    text
}

/// Stderr of a run that must fail.
fn stderr_of_failure(output: &Output, what: impl std::fmt::Debug) -> String {
    assert!(!output.status.success(), "{what:?} succeeded");
    String::from_utf8_lossy(&output.stderr).into_owned()
}

fn stdout_json(output: &Output) -> serde_json::Value {
    serde_json::from_str(&stdout_text(output)).expect("stdout is one JSON object")
}

#[test]
fn bench_nvme_json_contract_tiny() {
    let dir = tempdir();
    let d = dir.path().to_str().unwrap();
    let output = strata(&[
        "bench",
        "nvme",
        "--dir",
        d,
        "--size",
        "8MiB",
        "--block-size",
        "1MiB",
        "--queue-depth",
        "4",
        "--rw",
        "both",
        "--engine",
        "all",
        "--json",
    ]);
    let report = stdout_json(&output);
    let results = report["results"].as_array().unwrap();
    let engines = if strata_storage::probe_uring().is_ok() {
        2
    } else {
        1
    };
    assert_eq!(results.len(), 2 * engines);
    for row in results {
        assert!(["read", "write"].contains(&row["rw"].as_str().unwrap()));
        assert_eq!(row["block_size"], 1 << 20);
        assert_eq!(row["queue_depth"], 4);
        assert!(row["bw_bytes"].as_f64().unwrap() > 0.0);
        assert!(row["iops"].as_f64().unwrap() > 0.0);
        assert!(row["lat_ns"]["p99"].as_u64().unwrap() >= row["lat_ns"]["p50"].as_u64().unwrap());
    }
    assert!(report["best"]["read_bw_bytes"].as_f64().unwrap() > 0.0);
    assert!(report["best"]["write_bw_bytes"].as_f64().unwrap() > 0.0);
    assert!(
        !dir.path().join("strata-bench.dat").exists(),
        "test file left behind"
    );
}

#[test]
fn bench_nvme_table_recommendation_and_chart_tiny() {
    let dir = tempdir();
    let d = dir.path().to_str().unwrap();
    let chart = dir.path().join("sweep.svg");
    let output = strata(&[
        "bench",
        "nvme",
        "--dir",
        d,
        "--size",
        "4MiB",
        "--block-size",
        "128KiB,1MiB",
        "--queue-depth",
        "1,4",
        "--engine",
        "threads",
        "--plot",
        chart.to_str().unwrap(),
    ]);
    let text = stdout_text(&output);
    assert!(
        text.contains("[nvme]") && text.contains("engine = \"threads\""),
        "{text}"
    );
    // The snippet is a table `strata train` reads as it is.
    let snippet: String = text[text.find("[nvme]").unwrap()..]
        .lines()
        .take_while(|l| !l.trim().is_empty() && !l.starts_with("chart:"))
        .map(|l| format!("{l}\n"))
        .collect();
    let config = strata::train::TrainConfig::from_toml(&snippet)
        .unwrap_or_else(|err| panic!("{err}: {snippet}"));
    assert_eq!(config.nvme.unwrap().dirs, [dir.path()]);
    let svg = std::fs::read_to_string(&chart).unwrap();
    assert!(
        svg.starts_with("<svg") && svg.contains("GB/s"),
        "not a chart"
    );
}

#[test]
fn bench_nvme_bad_input_gets_one_line_naming_the_fix() {
    let dir = tempdir();
    let d = dir.path().to_str().unwrap();
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["--dir", "/no/such/strata/dir"], "does not exist"),
        (
            vec!["--dir", d, "--size", "1000000", "--block-size", "4096"],
            "multiple",
        ),
        (
            vec![
                "--dir",
                d,
                "--size",
                "1MiB",
                "--block-size",
                "1MiB",
                "--queue-depth",
                "0",
            ],
            "out of range",
        ),
        (
            vec!["--dir", d, "--size", "1000TiB", "--block-size", "1MiB"],
            "free",
        ),
        (
            vec![
                "--dir",
                d,
                "--size",
                "4MiB",
                "--block-size",
                "1MiB",
                "--plot",
                "x.png",
            ],
            ".svg",
        ),
        (
            vec!["--dir", d, "--size", "4MiB", "--block-size", "0"],
            "--block-size 0B: a block must be positive",
        ),
    ];
    for (args, expected) in cases {
        let mut full = vec!["bench", "nvme"];
        full.extend(&args);
        let output = strata(&full);
        let stderr = stderr_of_failure(&output, &args);
        let last = stderr.trim_end().lines().last().unwrap_or_default();
        assert!(
            last.starts_with("error: ") && last.contains(expected),
            "{args:?}: {stderr}"
        );
    }
    if strata_storage::sys::is_memory_filesystem(std::path::Path::new("/dev/shm")).unwrap_or(false)
    {
        let output = strata(&[
            "bench",
            "nvme",
            "--dir",
            "/dev/shm",
            "--size",
            "1MiB",
            "--block-size",
            "1MiB",
        ]);
        assert!(String::from_utf8_lossy(&output.stderr).contains("memory speed"));
    } else {
        println!("skipped: tmpfs refusal (/dev/shm is not tmpfs here)");
    }
}

#[test]
fn bench_swap_tiny() {
    let dir = tempdir();
    let output = strata(&[
        "bench",
        "swap",
        "--dir",
        dir.path().to_str().unwrap(),
        "--size",
        "8MiB",
        "--block-size",
        "1MiB",
        "--queue-depth",
        "4",
        "--rounds",
        "1",
        "--json",
    ]);
    let report = stdout_json(&output);
    for key in [
        "write_ratio",
        "read_ratio",
        "raw_read_bw_bytes",
        "store_read_bw_bytes",
    ] {
        assert!(report[key].as_f64().unwrap() > 0.0, "{key}: {report}");
    }
}

#[test]
fn fio_comparison_script_tiny() {
    if Command::new("fio").arg("--version").output().is_err() {
        println!("skipped: benches/nvme_vs_fio.sh (fio is not installed; .ci/run installs it)");
        return;
    }
    let dir = tempdir();
    let output = Command::new("bash")
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/benches/nvme_vs_fio.sh"
        ))
        .arg(dir.path())
        .env("STRATA", env!("CARGO_BIN_EXE_strata"))
        .env("SIZE", (8u64 << 20).to_string())
        .env("ROUNDS", "1")
        .output()
        .unwrap();
    let text = stdout_text(&output);
    assert_eq!(
        text.lines()
            .filter(|l| l.starts_with("1048576") || l.starts_with("131072"))
            .count(),
        4,
        "{text}"
    );
}

#[test]
fn bench_tiers_json_contract_tiny() {
    let dir = tempdir();
    let dir_arg = dir.path().to_str().unwrap();
    let args = [
        "bench", "tiers", "--dir", dir_arg, "--size", "20MiB", "--device", "cpu", "--rounds", "1",
    ];
    let output = strata(&[&args[..], &["--json"]].concat());
    let report = stdout_json(&output);
    let paths: Vec<&str> = report["results"]
        .as_array()
        .unwrap()
        .iter()
        .map(|row| {
            for key in ["bytes_per_s", "raw_bytes_per_s", "ratio"] {
                assert!(row[key].as_f64().unwrap() > 0.0, "{key}: {row}");
            }
            row["path"].as_str().unwrap()
        })
        .collect();
    assert_eq!(
        paths,
        ["host->nvme", "nvme->host", "host->device", "device->host"]
    );
    let table = strata(&args);
    assert!(table.status.success());
    assert!(String::from_utf8_lossy(&table.stdout).contains("device->host"));
}

#[test]
fn bench_tiers_bad_input_names_the_fix() {
    let dir = tempdir();
    let d = dir.path().to_str().unwrap();
    let cases: [(&[&str], &str); 5] = [
        (
            &["--dir", "/nonexistent/strata", "--size", "8MiB"],
            "does not exist",
        ),
        (&["--dir", d, "--size", "64TiB"], "lower --size"),
        (&["--dir", d, "--size", "0"], "--size 0B: use a positive"),
        (&["--dir", d, "--size", "4097"], "multiple of 4 KiB"),
        (
            &["--dir", d, "--size", "8MiB", "--device", "tpu"],
            "use auto, cpu or cuda",
        ),
    ];
    for (args, expected) in cases {
        let mut full = vec!["bench", "tiers"];
        full.extend_from_slice(args);
        let output = strata(&full);
        let stderr = stderr_of_failure(&output, args);
        assert!(stderr.contains(expected), "{args:?}: {stderr}");
    }
}

#[test]
fn low_memlock_limit_warns_once_and_still_measures() {
    // Root ignores RLIMIT_MEMLOCK through CAP_IPC_LOCK, so drop it first.
    let probe = Command::new("setpriv")
        .args([
            "--bounding-set",
            "-ipc_lock",
            "--",
            "prlimit",
            "--memlock=65536:65536",
            "true",
        ])
        .output();
    if !probe.map(|o| o.status.success()).unwrap_or(false) {
        println!("skipped: low-memlock run (setpriv/prlimit cannot drop CAP_IPC_LOCK here)");
        return;
    }
    let dir = tempdir();
    let output = Command::new("setpriv")
        .args([
            "--bounding-set",
            "-ipc_lock",
            "--",
            "prlimit",
            "--memlock=65536:65536",
            env!("CARGO_BIN_EXE_strata"),
        ])
        .args([
            "bench",
            "nvme",
            "--dir",
            dir.path().to_str().unwrap(),
            "--size",
            "8MiB",
            "--block-size",
            "1MiB",
        ])
        .args(["--queue-depth", "4", "--rw", "both", "--json"])
        .env("STRATA_LOG", "info")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    let report = stdout_json(&output);
    assert_eq!(report["results"].as_array().unwrap().len() % 2, 0);
    assert_eq!(stderr.matches("could not page-lock").count(), 1, "{stderr}");
    assert!(
        stderr.contains("RLIMIT_MEMLOCK is 64KiB") && stderr.contains("ulimit -l"),
        "{stderr}"
    );
}

#[test]
fn bench_adam_json_contract_tiny() {
    let output = strata(&[
        "bench",
        "adam",
        "--params",
        "4096,70000",
        "--threads",
        "1,all",
        "--rounds",
        "2",
        "--round-ms",
        "0",
        "--json",
    ]);
    let report = stdout_json(&output);
    let results = report["results"].as_array().unwrap();
    for kernel in [
        "adamw_fp32",
        "offload_step_bf16",
        "roofline_4r3w",
        "lion_fp32",
        "grad_norm_bf16",
    ] {
        let rows: Vec<_> = results.iter().filter(|r| r["kernel"] == kernel).collect();
        assert!(rows.len() >= 2, "{kernel}: {report}");
        for row in rows {
            assert!(
                [4096, 70000].contains(&row["params"].as_u64().unwrap()),
                "{row}"
            );
            assert!(row["threads"].as_u64().unwrap() >= 1);
            let params_per_s = row["params_per_s"].as_f64().unwrap();
            assert!(
                params_per_s > 0.0 && row["bytes_per_s"].as_f64().unwrap() > params_per_s,
                "{row}"
            );
            assert!(row["roofline_fraction"].as_f64().unwrap() > 0.0, "{row}");
        }
    }
}

#[test]
fn bench_adam_table_every_isa_and_chart_tiny() {
    let dir = tempdir();
    let chart = dir.path().join("adam.svg");
    let output = strata(&[
        "bench",
        "adam",
        "--params",
        "1K,3000",
        "--threads",
        "2",
        "--isa",
        "all",
        "--kernels",
        "adamw_fp32,offload_step_fp16,roofline_4r3w",
        "--rounds",
        "1",
        "--round-ms",
        "0",
        "--plot",
        chart.to_str().unwrap(),
    ]);
    let text = stdout_text(&output);
    assert!(
        text.contains("of roofline")
            && text.contains("portable")
            && text.contains("offload_step_fp16"),
        "{text}"
    );
    assert!(std::fs::read_to_string(&chart).unwrap().contains("<svg"));
}

#[test]
fn bench_adam_bad_input_gets_one_line_naming_the_fix() {
    for (args, expected) in [
        (vec!["--params", "lots"], "--params"),
        (vec!["--params", "16G"], "lower --params"),
        (vec!["--kernels", "adam"], "adamw_fp32"),
        (vec!["--isa", "sse9"], "avx512bf16"),
        (vec!["--threads", "0"], "--threads"),
        (vec!["--rounds", "0"], "--rounds"),
        (
            vec![
                "--params",
                "1K",
                "--round-ms",
                "0",
                "--rounds",
                "1",
                "--plot",
                "x.png",
            ],
            ".svg",
        ),
    ] {
        let mut full = vec!["bench", "adam"];
        full.extend(&args);
        let output = strata(&full);
        let stderr = stderr_of_failure(&output, &args);
        assert!(stderr.contains(expected), "{args:?}: {stderr}");
    }
    // A bad STRATA_ISA is named and ignored, not fatal.
    let output = strata_command()
        .args([
            "bench",
            "adam",
            "--params",
            "1K",
            "--rounds",
            "1",
            "--round-ms",
            "0",
            "--kernels",
            "adamw_fp32",
        ])
        .env("STRATA_ISA", "sse9")
        .output()
        .unwrap();
    stdout_text(&output);
    assert!(String::from_utf8_lossy(&output.stderr).contains("STRATA_ISA ignored"));
}

#[test]
fn deepspeed_comparison_script_tiny() {
    // The peers need torch and deepspeed, which CI does not install
    // (gigabytes): without them the sweep runs strata's kernels alone
    // (`--peers none`); point STRATA_COMPARE_PYTHON at an interpreter that
    // has them to run the peers too.
    let python = std::env::var("STRATA_COMPARE_PYTHON").unwrap_or_else(|_| "python3".into());
    let probe = Command::new(&python)
        .args(["-c", "import torch, deepspeed"])
        .output();
    let peers = probe.is_ok_and(|p| p.status.success());
    if !peers {
        println!("peers skipped: {python} lacks torch or deepspeed; strata's sweep runs alone");
    }
    let mut path = std::path::PathBuf::from(&python);
    path.pop();
    let search_path = format!(
        "{}:{}",
        path.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let dir = tempfile::tempdir().unwrap();
    let chart = dir.path().join("threads.svg");
    let output = Command::new(&python)
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/benches/adam_vs_deepspeed.py"
        ))
        .args(["--strata", env!("CARGO_BIN_EXE_strata")])
        .args(["--params", "65536", "--rounds", "1", "--reps", "1"])
        .args(["--threads", "1,2", "--idle", "--json", "--plot"])
        .arg(&chart)
        .args(["--peers", if peers { "torch,deepspeed" } else { "none" }])
        .env("PATH", search_path)
        .output()
        .unwrap();
    let text = stdout_text(&output);
    let report: serde_json::Value = serde_json::from_str(text.lines().last().unwrap()).unwrap();
    let mut keys = vec![
        "adamw_vs_roofline@2",
        "bf16_moments_vs_fp32_states@1",
        "bf16_master_vs_fp32_states@2",
    ];
    let mut idle_keys = vec!["idle_adamw_vs_ordinary@1", "idle_adamw_vs_ordinary@2"];
    if peers {
        keys.push("adamw_vs_best_peer@2");
        idle_keys.push("idle_adamw_vs_best_peer@2");
    }
    for key in keys {
        assert!(
            report["ratios"][key].as_f64().unwrap() > 0.0,
            "{key}: {report}"
        );
    }
    for key in idle_keys {
        assert!(
            report["idle_ratios"][key].as_f64().unwrap() > 0.0,
            "{key}: {report}"
        );
    }
    for threads in ["1", "2"] {
        let rates = &report["params_per_s_median"][threads];
        let per_thread = &report["gb_per_s_per_thread"][threads];
        assert!(
            rates["strata_engine_step_bf16"].as_f64().unwrap() > 0.0,
            "{report}"
        );
        assert!(
            per_thread["strata_adamw_fp32"].as_f64().unwrap() > 0.0,
            "{report}"
        );
    }
    // The distance strata's kernels prefetched, as `bench adam` reports it.
    assert_eq!(
        report["strata_prefetch_elems"].as_u64(),
        Some(strata::optim::prefetch_elems() as u64),
        "{report}"
    );
    let svg = std::fs::read_to_string(&chart).unwrap();
    assert!(
        svg.starts_with("<svg") && svg.matches("<polyline").count() >= 6,
        "{svg}"
    );
    // A bad thread list is refused before anything runs.
    let output = Command::new(&python)
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/benches/adam_vs_deepspeed.py"
        ))
        .args(["--peers", "none", "--threads", "0,2"])
        .output()
        .unwrap();
    assert!(!output.status.success());
    assert!(String::from_utf8_lossy(&output.stderr).contains("--threads"));
    // More threads than the bench may use, and a sweep larger than the
    // memory: refused before anything runs, naming what fits.
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/benches/adam_vs_deepspeed.py");
    for (args, says) in [
        (["--threads", "1,100000"], "CPUs (its affinity), so at most"),
        (
            ["--params", "1000000000000"],
            "of memory is available; use --params",
        ),
    ] {
        let output = Command::new(&python)
            .arg(script)
            .args(["--strata", env!("CARGO_BIN_EXE_strata"), "--peers", "none"])
            .args(args)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success() && err.contains(says), "{err}");
    }
}

/// The peers' worker process ends with the bench, even one killed with
/// SIGKILL mid-sweep (a regression test: workers of a bench that died
/// used to keep their tensors and run on).
#[test]
fn deepspeed_comparison_leaves_no_worker_behind() {
    let probe = Command::new("python3")
        .args(["-c", "import torch"])
        .output();
    if !probe.is_ok_and(|p| p.status.success()) {
        println!("skipped: python3 lacks torch, which the peer worker runs");
        return;
    }
    let mut bench = Command::new("python3")
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/benches/adam_vs_deepspeed.py"
        ))
        .args(["--strata", env!("CARGO_BIN_EXE_strata"), "--peers", "torch"])
        .args(["--threads", "1", "--params", "4096", "--rounds", "100000"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let parent = format!("--parent\0{}\0", bench.id());
    let workers = || -> Vec<u32> {
        std::fs::read_dir("/proc")
            .unwrap()
            .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<u32>().ok())
            .filter(|pid| {
                std::fs::read(format!("/proc/{pid}/cmdline"))
                    .is_ok_and(|cmd| String::from_utf8_lossy(&cmd).contains(&parent))
            })
            .collect()
    };
    let deadline = Instant::now() + Duration::from_secs(120);
    while workers().is_empty() {
        assert!(Instant::now() < deadline, "no peer worker started");
        std::thread::sleep(Duration::from_millis(50));
    }
    bench.kill().unwrap();
    bench.wait().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    // A worker started between the scan and the kill dies the same way.
    while !workers().is_empty() {
        assert!(
            Instant::now() < deadline,
            "workers {:?} outlived the bench",
            workers()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn bench_adam_reports_the_prefetch_distance_and_names_a_bad_one() {
    let run = |value: &str| {
        Command::new(env!("CARGO_BIN_EXE_strata"))
            .args(["bench", "adam", "--params", "64K", "--threads", "1"])
            .args([
                "--rounds",
                "1",
                "--round-ms",
                "1",
                "--kernels",
                "adamw_fp32",
                "--json",
            ])
            .env("STRATA_PREFETCH_ELEMS", value)
            .output()
            .unwrap()
    };
    let distance = |output: &Output| {
        let text = stdout_text(output);
        let report: serde_json::Value = serde_json::from_str(text.lines().last().unwrap()).unwrap();
        report["prefetch_elems"].as_u64().unwrap()
    };
    // Only x86_64 prefetches; elsewhere the distance is 0 whatever is asked.
    let x86 = cfg!(target_arch = "x86_64");
    assert_eq!(distance(&run("0")), 0);
    assert_eq!(distance(&run("2048")), if x86 { 2048 } else { 0 });
    let bad = run("4k");
    assert_eq!(distance(&bad), if x86 { 1024 } else { 0 });
    if x86 {
        let stderr = String::from_utf8_lossy(&bad.stderr);
        assert!(
            stderr.contains("STRATA_PREFETCH_ELEMS=\"4k\"") && stderr.contains("65536"),
            "{stderr}"
        );
    }
}

#[test]
fn optimizer_lane_script_tiny() {
    let output = Command::new("python3")
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/benches/optimizer-lane.py"
        ))
        .args(["--strata", env!("CARGO_BIN_EXE_strata")])
        .args(["--steps", "4", "--rounds", "1", "--threads", "1", "--json"])
        .output()
        .unwrap();
    let text = stdout_text(&output);
    let report: serde_json::Value = serde_json::from_str(text.lines().last().unwrap()).unwrap();
    let row = &report["threads"]["1"];
    for key in ["bench_params_per_s", "lane_params_per_s"] {
        assert!(row[key].as_f64().unwrap() > 1e6, "{key}: {report}");
    }
    assert_eq!(report["group_params"], 12 * 512 * 512 + 13 * 512);
}

#[test]
fn gpu_machine_check_script_tiny() {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/benches/gpu-machine-check.sh");
    let dir = tempfile::tempdir().unwrap();
    let output = Command::new("bash")
        .arg(script)
        .env("TINY", "1")
        .env("OUT", dir.path())
        .env("STRATA", env!("CARGO_BIN_EXE_strata"))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let read = |name: &str| std::fs::read_to_string(dir.path().join(name)).unwrap();
    assert!(read("env.txt").contains("CPU(s)"));
    assert!(
        read("bars.txt").contains("adamw_vs_roofline@2"),
        "{}",
        read("bars.txt")
    );
    assert!(read("chart.svg").contains("<svg"));
    assert!(
        read("lane.txt").contains("bar 0.9x"),
        "{}",
        read("lane.txt")
    );
    assert!(read("pool.txt").contains("pinned host pool committed"));
    assert!(
        read("tiers.txt").contains("host->device"),
        "{}",
        read("tiers.txt")
    );
    assert!(
        read("kernels.txt").contains("attention_backward"),
        "{}",
        read("kernels.txt")
    );
    // strata's two peers train on the CPU device: each has a row of the
    // table with its seconds per step, and none failed.
    let train = read("train.txt");
    for peer in ["strata-offload", "strata-resident"] {
        let row = train.lines().find(|l| l.starts_with(&format!("{peer} ")));
        let seconds = row.and_then(|l| l.split_whitespace().nth(1));
        assert!(
            seconds.is_some_and(|s| s.parse::<f64>().is_ok_and(|s| s > 0.0)),
            "{peer}: {train}"
        );
    }
    assert!(!train.contains("failed:"), "{train}");
    // A part it does not know, and a binary that is not there, are named.
    let unknown = Command::new("bash")
        .args([script, "fast"])
        .env("OUT", dir.path())
        .env("STRATA", env!("CARGO_BIN_EXE_strata"))
        .output()
        .unwrap();
    assert_eq!(unknown.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&unknown.stderr).contains("unknown part 'fast'"));
    let missing = Command::new("bash")
        .arg(script)
        .env("OUT", dir.path())
        .env("STRATA", dir.path().join("no-such-strata"))
        .output()
        .unwrap();
    assert_eq!(missing.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&missing.stderr).contains("no strata binary"));
}

#[test]
fn state_dtype_loss_script_tiny() {
    let output = Command::new("python3")
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/benches/state-dtype-loss.py"
        ))
        .args(["--strata", env!("CARGO_BIN_EXE_strata")])
        .args(["--steps", "3", "--seeds", "1", "--null", "bf16-moments"])
        .arg("--json")
        .output()
        .unwrap();
    let text = stdout_text(&output);
    let report: serde_json::Value = serde_json::from_str(text.lines().last().unwrap()).unwrap();
    for dtype in [
        "fp32@1",
        "bf16-moments@1",
        "bf16@1",
        "bf16-moments/reseeded@1",
    ] {
        let loss = report["final_loss"][dtype].as_f64().unwrap();
        assert!(loss.is_finite() && loss > 0.0, "{dtype}: {report}");
    }
    for dtype in ["bf16-moments", "bf16"] {
        assert!(
            report["against_fp32"][dtype]["gap_max"].as_f64().unwrap() < 0.05,
            "{report}"
        );
    }
    // The third step's loss already sees the other rounding.
    let floor = report["rounding_seed_only"]["bf16-moments"]["gap_max"]
        .as_f64()
        .unwrap();
    assert!(floor > 0.0 && floor < 0.05, "{report}");
}

/// `strata plan` of the issue's example (1T on one DGX-2, parameters and
/// optimizer states on NVMe) with `extra` options, as JSON.
fn plan_1t_on_nvme(extra: &[&str]) -> serde_json::Value {
    let mut args = vec![
        "plan",
        "--preset",
        "dgx2",
        "--nodes",
        "1",
        "--params",
        "1T",
        "--offload-param",
        "nvme",
        "--offload-optimizer",
        "nvme",
        "--json",
    ];
    args.extend_from_slice(extra);
    stdout_json(&strata(&args))
}

#[test]
fn plan_json_contract_on_the_issue_example() {
    let json = plan_1t_on_nvme(&["--policy", "strata"]);
    // The step's plan (linear layers tiled) fits; strata's engine, which
    // gathers a whole block in f32, does not: `plan` says what `train`
    // would, with the same count, and the step it simulated stays shown.
    let reason = json["reason"].as_str().unwrap_or_default();
    assert_eq!(json["fits"], false, "{json}");
    assert!(
        reason.contains("strata's engine cannot hold it")
            && reason.contains("the device tier needs at least 59.38 GiB (compute workspace")
            && reason.contains("raise --gpu-memory to at least 59.38 GiB"),
        "{reason}"
    );
    for key in [
        "device_bytes_per_gpu",
        "host_bytes_per_node",
        "nvme_bytes_per_node",
        "step_time_s",
        "tflops_per_gpu",
    ] {
        assert!(
            json[key].as_f64().is_some_and(|v| v > 0.0),
            "{key}: {}",
            json[key]
        );
    }
    assert!(json["device_bytes_per_gpu"].as_f64().unwrap() <= 32e9);
    assert_eq!(json["bottleneck"], "nvme");
    let baseline = plan_1t_on_nvme(&["--policy", "deepspeed"]);
    assert!(baseline["step_time_s"].as_f64().unwrap() >= json["step_time_s"].as_f64().unwrap());
    // The default recomputes every block; `auto` says how many it keeps.
    assert_eq!(json["activations"]["recomputed_layers"], 128, "{json}");
    let auto = plan_1t_on_nvme(&["--checkpoint", "auto"]);
    // NVMe-bound: host memory is worth more as the states' cache than for
    // activations, so the choice's simulated step loses to recomputing
    // every block, and that is what `auto` reports.
    assert_eq!(auto["activations"]["recomputed_layers"], 128, "{auto}");
    assert_eq!(auto["step_time_s"], json["step_time_s"]);
}

#[test]
fn plan_table_and_chart() {
    let dir = tempdir();
    let chart = dir.path().join("plan.svg");
    let output = strata(&[
        "plan",
        "--preset",
        "dgx-a100",
        "--params",
        "13B",
        "--compare",
        "--plot",
        chart.to_str().unwrap(),
    ]);
    let text = stdout_text(&output);
    for needle in [
        "fits:    yes",
        "bottleneck:",
        "model states",
        "DeepSpeed's estimate_zero3",
        "faster",
    ] {
        assert!(text.contains(needle), "no {needle:?} in\n{text}");
    }
    let svg = std::fs::read_to_string(&chart).unwrap();
    assert!(
        svg.contains("memory per tier") && svg.contains("busy share"),
        "chart lacks its panels"
    );
}

/// A 13B plan on one 24 GB GPU that does not fit says which tier runs
/// out, what fills it in GiB and a fix that applies: with its parameters
/// on the device, the engine's count (the one `strata train` refuses a
/// config with); on a host smaller than the plan's reserve, the host.
#[test]
fn plan_13b_on_a_24gb_gpu_names_the_tier_its_parts_and_a_fix() {
    let plan = |extra: &[&str]| {
        let mut args = vec![
            "plan",
            "--params",
            "13B",
            "--preset",
            "dgx-a100",
            "--gpus-per-node",
            "1",
            "--gpu-memory",
            "24GB",
            "--json",
        ];
        args.extend_from_slice(extra);
        let json = stdout_json(&strata(&args));
        assert_eq!(json["fits"], false, "{json}");
        json["reason"].as_str().unwrap().to_string()
    };
    let device = plan(&["--offload-param", "device"]);
    assert!(
        device.contains(
            "the device tier needs at least 50.38 GiB (16-bit parameters (two sets) 47.88 GiB"
        ) && device
            .contains("raise --gpu-memory to at least 50.38 GiB, or set --offload-param nvme"),
        "{device}"
    );
    let host = plan(&[
        "--host-memory",
        "64GB",
        "--offload-param",
        "nvme",
        "--offload-optimizer",
        "nvme",
    ]);
    assert!(
        host.contains(
            "the host has no room for the plan: its 59.60 GiB is within the 64.00 GiB kept"
        ) && host.contains("give the host more than 64.00 GiB"),
        "{host}"
    );
}

/// Sizes take units (`512GiB`, `4TB`); a plain number keeps the flags'
/// older unit (GB, or TB for a drive).
/// `strata plan --shard-degree`: hybrid sharding's groups in the table
/// and the JSON, its states per GPU the replicas' count times full
/// sharding's.
#[test]
fn plan_counts_hybrid_sharding() {
    let plan = |degree: &str, json: bool| {
        let mut args = vec!["plan", "--params", "13B", "--nodes", "2"];
        args.extend(["--shard-degree", degree]);
        if json {
            args.push("--json");
        }
        stdout_text(&strata(&args))
    };
    let table = plan("16", false);
    assert!(
        table.contains("dp 32 (sharded over 16, 2 replicas)"),
        "{table}"
    );
    let states = |degree| {
        let report: serde_json::Value = serde_json::from_str(&plan(degree, true)).unwrap();
        assert_eq!(
            report["parallelism"]["shard_degree"],
            degree.parse::<u32>().unwrap()
        );
        let parts = report["memory"].as_array().unwrap().clone();
        let part = parts.iter().find(|p| {
            p["name"]
                .as_str()
                .is_some_and(|n| n.starts_with("master weights"))
        });
        part.unwrap()["per_gpu_bytes"].as_f64().unwrap()
    };
    let ratio = states("16") / states("0");
    assert!((ratio - 2.0).abs() < 0.01, "states x{ratio}");
}

#[test]
fn plan_sizes_take_units() {
    let hardware = |extra: &[&str]| {
        let mut args = vec!["plan", "--params", "13B", "--json"];
        args.extend_from_slice(extra);
        stdout_json(&strata(&args))["hardware"].clone()
    };
    let with_units = hardware(&[
        "--host-memory",
        "512GiB",
        "--gpu-memory",
        "24GB",
        "--nvme-capacity",
        "4TB",
    ]);
    assert_eq!(with_units["host_memory_bytes"], 512u64 << 30);
    assert_eq!(with_units["gpu_memory_bytes"], 24_000_000_000u64);
    assert_eq!(with_units["nvme_bytes"], 4_000_000_000_000u64);
    let plain = hardware(&["--host-memory-gb", "512", "--nvme-capacity-tb", "4"]);
    assert_eq!(plain["host_memory_bytes"], 512_000_000_000u64);
    assert_eq!(plain["nvme_bytes"], 4_000_000_000_000u64);
}

/// `--arch NAME --params 70B` plans the shape and vocabulary that
/// architecture gives that size (a published one where it has one).
#[test]
fn plan_takes_each_architectures_shape_and_vocabulary() {
    for arch in strata::train::model::ARCHITECTURES {
        let shape = (arch.for_params)(70e9).unwrap();
        let json = stdout_json(&strata(&[
            "plan", "--arch", arch.name, "--params", "70B", "--json",
        ]));
        let model = &json["model"];
        assert_eq!(
            (
                &model["layers"],
                &model["hidden"],
                &model["heads"],
                &model["vocab"]
            ),
            (
                &shape.layers.into(),
                &shape.hidden.into(),
                &shape.heads.into(),
                &shape.vocab.into()
            ),
            "{}: {model}",
            arch.name
        );
    }
}

#[test]
fn plan_bad_options_are_named() {
    let cases: [(&[&str], &str); 14] = [
        (
            &["plan", "--params", "13B", "--shard-degree", "3"],
            "--shard-degree 3 does not divide the 16 data-parallel GPUs",
        ),
        (
            &["plan", "--params", "13B", "--host-memory", "512XB"],
            "unknown unit \"XB\" in size \"512XB\"",
        ),
        (
            &["plan", "--params", "13B", "--checkpoint", "sometimes"],
            "is not every (true), none (false) or auto",
        ),
        (
            &[
                "plan",
                "--params",
                "13B",
                "--checkpoint",
                "auto",
                "--no-checkpoint",
            ],
            "cannot be used with",
        ),
        (
            &["plan", "--params", "1T", "--layers", "10"],
            "--params picks the shape",
        ),
        (
            &["plan", "--layers", "10"],
            "all of --layers, --hidden and --heads",
        ),
        (&["plan"], "--params (e.g. 1T)"),
        (
            &["plan", "--params", "1T", "--preset", "dgx3"],
            "unknown preset",
        ),
        (
            &[
                "plan",
                "--params",
                "13B",
                "--offload-param",
                "nvme",
                "--zero-stage",
                "2",
            ],
            "--zero-stage 3",
        ),
        (
            &["plan", "--params", "13B", "--offload-param", "disk"],
            "invalid value 'disk'",
        ),
        (
            &["plan", "--arch", "nope", "--params", "13B"],
            "strata trains these architectures",
        ),
        // Bounded: the plan's time and memory grow with these.
        (&["plan", "--params", "1e30"], "50M to 1e15"),
        (
            &[
                "plan",
                "--layers",
                "100000000",
                "--hidden",
                "128",
                "--heads",
                "1",
            ],
            "--layers 100000000 is above the most strata plans, 4096",
        ),
        (
            &["plan", "--params", "13B", "--grad-accumulation", "1000"],
            "block passes per step, above the 8192 a plan holds",
        ),
    ];
    for (args, needle) in cases {
        let stderr = stderr_of_failure(&strata(args), args);
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
    }
    let unknown = strata(&["plan", "--params", "1T", "--offload-paramz", "nvme"]);
    assert!(stderr_of_failure(&unknown, "--offload-paramz").contains("--offload-param"));
}

fn strata_in(dir: &std::path::Path, args: &[&str]) -> Output {
    strata_command()
        .args(args)
        .current_dir(dir)
        .output()
        .expect("strata runs")
}

fn last_json_line(output: &Output) -> serde_json::Value {
    let text = stdout_text(output);
    serde_json::from_str(text.lines().last().expect("output")).expect("last line is JSON")
}

/// With two ranks the trace shows the collectives on a lane of their own
/// beside compute: each group's all-gather and reduce-scatter, with bytes;
/// a group is gathered once per pass whatever the micro-batches (a
/// regression test: it was gathered again for each).
#[test]
fn train_trace_shows_the_collectives_on_their_own_lane() {
    let dir = tempdir();
    let config = dir.path().join("two.toml");
    std::fs::write(&config, "[train]\nranks = 2\ngrad_accumulation = 3\n").unwrap();
    let args = ["train", "--config", "two.toml", "--steps", "2"];
    let output = strata_in(
        dir.path(),
        &[&args[..], &["--trace", "trace.json"]].concat(),
    );
    stdout_text(&output);
    let trace: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("trace.json")).unwrap()).unwrap();
    let events = trace["traceEvents"].as_array().unwrap();
    let lane = events
        .iter()
        .find(|e| e["ph"] == "M" && e["args"]["name"] == "collectives")
        .expect("a collectives lane")["tid"]
        .clone();
    let compute = events
        .iter()
        .find(|e| e["ph"] == "M" && e["args"]["name"] == "compute")
        .expect("a compute lane")["tid"]
        .clone();
    assert_ne!(lane, compute);
    for name in ["all-gather", "reduce-scatter"] {
        let spans: Vec<_> = events
            .iter()
            .filter(|e| e["ph"] == "X" && e["cat"] == "collective" && e["name"] == name)
            .collect();
        assert!(!spans.is_empty(), "no {name} in the trace");
        for span in &spans {
            assert_eq!(span["tid"], lane, "{span}");
            assert!(span["args"]["bytes"].as_u64().unwrap() > 0, "{span}");
        }
        // Two steps: each group gathered in each forward and backward
        // (the embeddings: their forward and the head's), reduced once.
        let per_group = if name == "all-gather" { 4 } else { 2 };
        for group in 0..5 {
            let count = spans.iter().filter(|s| s["args"]["group"] == group).count();
            assert_eq!(count, per_group, "{name} of group {group}");
        }
    }
}

#[test]
fn train_default_json_contract_tiny() {
    let dir = tempdir();
    let output = strata_in(
        dir.path(),
        &["train", "--steps", "4", "--json", "--trace", "trace.json"],
    );
    let summary = last_json_line(&output);
    // The trace shows compute (per block and micro-batch), the CPU
    // optimizer's updates on their own lane, and the transfers.
    let trace: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("trace.json")).unwrap()).unwrap();
    let spans: Vec<(String, String)> = trace["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["ph"] == "X")
        .map(|e| {
            (
                e["cat"].as_str().unwrap().into(),
                e["name"].as_str().unwrap().into(),
            )
        })
        .collect();
    for (category, name) in [
        ("compute", "block forward"),
        ("compute", "block backward"),
        ("transfer", "nvme->host"),
    ] {
        assert!(
            spans.iter().any(|(c, n)| c == category && n == name),
            "no {category} {name} in the trace"
        );
    }
    assert!(
        spans
            .iter()
            .any(|(c, n)| c == "compute" && n.ends_with("optimizer")),
        "no optimizer span in the trace"
    );
    for key in [
        "steps",
        "loss_first",
        "loss_last",
        "tokens_per_s",
        "model_state_bytes",
    ] {
        assert!(summary[key].is_number(), "{key} in {summary}");
    }
    for key in ["budget_bytes", "peak_bytes", "predicted_peak_bytes"] {
        for tier in ["device", "host", "nvme"] {
            assert!(summary[key][tier].is_u64(), "{key}.{tier} in {summary}");
        }
    }
    assert_eq!(summary["steps"], 4);
    assert!(
        summary["loss_last"].as_f64() < summary["loss_first"].as_f64(),
        "{summary}"
    );
    assert!(
        !dir.path().join("strata-train-swap").exists(),
        "the swap directory the run created is removed at its end"
    );
    let text = stdout_text(&output);
    assert!(text.contains("peak memory per tier"), "{text}");
    assert!(
        text.contains("moved per link (rank 0): host->device "),
        "{text}"
    );
    assert!(summary["moved_bytes"][1].as_u64() > Some(0), "{summary}");
}

/// Every step's record goes to metrics.jsonl beside the checkpoints; the
/// step line is short and printed every --log-every steps (and the first
/// and last).
#[test]
fn train_writes_every_step_to_metrics_and_prints_every_log_every() {
    let dir = tempdir();
    let output = strata_in(
        dir.path(),
        &[
            "train",
            "--steps",
            "5",
            "--checkpoint-dir",
            "ck",
            "--log-every",
            "2",
        ],
    );
    stdout_text(&output);
    let stderr = String::from_utf8_lossy(&output.stderr);
    let steps: Vec<&str> = stderr.lines().filter(|l| l.starts_with("step ")).collect();
    assert_eq!(steps.len(), 4, "steps 1, 2, 4 and 5: {stderr}");
    for line in &steps {
        assert!(line.len() < 80, "a short step line: {line}");
        assert!(line.contains(" loss ") && line.contains(" lr ") && line.contains(" tok/s "));
    }
    let metrics = std::fs::read_to_string(dir.path().join("ck/metrics.jsonl")).unwrap();
    let records: Vec<serde_json::Value> = metrics
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(records.len(), 5, "{metrics}");
    for (i, r) in records.iter().enumerate() {
        assert_eq!(r["step"], i as u64 + 1);
        for key in [
            "loss",
            "lr",
            "grad_norm",
            "seconds",
            "tokens",
            "unix_time_s",
        ] {
            assert!(r[key].is_number(), "{key} in {r}");
        }
        assert!(r["moved_bytes"]["nvme_to_host"].is_u64(), "{r}");
    }
    let zero = stderr_of_failure(
        &strata_in(dir.path(), &["train", "--log-every", "0"]),
        "--log-every 0",
    );
    assert!(zero.contains("--log-every 0 prints no step"), "{zero}");

    // A run that went past its last checkpoint (as a killed one does) and
    // is resumed keeps each step's record once: the records after the
    // checkpoint are dropped, then the resumed steps appended.
    std::fs::write(
        dir.path().join("every.toml"),
        "[train]\nsteps = 6\ncheckpoint_every = 3\n",
    )
    .unwrap();
    let ck = dir.path().join("ck2");
    stdout_text(&strata_in(
        dir.path(),
        &[
            "train",
            "--config",
            "every.toml",
            "--checkpoint-dir",
            "ck2",
            "--stop-after",
            "5",
        ],
    ));
    // Only step 3's checkpoint survives the "crash"; step 5's records stay.
    std::fs::remove_dir_all(ck.join("step-00000005")).unwrap();
    // A step that `latest` does not name is resumed only into another
    // directory (its later checkpoints are another future of the run).
    std::fs::write(ck.join("latest"), "step-00000005").unwrap();
    let mixed = stderr_of_failure(
        &strata_in(dir.path(), &["train", "--resume", "ck2/step-00000003"]),
        "a step latest does not name",
    );
    assert!(
        mixed.contains("names step-00000005, a later checkpoint of the run: give --checkpoint-dir"),
        "{mixed}"
    );
    std::fs::write(ck.join("latest"), "step-00000003").unwrap();
    stdout_text(&strata_in(dir.path(), &["train", "--resume", "ck2"]));
    let steps: Vec<u64> = std::fs::read_to_string(ck.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["step"]
                .as_u64()
                .unwrap()
        })
        .collect();
    assert_eq!(steps, [1, 2, 3, 4, 5, 6]);
}

/// A 70B model (the first registered architecture whose 70B shape has
/// grouped-query heads) with everything on NVMe runs out of host memory
/// for its fp32 gradients: the message names the tier, the parts in GiB
/// and a fix that applies, before anything is allocated.
#[test]
fn train_a_70b_model_on_nvme_names_the_host_its_gradients_and_a_fix() {
    use strata::train::{Placement, TrainConfig, model::ARCHITECTURES};
    let dir = tempdir();
    let model = ARCHITECTURES
        .iter()
        .map(|arch| (arch.for_params)(70e9).unwrap())
        .find(|shape| shape.kv_heads.is_some_and(|kv| kv < shape.heads))
        .expect("an architecture with grouped-query heads");
    let mut config = TrainConfig {
        model,
        ..TrainConfig::default()
    };
    config.train.micro_batch = 1;
    config.placement.params = Placement::Nvme;
    config.placement.optimizer = Placement::Nvme;
    config.host.budget = "100GiB".parse().unwrap();
    config.device.budget = "70GiB".parse().unwrap();
    let nvme = config.nvme.as_mut().unwrap();
    nvme.dirs = vec![".".into()];
    nvme.capacity = "4TiB".parse().unwrap();
    nvme.create_dirs = false;
    let path = dir.path().join("70b.toml");
    std::fs::write(&path, config.to_toml().unwrap()).unwrap();
    let output = strata_in(dir.path(), &["train", "--config", path.to_str().unwrap()]);
    let stderr = stderr_of_failure(&output, "70B on NVMe");
    assert!(
        stderr.contains("the model does not fit: the host tier needs at least 262.83 GiB (fp32 gradients (placement.gradients, by default with the optimizer) 262.83 GiB), and host.budget is 100.00 GiB")
            && stderr.contains("raise host.budget to at least 262.83 GiB, or set placement.gradients = \"nvme\", or shard over train.ranks = 3 (each rank has its own host.budget: 300.00 GiB in all)"),
        "{stderr}"
    );
}

#[test]
fn train_bad_configs_are_named_before_training() {
    let dir = tempdir();
    let config = dir.path().join("bad.toml");
    std::fs::write(&config, "[placement]\nparms = \"nvme\"\n").unwrap();
    let output = strata_in(dir.path(), &["train", "--config", config.to_str().unwrap()]);
    let stderr = stderr_of_failure(&output, "unknown key");
    assert!(stderr.contains("parms"), "{stderr}");
    std::fs::write(
        &config,
        "[placement]\nparams = \"device\"\noptimizer = \"device\"\n[device]\nbudget = \"20MiB\"\n",
    )
    .unwrap();
    let output = strata_in(dir.path(), &["train", "--config", config.to_str().unwrap()]);
    let stderr = stderr_of_failure(&output, "a placement that cannot fit");
    assert!(
        stderr.contains("the device tier needs at least 28.0 MiB")
            && stderr.contains(
                "raise device.budget to at least 28.0 MiB, or set placement.optimizer = \"nvme\""
            ),
        "{stderr}"
    );
    // Each message names the field at fault, once, with the right number.
    let cases = [
        (
            "[train]\nlr = nan\n",
            "train.lr = NaN: use a positive, finite",
        ),
        (
            "[device]\nkind = \"cuda\"\n[train]\nranks = 2\n",
            "ranks as threads of one process share its one GPU: start a process per GPU (strata train --nproc 2",
        ),
        (
            "[device]\nbudget = \"0\"\n",
            "device.budget = 0B: the device needs room",
        ),
        (
            "[host]\nbudget = \"1MiB\"\n",
            "the model does not fit: the host tier needs at least 6.4 MiB (16-bit parameters (two sets) 3.2 MiB, fp32 gradients",
        ),
        // The device `auto` resolves to without a GPU is this machine's
        // memory: a budget past it is refused before anything is allocated.
        (
            "[device]\nkind = \"auto\"\nbudget = \"100TiB\"\n",
            "invalid setting device.budget = 100TiB: 1 rank(s) x (device.budget 100TiB on the CPU device + host.budget 32MiB) need 102400.03 GiB of memory",
        ),
        // Sizes past the limits, and a model that cannot fit, are refused
        // by a closed-form count before anything is planned or allocated;
        // a vocab that does not cover the data, before any rank starts.
        (
            "[model]\nhidden = 1000000000\nheads = 1\nlayers = 100000000\n",
            "model.hidden = 1000000000: use at most 65536",
        ),
        (
            "[model]\nhidden = 8192\nheads = 64\nlayers = 64\n",
            "the model does not fit: the device tier needs at least 6.06 GiB (compute workspace",
        ),
        (
            "[model]\nvocab = 100\n",
            "model.vocab = 100: the text's largest byte is 122, past the model's vocabulary",
        ),
        (
            "[train]\nmicro_batch = 100000000\n",
            "train.micro_batch = 100000000: use 1 to 65536",
        ),
    ];
    for (text, expected) in cases {
        std::fs::write(&config, text).unwrap();
        let output = strata_in(dir.path(), &["train", "--config", config.to_str().unwrap()]);
        let stderr = stderr_of_failure(&output, text);
        assert!(stderr.contains(expected), "{text}: {stderr}");
        let error = stderr.lines().find(|l| l.starts_with("error:")).unwrap();
        assert!(!error.contains("needs 0 bytes"), "{error}");
        let said = &expected[expected.find(": ").unwrap() + 2..];
        assert_eq!(error.matches(said).count(), 1, "said twice: {error}");
    }
    // A swap directory a config names must exist: not created on whatever
    // disk holds its parent.
    std::fs::write(&config, "[nvme]\ndirs = [\"no-such-drive\"]\n").unwrap();
    let output = strata_in(dir.path(), &["train", "--config", config.to_str().unwrap()]);
    let stderr = stderr_of_failure(&output, "a missing swap directory");
    assert!(
        stderr.contains("nvme.dirs entry no-such-drive: it does not exist")
            && stderr.contains("nvme.create_dirs = true"),
        "{stderr}"
    );
    assert!(!dir.path().join("no-such-drive").exists());
    // A swap directory that cannot be created is the OS's error, with its
    // errno and the path, not a configuration value's.
    std::fs::write(dir.path().join("a-file"), b"").unwrap();
    std::fs::write(
        &config,
        "[nvme]\ndirs = [\"a-file/swap\"]\ncreate_dirs = true\n",
    )
    .unwrap();
    let output = strata_in(dir.path(), &["train", "--config", config.to_str().unwrap()]);
    let stderr = stderr_of_failure(&output, "a swap directory under a file");
    assert!(
        stderr.contains("create nvme.dirs entry a-file/swap")
            && stderr.contains("os error 20")
            && stderr.contains("choose a writable directory"),
        "{stderr}"
    );
}

#[test]
fn train_killed_during_checkpoints_resumes_from_the_last_whole_one() {
    let dir = tempdir();
    let config = dir.path().join("ckpt.toml");
    std::fs::write(
        &config,
        "[model]\nseq = 32\nhidden = 64\nlayers = 2\n[train]\nsteps = 60\nmicro_batch = 4\ncheckpoint_every = 1\ncheckpoint_dir = \"ckpt\"\n[device]\nbudget = \"8MiB\"\n",
    )
    .unwrap();
    let mut child = strata_command()
        .args(["train", "--config", config.to_str().unwrap()])
        .current_dir(dir.path())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let latest = dir.path().join("ckpt/latest");
    let started = std::time::Instant::now();
    while !latest.exists() && started.elapsed().as_secs() < 120 {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    // Checkpoints are written every step, so a kill lands in one often.
    std::thread::sleep(std::time::Duration::from_millis(37));
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    let output = strata_in(
        dir.path(),
        &[
            "train",
            "--config",
            config.to_str().unwrap(),
            "--resume",
            "ckpt",
            "--json",
        ],
    );
    let summary = last_json_line(&output);
    assert!(
        summary["steps"].as_u64().unwrap() < 60,
        "resumed part-way: {summary}"
    );
}

fn deepspeed_example(name: &str) -> String {
    format!(
        "{}/examples/configs/deepspeed/{name}",
        env!("CARGO_MANIFEST_DIR")
    )
}

#[test]
fn train_deepspeed_print_config_shows_the_strata_toml_and_one_warning() {
    let dir = tempdir();
    let ds = deepspeed_example("zero3-infinity-nvme.json");
    let output = strata_in(dir.path(), &["train", "--deepspeed", &ds, "--print-config"]);
    let text = stdout_text(&output);
    let config = strata::train::TrainConfig::from_toml(&text).expect("the printed TOML reads back");
    assert_eq!(config.placement.params, strata::train::Placement::Nvme);
    assert_eq!(config.placement.optimizer, strata::train::Placement::Nvme);
    assert!(text.contains("kind = \"warmup_cosine_lr\""), "{text}");
    let stderr = String::from_utf8_lossy(&output.stderr);
    let warnings: Vec<&str> = stderr
        .lines()
        .filter(|line| line.contains("no strata meaning"))
        .collect();
    assert_eq!(warnings.len(), 1, "{stderr}");
    // One warning, the keys one per line under it.
    let listed: Vec<&str> = stderr
        .lines()
        .skip_while(|line| !line.contains("no strata meaning"))
        .skip(1)
        .take_while(|line| line.starts_with("  "))
        .map(str::trim)
        .collect();
    assert!(
        listed.contains(&"zero_optimization.stage3_prefetch_bucket_size")
            && listed.contains(&"steps_per_print"),
        "{stderr}"
    );
    // Printing trains nothing: no swap directory appears.
    assert!(!dir.path().join("strata-train-swap").exists());
}

#[test]
fn train_deepspeed_precedence_config_then_deepspeed_then_flags() {
    let dir = tempdir();
    let base = dir.path().join("base.toml");
    std::fs::write(
        &base,
        "[train]\nsteps = 50\nmicro_batch = 4\ngrad_accumulation = 3\nlr = 0.002\nclip_norm = 0.5\n",
    )
    .unwrap();
    let ds = dir.path().join("ds.json");
    std::fs::write(
        &ds,
        r#"{"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 2,
            "gradient_clipping": 2.0, "bf16": {"enabled": true},
            "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 5, "total_num_steps": "auto"}}}"#,
    )
    .unwrap();
    let output = strata_in(
        dir.path(),
        &[
            "train",
            "--config",
            base.to_str().unwrap(),
            "--deepspeed",
            ds.to_str().unwrap(),
            "--steps",
            "10",
            "--print-config",
        ],
    );
    let config = strata::train::TrainConfig::from_toml(&stdout_text(&output)).unwrap();
    let t = &config.train;
    // micro-batch: "auto" keeps --config's; accumulation and clipping: the
    // DeepSpeed keys; steps: the flag; lr: WarmupDecayLR's default peak.
    assert_eq!((t.micro_batch, t.grad_accumulation, t.steps), (4, 2, 10));
    assert_eq!((t.clip_norm, t.lr), (2.0, 0.001));
    // total_num_steps "auto" follows train.steps, so --steps: the rate
    // reaches 0 at step 10 + 2 (DeepSpeed's scheduler lags a step).
    assert!(t.lr_at(11) > 0.0 && t.lr_at(12) == 0.0, "{t:?}");
}

#[test]
fn train_deepspeed_refuses_what_strata_cannot_honor_by_key() {
    let dir = tempdir();
    for (json, key) in [
        (
            r#"{"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.3}}}"#,
            "zero_optimization.offload_optimizer.ratio",
        ),
        (r#"{"aio": {"use_gds": true}}"#, "aio.use_gds"),
        (
            r#"{"train_batch_size": 7, "train_micro_batch_size_per_gpu": 2}"#,
            "train_batch_size",
        ),
    ] {
        let ds = dir.path().join("ds.json");
        std::fs::write(&ds, json).unwrap();
        let output = strata_in(
            dir.path(),
            &["train", "--deepspeed", ds.to_str().unwrap(), "--steps", "1"],
        );
        let stderr = stderr_of_failure(&output, json);
        assert!(stderr.contains(key), "{json}: {stderr}");
        assert_eq!(
            stderr.lines().filter(|l| l.starts_with("error:")).count(),
            1,
            "{stderr}"
        );
    }
}

#[test]
fn train_deepspeed_zero_infinity_example_trains_tiny() {
    let dir = tempdir();
    let ds = deepspeed_example("zero3-infinity-nvme.json");
    // nvme_path must exist (DeepSpeed would create it; strata refuses).
    let missing = strata_in(dir.path(), &["train", "--deepspeed", &ds, "--steps", "3"]);
    let stderr = stderr_of_failure(&missing, "a missing nvme_path");
    assert!(
        stderr.contains("strata-train-swap: it does not exist") && stderr.contains("mkdir -p"),
        "{stderr}"
    );
    std::fs::create_dir(dir.path().join("strata-train-swap")).unwrap();
    let output = strata_in(
        dir.path(),
        &["train", "--deepspeed", &ds, "--steps", "3", "--json"],
    );
    let summary = last_json_line(&output);
    assert_eq!(summary["steps"], 3);
    assert!(
        summary["peak_bytes"]["nvme"].as_u64() > Some(0),
        "{summary}"
    );
    assert!(dir.path().join("strata-train-swap/rank0").is_dir());
}

#[test]
fn checkpoint_verify_exit_codes_tiny() {
    let dir = tempdir();
    let output = strata_in(
        dir.path(),
        &[
            "train",
            "--steps",
            "2",
            "--checkpoint-dir",
            "ckpt",
            "--json",
        ],
    );
    stdout_text(&output);
    let root = dir.path().join("ckpt");
    let whole = strata(&["checkpoint", "verify", root.to_str().unwrap(), "--json"]);
    let report: serde_json::Value = serde_json::from_str(&stdout_text(&whole)).unwrap();
    assert_eq!(report["whole"], true);
    assert_eq!(report["meta_json_checksummed"], true);
    // config.json, generation_config.json, the weights, the optimizer
    // shard, the run's strata.toml.
    assert_eq!(report["files"].as_array().unwrap().len(), 5, "{report}");
    let text = stdout_text(&strata(&["checkpoint", "verify", root.to_str().unwrap()]));
    assert!(
        text.contains("ok  model.safetensors") && text.contains("whole"),
        "{text}"
    );

    let step = root.join(report["dir"].as_str().unwrap());
    let weights = step.join("model.safetensors");
    let mut bytes = std::fs::read(&weights).unwrap();
    bytes[100] ^= 0x40;
    std::fs::write(&weights, &bytes).unwrap();
    let corrupt = strata(&["checkpoint", "verify", step.to_str().unwrap()]);
    assert_eq!(corrupt.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&corrupt.stderr);
    assert!(
        stderr.contains("is not a whole checkpoint")
            && stderr.contains("model.safetensors")
            && stderr.contains("corrupt"),
        "{stderr}"
    );
    let missing = strata(&[
        "checkpoint",
        "verify",
        dir.path().join("nope").to_str().unwrap(),
    ]);
    assert_eq!(missing.status.code(), Some(1));
    assert_eq!(strata(&["checkpoint", "verify"]).status.code(), Some(2));
}

#[test]
fn plot_paths_are_checked_before_any_sweep() {
    let dir = tempdir();
    let missing = dir.path().join("no-such-dir/chart.svg");
    let missing = missing.to_str().unwrap();
    let nvme_dir = dir.path().to_str().unwrap();
    for args in [
        vec!["bench", "adam", "--params", "1M", "--plot", missing],
        vec![
            "bench", "nvme", "--dir", nvme_dir, "--size", "4MiB", "--plot", missing,
        ],
        vec!["plan", "--params", "1B", "--plot", missing],
    ] {
        let started = std::time::Instant::now();
        let output = strata(&args);
        let stderr = stderr_of_failure(&output, args.join(" "));
        assert!(
            stderr.contains("no-such-dir") && stderr.contains("does not exist"),
            "{args:?}: {stderr}"
        );
        assert!(
            started.elapsed() < std::time::Duration::from_secs(5),
            "{args:?} ran its sweep before refusing the chart path"
        );
    }
    let not_svg = dir.path().join("chart.png");
    let output = strata(&[
        "plan",
        "--params",
        "1B",
        "--plot",
        not_svg.to_str().unwrap(),
    ]);
    assert!(stderr_of_failure(&output, "png").contains("ending in .svg"));
    // A directory named like a chart: refused before the sweep, not after.
    let directory = dir.path().join("dir.svg");
    std::fs::create_dir(&directory).unwrap();
    let started = std::time::Instant::now();
    let output = strata(&[
        "bench",
        "adam",
        "--params",
        "1M",
        "--plot",
        directory.to_str().unwrap(),
    ]);
    let stderr = stderr_of_failure(&output, "a directory");
    assert!(stderr.contains("that is a directory"), "{stderr}");
    assert!(started.elapsed() < std::time::Duration::from_secs(5));
}

/// A `strata train` child in `dir` whose stderr is read line by line; the
/// lines so far are in the returned buffer.
/// `strata train` in `dir`, its stderr collected line by line into the
/// shared list by a reader thread (join it after the child exits to have
/// every line: regression, a line written just before exit was missed
/// under load).
fn train_child(
    dir: &std::path::Path,
    args: &[&str],
) -> (
    std::process::Child,
    std::sync::Arc<std::sync::Mutex<Vec<String>>>,
    std::thread::JoinHandle<()>,
) {
    use std::io::BufRead;
    let mut child = strata_command()
        .args(["train", "--log-every", "1"])
        .args(args)
        .current_dir(dir)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let lines = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let stderr = child.stderr.take().unwrap();
    let sink = lines.clone();
    let reader = std::thread::spawn(move || {
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            sink.lock().unwrap().push(line);
        }
    });
    (child, lines, reader)
}

/// Waits (at most two minutes) until the child has reported `step`.
fn wait_for_step(lines: &std::sync::Mutex<Vec<String>>, step: u64) {
    wait_for_line(lines, &format!("step {step:>5} "));
}

/// Waits for a line starting with `needle` (at most 120 s).
fn wait_for_line(lines: &std::sync::Mutex<Vec<String>>, needle: &str) {
    let started = std::time::Instant::now();
    while !lines.lock().unwrap().iter().any(|l| l.starts_with(needle)) {
        assert!(started.elapsed().as_secs() < 120, "no line {needle:?}");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

fn send(child: &std::process::Child, signal: &str) {
    let status = Command::new("kill")
        .args([&format!("-{signal}"), &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
}

fn swap_files(dir: &std::path::Path) -> Vec<String> {
    let owned = dir.join("strata-train-swap/rank0/strata-swap");
    std::fs::read_dir(owned)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect()
}

const SIGNAL_CONFIG: &str = "[model]\nseq = 32\nhidden = 64\nlayers = 2\n[train]\nsteps = 400\nmicro_batch = 4\ncheckpoint_dir = \"ckpt\"\n";

#[test]
fn train_sigterm_stops_at_a_step_boundary_checkpoints_and_resumes_bit_identical() {
    let dir = tempdir();
    let config = dir.path().join("run.toml");
    std::fs::write(&config, SIGNAL_CONFIG).unwrap();
    let config = config.to_str().unwrap();
    let (child, lines, reader) = train_child(dir.path(), &["--config", config]);
    wait_for_step(&lines, 3);
    send(&child, "TERM");
    let output = child.wait_with_output().unwrap();
    reader.join().unwrap();
    let stderr = lines.lock().unwrap().join("\n");
    assert_eq!(output.status.code(), Some(143), "{stderr}");
    let said = "stopped by SIGTERM after step ";
    let at = stderr.find(said).unwrap_or_else(|| panic!("{stderr}")) + said.len();
    let stopped_at: u64 = stderr[at..]
        .split(|c: char| !c.is_ascii_digit())
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!(stopped_at >= 3, "{stderr}");
    let latest = std::fs::read_to_string(dir.path().join("ckpt/latest")).unwrap();
    assert_eq!(latest.trim(), format!("step-{stopped_at:08}"));
    assert_eq!(swap_files(dir.path()), Vec::<String>::new(), "swap removed");

    // Resumed with --resume alone (the checkpoint holds the run's config),
    // the losses are the uninterrupted run's, bit for bit.
    let steps = (stopped_at + 3).to_string();
    let resumed_run = strata_in(
        dir.path(),
        &[
            "train",
            "--resume",
            "ckpt",
            "--stop-after",
            &steps,
            "--json",
            "--log-level",
            "info",
        ],
    );
    let said = String::from_utf8_lossy(&resumed_run.stderr);
    assert!(
        said.contains(&format!("resumed from step {stopped_at} of 400")),
        "{said}"
    );
    let resumed = last_json_line(&resumed_run);
    // A flag that would change the run is refused, naming both values.
    let refused = stderr_of_failure(
        &strata_in(dir.path(), &["train", "--resume", "ckpt", "--steps", "500"]),
        "--steps changed on resume",
    );
    assert!(
        refused.contains("train.steps = 400 in the checkpoint's run, 500 in this one"),
        "{refused}"
    );
    let refused = stderr_of_failure(
        &strata_in(
            dir.path(),
            &[
                "train",
                "--resume",
                "ckpt",
                "--micro-batch",
                "2",
                "--lr",
                "0.1",
            ],
        ),
        "batch and lr changed on resume",
    );
    assert!(
        refused.contains("train.lr = 0.003 in the checkpoint's run, 0.1 in this one")
            && refused.contains("train.micro_batch = 4 in the checkpoint's run, 2 in this one"),
        "{refused}"
    );
    let other = tempdir();
    let whole = last_json_line(&strata_in(
        other.path(),
        &[
            "train",
            "--config",
            config,
            "--stop-after",
            &steps,
            "--json",
        ],
    ));
    let tail = &whole["losses"].as_array().unwrap()[stopped_at as usize..];
    assert_eq!(resumed["losses"].as_array().unwrap(), tail);
}

/// A second signal, or the grace running out, aborts the step in progress:
/// the run returns at once, removes its swap files and keeps the last whole
/// checkpoint. A run killed outright leaves its swap file, which the next
/// run in the same directories removes.
#[test]
fn train_second_signal_or_spent_grace_aborts_the_step_and_the_next_run_cleans_up_after_a_kill() {
    let dir = tempdir();
    let config = dir.path().join("run.toml");
    // Checkpoints every step, so that one is whole whenever the run dies.
    std::fs::write(
        &config,
        format!("{SIGNAL_CONFIG}checkpoint_every = 1\nlock_wait_s = 5.0\n"),
    )
    .unwrap();
    let config = config.to_str().unwrap();
    for (signals, grace, code, said) in [
        (
            &["TERM", "INT"][..],
            "25",
            Some(130),
            "a second signal (SIGINT) received: aborting the step in progress",
        ),
        (
            &["TERM"][..],
            "0",
            Some(143),
            "did not stop within --signal-grace 0 s: aborting the step in progress",
        ),
        (&["KILL"][..], "25", None, ""),
    ] {
        let (child, lines, reader) = train_child(
            dir.path(),
            &["--config", config, "--overwrite", "--signal-grace", grace],
        );
        wait_for_step(&lines, 2);
        for (i, signal) in signals.iter().enumerate() {
            send(&child, signal);
            if i + 1 < signals.len() {
                // Both pending at once, sigwait would take the lower
                // number (INT) first: let the first be seen.
                wait_for_line(&lines, &format!("strata: SIG{signal} received"));
            }
        }
        let started = std::time::Instant::now();
        let output = child.wait_with_output().unwrap();
        reader.join().unwrap();
        let stderr = lines.lock().unwrap().join("\n");
        assert_eq!(output.status.code(), code, "{stderr}");
        assert!(started.elapsed().as_secs() < 10, "stopped at once");
        let left = swap_files(dir.path());
        if code.is_some() {
            assert!(
                stderr.contains(said)
                    && stderr.contains("aborted mid-step by")
                    && stderr.contains("the last whole checkpoint is"),
                "{stderr}"
            );
            assert_eq!(
                left,
                Vec::<String>::new(),
                "the aborted run removed its swap"
            );
        } else {
            // Killed: its swap file stays.
            assert_eq!(left.len(), 1, "{left:?}");
        }
        // The last whole checkpoint stays.
        let verify = strata_in(dir.path(), &["checkpoint", "verify", "ckpt"]);
        assert!(verify.status.success(), "{verify:?}");
        // The next run in the same directories removes it and trains.
        let next = strata_in(
            dir.path(),
            &[
                "train",
                "--config",
                config,
                "--overwrite",
                "--stop-after",
                "1",
            ],
        );
        stdout_text(&next);
        for file in &left {
            assert!(!swap_files(dir.path()).contains(file), "{file} removed");
        }
    }
}

/// `--tokens` trains on a file of u16 (or u32) token ids: the same file
/// gives the same losses, and ids past the model's vocab are named before
/// training.
#[test]
fn train_reads_a_token_file_tiny() {
    let dir = tempdir();
    let ids: Vec<u8> = (0..20_000u32)
        .flat_map(|i| ((i.wrapping_mul(2_654_435_761) >> 7) as u16 % 500).to_le_bytes())
        .collect();
    std::fs::write(dir.path().join("tokens.u16"), ids).unwrap();
    std::fs::write(dir.path().join("vocab.toml"), "[model]\nvocab = 512\n").unwrap();
    let args = [
        "train",
        "--config",
        "vocab.toml",
        "--tokens",
        "tokens.u16",
        "--steps",
        "3",
        "--json",
        "--overwrite",
    ];
    let first = last_json_line(&strata_in(dir.path(), &args));
    let second = last_json_line(&strata_in(dir.path(), &args));
    assert_eq!(first["losses"].as_array().unwrap().len(), 3);
    assert_eq!(first["losses"], second["losses"]);
    let small = strata_in(
        dir.path(),
        &["train", "--tokens", "tokens.u16", "--steps", "1"],
    );
    let err = stderr_of_failure(&small, "model.vocab");
    assert!(
        err.contains("the token file's largest id is 499, past the model's vocabulary")
            && err.contains("set model.vocab to at least 500"),
        "{err}"
    );
    // A text passed as token ids is told to use --data.
    std::fs::write(
        dir.path().join("notes.txt"),
        "plain text, not token ids\n".repeat(100),
    )
    .unwrap();
    let text = strata_in(
        dir.path(),
        &["train", "--tokens", "notes.txt", "--steps", "1"],
    );
    let err = stderr_of_failure(&text, "a text as --tokens");
    assert!(
        err.contains("the file reads as text: pass a text with --data"),
        "{err}"
    );
}

/// A word-level tokenizer of `words` (id = place, then `<unk>` and
/// `<eos>`), with a `tokenizer_config.json` naming `<eos>`, in `dir`.
fn word_tokenizer(dir: &std::path::Path, words: &[&str]) {
    let mut vocab: Vec<String> = words.iter().map(|w| format!("{w:?}")).collect();
    vocab.push("\"<unk>\"".into());
    vocab.push("\"<eos>\"".into());
    let vocab: Vec<String> = vocab
        .iter()
        .enumerate()
        .map(|(i, w)| format!("{w}: {i}"))
        .collect();
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(
        dir.join("tokenizer.json"),
        format!(
            r#"{{"version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
                "normalizer": null, "pre_tokenizer": {{"type": "Whitespace"}},
                "post_processor": null, "decoder": null,
                "model": {{"type": "WordLevel", "vocab": {{{}}}, "unk_token": "<unk>"}}}}"#,
            vocab.join(", ")
        ),
    )
    .unwrap();
    std::fs::write(
        dir.join("tokenizer_config.json"),
        r#"{"eos_token": "<eos>"}"#,
    )
    .unwrap();
}

/// `--data docs.jsonl --tokenizer DIR` tokenizes the documents once into
/// a cache and trains on every window once per epoch; a resume reads on
/// mid-epoch bit for bit, a resume on changed data is refused naming both,
/// and a tokenizer with more ids than the model's vocabulary is refused.
#[test]
fn train_tokenizes_jsonl_once_and_resumes_mid_epoch_tiny() {
    let dir = tempdir();
    let words = [
        "the", "tiers", "hold", "every", "tensor", "and", "move", "it",
    ];
    word_tokenizer(&dir.path().join("tok"), &words);
    let lines: String = (0..400)
        .map(|i| {
            let doc: Vec<&str> = (0..(i % 7 + 3))
                .map(|j| words[(i * 3 + j * 5) % 8])
                .collect();
            format!("{{\"text\": \"{}\"}}\n", doc.join(" "))
        })
        .collect();
    std::fs::write(dir.path().join("docs.jsonl"), lines).unwrap();
    std::fs::write(
        dir.path().join("small.toml"),
        "[model]\nvocab = 64\nseq = 16\n[train]\nsteps = 6\nmicro_batch = 4\nwarmup_steps = 1\n",
    )
    .unwrap();
    let base = [
        "train",
        "--config",
        "small.toml",
        "--data",
        "docs.jsonl",
        "--tokenizer",
        "tok",
        "--json",
    ];
    let with = |extra: &[&str]| -> Vec<String> {
        base.iter().chain(extra).map(|s| s.to_string()).collect()
    };
    let run = |args: Vec<String>| {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        strata_in(dir.path(), &args)
    };
    let whole = last_json_line(&run(with(&["--checkpoint-dir", "whole"])));
    let cache: Vec<String> = std::fs::read_dir(dir.path().join(".strata-cache"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(cache.len(), 2, "one token file and its record: {cache:?}");
    // Stopped after step 2 (8 of an epoch's windows read), then resumed.
    run(with(&["--checkpoint-dir", "part", "--stop-after", "2"]));
    let meta: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.path().join("part/step-00000002/meta.json")).unwrap(),
    )
    .unwrap();
    let windows = meta["data"]["windows"].as_u64().unwrap();
    assert!(windows > 8, "{meta}");
    assert_eq!(meta["data"]["samples"], 8);
    assert_eq!(meta["data"]["epoch"], 0);
    assert_eq!(meta["data"]["epoch_position"], 8);
    let resumed = last_json_line(&strata_in(
        dir.path(),
        &["train", "--resume", "part", "--json"],
    ));
    let losses = whole["losses"].as_array().unwrap();
    assert_eq!(resumed["losses"].as_array().unwrap()[..], losses[2..]);
    let again: Vec<String> = std::fs::read_dir(dir.path().join(".strata-cache"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        again.len(),
        2,
        "the cache was read, not made again: {again:?}"
    );
    // The data changed under the checkpoint: refused, naming both.
    let text = std::fs::read_to_string(dir.path().join("docs.jsonl")).unwrap();
    std::fs::write(
        dir.path().join("docs.jsonl"),
        text.replace("tiers", "tensor"),
    )
    .unwrap();
    run(with(&["--checkpoint-dir", "other", "--stop-after", "1"]));
    let err = stderr_of_failure(
        &strata_in(
            dir.path(),
            &[
                "train",
                "--resume",
                "part/step-00000002",
                "--checkpoint-dir",
                "third",
            ],
        ),
        "resume on changed data",
    );
    assert!(
        err.contains("was trained on") && err.contains("and [data] now gives"),
        "{err}"
    );
    // A tokenizer with more ids than the model's vocabulary.
    std::fs::write(
        dir.path().join("tiny.toml"),
        "[model]\nvocab = 8\nseq = 16\n",
    )
    .unwrap();
    let err = stderr_of_failure(
        &strata_in(
            dir.path(),
            &[
                "train",
                "--config",
                "tiny.toml",
                "--data",
                "docs.jsonl",
                "--tokenizer",
                "tok",
            ],
        ),
        "a tokenizer past the vocabulary",
    );
    assert!(
        err.contains("has 10 ids, more than the model's vocabulary")
            && err.contains("model.vocab to at least 10"),
        "{err}"
    );
}

/// `--sft` trains on supervised JSONL (prompt and response fields): the
/// run says how many of the tokens are loss targets, and a checkpoint's
/// config (format = "sft" kept) resumes it bit for bit; with `[data]
/// attention = "document"` its documents are kept apart (the tokenizer's
/// end of text between them); `strata eval` gives the checkpoint's loss
/// over the data (every window once, or the first few); `strata generate`
/// continues a prompt from
/// the checkpoint through the run's tokenizer (greedy, or sampled the same
/// for a seed); read as plain JSONL the lines lack their text field,
/// named; without a tokenizer `--sft` is refused.
#[test]
fn train_sft_masks_prompts_resumes_and_generates_tiny() {
    let dir = tempdir();
    let words = ["what", "is", "a", "tier", "the", "place", "of", "tensor"];
    word_tokenizer(&dir.path().join("tok"), &words);
    let lines: String = (0..300)
        .map(|i| {
            let pick = |n: usize, k: usize| -> String {
                (0..n)
                    .map(|j| words[(i * k + j * 3) % 8])
                    .collect::<Vec<_>>()
                    .join(" ")
            };
            format!(
                "{{\"prompt\": \"{}\", \"response\": \"{}\"}}\n",
                pick(i % 4 + 2, 5),
                pick(i % 3 + 2, 7)
            )
        })
        .collect();
    std::fs::write(dir.path().join("sft.jsonl"), lines).unwrap();
    std::fs::write(
        dir.path().join("small.toml"),
        "[model]\nvocab = 16\nseq = 16\n[train]\nsteps = 4\nmicro_batch = 4\nwarmup_steps = 1\n",
    )
    .unwrap();
    let args = |extra: &[&'static str]| -> Vec<&'static str> {
        let mut args = vec![
            "train",
            "--config",
            "small.toml",
            "--data",
            "sft.jsonl",
            "--tokenizer",
            "tok",
            "--json",
        ];
        args.extend_from_slice(extra);
        args
    };
    let output = strata_command()
        .args(args(&["--sft", "--checkpoint-dir", "whole"]))
        .env("STRATA_LOG", "info")
        .current_dir(dir.path())
        .output()
        .unwrap();
    let log = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(
        output.status.success(),
        "{log}{}",
        String::from_utf8_lossy(&output.stdout)
    );
    assert!(
        log.contains("loss masks:") && log.contains("are loss targets"),
        "{log}"
    );
    let sft = last_json_line(&output);
    let config = std::fs::read_to_string(dir.path().join("whole/step-00000004/strata.toml"))
        .unwrap_or_default();
    assert!(config.contains("format = \"sft\""), "{config}");
    let part = strata_in(
        dir.path(),
        &args(&["--sft", "--checkpoint-dir", "part", "--stop-after", "2"]),
    );
    assert!(part.status.success());
    let resumed = last_json_line(&strata_in(
        dir.path(),
        &["train", "--resume", "part", "--json"],
    ));
    let losses = sft["losses"].as_array().unwrap();
    assert_eq!(resumed["losses"].as_array().unwrap()[..], losses[2..]);
    // Packed and kept apart: positions restart at each document, which
    // attends to itself alone (the tokenizer's end of text tells them).
    std::fs::write(
        dir.path().join("apart.toml"),
        "[model]\nvocab = 16\nseq = 16\n[train]\nsteps = 2\nmicro_batch = 4\nwarmup_steps = 1\n[data]\nattention = \"document\"\n",
    )
    .unwrap();
    let apart = strata_command()
        .args([
            "train",
            "--config",
            "apart.toml",
            "--data",
            "sft.jsonl",
            "--tokenizer",
            "tok",
            "--sft",
            "--json",
        ])
        .env("STRATA_LOG", "info")
        .current_dir(dir.path())
        .output()
        .unwrap();
    let log = String::from_utf8_lossy(&apart.stderr).into_owned();
    assert!(apart.status.success(), "{log}");
    assert!(
        log.contains("documents kept apart: each starts after token 9"),
        "{log}"
    );
    let apart = last_json_line(&apart);
    assert_ne!(apart["losses"][1], sft["losses"][1]);
    // What the trained model writes after a prompt, through the run's
    // tokenizer: the same tokens for the same seed.
    let generate = |extra: &[&str]| {
        let mut all = vec![
            "generate",
            "--checkpoint",
            "whole",
            "--prompt",
            "what is",
            "--max-new-tokens",
            "5",
            "--json",
        ];
        all.extend_from_slice(extra);
        stdout_json(&strata_in(dir.path(), &all))
    };
    let greedy = generate(&[]);
    assert_eq!(
        greedy["prompt_tokens"],
        serde_json::json!([0, 1]),
        "{greedy}"
    );
    let made = greedy["tokens"].as_array().unwrap();
    assert!(
        (made.len() == 5 && greedy["stopped"] == "max_new_tokens")
            || (made.len() < 5 && greedy["stopped"] == "end_of_text"),
        "{greedy}"
    );
    // Ids of the model's vocabulary (16) but its end of text (9), and the
    // same every time.
    assert!(
        made.iter().all(|t| t.as_u64().unwrap() < 16 && t != 9),
        "{greedy}"
    );
    assert_eq!(generate(&[])["tokens"], greedy["tokens"]);
    let sampled = ["--temperature", "1.0", "--top-k", "4", "--seed", "9"];
    assert_eq!(generate(&sampled)["tokens"], generate(&sampled)["tokens"]);
    let err = stderr_of_failure(
        &strata_in(
            dir.path(),
            &[
                "generate",
                "--checkpoint",
                "whole",
                "--prompt",
                "a",
                "--temperature",
                "-1",
            ],
        ),
        "a negative temperature",
    );
    assert!(err.contains("temperature"), "{err}");
    let err = stderr_of_failure(
        &strata_in(
            dir.path(),
            &["generate", "--checkpoint", "nowhere", "--prompt", "a"],
        ),
        "a missing checkpoint",
    );
    assert!(err.contains("nowhere"), "{err}");
    // Its loss over the data, forward only, every window once (the first
    // three with --max-windows), the prompts masked as in training.
    let eval = |extra: &[&str]| {
        let mut all = vec![
            "eval",
            "--checkpoint",
            "whole",
            "--data",
            "sft.jsonl",
            "--sft",
            "--json",
        ];
        all.extend_from_slice(extra);
        stdout_json(&strata_in(dir.path(), &all))
    };
    let whole_data = eval(&[]);
    let loss = whole_data["loss"].as_f64().unwrap();
    assert!(loss.is_finite() && loss > 0.0, "{whole_data}");
    assert!(
        (whole_data["perplexity"].as_f64().unwrap() - loss.exp()).abs() < 1e-9 * loss.exp(),
        "{whole_data}"
    );
    let windows = whole_data["windows"].as_u64().unwrap();
    let first = eval(&["--max-windows", "3", "--micro-batch", "2"]);
    assert_eq!(first["windows"], 3);
    assert!(first["targets"].as_u64().unwrap() < whole_data["targets"].as_u64().unwrap());
    assert!(windows > 3);
    let plain = strata_in(dir.path(), &args(&["--checkpoint-dir", "plain"]));
    let err = String::from_utf8_lossy(&plain.stderr).into_owned();
    assert!(err.contains("no string field \"text\""), "{err}");
    let err = stderr_of_failure(
        &strata_in(
            dir.path(),
            &[
                "train",
                "--config",
                "small.toml",
                "--data",
                "sft.jsonl",
                "--sft",
            ],
        ),
        "--sft without a tokenizer",
    );
    assert!(
        err.contains("data.tokenizer") && err.contains("sft"),
        "{err}"
    );
}

/// `[eval]` evaluates held-out data every N steps and at the last: the
/// loss is in those steps' reports (and lines, and a span of the trace),
/// and equals `strata eval`
/// of the final checkpoint on the same windows; `eval.every` without
/// files is refused by name.
#[test]
fn train_evaluates_held_out_data_every_n_steps_tiny() {
    let dir = tempdir();
    let held: String = (0..40)
        .map(|i| format!("held-out line {i}: the tiers move every tensor where it is needed.\n"))
        .collect();
    std::fs::write(dir.path().join("held.txt"), held).unwrap();
    std::fs::write(
        dir.path().join("eval.toml"),
        "[model]\nseq = 32\n[train]\nsteps = 5\nmicro_batch = 4\nwarmup_steps = 1\n[eval]\nevery = 2\nwindows = 4\npath = \"held.txt\"\n[checkpoint]\nweights_dtype = \"f32\"\n",
    )
    .unwrap();
    let summary = last_json_line(&strata_in(
        dir.path(),
        &[
            "train",
            "--config",
            "eval.toml",
            "--checkpoint-dir",
            "ck",
            "--trace",
            "trace.json",
            "--json",
        ],
    ));
    let trace = std::fs::read_to_string(dir.path().join("trace.json")).unwrap();
    // The passes' ops are spans (one pass of 4 windows each time).
    assert_eq!(trace.matches("\"eval: loss\"").count(), 3, "a span each");
    assert_eq!(
        trace.matches("\"eval: block forward\"").count(),
        3 * 4,
        "4 blocks"
    );
    let reports = summary["reports"].as_array().unwrap();
    let evaluated: Vec<u64> = reports
        .iter()
        .filter(|r| r.get("eval_loss").is_some())
        .map(|r| r["step"].as_u64().unwrap())
        .collect();
    assert_eq!(evaluated, [2, 4, 5], "{summary}");
    let last = reports[4]["eval_loss"].as_f64().unwrap();
    let after = stdout_json(&strata_in(
        dir.path(),
        &[
            "eval",
            "--checkpoint",
            "ck",
            "--data",
            "held.txt",
            "--max-windows",
            "4",
            "--json",
        ],
    ));
    assert_eq!(after["windows"], 4);
    // The checkpoint resumed: its master weights, the same passes.
    assert_eq!(after["loss"].as_f64().unwrap(), last, "{after}");
    // Placed by another config (parameters and states on NVMe, two
    // passes of two windows): the same loss, the parameters on the drive.
    std::fs::write(
        dir.path().join("offload.toml"),
        "[train]\nmicro_batch = 2\n[placement]\nparams = \"nvme\"\noptimizer = \"nvme\"\n[nvme]\ndirs = [\"eval-swap\"]\ncreate_dirs = true\n",
    )
    .unwrap();
    let offloaded = stdout_json(&strata_in(
        dir.path(),
        &[
            "eval",
            "--checkpoint",
            "ck",
            "--config",
            "offload.toml",
            "--data",
            "held.txt",
            "--max-windows",
            "4",
            "--json",
        ],
    ));
    let relative = (offloaded["loss"].as_f64().unwrap() - last).abs() / last;
    assert!(relative < 1e-6, "{offloaded} against {last}");
    assert!(
        offloaded["peak_bytes"]["nvme"].as_u64().unwrap() > 0,
        "{offloaded}"
    );
    let err = stderr_of_failure(
        &strata_in(
            dir.path(),
            &["eval", "--checkpoint", "ck", "--config", "missing.toml"],
        ),
        "a missing --config",
    );
    assert!(err.contains("missing.toml"), "{err}");
    std::fs::write(dir.path().join("bad.toml"), "[eval]\nevery = 2\n").unwrap();
    let err = stderr_of_failure(
        &strata_in(dir.path(), &["train", "--config", "bad.toml"]),
        "eval.every without eval.path",
    );
    assert!(
        err.contains("eval.every") && err.contains("eval.path"),
        "{err}"
    );
}

/// `strata bench tokenize` in a tiny mode: the documents, tokens and
/// tokens/s of a JSONL file, the kept token file holding each document's
/// ids then the end-of-text id.
#[test]
fn bench_tokenize_json_contract_tiny() {
    let dir = tempdir();
    word_tokenizer(&dir.path().join("tok"), &["a", "b", "c"]);
    std::fs::write(
        dir.path().join("docs.jsonl"),
        "{\"text\": \"a b\"}\n{\"text\": \"c a c\"}\n",
    )
    .unwrap();
    let out = stdout_json(&strata_in(
        dir.path(),
        &[
            "bench",
            "tokenize",
            "--data",
            "docs.jsonl",
            "--tokenizer",
            "tok",
            "--rounds",
            "2",
            "--json",
            "--keep",
            "kept",
        ],
    ));
    assert_eq!(
        (out["documents"].as_u64(), out["tokens"].as_u64()),
        (Some(2), Some(7))
    );
    assert!(out["tokens_per_s"].as_f64().unwrap() > 0.0, "{out}");
    let ids: Vec<u16> = std::fs::read(out["token_file"].as_str().unwrap())
        .unwrap()
        .chunks_exact(2)
        .map(|b| u16::from_le_bytes([b[0], b[1]]))
        .collect();
    assert_eq!(ids, [0, 1, 4, 2, 0, 2, 4]);
}

/// A directory of token shards trains as one corpus (its files in name
/// order); a shard shorter than a window is named.
#[test]
fn train_reads_a_directory_of_token_shards_tiny() {
    let dir = tempdir();
    let shards = dir.path().join("shards");
    std::fs::create_dir(&shards).unwrap();
    for (n, len) in [(0u32, 3000u32), (1, 2000)] {
        let ids: Vec<u8> = (0..len)
            .flat_map(|i| ((i * 7 + n * 13) as u16 % 200).to_le_bytes())
            .collect();
        std::fs::write(shards.join(format!("part-{n}.bin")), ids).unwrap();
    }
    std::fs::write(dir.path().join("vocab.toml"), "[model]\nvocab = 256\n").unwrap();
    let args = [
        "train",
        "--config",
        "vocab.toml",
        "--tokens",
        "shards",
        "--steps",
        "2",
        "--json",
    ];
    let first = last_json_line(&strata_in(dir.path(), &args));
    assert_eq!(first["losses"].as_array().unwrap().len(), 2);
    std::fs::write(shards.join("part-2.bin"), [0u8; 10]).unwrap();
    let err = stderr_of_failure(
        &strata_in(dir.path(), &args),
        "a shard shorter than a window",
    );
    assert!(
        err.contains(
            "part-2.bin: it holds 5 tokens, and a file needs more than model.seq + 1 = 65 tokens"
        ),
        "{err}"
    );
}

/// `benches/gpu_vs_deepspeed.py --tiny`: strata's peers train on the shared
/// token file and report tokens/s; peers whose libraries (torch,
/// DeepSpeed) or GPU are missing say so instead of failing; a peer that
/// does not exist is refused before anything runs.
#[test]
fn gpu_vs_deepspeed_script_tiny() {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/benches/gpu_vs_deepspeed.py");
    let output = Command::new("python3")
        .arg(script)
        .args(["--strata", env!("CARGO_BIN_EXE_strata")])
        .args(["--tiny", "--json", "--clip-all"])
        .args([
            "--peers",
            "strata-offload,strata-resident,torch,ds-zero3-offload",
        ])
        .output()
        .unwrap();
    let text = stdout_text(&output);
    let report: serde_json::Value = serde_json::from_str(text.lines().last().unwrap()).unwrap();
    let peers = report["peers"].as_array().unwrap();
    assert_eq!(peers.len(), 4, "{report}");
    for peer in &peers[..2] {
        assert!(peer["tokens_per_s"].as_f64().unwrap() > 0.0, "{peer}");
        assert_eq!(peer["clipped"].as_f64().unwrap(), 1.0, "--clip-all: {peer}");
        assert_eq!(peer["losses"].as_array().unwrap().len(), 4, "{peer}");
        assert!(peer["recomputed_blocks"].is_u64(), "{peer}");
    }
    // The two strata peers train on the same windows: the same losses.
    assert_eq!(peers[0]["losses"], peers[1]["losses"]);
    for peer in &peers[2..] {
        assert!(
            peer["tokens_per_s"].is_number() || peer["skipped"].is_string(),
            "{peer}"
        );
    }
    let refused = Command::new("python3")
        .arg(script)
        .args(["--tiny", "--peers", "strata-offload,nccl"])
        .output()
        .unwrap();
    assert!(!refused.status.success());
    assert!(String::from_utf8_lossy(&refused.stderr).contains("--peers nccl"));
    // --max-grad-norm 0: no peer clips (unclipped steps measured).
    let output = Command::new("python3")
        .arg(script)
        .args(["--strata", env!("CARGO_BIN_EXE_strata")])
        .args(["--tiny", "--json", "--max-grad-norm", "0"])
        .args(["--peers", "strata-offload,torch"])
        .output()
        .unwrap();
    let text = stdout_text(&output);
    let report: serde_json::Value = serde_json::from_str(text.lines().last().unwrap()).unwrap();
    assert_eq!(report["shape"]["max_grad_norm"].as_f64(), Some(0.0));
    for peer in report["peers"].as_array().unwrap() {
        assert!(
            peer["clipped"].as_f64() == Some(0.0) || peer["skipped"].is_string(),
            "--max-grad-norm 0: {peer}"
        );
    }
    for bad in [["--max-grad-norm", "-1"], ["--max-grad-norm", "inf"]] {
        let refused = Command::new("python3")
            .arg(script)
            .args(["--tiny", "--peers", "strata-offload"])
            .args(bad)
            .output()
            .unwrap();
        assert!(!refused.status.success());
        let err = String::from_utf8_lossy(&refused.stderr);
        assert!(err.contains("--max-grad-norm"), "{err}");
    }
}

#[test]
fn bench_kernels_json_contract_tiny_and_bad_input_names_the_fix() {
    let args = [
        "bench",
        "kernels",
        "--device",
        "cpu",
        "--batch",
        "1",
        "--seq",
        "33",
        "--heads",
        "2",
        "--head-dim",
        "16",
        "--gemm",
        "64x48x32",
        "--rounds",
        "2",
        "--round-ms",
        "1",
    ];
    let report = stdout_json(&strata(&[&args[..], &["--json", "--no-torch"]].concat()));
    assert_eq!(report["device"], "cpu");
    assert_eq!(report["torch"], "left out (--no-torch)");
    assert_eq!(report["torch_results"].as_array().unwrap().len(), 0);
    let ops: Vec<&str> = report["results"]
        .as_array()
        .unwrap()
        .iter()
        .map(|row| {
            assert!(row["ms"].as_f64().unwrap() > 0.0, "{row}");
            assert!(row["tflops"].as_f64().unwrap() > 0.0, "{row}");
            assert_eq!(row["dtype"], "f32");
            row["op"].as_str().unwrap()
        })
        .collect();
    assert_eq!(ops, ["attention_forward", "attention_backward", "gemm"]);
    assert_eq!(report["results"][2]["shape"], "64 x 48 x 32");
    let table = stdout_text(&strata(&[&args[..], &["--no-torch"]].concat()));
    assert!(table.contains("attention_backward") && table.contains("TFLOPS"));
    // Grouped-query heads and packed documents, with torch's SDPA on the
    // same shapes beside them where torch is importable (else the report
    // says why).
    let packed = [
        &args[..8],
        &["--heads", "4", "--kv-heads", "2", "--head-dim", "16"],
        &["--documents", "10", "--gemm", "64x48x32", "--rounds", "2"],
        &["--round-ms", "1", "--json"],
    ]
    .concat();
    let report = stdout_json(&strata(&packed));
    let results = report["results"].as_array().unwrap();
    assert_eq!(results[0]["shape"], "b1 s33 h4 kv2 d16 docs 10");
    let torch = report["torch"].as_str().unwrap();
    let beside = report["torch_results"].as_array().unwrap();
    if torch.starts_with("torch ") {
        assert_eq!(beside.len(), 2, "{report}");
        assert!(results[0]["vs_torch"].as_f64().unwrap() > 0.0, "{report}");
        assert_eq!(beside[1]["op"], "attention_backward");
        assert_eq!(beside[1]["path"], "torch sdpa");
    } else {
        assert!(torch.contains("torch"), "{torch}");
        assert!(beside.is_empty() && results[0].get("vs_torch").is_none());
    }
    let cases: [(&[&str], &str); 6] = [
        (&["--gemm", "3x4"], "MxNxK"),
        (&["--dtype", "f16"], "is not bf16 or f32"),
        (&["--dtype", "bf16"], "the CPU backend computes in f32 only"),
        (&["--rounds", "0"], "--rounds must be at least 1"),
        (
            &["--heads", "4", "--kv-heads", "3"],
            "must divide the 4 query heads",
        ),
        (&["--documents", "0"], "at least one token"),
    ];
    for (extra, expected) in cases {
        let full = [&args[..6], extra].concat();
        let text = stderr_of_failure(&strata(&full), &full);
        assert!(text.contains(expected), "{full:?}: {text}");
    }
}

#[test]
fn plan_takes_measured_rates_from_bench_kernels_json_and_names_a_bad_file() {
    let dir = tempdir();
    let report = strata(&[
        "bench",
        "kernels",
        "--device",
        "cpu",
        "--batch",
        "1",
        "--seq",
        "32",
        "--heads",
        "2",
        "--head-dim",
        "16",
        "--gemm",
        "64x64x64",
        "--rounds",
        "1",
        "--round-ms",
        "1",
        "--no-torch",
        "--json",
    ]);
    let kernels = dir.path().join("kernels.json");
    std::fs::write(&kernels, stdout_text(&report)).unwrap();
    let kernels = kernels.to_str().unwrap();
    let plan = [
        "plan",
        "--preset",
        "dgx-h100",
        "--gpus-per-node",
        "1",
        "--layers",
        "2",
        "--hidden",
        "512",
        "--heads",
        "8",
        "--seq",
        "256",
        "--micro-batch",
        "2",
        "--json",
    ];
    let base = stdout_json(&strata(&plan));
    let measured = stdout_json(&strata(&[&plan[..], &["--kernels", kernels]].concat()));
    let rates = &measured["hardware"]["attention_flops_per_s"];
    assert!(
        rates[0].as_f64().unwrap() > 0.0 && rates[1].as_f64().unwrap() > 0.0,
        "{rates}"
    );
    assert!(base["hardware"]["attention_flops_per_s"].is_null());
    // The CPU's rates are far below an H100's: the same step takes longer.
    let step = |v: &serde_json::Value| v["step_time_s"].as_f64().unwrap();
    assert!(
        step(&measured) > 10.0 * step(&base),
        "{} vs {}",
        step(&measured),
        step(&base)
    );
    let empty = dir.path().join("empty.json");
    std::fs::write(&empty, r#"{"results": []}"#).unwrap();
    let cases = [
        (empty.to_str().unwrap(), "has no gemm result"),
        ("/nonexistent/kernels.json", "strata bench kernels --json"),
    ];
    for (file, expected) in cases {
        let text = stderr_of_failure(&strata(&[&plan[..], &["--kernels", file]].concat()), file);
        assert!(text.contains(expected), "{file}: {text}");
    }
}

/// What the command line changes or leaves out is said, not done silently:
/// `--steps` shorter than the warmup cuts it with a warning (and leaves a
/// warmup that ends within the run as set); a resume or a
/// `train.checkpoint_every` with no checkpoint directory warns that the run
/// writes none; `--stop-after 0` is refused.
#[test]
fn train_says_what_the_command_line_changes_or_leaves_out() {
    let dir = tempdir();
    let config = dir.path().join("c.toml");
    std::fs::write(&config, "[train]\nsteps = 1000\nwarmup_steps = 100\n").unwrap();
    let config = config.to_str().unwrap();
    let printed = |args: &[&str]| {
        let mut all = vec!["train", "--config", config, "--print-config"];
        all.extend_from_slice(args);
        let output = strata(&all);
        let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
        (stdout_text(&output), stderr)
    };
    let (kept, quiet) = printed(&["--steps", "400"]);
    assert!(kept.contains("warmup_steps = 100"), "{kept}");
    assert!(!quiet.contains("warmup"), "{quiet}");
    let (cut, warned) = printed(&["--steps", "40"]);
    assert!(cut.contains("warmup_steps = 10"), "{cut}");
    assert!(
        warned.contains("train.warmup_steps 100 would not end within the run"),
        "{warned}"
    );
    let (_, long) = printed(&["--steps", "40", "--lr", "0.01"]);
    assert!(!long.contains("never reaches"), "{long}");
    std::fs::write(
        dir.path().join("w.toml"),
        "[train]\nsteps = 50\nwarmup_steps = 60\n",
    )
    .unwrap();
    let warm = strata(&[
        "train",
        "--config",
        dir.path().join("w.toml").to_str().unwrap(),
        "--print-config",
    ]);
    let stderr = String::from_utf8_lossy(&warm.stderr);
    assert!(
        stderr.contains("the warmup (60 steps) is at least as long as the run (train.steps = 50)"),
        "{stderr}"
    );
    let missing = stderr_of_failure(
        &strata(&["train", "--resume", "nowhere"]),
        "--resume nowhere",
    );
    assert!(missing.contains("no checkpoint there"), "{missing}");
    std::fs::write(dir.path().join("e.toml"), "[train]\ncheckpoint_every = 5\n").unwrap();
    let every = strata(&[
        "train",
        "--config",
        dir.path().join("e.toml").to_str().unwrap(),
        "--print-config",
    ]);
    let stderr = String::from_utf8_lossy(&every.stderr);
    assert!(
        stderr.contains("train.checkpoint_every = 5 but no checkpoint directory"),
        "{stderr}"
    );
    let zero = stderr_of_failure(
        &strata(&["train", "--config", config, "--stop-after", "0"]),
        "--stop-after 0",
    );
    assert!(zero.contains("--stop-after 0 runs no step"), "{zero}");
}

/// A token file of `count` ids below `vocab` (u16), seeded.
fn token_file(path: &std::path::Path, count: usize, vocab: u16) {
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let bytes: Vec<u8> = (0..count)
        .flat_map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            ((state % u64::from(vocab)) as u16).to_le_bytes()
        })
        .collect();
    std::fs::write(path, bytes).unwrap();
}

fn read_json(path: &std::path::Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

/// The committed Hugging Face fixture (train/tests/fixtures/hf/) with the
/// most to check: fewer key/value heads than query heads, an untied head,
/// scaled rotary frequencies (the first such by name).
fn hf_fixture() -> std::path::PathBuf {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("train/tests/fixtures/hf");
    let mut dirs: Vec<_> = std::fs::read_dir(&root)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.join("config.json").exists())
        .collect();
    dirs.sort();
    dirs.into_iter()
        .find(|dir| {
            let c = read_json(&dir.join("config.json"));
            c["tie_word_embeddings"] == false
                && c["num_key_value_heads"].as_u64() < c["num_attention_heads"].as_u64()
                && c["rope_parameters"]["factor"].is_number()
        })
        .expect("a fixture with grouped-query heads, an untied head and scaled rotary frequencies")
}

#[test]
fn train_init_from_a_hugging_face_folder_fine_tunes_checkpoints_and_resumes_bit_identically() {
    let dir = tempdir();
    token_file(&dir.path().join("tok.bin"), 4096, 48);
    // Small shards, so the checkpoint's weights come with an index.
    std::fs::write(
        dir.path().join("ft.toml"),
        "[train]\nsteps = 20\nmicro_batch = 2\ncheckpoint_every = 10\nwarmup_steps = 2\n[checkpoint]\nmax_shard_size = \"8KiB\"\n",
    )
    .unwrap();
    let fixture = hf_fixture();
    let theirs = read_json(&fixture.join("config.json"));
    let base = |ck: &str| -> Vec<String> {
        [
            "train",
            "--config",
            "ft.toml",
            "--init-from",
            fixture.to_str().unwrap(),
            "--tokens",
            "tok.bin",
            "--checkpoint-dir",
            ck,
            "--json",
        ]
        .map(String::from)
        .to_vec()
    };
    let run = |args: Vec<String>| {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        strata_in(dir.path(), &args)
    };
    let whole = last_json_line(&run(base("a")));
    assert_eq!(whole["steps"], 20);
    assert!(
        whole["loss_last"].as_f64() < whole["loss_first"].as_f64(),
        "{whole}"
    );
    // The fixture's loss is about ln(48) = 3.87 from its weights: the
    // first step starts from them, not from a fresh initialization.
    let first = whole["loss_first"].as_f64().unwrap();
    assert!((3.5..4.5).contains(&first), "{whole}");
    // Interrupted at step 10 and resumed: the same bits at step 20.
    let mut part = base("b");
    part.extend(["--stop-after".into(), "10".into()]);
    last_json_line(&run(part));
    let mut resumed = base("b");
    resumed.extend(["--resume".into(), "b".into()]);
    last_json_line(&run(resumed));
    let (a, b) = (
        dir.path().join("a/step-00000020"),
        dir.path().join("b/step-00000020"),
    );
    let mut files: Vec<String> = std::fs::read_dir(&a)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n != "meta.json" && n != "meta.json.xxh3")
        .collect();
    files.sort();
    // The run's config differs only in where its checkpoints went and
    // where it started (a resumed run starts from its checkpoint).
    let config = |dir: &std::path::Path| {
        std::fs::read_to_string(dir.join("strata.toml"))
            .unwrap()
            .lines()
            .filter(|l| !l.starts_with("checkpoint_dir = ") && !l.starts_with("init_from = "))
            .collect::<Vec<_>>()
            .join("\n")
    };
    assert_eq!(config(&a), config(&b));
    for name in files.iter().filter(|n| *n != "strata.toml") {
        assert_eq!(
            std::fs::read(a.join(name)).unwrap(),
            std::fs::read(b.join(name)).unwrap(),
            "{name} differs between the whole run and the resumed one"
        );
    }
    // A Hugging Face folder: config, generation config, bf16 shards and
    // their index.
    assert!(
        files.contains(&"generation_config.json".to_string()),
        "{files:?}"
    );
    assert!(
        files.contains(&"model.safetensors.index.json".to_string()),
        "{files:?}"
    );
    let config = read_json(&a.join("config.json"));
    for key in [
        "architectures",
        "model_type",
        "num_key_value_heads",
        "tie_word_embeddings",
        "intermediate_size",
        "rms_norm_eps",
    ] {
        assert_eq!(config[key], theirs[key], "{key}");
    }
    assert_eq!(config["torch_dtype"], "bfloat16");
    assert_eq!(
        config["rope_scaling"]["factor"],
        theirs["rope_parameters"]["factor"]
    );
    // The special tokens and generation settings of the folder it came from.
    for key in ["bos_token_id", "eos_token_id", "pad_token_id"] {
        assert_eq!(config[key], theirs[key], "{key}");
    }
    assert_eq!(
        std::fs::read(a.join("generation_config.json")).unwrap(),
        std::fs::read(fixture.join("generation_config.json")).unwrap()
    );
    // Every tensor transformers saved, under its name, and no other.
    let index = read_json(&a.join("model.safetensors.index.json"));
    let map = index["weight_map"].as_object().unwrap();
    let mut ours: Vec<&String> = map.keys().collect();
    let their_index = read_json(&fixture.join("model.safetensors.index.json"));
    let mut saved: Vec<&String> = their_index["weight_map"]
        .as_object()
        .unwrap()
        .keys()
        .collect();
    ours.sort();
    saved.sort();
    assert_eq!(ours, saved);
    for shard in map.values().map(|v| v.as_str().unwrap()) {
        let bytes = std::fs::read(a.join(shard)).unwrap();
        let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        for (name, view) in file.tensors() {
            assert_eq!(view.dtype(), safetensors::Dtype::BF16, "{name}");
        }
    }
    // The step directory starts another run as it is.
    let again = strata_in(
        dir.path(),
        &[
            "train",
            "--init-from",
            a.to_str().unwrap(),
            "--tokens",
            "tok.bin",
            "--steps",
            "2",
            "--json",
        ],
    );
    let again = last_json_line(&again);
    let last = whole["loss_last"].as_f64().unwrap();
    assert!(
        (again["loss_first"].as_f64().unwrap() - last).abs() < 0.5,
        "{again} after {whole}"
    );
    // transformers opens it, where a Python with it is named.
    if let Ok(python) = std::env::var("STRATA_FIXTURE_PYTHON") {
        let out = Command::new(python)
            .args([
                "-c",
                "import sys, transformers; m = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1]); print(type(m).__name__, m.dtype)",
            ])
            .arg(&a)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let class = theirs["architectures"][0].as_str().unwrap();
        assert!(text.contains(&format!("{class} torch.bfloat16")), "{text}");
    } else {
        println!(
            "skipped transformers' from_pretrained: set STRATA_FIXTURE_PYTHON to a Python with transformers"
        );
    }
}

#[test]
fn train_init_from_bad_folders_are_refused_naming_the_file_and_the_fix() {
    let dir = tempdir();
    token_file(&dir.path().join("tok.bin"), 1024, 48);
    let copy = |name: &str| -> std::path::PathBuf {
        let to = dir.path().join(name);
        std::fs::create_dir_all(&to).unwrap();
        for entry in std::fs::read_dir(hf_fixture()).unwrap().flatten() {
            std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
        }
        to
    };
    let refused = |folder: &std::path::Path, extra: &[&str]| -> String {
        let mut args = vec![
            "train",
            "--init-from",
            folder.to_str().unwrap(),
            "--tokens",
            "tok.bin",
            "--steps",
            "2",
        ];
        args.extend(extra);
        let output = strata_in(dir.path(), &args);
        stderr_of_failure(&output, folder)
    };
    let missing = dir.path().join("nowhere");
    let err = refused(&missing, &[]);
    assert!(
        err.contains("nowhere") && err.contains("not a directory"),
        "{err}"
    );
    let shard = copy("shard");
    std::fs::remove_file(shard.join("model-00002-of-00003.safetensors")).unwrap();
    let err = refused(&shard, &[]);
    assert!(
        err.contains("model-00002-of-00003.safetensors")
            && err.contains("download the missing one"),
        "{err}"
    );
    let corrupt = copy("corrupt");
    let file = corrupt.join("model-00001-of-00003.safetensors");
    let mut bytes = std::fs::read(&file).unwrap();
    bytes[12] = b'#';
    std::fs::write(&file, bytes).unwrap();
    let err = refused(&corrupt, &[]);
    assert!(
        err.contains("model-00001-of-00003.safetensors")
            && err.contains("corrupt safetensors header"),
        "{err}"
    );
    let unparsed = copy("unparsed");
    std::fs::write(unparsed.join("config.json"), "{\"model_type\": ").unwrap();
    let err = refused(&unparsed, &[]);
    assert!(
        err.contains("config.json") && err.contains("does not parse"),
        "{err}"
    );
    let unknown = copy("unknown");
    let mut config = read_json(&unknown.join("config.json"));
    config["model_type"] = "falcon".into();
    std::fs::write(unknown.join("config.json"), config.to_string()).unwrap();
    let err = refused(&unknown, &[]);
    assert!(
        err.contains("falcon") && err.contains("strata trains these architectures: \""),
        "{err}"
    );
    let shape = copy("shape");
    let mut config = read_json(&shape.join("config.json"));
    let (ffn, hidden) = (
        config["intermediate_size"].as_u64().unwrap(),
        config["hidden_size"].as_u64().unwrap(),
    );
    config["intermediate_size"] = (ffn + 8).into();
    std::fs::write(shape.join("config.json"), config.to_string()).unwrap();
    let err = refused(&shape, &[]);
    assert!(
        err.contains(&format!("of shape [{ffn}, {hidden}]"))
            && err.contains(&format!("needs [{}, {hidden}]", ffn + 8)),
        "{err}"
    );
    // A model whose positions are a table trains at exactly its rows.
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("train/tests/fixtures/hf");
    let table = std::fs::read_dir(&root)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| {
            p.join("config.json").exists()
                && read_json(&p.join("config.json"))["n_positions"].is_u64()
        })
        .expect("a fixture with a position table");
    let rows = read_json(&table.join("config.json"))["n_positions"]
        .as_u64()
        .unwrap();
    std::fs::write(
        dir.path().join("s.toml"),
        format!("[model]\nseq = {}\n", rows / 2),
    )
    .unwrap();
    let err = refused(&table, &["--config", "s.toml"]);
    assert!(
        err.contains(&format!("a table of {rows} positions"))
            && err.contains(&format!("model.seq = {rows}")),
        "{err}"
    );
    std::fs::write(
        dir.path().join("h.toml"),
        format!("[model]\nhidden = {}\n", 2 * hidden),
    )
    .unwrap();
    let err = refused(&hf_fixture(), &["--config", "h.toml"]);
    assert!(
        err.contains(&format!("model.hidden = {hidden}"))
            && err.contains(&format!("sets {}", 2 * hidden)),
        "{err}"
    );
}

#[test]
fn bench_load_json_contract_tiny() {
    let dir = tempdir();
    let d = dir.path().join("load");
    let output = strata(&[
        "bench",
        "load",
        "--dir",
        d.to_str().unwrap(),
        "--layers",
        "2",
        "--hidden",
        "32",
        "--heads",
        "4",
        "--kv-heads",
        "2",
        "--ffn",
        "64",
        "--vocab",
        "500",
        "--seq",
        "16",
        "--steps",
        "2",
        "--max-shard-size",
        "16KiB",
        "--nvme-size",
        "8MiB",
        "--rest-s",
        "0",
        "--device-budget",
        "64MiB",
        "--json",
    ]);
    let report = stdout_json(&output);
    assert_eq!(report["steps"], 2, "{report}");
    for key in ["disk_after_run_bytes_per_s", "disk_rested_bytes_per_s"] {
        let rates = report[key].as_array().unwrap();
        assert!(rates.iter().all(|r| r.as_f64().unwrap() > 0.0), "{report}");
    }
    let file_bytes = report["file_bytes"].as_u64().unwrap();
    assert!(
        file_bytes > 2 * report["params"].as_u64().unwrap(),
        "{report}"
    );
    for key in [
        "first_step_s",
        "bound_s",
        "ratio",
        "load_s",
        "read_bw_bytes",
        "write_bw_bytes",
    ] {
        assert!(report[key].as_f64().unwrap() > 0.0, "{key} in {report}");
    }
    assert!(
        report["load_written_bytes"].as_u64().unwrap() > 0,
        "{report}"
    );
    let peak = report["peak_bytes"].as_u64().unwrap();
    assert!(
        peak > 0 && peak <= report["peak_bound_bytes"].as_u64().unwrap(),
        "{report}"
    );
    // Everything it made is removed.
    let left: Vec<_> = std::fs::read_dir(&d)
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

/// A `[model]` key set to the value transformers takes for a key the
/// folder's config.json leaves out agrees with the folder, and
/// `max_positions` set in the config is the run's, not the folder's.
#[test]
fn train_init_from_takes_transformers_defaults_and_the_configs_positions() {
    let dir = tempdir();
    let folder = dir.path().join("folder");
    std::fs::create_dir_all(&folder).unwrap();
    for entry in std::fs::read_dir(hf_fixture()).unwrap().flatten() {
        std::fs::copy(entry.path(), folder.join(entry.file_name())).unwrap();
    }
    let mut config = read_json(&folder.join("config.json"));
    config.as_object_mut().unwrap().remove("rms_norm_eps");
    std::fs::write(folder.join("config.json"), config.to_string()).unwrap();
    let arch = config["model_type"].as_str().unwrap().to_owned();
    // `strata train --print-config` of a run.toml whose [model] has `keys`.
    let print_config = |keys: &str| {
        std::fs::write(
            dir.path().join("run.toml"),
            format!("[model]\narch = \"{arch}\"\n{keys}"),
        )
        .unwrap();
        let folder = folder.to_str().unwrap();
        let args = [
            "train",
            "--config",
            "run.toml",
            "--init-from",
            folder,
            "--print-config",
        ];
        strata_in(dir.path(), &args)
    };
    let output = print_config("norm_eps = 1e-6\nmax_positions = 4096\n");
    assert!(
        output.status.success(),
        "{}",
        stderr_of_failure(&output, "print-config")
    );
    let printed: toml::Table = toml::from_str(&String::from_utf8_lossy(&output.stdout)).unwrap();
    let model = printed["model"].as_table().unwrap();
    assert_eq!(model["norm_eps"].as_float(), Some(1e-6), "{model:?}");
    assert_eq!(model["max_positions"].as_integer(), Some(4096), "{model:?}");
    // Positions below the folder's bound the sequence a run takes from it
    // (through the library: a config file's own check asks for a seq
    // within its max_positions first).
    let positions = config["max_position_embeddings"].as_u64().unwrap() as usize;
    let mut run = strata::train::TrainConfig::default();
    run.model.init_from = Some(folder.clone());
    run.model.max_positions = Some(positions / 2);
    let set = ["max_positions".to_string()].into_iter().collect();
    let resolved = run.with_init_from(&set).unwrap();
    assert_eq!(resolved.model.seq, positions / 2);
    // A value other than transformers' default disagrees with the folder.
    let output = print_config("norm_eps = 1e-5\n");
    let err = stderr_of_failure(&output, "disagreeing norm_eps");
    assert!(
        err.contains("model.norm_eps") && err.contains("1e-6"),
        "{err}"
    );
}

/// `--resume auto`: in a checkpoint directory with no checkpoint the run
/// starts there; the same command again (as a launcher that restarts
/// failed jobs runs it) resumes from the newest checkpoint, and the two
/// give the losses of the run straight through, bit for bit. Without a
/// checkpoint directory it is refused by name.
#[test]
fn train_resume_auto_starts_then_resumes_tiny() {
    let dir = tempdir();
    let losses = |summary: &serde_json::Value| -> Vec<f64> {
        summary["losses"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap())
            .collect()
    };
    let auto = |extra: &[&str]| {
        let mut all = vec![
            "train",
            "--steps",
            "6",
            "--json",
            "--checkpoint-dir",
            "ck",
            "--resume",
            "auto",
        ];
        all.extend_from_slice(extra);
        losses(&last_json_line(&strata_in(dir.path(), &all)))
    };
    let first = auto(&["--stop-after", "3"]);
    assert_eq!(first.len(), 3);
    let rest = auto(&[]);
    let straight = losses(&last_json_line(&strata_in(
        dir.path(),
        &["train", "--steps", "6", "--json"],
    )));
    assert_eq!([first, rest].concat(), straight);
    let err = stderr_of_failure(
        &strata_in(dir.path(), &["train", "--resume", "auto"]),
        "--resume auto without a checkpoint directory",
    );
    assert!(
        err.contains("--resume auto") && err.contains("--checkpoint-dir"),
        "{err}"
    );
}
