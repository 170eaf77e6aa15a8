//! Training data: texts (a token per byte) or files of token ids, one or
//! many (a directory of shards), cut into windows of `seq + 1` tokens; and
//! which windows each step, micro-batch and rank reads ([`DataReader`]).
//!
//! The epoch order ([`DataOrder::Epoch`], the default) reads every window
//! once per epoch, shuffled by the seed and the epoch; the random order
//! draws windows starting anywhere, with replacement, by the seed and the
//! step. Either is a function of the seed and how many sequences the run
//! has read (numbered across ranks), so any number of ranks reads the same
//! sequences, a resumed run reads what the uninterrupted one would (the
//! count is in the checkpoint, [`DataPosition`]), and a peer replaying
//! [`window_start`] reads what the random order reads.

mod chat;
mod order;
mod table;
mod tokenize;

pub use table::{DataAttention, DataConfig, DataFormat, DataPaths};
pub use tokenize::{TEXT_DOCUMENT_BYTES_MAX, TextTokenizer, Tokenized, tokenize, tokenize_bytes};

use std::path::{Path, PathBuf};
use std::sync::Arc;

use strata_kernels::IGNORE_TARGET;

use crate::error::{Result, TrainError};
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

/// How a run's sequences are drawn from the corpus.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DataOrder {
    /// Every window (`seq + 1` tokens every `seq`, so each token is a
    /// target once) once per epoch, in an order shuffled by `train.seed`
    /// and the epoch; the run's sequences run through the epochs in turn,
    /// whatever the number of ranks.
    #[default]
    Epoch,
    /// Windows starting anywhere, drawn with replacement by the seed and
    /// the step (nanoGPT's `get_batch`; the GPU bench's peers replay it
    /// with [`window_start`]).
    Random,
}

impl std::str::FromStr for DataOrder {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "epoch" => Ok(DataOrder::Epoch),
            "random" => Ok(DataOrder::Random),
            other => Err(format!("data order {other:?}: use epoch or random")),
        }
    }
}

/// Files a corpus may hold (a directory of shards).
pub const DATA_FILES_MAX: usize = 65_536;

/// The bit a token carries when it is no loss target (a prompt token in
/// supervised fine-tuning, transformers' label -100): the model reads the
/// id below it, and the loss does not score the token's prediction. Ids
/// stay below [`crate::model::VOCAB_MAX`], far under it. Only token files
/// strata wrote with loss masks (`format = "sft"`'s cache) carry it: in any
/// other token file such a value is an id past the vocabulary.
pub const NOT_A_TARGET: u32 = 1 << 31;

/// The bit a token carries when it starts a document packed into a
/// sequence after another (`[data] attention = "document"`): its position
/// restarts at 0, no token of it attends to the document before, and it is
/// no loss target (nothing in its document predicts it). Set on the
/// windows as they are read, never stored.
pub const DOCUMENT_START: u32 = 1 << 30;

/// The bits of a token that are its id (below the marks).
pub const TOKEN_ID: u32 = !(NOT_A_TARGET | DOCUMENT_START);

/// Micro-batch `m`'s inputs, next-token targets and position ids out of
/// the step's sequences of `seq + 1` tokens: a token marked
/// [`NOT_A_TARGET`] or [`DOCUMENT_START`] is read as its id and is no
/// target ([`IGNORE_TARGET`]); a [`DOCUMENT_START`] restarts the positions
/// at 0 (and attention: no row sees the document before it). Returns
/// whether any document starts inside a sequence (else the position ids
/// are each token's place in its sequence, and need not be given).
pub(crate) fn split_tokens(
    tokens: &[u32],
    m: usize,
    batch: usize,
    seq: usize,
    (inputs, targets, position_ids): (&mut [u32], &mut [u32], &mut [u32]),
) -> bool {
    let micro = &tokens[m * batch * (seq + 1)..(m + 1) * batch * (seq + 1)];
    let mut packed = false;
    for (i, sequence) in micro.chunks_exact(seq + 1).enumerate() {
        let rows = i * seq..(i + 1) * seq;
        let mut place = 0u32;
        for (j, ((input, id), &token)) in inputs[rows.clone()]
            .iter_mut()
            .zip(&mut position_ids[rows.clone()])
            .zip(sequence)
            .enumerate()
        {
            *input = token & TOKEN_ID;
            if j > 0 && token & DOCUMENT_START != 0 {
                place = 0;
                packed = true;
            }
            *id = place;
            place += 1;
        }
        for (target, &token) in targets[rows].iter_mut().zip(&sequence[1..]) {
            *target = match is_target(token) {
                true => token,
                false => IGNORE_TARGET,
            };
        }
    }
    packed
}

/// Whether the loss scores `token` as the target of the one before it:
/// neither [`NOT_A_TARGET`] nor [`DOCUMENT_START`].
pub fn is_target(token: u32) -> bool {
    token & !TOKEN_ID == 0
}

/// Bytes hashed and scanned at a time when a token file is opened.
const SCAN_BYTES: usize = 1 << 20;

#[derive(Clone, Debug)]
enum Tokens {
    /// A text: each byte a token (vocabulary 256).
    Bytes(Vec<u8>),
    /// A token file, mapped (not read into memory); `masked`: its ids
    /// carry [`NOT_A_TARGET`] (strata's cache of supervised data).
    File {
        map: Arc<memmap2::Mmap>,
        dtype: TokenDtype,
        masked: bool,
    },
}

impl Tokens {
    fn bytes(&self) -> &[u8] {
        match self {
            Tokens::Bytes(bytes) => bytes,
            Tokens::File { map, .. } => map,
        }
    }

    fn dtype_bytes(&self) -> usize {
        match self {
            Tokens::Bytes(_) => 1,
            Tokens::File { dtype, .. } => dtype.bytes(),
        }
    }

    /// The bits of a token that are flags, not its id.
    fn flags(&self) -> u32 {
        match self {
            Tokens::File { masked: true, .. } => NOT_A_TARGET,
            _ => 0,
        }
    }

    /// Token `i`, with its flags.
    fn token(&self, i: usize) -> u32 {
        match self {
            Tokens::Bytes(bytes) => u32::from(bytes[i]),
            Tokens::File { map, dtype, .. } => {
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

    /// The largest id in `bytes`, whole tokens of this encoding, flags
    /// left out.
    fn max_in(&self, bytes: &[u8]) -> u32 {
        let ids = !self.flags();
        match self.dtype_bytes() {
            1 => bytes.iter().copied().max().map_or(0, u32::from),
            2 => bytes
                .chunks_exact(2)
                .map(|b| u16::from_le_bytes([b[0], b[1]]))
                .max()
                .map_or(0, u32::from),
            _ => bytes
                .chunks_exact(4)
                .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) & ids)
                .max()
                .unwrap_or(0),
        }
    }
}

/// One file (or text) of a corpus.
#[derive(Clone, Debug)]
struct Source {
    /// Its path (or what the text was).
    name: PathBuf,
    tokens: Tokens,
    /// Tokens in it.
    len: usize,
    /// The largest token id in it.
    max_token: u32,
    /// xxh3-64 of its bytes.
    checksum: u64,
}

impl Source {
    /// `tokens` with their largest id and checksum, in one pass over the
    /// bytes (a mapped file is read once).
    fn scan(name: PathBuf, tokens: Tokens) -> Source {
        let mut hasher = xxhash_rust::xxh3::Xxh3::new();
        let mut max_token = 0;
        for chunk in tokens.bytes().chunks(SCAN_BYTES) {
            hasher.update(chunk);
            max_token = max_token.max(tokens.max_in(chunk));
        }
        let len = tokens.bytes().len() / tokens.dtype_bytes();
        Source {
            name,
            tokens,
            len,
            max_token,
            checksum: hasher.digest(),
        }
    }

    /// Windows of `seq + 1` tokens every `seq` tokens (the epoch order's).
    fn windows(&self, seq: usize) -> u64 {
        ((self.len - 1) / seq) as u64
    }

    /// Starts a random window may take (as [`window_start`]).
    fn starts(&self, seq: usize) -> u64 {
        (self.len - seq - 1) as u64
    }
}

/// The tokens a run trains on: one or more texts or token files, each cut
/// into windows of `seq + 1` tokens (a window never spans two files).
#[derive(Clone, Debug)]
pub struct Corpus {
    sources: Vec<Source>,
    seq: usize,
    /// Each source's first window in the epoch order, and theirs in all.
    window_first: Vec<u64>,
    windows: u64,
    /// Each source's first start in the random order, and theirs in all.
    start_first: Vec<u64>,
    starts: u64,
    /// Tokens in every source.
    tokens: u64,
    /// xxh3-64 over each source's length and checksum.
    checksum: u64,
    /// With documents kept apart: the end-of-document id, after which a
    /// token is marked [`DOCUMENT_START`].
    eos: Option<u32>,
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

fn data_error(path: &Path, problem: impl Into<String>, fix: impl Into<String>) -> TrainError {
    TrainError::Data {
        path: path.to_path_buf(),
        problem: problem.into(),
        fix: fix.into(),
    }
}

impl Corpus {
    /// A text's `bytes` as byte tokens; it must hold more than one window.
    pub fn new(bytes: Vec<u8>, seq: usize) -> Result<Corpus> {
        if bytes.len() <= seq + 1 {
            return Err(too_short(bytes.len(), "bytes", seq));
        }
        let source = Source::scan(PathBuf::from("the text"), Tokens::Bytes(bytes));
        Ok(Corpus::of(vec![source], seq))
    }

    /// A file of little-endian token ids of `dtype`, mapped read-only
    /// (the file must not change while a run reads it). Its length must be
    /// a whole number of tokens, more than one window.
    pub fn open_tokens(path: &Path, dtype: TokenDtype, seq: usize) -> Result<Corpus> {
        let source = open_token_file(path, dtype, false)?;
        if source.len <= seq + 1 {
            return Err(too_short(source.len, "tokens", seq));
        }
        Ok(Corpus::of(vec![source], seq))
    }

    /// The token file [`tokenize`] made or found (with loss masks when its
    /// data was supervised), as [`Corpus::open_tokens`] opens one.
    pub fn open_tokenized(tokenized: &Tokenized, seq: usize) -> Result<Corpus> {
        let source = open_token_file(&tokenized.path, tokenized.dtype, tokenized.masked)?;
        if source.len <= seq + 1 {
            return Err(too_short(source.len, "tokens", seq));
        }
        Ok(Corpus::of(vec![source], seq))
    }

    /// The files `[data]` names, in the order given; a directory stands
    /// for its files (not those whose names start with a dot), in name
    /// order. Texts are read (one token per byte), token files mapped.
    /// Each file must hold more than one window of `seq + 1` tokens.
    pub fn open(data: &DataConfig, seq: usize) -> Result<Corpus> {
        if data.path.is_empty() {
            return Err(bad(
                "data.path",
                "none",
                "name the files to train on (--data, --tokens)",
            ));
        }
        let files = data_files(&data.path.0)?;
        let mut sources = Vec::with_capacity(files.len());
        for path in &files {
            let source = match data.format {
                DataFormat::Tokens => open_token_file(path, data.token_dtype, false)?,
                DataFormat::Text => {
                    let bytes = std::fs::read(path).map_err(|err| {
                        os(
                            format!("read text {}", path.display()),
                            err,
                            "check that --data (or [data] path) names readable files",
                        )
                    })?;
                    Source::scan(path.clone(), Tokens::Bytes(bytes))
                }
                DataFormat::Jsonl | DataFormat::Sft => {
                    return Err(data_error(
                        path,
                        "JSONL is read through a tokenizer",
                        "set data.tokenizer (--tokenizer DIR): its documents are tokenized into a token file first",
                    ));
                }
            };
            if source.len <= seq + 1 {
                let unit = match data.format {
                    DataFormat::Text => "bytes",
                    _ => "tokens",
                };
                return Err(data_error(
                    path,
                    format!(
                        "it holds {} {unit}, and a file needs more than model.seq + 1 = {} {unit}",
                        source.len,
                        seq + 1
                    ),
                    "leave the file out, or train with a shorter model.seq",
                ));
            }
            sources.push(source);
        }
        let corpus = Corpus::of(sources, seq);
        Ok(match (data.attention, data.eos_id) {
            (DataAttention::Document, Some(eos)) => corpus.with_documents(eos),
            _ => corpus,
        })
    }

    fn of(sources: Vec<Source>, seq: usize) -> Corpus {
        let (mut window_first, mut start_first) = (Vec::new(), Vec::new());
        let (mut windows, mut starts, mut tokens) = (0u64, 0u64, 0u64);
        let mut hasher = xxhash_rust::xxh3::Xxh3::new();
        for source in &sources {
            window_first.push(windows);
            start_first.push(starts);
            windows += source.windows(seq);
            starts += source.starts(seq);
            tokens += source.len as u64;
            hasher.update(&(source.len as u64).to_le_bytes());
            hasher.update(&source.checksum.to_le_bytes());
        }
        Corpus {
            sources,
            seq,
            window_first,
            windows,
            start_first,
            starts,
            tokens,
            checksum: hasher.digest(),
            eos: None,
        }
    }

    /// This corpus with its documents kept apart in each window (`[data]
    /// attention = "document"`): a token after the id `eos` is marked
    /// [`DOCUMENT_START`] as the windows are read. ([`Corpus::open`] does
    /// it for `data.eos_id`; a tokenized corpus takes its tokenizer's.)
    pub fn with_documents(mut self, eos: u32) -> Corpus {
        self.eos = Some(eos);
        self
    }

    /// The end-of-document id its windows are marked after, if any.
    pub fn documents_end(&self) -> Option<u32> {
        self.eos
    }

    /// Errors unless a model of `vocab` tokens covers every token.
    pub fn check_vocab(&self, vocab: usize) -> Result<()> {
        let Some(source) = self.sources.iter().find(|s| s.max_token as usize >= vocab) else {
            return Ok(());
        };
        let max = source.max_token as usize;
        let ids = !source.tokens.flags();
        let at = (0..source.len)
            .find(|&i| (source.tokens.token(i) & ids) as usize >= vocab)
            .unwrap_or(0);
        let file = if self.sources.len() > 1 {
            format!(" (in {})", source.name.display())
        } else {
            String::new()
        };
        let fix = match &source.tokens {
            Tokens::Bytes(bytes) => format!(
                "the text's largest byte is {max}, past the model's vocabulary (the first such byte is {} at offset {at}{file}): set model.vocab to at least {} (256 covers every byte)",
                bytes[at],
                max + 1
            ),
            Tokens::File { map, .. }
                if looks_like_text(&map[..map.len().min(TEXT_SNIFF_BYTES)]) =>
            {
                format!(
                    "the token file's largest id is {max}, past the model's vocabulary, and the file{file} reads as text: pass a text with --data (one token per byte), not --tokens; or, if it holds token ids, set model.vocab to at least {}",
                    max + 1
                )
            }
            Tokens::File { .. } => format!(
                "the token file's largest id is {max}, past the model's vocabulary (the first such id is {}, token {at} of the file{file}): set model.vocab to at least {}, or check --token-dtype",
                source.tokens.token(at) & ids,
                max + 1
            ),
        };
        Err(bad("model.vocab", vocab, fix))
    }

    /// Tokens in the corpus.
    pub fn len(&self) -> usize {
        self.tokens as usize
    }

    /// Whether it is empty (never: the constructors refuse that).
    pub fn is_empty(&self) -> bool {
        self.tokens == 0
    }

    /// Files (or texts) in it.
    pub fn files(&self) -> usize {
        self.sources.len()
    }

    /// Windows of `seq + 1` tokens in an epoch.
    pub fn windows(&self) -> u64 {
        self.windows
    }

    /// Where the run's sequences come from and how many make an epoch,
    /// for the run's first lines.
    pub fn describe(&self, sequences_per_step: usize) -> String {
        let files = match self.sources.as_slice() {
            [one] => one.name.display().to_string(),
            many => format!("{} files", many.len()),
        };
        format!(
            "{files}: {} tokens, {} windows of {} tokens (an epoch is {:.1} steps of {sequences_per_step} sequences)",
            self.tokens,
            self.windows,
            self.seq + 1,
            self.windows as f64 / sequences_per_step as f64
        )
    }

    /// The record of the data a checkpoint's run has read `samples`
    /// sequences of.
    pub fn position(&self, samples: u64) -> DataPosition {
        DataPosition {
            samples,
            epoch: samples / self.windows,
            epoch_position: samples % self.windows,
            windows: self.windows,
            tokens: self.tokens,
            checksum: format!("{:016x}", self.checksum),
        }
    }

    /// Errors unless this is the data `saved` (a checkpoint's record) was
    /// read from: a resumed run must read the windows the uninterrupted
    /// one would.
    pub fn check_position(&self, saved: &DataPosition, checkpoint: &Path) -> Result<()> {
        let here = self.position(saved.samples);
        if (here.windows, here.tokens, &here.checksum)
            == (saved.windows, saved.tokens, &saved.checksum)
        {
            return Ok(());
        }
        Err(data_error(
            &self.sources[0].name,
            format!(
                "the checkpoint {} was trained on {} tokens in {} windows (checksum {}), and [data] now gives {} tokens in {} windows (checksum {})",
                checkpoint.display(),
                saved.tokens,
                saved.windows,
                saved.checksum,
                here.tokens,
                here.windows,
                here.checksum
            ),
            format!(
                "resume with the files the run was trained on, in the same order; or start a new run from its weights with --init-from {}",
                checkpoint.display()
            ),
        ))
    }

    /// Copies the `seq + 1` tokens from `offset` of source `source`, with
    /// documents kept apart the ones after an end of document marked.
    fn copy_window(&self, source: usize, offset: usize, out: &mut [u32]) {
        let tokens = &self.sources[source].tokens;
        let mut after_eos = false;
        for (i, token) in out.iter_mut().enumerate() {
            *token = tokens.token(offset + i);
            if let Some(eos) = self.eos {
                if after_eos {
                    *token |= DOCUMENT_START;
                }
                after_eos = *token & TOKEN_ID == eos;
            }
        }
    }

    /// Window `window` (below [`Corpus::windows`]) in file order, `seq + 1`
    /// tokens with their marks: what an evaluation reads, every window
    /// once.
    pub fn window(&self, window: u64, out: &mut [u32]) {
        assert!(window < self.windows, "window {window} of {}", self.windows);
        self.epoch_window(window, out);
    }

    /// Model tokens in a sequence of its windows.
    pub fn seq(&self) -> usize {
        self.seq
    }

    /// Window `window` of the epoch order.
    fn epoch_window(&self, window: u64, out: &mut [u32]) {
        let source = self.window_first.partition_point(|&f| f <= window) - 1;
        let offset = (window - self.window_first[source]) as usize * self.seq;
        self.copy_window(source, offset, out);
    }

    /// The window starting at `start` of every start the random order
    /// draws from.
    fn random_window(&self, start: u64, out: &mut [u32]) {
        let source = self.start_first.partition_point(|&f| f <= start) - 1;
        self.copy_window(source, (start - self.start_first[source]) as usize, out);
    }
}

/// The files `paths` names, directories expanded (their files in name
/// order, hidden ones left out).
fn data_files(paths: &[PathBuf]) -> Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    for path in paths {
        let meta = std::fs::metadata(path).map_err(|err| {
            os(
                format!("open data {}", path.display()),
                err,
                "check that --data, --tokens (or [data] path) name existing, readable files or directories",
            )
        })?;
        if !meta.is_dir() {
            files.push(path.clone());
            continue;
        }
        let entries = std::fs::read_dir(path).map_err(|err| {
            os(
                format!("list data directory {}", path.display()),
                err,
                "check the directory is readable",
            )
        })?;
        let mut inside = Vec::new();
        for entry in entries {
            let entry = entry.map_err(|err| {
                os(
                    format!("list data directory {}", path.display()),
                    err,
                    "check the directory is readable",
                )
            })?;
            let hidden = entry.file_name().to_string_lossy().starts_with('.');
            if !hidden && entry.path().is_file() {
                inside.push(entry.path());
            }
            if inside.len() > DATA_FILES_MAX {
                break;
            }
        }
        if inside.is_empty() {
            return Err(data_error(
                path,
                "the directory holds no data files",
                "name a directory of token files or texts, or the files themselves",
            ));
        }
        inside.sort();
        files.extend(inside);
    }
    if files.len() > DATA_FILES_MAX {
        return Err(data_error(
            &paths[0],
            format!("more than {DATA_FILES_MAX} data files"),
            "join small shards into larger files",
        ));
    }
    Ok(files)
}

/// A token file of `dtype`, mapped and scanned; `masked`: its ids carry
/// [`NOT_A_TARGET`].
fn open_token_file(path: &Path, dtype: TokenDtype, masked: bool) -> Result<Source> {
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
    if usize::try_from(bytes).is_err() {
        return Err(bad(
            "tokens",
            path.display(),
            "the file is larger than this machine can map",
        ));
    }
    if bytes == 0 {
        return Err(data_error(
            path,
            "the token file is empty",
            "leave it out, or check that it was written whole",
        ));
    }
    // SAFETY: the map is read-only and private to this process; the documented contract is that the token file does not change while a run reads it (a truncation would fault, not corrupt silently).
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|err| {
        os(
            format!("map token file {}", path.display()),
            err,
            "check the file is a regular file",
        )
    })?;
    Ok(Source::scan(
        path.to_path_buf(),
        Tokens::File {
            map: Arc::new(map),
            dtype,
            masked,
        },
    ))
}

/// Where a run stands in its data: the record a checkpoint keeps in
/// `meta.json`, so that a resumed run reads exactly the windows the
/// uninterrupted one would, and refuses other data.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct DataPosition {
    /// Sequences read so far by every rank together: the next step reads
    /// from the one after.
    pub samples: u64,
    /// The epoch the next sequence falls in (`samples / windows`).
    pub epoch: u64,
    /// Its place in that epoch (`samples % windows`).
    pub epoch_position: u64,
    /// Windows in an epoch.
    pub windows: u64,
    /// Tokens in the data.
    pub tokens: u64,
    /// xxh3-64 over each file's length and xxh3-64, in hex.
    pub checksum: String,
}

/// Which windows one rank reads at each step, and where the run stands.
pub struct DataReader<'a> {
    corpus: &'a Corpus,
    order: DataOrder,
    seed: u64,
    rank: usize,
    world: usize,
    accumulation: usize,
    micro_batch: usize,
    /// Sequences every rank together has read before the next step.
    samples: u64,
}

impl<'a> DataReader<'a> {
    /// Rank `rank` of `world` reading `corpus` in `order`, each step
    /// `accumulation` micro-batches of `micro_batch` sequences per rank,
    /// `samples` sequences into the run (0 for a new run, a checkpoint's
    /// [`DataPosition::samples`] for a resumed one).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        corpus: &'a Corpus,
        order: DataOrder,
        seed: u64,
        (rank, world): (usize, usize),
        accumulation: usize,
        micro_batch: usize,
        samples: u64,
    ) -> DataReader<'a> {
        assert!(rank < world, "rank {rank} of {world}");
        DataReader {
            corpus,
            order,
            seed,
            rank,
            world,
            accumulation,
            micro_batch,
            samples,
        }
    }

    /// Sequences every rank together reads in a step.
    fn step_samples(&self) -> u64 {
        (self.world * self.accumulation * self.micro_batch) as u64
    }

    /// This rank's tokens for step `step` (numbered from 1): for each
    /// micro-batch, `micro_batch` windows of `seq + 1` tokens. The
    /// sequences of a step are numbered across ranks, so `world` ranks of
    /// `micro_batch` read what one rank of `world x micro_batch` reads.
    pub fn step_tokens(&mut self, step: u64, out: &mut [u32]) {
        let window_len = self.corpus.seq + 1;
        assert_eq!(
            out.len(),
            self.accumulation * self.micro_batch * window_len,
            "step tokens"
        );
        let mut windows = out.chunks_exact_mut(window_len);
        for m in 0..self.accumulation {
            for i in 0..self.micro_batch {
                let global = ((m * self.world + self.rank) * self.micro_batch + i) as u64;
                let window = windows.next().expect("sized above");
                match self.order {
                    DataOrder::Epoch => {
                        let (_, at) = order::epoch_window(
                            self.seed,
                            self.samples + global,
                            self.corpus.windows,
                        );
                        self.corpus.epoch_window(at, window);
                    }
                    DataOrder::Random => {
                        let start = mix(self.seed, step, global) % self.corpus.starts;
                        self.corpus.random_window(start, window);
                    }
                }
            }
        }
        self.samples += self.step_samples();
    }

    /// Where the run stands after the steps read so far.
    pub fn position(&self) -> DataPosition {
        self.corpus.position(self.samples)
    }
}

/// Where window `global` of `step` starts in a corpus of one file of `len`
/// tokens, in the random order (the `(m x world + rank) x micro_batch +
/// i`-th sequence of the step, of `seq + 1` tokens): SplitMix64's
/// finalizer over (seed, step, window), modulo the `len - seq - 1` possible
/// starts. Peers that train on the same tokens
/// (`benches/gpu_vs_deepspeed.py`) compute the same.
pub fn window_start(seed: u64, step: u64, global: u64, len: usize, seq: usize) -> usize {
    (mix(seed, step, global) % (len - seq - 1) as u64) as usize
}

/// SplitMix64's finalizer over the three inputs.
fn mix(seed: u64, step: u64, window: u64) -> u64 {
    let z = seed
        .wrapping_mul(0x9e37_79b9_7f4a_7c15)
        .wrapping_add(step.wrapping_mul(0xbf58_476d_1ce4_e5b9))
        .wrapping_add(window.wrapping_mul(0x94d0_49bb_1331_11eb));
    order::finalize(z)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rank `rank` of `world`'s tokens of step `step` (one micro-batch
    /// count and size), `samples` sequences into the run.
    #[allow(clippy::too_many_arguments)]
    fn read(
        corpus: &Corpus,
        order: DataOrder,
        seed: u64,
        step: u64,
        (rank, world): (usize, usize),
        accumulation: usize,
        micro_batch: usize,
        samples: u64,
    ) -> Vec<u32> {
        let mut out = vec![0; accumulation * micro_batch * (corpus.seq + 1)];
        DataReader::new(
            corpus,
            order,
            seed,
            (rank, world),
            accumulation,
            micro_batch,
            samples,
        )
        .step_tokens(step, &mut out);
        out
    }

    #[test]
    fn two_ranks_read_what_one_rank_of_twice_the_batch_reads() {
        let corpus = ByteCorpus::new((0..=255u8).cycle().take(5000).collect(), 16).unwrap();
        let (seq, accumulation) = (16, 2);
        for order in [DataOrder::Random, DataOrder::Epoch] {
            let one = read(&corpus, order, 7, 3, (0, 1), accumulation, 4, 16);
            let halves: Vec<Vec<u32>> = (0..2)
                .map(|rank| read(&corpus, order, 7, 3, (rank, 2), accumulation, 2, 16))
                .collect();
            let window = 2 * (seq + 1);
            for m in 0..accumulation {
                let joined: Vec<u32> = [
                    &halves[0][m * window..][..window],
                    &halves[1][m * window..][..window],
                ]
                .concat();
                assert_eq!(joined, one[m * 2 * window..][..2 * window], "{order:?}");
            }
            let other_step = read(&corpus, order, 7, 4, (0, 1), accumulation, 4, 24);
            assert_ne!(one, other_step, "steps read different windows ({order:?})");
        }
    }

    /// The random order of one file is the one strata always drew (the
    /// golden losses and the GPU bench's replay depend on it).
    #[test]
    fn the_random_order_of_one_file_starts_where_window_start_says() {
        let text: Vec<u8> = (0..3000u32).map(|i| (i * 7 % 251) as u8).collect();
        let corpus = Corpus::new(text.clone(), 16).unwrap();
        let tokens = read(&corpus, DataOrder::Random, 5, 2, (1, 2), 2, 3, 0);
        for (n, window) in tokens.chunks_exact(17).enumerate() {
            let (m, i) = (n / 3, n % 3);
            let global = ((m * 2 + 1) * 3 + i) as u64;
            let start = window_start(5, 2, global, text.len(), 16);
            let expected: Vec<u32> = text[start..start + 17].iter().map(|&b| b.into()).collect();
            assert_eq!(window, expected);
        }
    }

    #[test]
    fn an_epoch_reads_every_window_once_whatever_the_ranks() {
        let dir = tempfile::tempdir().unwrap();
        // Two files of 5 and 3 windows (and a tail shorter than one):
        // token t of file f is f * 1000 + t, so a window names its place.
        let seq = 4;
        let mut paths = Vec::new();
        for (f, len) in [(0u32, 22u32), (1, 14)] {
            let path = dir.path().join(format!("shard-{f}.bin"));
            let ids: Vec<u8> = (0..len)
                .flat_map(|t| ((f * 1000 + t) as u16).to_le_bytes())
                .collect();
            std::fs::write(&path, ids).unwrap();
            paths.push(path);
        }
        let config = DataConfig {
            path: DataPaths(vec![dir.path().to_path_buf()]),
            format: DataFormat::Tokens,
            ..DataConfig::default()
        };
        let corpus = Corpus::open(&config, seq).unwrap();
        assert_eq!((corpus.files(), corpus.windows(), corpus.len()), (2, 8, 36));
        let mut expected: Vec<Vec<u32>> = Vec::new();
        for (f, windows) in [(0u32, 5u32), (1, 3)] {
            for w in 0..windows {
                expected.push(
                    (0..=seq as u32)
                        .map(|t| f * 1000 + w * seq as u32 + t)
                        .collect(),
                );
            }
        }
        expected.sort();
        // Two epochs of 8 windows, 4 steps of 4 sequences: by one rank of
        // 2 micro-batches of 2, and by two ranks of one micro-batch of 2.
        for (world, micro_batch) in [(1usize, 2usize), (2, 1)] {
            let mut readers: Vec<DataReader<'_>> = (0..world)
                .map(|rank| {
                    DataReader::new(
                        &corpus,
                        DataOrder::Epoch,
                        9,
                        (rank, world),
                        2,
                        micro_batch,
                        0,
                    )
                })
                .collect();
            let mut seen: Vec<Vec<u32>> = Vec::new();
            for step in 1..=4 {
                for reader in &mut readers {
                    let mut out = vec![0; 2 * micro_batch * (seq + 1)];
                    reader.step_tokens(step, &mut out);
                    seen.extend(out.chunks_exact(seq + 1).map(<[u32]>::to_vec));
                }
            }
            let position = readers[0].position();
            assert_eq!(
                (position.samples, position.epoch, position.epoch_position),
                (16, 2, 0)
            );
            for epoch in seen.chunks_exact(8).map(<[Vec<u32>]>::to_vec) {
                let mut epoch = epoch;
                epoch.sort();
                assert_eq!(epoch, expected, "an epoch of {world} ranks");
            }
        }
        // Resumed 6 sequences in (mid-epoch), a reader reads what the
        // uninterrupted run read from there.
        let whole = read(&corpus, DataOrder::Epoch, 9, 3, (0, 1), 1, 4, 8);
        let mut resumed = DataReader::new(&corpus, DataOrder::Epoch, 9, (0, 1), 1, 2, 6);
        let mut out = vec![0; 2 * (seq + 1)];
        resumed.step_tokens(4, &mut out);
        assert_ne!(
            out[..],
            whole[..2 * (seq + 1)],
            "mid-epoch differs from a step start"
        );
        resumed.step_tokens(5, &mut out);
        assert_eq!(out[..], whole[..2 * (seq + 1)]);
    }

    #[test]
    fn a_checkpoint_of_other_data_is_refused_naming_both() {
        let corpus = Corpus::new(vec![b'a'; 500], 16).unwrap();
        let saved = corpus.position(40);
        assert_eq!(
            (saved.epoch, saved.epoch_position, saved.windows),
            (1, 9, 31)
        );
        corpus
            .check_position(&saved, Path::new("ckpt/step-5"))
            .unwrap();
        let other = Corpus::new(vec![b'b'; 500], 16).unwrap();
        let err = other
            .check_position(&saved, Path::new("ckpt/step-5"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("trained on 500 tokens in 31 windows")
                && err.contains("--init-from ckpt/step-5"),
            "{err}"
        );
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
    fn a_text_shorter_than_a_window_is_refused() {
        let err = ByteCorpus::new(b"short".to_vec(), 64).unwrap_err();
        assert!(err.to_string().contains("longer than model.seq"), "{err}");
    }

    #[test]
    fn bad_data_files_are_named_with_the_problem() {
        let dir = tempfile::tempdir().unwrap();
        let tokens = |paths: Vec<PathBuf>| DataConfig {
            path: DataPaths(paths),
            format: DataFormat::Tokens,
            ..DataConfig::default()
        };
        let empty_dir = dir.path().join("empty");
        std::fs::create_dir(&empty_dir).unwrap();
        let err = Corpus::open(&tokens(vec![empty_dir]), 16)
            .unwrap_err()
            .to_string();
        assert!(err.contains("holds no data files"), "{err}");
        let empty = dir.path().join("empty.bin");
        std::fs::write(&empty, b"").unwrap();
        let err = Corpus::open(&tokens(vec![empty]), 16)
            .unwrap_err()
            .to_string();
        assert!(err.contains("empty.bin: the token file is empty"), "{err}");
        let short = dir.path().join("short.bin");
        std::fs::write(&short, [0u8; 20]).unwrap();
        let err = Corpus::open(&tokens(vec![short]), 16)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(
                "short.bin: it holds 10 tokens, and a file needs more than model.seq + 1 = 17 tokens"
            ),
            "{err}"
        );
        let err = Corpus::open(&tokens(vec![dir.path().join("none")]), 16)
            .unwrap_err()
            .to_string();
        assert!(err.contains("open data") && err.contains("none"), "{err}");
        // An id past the vocabulary in the second of two files: the file
        // and the token named.
        let (a, b) = (dir.path().join("a.bin"), dir.path().join("b.bin"));
        std::fs::write(&a, [1u8; 100]).unwrap();
        let mut ids = vec![0u8; 100];
        ids[60..62].copy_from_slice(&700u16.to_le_bytes());
        std::fs::write(&b, ids).unwrap();
        let err = Corpus::open(&tokens(vec![a, b]), 16)
            .unwrap()
            .check_vocab(512)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("the first such id is 700, token 30 of the file (in ")
                && err.contains("b.bin"),
            "{err}"
        );
    }

    #[test]
    fn a_token_file_reads_the_windows_a_text_of_the_same_ids_reads() {
        let dir = tempfile::tempdir().unwrap();
        let ids: Vec<u8> = (0..3000u32).map(|i| (i * 7 % 251) as u8).collect();
        let text = Corpus::new(ids.clone(), 16).unwrap();
        let from_text = read(&text, DataOrder::Random, 5, 2, (0, 1), 1, 3, 0);
        for dtype in [TokenDtype::U16, TokenDtype::U32] {
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
            assert_eq!((file.len(), file.sources[0].max_token), (3000, 250));
            for order in [DataOrder::Random, DataOrder::Epoch] {
                assert_eq!(
                    read(&file, order, 5, 2, (0, 1), 1, 3, 6),
                    read(&text, order, 5, 2, (0, 1), 1, 3, 6),
                );
            }
            assert_eq!(
                read(&file, DataOrder::Random, 5, 2, (0, 1), 1, 3, 0),
                from_text
            );
        }
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

    /// Documents kept apart: a token after the end of document is marked
    /// DOCUMENT_START in the windows as read (never stored), including
    /// across the window's first token, and its id stays below the mark.
    #[test]
    fn documents_kept_apart_mark_each_start_in_the_windows() {
        // Byte tokens: documents end at byte 0.
        let text: Vec<u8> = b"ab\0cde\0f\0ghij\0".repeat(4);
        let corpus = Corpus::new(text.clone(), 7).unwrap().with_documents(0);
        let mut window = vec![0u32; 8];
        corpus.epoch_window(0, &mut window);
        let want: Vec<u32> = [b'a', b'b', 0, b'c', b'd', b'e', 0, b'f']
            .iter()
            .enumerate()
            .map(|(i, &b)| match i {
                3 | 7 => u32::from(b) | DOCUMENT_START,
                _ => u32::from(b),
            })
            .collect();
        assert_eq!(window, want);
        assert!(!is_target(window[3]) && is_target(window[4]));
        assert!(window.iter().all(|t| (t & TOKEN_ID) < 256));
        // Without it, the same ids unmarked.
        let plain = Corpus::new(text, 7).unwrap();
        let mut unmarked = vec![0u32; 8];
        plain.epoch_window(0, &mut unmarked);
        let ids: Vec<u32> = window.iter().map(|t| t & TOKEN_ID).collect();
        assert_eq!(unmarked, ids);
    }
}
