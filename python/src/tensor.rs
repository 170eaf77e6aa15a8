//! Tensors in: `__dlpack__` objects (torch tensors, numpy arrays; bf16
//! included) and buffer-protocol objects, checked for device (CPU), dtype
//! and contiguity. A [`Tensor`] keeps its owner (and the DLPack capsule or
//! the buffer view) alive, so its memory stays valid while the GIL is
//! released; dropping it hands everything back.
//!
//! Raw writes bypass autograd's version counter: callers write under
//! no_grad semantics (the Python layer steps inside `torch.no_grad()`).

use std::ffi::{CStr, c_void};

use pyo3::buffer::PyUntypedBuffer;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyList, PyTuple, PyType};

/// DLPack's device, data type and tensor (dlpack.h, ABI version 0.x).
#[repr(C)]
struct DlDevice {
    device_type: i32,
    device_id: i32,
}

#[repr(C)]
struct DlDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

#[repr(C)]
struct DlTensor {
    data: *mut c_void,
    device: DlDevice,
    ndim: i32,
    dtype: DlDataType,
    shape: *const i64,
    strides: *const i64,
    byte_offset: u64,
}

const DL_CPU: i32 = 1;
const DL_CUDA_HOST: i32 = 3;
const DL_INT: u8 = 0;
const DL_UINT: u8 = 1;
const DL_FLOAT: u8 = 2;
const DL_BFLOAT: u8 = 4;
const DL_COMPLEX: u8 = 5;
const DL_BOOL: u8 = 6;

const CAPSULE_NAME: &CStr = c"dltensor";

/// The element types strata's kernels take.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Dtype {
    F32,
    Bf16,
    F16,
    /// 16-bit unsigned: numpy's stand-in for bf16 (`a.view(np.uint16)`).
    U16,
    U8,
    /// Anything else, by DLPack type code and bits (named in errors).
    Other(u8, u8),
}

impl Dtype {
    fn from_dlpack(code: u8, bits: u8) -> Dtype {
        match (code, bits) {
            (DL_FLOAT, 32) => Dtype::F32,
            (DL_FLOAT, 16) => Dtype::F16,
            (DL_BFLOAT, 16) => Dtype::Bf16,
            (DL_UINT, 16) => Dtype::U16,
            (DL_UINT, 8) => Dtype::U8,
            (code, bits) => Dtype::Other(code, bits),
        }
    }

    fn from_format(format: &CStr, item_bytes: usize) -> Dtype {
        let format = format.to_bytes();
        let code = format
            .iter()
            .rev()
            .find(|c| c.is_ascii_alphabetic() || **c == b'?')
            .copied();
        let bits = (item_bytes * 8).min(255) as u8;
        let code = match code {
            Some(b'f' | b'd' | b'e') => DL_FLOAT,
            Some(b'B' | b'H' | b'I' | b'L' | b'Q' | b'N') => DL_UINT,
            Some(b'?') => DL_BOOL,
            _ => DL_INT,
        };
        Dtype::from_dlpack(code, bits)
    }

    pub(crate) fn bytes(self) -> usize {
        match self {
            Dtype::F32 => 4,
            Dtype::Bf16 | Dtype::F16 | Dtype::U16 => 2,
            Dtype::U8 => 1,
            Dtype::Other(_, bits) => usize::from(bits).div_ceil(8),
        }
    }

    pub(crate) fn name(self) -> String {
        match self {
            Dtype::F32 => "float32".into(),
            Dtype::Bf16 => "bfloat16".into(),
            Dtype::F16 => "float16".into(),
            Dtype::U16 => "uint16".into(),
            Dtype::U8 => "uint8".into(),
            Dtype::Other(code, bits) => {
                let kind = match code {
                    DL_INT => "int",
                    DL_UINT => "uint",
                    DL_FLOAT => "float",
                    DL_BFLOAT => "bfloat",
                    DL_COMPLEX => "complex",
                    DL_BOOL => return "bool".into(),
                    _ => "dlpack-type-",
                };
                format!("{kind}{bits}")
            }
        }
    }
}

/// What keeps a tensor's memory alive.
enum Keep {
    /// The exporting object and its (unconsumed) capsule: the capsule's
    /// destructor calls the producer's deleter when we drop it.
    DlPack {
        _owner: Py<PyAny>,
        _capsule: Py<PyAny>,
    },
    /// A torch tensor and its storage: the storage keeps the memory even if
    /// the tensor is pointed elsewhere meanwhile (`set_`, `.data =`). A
    /// storage resized in place (`resize_` growing it, or to 0 as FSDP
    /// does) would still free it: as with DLPack, nothing may touch the
    /// tensors while the GIL is released.
    Storage {
        _owner: Py<PyAny>,
        _storage: Py<PyAny>,
    },
    /// A buffer view; releasing it (on drop) lets the exporter resize again.
    Buffer(#[allow(dead_code)] PyUntypedBuffer),
}

/// `torch.Tensor` and the dtypes strata takes, looked up once torch has
/// been imported (strata never imports it itself).
struct Torch {
    tensor: Py<PyType>,
    is_grad_enabled: Py<PyAny>,
    strided: Py<PyAny>,
    bool_: Py<PyAny>,
    dtypes: Vec<(Py<PyAny>, Dtype)>,
}

static TORCH: PyOnceLock<Torch> = PyOnceLock::new();

impl Torch {
    /// torch's lookups when `obj` is a `torch.Tensor` (subclasses
    /// included); None for anything else, or while torch is not imported.
    fn of<'a>(obj: &Bound<'a, PyAny>) -> PyResult<Option<&'a Torch>> {
        let py = obj.py();
        let torch = match TORCH.get(py) {
            Some(torch) => torch,
            None => {
                let modules = py.import("sys")?.getattr("modules")?;
                let Ok(module) = modules.get_item("torch") else {
                    return Ok(None);
                };
                TORCH.get_or_try_init(py, || Torch::new(&module))?
            }
        };
        Ok(obj.is_instance(torch.tensor.bind(py))?.then_some(torch))
    }

    fn new(module: &Bound<'_, PyAny>) -> PyResult<Torch> {
        let mut dtypes = Vec::new();
        for (name, dtype) in [
            ("float32", Dtype::F32),
            ("bfloat16", Dtype::Bf16),
            ("float16", Dtype::F16),
            ("uint16", Dtype::U16),
            ("uint8", Dtype::U8),
        ] {
            // uint16 arrived in torch 2.3.
            if let Ok(object) = module.getattr(name) {
                dtypes.push((object.unbind(), dtype));
            }
        }
        Ok(Torch {
            tensor: module.getattr("Tensor")?.cast_into::<PyType>()?.unbind(),
            is_grad_enabled: module.getattr("is_grad_enabled")?.unbind(),
            strided: module.getattr("strided")?.unbind(),
            bool_: module.getattr("bool")?.unbind(),
            dtypes,
        })
    }

    /// The dtype of tensor `obj` (others by kind and width, for errors).
    fn dtype(&self, obj: &Bound<'_, PyAny>) -> PyResult<Dtype> {
        let dtype = obj.getattr(intern!(obj.py(), "dtype"))?;
        for (known, ours) in &self.dtypes {
            if dtype.is(known) {
                return Ok(*ours);
            }
        }
        let bits = obj.call_method0("element_size")?.extract::<usize>()? * 8;
        let code = match (
            dtype.getattr("is_floating_point")?.is_truthy()?,
            dtype.getattr("is_complex")?.is_truthy()?,
            dtype.getattr("is_signed")?.is_truthy()?,
        ) {
            (true, _, _) => DL_FLOAT,
            (_, true, _) => DL_COMPLEX,
            (_, _, true) => DL_INT,
            _ if dtype.is(&self.bool_) => DL_BOOL,
            _ => DL_UINT,
        };
        Ok(Dtype::from_dlpack(code, bits.min(255) as u8))
    }
}

/// A contiguous CPU tensor borrowed from Python.
pub(crate) struct Tensor {
    pub(crate) name: String,
    ptr: *mut u8,
    pub(crate) elems: usize,
    pub(crate) dtype: Dtype,
    readonly: bool,
    _keep: Keep,
}

// SAFETY: the memory is owned by Python objects this struct keeps alive;
// which thread touches it is governed by the callers' rules (every use
// happens while the owning call holds the tensor, with the GIL released
// only around kernels that the caller is waiting on).
unsafe impl Send for Tensor {}
// SAFETY: as above; shared references only read the pointer and sizes.
unsafe impl Sync for Tensor {}

impl Tensor {
    /// Borrows `obj` (named `name` in errors).
    pub(crate) fn from_py(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Tensor> {
        if let Some(torch) = Torch::of(obj)? {
            return Self::from_torch(obj, torch, name);
        }
        if obj.hasattr("__dlpack__")? {
            // An exporter that refuses (numpy's read-only arrays) may still
            // offer the buffer protocol; errors of our own checks stand.
            return match obj.call_method0("__dlpack__") {
                Ok(capsule) => Self::from_capsule(obj, capsule, name),
                Err(err) => match PyUntypedBuffer::get(obj) {
                    Ok(buffer) => Self::from_buffer(buffer, name),
                    Err(_) => Err(dlpack_refused(err, name)),
                },
            };
        }
        match PyUntypedBuffer::get(obj) {
            Ok(buffer) => Self::from_buffer(buffer, name),
            Err(_) => Err(PyTypeError::new_err(format!(
                "{name}: expected a CPU tensor (a torch.Tensor, a numpy array or any object with \
                 __dlpack__ or the buffer protocol), got {}",
                obj.get_type().name()?
            ))),
        }
    }

    fn from_capsule(
        obj: &Bound<'_, PyAny>,
        capsule: Bound<'_, PyAny>,
        name: &str,
    ) -> PyResult<Tensor> {
        let capsule_name = CAPSULE_NAME.as_ptr();
        // SAFETY: `capsule` is a live object; GetPointer checks that it is a capsule with this name and returns null (with an exception set) otherwise.
        let managed = unsafe { pyo3::ffi::PyCapsule_GetPointer(capsule.as_ptr(), capsule_name) };
        if managed.is_null() {
            let _ = PyErr::take(obj.py());
            return Err(PyTypeError::new_err(format!(
                "{name}: __dlpack__ did not return a \"dltensor\" capsule (a consumed or versioned \
                 capsule?)"
            )));
        }
        // SAFETY: a "dltensor" capsule holds a DLManagedTensor, whose first field is the DLTensor; the capsule (kept below) keeps it alive.
        let tensor = unsafe { &*(managed as *const DlTensor) };
        if tensor.device.device_type != DL_CPU && tensor.device.device_type != DL_CUDA_HOST {
            return Err(PyValueError::new_err(format!(
                "{name}: the tensor is on a device (DLPack device type {}), strata steps CPU \
                 tensors: move it with .cpu() or offload the optimizer to the CPU",
                tensor.device.device_type
            )));
        }
        if tensor.dtype.lanes != 1 {
            return Err(PyValueError::new_err(format!(
                "{name}: vector dtypes ({} lanes) are not supported",
                tensor.dtype.lanes
            )));
        }
        let dtype = Dtype::from_dlpack(tensor.dtype.code, tensor.dtype.bits);
        let ndim = usize::try_from(tensor.ndim).unwrap_or(0);
        // SAFETY: DLPack guarantees `ndim` entries in shape, and in strides when strides is not null.
        let shape = unsafe { dims(tensor.shape, ndim) };
        // SAFETY: as above.
        let strides = unsafe { dims(tensor.strides, ndim) };
        let mut elems: usize = 1;
        for &extent in shape {
            elems = usize::try_from(extent)
                .ok()
                .and_then(|e| elems.checked_mul(e))
                .ok_or_else(|| PyValueError::new_err(format!("{name}: bad shape {shape:?}")))?;
        }
        if !strides.is_empty() && !is_c_contiguous(shape, strides) {
            return Err(PyValueError::new_err(format!(
                "{name}: the tensor is not contiguous (shape {shape:?}, strides {strides:?}): \
                 pass tensor.contiguous()"
            )));
        }
        // SAFETY: byte_offset lies inside the allocation DLPack describes.
        let ptr = unsafe { tensor.data.cast::<u8>().add(tensor.byte_offset as usize) };
        Ok(Tensor {
            name: name.to_string(),
            ptr,
            elems,
            dtype,
            readonly: false,
            _keep: Keep::DlPack {
                _owner: obj.clone().unbind(),
                _capsule: capsule.unbind(),
            },
        })
    }

    /// A torch tensor read through its own accessors (a tenth of the cost
    /// of `__dlpack__`, which matters for a model's hundreds of tensors per
    /// step), with the same checks as the DLPack path; its storage is held
    /// like the capsule would hold it.
    fn from_torch(obj: &Bound<'_, PyAny>, torch: &Torch, name: &str) -> PyResult<Tensor> {
        let py = obj.py();
        if !obj.getattr(intern!(py, "is_cpu"))?.is_truthy()? {
            return Err(PyValueError::new_err(format!(
                "{name}: the tensor is on {}, strata steps CPU tensors: move it with .cpu() or \
                 offload the optimizer to the CPU",
                obj.getattr("device")?.str()?
            )));
        }
        // Raw writes bypass autograd, as torch's own in-place updates do
        // under no_grad: a tensor that requires grad is taken only there.
        if obj.getattr(intern!(py, "requires_grad"))?.is_truthy()?
            && torch.is_grad_enabled.call0(py)?.is_truthy(py)?
        {
            return Err(PyValueError::new_err(format!(
                "{name}: the tensor requires grad and autograd is on (call under \
                 torch.no_grad(), or pass tensor.detach(): strata writes under no_grad)"
            )));
        }
        // A negative view holds -x lazily (complex dtypes, whose conjugate
        // bit is the other lazy flag, are refused by dtype).
        if obj.call_method0(intern!(py, "is_neg"))?.is_truthy()? {
            return Err(PyValueError::new_err(format!(
                "{name}: the tensor is a lazy view (is_neg): pass tensor.resolve_neg()"
            )));
        }
        let layout = obj.getattr(intern!(py, "layout"))?;
        if !layout.is(&torch.strided) {
            return Err(PyValueError::new_err(format!(
                "{name}: the tensor's layout is {}, strata takes dense (strided) tensors: pass \
                 tensor.to_dense()",
                layout.str()?
            )));
        }
        if !obj
            .call_method0(intern!(py, "is_contiguous"))?
            .is_truthy()?
        {
            return Err(PyValueError::new_err(format!(
                "{name}: the tensor is not contiguous (shape {}, strides {}): pass \
                 tensor.contiguous()",
                obj.getattr("shape")?.str()?,
                obj.call_method0("stride")?.str()?
            )));
        }
        let dtype = torch.dtype(obj)?;
        let elems: usize = obj.call_method0(intern!(py, "numel"))?.extract()?;
        let address: usize = obj.call_method0(intern!(py, "data_ptr"))?.extract()?;
        if address == 0 && elems > 0 {
            return Err(PyValueError::new_err(format!(
                "{name}: the tensor has no memory of its own (a lazy zero tensor or a wrapper \
                 subclass): pass tensor.clone()"
            )));
        }
        let storage = obj.call_method0(intern!(py, "untyped_storage"))?;
        Ok(Tensor {
            name: name.to_string(),
            ptr: address as *mut u8,
            elems,
            dtype,
            readonly: false,
            _keep: Keep::Storage {
                _owner: obj.clone().unbind(),
                _storage: storage.unbind(),
            },
        })
    }

    fn from_buffer(buffer: PyUntypedBuffer, name: &str) -> PyResult<Tensor> {
        if !buffer.is_c_contiguous() {
            return Err(PyValueError::new_err(format!(
                "{name}: the buffer is not C-contiguous: pass a contiguous copy"
            )));
        }
        let dtype = Dtype::from_format(buffer.format(), buffer.item_size());
        Ok(Tensor {
            name: name.to_string(),
            ptr: buffer.buf_ptr().cast(),
            elems: buffer.item_count(),
            dtype,
            readonly: buffer.readonly(),
            _keep: Keep::Buffer(buffer),
        })
    }

    /// Bytes the tensor spans.
    pub(crate) fn len_bytes(&self) -> usize {
        self.elems * self.dtype.bytes()
    }

    /// The start of its memory.
    pub(crate) fn ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// Errors unless the tensor may be written.
    pub(crate) fn check_writable(&self) -> PyResult<()> {
        if self.readonly {
            return Err(PyValueError::new_err(format!(
                "{}: the buffer is read-only and strata must write it",
                self.name
            )));
        }
        Ok(())
    }

    /// Errors unless the tensor holds `elems` elements of one of `dtypes`.
    pub(crate) fn expect(&self, dtypes: &[Dtype], elems: usize) -> PyResult<()> {
        if !dtypes.contains(&self.dtype) {
            let names: Vec<String> = dtypes.iter().map(|d| d.name()).collect();
            return Err(PyTypeError::new_err(format!(
                "{}: dtype {} is not supported here: use {}",
                self.name,
                self.dtype.name(),
                names.join(" or ")
            )));
        }
        if self.elems != elems {
            return Err(PyValueError::new_err(format!(
                "{}: {} elements, but the parameter has {elems}",
                self.name, self.elems
            )));
        }
        let align = self.dtype.bytes();
        if self.elems > 0 && !(self.ptr as usize).is_multiple_of(align) {
            return Err(PyValueError::new_err(format!(
                "{}: its memory starts at an address that is not a multiple of its \
                 {align}-byte elements: pass an aligned copy",
                self.name
            )));
        }
        Ok(())
    }

    /// The memory as `T`s.
    ///
    /// # Safety
    /// The dtype must be `T`'s (checked by [`Tensor::expect`]) and nothing
    /// else may access the memory while the slice lives.
    pub(crate) unsafe fn slice<T>(&self) -> &[T] {
        // SAFETY: contiguous, aligned memory of `elems` elements of the right type (checked by `expect`), alive while `self` is, or no element at all (a dangling pointer then: torch hands out null for empty tensors); exclusivity is the caller's.
        unsafe { std::slice::from_raw_parts(self.typed_ptr::<T>(), self.elems) }
    }

    /// The memory as mutable `T`s.
    ///
    /// # Safety
    /// As [`Tensor::slice`], and the tensor must be writable (checked by
    /// [`Tensor::check_writable`]).
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn slice_mut<T>(&self) -> &mut [T] {
        // SAFETY: as for `slice`, and no other slice of this memory lives.
        unsafe { std::slice::from_raw_parts_mut(self.typed_ptr::<T>(), self.elems) }
    }

    /// The start as `T`s; dangling (never read) when there are none.
    fn typed_ptr<T>(&self) -> *mut T {
        match self.elems {
            0 => std::ptr::NonNull::<T>::dangling().as_ptr(),
            _ => self.ptr.cast::<T>(),
        }
    }
}

fn dlpack_refused(err: PyErr, name: &str) -> PyErr {
    let hint = if err.to_string().contains("require") {
        " (pass tensor.detach(): strata writes under no_grad)"
    } else {
        ""
    };
    PyValueError::new_err(format!("{name}: __dlpack__ failed: {err}{hint}"))
}

/// Errors if a tensor marked written (`(tensor, true)`) shares memory with
/// any other of `tensors` (a kernel would then read what it is writing; two
/// that are only read may overlap). Sorted by address, so a model's
/// hundreds of tensors cost n log n, not n squared.
pub(crate) fn check_disjoint(tensors: &[(&Tensor, bool)]) -> PyResult<()> {
    // (start, argument order, end): equal starts keep the order given.
    let mut spans: Vec<(usize, usize, usize)> = tensors
        .iter()
        .enumerate()
        .filter(|(_, (t, _))| t.len_bytes() > 0)
        .map(|(i, (t, _))| (t.ptr as usize, i, t.ptr as usize + t.len_bytes()))
        .collect();
    spans.sort_unstable();
    // The furthest-reaching span so far, and the furthest written one: a
    // span overlaps an earlier one exactly when it starts before that
    // one's end.
    let mut any: Option<(usize, usize)> = None;
    let mut any_written: Option<(usize, usize)> = None;
    for &(start, i, end) in &spans {
        let written = tensors[i].1;
        let earlier = match written {
            true => any,
            false => any_written,
        };
        if let Some((earlier_end, j)) = earlier
            && start < earlier_end
        {
            return Err(PyValueError::new_err(format!(
                "{} and {} share memory: pass separate tensors",
                tensors[j].0.name, tensors[i].0.name
            )));
        }
        if any.is_none_or(|(e, _)| end > e) {
            any = Some((end, i));
        }
        if written && any_written.is_none_or(|(e, _)| end > e) {
            any_written = Some((end, i));
        }
    }
    Ok(())
}

/// A tensor, or each tensor of a list or tuple (named `name[i]` in errors).
pub(crate) fn tensor_list(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Vec<Tensor>> {
    match items(obj) {
        Some(items) => items
            .iter()
            .enumerate()
            .map(|(i, item)| Tensor::from_py(item, &format!("{name}[{i}]")))
            .collect(),
        None => Ok(vec![Tensor::from_py(obj, name)?]),
    }
}

/// As [`tensor_list`], where an entry may be None (no tensor there); `n`
/// entries are expected, one per parameter.
pub(crate) fn optional_tensor_list(
    obj: &Bound<'_, PyAny>,
    name: &str,
    n: usize,
) -> PyResult<Vec<Option<Tensor>>> {
    let tensors: Vec<Option<Tensor>> = match items(obj) {
        Some(items) => items
            .iter()
            .enumerate()
            .map(|(i, item)| match item.is_none() {
                true => Ok(None),
                false => Tensor::from_py(item, &format!("{name}[{i}]")).map(Some),
            })
            .collect::<PyResult<_>>()?,
        None => vec![Some(Tensor::from_py(obj, name)?)],
    };
    expect_count(tensors.len(), name, n)?;
    Ok(tensors)
}

/// Errors unless a list holds one entry per parameter.
pub(crate) fn expect_count(got: usize, name: &str, params: usize) -> PyResult<()> {
    if got != params {
        return Err(PyValueError::new_err(format!(
            "{name}: {got} tensors for {params} parameters: pass one per parameter"
        )));
    }
    Ok(())
}

fn items<'py>(obj: &Bound<'py, PyAny>) -> Option<Vec<Bound<'py, PyAny>>> {
    if let Ok(list) = obj.cast::<PyList>() {
        return Some(list.iter().collect());
    }
    obj.cast::<PyTuple>().ok().map(|t| t.iter().collect())
}

/// # Safety
/// `ptr` is null or points at `n` readable i64s that outlive the result.
unsafe fn dims<'a>(ptr: *const i64, n: usize) -> &'a [i64] {
    if ptr.is_null() || n == 0 {
        &[]
    } else {
        // SAFETY: the caller's contract.
        unsafe { std::slice::from_raw_parts(ptr, n) }
    }
}

fn is_c_contiguous(shape: &[i64], strides: &[i64]) -> bool {
    // An empty tensor touches no memory, whatever strides it reports
    // (numpy exports zero strides for them).
    if shape.contains(&0) {
        return true;
    }
    let mut expected = 1i64;
    for (&extent, &stride) in shape.iter().zip(strides).rev() {
        if extent != 1 && stride != expected {
            return false;
        }
        expected = expected.saturating_mul(extent);
    }
    true
}
