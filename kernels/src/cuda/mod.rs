//! The CUDA half of strata-kernels: CUDA C kernels compiled at run time by
//! NVRTC ([`nvrtc`]), the sources beside their Rust wrappers.
//!
//! Built so far: the element-wise and row kernels of a transformer step
//! ([`OPS_SOURCE`], `ops.cu`), compiled for every architecture in
//! [`nvrtc::ARCHS`] in CI (no GPU needed), their launchers ([`Ops`]) and
//! cuBLASLt GEMMs ([`Gemm`]), a causal attention that is flash-style in
//! memory (tiles, online softmax, log-sum-exp saved) on CUDA cores, and
//! [`CudaBackend`], the [`crate::Backend`] over them. None has run on a GPU
//! yet (`tests/cuda_ops.rs` will, where one is lent). Not yet built: the
//! engine on the CUDA backend, GEMM epilogues and the tensor-core
//! attention; until then the engine computes on the CPU backend.

mod backend;
mod gemm;
mod launch;
pub mod nvrtc;

pub use backend::{CudaBackend, CudaLimits, GEMM_WORKSPACE_BYTES, READBACKS_MAX, UPLOADS_MAX};
pub use gemm::{GEMM_PLANS_MAX, Gemm, Operand};
pub use launch::{HEAD_DIM_MAX, Ops, SUM_BLOCKS};

/// The element-wise and row kernels (`ops.cu`).
pub const OPS_SOURCE: &str = include_str!("ops.cu");

/// The name [`nvrtc::compile`] gives `ops.cu`.
pub const OPS_NAME: &str = "ops";

/// Kernels defined for each element type (`<name>_f32`, `<name>_bf16`).
pub const OPS_PER_DTYPE: [&str; 18] = [
    "gelu",
    "gelu_backward",
    "add",
    "axpy",
    "scale",
    "add_bias",
    "bias_grad",
    "layer_norm",
    "layer_norm_backward_dx",
    "layer_norm_backward_params",
    "cross_entropy",
    "embedding",
    "embedding_backward",
    "sum_squares_partials",
    "non_finite",
    "attention_forward",
    "attention_backward_dq",
    "attention_backward_dkv",
];

/// Kernels defined once.
pub const OPS_SINGLE: [&str; 5] = [
    "cast_f32_bf16",
    "cast_bf16_f32",
    "sum_partials",
    "mean_f32",
    "adamw_bf16",
];

/// The block size the row and reduction kernels of `ops.cu` are written
/// for (its `BLOCK`).
pub const BLOCK: u32 = 256;

/// Every kernel `ops.cu` defines.
pub fn ops_kernels() -> Vec<String> {
    OPS_PER_DTYPE
        .iter()
        .flat_map(|op| ["f32", "bf16"].map(|dtype| format!("{op}_{dtype}")))
        .chain(OPS_SINGLE.iter().map(|op| op.to_string()))
        .collect()
}
