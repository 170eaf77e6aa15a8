//! Training data: a text's bytes, or a file of token ids, and which
//! windows of it each step, micro-batch and rank reads (a function of the
//! seed and the step alone, so a resumed run reads what an uninterrupted
//! one would, and a peer replaying [`window_start`] reads the same).

use std::path::Path;
use std::sync::Arc;

use crate::error::Result;
use crate::error::{bad, os};

/// How a token file stores each id: little-endian u16 (nanoGPT's
/// `train.bin`; vocabularies up to 65536) or u32.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TokenDtype {
    /// Two bytes per token.
    #[default]
    U16,
    /// Four bytes per token.
    U32,
}

impl TokenDtype {
    /// Bytes per token.
    pub fn bytes(self) -> usize {
        match self {
            TokenDtype::U16 => 2,
            TokenDtype::U32 => 4,
        }
    }
}

impl std::str::FromStr for TokenDtype {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "u16" | "uint16" => Ok(TokenDtype::U16),
            "u32" | "uint32" => Ok(TokenDtype::U32),
            other => Err(format!("token dtype {other:?}: use u16 or u32")),
        }
    }
}

impl std::fmt::Display for TokenDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            TokenDtype::U16 => "u16",
            TokenDtype::U32 => "u32",
        })
    }
}

#[derive(Clone, Debug)]
enum Tokens {
    /// A text: each byte a token (vocabulary 256).
    Bytes(Vec<u8>),
    /// A token file, mapped (not read into memory).
    File {
        map: Arc<memmap2::Mmap>,
        dtype: TokenDtype,
    },
}

/// Bytes of a token file looked at to tell whether it is text.
const TEXT_SNIFF_BYTES: usize = 4096;

/// Whether `bytes` read as text: UTF-8 (a character cut at the end
/// allowed) with no control character but tab, newline and return.
fn looks_like_text(bytes: &[u8]) -> bool {
    let valid = match std::str::from_utf8(bytes) {
        Ok(text) => text,
        Err(err) if err.error_len().is_none() => {
            std::str::from_utf8(&bytes[..err.valid_up_to()]).expect("valid up to there")
        }
        Err(_) => return false,
    };
    !valid.is_empty()
        && valid
            .chars()
            .all(|c| !c.is_control() || matches!(c, '\t' | '\n' | '\r'))
}

/// The tokens a run trains on.
#[derive(Clone, Debug)]
pub struct Corpus {
    tokens: Tokens,
    len: usize,
    /// The largest token id in it.
    max_token: u32,
}

/// The name the corpus had when it held only texts.
pub type ByteCorpus = Corpus;

fn too_short(len: usize, unit: &str, seq: usize) -> crate::error::TrainError {
    bad(
        "data",
        format!("{len} {unit}"),
        format!("give data longer than model.seq + 1 = {} {unit}", seq + 1),
    )
}

impl Corpus {
    /// A text's `bytes` as byte tokens; it must hold more than one window.
    pub fn new(bytes: Vec<u8>, seq: usize) -> Result<Corpus> {
        if bytes.len() <= seq + 1 {
            return Err(too_short(bytes.len(), "bytes", seq));
        }
        let max_token = u32::from(bytes.iter().copied().max().unwrap_or(0));
        let len = bytes.len();
        Ok(Corpus {
            tokens: Tokens::Bytes(bytes),
            len,
            max_token,
        })
    }

    /// A file of little-endian token ids of `dtype`, mapped read-only
    /// (the file must not change while a run reads it). Its length must be
    /// a whole number of tokens, more than one window.
    pub fn open_tokens(path: &Path, dtype: TokenDtype, seq: usize) -> Result<Corpus> {
        let file = std::fs::File::open(path).map_err(|err| {
            os(
                format!("open token file {}", path.display()),
                err,
                "check that --tokens (or [data] path) names an existing, readable file",
            )
        })?;
        let bytes = file
            .metadata()
            .map_err(|err| os(format!("stat {}", path.display()), err, "check the file"))?
            .len();
        if bytes % dtype.bytes() as u64 != 0 {
            return Err(bad(
                "tokens",
                path.display(),
                format!(
                    "it holds {bytes} bytes, not a whole number of {dtype} tokens ({} bytes each): is --token-dtype (data.token_dtype) right?",
                    dtype.bytes()
                ),
            ));
        }
        let len = usize::try_from(bytes / dtype.bytes() as u64).map_err(|_| {
            bad(
                "tokens",
                path.display(),
                "the file is larger than this machine can map",
            )
        })?;
        if len <= seq + 1 {
            return Err(too_short(len, "tokens", seq));
        }
        // SAFETY: the map is read-only and private to this process; the documented contract is that the token file does not change while a run reads it (a truncation would fault, not corrupt silently).
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|err| {
            os(
                format!("map token file {}", path.display()),
                err,
                "check the file is a regular file",
            )
        })?;
        let mut corpus = Corpus {
            tokens: Tokens::File {
                map: Arc::new(map),
                dtype,
            },
            len,
            max_token: 0,
        };
        corpus.max_token = (0..len).map(|i| corpus.token(i)).max().unwrap_or(0);
        Ok(corpus)
    }

    /// Token `i`.
    fn token(&self, i: usize) -> u32 {
        match &self.tokens {
            Tokens::Bytes(bytes) => u32::from(bytes[i]),
            Tokens::File { map, dtype } => {
                let at = i * dtype.bytes();
                match dtype {
                    TokenDtype::U16 => u32::from(u16::from_le_bytes([map[at], map[at + 1]])),
                    TokenDtype::U32 => {
                        u32::from_le_bytes(map[at..at + 4].try_into().expect("four bytes"))
                    }
                }
            }
        }
    }

    /// Errors unless a model of `vocab` tokens covers every token.
    pub fn check_vocab(&self, vocab: usize) -> Result<()> {
        let max = self.max_token as usize;
        if max < vocab {
            return Ok(());
        }
        let at = (0..self.len)
            .find(|&i| self.token(i) as usize >= vocab)
            .unwrap_or(0);
        let fix = match &self.tokens {
            Tokens::Bytes(bytes) => format!(
                "the text's largest byte is {max}, past the model's vocabulary (the first such byte is {} at offset {at}): set model.vocab to at least {} (256 covers every byte)",
                bytes[at],
                max + 1
            ),
            Tokens::File { map, .. }
                if looks_like_text(&map[..map.len().min(TEXT_SNIFF_BYTES)]) =>
            {
                format!(
                    "the token file's largest id is {max}, past the model's vocabulary, and the file reads as text: pass a text with --data (one token per byte), not --tokens; or, if it holds token ids, set model.vocab to at least {}",
                    max + 1
                )
            }
            Tokens::File { .. } => format!(
                "the token file's largest id is {max}, past the model's vocabulary (the first such id is {}, token {at} of the file): set model.vocab to at least {}, or check --token-dtype",
                self.token(at),
                max + 1
            ),
        };
        Err(bad("model.vocab", vocab, fix))
    }

    /// Tokens in the corpus.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it is empty (never: the constructors refuse that).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Rank `rank`'s tokens for step `step`: for each of `accumulation`
    /// micro-batches, `micro_batch` windows of `seq + 1` bytes. The
    /// windows of a step are numbered across ranks, so `world` ranks of
    /// `micro_batch` read what one rank of `world x micro_batch` reads.
    #[allow(clippy::too_many_arguments)]
    pub fn step_tokens(
        &self,
        seed: u64,
        step: u64,
        rank: usize,
        world: usize,
        accumulation: usize,
        micro_batch: usize,
        seq: usize,
        out: &mut [u32],
    ) {
        assert_eq!(
            out.len(),
            accumulation * micro_batch * (seq + 1),
            "step tokens"
        );
        let mut windows = out.chunks_exact_mut(seq + 1);
        for m in 0..accumulation {
            for i in 0..micro_batch {
                let global = (m * world + rank) * micro_batch + i;
                let start = window_start(seed, step, global as u64, self.len, seq);
                let window = windows.next().expect("sized above");
                for (offset, token) in window.iter_mut().enumerate() {
                    *token = self.token(start + offset);
                }
            }
        }
    }
}

/// Where window `global` of `step` starts in a corpus of `len` tokens (the
/// `(m x world + rank) x micro_batch + i`-th sequence of the step, of
/// `seq + 1` tokens): SplitMix64's finalizer over (seed, step, window),
/// modulo the `len - seq - 1` possible starts. Peers that train on the same
/// tokens (`benches/gpu_vs_deepspeed.py`) compute the same.
pub fn window_start(seed: u64, step: u64, global: u64, len: usize, seq: usize) -> usize {
    (mix(seed, step, global) % (len - seq - 1) as u64) as usize
}

/// SplitMix64's finalizer over the three inputs.
fn mix(seed: u64, step: u64, window: u64) -> u64 {
    let mut z = seed
        .wrapping_mul(0x9e37_79b9_7f4a_7c15)
        .wrapping_add(step.wrapping_mul(0xbf58_476d_1ce4_e5b9))
        .wrapping_add(window.wrapping_mul(0x94d0_49bb_1331_11eb));
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_ranks_read_what_one_rank_of_twice_the_batch_reads() {
        let corpus = ByteCorpus::new((0..=255u8).cycle().take(5000).collect(), 16).unwrap();
        let (seq, accumulation) = (16, 2);
        let mut one = vec![0; accumulation * 4 * (seq + 1)];
        corpus.step_tokens(7, 3, 0, 1, accumulation, 4, seq, &mut one);
        let mut halves = Vec::new();
        for rank in 0..2 {
            let mut part = vec![0; accumulation * 2 * (seq + 1)];
            corpus.step_tokens(7, 3, rank, 2, accumulation, 2, seq, &mut part);
            halves.push(part);
        }
        let window = 2 * (seq + 1);
        for m in 0..accumulation {
            let joined: Vec<u32> = [
                &halves[0][m * window..][..window],
                &halves[1][m * window..][..window],
            ]
            .concat();
            assert_eq!(joined, one[m * 2 * window..][..2 * window]);
        }
        let mut other_step = vec![0; one.len()];
        corpus.step_tokens(7, 4, 0, 1, accumulation, 4, seq, &mut other_step);
        assert_ne!(one, other_step, "steps read different windows");
    }

    #[test]
    fn a_text_shorter_than_a_window_is_refused() {
        let err = ByteCorpus::new(b"short".to_vec(), 64).unwrap_err();
        assert!(err.to_string().contains("longer than model.seq"), "{err}");
    }

    /// The values `benches/gpu_vs_deepspeed.py`'s Python `window_start`
    /// gives: the peers there read the windows strata reads.
    #[test]
    fn window_starts_match_the_benchs_python_replay() {
        assert_eq!(window_start(1, 1, 0, 1_000_000, 1024), 736_099);
        assert_eq!(window_start(7, 3, 5, 3000, 16), 541);
        assert_eq!(
            window_start((1 << 63) + 5, 12345, 999, 1_000_000_000, 1024),
            88_261_132
        );
    }

    #[test]
    fn a_token_file_reads_the_windows_a_text_of_the_same_ids_reads() {
        let dir = tempfile::tempdir().unwrap();
        let ids: Vec<u8> = (0..3000u32).map(|i| (i * 7 % 251) as u8).collect();
        let text = Corpus::new(ids.clone(), 16).unwrap();
        let (mut from_text, mut from_u16, mut from_u32) =
            (vec![0; 3 * 17], vec![0; 3 * 17], vec![0; 3 * 17]);
        text.step_tokens(5, 2, 0, 1, 1, 3, 16, &mut from_text);
        for (dtype, out) in [
            (TokenDtype::U16, &mut from_u16),
            (TokenDtype::U32, &mut from_u32),
        ] {
            let path = dir.path().join(format!("tokens.{dtype}"));
            let bytes: Vec<u8> = ids
                .iter()
                .flat_map(|&b| match dtype {
                    TokenDtype::U16 => u16::from(b).to_le_bytes().to_vec(),
                    TokenDtype::U32 => u32::from(b).to_le_bytes().to_vec(),
                })
                .collect();
            std::fs::write(&path, bytes).unwrap();
            let file = Corpus::open_tokens(&path, dtype, 16).unwrap();
            assert_eq!((file.len(), file.max_token), (3000, 250));
            file.step_tokens(5, 2, 0, 1, 1, 3, 16, out);
        }
        assert_eq!(from_u16, from_text);
        assert_eq!(from_u32, from_text);
        // Ids past the vocabulary, a ragged file, a missing one: named.
        let path = dir.path().join("big.u16");
        let big: Vec<u8> = (0..100u16).flat_map(|i| (i * 600).to_le_bytes()).collect();
        std::fs::write(&path, &big).unwrap();
        let err = Corpus::open_tokens(&path, TokenDtype::U16, 16)
            .unwrap()
            .check_vocab(50304)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("model.vocab") && err.contains("59400"),
            "{err}"
        );
        std::fs::write(&path, &big[..99]).unwrap();
        let err = Corpus::open_tokens(&path, TokenDtype::U16, 16)
            .unwrap_err()
            .to_string();
        assert!(err.contains("whole number of u16 tokens"), "{err}");
        let err = Corpus::open_tokens(&dir.path().join("none"), TokenDtype::U16, 16)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("open token file") && err.contains("--tokens"),
            "{err}"
        );
    }
}
