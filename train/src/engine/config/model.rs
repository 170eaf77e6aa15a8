//! `[model]`: the architecture and its shape; the dtype it computes in.

use serde::{Deserialize, Serialize};

use crate::error::Result;
use crate::model::{Arch, Model};

/// The element type of activations and the matrix products' operands on
/// the device (`[train] compute_dtype`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase", try_from = "String")]
pub enum ComputeDtype {
    /// bf16 on a GPU (tensor cores), f32 on the CPU device.
    #[default]
    Auto,
    /// f32 everywhere.
    F32,
    /// bf16 activations and matrix operands, fp32 accumulation; parameter
    /// gradients, biases, LayerNorm parameters and statistics stay f32.
    Bf16,
}

impl TryFrom<String> for ComputeDtype {
    type Error = String;

    fn try_from(text: String) -> Result<Self, String> {
        match text.as_str() {
            "auto" => Ok(ComputeDtype::Auto),
            "f32" | "fp32" => Ok(ComputeDtype::F32),
            "bf16" => Ok(ComputeDtype::Bf16),
            _ => Err(format!(
                "compute_dtype: {text:?} is not \"auto\", \"f32\" or \"bf16\""
            )),
        }
    }
}

impl ComputeDtype {
    /// The dtype on a device of `kind`.
    pub fn resolve(self, kind: strata_device::DeviceKind) -> strata_device::Dtype {
        use strata_device::{DeviceKind, Dtype};
        match (self, kind) {
            (ComputeDtype::F32, _) | (ComputeDtype::Auto, DeviceKind::Cpu) => Dtype::F32,
            (ComputeDtype::Bf16, _) | (ComputeDtype::Auto, DeviceKind::Cuda) => Dtype::Bf16,
        }
    }
}

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
