//! `strata._strata.AsyncIO` (DeepNVMe's `aio_handle` verbs over
//! strata-storage's [`IoHandle`]) and `LockedBuffer`, page-locked aligned
//! host memory exposed through the buffer protocol.

use std::ffi::{c_int, c_void};
use std::path::PathBuf;

use pyo3::exceptions::{PyMemoryError, PyOSError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBool;
use strata_storage::{
    AlignedBuf, EngineKind, HandleConfig, IoHandle, Op, PAGE_BYTES, StorageError,
};

use crate::tensor::Tensor;

/// Storage errors as `OSError` (with errno where the kernel gave one),
/// carrying the Rust message word for word.
fn os_error(err: StorageError) -> PyErr {
    let errno = match &err {
        StorageError::Io { cause, .. }
        | StorageError::DiskFull { cause, .. }
        | StorageError::NotWritable { cause, .. }
        | StorageError::Os { cause, .. } => cause.raw_os_error(),
        _ => None,
    };
    match errno {
        Some(errno) => PyOSError::new_err((errno, err.to_string())),
        None => PyOSError::new_err(err.to_string()),
    }
}

/// Argument `name` of `function` as a count of at least `least`: a
/// TypeError when it is not an integer, a ValueError when it is out of
/// range, each naming the argument (PyO3's own extraction errors do not).
fn count_arg(value: &Bound<'_, PyAny>, function: &str, name: &str, least: u64) -> PyResult<u64> {
    let kind = || {
        value
            .get_type()
            .name()
            .map_or_else(|_| "?".to_string(), |n| n.to_string())
    };
    // Any integer (a numpy one too: whatever has __index__), not a bool.
    let index = if value.is_instance_of::<PyBool>() {
        None
    } else {
        value.call_method0("__index__").ok()
    };
    let Some(index) = index else {
        return Err(PyTypeError::new_err(format!(
            "{function}: {name} must be an integer, not {}",
            kind()
        )));
    };
    let number: i64 = index
        .extract()
        .map_err(|_| PyValueError::new_err(format!("{function}: {name} = {value} is too large")))?;
    u64::try_from(number)
        .ok()
        .filter(|&n| n >= least)
        .ok_or_else(|| {
            PyValueError::new_err(format!(
                "{function}: {name} must be at least {least}, not {number}"
            ))
        })
}

/// Argument `name` of `function` as a path: a TypeError naming it when it
/// is not a str or an os.PathLike.
fn path_arg(value: &Bound<'_, PyAny>, function: &str, name: &str) -> PyResult<PathBuf> {
    value.extract::<PathBuf>().map_err(|_| {
        PyTypeError::new_err(format!(
            "{function}: {name} must be a path (str or os.PathLike), not {}",
            value
                .get_type()
                .name()
                .map_or_else(|_| "?".to_string(), |n| n.to_string())
        ))
    })
}

/// An optional count argument: its default when absent.
fn count_or(
    value: Option<&Bound<'_, PyAny>>,
    default: u64,
    function: &str,
    name: &str,
    least: u64,
) -> PyResult<usize> {
    let n = match value {
        Some(value) => count_arg(value, function, name, least)?,
        None => default,
    };
    usize::try_from(n)
        .map_err(|_| PyValueError::new_err(format!("{function}: {name} = {n} is too large")))
}

/// A verb's path and offset (0 when absent), checked by name.
fn place(
    function: &str,
    path: &Bound<'_, PyAny>,
    offset: Option<&Bound<'_, PyAny>>,
) -> PyResult<(PathBuf, u64)> {
    let path = path_arg(path, function, "path")?;
    let offset = match offset {
        Some(offset) => count_arg(offset, function, "offset", 0)?,
        None => 0,
    };
    Ok((path, offset))
}

/// Asynchronous whole-tensor reads and writes at (path, offset).
#[pyclass(module = "strata._strata", subclass)]
pub(crate) struct AsyncIO {
    // Declared before `held`: dropping the handle waits for the kernel to
    // finish with the buffers before their owners are released.
    handle: IoHandle,
    held: Vec<Tensor>,
}

#[pymethods]
impl AsyncIO {
    /// `engine`: "uring" (default), "threads" (pread/pwrite on a pool,
    /// where io_uring is blocked) or "auto".
    #[new]
    #[pyo3(signature = (block_size=None, queue_depth=None, threads=None, engine="auto"))]
    fn new(
        block_size: Option<&Bound<'_, PyAny>>,
        queue_depth: Option<&Bound<'_, PyAny>>,
        threads: Option<&Bound<'_, PyAny>>,
        engine: &str,
    ) -> PyResult<Self> {
        let block_size = count_or(block_size, 1 << 20, "AsyncIO", "block_size", 1)?;
        let queue_depth = count_or(queue_depth, 32, "AsyncIO", "queue_depth", 1)?;
        let threads = count_or(threads, 1, "AsyncIO", "threads", 1)?;
        let engine = match engine {
            "uring" => EngineKind::Uring,
            "threads" => EngineKind::Threads,
            "auto" => match strata_storage::probe_uring() {
                Ok(()) => EngineKind::Uring,
                Err(_) => EngineKind::Threads,
            },
            other => {
                return Err(PyValueError::new_err(format!(
                    "engine = {other:?}: use \"uring\", \"threads\" or \"auto\""
                )));
            }
        };
        let handle = IoHandle::new(HandleConfig {
            block_bytes: block_size,
            queue_depth,
            threads,
            engine,
        })
        .map_err(|err| PyValueError::new_err(err.to_string()))?;
        Ok(AsyncIO {
            handle,
            held: Vec::new(),
        })
    }

    /// Bytes per request.
    #[getter]
    fn block_size(&self) -> usize {
        self.handle.config().block_bytes
    }

    /// Requests in flight per thread.
    #[getter]
    fn queue_depth(&self) -> usize {
        self.handle.config().queue_depth
    }

    /// Threads an operation is split over.
    #[getter]
    fn threads(&self) -> usize {
        self.handle.config().threads
    }

    /// "uring" or "threads".
    #[getter]
    fn engine(&self) -> String {
        self.handle.config().engine.to_string()
    }

    /// Starts reading `len(buffer)` bytes of `path` at `offset` into
    /// `buffer`; returns at once. `buffer` must not be touched until wait().
    #[pyo3(signature = (buffer, path, offset=None))]
    fn async_pread(
        &mut self,
        buffer: &Bound<'_, PyAny>,
        path: &Bound<'_, PyAny>,
        offset: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<i64> {
        let (path, offset) = place("async_pread", path, offset)?;
        self.start(Op::Read, buffer, path, offset)?;
        Ok(0)
    }

    /// Starts writing `buffer` to `path` at `offset` (created if missing,
    /// never truncated); returns at once.
    #[pyo3(signature = (buffer, path, offset=None))]
    fn async_pwrite(
        &mut self,
        buffer: &Bound<'_, PyAny>,
        path: &Bound<'_, PyAny>,
        offset: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<i64> {
        let (path, offset) = place("async_pwrite", path, offset)?;
        self.start(Op::Write, buffer, path, offset)?;
        Ok(0)
    }

    /// Reads and waits (for this and every operation still pending).
    /// Returns the number of operations completed.
    #[pyo3(signature = (buffer, path, offset=None))]
    fn sync_pread(
        &mut self,
        py: Python<'_>,
        buffer: &Bound<'_, PyAny>,
        path: &Bound<'_, PyAny>,
        offset: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<usize> {
        let (path, offset) = place("sync_pread", path, offset)?;
        self.start(Op::Read, buffer, path, offset)?;
        self.wait(py)
    }

    /// Writes and waits, as sync_pread.
    #[pyo3(signature = (buffer, path, offset=None))]
    fn sync_pwrite(
        &mut self,
        py: Python<'_>,
        buffer: &Bound<'_, PyAny>,
        path: &Bound<'_, PyAny>,
        offset: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<usize> {
        let (path, offset) = place("sync_pwrite", path, offset)?;
        self.start(Op::Write, buffer, path, offset)?;
        self.wait(py)
    }

    /// Waits for every operation started; returns how many completed.
    /// The first error is raised as OSError after all have finished.
    fn wait(&mut self, py: Python<'_>) -> PyResult<usize> {
        let handle = &mut self.handle;
        let result = py.detach(|| handle.wait());
        self.held.clear();
        result.map_err(os_error)
    }

    /// Operations started and not yet waited for.
    fn pending(&self) -> usize {
        self.handle.pending()
    }
}

impl AsyncIO {
    fn start(
        &mut self,
        op: Op,
        buffer: &Bound<'_, PyAny>,
        path: PathBuf,
        offset: u64,
    ) -> PyResult<()> {
        let tensor = Tensor::from_py(buffer, "buffer")?;
        if op == Op::Read {
            tensor.check_writable()?;
        }
        // SAFETY: `tensor` keeps the memory alive in `held` until wait() (or drop, which waits first); the caller was told not to touch it meanwhile, as with DeepNVMe.
        unsafe {
            self.handle
                .start(op, tensor.ptr(), tensor.len_bytes(), &path, offset)
                .map_err(os_error)?;
        }
        self.held.push(tensor);
        Ok(())
    }
}

/// Page-locked, page-aligned host memory for direct I/O, exposed through
/// the buffer protocol (wrap it with torch.frombuffer or numpy.frombuffer).
/// From 2 MiB up it lies on transparent huge pages where the kernel has
/// them, committed when made (a shortage is a MemoryError here, not a kill
/// later); `lock=False` gives that memory without locking it (the
/// optimizers' states), despite the class's name.
#[pyclass(module = "strata._strata", weakref)]
pub(crate) struct LockedBuffer {
    buf: AlignedBuf,
    len: usize,
}

#[pymethods]
impl LockedBuffer {
    /// `nbytes` of zeroed memory; page-locked (with `lock`) when
    /// RLIMIT_MEMLOCK allows (see `locked`).
    #[new]
    #[pyo3(signature = (nbytes, lock = true))]
    fn new(nbytes: &Bound<'_, PyAny>, lock: bool) -> PyResult<Self> {
        let nbytes = count_or(Some(nbytes), 0, "LockedBuffer", "nbytes", 0)?;
        let rounded = nbytes
            .max(1)
            .checked_next_multiple_of(PAGE_BYTES)
            .filter(|&n| n <= isize::MAX as usize)
            .ok_or_else(|| PyValueError::new_err(format!("nbytes = {nbytes} is too large")))?;
        let buf = if lock {
            AlignedBuf::new_locked(rounded, PAGE_BYTES)
        } else {
            AlignedBuf::new(rounded, PAGE_BYTES)
        }
        .map_err(|err| match err {
            StorageError::HostAlloc { .. } => PyMemoryError::new_err(err.to_string()),
            _ => PyValueError::new_err(err.to_string()),
        })?;
        Ok(LockedBuffer { buf, len: nbytes })
    }

    /// Whether mlock succeeded (false: RLIMIT_MEMLOCK too low; raise it
    /// with `ulimit -l unlimited`).
    #[getter]
    fn locked(&self) -> bool {
        self.buf.is_locked()
    }

    fn __len__(&self) -> usize {
        self.len
    }

    /// # Safety
    /// Called by Python with a valid `view` to fill.
    unsafe fn __getbuffer__(
        mut slf: PyRefMut<'_, Self>,
        view: *mut pyo3::ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        let ptr = slf.buf.as_mut_ptr().cast::<c_void>();
        let len = slf.len as isize;
        // SAFETY: `view` is Python's to fill; the memory lives as long as `slf`, which the view references (FillInfo takes a reference).
        let rc = unsafe { pyo3::ffi::PyBuffer_FillInfo(view, slf.as_ptr(), ptr, len, 0, flags) };
        if rc != 0 {
            return Err(PyErr::fetch(slf.py()));
        }
        Ok(())
    }
}
