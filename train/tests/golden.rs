//! Golden losses: the default run and three example configs, 20 steps
//! each, every step's loss compared as f64 bits with values recorded from
//! the code. The guard of every refactor that must leave numerics alone; a
//! deliberate change of numerics re-records them in a commit of its own
//! that says why:
//!
//! ```text
//! STRATA_GOLDEN_RECORD=1 cargo test -p strata-train --test golden
//! ```
//!
//! The bits depend on the instruction set the kernels run with (the
//! optimizer's back end, and fused multiply-adds in the matrix products),
//! so the file holds one recording per machine fingerprint, and recording
//! replaces only this machine's. On a kind of CPU with no recording the
//! test says so and skips, unless `STRATA_REQUIRE_GOLDEN` is set (CI sets
//! it: its machines are of the kinds recorded). `STRATA_ISA=avx2` checks
//! the AVX2 recording on an AVX-512 machine.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use strata_train::{ByteCorpus, DataOrder, RunOptions, TrainConfig, run};

/// Steps of each run.
const STEPS: u64 = 20;

/// The recorded values, beside this file.
fn golden_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/losses.json")
}

/// What the bits depend on besides the code: the optimizer's instruction
/// set and whether the matrix products fuse multiply-adds.
fn fingerprint() -> String {
    #[cfg(target_arch = "x86_64")]
    let fma =
        std::arch::is_x86_feature_detected!("fma") && std::arch::is_x86_feature_detected!("avx");
    #[cfg(not(target_arch = "x86_64"))]
    let fma = false;
    format!(
        "{} {}; gemm fma {fma}",
        std::env::consts::ARCH,
        strata_optim::Isa::chosen()
    )
}

/// The runs: the built-in default (`strata train` with no config, on its
/// built-in text) and the example configs, with their swap directories
/// under `swap`.
///
/// They read their windows in the random order, the one they were recorded
/// with before the epoch order existed (so that these bits guard the
/// compute, not the data order); `default-epoch` is the default run in
/// the epoch order, as `strata train` runs it now.
fn runs(swap: &Path) -> Vec<(&'static str, TrainConfig)> {
    let configs = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/configs");
    let mut runs = vec![("default", TrainConfig::default())];
    for name in ["offload", "resident", "zero3-2rank"] {
        let path = configs.join(format!("{name}.toml"));
        let text = std::fs::read_to_string(&path).unwrap();
        runs.push((name, TrainConfig::from_toml(&text).unwrap()));
    }
    for (_, config) in &mut runs {
        config.data.order = DataOrder::Random;
    }
    runs.push(("default-epoch", TrainConfig::default()));
    for (_, config) in &mut runs {
        // As `strata train --steps 20` runs them: a warmup that would not
        // end within the run is cut to a quarter of it.
        config.train.steps = STEPS;
        if config.train.warmup_steps >= STEPS {
            config.train.warmup_steps = STEPS / 4;
        }
        if let Some(nvme) = &mut config.nvme {
            nvme.dirs = vec![swap.to_path_buf()];
            nvme.create_dirs = true;
        }
    }
    runs
}

/// Every step's loss of each run, as the bits of its f64.
fn measure() -> BTreeMap<String, Vec<String>> {
    let text = include_str!("../../examples/data/tiers.txt");
    let swap = tempfile::tempdir().unwrap();
    let mut losses = BTreeMap::new();
    for (name, config) in runs(swap.path()) {
        let corpus = ByteCorpus::new(text.as_bytes().to_vec(), config.model.seq).unwrap();
        let summary = run(&config, &corpus, &RunOptions::default(), &mut |_| {}).unwrap();
        assert_eq!(summary.losses.len() as u64, STEPS, "{name}");
        let bits = summary
            .losses
            .iter()
            .map(|l| format!("{:016x}", l.to_bits()))
            .collect();
        losses.insert(name.to_string(), bits);
    }
    losses
}

#[derive(serde::Serialize, serde::Deserialize)]
struct Golden {
    /// [`fingerprint`] of the machine that recorded them.
    fingerprint: String,
    /// Per run, each step's loss as the hexadecimal bits of an f64.
    losses: BTreeMap<String, Vec<String>>,
}

/// The file: one recording per kind of machine.
#[derive(Default, serde::Serialize, serde::Deserialize)]
struct Recordings {
    recordings: Vec<Golden>,
}

#[test]
fn every_steps_loss_is_the_recorded_bits() {
    let path = golden_path();
    let mut file: Recordings = std::fs::read_to_string(&path)
        .map(|text| serde_json::from_str(&text).unwrap())
        .unwrap_or_default();
    let here = fingerprint();
    if std::env::var_os("STRATA_GOLDEN_RECORD").is_some() {
        file.recordings.retain(|g| g.fingerprint != here);
        file.recordings.push(Golden {
            fingerprint: here,
            losses: measure(),
        });
        file.recordings
            .sort_by(|a, b| a.fingerprint.cmp(&b.fingerprint));
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        let json = serde_json::to_string_pretty(&file).unwrap();
        std::fs::write(&path, json + "\n").unwrap();
        eprintln!("recorded {}", path.display());
        return;
    }
    let Some(golden) = file.recordings.iter().find(|g| g.fingerprint == here) else {
        let recorded: Vec<&str> = file
            .recordings
            .iter()
            .map(|g| g.fingerprint.as_str())
            .collect();
        let why = format!(
            "recorded on `{}`, this machine is `{here}` (STRATA_ISA picks another instruction set)",
            recorded.join("`, `")
        );
        assert!(
            std::env::var_os("STRATA_REQUIRE_GOLDEN").is_none(),
            "STRATA_REQUIRE_GOLDEN is set but the golden losses do not apply: {why}"
        );
        eprintln!("skipped: golden losses {why}");
        return;
    };
    let measured = measure();
    for (name, expected) in &golden.losses {
        let got = measured
            .get(name)
            .unwrap_or_else(|| panic!("no run {name}"));
        for (step, (e, g)) in expected.iter().zip(got).enumerate() {
            let value = |bits: &str| f64::from_bits(u64::from_str_radix(bits, 16).unwrap());
            assert_eq!(
                e,
                g,
                "{name}: step {} loss {} recorded, {} now",
                step + 1,
                value(e),
                value(g)
            );
        }
        assert_eq!(expected.len(), got.len(), "{name}: steps");
    }
    assert_eq!(golden.losses.len(), measured.len(), "runs");
}
