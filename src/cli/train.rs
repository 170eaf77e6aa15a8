//! `strata train`: a GPT-2-style model trained with its model states
//! tiered across device memory, pinned host RAM and NVMe, ZeRO-3 sharded
//! over ranks; with no arguments, a small model on the text bundled in
//! `examples/data/`, swapping to `./strata-train-swap`.

use std::path::PathBuf;

use anyhow::{Context, bail};
use clap::Args;
use strata_runtime::Link;
use strata_train::{self as engine, ByteCorpus, RunOptions, RunSummary, TrainConfig};

/// The text `strata train` learns by default (byte tokens).
pub const DEFAULT_TEXT: &str = include_str!("../../examples/data/tiers.txt");

/// Options of `strata train`.
#[derive(Args, Debug)]
pub struct TrainArgs {
    /// A TOML config ([model], [train], [placement], [device], [host],
    /// [nvme], [runtime]); see examples/configs/. Without it: the built-in
    /// small model, states on NVMe under ./strata-train-swap.
    #[arg(long)]
    config: Option<PathBuf>,
    /// A DeepSpeed config (ds_config.json) to run: its keys override the
    /// fields of --config (or the defaults) they map to, and the flags
    /// below override both; see docs/deepspeed-config.md.
    #[arg(long, value_name = "FILE")]
    deepspeed: Option<PathBuf>,
    /// Print the strata config (TOML) the options come to, and exit
    /// without training.
    #[arg(long)]
    print_config: bool,
    /// Steps to run (overrides train.steps).
    #[arg(long)]
    steps: Option<u64>,
    /// A text to train on instead of the bundled one (byte tokens).
    #[arg(long)]
    data: Option<PathBuf>,
    /// Resume from a checkpoint (a step-* directory, or a checkpoint_dir
    /// whose `latest` names one).
    #[arg(long)]
    resume: Option<PathBuf>,
    /// Write checkpoints here (overrides train.checkpoint_dir).
    #[arg(long)]
    checkpoint_dir: Option<PathBuf>,
    /// Start a new run in a checkpoint directory that holds another run's
    /// checkpoints (refused without it unless --resume).
    #[arg(long)]
    overwrite: bool,
    /// Stop after this step (the schedule still spans train.steps): to
    /// interrupt and resume.
    #[arg(long)]
    stop_after: Option<u64>,
    /// Write rank 0's Chrome/Perfetto trace of transfers, spills and waits.
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Print a JSON summary as the last line.
    #[arg(long)]
    json: bool,
}

/// The run's config: `--config` (or the defaults), then `--deepspeed`'s
/// keys, then the flags.
fn load_config(args: &TrainArgs) -> anyhow::Result<TrainConfig> {
    let mut config = match &args.config {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("cannot read config {}", path.display()))?;
            TrainConfig::from_toml(&text).with_context(|| format!("config {}", path.display()))?
        }
        None => TrainConfig::default(),
    };
    if let Some(path) = &args.deepspeed {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read --deepspeed {}", path.display()))?;
        let mapping = engine::from_deepspeed_json(&text, Some(&config))
            .with_context(|| format!("--deepspeed {}", path.display()))?;
        if !mapping.ignored.is_empty() {
            tracing::warn!(
                "--deepspeed {}: these keys have no strata meaning and are ignored: {} (see docs/deepspeed-config.md)",
                path.display(),
                mapping.ignored.join(", ")
            );
        }
        for note in &mapping.notes {
            tracing::warn!("--deepspeed {}: {note}", path.display());
        }
        config = mapping.config;
    }
    if let Some(steps) = args.steps {
        if steps == 0 {
            bail!("--steps must be at least 1");
        }
        config.train.steps = steps;
        config.train.warmup_steps = config.train.warmup_steps.min(steps / 4);
    }
    if let Some(dir) = &args.checkpoint_dir {
        config.train.checkpoint_dir = Some(dir.clone());
    }
    config.validate()?;
    Ok(config)
}

/// Runs `strata train`.
pub fn run(args: TrainArgs) -> anyhow::Result<()> {
    let config = load_config(&args)?;
    if args.print_config {
        print!("{}", config.to_toml()?);
        return Ok(());
    }
    let text = match &args.data {
        Some(path) => {
            std::fs::read(path).with_context(|| format!("cannot read --data {}", path.display()))?
        }
        None => DEFAULT_TEXT.as_bytes().to_vec(),
    };
    let corpus = ByteCorpus::new(text, config.model.seq)?;
    let options = RunOptions {
        stop_after: args.stop_after,
        resume: args.resume.clone(),
        trace: args.trace.clone(),
        overwrite: args.overwrite,
    };
    let total = options
        .stop_after
        .unwrap_or(config.train.steps)
        .min(config.train.steps);
    let bar = super::progress_bar(
        total,
        args.json,
        "{spinner} step {pos}/{len} [{bar:30}] {msg} ({elapsed})",
    );
    tracing::info!(
        "training {} parameters ({} layers, hidden {}), {} rank(s), params on {:?}, optimizer on {:?}",
        config.model.gpt().params(),
        config.model.layers,
        config.model.hidden,
        config.train.ranks,
        config.placement.params,
        config.placement.optimizer,
    );
    let mut moved_before = [0u64; 4];
    let summary = engine::run(&config, &corpus, &options, &mut |progress| {
        let r = progress.report;
        let moved: [u64; 4] = [0, 1, 2, 3].map(|i| progress.stats.links[i].bytes);
        let step_moved: Vec<String> = moved
            .iter()
            .zip(moved_before)
            .map(|(now, before)| mib(now - before))
            .collect();
        moved_before = moved;
        bar.set_position(r.step);
        bar.set_message(format!(
            // Stats' links are in `Link` order: h->nvme, nvme->h, h->d, d->h.
            "loss {:.4}  {:.0} tok/s  moved h->d {} d->h {} nvme->h {} h->nvme {}",
            r.loss,
            r.tokens as f64 / r.seconds,
            step_moved[Link::HostToDevice.index()],
            step_moved[Link::DeviceToHost.index()],
            step_moved[Link::NvmeToHost.index()],
            step_moved[Link::HostToNvme.index()],
        ));
        if bar.is_hidden() && !args.json {
            eprintln!(
                "step {:>5}  loss {:.4}  lr {:.2e}  grad-norm {:.3}{}  {:.0} tok/s  (waited {:.0} ms for the optimizer; it ran at {:.3} G params/s)",
                r.step,
                r.loss,
                r.lr,
                r.grad_norm,
                if r.skipped {
                    "  (overflow: skipped)"
                } else if r.late && r.clip < 1.0 {
                    "  (clipped: updated during the next forward)"
                } else if r.late {
                    "  (updated during the next forward)"
                } else {
                    ""
                },
                r.tokens as f64 / r.seconds,
                r.optimizer_wait_s * 1e3,
                r.optimizer_params_per_s / 1e9,
            );
        }
    })?;
    bar.finish_and_clear();
    print_summary(&summary, args.json)
}

fn mib(bytes: u64) -> String {
    format!("{:.1}MiB", bytes as f64 / (1 << 20) as f64)
}

fn print_summary(summary: &RunSummary, json: bool) -> anyhow::Result<()> {
    println!(
        "trained {} steps: loss {:.4} -> {:.4}, {:.0} tokens/s",
        summary.steps, summary.loss_first, summary.loss_last, summary.tokens_per_s
    );
    println!(
        "model states {} per rank, {:.1}x the device budget of {}",
        mib(summary.model_state_bytes),
        summary.model_state_bytes as f64 / summary.budget_bytes.device as f64,
        mib(summary.budget_bytes.device),
    );
    println!("peak memory per tier (rank 0), measured against the plan's prediction:");
    println!(
        "  {:<8} {:>12} {:>12} {:>12} {:>8}",
        "tier", "budget", "peak", "predicted", "error"
    );
    let budget = summary.budget_bytes.as_array();
    let peak = summary.peak_bytes.as_array();
    let predicted = summary.predicted_peak_bytes.as_array();
    for (i, name) in ["device", "host", "nvme"].iter().enumerate() {
        let error = if peak[i] == 0 {
            0.0
        } else {
            100.0 * (predicted[i] as f64 - peak[i] as f64) / peak[i] as f64
        };
        println!(
            "  {:<8} {:>12} {:>12} {:>12} {:>7.1}%",
            name,
            mib(budget[i]),
            mib(peak[i]),
            mib(predicted[i]),
            error
        );
    }
    println!(
        "  (device includes the {} compute workspace)",
        mib(summary.workspace_bytes)
    );
    if summary.state_cache_bytes > 0 {
        println!(
            "  (host includes the {} state cache)",
            mib(summary.state_cache_bytes)
        );
    }
    for path in &summary.checkpoints {
        println!("checkpoint: {}", path.display());
    }
    if json {
        println!("{}", serde_json::to_string(summary)?);
    }
    Ok(())
}
