"""strata.io.AsyncIO with numpy: bytes written and read back match on every
path (aligned, unaligned buffers, tails, offsets), counts, fork, errors."""

import errno
import os

import numpy as np
import pytest

import strata.io
from strata.io import AsyncIO, LockedBuffer


@pytest.fixture(params=["uring", "threads"])
def handle(request):
    try:
        return AsyncIO(block_size=64 << 10, queue_depth=8, threads=2, engine=request.param)
    except ValueError as err:
        pytest.skip(f"{request.param}: {err}")


@pytest.mark.parametrize("nbytes,misalign,offset", [
    (1 << 20, 0, 0),
    ((1 << 20) + 123, 0, 4096),
    (300_001, 1, 0),
    (100_000, 0, 17),
    (3, 1, 5),
])
def test_bytes_written_and_read_back_match(handle, tmp_path, nbytes, misalign, offset):
    rng = np.random.default_rng(nbytes)
    raw = np.empty(nbytes + misalign, np.uint8)
    src = raw[misalign:]
    src[:] = rng.integers(0, 256, nbytes, dtype=np.uint8)
    path = tmp_path / "t.bin"
    assert handle.async_pwrite(src, str(path), offset) == 0
    assert handle.wait() == 1
    assert os.path.getsize(path) == offset + nbytes
    back_raw = np.zeros(nbytes + misalign, np.uint8)
    back = back_raw[misalign:]
    assert handle.sync_pread(back, path, offset) == 1
    assert (back == src).all()


def test_bf16_as_uint16_and_many_operations(handle, tmp_path):
    tensors = [np.arange(i * 1000, i * 1000 + 70_000, dtype=np.uint16) for i in range(8)]
    for i, t in enumerate(tensors):
        handle.async_pwrite(t, str(tmp_path / f"{i}.bin"))
    assert handle.pending() == 8
    assert handle.wait() == 8
    backs = [np.zeros_like(t) for t in tensors]
    for i, b in enumerate(backs):
        handle.async_pread(b, str(tmp_path / f"{i}.bin"))
    assert handle.wait() == 8
    assert all((a == b).all() for a, b in zip(tensors, backs))


def test_locked_tensors(tmp_path):
    h = AsyncIO()
    like = np.zeros(1, np.float32)
    t = h.new_cpu_locked_tensor(1 << 18, like)
    assert t.dtype == np.float32 and t.size == 1 << 18
    assert t.ctypes.data % 4096 == 0, "locked tensors are page-aligned for direct I/O"
    t[:] = np.arange(t.size)
    h.sync_pwrite(t, tmp_path / "locked.bin")
    u = h.new_cpu_locked_tensor(1 << 18, like)
    h.sync_pread(u, tmp_path / "locked.bin")
    assert (t == u).all()
    assert h.free_cpu_locked_tensor(t) and h.free_cpu_locked_tensor(u)
    with pytest.raises(ValueError, match="did not come from new_cpu_locked_tensor"):
        h.free_cpu_locked_tensor(np.zeros(4))
    # Wrong arguments are TypeError/ValueError naming the argument.
    with pytest.raises(TypeError, match="new_cpu_locked_tensor: example_tensor must be a torch tensor or a numpy array"):
        h.new_cpu_locked_tensor(10, None)
    with pytest.raises(TypeError, match="new_cpu_locked_tensor: num_elem must be an integer count of elements, not str"):
        h.new_cpu_locked_tensor("10", like)
    with pytest.raises(ValueError, match="new_cpu_locked_tensor: num_elem must be at least 0, not -1"):
        h.new_cpu_locked_tensor(-1, like)
    with pytest.raises(TypeError, match="free_cpu_locked_tensor: tensor must be a torch tensor or a numpy array, not list"):
        h.free_cpu_locked_tensor([1, 2])
    assert len(LockedBuffer(10)) == 10
    # Unlocked (the optimizers' states): zeroed, writable, page-aligned.
    plain = np.frombuffer(LockedBuffer(3 << 20, lock=False), dtype=np.float32)
    assert plain.size == (3 << 20) // 4 and plain.ctypes.data % 4096 == 0
    assert not plain.any()
    plain[-1] = 7
    assert plain[-1] == 7 and not LockedBuffer(4096, lock=False).locked
    with pytest.raises(MemoryError, match="could not allocate"):
        LockedBuffer(1 << 62, lock=False)


def test_errors_name_the_path_and_errno(tmp_path):
    h = AsyncIO()
    buf = np.zeros(8192, np.uint8)
    missing = tmp_path / "absent.bin"
    with pytest.raises(OSError) as info:
        h.async_pread(buf, missing)
    assert info.value.errno == errno.ENOENT and "absent.bin" in str(info.value)
    short = tmp_path / "short.bin"
    short.write_bytes(b"x" * 100)
    with pytest.raises(OSError, match="short.bin ended at offset 100 with 8092 bytes"):
        h.sync_pread(buf, short)
    os.chmod(tmp_path, 0o500)
    try:
        if os.geteuid() != 0:
            with pytest.raises(OSError) as info:
                h.sync_pwrite(buf, tmp_path / "new.bin")
            assert info.value.errno == errno.EACCES
    finally:
        os.chmod(tmp_path, 0o700)
    readonly = np.zeros(16, np.uint8)
    readonly.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        h.async_pread(readonly, short)
    with pytest.raises(ValueError, match="block_size"):
        AsyncIO(block_size=1000)
    with pytest.raises(ValueError, match="engine"):
        AsyncIO(engine="libaio")
    # Wrong arguments name the argument: TypeError for the wrong type,
    # ValueError for a value out of range.
    with pytest.raises(TypeError, match="AsyncIO: block_size must be an integer, not str"):
        AsyncIO(block_size="1MiB")
    with pytest.raises(ValueError, match="AsyncIO: queue_depth must be at least 1, not 0"):
        AsyncIO(queue_depth=0)
    with pytest.raises(TypeError, match=r"sync_pwrite: path must be a path \(str or os.PathLike\), not int"):
        h.sync_pwrite(buf, 3)
    with pytest.raises(ValueError, match="async_pwrite: offset must be at least 0, not -1"):
        h.async_pwrite(buf, tmp_path / "x.bin", -1)
    with pytest.raises(ValueError, match="LockedBuffer: nbytes must be at least 0, not -1"):
        LockedBuffer(-1)
    with pytest.raises(TypeError, match="LockedBuffer: nbytes must be an integer, not bool"):
        LockedBuffer(True)
    # numpy integers are integers.
    assert len(LockedBuffer(np.int64(10))) == 10
    assert AsyncIO(block_size=np.int32(1 << 20)).block_size == 1 << 20
    assert h.wait() == 0


def test_a_forked_child_builds_its_own_threads(tmp_path):
    h = AsyncIO(threads=2)
    data = np.arange(1 << 16, dtype=np.float32)
    h.sync_pwrite(data, tmp_path / "parent.bin")
    from strata._strata import Kernels

    k = Kernels(threads=2)
    p = np.ones(1 << 19, np.float32)
    k.adam(p, p.copy(), np.zeros_like(p), np.zeros_like(p), step=1, lr=1e-3, beta1=0.9, beta2=0.999,
           eps=1e-8, weight_decay=0.0, adamw_mode=True, bias_correction=True)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            back = np.zeros_like(data)
            h.sync_pread(back, tmp_path / "parent.bin")
            k.adam(p, p.copy(), np.zeros_like(p), np.zeros_like(p), step=1, lr=1e-3, beta1=0.9,
                   beta2=0.999, eps=1e-8, weight_decay=0.0, adamw_mode=True, bias_correction=True)
            code = 0 if (back == data).all() else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert strata.io.AsyncIO is AsyncIO


def test_deepnvme_style_pread_pwrite_with_validate(tmp_path):
    h = AsyncIO()
    data = np.arange(10_000, dtype=np.float32)
    path = str(tmp_path / "v.bin")
    assert h.pwrite(data, path, True, False) == 1
    back = np.zeros_like(data)
    assert h.pread(back, path, True, False) == 1 and (back == data).all()
    assert h.pwrite(data, path, False, True) == 0 and h.wait() == 1
    with open(path, "r+b") as f:
        f.write(b"\xff")
    with pytest.raises(OSError, match="validation failed"):
        strata.io._validate(data, path, 0)  # what validate=True runs after a transfer
    assert h.get_block_size() == 1 << 20 and h.get_queue_depth() == 32 and h.get_intra_op_parallelism() == 1
