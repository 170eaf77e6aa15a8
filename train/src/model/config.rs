//! The `[model]` table: which architecture, and its shape.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::{Arch, Model};
use crate::error::Result;

/// The `[model]` table: the architecture (a name in
/// [`crate::model::ARCHITECTURES`]) and its shape. The keys after `layers`
/// belong to architectures with grouped-query heads, rotary embeddings and
/// gated MLPs; left out, each takes its architecture's default, and an
/// architecture without them refuses any that is set.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelConfig {
    /// The architecture (`strata train --print-config` shows the default).
    pub arch: Arch,
    /// A Hugging Face model folder to start from (`config.json` and
    /// safetensors weights; `strata train --init-from`): its config gives
    /// the architecture and shape ([`crate::TrainConfig::with_init_from`]),
    /// its weights the initial values.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub init_from: Option<PathBuf>,
    /// Vocabulary (256: byte-level tokens).
    pub vocab: usize,
    /// Sequence length.
    pub seq: usize,
    /// Hidden size.
    pub hidden: usize,
    /// Attention heads (query heads).
    pub heads: usize,
    /// Blocks.
    pub layers: usize,
    /// Key/value heads (grouped-query attention; divides `heads`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_heads: Option<usize>,
    /// The MLP's inner width (`intermediate_size`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ffn: Option<usize>,
    /// The rotary embeddings' base (`rope_theta`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rope_theta: Option<f64>,
    /// The rotary frequencies scaled by wavelength (`rope_scaling` with
    /// low and high frequency factors).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rope_scaling: Option<RopeScaling>,
    /// The RMSNorm epsilon (`rms_norm_eps`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub norm_eps: Option<f64>,
    /// Whether the LM head is the token embedding (`tie_word_embeddings`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tie_embeddings: Option<bool>,
    /// Positions the model was made for (`max_position_embeddings`): what
    /// a checkpoint's config says, when `seq` trains on fewer.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_positions: Option<usize>,
    /// An attention window (`sliding_window`): accepted when the
    /// sequence fits inside it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sliding_window: Option<usize>,
}

/// Rotary frequencies scaled by wavelength (transformers' `rope_scaling`
/// of that kind): low frequencies divided by `factor`, high ones kept,
/// those between blended.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RopeScaling {
    /// What low frequencies are divided by (8, say).
    pub factor: f64,
    /// Wavelengths longer than `original_max_positions / low_freq_factor`
    /// are scaled.
    pub low_freq_factor: f64,
    /// Wavelengths shorter than `original_max_positions /
    /// high_freq_factor` are kept.
    pub high_freq_factor: f64,
    /// The context the model was first trained at
    /// (`original_max_position_embeddings`).
    pub original_max_positions: usize,
}

impl Default for ModelConfig {
    fn default() -> Self {
        ModelConfig {
            arch: Arch::default(),
            init_from: None,
            vocab: 256,
            seq: 64,
            hidden: 128,
            heads: 4,
            layers: 4,
            kv_heads: None,
            ffn: None,
            rope_theta: None,
            rope_scaling: None,
            norm_eps: None,
            tie_embeddings: None,
            max_positions: None,
            sliding_window: None,
        }
    }
}

impl ModelConfig {
    /// The architecture of this shape ([`crate::model::build`]): its
    /// shape checked, the error naming the key.
    pub fn build(&self) -> Result<Box<dyn Model>> {
        crate::model::build(self)
    }

    /// The optional keys that are set, by name: what an architecture
    /// without them refuses.
    pub(crate) fn optional_keys(&self) -> Vec<&'static str> {
        [
            ("model.kv_heads", self.kv_heads.is_some()),
            ("model.ffn", self.ffn.is_some()),
            ("model.rope_theta", self.rope_theta.is_some()),
            ("model.rope_scaling", self.rope_scaling.is_some()),
            ("model.norm_eps", self.norm_eps.is_some()),
            ("model.tie_embeddings", self.tie_embeddings.is_some()),
            ("model.max_positions", self.max_positions.is_some()),
            ("model.sliding_window", self.sliding_window.is_some()),
        ]
        .into_iter()
        .filter_map(|(key, set)| set.then_some(key))
        .collect()
    }
}
