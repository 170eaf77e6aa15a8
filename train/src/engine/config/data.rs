//! `[data]`: what the run trains on, so that a checkpoint's config names
//! it and `strata train --resume DIR` alone reads the same windows.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::engine::data::TokenDtype;

/// The `[data]` table.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DataConfig {
    /// The file: a text (`format = "text"`, byte tokens) or token ids
    /// (`format = "tokens"`); absent: the text bundled with strata.
    pub path: Option<PathBuf>,
    /// How the file is read.
    pub format: DataFormat,
    /// How a token file stores each id (`format = "tokens"`).
    pub token_dtype: TokenDtype,
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
}
