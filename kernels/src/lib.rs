//! strata-kernels: compute. The CPU reference kernels (free functions over
//! slices in [`cpu`]), and the [`Backend`] trait at op granularity over
//! `strata_device` buffers that the model is written against.
//!
//! Kernels never move data between tiers and never see a file, a tier or a
//! rank: they read and write the views they are given.

mod backend;
pub mod bench;
pub mod cpu;
pub mod cuda;
mod error;

pub use backend::{
    Attention, Backend, IGNORE_TARGET, Matrix, Readback, ReadbackSlots, no_position_ids,
};
pub use cpu::CpuBackend;
pub use error::{KernelError, Result};
