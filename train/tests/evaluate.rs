//! Evaluation through the engine: forward-only passes with the parameters
//! where training keeps them. The loss is every window's mean next-token
//! cross-entropy (computed here in f64 from the model's whole logits)
//! whatever the ranks, micro-batches and placement; parameters on NVMe
//! evaluate to the bits of parameters in host memory; a pass gives the
//! loss its step reports on the same tokens, masks and all; and an
//! evaluation between steps changes no step's bits, late updates included.
//! The weights are the committed tiny fixture whose weights are bf16
//! (held exactly by strata's bf16 copies), computed in f32.

use std::path::Path;

use strata_device::{View, ViewMut};
use strata_kernels::CpuBackend;
use strata_storage::ByteSize;
use strata_train::hf::HfFolder;
use strata_train::model::forward_logits;
use strata_train::{
    ComputeDtype, Corpus, Engine, Evaluation, NOT_A_TARGET, Placement, TokenDtype, Tokenized,
    TrainConfig, evaluate,
};

const SEQ: usize = 8;

mod common;
use common::bf16_folder as folder;

/// The fixture from its folder, f32 compute, `ranks x grad_accumulation x
/// micro_batch` sequences a step, the parameters and optimizer states
/// where `placement` says.
fn config(
    dir: &Path,
    (ranks, grad_accumulation, micro_batch): (usize, usize, usize),
    placement: Placement,
) -> TrainConfig {
    let mut config = TrainConfig::default();
    config.model.init_from = Some(folder());
    config.model.seq = SEQ;
    config.train.ranks = ranks;
    config.train.grad_accumulation = grad_accumulation;
    config.train.micro_batch = micro_batch;
    config.train.steps = 8;
    config.train.warmup_steps = 1;
    config.train.compute_dtype = ComputeDtype::F32;
    config.placement.params = placement;
    config.placement.optimizer = placement;
    config.device.budget = ByteSize(64 << 20);
    config.host.budget = ByteSize(256 << 20);
    let nvme = config.nvme.as_mut().unwrap();
    nvme.dirs = vec![dir.join("swap")];
    nvme.capacity = ByteSize(256 << 20);
    nvme.create_dirs = true;
    config.with_init_from(&["seq".to_string()].into()).unwrap()
}

/// Ids below the fixture's vocabulary, the same every run.
fn ids(n: usize, seed: u64, vocab: usize) -> Vec<u32> {
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % vocab as u64) as u32
        })
        .collect()
}

/// `tokens` (marks and all) as a u32 token file in `dir`, opened as a run
/// opens tokenized data.
fn corpus(dir: &Path, tokens: &[u32]) -> Corpus {
    let path = dir.join("held.u32");
    let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
    std::fs::write(&path, bytes).unwrap();
    let targets = tokens.iter().filter(|&&t| t & NOT_A_TARGET == 0).count();
    let tokenized = Tokenized {
        path,
        dtype: TokenDtype::U32,
        documents: 1,
        tokens: tokens.len() as u64,
        reused: false,
        masked: targets < tokens.len(),
        targets: targets as u64,
        eos: None,
    };
    Corpus::open_tokenized(&tokenized, SEQ).unwrap()
}

/// Every window's mean next-token cross-entropy, from the whole logits of
/// the folder's model in f64: the sum and the rows counted.
fn reference(corpus: &Corpus) -> (f64, u64) {
    let (model, groups) = HfFolder::open(&folder())
        .unwrap()
        .read_model(Some(SEQ))
        .unwrap();
    let vocab = model.vocab();
    let blocks: Vec<View<'_>> = groups[1..].iter().map(|g| View::host_slice(g)).collect();
    let mut window = vec![0u32; SEQ + 1];
    let (mut sum, mut rows) = (0f64, 0u64);
    for w in 0..corpus.windows() {
        corpus.window(w, &mut window);
        let mut logits = vec![0f32; SEQ * vocab];
        forward_logits(
            &*model,
            &CpuBackend,
            View::host_slice(&groups[0]),
            &blocks,
            View::host_slice(&window[..SEQ]),
            ViewMut::host_slice(&mut logits),
        )
        .unwrap();
        for (row, &target) in logits.chunks_exact(vocab).zip(&window[1..]) {
            let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
            let log_sum = row
                .iter()
                .map(|&v| f64::from(v - max).exp())
                .sum::<f64>()
                .ln()
                + f64::from(max);
            sum += log_sum - f64::from(row[target as usize]);
            rows += 1;
        }
    }
    (sum, rows)
}

fn vocab() -> usize {
    let dir = tempfile::tempdir().unwrap();
    config(dir.path(), (1, 1, 1), Placement::Cpu).model.vocab
}

#[test]
fn an_evaluation_is_every_windows_mean_cross_entropy_whatever_the_ranks_and_batch() {
    let dir = tempfile::tempdir().unwrap();
    // Seven windows: no batch below divides them but one.
    let held = corpus(dir.path(), &ids(7 * SEQ + 1, 5, vocab()));
    assert_eq!(held.windows(), 7);
    let (sum, rows) = reference(&held);
    let want = sum / rows as f64;
    let mut host = None;
    for (ranks, accumulation, micro) in [(1, 1, 1), (1, 1, 3), (2, 1, 2), (2, 2, 1), (1, 1, 16)] {
        let swap = tempfile::tempdir().unwrap();
        let config = config(swap.path(), (ranks, accumulation, micro), Placement::Cpu);
        let got = evaluate(&config, None, &held, None, &|_| {}).unwrap();
        let relative = (got.loss - want).abs() / want;
        eprintln!(
            "{ranks} ranks x {accumulation} x {micro}: loss {} (f64 reference {want}, relative {relative:e})",
            got.loss
        );
        assert_eq!((got.windows, got.targets), (7, rows));
        assert!(relative <= 1e-5, "{got:?} against {want}");
        assert!((got.perplexity - got.loss.exp()).abs() <= 1e-12 * got.perplexity);
        if (ranks, accumulation, micro) == (1, 1, 3) {
            host = Some(got);
        }
    }
    // On NVMe, parameters and states move under the plans: the same bits.
    let swap = tempfile::tempdir().unwrap();
    let offloaded = config(swap.path(), (1, 1, 3), Placement::Nvme);
    let got = evaluate(&offloaded, None, &held, None, &|_| {}).unwrap();
    assert_eq!(got.loss, host.unwrap().loss, "NVMe against host memory");
    // The first windows alone.
    let first = evaluate(&offloaded, None, &held, Some(3), &|_| {}).unwrap();
    assert_eq!((first.windows, first.targets), (3, 3 * SEQ as u64));
}

/// Rank `r`'s engine of a group of `ranks`, each running `work` with it.
fn on_ranks<T: Send>(
    config: &TrainConfig,
    work: impl Fn(usize, &mut Engine) -> T + Sync,
) -> Vec<T> {
    let group = strata_comm::InProcess::group(config.train.ranks, 1 << 20);
    std::thread::scope(|scope| {
        let work = &work;
        let handles: Vec<_> = group
            .into_iter()
            .enumerate()
            .map(|(rank, member)| {
                scope.spawn(move || {
                    let mut engine = Engine::new(config, Box::new(member)).unwrap();
                    work(rank, &mut engine)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// A forward-only pass over a step's windows gives the loss that step
/// reports (before its update), prompts masked as in training.
#[test]
fn a_pass_gives_the_loss_its_step_reports_masks_and_all() {
    let dir = tempfile::tempdir().unwrap();
    let (ranks, accumulation, micro) = (2, 2, 1);
    let sequences = ranks * accumulation * micro;
    // Every third token is no target (a prompt's).
    let tokens: Vec<u32> = ids(sequences * SEQ + 1, 9, vocab())
        .into_iter()
        .enumerate()
        .map(|(i, t)| if i % 3 == 1 { t | NOT_A_TARGET } else { t })
        .collect();
    let held = corpus(dir.path(), &tokens);
    let config = config(dir.path(), (ranks, accumulation, micro), Placement::Cpu);
    let per_rank = accumulation * micro;
    let results: Vec<(Evaluation, f64)> = on_ranks(&config, |rank, engine| {
        let evaluation = engine.evaluate(&held, None, &|_| {}).unwrap();
        let mut mine = vec![0u32; per_rank * (SEQ + 1)];
        for (i, window) in mine.chunks_exact_mut(SEQ + 1).enumerate() {
            held.window((rank * per_rank + i) as u64, window);
        }
        (evaluation, engine.step(&mine).unwrap().loss)
    });
    let (evaluation, step_loss) = &results[0];
    let relative = (evaluation.loss - step_loss).abs() / step_loss;
    eprintln!(
        "pass {} over {} targets, step {step_loss} (relative {relative:e})",
        evaluation.loss, evaluation.targets
    );
    assert!(evaluation.targets < (sequences * SEQ) as u64, "some masked");
    assert!(relative <= 1e-12, "{evaluation:?} against {step_loss}");
    let seen = |e: &Evaluation| (e.windows, e.targets, e.loss);
    assert_eq!(
        seen(&results[1].0),
        seen(&results[0].0),
        "every rank gets the evaluation"
    );
}

/// Steps with evaluations between them compute what steps without do, bit
/// for bit: clipped steps (their updates late) and offloaded states too.
#[test]
fn an_evaluation_between_steps_changes_no_step() {
    let dir = tempfile::tempdir().unwrap();
    let held = corpus(dir.path(), &ids(5 * SEQ + 1, 3, vocab()));
    for (clip, placement) in [(0.0, Placement::Cpu), (1e-3, Placement::Nvme)] {
        let swap = tempfile::tempdir().unwrap();
        let mut config = config(swap.path(), (2, 1, 2), placement);
        config.train.clip_norm = clip;
        let steps = |evaluate_after: &'static [u64]| {
            on_ranks(&config, |rank, engine| {
                let mut losses = Vec::new();
                let mut evaluations = Vec::new();
                let mut lates = Vec::new();
                for step in 1..=4u64 {
                    let tokens = ids(engine.tokens_per_step(), 100 * step + rank as u64, vocab());
                    let report = engine.step(&tokens).unwrap();
                    losses.push(report.loss);
                    lates.push(report.late);
                    if evaluate_after.contains(&step) {
                        evaluations.push(engine.evaluate(&held, None, &|_| {}).unwrap().loss);
                    }
                }
                (losses, evaluations, lates)
            })
            .swap_remove(0)
        };
        let (plain, _, late) = steps(&[]);
        let (evaluated, losses, _) = steps(&[1, 2, 4]);
        eprintln!("clip {clip}, {placement:?}: steps {plain:?}, evaluations {losses:?}");
        assert_eq!(evaluated, plain, "clip {clip}, {placement:?}");
        assert_eq!(losses.len(), 3);
        assert!(losses.iter().all(|l| l.is_finite() && *l > 0.0));
        if clip > 0.0 {
            // Each step after the first ran the last one's update late
            // (an evaluation applies it first).
            assert!(late[1..].iter().all(|&l| l), "{late:?}");
        }
    }
}

/// A model whose bf16 parameters alone are larger than the device's budget
/// evaluates with them on NVMe, streamed block by block under the plans,
/// to the bits of the same model evaluated from host memory; the device's
/// peak stays under the model's size. (The host holds what training holds
/// there: the engine's fp32 gradient shards.)
#[test]
fn a_model_larger_than_the_device_evaluates_offloaded() {
    let dir = tempfile::tempdir().unwrap();
    let shaped = |placement: Placement, device_mib: u64, host_mib: u64| {
        let mut config = TrainConfig::default();
        config.model.seq = 16;
        config.model.hidden = 128;
        config.model.heads = 4;
        config.model.layers = 12;
        config.train.micro_batch = 1;
        config.train.compute_dtype = ComputeDtype::F32;
        config.placement.params = placement;
        config.placement.optimizer = placement;
        config.device.budget = ByteSize(device_mib << 20);
        config.host.budget = ByteSize(host_mib << 20);
        let nvme = config.nvme.as_mut().unwrap();
        nvme.dirs = vec![dir.path().join(format!("swap-{device_mib}"))];
        nvme.capacity = ByteSize(1 << 30);
        nvme.create_dirs = true;
        config
    };
    let text = b"every tensor lives in a tier and moves where the step needs it. ".repeat(8);
    let held = Corpus::new(text, 16).unwrap();
    let model = shaped(Placement::Cpu, 64, 256).model.build().unwrap();
    let params: usize = strata_train::model::initial_values(&*model, 0)
        .iter()
        .map(Vec::len)
        .sum();
    let model_bytes = 2 * params as u64;
    let host = evaluate(
        &shaped(Placement::Cpu, 64, 256),
        None,
        &held,
        Some(8),
        &|_| {},
    )
    .unwrap();
    let offloaded = evaluate(
        &shaped(Placement::Nvme, 4, 64),
        None,
        &held,
        Some(8),
        &|_| {},
    )
    .unwrap();
    eprintln!(
        "{params} parameters ({model_bytes} bytes in bf16): loss {} from host memory, {} from NVMe with peaks of {:?}",
        host.loss, offloaded.loss, offloaded.peak_bytes
    );
    assert_eq!(offloaded.loss, host.loss);
    let peak = offloaded.peak_bytes;
    assert!(
        peak.device < model_bytes,
        "{:?} against a model of {model_bytes} bytes",
        offloaded.peak_bytes
    );
    assert!(
        offloaded.peak_bytes.nvme >= model_bytes,
        "{:?}",
        offloaded.peak_bytes
    );
}
