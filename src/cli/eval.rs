//! `strata eval`: a checkpoint's loss and perplexity over held-out data.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use strata_train::hf::HfFolder;
use strata_train::{DataConfig, DataFormat, DataPaths, TokenDtype};

use super::generate::open_weights;
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
    /// Sequences a forward pass.
    #[arg(long, default_value_t = 8)]
    micro_batch: usize,
    /// Evaluate the first N windows only (default: every one).
    #[arg(long, value_name = "N")]
    max_windows: Option<u64>,
    /// Print the result as one JSON object.
    #[arg(long)]
    json: bool,
}

pub fn run(args: EvalArgs) -> anyhow::Result<()> {
    let (folder, run) = open_weights(&args.checkpoint)?;
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
    // A folder of no run keeps its own sequence length.
    let seq = run.as_ref().map(|c| c.model.seq);
    let mut config = run.unwrap_or_default();
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
        let tokenizer = match (&args.tokenizer, format) {
            (_, DataFormat::Tokens) => None,
            (Some(dir), _) => Some(absolute(dir, "--tokenizer")?),
            (None, _) => config.data.tokenizer.clone(),
        };
        // The run's end of documents: its eos_id, or its tokenizer's end
        // of text (token files carry no tokenizer of their own).
        let eos_id = match (config.data.eos_id, &config.data.tokenizer) {
            (Some(id), _) => Some(id),
            (None, Some(dir)) if config.data.attention == strata_train::DataAttention::Document => {
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
            ..config.data.as_format(format)
        };
    } else {
        tracing::warn!(
            "no --data or --tokens: evaluating on the data the run trained on, not held-out data"
        );
    }
    let (model, groups) = HfFolder::open(&folder)?
        .read_model(seq)
        .with_context(|| format!("--checkpoint {}", args.checkpoint.display()))?;
    if config.data.tokenizer.is_none()
        && config.data.format != DataFormat::Tokens
        && model.vocab() != 256
    {
        anyhow::bail!(
            "texts without a tokenizer are read a token per byte, for the built-in model's 256 ids, and this model has {}: give its tokenizer with --tokenizer, or token files with --tokens",
            model.vocab()
        );
    }
    config.model.seq = model.seq();
    config.model.vocab = model.vocab();
    let corpus = open_data(&config, args.json)?;
    corpus.check_vocab(model.vocab())?;
    let windows = args
        .max_windows
        .map_or(corpus.windows(), |n| n.min(corpus.windows()));
    let bar = super::progress_bar(
        windows,
        args.json,
        "{spinner} evaluating [{bar:30}] {pos}/{len} windows ({elapsed})",
    );
    let result = strata_train::evaluate::evaluate(
        &*model,
        &groups,
        &corpus,
        (args.micro_batch, args.max_windows),
        &|n| bar.inc(n),
    )?;
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
    }
    Ok(())
}
