//! `strata bench tokenize`: texts or JSONL through a tokenizer as `strata
//! train --data ... --tokenizer DIR` tokenizes them (the sources
//! checksummed, the documents encoded on every core, the token file
//! written and synced), each round into a fresh cache, in tokens/s and
//! source bytes/s; the median of the rounds.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::bail;
use clap::Args;
use strata_train::{DataConfig, DataFormat, DataPaths};

/// Options of `strata bench tokenize`.
#[derive(Args, Debug)]
pub struct TokenizeArgs {
    /// Texts (each file one document) or JSONL files (`.jsonl`, a document
    /// per line), or directories of them.
    #[arg(long, num_args = 1.., value_name = "FILE", required = true)]
    data: Vec<PathBuf>,
    /// The tokenizer: a folder holding tokenizer.json, or the file.
    #[arg(long, value_name = "DIR")]
    tokenizer: PathBuf,
    /// The JSONL field that holds each document's text.
    #[arg(long, default_value = "text")]
    text_field: String,
    /// Keep each round's token file under this directory (default: a
    /// temporary one, removed); the JSON names the last round's file.
    #[arg(long, value_name = "DIR")]
    keep: Option<PathBuf>,
    /// Rounds (the median is reported).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// One JSON object on stdout.
    #[arg(long)]
    json: bool,
}

/// Runs `strata bench tokenize`.
pub fn run(args: TokenizeArgs) -> anyhow::Result<()> {
    if args.rounds == 0 {
        bail!("--rounds 0 measures nothing: give at least 1");
    }
    let format = DataFormat::of_texts(&args.data);
    let scratch = match &args.keep {
        Some(_) => None,
        None => Some(Scratch(
            std::env::temp_dir().join(format!("strata-bench-tokenize-{}", std::process::id())),
        )),
    };
    let root = match (&args.keep, &scratch) {
        (Some(keep), _) => std::path::absolute(keep)?,
        (None, scratch) => scratch.as_ref().expect("made above").0.clone(),
    };
    let mut data = DataConfig {
        path: DataPaths(args.data.clone()),
        format,
        tokenizer: Some(args.tokenizer.clone()),
        text_field: (format == DataFormat::Jsonl).then(|| args.text_field.clone()),
        ..DataConfig::default()
    };
    let bytes = strata_train::tokenize_bytes(&data)? / 2;
    let (mut seconds, mut last) = (Vec::new(), None);
    for round in 0..args.rounds {
        // Each round tokenizes: a cache left by an earlier run would be read.
        let dir = root.join(format!("round-{round}"));
        let _ = std::fs::remove_dir_all(&dir);
        data.cache_dir = Some(dir);
        let started = Instant::now();
        let tokenized = strata_train::tokenize(&data, u32::MAX as usize, &|_| {})?;
        seconds.push(started.elapsed().as_secs_f64());
        last = Some(tokenized);
    }
    let tokenized = last.expect("one round at least");
    let median = super::median(&mut seconds);
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    if args.json {
        println!(
            "{}",
            serde_json::json!({
                "bench": "tokenize",
                "documents": tokenized.documents,
                "tokens": tokenized.tokens,
                "source_bytes": bytes,
                "threads": threads,
                "seconds_median": median,
                "tokens_per_s": tokenized.tokens as f64 / median,
                "bytes_per_s": bytes as f64 / median,
                "token_file": args.keep.as_ref().map(|_| tokenized.path.clone()),
                "token_dtype": tokenized.dtype.to_string(),
            })
        );
    } else {
        println!(
            "tokenized {} documents ({} bytes) into {} tokens: {:.0} tokens/s, {:.1} MB/s of text (median of {} rounds, {threads} threads)",
            tokenized.documents,
            bytes,
            tokenized.tokens,
            tokenized.tokens as f64 / median,
            bytes as f64 / median / 1e6,
            args.rounds
        );
    }
    Ok(())
}

/// The rounds' caches, removed however the bench ends.
struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
