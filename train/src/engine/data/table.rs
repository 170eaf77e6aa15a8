//! `[data]`: what the run trains on, so that a checkpoint's config names
//! it and `strata train --resume DIR` alone reads the same windows.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::{DataOrder, TokenDtype};

/// The `[data]` table.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DataConfig {
    /// The files: texts (`format = "text"`, byte tokens) or token ids
    /// (`format = "tokens"`), one path or a list, a directory standing for
    /// its files in name order; none: the text bundled with strata.
    #[serde(skip_serializing_if = "DataPaths::is_empty")]
    pub path: DataPaths,
    /// How the files are read.
    pub format: DataFormat,
    /// How a token file stores each id (`format = "tokens"`).
    pub token_dtype: TokenDtype,
    /// Which windows each step reads: every window once per epoch
    /// (`"epoch"`) or windows drawn with replacement (`"random"`).
    pub order: DataOrder,
    /// The model's tokenizer (a directory holding `tokenizer.json`, or the
    /// file): texts and JSONL are tokenized with it (once, into the
    /// cache) instead of read a byte per token.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokenizer: Option<PathBuf>,
    /// The field of each JSONL line that holds its document's text
    /// (default `"text"`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub text_field: Option<String>,
    /// Where tokenized data is cached (default: `.strata-cache` beside the
    /// first file).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cache_dir: Option<PathBuf>,
    /// Whether a token attends to the documents before its own in its
    /// window (`"causal"`, the default) or to its own alone
    /// (`"document"`: documents packed into a sequence, positions
    /// restarting at each, block-diagonal causal attention; the first
    /// token of each is no target).
    pub attention: DataAttention,
    /// The end-of-document token id that tells documents apart for
    /// `attention = "document"` (default: the tokenizer's end of text).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub eos_id: Option<u32>,
    /// The field of each supervised (`format = "sft"`) line that holds its
    /// prompt, read but not scored (default `"prompt"`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_field: Option<String>,
    /// The field of each supervised line that holds its response, the
    /// loss's targets (default `"response"`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub response_field: Option<String>,
}

impl DataConfig {
    /// The JSONL field that holds each document's text.
    pub fn text_field(&self) -> &str {
        self.text_field.as_deref().unwrap_or("text")
    }

    /// These settings read as `format`: the fields only another format
    /// reads (a JSONL text field, a supervised prompt and response field)
    /// left out, the rest kept.
    pub fn as_format(&self, format: DataFormat) -> DataConfig {
        DataConfig {
            format,
            text_field: self
                .text_field
                .clone()
                .filter(|_| format == DataFormat::Jsonl),
            prompt_field: self
                .prompt_field
                .clone()
                .filter(|_| format == DataFormat::Sft),
            response_field: self
                .response_field
                .clone()
                .filter(|_| format == DataFormat::Sft),
            ..self.clone()
        }
    }

    /// The supervised JSONL field that holds each prompt.
    pub fn prompt_field(&self) -> &str {
        self.prompt_field.as_deref().unwrap_or("prompt")
    }

    /// The supervised JSONL field that holds each response.
    pub fn response_field(&self) -> &str {
        self.response_field.as_deref().unwrap_or("response")
    }
}

/// `[data] path`: one path (written as a string) or several (a list).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DataPaths(pub Vec<PathBuf>);

impl DataPaths {
    /// Whether no path is named (the bundled text).
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl Serialize for DataPaths {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self.0.as_slice() {
            [one] => one.serialize(serializer),
            many => many.serialize(serializer),
        }
    }
}

impl<'de> Deserialize<'de> for DataPaths {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum OneOrMany {
            One(PathBuf),
            Many(Vec<PathBuf>),
        }
        Ok(DataPaths(match OneOrMany::deserialize(deserializer)? {
            OneOrMany::One(path) => vec![path],
            OneOrMany::Many(paths) => paths,
        }))
    }
}

impl DataFormat {
    /// How files named as texts (`--data`) are read: as JSONL when every
    /// one ends in `.jsonl`, else as texts.
    pub fn of_texts(paths: &[PathBuf]) -> DataFormat {
        if paths.iter().all(|p| is_jsonl(p)) {
            DataFormat::Jsonl
        } else {
            DataFormat::Text
        }
    }
}

/// Whether a file's name says JSONL (`.jsonl`).
pub fn is_jsonl(path: &std::path::Path) -> bool {
    path.extension().is_some_and(|e| e == "jsonl")
}

/// `[data] attention`: what a token attends to in its window.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DataAttention {
    /// Every token before it in the window, whatever document it is in.
    #[default]
    Causal,
    /// The tokens before it in its own document (after the last
    /// end-of-document token), its position counted from its document's
    /// start.
    Document,
}

/// How `[data] path` is read.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DataFormat {
    /// A text, one token per byte (vocab 256 covers it).
    #[default]
    Text,
    /// Little-endian token ids of `token_dtype` (nanoGPT's `train.bin`).
    Tokens,
    /// JSON lines, each a document whose text is in `text_field`
    /// (tokenized with `tokenizer`).
    Jsonl,
    /// Supervised fine-tuning: JSON lines, each a prompt (`prompt_field`)
    /// and its response (`response_field`), tokenized with `tokenizer`
    /// into one document, the loss on the response's tokens (and the end
    /// of text) alone.
    Sft,
}

impl DataFormat {
    /// Whether its files are JSON lines.
    pub fn is_json_lines(self) -> bool {
        matches!(self, DataFormat::Jsonl | DataFormat::Sft)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_path_is_one_string_or_a_list() {
        let one: DataConfig = toml::from_str("path = \"a.bin\"").unwrap();
        assert_eq!(one.path, DataPaths(vec!["a.bin".into()]));
        assert_eq!(one.order, DataOrder::Epoch);
        let many: DataConfig =
            toml::from_str("path = [\"a.bin\", \"shards\"]\norder = \"random\"").unwrap();
        assert_eq!(many.path.0.len(), 2);
        assert_eq!(many.order, DataOrder::Random);
        for config in [one, many, DataConfig::default()] {
            let text = toml::to_string(&config).unwrap();
            assert_eq!(
                toml::from_str::<DataConfig>(&text).unwrap(),
                config,
                "{text}"
            );
        }
        let err = toml::from_str::<DataConfig>("order = \"sequential\"").unwrap_err();
        assert!(err.message().contains("sequential"), "{}", err.message());
    }
}
