"""strata from Python.

- ``strata.optim``: ``CPUAdam`` (DeepSpeedCPUAdam's signature and semantics),
  ``CPUAdagrad`` and ``CPULion`` as ``torch.optim.Optimizer`` subclasses,
  stepping CPU fp32 tensors in place through strata's SIMD kernels with the
  GIL released.
- ``strata.torch``: ``AdamW`` beneath a PyTorch loop (plain modules,
  FSDP2 and DTensor shards): fp32 master weights and moments in strata's
  page-locked host memory or on NVMe, updated by a strata thread while the
  loop goes on; the parameters keep their compute dtype only.
- ``strata.io``: ``AsyncIO``, DeepNVMe's ``aio_handle`` verbs (async/sync
  pread/pwrite of whole tensors at (path, offset), ``wait()``, page-locked
  tensors).

The kernels and the I/O engine are Rust (``strata._strata``); nothing is
compiled at import time.
"""

from ._strata import ISA, __version__

__all__ = ["ISA", "__version__", "io", "optim", "torch"]


def __getattr__(name):
    # Submodules load on first use: strata.optim and strata.torch need torch,
    # strata.io does not.
    if name in ("io", "optim", "torch"):
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'strata' has no attribute {name!r}")
