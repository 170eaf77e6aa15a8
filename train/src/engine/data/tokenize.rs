//! Texts through the model's tokenizer: plain text files or JSONL with a
//! text field, tokenized once (documents in parallel on every core) into a
//! token file in a cache beside the data, named by a key over the sources'
//! checksums and the tokenizer's. A run over unchanged sources and
//! tokenizer reads the cache; a change of either makes another key, so a
//! stale cache is never read.
//!
//! Each document is the tokenizer's encoding with its special tokens (a
//! begin-of-text token where its post-processor adds one), as
//! transformers' `tokenizer(text)["input_ids"]` gives it, then the end-of-text token
//! `tokenizer_config.json` names (`eos_token`), when it names one, so that
//! documents stay apart in the token stream.
//!
//! A supervised line (`format = "sft"`) is one document: its prompt
//! encoded with the special tokens, its response without them (as
//! `tokenizer(prompt)["input_ids"] + tokenizer(response,
//! add_special_tokens=False)["input_ids"]`), then the end-of-text token.
//! The prompt's tokens carry [`NOT_A_TARGET`] (transformers' label -100):
//! the loss is on the response and the end of text alone. Such a cache is
//! u32 whatever the vocabulary, for the flag.

use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::chat::ChatTemplate;
use super::{DataConfig, DataFormat, NOT_A_TARGET, TokenDtype, data_error, data_files};
use crate::error::{Result, bad, os};

/// The layout of a cache file; a change makes every key new.
const CACHE_FORMAT: u32 = 1;

/// Text handed to the tokenizer at once (a batch of documents).
const BATCH_BYTES: usize = 8 << 20;

/// The largest plain text file, tokenized as one document in memory.
pub const TEXT_DOCUMENT_BYTES_MAX: u64 = 1 << 30;

/// Bytes read at a time when a source is checksummed.
const HASH_BYTES: usize = 1 << 20;

/// What [`tokenize`] made or found.
#[derive(Clone, Debug)]
pub struct Tokenized {
    /// The token file.
    pub path: PathBuf,
    /// How it stores each id.
    pub dtype: TokenDtype,
    /// Documents in it.
    pub documents: u64,
    /// Tokens in it.
    pub tokens: u64,
    /// Whether it was there already (unchanged sources and tokenizer).
    pub reused: bool,
    /// Whether its ids carry [`NOT_A_TARGET`] (supervised data: the
    /// prompts' tokens are no loss targets).
    pub masked: bool,
    /// Tokens that are loss targets (all of them without masks).
    pub targets: u64,
    /// The end-of-text id that ends each document, where the tokenizer's
    /// `tokenizer_config.json` names one.
    pub eos: Option<u32>,
}

/// The record beside a cache file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
struct CacheMeta {
    key: String,
    tokenizer: PathBuf,
    sources: Vec<PathBuf>,
    documents: u64,
    tokens: u64,
    dtype: TokenDtype,
    #[serde(default)]
    masked: bool,
    #[serde(default)]
    targets: u64,
}

/// The tokenizer `[data] tokenizer` names: a directory holding
/// `tokenizer.json`, or the file itself; and the end-of-text id its
/// `tokenizer_config.json` names.
struct Loaded {
    tokenizer: tokenizers::Tokenizer,
    file: PathBuf,
    bytes: Vec<u8>,
    eos: Option<u32>,
    /// `tokenizer_config.json`'s chat template, where it has one, and the
    /// file's bytes (in the cache key).
    chat: Option<ChatTemplate>,
    config_bytes: Vec<u8>,
}

/// The model's tokenizer for text in and out (a prompt, what a model
/// writes): as [`tokenize`] reads it, with its end-of-text id.
pub struct TextTokenizer(Loaded);

impl std::fmt::Debug for TextTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TextTokenizer")
            .field("file", &self.0.file)
            .field("eos", &self.0.eos)
            .finish()
    }
}

impl TextTokenizer {
    /// The tokenizer at `path`: a directory holding `tokenizer.json`, or
    /// the file.
    pub fn open(path: &Path) -> Result<TextTokenizer> {
        load_tokenizer(path).map(TextTokenizer)
    }

    /// `text`'s ids, with the special tokens (transformers'
    /// `tokenizer(text)["input_ids"]`).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let encoding = self.0.tokenizer.encode(text, true).map_err(|err| {
            data_error(
                &self.0.file,
                format!("the tokenizer failed on the text: {err}"),
                "check the tokenizer and the text",
            )
        })?;
        Ok(encoding.get_ids().to_vec())
    }

    /// The text of `ids`, special tokens included.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.0.tokenizer.decode(ids, false).map_err(|err| {
            data_error(
                &self.0.file,
                format!("the tokenizer cannot decode the ids: {err}"),
                "check that the tokenizer is the model's",
            )
        })
    }

    /// The end-of-text id its `tokenizer_config.json` names.
    pub fn eos(&self) -> Option<u32> {
        self.0.eos
    }
}

fn load_tokenizer(path: &Path) -> Result<Loaded> {
    let file = if path.is_dir() {
        path.join("tokenizer.json")
    } else {
        path.to_path_buf()
    };
    let bytes = std::fs::read(&file).map_err(|err| {
        os(
            format!("read tokenizer {}", file.display()),
            err,
            "name a directory holding tokenizer.json (a Hugging Face model folder), or the file, with --tokenizer (data.tokenizer)",
        )
    })?;
    let mut tokenizer = tokenizers::Tokenizer::from_bytes(&bytes).map_err(|err| {
        data_error(
            &file,
            format!("it is not a tokenizer the tokenizers library reads: {err}"),
            "give the tokenizer.json of a Hugging Face fast tokenizer",
        )
    })?;
    // Documents whole and unpadded, as transformers' plain call encodes
    // them: a tokenizer.json may carry truncation and padding settings.
    tokenizer.with_padding(None);
    tokenizer
        .with_truncation(None)
        .expect("turning truncation off cannot fail");
    let config = file.with_file_name("tokenizer_config.json");
    let (eos, chat, config_bytes) = match std::fs::read(&config) {
        Ok(text) => {
            let value: serde_json::Value = serde_json::from_slice(&text).map_err(|err| {
                data_error(
                    &config,
                    format!("it does not parse as JSON: {err}"),
                    "fix or remove the file",
                )
            })?;
            let (bos, eos) = (
                special_token(&value, "bos_token"),
                special_token(&value, "eos_token"),
            );
            let chat = chat_template(&value)
                .map(|source| ChatTemplate::new(source, bos, eos.clone()))
                .transpose()
                .map_err(|problem| {
                    data_error(&config, problem, "fix its chat_template, or remove it")
                })?;
            (eos.and_then(|t| tokenizer.token_to_id(&t)), chat, text)
        }
        Err(_) => (None, None, Vec::new()),
    };
    Ok(Loaded {
        tokenizer,
        file,
        bytes,
        eos,
        chat,
        config_bytes,
    })
}

/// A special token of a `tokenizer_config.json` (`eos_token`,
/// `bos_token`): a string, or an added token's `content`.
fn special_token(config: &serde_json::Value, key: &str) -> Option<String> {
    match config.get(key) {
        Some(serde_json::Value::String(token)) => Some(token.clone()),
        Some(token) => token
            .get("content")
            .and_then(|c| c.as_str())
            .map(String::from),
        None => None,
    }
}

/// A `tokenizer_config.json`'s chat template: a string, or among named
/// ones the one named `default`.
fn chat_template(config: &serde_json::Value) -> Option<&str> {
    match config.get("chat_template")? {
        serde_json::Value::String(source) => Some(source),
        serde_json::Value::Array(named) => named
            .iter()
            .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
            .and_then(|t| t.get("template"))
            .and_then(|t| t.as_str()),
        _ => None,
    }
}

/// A source file opened for reading.
fn open_source(path: &Path) -> Result<std::fs::File> {
    std::fs::File::open(path).map_err(|err| {
        os(
            format!("open data {}", path.display()),
            err,
            "check that --data (or [data] path) names readable files",
        )
    })
}

/// xxh3-64 of a file's bytes, read a piece at a time.
fn checksum(path: &Path, progress: &dyn Fn(u64)) -> Result<u64> {
    let mut file = open_source(path)?;
    let mut hasher = xxhash_rust::xxh3::Xxh3::new();
    let mut buffer = vec![0; HASH_BYTES];
    loop {
        let n = std::io::Read::read(&mut file, &mut buffer).map_err(|err| {
            os(
                format!("read data {}", path.display()),
                err,
                "check the file",
            )
        })?;
        if n == 0 {
            return Ok(hasher.digest());
        }
        hasher.update(&buffer[..n]);
        progress(n as u64);
    }
}

/// Bytes [`tokenize`] reads for `data`: each source twice (checksummed,
/// then tokenized, unless a cache is found), for a progress bar's length.
pub fn tokenize_bytes(data: &DataConfig) -> Result<u64> {
    let mut total = 0;
    for path in data_files(&data.path.0)? {
        total += std::fs::metadata(&path)
            .map_err(|err| os(format!("stat {}", path.display()), err, "check the file"))?
            .len();
    }
    Ok(2 * total)
}

/// Tokenizes `data`'s sources with its tokenizer into a token file in the
/// cache, or finds the one made from the same sources and tokenizer.
/// Refuses a tokenizer with more ids than `vocab`. `progress` is told of
/// each stretch of source bytes read.
pub fn tokenize(data: &DataConfig, vocab: usize, progress: &dyn Fn(u64)) -> Result<Tokenized> {
    let Some(tokenizer_path) = data.tokenizer.as_deref() else {
        return Err(bad(
            "data.tokenizer",
            "none",
            "name the model's tokenizer (--tokenizer DIR) to tokenize texts or JSONL",
        ));
    };
    if data.path.is_empty() {
        return Err(bad(
            "data.path",
            "none",
            "name the texts or JSONL files to tokenize (--data)",
        ));
    }
    let files = data_files(&data.path.0)?;
    let loaded = load_tokenizer(tokenizer_path)?;
    // Ids may have gaps (an added token past the vocabulary): the largest
    // bounds the model's vocabulary and the file's width, not the count.
    let ids = loaded
        .tokenizer
        .get_vocab(true)
        .values()
        .max()
        .map_or(0, |&id| id as usize + 1);
    if ids > vocab {
        return Err(bad(
            "model.vocab",
            vocab,
            format!(
                "the tokenizer {} has {ids} ids, more than the model's vocabulary: set model.vocab to at least {ids}, or use the model's own tokenizer",
                loaded.file.display()
            ),
        ));
    }
    let masked = data.format == DataFormat::Sft;
    let dtype = if ids <= 1 << 16 && !masked {
        TokenDtype::U16
    } else {
        TokenDtype::U32
    };
    if data.format == DataFormat::Tokens {
        return Err(bad(
            "data.tokenizer",
            loaded.file.display(),
            "token files are tokenized already: leave data.tokenizer out, or give texts or JSONL (--data)",
        ));
    }
    if data.format == DataFormat::Text
        && let Some(jsonl) = files.iter().find(|f| super::table::is_jsonl(f))
    {
        return Err(data_error(
            jsonl,
            "a .jsonl file among texts, which would be tokenized as one document of JSON",
            "set data.format = \"jsonl\" (--data infers it when every file named ends in .jsonl), or keep texts and JSONL apart",
        ));
    }
    let field = match data.format {
        DataFormat::Sft => format!("{} {}", data.prompt_field(), data.response_field()),
        _ => data.text_field().to_string(),
    };
    let mut hasher = xxhash_rust::xxh3::Xxh3::new();
    hasher.update(&CACHE_FORMAT.to_le_bytes());
    hasher.update(&xxhash_rust::xxh3::xxh3_64(&loaded.bytes).to_le_bytes());
    hasher.update(&xxhash_rust::xxh3::xxh3_64(&loaded.config_bytes).to_le_bytes());
    hasher.update(&loaded.eos.map_or(u64::MAX, u64::from).to_le_bytes());
    hasher.update(format!("{:?} {field}", data.format).as_bytes());
    for path in &files {
        hasher.update(&checksum(path, progress)?.to_le_bytes());
    }
    let key = format!("{:016x}", hasher.digest());
    let dir = match &data.cache_dir {
        Some(dir) => dir.clone(),
        None => files[0]
            .parent()
            .unwrap_or(Path::new("."))
            .join(".strata-cache"),
    };
    let stem = files[0]
        .file_stem()
        .map_or_else(|| "data".into(), |s| s.to_string_lossy().into_owned());
    let path = dir.join(format!("{stem}-{key}.{dtype}"));
    let meta_path = path.with_extension(format!("{dtype}.json"));
    if let Some(meta) = std::fs::read(&meta_path)
        .ok()
        .and_then(|bytes| serde_json::from_slice::<CacheMeta>(&bytes).ok())
        .filter(|meta| meta.key == key)
    {
        let len = std::fs::metadata(&path)
            .map(|m| m.len())
            .unwrap_or(u64::MAX);
        if len == meta.tokens * dtype.bytes() as u64 {
            return Ok(Tokenized {
                path,
                dtype,
                documents: meta.documents,
                tokens: meta.tokens,
                reused: true,
                masked,
                targets: meta.targets,
                eos: loaded.eos,
            });
        }
    }
    std::fs::create_dir_all(&dir).map_err(|err| {
        os(
            format!("create the token cache {}", dir.display()),
            err,
            "set data.cache_dir to a writable directory",
        )
    })?;
    let tmp = path.with_extension(format!("{dtype}.tmp-{}", std::process::id()));
    let written = write_tokens(&loaded, data, &files, dtype, &tmp, progress);
    let (documents, tokens, targets) = match written {
        Ok(counts) => counts,
        Err(err) => {
            let _ = std::fs::remove_file(&tmp);
            return Err(err);
        }
    };
    let meta = CacheMeta {
        key,
        tokenizer: loaded.file.clone(),
        sources: files,
        documents,
        tokens,
        dtype,
        masked,
        targets,
    };
    // The record first, then the token file: the token file's rename is
    // the commit. A record without its token file (a crash between the
    // two) is never read, as the token file's length is checked against it.
    let meta_tmp = meta_path.with_extension(format!("json.tmp-{}", std::process::id()));
    let publish = || -> std::io::Result<()> {
        let json = serde_json::to_vec_pretty(&meta).expect("serializes");
        std::fs::write(&meta_tmp, json)?;
        std::fs::rename(&meta_tmp, &meta_path)?;
        std::fs::rename(&tmp, &path)?;
        std::fs::File::open(&dir)?.sync_all()
    };
    publish().map_err(|err| {
        for left in [&tmp, &meta_tmp] {
            let _ = std::fs::remove_file(left);
        }
        os(
            format!(
                "write the token cache {} and its record {}",
                path.display(),
                meta_path.display()
            ),
            err,
            "check the cache directory's room and permissions (data.cache_dir)",
        )
    })?;
    Ok(Tokenized {
        path,
        dtype,
        documents,
        tokens,
        reused: false,
        masked,
        targets,
        eos: loaded.eos,
    })
}

/// Tokenizes every document of `files` into `target`, returning the
/// documents, tokens and loss targets written.
fn write_tokens(
    loaded: &Loaded,
    data: &DataConfig,
    files: &[PathBuf],
    dtype: TokenDtype,
    target: &Path,
    progress: &dyn Fn(u64),
) -> Result<(u64, u64, u64)> {
    let file = std::fs::File::create(target).map_err(|err| {
        os(
            format!("create the token cache {}", target.display()),
            err,
            "set data.cache_dir to a writable directory",
        )
    })?;
    let mut out = Writer {
        file: std::io::BufWriter::with_capacity(1 << 20, file),
        dtype,
        target,
        masked: data.format == DataFormat::Sft,
        tokens: 0,
        documents: 0,
        targets: 0,
    };
    let mut batch = Batch::default();
    for path in files {
        match data.format {
            DataFormat::Jsonl => {
                let field = data.text_field();
                for_each_line(path, progress, &mut |number, value| {
                    let text = string_field(path, number, &value, field, TEXT_FIX)?;
                    batch.add(Doc::Text(text), loaded, &mut out)
                })?;
            }
            DataFormat::Sft => {
                for_each_line(path, progress, &mut |number, value| {
                    let doc = supervised(path, number, &value, data, loaded)?;
                    batch.add(doc, loaded, &mut out)
                })?;
            }
            DataFormat::Text => {
                let len = std::fs::metadata(path).map(|m| m.len()).unwrap_or(0);
                if len > TEXT_DOCUMENT_BYTES_MAX {
                    return Err(data_error(
                        path,
                        format!(
                            "a text file is tokenized as one document, and it holds {len} bytes, past {TEXT_DOCUMENT_BYTES_MAX}"
                        ),
                        "split it into several files, or give JSONL with a document per line",
                    ));
                }
                let text = std::fs::read_to_string(path).map_err(|err| {
                    os(
                        format!("read text {}", path.display()),
                        err,
                        "give UTF-8 text files to --data with --tokenizer",
                    )
                })?;
                batch.add(Doc::Text(text), loaded, &mut out)?;
                progress(len);
            }
            DataFormat::Tokens => unreachable!("refused before the sources are read"),
        }
    }
    batch.encode(loaded, &mut out)?;
    if out.tokens == 0 {
        return Err(data_error(
            &files[0],
            "the data holds no text to tokenize",
            "give files with text in them",
        ));
    }
    let file = out
        .file
        .into_inner()
        .map_err(|err| err.into_error())
        .and_then(|file| file.sync_all().map(|()| file));
    file.map_err(|err| {
        os(
            format!("write the token cache {}", target.display()),
            err,
            "check the cache directory's room (data.cache_dir)",
        )
    })?;
    Ok((out.documents, out.tokens, out.targets))
}

/// Calls `each` with the number and the parsed object of every line of a
/// JSONL file (blank lines skipped), telling `progress` of each line's
/// bytes; a line that does not parse is refused with its number.
fn for_each_line(
    path: &Path,
    progress: &dyn Fn(u64),
    each: &mut dyn FnMut(usize, serde_json::Value) -> Result<()>,
) -> Result<()> {
    let file = open_source(path)?;
    for (index, line) in std::io::BufReader::new(file).lines().enumerate() {
        let number = index + 1;
        let line = line.map_err(|err| match err.kind() {
            std::io::ErrorKind::InvalidData => data_error(
                path,
                format!("line {number} cannot be read as UTF-8 text: {err}"),
                "give UTF-8 JSONL, one JSON object per line",
            ),
            _ => os(
                format!("read line {number} of {}", path.display()),
                err,
                "check the file",
            ),
        })?;
        // Its bytes and the newline, as the progress bar counts the file.
        progress(line.len() as u64 + 1);
        if line.trim().is_empty() {
            continue;
        }
        let value: serde_json::Value = serde_json::from_str(&line).map_err(|err| {
            data_error(
                path,
                format!("line {number} does not parse as JSON: {err}"),
                "give JSONL, one JSON object per line",
            )
        })?;
        each(number, value)?;
    }
    Ok(())
}

/// What a JSONL line without its text field is told.
const TEXT_FIX: &str = "set data.text_field to the field that holds each document's text";

/// Line `number`'s string `field`, or an error naming both and `fix`.
fn string_field(
    path: &Path,
    number: usize,
    value: &serde_json::Value,
    field: &str,
    fix: &str,
) -> Result<String> {
    match value.get(field).and_then(|t| t.as_str()) {
        Some(text) => Ok(text.to_string()),
        None => Err(data_error(
            path,
            format!("line {number} has no string field {field:?}"),
            fix,
        )),
    }
}

/// A supervised line's document: its `messages` through the chat template,
/// or its prompt and response.
fn supervised(
    path: &Path,
    number: usize,
    value: &serde_json::Value,
    data: &DataConfig,
    loaded: &Loaded,
) -> Result<Doc> {
    if let Some(messages) = value.get(MESSAGES) {
        let Some(chat) = &loaded.chat else {
            return Err(data_error(
                path,
                format!(
                    "line {number} holds chat messages, and the tokenizer's tokenizer_config.json has no chat_template"
                ),
                "give the model's tokenizer (its chat template renders the messages), or prompt and response fields",
            ));
        };
        let (text, spans) = chat.render(messages).map_err(|problem| {
            data_error(
                path,
                format!("line {number}: {problem}"),
                "give messages of roles and contents the model's chat template takes, with an assistant turn",
            )
        })?;
        return Ok(Doc::Chat(text, spans));
    }
    let fix = "set data.prompt_field and data.response_field to the fields that hold each line's prompt and response, or give chat messages in a \"messages\" field";
    let prompt = string_field(path, number, value, data.prompt_field(), fix)?;
    let response = string_field(path, number, value, data.response_field(), fix)?;
    Ok(Doc::Pair(prompt, response))
}

/// The field of a supervised line that holds chat messages.
const MESSAGES: &str = "messages";

/// One document to tokenize.
enum Doc {
    /// A text, every token a target.
    Text(String),
    /// A prompt (no targets) and its response.
    Pair(String, String),
    /// A conversation as its chat template writes it, and the byte ranges
    /// of its assistant turns (the targets).
    Chat(String, Vec<std::ops::Range<usize>>),
}

/// Documents waiting to be encoded together, in order.
#[derive(Default)]
struct Batch {
    docs: Vec<Doc>,
    bytes: usize,
}

impl Batch {
    /// Adds a document (an empty text is none), encoding the batch once it
    /// holds [`BATCH_BYTES`].
    fn add(&mut self, doc: Doc, loaded: &Loaded, out: &mut Writer<'_>) -> Result<()> {
        self.bytes += match &doc {
            Doc::Text(text) if text.is_empty() => return Ok(()),
            Doc::Text(text) | Doc::Chat(text, _) => text.len(),
            Doc::Pair(prompt, response) => prompt.len() + response.len(),
        };
        self.docs.push(doc);
        if self.bytes >= BATCH_BYTES {
            self.encode(loaded, out)?;
        }
        Ok(())
    }

    /// Encodes the documents (in parallel, by the tokenizers library's
    /// pool) and writes their ids in order.
    fn encode(&mut self, loaded: &Loaded, out: &mut Writer<'_>) -> Result<()> {
        let encode = |texts: Vec<String>, special: bool, offsets: bool| {
            let tokenizer = &loaded.tokenizer;
            let done = if offsets {
                tokenizer.encode_batch(texts, special)
            } else {
                tokenizer.encode_batch_fast(texts, special)
            };
            done.map_err(|err| {
                data_error(
                    &loaded.file,
                    format!("the tokenizer failed on the data: {err}"),
                    "check the tokenizer and the text",
                )
            })
        };
        self.bytes = 0;
        // The texts move into their batches; what each document was (and a
        // conversation's turns) stays, in order.
        let mut texts = Vec::new();
        let (mut prompts, mut responses, mut chats) = (Vec::new(), Vec::new(), Vec::new());
        let docs: Vec<Doc> = std::mem::take(&mut self.docs)
            .into_iter()
            .map(|doc| match doc {
                Doc::Text(text) => {
                    texts.push(text);
                    Doc::Text(String::new())
                }
                Doc::Pair(prompt, response) => {
                    prompts.push(prompt);
                    responses.push(response);
                    Doc::Pair(String::new(), String::new())
                }
                // A template writes its special tokens as text.
                Doc::Chat(text, spans) => {
                    chats.push(text);
                    Doc::Chat(String::new(), spans)
                }
            })
            .collect();
        let mut texts = encode(texts, true, false)?.into_iter();
        let mut prompts = encode(prompts, true, false)?.into_iter();
        let mut responses = encode(responses, false, false)?.into_iter();
        let mut chats = encode(chats, false, true)?.into_iter();
        let eos = loaded.eos.map(|id| (id, true));
        for doc in &docs {
            match doc {
                Doc::Text(_) => {
                    let ids = texts.next().expect("one encoding a text");
                    let tokens = ids.get_ids().iter().map(|&id| (id, true));
                    out.document(tokens.chain(eos))?;
                }
                Doc::Pair(..) => {
                    let prompt = prompts.next().expect("one encoding a prompt");
                    let response = responses.next().expect("one encoding a response");
                    let tokens = prompt.get_ids().iter().map(|&id| (id, false));
                    let answer = response.get_ids().iter().map(|&id| (id, true));
                    out.document(tokens.chain(answer).chain(eos))?;
                }
                Doc::Chat(_, spans) => {
                    let chat = chats.next().expect("one encoding a conversation");
                    // A target is a token wholly inside an assistant turn.
                    let within = |&(start, end): &(usize, usize)| {
                        spans.iter().any(|s| s.start <= start && end <= s.end)
                    };
                    let tokens = chat
                        .get_ids()
                        .iter()
                        .zip(chat.get_offsets())
                        .map(|(&id, offsets)| (id, within(offsets)));
                    out.document(tokens.chain(eos))?;
                }
            }
        }
        Ok(())
    }
}

/// The token file being written.
struct Writer<'a> {
    file: std::io::BufWriter<std::fs::File>,
    dtype: TokenDtype,
    target: &'a Path,
    /// Supervised data: prompts and each document's first token are
    /// marked [`NOT_A_TARGET`].
    masked: bool,
    tokens: u64,
    documents: u64,
    targets: u64,
}

impl Writer<'_> {
    /// Writes a document's tokens, each with whether it is a loss target.
    /// With masks the others are marked [`NOT_A_TARGET`], and so is the
    /// first token whatever it is: nothing before it in the document
    /// predicts it. Without masks every token is written as it is.
    fn document(&mut self, tokens: impl Iterator<Item = (u32, bool)>) -> Result<()> {
        let (masked, dtype, file) = (self.masked, self.dtype, &mut self.file);
        let (mut len, mut targets) = (0u64, 0u64);
        let mut written = Ok(());
        for (i, (id, target)) in tokens.enumerate() {
            let target = !masked || (target && i > 0);
            let id = if target { id } else { id | NOT_A_TARGET };
            len += 1;
            targets += u64::from(target);
            written = match dtype {
                // The width was chosen from the largest id the tokenizer
                // has (u32 with masks).
                TokenDtype::U16 => file.write_all(
                    &u16::try_from(id)
                        .expect("ids fit the width chosen for them")
                        .to_le_bytes(),
                ),
                TokenDtype::U32 => file.write_all(&id.to_le_bytes()),
            };
            if written.is_err() {
                break;
            }
        }
        written.map_err(|err| {
            os(
                format!("write the token cache {}", self.target.display()),
                err,
                "check the cache directory's room (data.cache_dir)",
            )
        })?;
        self.tokens += len;
        self.targets += targets;
        self.documents += 1;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::DataPaths;
    use super::*;

    /// A word-level tokenizer of `words` (id = place) plus `<unk>` and
    /// `<eos>`, split on whitespace, saved in `dir` with a
    /// `tokenizer_config.json` naming `<eos>`.
    fn word_tokenizer(dir: &Path, words: &[&str]) {
        let mut vocab: std::collections::HashMap<String, u32> = words
            .iter()
            .enumerate()
            .map(|(i, w)| (w.to_string(), i as u32))
            .collect();
        vocab.insert("<unk>".into(), words.len() as u32);
        vocab.insert("<eos>".into(), words.len() as u32 + 1);
        let model = tokenizers::models::wordlevel::WordLevel::builder()
            .vocab(vocab.into_iter().collect())
            .unk_token("<unk>".into())
            .build()
            .unwrap();
        let mut tokenizer = tokenizers::Tokenizer::new(model);
        tokenizer.with_pre_tokenizer(Some(tokenizers::pre_tokenizers::whitespace::Whitespace {}));
        tokenizer.save(dir.join("tokenizer.json"), false).unwrap();
        std::fs::write(
            dir.join("tokenizer_config.json"),
            r#"{"eos_token": {"content": "<eos>", "special": true}}"#,
        )
        .unwrap();
    }

    fn jsonl(dir: &Path, path: &Path) -> DataConfig {
        DataConfig {
            path: DataPaths(vec![path.to_path_buf()]),
            format: DataFormat::Jsonl,
            tokenizer: Some(dir.to_path_buf()),
            ..DataConfig::default()
        }
    }

    fn ids(tokenized: &Tokenized) -> Vec<u16> {
        std::fs::read(&tokenized.path)
            .unwrap()
            .chunks_exact(2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
            .collect()
    }

    #[test]
    fn documents_are_tokenized_once_and_the_cache_read_until_a_source_changes() {
        let dir = tempfile::tempdir().unwrap();
        word_tokenizer(dir.path(), &["the", "cat", "sat", "on", "mat"]);
        let data = dir.path().join("docs.jsonl");
        std::fs::write(
            &data,
            "{\"text\": \"the cat sat\"}\n\n{\"text\": \"on the mat\", \"id\": 2}\n{\"text\": \"dog\"}\n",
        )
        .unwrap();
        let config = jsonl(dir.path(), &data);
        let read = std::sync::atomic::AtomicU64::new(0);
        let progress = |n: u64| {
            read.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
        };
        let first = tokenize(&config, 64, &progress).unwrap();
        assert!(!first.reused);
        assert_eq!(
            (first.documents, first.tokens, first.dtype),
            (3, 10, TokenDtype::U16)
        );
        // Each document's ids, then <eos> (6); "dog" is <unk> (5).
        assert_eq!(ids(&first), [0, 1, 2, 6, 3, 0, 4, 6, 5, 6]);
        assert!(first.path.starts_with(dir.path().join(".strata-cache")));
        // The progress bar's length is what a fresh tokenization reads.
        assert_eq!(
            read.load(std::sync::atomic::Ordering::Relaxed),
            tokenize_bytes(&config).unwrap()
        );
        let cache = dir.path().join(".strata-cache");
        let mut names: Vec<String> = std::fs::read_dir(&cache)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(
            names.len(),
            2,
            "the token file and its record alone: {names:?}"
        );
        assert!(names[1].ends_with(".u16.json"), "{names:?}");
        let again = tokenize(&config, 64, &|_| {}).unwrap();
        assert!(again.reused);
        assert_eq!((again.path.clone(), again.tokens), (first.path.clone(), 10));
        // Another text, or another tokenizer: another cache, made anew.
        std::fs::write(&data, "{\"text\": \"the mat\"}\n").unwrap();
        let changed = tokenize(&config, 64, &|_| {}).unwrap();
        assert!(!changed.reused);
        assert_ne!(changed.path, first.path);
        assert_eq!(ids(&changed), [0, 4, 6]);
        word_tokenizer(dir.path(), &["mat", "the"]);
        let retokenized = tokenize(&config, 64, &|_| {}).unwrap();
        assert!(!retokenized.reused);
        assert_eq!(ids(&retokenized), [1, 0, 3]);
        // A plain text file is one document.
        let text = dir.path().join("book.txt");
        std::fs::write(&text, "the mat\nthe mat\n").unwrap();
        let whole = tokenize(
            &DataConfig {
                format: DataFormat::Text,
                ..jsonl(dir.path(), &text)
            },
            64,
            &|_| {},
        )
        .unwrap();
        assert_eq!(ids(&whole), [1, 0, 1, 0, 3]);
        // A tokenizer.json that asks for truncation and padding encodes
        // whole, unpadded documents all the same (as transformers' plain
        // call does).
        let mut saved =
            tokenizers::Tokenizer::from_file(dir.path().join("tokenizer.json")).unwrap();
        saved
            .with_truncation(Some(tokenizers::TruncationParams {
                max_length: 1,
                ..Default::default()
            }))
            .unwrap();
        saved.with_padding(Some(tokenizers::PaddingParams::default()));
        saved
            .save(dir.path().join("tokenizer.json"), false)
            .unwrap();
        std::fs::write(&data, "{\"text\": \"the mat the\"}\n{\"text\": \"mat\"}\n").unwrap();
        assert_eq!(
            ids(&tokenize(&config, 64, &|_| {}).unwrap()),
            [1, 0, 1, 3, 0, 3]
        );
        // A .jsonl among texts would be one document of JSON: refused.
        let err = tokenize(
            &DataConfig {
                format: DataFormat::Text,
                path: DataPaths(vec![text.clone(), data.clone()]),
                ..jsonl(dir.path(), &text)
            },
            64,
            &|_| {},
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("a .jsonl file among texts"), "{err}");
        // The cache dir may be set elsewhere.
        let elsewhere = dir.path().join("cache");
        let moved = tokenize(
            &DataConfig {
                cache_dir: Some(elsewhere.clone()),
                ..config
            },
            64,
            &|_| {},
        )
        .unwrap();
        assert!(moved.path.starts_with(&elsewhere) && !moved.reused);
    }

    #[test]
    fn bad_jsonl_and_tokenizers_are_named_with_the_line_and_the_fix() {
        let dir = tempfile::tempdir().unwrap();
        word_tokenizer(dir.path(), &["a", "b"]);
        let data = dir.path().join("bad.jsonl");
        let err = |text: &str, vocab: usize| {
            std::fs::write(&data, text).unwrap();
            tokenize(&jsonl(dir.path(), &data), vocab, &|_| {})
                .unwrap_err()
                .to_string()
        };
        let e = err("{\"text\": \"a\"}\n{\"text\": \"b\"\n", 64);
        assert!(
            e.contains("bad.jsonl: line 2 does not parse as JSON"),
            "{e}"
        );
        let e = err("{\"body\": \"a\"}\n", 64);
        assert!(
            e.contains("line 1 has no string field \"text\"") && e.contains("data.text_field"),
            "{e}"
        );
        let e = err("\n\n", 64);
        assert!(e.contains("holds no text to tokenize"), "{e}");
        let e = err("{\"text\": \"a\"}\n", 3);
        assert!(
            e.contains("has 4 ids, more than the model's vocabulary")
                && e.contains("set model.vocab to at least 4"),
            "{e}"
        );
        let e = tokenize(&jsonl(&dir.path().join("none"), &data), 64, &|_| {})
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("read tokenizer") && e.contains("--tokenizer"),
            "{e}"
        );
        std::fs::write(dir.path().join("tokenizer.json"), "{\"model\": 1}").unwrap();
        let e = err("{\"text\": \"a\"}\n", 64);
        assert!(
            e.contains("not a tokenizer the tokenizers library reads"),
            "{e}"
        );
        // No temporary file left behind by a failed tokenization.
        let cache = dir.path().join(".strata-cache");
        let left: Vec<_> = std::fs::read_dir(&cache)
            .map(|d| d.map(|e| e.unwrap().file_name()).collect())
            .unwrap_or_default();
        assert!(left.is_empty(), "{left:?}");
    }

    /// A supervised line is its prompt (special tokens and all) marked
    /// NOT_A_TARGET, its response, then the end of text; an empty prompt
    /// still marks the document's first token; the cache is u32 and its
    /// corpus reads the ids under the marks; a line without its response
    /// is named.
    #[test]
    fn supervised_lines_mark_their_prompts_as_no_targets() {
        let dir = tempfile::tempdir().unwrap();
        word_tokenizer(dir.path(), &["the", "cat", "sat", "on", "mat"]);
        let data = dir.path().join("sft.jsonl");
        std::fs::write(
            &data,
            "{\"prompt\": \"the cat\", \"response\": \"sat on\"}\n{\"prompt\": \"\", \"response\": \"mat mat\"}\n",
        )
        .unwrap();
        let config = DataConfig {
            format: DataFormat::Sft,
            ..jsonl(dir.path(), &data)
        };
        let tokenized = tokenize(&config, 64, &|_| {}).unwrap();
        assert!(tokenized.masked);
        assert_eq!(tokenized.dtype, TokenDtype::U32);
        let ids: Vec<u32> = std::fs::read(&tokenized.path)
            .unwrap()
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let (m, eos) = (NOT_A_TARGET, 6);
        assert_eq!(ids, [m, 1 | m, 2, 3, eos, 4 | m, 4, eos]);
        assert_eq!((tokenized.tokens, tokenized.targets), (8, 5));
        let again = tokenize(&config, 64, &|_| {}).unwrap();
        assert!(again.reused && again.masked && again.targets == 5);
        // Its corpus reads the ids under the marks: the largest is the end of text.
        let corpus = super::super::Corpus::open_tokenized(&tokenized, 4).unwrap();
        corpus.check_vocab(7).unwrap();
        let err = corpus.check_vocab(6).unwrap_err().to_string();
        assert!(err.contains("largest id is 6"), "{err}");
        std::fs::write(&data, "{\"prompt\": \"the\"}\n").unwrap();
        let err = tokenize(&config, 64, &|_| {}).unwrap_err().to_string();
        assert!(
            err.contains("line 1 has no string field \"response\"")
                && err.contains("data.response_field"),
            "{err}"
        );
    }
}
