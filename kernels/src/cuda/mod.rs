//! The CUDA half of strata-kernels: CUDA C kernels compiled at run time by
//! NVRTC ([`nvrtc`]), the sources beside their Rust wrappers.
//!
//! Built so far: the element-wise and row kernels of a transformer step,
//! LayerNorm and GELU, RMSNorm, rotary and SwiGLU
//! ([`OPS_SOURCE`], `ops.cu`), compiled for every architecture in
//! [`nvrtc::ARCHS`] in CI (no GPU needed), their launchers ([`Ops`]) and
//! cuBLASLt GEMMs ([`Gemm`]), a causal attention that is flash-style in
//! memory (tiles, online softmax, log-sum-exp saved) on CUDA cores, the
//! same on tensor cores for bf16 and head dims 64 and 128
//! ([`ATTENTION_SOURCE`], `attention.cu`: `ldmatrix`, `mma.sync`,
//! `cp.async`), both with grouped-query heads and packed documents, and
//! [`CudaBackend`], the [`crate::Backend`] over them.
//! The first ran on an H200 (docs/gpu-validation.md, 2026-11-26); RMSNorm,
//! rotary, SwiGLU, grouped-query heads and packed documents have not run
//! on a GPU yet (`tests/cuda_ops.rs` will, where one is lent). cuBLASLt's epilogues fuse a linear layer's bias, fc1's bias and
//! GELU, and the GELU's backward into their GEMMs where it has an
//! algorithm for them (the ops run unfused otherwise).

mod backend;
mod gemm;
mod launch;
pub mod nvrtc;

pub use backend::{CudaBackend, CudaLimits, GEMM_WORKSPACE_BYTES, READBACKS_MAX, UPLOADS_MAX};
pub use gemm::{Epilogue, GEMM_PLANS_MAX, Gemm, Operand};
pub use launch::{FLASH_ROWS, HEAD_DIM_MAX, Ops, SUM_BLOCKS};

/// The element-wise and row kernels (`ops.cu`).
pub const OPS_SOURCE: &str = include_str!("ops.cu");

/// The name [`nvrtc::compile`] gives `ops.cu`.
pub const OPS_NAME: &str = "ops";

/// The tensor-core flash attention (`attention.cu`).
pub const ATTENTION_SOURCE: &str = include_str!("attention.cu");

/// The name [`nvrtc::compile`] gives `attention.cu`.
pub const ATTENTION_NAME: &str = "attention";

/// The head dims `attention.cu` is instantiated for (bf16 only); other
/// shapes and f32 take `ops.cu`'s attention on CUDA cores.
pub const FLASH_HEAD_DIMS: [usize; 2] = [64, 128];

/// `attention.cu`'s kernels per head dim (`<name>_d<head_dim>`).
pub const FLASH_PER_HEAD_DIM: [&str; 3] =
    ["flash_forward", "flash_backward_dq", "flash_backward_dkv"];

/// Every kernel `attention.cu` defines.
pub fn attention_kernels() -> Vec<String> {
    FLASH_PER_HEAD_DIM
        .iter()
        .flat_map(|k| FLASH_HEAD_DIMS.map(|d| format!("{k}_d{d}")))
        .chain(["flash_dsum".to_string()])
        .collect()
}

/// Bytes of dynamic shared memory `kernel` (a [`FLASH_PER_HEAD_DIM`]
/// name) takes at `head_dim`, as `attention.cu` lays its tiles out: rows of
/// `head_dim + FLASH_PAD` bf16, [`FLASH_ROWS`] query rows and as many keys
/// per tile.
pub fn flash_shared_bytes(kernel: &str, head_dim: usize) -> u32 {
    /// `attention.cu`'s FLASH_PAD.
    const FLASH_PAD: u32 = 8;
    let row = (head_dim as u32 + FLASH_PAD) * 2;
    let tile = FLASH_ROWS as u32 * row;
    match kernel {
        // The query tile and two stages of key and value tiles.
        "flash_forward" => 5 * tile,
        // Query, dout, key and value tiles.
        "flash_backward_dq" => 4 * tile,
        // Key and value tiles, query and dout tiles of FLASH_KV_ROWS(D)
        // rows (half as many at head dim 128), those rows' first keys (u64)
        // and their lse and D (f32).
        "flash_backward_dkv" => {
            let rows = if head_dim == 128 { 32 } else { 64 };
            2 * tile + 2 * rows * row + rows * 8 + 2 * rows * 4
        }
        other => panic!("{other} is not one of attention.cu's per-head-dim kernels"),
    }
}

/// Kernels defined for each element type (`<name>_f32`, `<name>_bf16`).
pub const OPS_PER_DTYPE: [&str; 24] = [
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
    "rms_norm",
    "rms_norm_backward_dx",
    "rms_norm_backward_gamma",
    "rotary",
    "swiglu",
    "swiglu_backward",
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kernels_read_the_ignored_target_the_rust_side_writes() {
        let define = format!("#define IGNORE_TARGET {:#x}u", crate::IGNORE_TARGET);
        assert!(OPS_SOURCE.contains(&define), "ops.cu lacks {define:?}");
    }
}
