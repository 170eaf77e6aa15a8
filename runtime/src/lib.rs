//! strata-runtime owns tensors, tiers and devices: the tensor-residency
//! manager that moves parameters, gradients, optimizer states and
//! activations between device memory, pinned host RAM and NVMe (through
//! [`strata_storage`]), carries out the plans of `strata-scheduler`, runs the
//! optimizer kernels of `strata-optim`, and hosts the training engine. It is
//! the only crate that touches CUDA.
//!
//! Its types arrive with the runtime issue; the crate exists now so that the
//! dependency direction (runtime -> storage, optim, scheduler) is fixed from
//! the first commit.

pub use strata_optim as optim;
pub use strata_scheduler as scheduler;
pub use strata_storage as storage;
