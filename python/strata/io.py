"""DeepNVMe's ``aio_handle`` verbs, backed by strata's io_uring engine.

    import strata.io
    h = strata.io.AsyncIO(block_size=1 << 20, queue_depth=32, threads=4)
    h.async_pwrite(tensor, "/nvme/t.bin")      # returns at once
    h.wait()                                   # -> 1 (operations completed)
    h.sync_pread(tensor, "/nvme/t.bin")        # read back and wait

Buffers: torch tensors (any dtype, bf16 included, CPU, contiguous), numpy
arrays, or anything with ``__dlpack__`` or the buffer protocol. Direct I/O
(O_DIRECT) is used for the aligned part of every transfer; a buffer that is
not aligned for it goes through aligned bounce blocks, a tail shorter than
the drive's block through the page cache. A buffer must not be touched (nor
freed) until ``wait()`` returns; the handle keeps a reference to it until
then. Raw reads bypass autograd's version counter: read into tensors under
``torch.no_grad()``.

Errors are ``OSError`` naming the path and, where the kernel gave one, the
errno.
"""

import os
import warnings

from ._strata import AsyncIO as _AsyncIO
from ._strata import LockedBuffer

__all__ = ["AsyncIO", "LockedBuffer"]


class AsyncIO(_AsyncIO):
    """DeepNVMe-style async I/O handle (see the module docstring).

    ``threads`` is DeepNVMe's ``intra_op_parallelism``: each operation is
    split over that many threads, each with its own ring and up to
    ``queue_depth`` requests of ``block_size`` bytes in flight.
    """

    def __new__(cls, block_size=1 << 20, queue_depth=32, threads=1, engine="auto"):
        self = super().__new__(cls, block_size, queue_depth, threads, engine)
        self._locked = {}
        return self

    def __init__(self, block_size=1 << 20, queue_depth=32, threads=1, engine="auto"):
        pass

    def get_block_size(self):
        return self.block_size

    def get_queue_depth(self):
        return self.queue_depth

    def get_intra_op_parallelism(self):
        return self.threads

    def get_single_submit(self):
        return False

    def get_overlap_events(self):
        return False

    def get_alignment(self):
        return 4096

    def pread(self, buffer, filename, validate=False, async_op=False, file_offset=0, **kwargs):
        """DeepNVMe's pread(buffer, filename, validate, async, file_offset):
        asynchronous when ``async`` is true (then wait()), else waits and
        returns the count. ``validate`` re-reads the range through the page
        cache and compares."""
        return self._parallel("read", buffer, filename, validate, async_op, file_offset, kwargs)

    def pwrite(self, buffer, filename, validate=False, async_op=False, file_offset=0, **kwargs):
        """DeepNVMe's pwrite, as pread."""
        return self._parallel("write", buffer, filename, validate, async_op, file_offset, kwargs)

    def _parallel(self, op, buffer, filename, validate, async_op, file_offset, kwargs):
        async_op = kwargs.pop("async", async_op)
        if kwargs:
            raise TypeError(f"p{op} got unexpected arguments {sorted(kwargs)}")
        if async_op:
            return getattr(self, f"async_p{op}")(buffer, filename, file_offset)
        count = getattr(self, f"sync_p{op}")(buffer, filename, file_offset)
        if validate:
            _validate(buffer, filename, file_offset)
        return count

    def is_pinned(self, buffer):
        """Whether ``buffer`` came from new_cpu_locked_tensor."""
        return _address(buffer) in self._locked

    def new_cpu_locked_tensor(self, num_elem, example_tensor):
        """A page-locked CPU tensor of ``num_elem`` elements of
        ``example_tensor``'s dtype (a torch tensor or a numpy array). Free it
        with ``free_cpu_locked_tensor``. Warns once when RLIMIT_MEMLOCK keeps
        the memory from being locked (it still works, unlocked)."""
        num_elem = _count("new_cpu_locked_tensor", "num_elem", num_elem)
        itemsize = _itemsize("new_cpu_locked_tensor", "example_tensor", example_tensor)
        buffer = LockedBuffer(num_elem * itemsize)
        if not buffer.locked:
            warnings.warn(
                f"could not page-lock {int(num_elem) * itemsize} bytes: RLIMIT_MEMLOCK is too low "
                "(raise it with `ulimit -l unlimited`); the tensor works but is not locked",
                RuntimeWarning,
                stacklevel=2,
            )
        tensor = _wrap(buffer, example_tensor, int(num_elem))
        self._locked[_address(tensor)] = buffer
        return tensor

    def free_cpu_locked_tensor(self, tensor):
        """Releases a tensor from ``new_cpu_locked_tensor`` (its memory goes
        when the last reference to the tensor does)."""
        if self._locked.pop(_address(tensor, "free_cpu_locked_tensor", "tensor"), None) is None:
            raise ValueError("free_cpu_locked_tensor: this tensor did not come from new_cpu_locked_tensor")
        return True


def _validate(buffer, filename, offset):
    data = memoryview(_bytes(buffer)).cast("B")
    with open(filename, "rb") as f:
        f.seek(offset)
        if f.read(len(data)) != data:
            raise OSError(f"validation failed: {filename} at offset {offset} differs from the buffer")


def _bytes(buffer):
    if hasattr(buffer, "numpy") and hasattr(buffer, "view"):
        import torch

        return buffer.detach().contiguous().view(torch.uint8).numpy()
    return buffer


def _count(function, name, value):
    """``value`` as a count of elements, or TypeError/ValueError naming the
    argument."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"{function}: {name} must be an integer count of elements, not {type(value).__name__}")
    value = value.__index__()
    if value < 0:
        raise ValueError(f"{function}: {name} must be at least 0, not {value}")
    return value


def _itemsize(function, name, example):
    if hasattr(example, "element_size") and hasattr(example, "dtype"):
        return example.element_size()
    if hasattr(example, "itemsize") and hasattr(example, "dtype"):
        return example.itemsize
    raise TypeError(f"{function}: {name} must be a torch tensor or a numpy array (its dtype is used), not {type(example).__name__}")


def _address(tensor, function="is_pinned", name="buffer"):
    if hasattr(tensor, "data_ptr"):
        return tensor.data_ptr()
    if hasattr(tensor, "__array_interface__"):
        return tensor.__array_interface__["data"][0]
    raise TypeError(f"{function}: {name} must be a torch tensor or a numpy array, not {type(tensor).__name__}")


def _wrap(buffer, example, num_elem):
    if type(example).__module__.startswith("torch"):
        import torch

        # The tensor keeps a reference to `buffer` through its storage.
        return torch.frombuffer(buffer, dtype=example.dtype, count=num_elem)
    import numpy

    return numpy.frombuffer(buffer, dtype=example.dtype, count=num_elem)
