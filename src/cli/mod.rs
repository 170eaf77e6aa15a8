//! Subcommands and what they share: logging, progress bars, charts.

mod adam;
mod chart;
mod checkpoint;
mod eval;
mod generate;
mod kernels;
mod load;
mod nproc;
mod nvme;
mod plan;
mod signals;
mod swap;
mod tiers;
mod tokenize;
mod train;

use std::io::IsTerminal;

use clap::{Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};

/// strata: train models far larger than GPU memory by tiering tensors across
/// device memory, pinned host RAM and NVMe.
#[derive(Parser, Debug)]
#[command(name = "strata", version, about, max_term_width = 100)]
pub struct Cli {
    /// Log level: error, warn, info, debug or trace (also STRATA_LOG).
    #[arg(long, global = true, env = "STRATA_LOG", default_value = "info")]
    pub log_level: String,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Measure the hardware paths strata depends on.
    #[command(subcommand)]
    Bench(Bench),
    /// Will a run fit, how is its memory spread over the tiers, how fast
    /// will it step and what limits it (planned and simulated).
    Plan(Box<plan::PlanArgs>),
    /// Train a model (`[model] arch`) with its states tiered across device,
    /// host and NVMe, ZeRO-3 sharded over ranks (no arguments: a small
    /// model on a bundled text).
    Train(Box<train::TrainArgs>),
    /// Inspect checkpoints without training.
    #[command(subcommand)]
    Checkpoint(checkpoint::CheckpointCommand),
    /// A checkpoint's loss and perplexity over held-out data (forward
    /// only, every window once).
    Eval(Box<eval::EvalArgs>),
    /// What a trained model writes after a prompt: a token at a time with
    /// a key/value cache, greedy or sampled, printed as it is made.
    Generate(Box<generate::GenerateArgs>),
}

#[derive(Subcommand, Debug)]
enum Bench {
    /// Sweep request size x queue depth x engine on a drive with O_DIRECT and
    /// recommend a [storage] config.
    Nvme(nvme::NvmeArgs),
    /// A tensor through the swap store (checksums included) against the raw
    /// engine, alternating rounds.
    Swap(swap::SwapArgs),
    /// CPU optimizer kernels (AdamW, the fused bf16 offload step, Adagrad,
    /// Lion, norms) in params/s and bytes/s next to the memory roofline.
    Adam(adam::AdamArgs),
    /// Every path through the runtime (host<->nvme, host<->device, both
    /// directions) next to the raw path in the same run.
    Tiers(tiers::TiersArgs),
    /// The compute backend's attention (forward, backward) and a GEMM in
    /// TFLOPS.
    Kernels(kernels::KernelsArgs),
    /// A Hugging Face model (random, of a 1.24B-parameter shape with
    /// grouped-query heads by default) loaded from evicted files onto NVMe,
    /// a few steps and a checkpoint: the time to the first step against the
    /// disk's rates, and the peak memory against the budgets.
    Load(load::LoadArgs),
    /// Texts or JSONL through a tokenizer as `strata train --tokenizer`
    /// tokenizes them, in tokens/s.
    Tokenize(tokenize::TokenizeArgs),
}

/// Runs the parsed command; the exit status it asks for.
pub fn run(cli: Cli) -> anyhow::Result<std::process::ExitCode> {
    let done = match cli.command {
        Command::Bench(Bench::Nvme(args)) => nvme::run(args),
        Command::Bench(Bench::Swap(args)) => swap::run(args),
        Command::Bench(Bench::Adam(args)) => adam::run(args),
        Command::Bench(Bench::Tiers(args)) => tiers::run(args),
        Command::Bench(Bench::Kernels(args)) => kernels::run(args),
        Command::Bench(Bench::Load(args)) => load::run(args),
        Command::Bench(Bench::Tokenize(args)) => tokenize::run(args),
        Command::Plan(args) => plan::run(*args),
        Command::Train(args) => return train::run(*args),
        Command::Checkpoint(command) => checkpoint::run(command),
        Command::Eval(args) => eval::run(*args),
        Command::Generate(args) => generate::run(*args),
    };
    done.map(|()| std::process::ExitCode::SUCCESS)
}

/// The drive options `bench swap` and `bench tiers` share.
#[derive(clap::Args, Debug)]
pub struct DriveArgs {
    /// Directory on the drive (must exist).
    #[arg(long)]
    dir: std::path::PathBuf,
    /// Request size (and checksum chunk).
    #[arg(long, default_value = "1MiB")]
    block_size: strata_storage::ByteSize,
    /// Requests in flight.
    #[arg(long, default_value_t = 32)]
    queue_depth: usize,
    /// auto, uring or threads.
    #[arg(long, default_value = "auto")]
    engine: strata_storage::EngineChoice,
}

impl DriveArgs {
    /// One directory, striped in request-size units, validated.
    pub fn storage_config(&self) -> anyhow::Result<strata_storage::StorageConfig> {
        let config = strata_storage::StorageConfig {
            dirs: vec![self.dir.clone()],
            block_size: self.block_size,
            stripe_size: self.block_size,
            queue_depth: self.queue_depth,
            engine: self.engine,
            ..Default::default()
        };
        config.validate()?;
        Ok(config)
    }
}

/// Logs go to stderr through tracing, at the asked level.
pub fn init_logging(level: &str) {
    let filter: tracing_subscriber::filter::LevelFilter = level.parse().unwrap_or_else(|_| {
        eprintln!("warning: unknown log level {level:?}; using info (choose error, warn, info, debug or trace)");
        tracing_subscriber::filter::LevelFilter::INFO
    });
    tracing_subscriber::fmt()
        .with_max_level(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_target(false)
        .init();
}

/// A progress bar on stderr, hidden when stderr is not a terminal or the
/// output is JSON.
pub fn progress_bar(total: u64, json: bool, template: &str) -> ProgressBar {
    if json || !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(total);
    bar.set_style(
        ProgressStyle::with_template(template)
            .expect("valid progress template")
            .progress_chars("=> "),
    );
    bar
}

/// The median of some measurements.
pub fn median(values: &mut [f64]) -> f64 {
    assert!(!values.is_empty(), "median of nothing");
    values.sort_by(f64::total_cmp);
    let mid = values.len() / 2;
    if values.len() % 2 == 1 {
        values[mid]
    } else {
        (values[mid - 1] + values[mid]) / 2.0
    }
}
