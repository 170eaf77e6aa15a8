//! `strata generate`: what a trained model writes after a prompt, a token
//! at a time with a key/value cache, printed as it is made.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, bail};
use clap::Args;
use strata_train::generate::{Generator, Sampler};

/// Tokens a generation may ask for at once.
const NEW_TOKENS_MAX: usize = 1 << 20;

#[derive(Args, Debug)]
pub struct GenerateArgs {
    /// A checkpoint (a step-* directory, or a checkpoint_dir whose
    /// `latest` names one), or any Hugging Face folder of an architecture
    /// strata trains (config.json and safetensors).
    #[arg(long, value_name = "DIR")]
    checkpoint: PathBuf,
    /// The text to go on from.
    #[arg(long)]
    prompt: String,
    /// Tokens to add (fewer if the model writes its end of text, or its
    /// sequence length is reached).
    #[arg(long, default_value_t = 64)]
    max_new_tokens: usize,
    /// 0: the most likely token each time (greedy); above: sampled from
    /// the softmax of the logits over it.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    temperature: f32,
    /// Sample among the K most likely tokens only.
    #[arg(long, value_name = "K")]
    top_k: Option<usize>,
    /// Seed of the sampling (the same seed, the same text).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// The model's tokenizer (a folder holding tokenizer.json, or the
    /// file); default: the one the run trained with ([data] tokenizer), or
    /// the folder's own tokenizer.json; without one, a token per byte.
    #[arg(long, value_name = "DIR")]
    tokenizer: Option<PathBuf>,
    /// Print a JSON object (the prompt's and the new tokens' ids, the
    /// text, tokens/s) as the last line instead of the text as it is made.
    #[arg(long)]
    json: bool,
}

/// Text to and from token ids: the model's tokenizer, or a token per byte.
enum Codec {
    Tokenizer(Box<strata_train::TextTokenizer>),
    Bytes,
}

impl Codec {
    fn encode(&self, text: &str) -> anyhow::Result<Vec<u32>> {
        Ok(match self {
            Codec::Tokenizer(tokenizer) => tokenizer.encode(text)?,
            Codec::Bytes => text.bytes().map(u32::from).collect(),
        })
    }

    /// The text of `ids` (bytes that are not whole UTF-8 yet are left
    /// out until they are).
    fn decode(&self, ids: &[u32]) -> String {
        match self {
            // A tokenizer that cannot decode the model's ids shows nothing
            // for them rather than stopping the generation.
            Codec::Tokenizer(tokenizer) => tokenizer.decode(ids).unwrap_or_default(),
            Codec::Bytes => {
                let bytes: Vec<u8> = ids.iter().map(|&id| id as u8).collect();
                String::from_utf8_lossy(&bytes[..whole_characters(&bytes)]).into_owned()
            }
        }
    }

    fn eos(&self) -> Option<u32> {
        match self {
            Codec::Tokenizer(tokenizer) => tokenizer.eos(),
            Codec::Bytes => None,
        }
    }
}

/// The bytes of `bytes` before a character its last bytes begin and do
/// not finish (a byte that is no UTF-8 at all is shown as U+FFFD).
fn whole_characters(bytes: &[u8]) -> usize {
    let len = bytes.len();
    for back in 1..=len.min(3) {
        let byte = bytes[len - back];
        if byte & 0xC0 == 0x80 {
            continue;
        }
        let needed = match byte {
            0xF0.. => 4,
            0xE0.. => 3,
            0xC0.. => 2,
            _ => 1,
        };
        return if needed > back { len - back } else { len };
    }
    len
}

/// The folder holding the weights, and the config of the run that wrote
/// them: a checkpoint's step directory and its `strata.toml`, or the
/// folder itself (no run).
pub(super) fn open_weights(
    dir: &Path,
) -> anyhow::Result<(PathBuf, Option<strata_train::TrainConfig>)> {
    if dir.join("meta.json").exists() || dir.join("latest").exists() {
        let checkpoint = strata_train::Checkpoint::open(dir)?;
        let config = checkpoint.run_config()?;
        return Ok((checkpoint.dir, config));
    }
    Ok((dir.to_path_buf(), None))
}

/// [`open_weights`], and the tokenizer the run trained with.
fn weights_folder(dir: &Path) -> anyhow::Result<(PathBuf, Option<PathBuf>)> {
    let (folder, config) = open_weights(dir)?;
    Ok((folder, config.and_then(|c| c.data.tokenizer)))
}

fn codec(args: &GenerateArgs, folder: &Path, trained: Option<PathBuf>) -> anyhow::Result<Codec> {
    let own = folder.join("tokenizer.json");
    let path = match (&args.tokenizer, trained) {
        (Some(path), _) => Some(path.clone()),
        (None, Some(path)) => Some(path),
        (None, None) => own.exists().then_some(own),
    };
    let Some(path) = path else {
        return Ok(Codec::Bytes);
    };
    Ok(Codec::Tokenizer(Box::new(
        strata_train::TextTokenizer::open(&path)?,
    )))
}

/// Why the generation stopped.
#[derive(serde::Serialize, Clone, Copy, PartialEq, Eq, Debug)]
#[serde(rename_all = "snake_case")]
enum Stop {
    MaxNewTokens,
    EndOfText,
    SequenceLength,
}

pub fn run(args: GenerateArgs) -> anyhow::Result<()> {
    if args.max_new_tokens > NEW_TOKENS_MAX {
        bail!(
            "--max-new-tokens {}: ask for at most {NEW_TOKENS_MAX}",
            args.max_new_tokens
        );
    }
    let mut sampler = Sampler::new(args.temperature, args.top_k, args.seed)?;
    let (folder, trained) = weights_folder(&args.checkpoint)?;
    let codec = codec(&args, &folder, trained)?;
    let prompt = codec.encode(&args.prompt)?;
    if prompt.is_empty() {
        bail!("--prompt gives no tokens: give some text to go on from");
    }
    // The cache holds the prompt and the tokens asked for, at most the
    // model's sequence length.
    let wanted = prompt.len().saturating_add(args.max_new_tokens);
    let mut generator = Generator::open(&folder, Some(wanted))
        .with_context(|| format!("--checkpoint {}", args.checkpoint.display()))?;
    let (vocab, capacity) = (generator.model().vocab(), generator.capacity());
    if matches!(codec, Codec::Bytes) && vocab != 256 {
        bail!(
            "no tokenizer for a model of {vocab} ids (a token per byte is the built-in model's 256): give the model's tokenizer with --tokenizer"
        );
    }
    if let Some(&token) = prompt.iter().find(|&&t| t as usize >= vocab) {
        bail!(
            "the prompt's token {token} is past the model's vocabulary of {vocab}: give the model's own tokenizer with --tokenizer"
        );
    }
    if prompt.len() > capacity {
        bail!(
            "the prompt is {} tokens, and the model's sequence length is {capacity}: give a shorter prompt",
            prompt.len()
        );
    }
    let started = Instant::now();
    let mut logits = Vec::new();
    for &token in &prompt {
        logits.clear();
        logits.extend_from_slice(generator.feed(token)?);
    }
    let prefill_s = started.elapsed().as_secs_f64();
    let mut out = std::io::stdout().lock();
    if !args.json {
        write!(out, "{}", args.prompt)?;
        out.flush()?;
    }
    // What is printed is the text of the prompt and the new tokens past
    // the prompt's own (a token's text may hang on the one before it).
    let mut all = prompt.clone();
    let mut shown = codec.decode(&all).len();
    let started = Instant::now();
    let stop = loop {
        if all.len() - prompt.len() == args.max_new_tokens {
            break Stop::MaxNewTokens;
        }
        let next = sampler.next(&logits);
        if Some(next) == codec.eos() {
            break Stop::EndOfText;
        }
        all.push(next);
        if !args.json {
            // A token may finish a character another began: printed once
            // whole.
            let text = codec.decode(&all);
            if text.len() > shown && text.is_char_boundary(shown) {
                write!(out, "{}", &text[shown..])?;
                out.flush()?;
                shown = text.len();
            }
        }
        if generator.position() == capacity {
            break Stop::SequenceLength;
        }
        logits.clear();
        logits.extend_from_slice(generator.feed(next)?);
    };
    let seconds = started.elapsed().as_secs_f64();
    let made = &all[prompt.len()..];
    let tokens_per_s = made.len() as f64 / seconds.max(1e-9);
    if args.json {
        let summary = serde_json::json!({
            "prompt_tokens": prompt,
            "tokens": made,
            "text": codec.decode(made),
            "stopped": stop,
            "prefill_s": prefill_s,
            "tokens_per_s": tokens_per_s,
        });
        writeln!(out, "{summary}")?;
    } else {
        writeln!(out)?;
        let why = match stop {
            Stop::MaxNewTokens => "--max-new-tokens",
            Stop::EndOfText => "the end of text",
            Stop::SequenceLength => "the model's sequence length",
        };
        tracing::info!(
            "{} tokens after a prompt of {} in {seconds:.2} s ({tokens_per_s:.1} tokens/s; the prompt {prefill_s:.2} s), stopped at {why}",
            made.len(),
            prompt.len()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_an_unfinished_last_character_is_held_back() {
        assert_eq!(whole_characters(b"ab"), 2);
        assert_eq!(whole_characters(b"a\xc3"), 1);
        assert_eq!(whole_characters(b"a\xc3\xa9"), 3);
        assert_eq!(whole_characters(b"ab\xe2\x9c"), 2);
        assert_eq!(whole_characters(b"\xe2\x9c\x93"), 3);
        // A byte that is no UTF-8 is shown (as U+FFFD), not held back.
        assert_eq!(whole_characters(b"\xffab"), 3);
        assert_eq!(whole_characters(b"ab\x9c"), 3);
        assert_eq!(Codec::Bytes.decode(&[0xff, 104, 105]), "\u{fffd}hi");
    }
}
