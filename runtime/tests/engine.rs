//! The training engine end to end on tiny models: loss falls, ranks agree,
//! resume is exact, bad placements are refused before training.

use strata_runtime::engine::{ByteCorpus, Placement, RunOptions, TrainConfig, run};
use strata_storage::ByteSize;

fn corpus(seq: usize) -> ByteCorpus {
    let text = "the quick brown fox jumps over the lazy dog. a stitch in time saves nine. ".repeat(200);
    ByteCorpus::new(text.into_bytes(), seq).unwrap()
}

fn tiny(dir: &std::path::Path) -> TrainConfig {
    let mut config = TrainConfig::default();
    config.model.seq = 16;
    config.model.hidden = 32;
    config.model.heads = 2;
    config.model.layers = 2;
    config.train.steps = 20;
    config.train.micro_batch = 4;
    config.train.warmup_steps = 2;
    config.device.budget = ByteSize(2 << 20);
    config.host.budget = ByteSize(4 << 20);
    config.nvme.as_mut().unwrap().dirs = vec![dir.join("swap")];
    config.nvme.as_mut().unwrap().capacity = ByteSize(64 << 20);
    config
}

#[test]
fn loss_falls_with_states_on_nvme() {
    let dir = tempfile::tempdir().unwrap();
    let config = tiny(dir.path());
    let summary = run(&config, &corpus(16), &RunOptions::default(), &mut |_| {}).unwrap();
    assert_eq!(summary.steps, 20);
    assert!(summary.loss_last < summary.loss_first - 0.5, "{} -> {}", summary.loss_first, summary.loss_last);
    eprintln!("{}", serde_json::to_string(&summary).unwrap());
}

#[test]
fn two_ranks_match_one_rank_with_the_same_global_batch() {
    let dir = tempfile::tempdir().unwrap();
    let mut one = tiny(dir.path());
    one.placement.params = Placement::Cpu;
    let mut two = one.clone();
    two.train.ranks = 2;
    two.train.micro_batch = one.train.micro_batch / 2;
    let a = run(&one, &corpus(16), &RunOptions::default(), &mut |_| {}).unwrap();
    let b = run(&two, &corpus(16), &RunOptions::default(), &mut |_| {}).unwrap();
    for (x, y) in a.reports.iter().zip(&b.reports) {
        let relative = (x.loss - y.loss).abs() / x.loss.abs();
        eprintln!("step {} loss {} vs {} rel {relative:e}", x.step, x.loss, y.loss);
        assert!(relative <= 1e-5, "step {}: {} vs {}", x.step, x.loss, y.loss);
    }
}
