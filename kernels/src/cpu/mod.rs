//! The CPU reference: free functions over slices ([`gemm`], [`ops`]) and
//! [`CpuBackend`], the [`crate::Backend`] that runs them on the calling
//! thread. It is the oracle every other backend is tested against.

mod backend;
pub mod gemm;
pub mod ops;

pub use backend::CpuBackend;
