//! The `[model]` table: which architecture, and its shape.

use serde::{Deserialize, Serialize};

use super::{Arch, Model};
use crate::error::Result;

/// The `[model]` table: the architecture (a name in
/// [`crate::model::ARCHITECTURES`]) and its shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelConfig {
    /// The architecture (`strata train --print-config` shows the default).
    pub arch: Arch,
    /// Vocabulary (256: byte-level tokens).
    pub vocab: usize,
    /// Sequence length.
    pub seq: usize,
    /// Hidden size.
    pub hidden: usize,
    /// Attention heads.
    pub heads: usize,
    /// Blocks.
    pub layers: usize,
}

impl Default for ModelConfig {
    fn default() -> Self {
        ModelConfig {
            arch: Arch::default(),
            vocab: 256,
            seq: 64,
            hidden: 128,
            heads: 4,
            layers: 4,
        }
    }
}

impl ModelConfig {
    /// The architecture of this shape ([`crate::model::build`]): its
    /// shape checked, the error naming the key.
    pub fn build(&self) -> Result<Box<dyn Model>> {
        crate::model::build(self)
    }
}
