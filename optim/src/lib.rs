//! strata-optim holds the numeric kernels of CPU-side training: Adam, AdamW,
//! Adagrad and Lion over fp32 master weights, the fused bf16 offload step,
//! gradient norms and accumulation. Kernels are free functions over slices
//! with a scalar reference for every SIMD path; nothing here allocates inside
//! a step or knows where the slices came from.
//!
//! Its kernels arrive with the optimizer issue.
