//! The dtype the model computes in (`[train] compute_dtype`); the
//! `[model]` table itself is the model interface's ([`crate::model::ModelConfig`]).

use serde::{Deserialize, Serialize};

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
