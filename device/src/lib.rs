//! strata-device: what every crate that touches device memory shares, and
//! nothing more. [`Dtype`]s; [`Buffer`]s of device memory and the strided
//! [`View`]s operations take; streams ([`StreamKind`]) and the [`Fence`]s
//! that order work across them; and the CUDA [`cuda::Context`] of a GPU,
//! loaded at run time, with every CUDA library probed before first use
//! ([`cuda::probe_library`]).
//!
//! It is a leaf: it depends on no other strata crate. With the CUDA halves
//! of `strata-kernels` and `strata-comm`, it is the only crate that names a
//! CUDA type.
//!
//! ```
//! use strata_device::{Buffer, Dtype};
//! let mut qkv = Buffer::host(Dtype::F32, 4 * 3 * 8)?;   // 4 tokens, hidden 8
//! let k = qkv.view().matrix(4, 24)?.columns(8..16);       // a strided view
//! assert_eq!((k.raw().rows, k.raw().cols, k.raw().row_stride), (4, 8, 24));
//! # Ok::<(), strata_device::DeviceError>(())
//! ```

mod buffer;
mod cancel;
pub mod cuda;
mod dtype;
mod error;
mod fence;

pub use buffer::{Buffer, HOST_ALIGN_BYTES, Raw, View, ViewMut};
pub use cancel::Cancel;
pub use dtype::{Dtype, Element};
pub use error::{DeviceError, Result};
pub use fence::{Fence, HostSignal, StreamKind, Watch};

/// Which kind of device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceKind {
    /// The CPU device: host memory, compute on the calling thread.
    Cpu,
    /// A CUDA GPU.
    Cuda,
}
