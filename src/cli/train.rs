//! `strata train`: a model (`[model] arch`) trained with its model states
//! tiered across device memory, pinned host RAM and NVMe, ZeRO-3 sharded
//! over ranks; with no arguments, a small model on the text bundled in
//! `examples/data/`, swapping to `./strata-train-swap`.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::Args;
use strata_runtime::Link;
use strata_train::{self as engine, ByteCorpus, RunOptions, RunSummary, TrainConfig, TrainError};

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
    /// Steps to run (overrides train.steps; a train.warmup_steps as long
    /// as the run or longer is cut to a quarter of it, with a warning).
    #[arg(long)]
    steps: Option<u64>,
    /// A text to train on instead of the bundled one (byte tokens).
    #[arg(long, conflicts_with = "tokens")]
    data: Option<PathBuf>,
    /// A file of token ids to train on (little-endian, see --token-dtype;
    /// nanoGPT's train.bin is u16), mapped, not read into memory; the
    /// model's vocab must cover its ids.
    #[arg(long)]
    tokens: Option<PathBuf>,
    /// How --tokens stores each id: u16 or u32.
    #[arg(long, default_value = "u16", requires = "tokens")]
    token_dtype: engine::TokenDtype,
    /// Start from a Hugging Face model folder (config.json and safetensors
    /// weights, one file or shards with an index; bf16, fp16 or f32):
    /// its config gives [model] (a [model] key that disagrees is refused;
    /// model.seq may be shorter), its weights the initial values, read
    /// group by group straight into their tiers (sets model.init_from).
    #[arg(long, value_name = "DIR")]
    init_from: Option<PathBuf>,
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
    /// Seconds a run may take after SIGINT or SIGTERM to finish its step
    /// and write a final checkpoint; past it (or at a second signal) it
    /// exits at once, keeping the last whole checkpoint. Schedulers
    /// (Slurm, Kubernetes) give about 30 s before SIGKILL.
    #[arg(long, value_name = "SECONDS", default_value_t = SIGNAL_GRACE_DEFAULT_S)]
    signal_grace: f64,
}

/// `--signal-grace`'s default: under the 30 s most schedulers give.
const SIGNAL_GRACE_DEFAULT_S: f64 = 25.0;

/// The run's config: `--config` (or the defaults), then `--deepspeed`'s
/// keys, then the flags.
fn load_config(args: &TrainArgs) -> anyhow::Result<TrainConfig> {
    let (mut config, model_keys) = match &args.config {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("cannot read config {}", path.display()))?;
            let config = TrainConfig::from_toml(&text)
                .with_context(|| format!("config {}", path.display()))?;
            (config, TrainConfig::model_keys_in(&text))
        }
        None => (TrainConfig::default(), Default::default()),
    };
    if let Some(dir) = &args.init_from {
        config.model.init_from = Some(dir.clone());
    }
    // [model] from the folder's config.json, before anything else reads it.
    config = config.with_init_from(&model_keys)?;
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
        // A warmup that would not end within the run is cut to a quarter
        // of it, and said so; one that ends within it is left as set (a
        // silent cut changed the schedule of runs that named their steps,
        // and of a resumed run against the one it resumes).
        let warmup = config.train.warmup_steps;
        if warmup >= steps {
            config.train.warmup_steps = steps / 4;
            tracing::warn!(
                "--steps {steps}: train.warmup_steps {warmup} would not end within the run; \
                 warming up for {} steps (a quarter of it) instead",
                config.train.warmup_steps
            );
        }
    }
    if let Some(dir) = &args.checkpoint_dir {
        config.train.checkpoint_dir = Some(dir.clone());
    }
    if config.train.checkpoint_dir.is_none() {
        // Said at once: found out at a SIGTERM, it costs the steps since.
        if let Some(resume) = &args.resume {
            tracing::warn!(
                "--resume {}: this run writes no checkpoints (no --checkpoint-dir, no \
                 train.checkpoint_dir): pass --checkpoint-dir to go on writing them",
                resume.display()
            );
        } else if config.train.checkpoint_every > 0 {
            tracing::warn!(
                "train.checkpoint_every = {} but no checkpoint directory: the run writes no \
                 checkpoints; pass --checkpoint-dir or set train.checkpoint_dir",
                config.train.checkpoint_every
            );
        }
    }
    config.validate()?;
    Ok(config)
}

/// Runs `strata train`: exits 0, or 128 + the signal that stopped it.
pub fn run(args: TrainArgs) -> anyhow::Result<ExitCode> {
    if !(args.signal_grace.is_finite() && args.signal_grace >= 0.0) {
        bail!(
            "--signal-grace {} is not a number of seconds: give one at least 0 (default {SIGNAL_GRACE_DEFAULT_S})",
            args.signal_grace
        );
    }
    // Before any thread starts, so that every one inherits the mask.
    let blocked = super::signals::block().context("block SIGINT and SIGTERM for the run")?;
    let config = load_config(&args)?;
    if args.print_config {
        print!("{}", config.to_toml()?);
        return Ok(ExitCode::SUCCESS);
    }
    let corpus = match (&args.tokens, &args.data) {
        (Some(path), _) => engine::Corpus::open_tokens(path, args.token_dtype, config.model.seq)?,
        (None, Some(path)) => ByteCorpus::new(
            std::fs::read(path)
                .with_context(|| format!("cannot read --data {}", path.display()))?,
            config.model.seq,
        )?,
        (None, None) => ByteCorpus::new(DEFAULT_TEXT.as_bytes().to_vec(), config.model.seq)?,
    };
    if args.stop_after == Some(0) {
        bail!("--stop-after 0 runs no step: give the step to stop after, from 1");
    }
    let options = RunOptions {
        stop_after: args.stop_after,
        resume: args.resume.clone(),
        trace: args.trace.clone(),
        overwrite: args.overwrite,
        ..RunOptions::default()
    };
    let grace = Duration::from_secs_f64(args.signal_grace);
    let dir = config.train.checkpoint_dir.clone();
    super::signals::watch(blocked, options.stop.clone(), grace, move || {
        last_checkpoint(dir.as_deref())
    })
    .context("start the signal thread")?;
    tracing::info!(
        "on SIGINT or SIGTERM the run stops after its current step{}, within --signal-grace {:.0} s; past it, or at a second signal, it aborts the step",
        if config.train.checkpoint_dir.is_some() {
            " and writes a checkpoint"
        } else {
            ""
        },
        args.signal_grace
    );
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
        "training {} parameters ({} {} layers, hidden {}), {} rank(s), params on {:?}, optimizer on {:?}",
        config.model.build()?.params(),
        config.model.arch,
        config.model.layers,
        config.model.hidden,
        config.train.ranks,
        config.placement.params,
        config.placement.optimizer,
    );
    let mut moved_before = [0u64; 4];
    let mut timing = StopTiming::default();
    let summary = engine::run(&config, &corpus, &options, &mut |progress| {
        let r = progress.report;
        timing.observe(
            r.seconds,
            progress.checkpoint_s.or(progress.checkpoint_estimate_s),
            args.signal_grace,
        );
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
    });
    bar.finish_and_clear();
    let summary = match summary {
        Err(TrainError::Aborted { code }) => {
            eprintln!(
                "aborted mid-step by {}: {}{}",
                super::signals::name(code),
                last_checkpoint(config.train.checkpoint_dir.as_deref()),
                match &config.train.checkpoint_dir {
                    Some(dir) if dir.join("latest").exists() =>
                        format!("; go on with: strata train ... --resume {}", dir.display()),
                    _ => String::new(),
                }
            );
            return Ok(ExitCode::from(super::signals::exit_status(code)));
        }
        other => other?,
    };
    print_summary(&summary, config.model.layers, args.json)?;
    let Some(signal) = summary.stopped_by else {
        return Ok(ExitCode::SUCCESS);
    };
    eprintln!(
        "stopped by {} after step {}{}",
        super::signals::name(signal),
        summary.last_step,
        match (&config.train.checkpoint_dir, summary.checkpoints.last()) {
            (Some(dir), Some(_)) =>
                format!("; go on with: strata train ... --resume {}", dir.display()),
            _ => " (no checkpoint: the run writes none)".into(),
        }
    );
    Ok(ExitCode::from(super::signals::exit_status(signal)))
}

/// What stays when the run is stopped mid-step: the checkpoint `latest`
/// names in `dir`, read at that moment.
fn last_checkpoint(dir: Option<&Path>) -> String {
    let Some(dir) = dir else {
        return "the run writes no checkpoints".into();
    };
    match std::fs::read_to_string(dir.join("latest")) {
        Ok(name) => format!(
            "the last whole checkpoint is {}",
            dir.join(name.trim()).display()
        ),
        Err(_) => format!("no checkpoint was written in {} yet", dir.display()),
    }
}

/// Says once how long a stop takes (a step, then a checkpoint), as soon as
/// both were measured, and warns when that passes `--signal-grace`.
#[derive(Default)]
struct StopTiming {
    step_s: Option<f64>,
    checkpoint_s: Option<f64>,
    said: bool,
}

impl StopTiming {
    fn observe(&mut self, step_s: f64, checkpoint_s: Option<f64>, grace_s: f64) {
        // The first step also warms caches: the second is the estimate.
        self.step_s = Some(self.step_s.map_or(step_s, |first: f64| first.min(step_s)));
        self.checkpoint_s = checkpoint_s.or(self.checkpoint_s);
        let (Some(step), Some(checkpoint)) = (self.step_s, self.checkpoint_s) else {
            return;
        };
        if self.said {
            return;
        }
        self.said = true;
        let stop = step + checkpoint;
        if stop > grace_s {
            tracing::warn!(
                "a stop takes about {stop:.1} s (a step {step:.1} s, a checkpoint {checkpoint:.1} s), more than --signal-grace {grace_s:.0} s: a signal may end the run mid-step, keeping the checkpoint before"
            );
        } else {
            tracing::info!(
                "a stop takes about {stop:.1} s (a step {step:.1} s, a checkpoint {checkpoint:.1} s), within --signal-grace {grace_s:.0} s"
            );
        }
    }
}

fn mib(bytes: u64) -> String {
    format!("{:.1}MiB", bytes as f64 / (1 << 20) as f64)
}

fn print_summary(summary: &RunSummary, layers: usize, json: bool) -> anyhow::Result<()> {
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
    println!(
        "activations: {} of {layers} blocks recompute their forward in backward (train.checkpoint_activations)",
        summary.recomputed_blocks
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
    for failure in &summary.checkpoint_failures {
        println!(
            "checkpoint of step {} NOT written (the run went on): {}",
            failure.step, failure.cause
        );
    }
    if json {
        println!("{}", serde_json::to_string(summary)?);
    }
    Ok(())
}
