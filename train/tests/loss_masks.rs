//! Loss masks against transformers: a batch whose tokens carry
//! `NOT_A_TARGET` (supervised prompts) gives the loss transformers computes
//! with labels of -100 on the same batch, and the same gradient (its global
//! norm), whether the batch is one micro-batch, several accumulated, or
//! spread over ranks: the step's loss is the mean over the targets it
//! counts on every rank. The fixture is `tests/fixtures/sft/make.py`'s
//! (transformers 5.24, torch 2.15, eager attention, f32) over the one
//! committed tiny model of `tests/fixtures/hf` whose weights are bf16
//! (held exactly by strata's bf16 copies).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use strata_storage::ByteSize;
use strata_train::{ComputeDtype, Engine, NOT_A_TARGET, Placement, StepReport, TrainConfig};

mod common;
use common::bf16_folder;

/// The fixture's sequence length (make.py's SEQ).
const SEQ: usize = 8;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

/// transformers' batch, loss and gradient norm.
struct Reference {
    input_ids: Vec<u32>,
    labels: Vec<i32>,
    loss: f64,
    grad_norm: f64,
}

fn reference() -> Reference {
    let bytes = std::fs::read(fixtures().join("sft/masked.safetensors")).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let words = |name: &str| -> Vec<[u8; 4]> {
        file.tensor(name)
            .unwrap()
            .data()
            .chunks_exact(4)
            .map(|b| [b[0], b[1], b[2], b[3]])
            .collect()
    };
    let float = |name: &str| -> f64 {
        let data = file.tensor(name).unwrap().data().to_vec();
        match data.len() {
            4 => f64::from(f32::from_le_bytes(data[..4].try_into().unwrap())),
            _ => f64::from_le_bytes(data[..8].try_into().unwrap()),
        }
    };
    Reference {
        input_ids: words("input_ids")
            .into_iter()
            .map(|b| i32::from_le_bytes(b) as u32)
            .collect(),
        labels: words("labels")
            .into_iter()
            .map(i32::from_le_bytes)
            .collect(),
        loss: float("loss"),
        grad_norm: float("grad_norm"),
    }
}

/// The batch as strata's windows of `SEQ + 1`: token `i` (from 1) is
/// marked when transformers' label `i` is -100 (position `i - 1` predicts
/// nothing), and the window's last token, which transformers' shift drops,
/// is marked too.
fn windows(r: &Reference) -> Vec<u32> {
    let mut tokens = Vec::new();
    for (ids, labels) in r.input_ids.chunks(SEQ).zip(r.labels.chunks(SEQ)) {
        for (i, (&id, &label)) in ids.iter().zip(labels).enumerate() {
            let masked = i > 0 && label == -100;
            tokens.push(if masked { id | NOT_A_TARGET } else { id });
        }
        tokens.push(NOT_A_TARGET);
    }
    tokens
}

/// The bf16 fixture model from its folder, f32 compute, no clipping, the
/// global batch as `ranks x grad_accumulation x micro_batch`.
fn config(dir: &Path, ranks: usize, grad_accumulation: usize, micro_batch: usize) -> TrainConfig {
    let mut config = TrainConfig::default();
    config.model.init_from = Some(bf16_folder());
    config.model.seq = SEQ;
    config.train.ranks = ranks;
    config.train.grad_accumulation = grad_accumulation;
    config.train.micro_batch = micro_batch;
    config.train.clip_norm = 0.0;
    config.train.steps = 1;
    config.train.compute_dtype = ComputeDtype::F32;
    config.placement.params = Placement::Cpu;
    config.device.budget = ByteSize(64 << 20);
    config.host.budget = ByteSize(256 << 20);
    let nvme = config.nvme.as_mut().unwrap();
    nvme.dirs = vec![dir.join("swap")];
    nvme.capacity = ByteSize(256 << 20);
    nvme.create_dirs = true;
    let set: BTreeSet<String> = ["seq".to_string()].into();
    config.with_init_from(&set).unwrap()
}

/// One step of the batch over `ranks` (rank `r` takes its slice of the
/// global batch); rank 0's report.
fn step(config: &TrainConfig, tokens: &[u32]) -> StepReport {
    let ranks = config.train.ranks;
    let group = strata_comm::InProcess::group(ranks, 1 << 20);
    let per_rank = tokens.len() / ranks;
    let reports: Vec<StepReport> = std::thread::scope(|scope| {
        let handles: Vec<_> = group
            .into_iter()
            .enumerate()
            .map(|(rank, member)| {
                let mine = &tokens[rank * per_rank..(rank + 1) * per_rank];
                scope.spawn(move || {
                    let mut engine = Engine::new(config, Box::new(member)).unwrap();
                    engine.step(mine).unwrap()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    reports.into_iter().next().unwrap()
}

fn assert_close(what: &str, got: f64, want: f64, tolerance: f64) {
    let relative = (got - want).abs() / want.abs();
    assert!(
        relative <= tolerance,
        "{what}: strata {got}, transformers {want} (relative {relative:e})"
    );
}

#[test]
fn a_masked_loss_is_transformers_loss_over_labels_of_minus_100() {
    let r = reference();
    let tokens = windows(&r);
    let batch = r.input_ids.len() / SEQ;
    for (ranks, accumulation) in [(1, 1), (1, batch), (batch, 1)] {
        let dir = tempfile::tempdir().unwrap();
        let micro = batch / ranks / accumulation;
        let report = step(&config(dir.path(), ranks, accumulation, micro), &tokens);
        let what = format!("{ranks} ranks x {accumulation} micro-batches of {micro}");
        eprintln!(
            "{what}: loss {} (transformers {}), grad norm {} (transformers {})",
            report.loss, r.loss, report.grad_norm, r.grad_norm
        );
        assert_close(&format!("{what}: loss"), report.loss, r.loss, 1e-5);
        assert_close(
            &format!("{what}: gradient norm"),
            report.grad_norm,
            r.grad_norm,
            1e-5,
        );
    }
}

/// Without marks the loss is the plain mean, as before masks existed; a
/// mask on every target gives a zero gradient and a loss of 0, said.
#[test]
fn unmasked_and_wholly_masked_batches() {
    let r = reference();
    let dir = tempfile::tempdir().unwrap();
    let config = config(dir.path(), 1, 1, 3);
    let plain: Vec<u32> = windows(&r).iter().map(|t| t & !NOT_A_TARGET).collect();
    let unmasked = step(&config, &plain);
    let masked = step(&config, &windows(&r));
    assert!(unmasked.loss.is_finite() && unmasked.loss != masked.loss);
    let all: Vec<u32> = plain.iter().map(|t| t | NOT_A_TARGET).collect();
    let none = step(&config, &all);
    assert_eq!((none.loss, none.grad_norm), (0.0, 0.0));
}
