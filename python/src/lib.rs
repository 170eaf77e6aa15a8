//! strata from Python: the compiled half of the `strata` package
//! (`strata._strata`). A thin layer over the Rust crates:
//! - [`optim::Kernels`]: strata-optim's Adam, Adagrad and Lion on a pool of
//!   threads, stepping tensors in place with the GIL released;
//! - [`io::AsyncIO`]: DeepNVMe's `aio_handle` verbs over strata-storage's
//!   `IoHandle`, and [`io::LockedBuffer`], page-locked host memory;
//! - [`offload::OffloadStates`]: the master weights and moments of torch
//!   parameters in a page-locked arena or on NVMe, stepped by a worker
//!   thread while Python goes on (`strata/torch.py`).
//!
//! Tensors come in through `__dlpack__` or the buffer protocol
//! ([`tensor::Tensor`]), without copies. Errors carry the Rust error's
//! words. The Python half (`strata/optim.py`, `strata/io.py`) builds the
//! torch-facing classes on these.

mod io;
mod offload;
mod optim;
mod tensor;

use pyo3::prelude::*;

/// The extension module.
#[pymodule]
fn _strata(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<optim::Kernels>()?;
    m.add_class::<offload::OffloadStates>()?;
    m.add_class::<io::AsyncIO>()?;
    m.add_class::<io::LockedBuffer>()?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("ISA", strata_optim::Isa::chosen().name())?;
    Ok(())
}
