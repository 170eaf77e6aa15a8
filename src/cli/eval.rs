//! `strata eval`: a checkpoint's loss and perplexity over held-out data,
//! its parameters placed as the run that wrote it placed them (or as a
//! `--config` places them), forward only through the engine.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use strata_storage::ByteSize;
use strata_train::{
    Checkpoint, DataConfig, DataFormat, DataPaths, Placement, TokenDtype, TrainConfig,
};

use super::train::{absolute, open_data};

#[derive(Args, Debug)]
pub struct EvalArgs {
    /// A checkpoint (a step-* directory, or a checkpoint_dir whose
    /// `latest` names one), or any Hugging Face folder of an architecture
    /// strata trains.
    #[arg(long, value_name = "DIR")]
    checkpoint: PathBuf,
    /// Texts or JSONL to evaluate on (through --tokenizer, or the run's
    /// tokenizer; without one a token per byte), files or directories.
    #[arg(long, num_args = 1.., value_name = "FILE", conflicts_with = "tokens")]
    data: Vec<PathBuf>,
    /// Files of token ids to evaluate on (see --token-dtype).
    #[arg(long, num_args = 1.., value_name = "FILE")]
    tokens: Vec<PathBuf>,
    /// How --tokens stores each id: u16 (default) or u32.
    #[arg(long, requires = "tokens")]
    token_dtype: Option<TokenDtype>,
    /// The model's tokenizer for --data (default: the run's).
    #[arg(long, value_name = "DIR", conflicts_with = "tokens")]
    tokenizer: Option<PathBuf>,
    /// Read --data as supervised JSONL (prompt and response): the loss on
    /// the responses alone, as `strata train --sft`.
    #[arg(long, conflicts_with = "tokens")]
    sft: bool,
    /// A TOML config to place the parameters by ([device], [host],
    /// [nvme], [placement], [train] ranks and micro_batch): a checkpoint's
    /// model must be its run's; a Hugging Face folder gives [model].
    /// Without it: the run's config, or for a folder of no run the CPU
    /// device with every state in host memory, sized to this machine.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Sequences a rank's forward pass reads, per micro-batch (default:
    /// the config's train.micro_batch).
    #[arg(long)]
    micro_batch: Option<usize>,
    /// Evaluate the first N windows only (default: every one).
    #[arg(long, value_name = "N")]
    max_windows: Option<u64>,
    /// Print the result as one JSON object.
    #[arg(long)]
    json: bool,
}

pub fn run(args: EvalArgs) -> anyhow::Result<()> {
    let (checkpoint, run) = open_checkpoint(&args.checkpoint)?;
    let given = !args.data.is_empty() || !args.tokens.is_empty();
    if !given && run.is_none() {
        anyhow::bail!(
            "--checkpoint {} is a folder with no run's config to name its data: give --data or --tokens",
            args.checkpoint.display()
        );
    }
    if args.max_windows == Some(0) {
        anyhow::bail!("--max-windows 0: evaluate at least one window, or leave it out for all");
    }
    if args.micro_batch == Some(0) {
        anyhow::bail!("--micro-batch 0: give at least 1 sequence a pass");
    }
    let mut config = placement(&args, checkpoint.as_ref(), run.clone())?;
    if let Some(micro_batch) = args.micro_batch {
        config.train.micro_batch = micro_batch;
    }
    if given {
        let (paths, flag, format) = match args.tokens.is_empty() {
            true => (&args.data, "--data", DataFormat::of_texts(&args.data)),
            false => (&args.tokens, "--tokens", DataFormat::Tokens),
        };
        let format = if args.sft { DataFormat::Sft } else { format };
        let paths = paths
            .iter()
            .map(|path| absolute(path, flag))
            .collect::<anyhow::Result<Vec<_>>>()?;
        // The run's tokenizer, end of documents and attention, where it
        // had them.
        let trained = run.map(|c| c.data).unwrap_or_default();
        let tokenizer = match (&args.tokenizer, format) {
            (_, DataFormat::Tokens) => None,
            (Some(dir), _) => Some(absolute(dir, "--tokenizer")?),
            (None, _) => trained.tokenizer.clone(),
        };
        // The run's end of documents: its eos_id, or its tokenizer's end
        // of text (token files carry no tokenizer of their own).
        let eos_id = match (trained.eos_id, &trained.tokenizer) {
            (Some(id), _) => Some(id),
            (None, Some(dir)) if trained.attention == strata_train::DataAttention::Document => {
                strata_train::TextTokenizer::open(dir)?.eos()
            }
            _ => None,
        };
        config.data = DataConfig {
            path: DataPaths(paths),
            token_dtype: args.token_dtype.unwrap_or_default(),
            tokenizer,
            eos_id,
            // The run's fields, where the format reads them; its
            // attention and cache.
            ..trained.as_format(format)
        };
    } else {
        tracing::warn!(
            "no --data or --tokens: evaluating on the data the run trained on, not held-out data"
        );
    }
    let vocab = config.model.vocab;
    if config.data.tokenizer.is_none() && config.data.format != DataFormat::Tokens && vocab != 256 {
        anyhow::bail!(
            "texts without a tokenizer are read a token per byte, for the built-in model's 256 ids, and this model has {vocab}: give its tokenizer with --tokenizer, or token files with --tokens",
        );
    }
    let corpus = open_data(&config, args.json)?;
    corpus.check_vocab(vocab)?;
    let windows = args
        .max_windows
        .map_or(corpus.windows(), |n| n.min(corpus.windows()));
    let bar = super::progress_bar(
        windows,
        args.json,
        "{spinner} evaluating [{bar:30}] {pos}/{len} windows ({elapsed})",
    );
    let result = strata_train::evaluate(
        &config,
        checkpoint.as_ref(),
        &corpus,
        args.max_windows,
        &|n| bar.inc(n),
    )
    .with_context(|| format!("--checkpoint {}", args.checkpoint.display()))?;
    bar.finish_and_clear();
    if args.json {
        println!("{}", serde_json::to_string(&result)?);
    } else {
        println!(
            "loss {:.4}, perplexity {:.2} over {} targets in {} windows of {} tokens ({:.0} tokens/s)",
            result.loss,
            result.perplexity,
            result.targets,
            result.windows,
            config.model.seq + 1,
            result.tokens_per_s
        );
        let peak = &result.peak_bytes;
        println!(
            "peak memory of rank 0: device {}, host {}, nvme {} (parameters placed {})",
            ByteSize(peak.device),
            ByteSize(peak.host),
            ByteSize(peak.nvme),
            match (&args.config, checkpoint.is_some()) {
                (Some(path), _) => format!("by --config {}", path.display()),
                (None, true) => "as the run placed them".into(),
                (None, false) => {
                    "on the CPU device, every state in host memory (no --config)".into()
                }
            }
        );
    }
    Ok(())
}

/// The strata checkpoint `dir` names (a step-* directory, or a
/// checkpoint_dir whose `latest` names one) with its run's config, or
/// neither for a Hugging Face folder.
fn open_checkpoint(
    dir: &std::path::Path,
) -> anyhow::Result<(Option<Checkpoint>, Option<TrainConfig>)> {
    if dir.join("meta.json").exists() || dir.join("latest").exists() {
        let checkpoint = Checkpoint::open(dir)?;
        let config = checkpoint.run_config()?;
        return Ok((Some(checkpoint), config));
    }
    Ok((None, None))
}

/// The config the evaluation places its parameters by: `--config`, else
/// the run's; a checkpoint of no run's config (an older strata) or a
/// Hugging Face folder takes [model] from its config.json, and without
/// `--config` the CPU device with every state in host memory, its budgets
/// sized to this machine.
fn placement(
    args: &EvalArgs,
    checkpoint: Option<&Checkpoint>,
    run: Option<TrainConfig>,
) -> anyhow::Result<TrainConfig> {
    let folder = checkpoint.map_or_else(|| args.checkpoint.clone(), |c| c.dir.clone());
    let (config, model_keys) = match (&args.config, run) {
        (Some(path), _) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("cannot read --config {}", path.display()))?;
            let config = TrainConfig::from_toml(&text)
                .with_context(|| format!("--config {}", path.display()))?;
            (config, Some(TrainConfig::model_keys_in(&text)))
        }
        (None, Some(run)) => return Ok(run),
        (None, None) => {
            let mut config = TrainConfig::default();
            config.placement.params = Placement::Cpu;
            config.placement.optimizer = Placement::Cpu;
            (config, None)
        }
    };
    let sized = model_keys.is_none();
    let mut config = TrainConfig {
        model: strata_train::ModelConfig {
            init_from: Some(folder),
            ..config.model
        },
        ..config
    };
    config = config.with_init_from(&model_keys.unwrap_or_default())?;
    if sized {
        config = config.with_budgets_for_this_machine()?.0;
    }
    Ok(config)
}
