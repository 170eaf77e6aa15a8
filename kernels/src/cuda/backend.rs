//! [`CudaBackend`]: the [`Backend`] ops on one GPU, over [`Ops`] (the
//! NVRTC kernels) and [`Gemm`] (cuBLASLt), all on the device's one compute
//! stream. Every op checks its operands (device, dtype, size) and returns
//! once enqueued; errors of enqueued work surface at fences. Scalars come
//! back through page-locked readback slots, copied on the compute stream
//! after the kernel that wrote them: no device-wide sync, no allocation
//! per op (the scratch and the slots are sized at start).

use std::sync::{Arc, Mutex};

use strata_device::cuda::{Context, PinnedHost};
use strata_device::{Buffer, DeviceKind, Dtype, Fence, Raw, StreamKind, View, ViewMut};
use strata_optim::AdamCoefficients;

use super::{Epilogue, Gemm, Operand, Ops, SUM_BLOCKS};
use crate::backend::{
    Attention, Backend, Matrix, Readback, ReadbackSlots, check_heads, check_rotary_heads,
    check_swiglu_shapes, unfused,
};
use crate::cpu::ops::LN_EPS;
use crate::error::{KernelError, Result, same_len};

/// Readbacks that may be in flight at once.
pub const READBACKS_MAX: usize = 64;

/// Bytes of one readback slot: a value (f64, or a u32 flag) and a second
/// word (the cross-entropy's bad-token row).
const SLOT_BYTES: usize = 16;

/// Uploads (host to device, on the compute stream) in flight at once; the
/// next one reuses the page-locked slot of the one this many before it.
pub const UPLOADS_MAX: usize = 8;

/// The cuBLASLt workspace (enough for Hopper's best algorithms).
pub const GEMM_WORKSPACE_BYTES: u64 = 32 << 20;

/// What a CUDA backend holds besides the model: its limits.
#[derive(Clone, Copy, Debug)]
pub struct CudaLimits {
    /// The most rows a cross-entropy takes (micro-batch x seq).
    pub rows_max: usize,
    /// The most bytes one upload carries (a micro-batch's token ids).
    pub upload_bytes_max: usize,
}

impl CudaLimits {
    /// Device bytes the backend holds for these limits: the GEMM workspace,
    /// the sum partials, the rows' losses, the readback slots and one
    /// unread flag word.
    pub fn device_bytes(&self) -> u64 {
        GEMM_WORKSPACE_BYTES
            + u64::from(SUM_BLOCKS) * 8
            + self.rows_max as u64 * 4
            + ((READBACKS_MAX + 1) * SLOT_BYTES) as u64
    }
}

/// How a slot's bytes are read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Decode {
    F64,
    Flag,
    F32,
    Bf16,
    U32,
    /// The mean loss (f64), then the bad-token row + 1 (u64), of a
    /// cross-entropy over `vocab`.
    Loss {
        vocab: u64,
    },
}

struct Slots {
    host: PinnedHost,
    /// Per slot: free, or how its bytes are read.
    state: Mutex<Vec<Option<Decode>>>,
}

impl ReadbackSlots for Slots {
    fn read(&self, slot: usize) -> Result<f64> {
        let decode = self.state.lock().expect("readback slots")[slot].expect("a taken slot");
        let mut bytes = [0u8; SLOT_BYTES];
        // SAFETY: the slot is inside the pinned buffer, and its copy has landed (the readback's fence passed before `read`).
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.host.pointer().as_ptr().add(slot * SLOT_BYTES),
                bytes.as_mut_ptr(),
                SLOT_BYTES,
            )
        };
        let word = |i: usize| u64::from_le_bytes(bytes[i * 8..i * 8 + 8].try_into().expect("8"));
        let low = u32::from_le_bytes(bytes[..4].try_into().expect("4"));
        Ok(match decode {
            Decode::F64 => f64::from_bits(word(0)),
            Decode::Flag | Decode::U32 => f64::from(low),
            Decode::F32 => f64::from(f32::from_bits(low)),
            Decode::Bf16 => f64::from(half::bf16::from_bits(low as u16).to_f32()),
            Decode::Loss { vocab } => match word(1) {
                0 => f64::from_bits(word(0)),
                row => {
                    return Err(KernelError::TokenAt {
                        op: "cross_entropy",
                        position: row - 1,
                        vocab,
                    });
                }
            },
        })
    }

    fn release(&self, slot: usize) {
        self.state.lock().expect("readback slots")[slot] = None;
    }
}

/// The [`Backend`] on a CUDA GPU.
pub struct CudaBackend {
    context: Arc<Context>,
    ops: Ops,
    gemm: Gemm,
    limits: CudaLimits,
    /// Device scratch: GEMM workspace, sum partials, rows' losses, slots.
    scratch: Buffer,
    slots: Arc<Slots>,
    uploads: Mutex<Uploads>,
}

/// Page-locked staging for uploads: `UPLOADS_MAX` slots used in turn,
/// each with the fence of the copy that last read it.
struct Uploads {
    host: PinnedHost,
    next: usize,
    fences: Vec<Option<Fence>>,
}

/// A view's device address and element count, after checking that it is
/// on the GPU, contiguous and of `dtype` (when given).
/// A GEMM operand's shape and first address, checked to be on a GPU.
fn gemm_operand(
    op: &'static str,
    name: &'static str,
    raw: Raw,
    transposed: bool,
) -> Result<(Operand, u64)> {
    if raw.kind != DeviceKind::Cuda {
        return Err(KernelError::Device {
            op,
            operand: name,
            actual: raw.kind,
            expected: DeviceKind::Cuda,
        });
    }
    Ok((
        Operand {
            dtype: raw.dtype,
            rows: raw.rows as u64,
            cols: raw.cols as u64,
            row_stride: raw.row_stride as u64,
            transposed,
        },
        raw.start_address(),
    ))
}

/// An epilogue's aux operand: on this device, C's rows, columns and dtype.
fn aux_like(op: &'static str, name: &'static str, aux: Raw, c: Raw) -> Result<(u64, Operand)> {
    let (operand, at) = gemm_operand(op, name, aux, false)?;
    if (aux.rows, aux.cols, aux.dtype) != (c.rows, c.cols, c.dtype) {
        return Err(KernelError::Shape {
            op,
            operand: name,
            actual: format!("{} x {} {}", aux.rows, aux.cols, aux.dtype),
            expected: format!("the output's {} x {} {}", c.rows, c.cols, c.dtype),
        });
    }
    Ok((at, operand))
}

fn on_device(
    op: &'static str,
    operand: &'static str,
    raw: Raw,
    dtype: Option<Dtype>,
) -> Result<(u64, u64)> {
    if raw.kind != DeviceKind::Cuda {
        return Err(KernelError::Device {
            op,
            operand,
            actual: raw.kind,
            expected: DeviceKind::Cuda,
        });
    }
    if !raw.is_contiguous() {
        return Err(KernelError::Shape {
            op,
            operand,
            actual: format!("row stride {}", raw.row_stride),
            expected: "a contiguous view".into(),
        });
    }
    if let Some(dtype) = dtype.filter(|d| *d != raw.dtype) {
        return Err(KernelError::Dtype {
            op,
            backend: "cuda",
            operand,
            dtype: raw.dtype,
            fix: match dtype {
                Dtype::F32 => "this operand is f32",
                Dtype::U32 => "token ids are u32",
                _ => "give it the dtype the op documents",
            },
        });
    }
    Ok((raw.start_address(), raw.len() as u64))
}

/// The device address of `raw`, checked as [`on_device`] does and to hold
/// exactly `len` elements.
fn sized(
    op: &'static str,
    operand: &'static str,
    raw: Raw,
    dtype: Option<Dtype>,
    len: u64,
) -> Result<u64> {
    let (at, actual) = on_device(op, operand, raw, dtype)?;
    same_len(op, operand, actual, len)?;
    Ok(at)
}

/// A normalization's input `x` (rows of `gamma.len()`) and its f32 `gamma`:
/// (compute dtype, x's address, gamma's address, rows, columns).
fn norm_rows(op: &'static str, x: Raw, gamma: Raw) -> Result<(Dtype, u64, u64, u64, u64)> {
    let dtype = compute_dtype(op, "x", x)?;
    let (gamma_at, cols) = on_device(op, "gamma", gamma, Some(Dtype::F32))?;
    let (x_at, n) = on_device(op, "x", x, None)?;
    let rows = n / cols.max(1);
    same_len(op, "x", n, rows * cols)?;
    Ok((dtype, x_at, gamma_at, rows, cols))
}

/// The compute dtype of an op's main tensors: f32 or bf16.
fn compute_dtype(op: &'static str, operand: &'static str, raw: Raw) -> Result<Dtype> {
    match raw.dtype {
        Dtype::F32 | Dtype::Bf16 => Ok(raw.dtype),
        other => Err(KernelError::Dtype {
            op,
            backend: "cuda",
            operand,
            dtype: other,
            fix: "use f32 or bf16",
        }),
    }
}

/// A buffer over an allocation of [`Context::malloc`], freed when dropped.
///
/// # Safety
/// `address` is a fresh allocation of `len` elements of `dtype` on
/// `context`, owned by no one else; its users are fenced (the runtime
/// synchronizes at teardown) before the buffer is dropped.
unsafe fn adopt(context: &Arc<Context>, address: u64, len: usize, dtype: Dtype) -> Buffer {
    let owner = context.clone();
    let release = Box::new(move |address| {
        // SAFETY: allocated on `owner`, freed once (the buffer's release runs once), after its users (the caller's contract).
        let _ = unsafe { owner.free(address) };
    });
    // SAFETY: the caller's contract.
    unsafe { Buffer::from_raw(address, len, dtype, DeviceKind::Cuda, release) }
}

impl CudaBackend {
    /// A backend on `context`'s GPU: compiles (or reuses) the kernels,
    /// opens cuBLASLt and allocates the scratch and readback slots for
    /// `limits` ([`CudaLimits::device_bytes`] on the device).
    pub fn new(context: Arc<Context>, limits: CudaLimits) -> Result<CudaBackend> {
        let ops = Ops::load(context.cuda())?;
        let gemm = Gemm::new()?;
        let scratch_bytes = limits.device_bytes();
        let address = context.malloc(scratch_bytes)?;
        // SAFETY: a fresh allocation of `scratch_bytes`, a multiple of 4.
        let scratch = unsafe { adopt(&context, address, (scratch_bytes / 4) as usize, Dtype::U32) };
        let host = context.alloc_pinned(READBACKS_MAX * SLOT_BYTES, 64)?;
        let staging = context.alloc_pinned(UPLOADS_MAX * limits.upload_bytes_max.max(64), 64)?;
        Ok(CudaBackend {
            context,
            ops,
            gemm,
            limits,
            scratch,
            slots: Arc::new(Slots {
                host,
                state: Mutex::new(vec![None; READBACKS_MAX]),
            }),
            uploads: Mutex::new(Uploads {
                host: staging,
                next: 0,
                fences: vec![None; UPLOADS_MAX],
            }),
        })
    }

    fn stream(&self) -> &cudarc::driver::safe::CudaStream {
        self.context.compute_stream()
    }

    /// Whether this attention runs on the tensor-core kernels, for operands
    /// the backend allocated (every allocation is 16-byte aligned).
    pub fn attention_on_tensor_cores(&self, dtype: Dtype, shape: Attention) -> bool {
        self.ops.attention_on_tensor_cores(dtype, shape, &[])
    }

    /// `c = a b` with `epilogue` fused (its bias and aux at the addresses
    /// given); false, with nothing enqueued, where cuBLASLt has no
    /// algorithm for it (the caller runs the ops unfused).
    fn fused(
        &self,
        op: &'static str,
        (a, b, c): (Matrix<'_>, Matrix<'_>, Raw),
        epilogue: (Epilogue, u64, u64),
    ) -> Result<bool> {
        let a = gemm_operand(op, "a", a.view.raw(), a.transposed)?;
        let b = gemm_operand(op, "b", b.view.raw(), b.transposed)?;
        let c = gemm_operand(op, "c", c, false)?;
        // SAFETY: every address is a checked view's on this device (the bias and aux by the caller); the workspace is the scratch's first GEMM_WORKSPACE_BYTES.
        unsafe {
            self.gemm.matmul_fused(
                self.stream(),
                a,
                b,
                c,
                (1.0, 0.0),
                (self.workspace(), GEMM_WORKSPACE_BYTES),
                epilogue,
            )
        }
    }

    /// Device addresses of the scratch's parts.
    fn workspace(&self) -> u64 {
        self.scratch.view().raw().address
    }

    fn partials(&self) -> u64 {
        self.workspace() + GEMM_WORKSPACE_BYTES
    }

    fn row_losses(&self) -> u64 {
        self.partials() + u64::from(SUM_BLOCKS) * 8
    }

    fn device_slot(&self, slot: usize) -> u64 {
        self.row_losses() + self.limits.rows_max as u64 * 4 + (slot * SLOT_BYTES) as u64
    }

    /// A word kernels may flag into that is never read back.
    fn unread_word(&self) -> u64 {
        self.device_slot(READBACKS_MAX)
    }

    /// Takes a free slot (its device bytes zeroed: flags are only ever
    /// raised), lets `write` enqueue what fills it, copies it to its pinned
    /// twin after that work, and returns the readback. The slot is given
    /// back if anything fails.
    fn readback(&self, decode: Decode, write: impl FnOnce(u64) -> Result<()>) -> Result<Readback> {
        let slot = {
            let mut state = self.slots.state.lock().expect("readback slots");
            let slot = state
                .iter()
                .position(Option::is_none)
                .ok_or(KernelError::Readbacks {
                    in_flight: READBACKS_MAX,
                })?;
            state[slot] = Some(decode);
            slot
        };
        let device = self.device_slot(slot);
        let enqueued = (|| {
            // SAFETY: the slot is inside the scratch buffer, ours alone.
            unsafe {
                self.context
                    .fill_async(StreamKind::Compute, device, SLOT_BYTES, 0)
            }?;
            write(device)?;
            // SAFETY: both ranges are the slot's; the pinned one is read only after the fence recorded below.
            unsafe {
                self.context.read_on_compute(
                    device,
                    self.slots.host.pointer().as_ptr().add(slot * SLOT_BYTES),
                    SLOT_BYTES,
                )
            }?;
            Ok(self.context.record(StreamKind::Compute)?)
        })();
        match enqueued {
            Ok(fence) => Ok(Readback::pending(fence, self.slots.clone(), slot)),
            Err(err) => {
                // Nothing will land there: after what was enqueued, free.
                if let Ok(fence) = self.context.record(StreamKind::Compute) {
                    let _ = fence.wait();
                }
                self.slots.release(slot);
                Err(err)
            }
        }
    }
}

impl Backend for CudaBackend {
    fn kind(&self) -> DeviceKind {
        DeviceKind::Cuda
    }

    fn name(&self) -> &'static str {
        "cuda"
    }

    fn alloc(&self, dtype: Dtype, len: usize) -> Result<Buffer> {
        let bytes = (len as u64)
            .checked_mul(dtype.bytes())
            .ok_or(KernelError::Index {
                op: "alloc",
                what: "bytes",
                value: u64::MAX,
                max: u64::MAX,
            })?;
        let address = self.context.malloc(bytes.max(1))?;
        // SAFETY: a fresh allocation of `len` elements of `dtype`.
        let buffer = unsafe { adopt(&self.context, address, len, dtype) };
        // SAFETY: the new allocation, ours alone.
        unsafe {
            self.context
                .fill_async(StreamKind::Compute, address, bytes as usize, 0)
        }?;
        Ok(buffer)
    }

    fn record(&self) -> Result<Fence> {
        Ok(self.context.record(StreamKind::Compute)?)
    }

    fn wait(&self, fence: &Fence) -> Result<()> {
        Ok(self.context.wait_on(StreamKind::Compute, fence)?)
    }

    fn gemm(
        &self,
        a: Matrix<'_>,
        b: Matrix<'_>,
        alpha: f32,
        beta: f32,
        c: ViewMut<'_>,
    ) -> Result<()> {
        const OP: &str = "gemm";
        let a = gemm_operand(OP, "a", a.view.raw(), a.transposed)?;
        let b = gemm_operand(OP, "b", b.view.raw(), b.transposed)?;
        let c = gemm_operand(OP, "c", c.raw(), false)?;
        // SAFETY: every address is a checked view's on this device; the workspace is the scratch's first GEMM_WORKSPACE_BYTES.
        unsafe {
            self.gemm.matmul(
                self.stream(),
                a,
                b,
                c,
                (alpha, beta),
                (self.workspace(), GEMM_WORKSPACE_BYTES),
            )
        }
    }

    fn gemm_bias(
        &self,
        a: Matrix<'_>,
        b: Matrix<'_>,
        bias: View<'_>,
        c: ViewMut<'_>,
    ) -> Result<()> {
        const OP: &str = "gemm_bias";
        let (bias_at, bias_len) = on_device(OP, "bias", bias.raw(), Some(Dtype::F32))?;
        same_len(OP, "bias", bias_len, c.raw().cols as u64)?;
        let epilogue = (Epilogue::Bias { bias: Dtype::F32 }, bias_at, 0);
        match self.fused(OP, (a, b, c.raw()), epilogue)? {
            true => Ok(()),
            false => unfused::gemm_bias(self, a, b, bias, c),
        }
    }

    fn gemm_bias_gelu(
        &self,
        a: Matrix<'_>,
        b: Matrix<'_>,
        bias: View<'_>,
        pre: ViewMut<'_>,
        out: ViewMut<'_>,
    ) -> Result<()> {
        const OP: &str = "gemm_bias_gelu";
        let (bias_at, bias_len) = on_device(OP, "bias", bias.raw(), Some(Dtype::F32))?;
        let (out_raw, pre_raw) = (out.raw(), pre.raw());
        same_len(OP, "bias", bias_len, out_raw.cols as u64)?;
        let (pre_at, _) = aux_like(OP, "pre", pre_raw, out_raw)?;
        let epilogue = Epilogue::GeluAuxBias {
            bias: Dtype::F32,
            aux_ld: pre_raw.row_stride as u64,
        };
        match self.fused(OP, (a, b, out_raw), (epilogue, bias_at, pre_at))? {
            true => Ok(()),
            false => unfused::gemm_bias_gelu(self, a, b, bias, pre, out),
        }
    }

    fn gemm_dgelu(
        &self,
        a: Matrix<'_>,
        b: Matrix<'_>,
        pre: View<'_>,
        product: ViewMut<'_>,
        dx: ViewMut<'_>,
    ) -> Result<()> {
        const OP: &str = "gemm_dgelu";
        let dx_raw = dx.raw();
        let (pre_at, _) = aux_like(OP, "pre", pre.raw(), dx_raw)?;
        let epilogue = Epilogue::DGelu {
            aux_ld: pre.raw().row_stride as u64,
        };
        match self.fused(OP, (a, b, dx_raw), (epilogue, 0, pre_at))? {
            true => Ok(()),
            false => unfused::gemm_dgelu(self, a, b, pre, product, dx),
        }
    }

    fn add_bias(&self, x: ViewMut<'_>, bias: View<'_>) -> Result<()> {
        const OP: &str = "add_bias";
        let dtype = compute_dtype(OP, "x", x.raw())?;
        let (x_at, n) = on_device(OP, "x", x.raw(), None)?;
        let (bias_at, cols) = on_device(OP, "bias", bias.raw(), Some(Dtype::F32))?;
        same_len(OP, "x", n, n / cols.max(1) * cols)?;
        // SAFETY: checked views on this device.
        unsafe {
            self.ops
                .add_bias(self.stream(), dtype, x_at, bias_at, n / cols.max(1), cols)
        }
    }

    fn bias_grad(&self, dy: View<'_>, dbias: ViewMut<'_>) -> Result<()> {
        const OP: &str = "bias_grad";
        let dtype = compute_dtype(OP, "dy", dy.raw())?;
        let (dy_at, n) = on_device(OP, "dy", dy.raw(), None)?;
        let (db_at, cols) = on_device(OP, "dbias", dbias.raw(), Some(Dtype::F32))?;
        same_len(OP, "dy", n, n / cols.max(1) * cols)?;
        // SAFETY: checked views on this device.
        unsafe {
            self.ops
                .bias_grad(self.stream(), dtype, dy_at, db_at, n / cols.max(1), cols)
        }
    }

    fn add(&self, y: ViewMut<'_>, x: View<'_>) -> Result<()> {
        self.axpy(1.0, x, y)
    }

    fn axpy(&self, alpha: f32, x: View<'_>, y: ViewMut<'_>) -> Result<()> {
        const OP: &str = "axpy";
        let dtype = compute_dtype(OP, "y", y.raw())?;
        let (y_at, n) = on_device(OP, "y", y.raw(), None)?;
        let (x_at, len) = on_device(OP, "x", x.raw(), Some(dtype))?;
        same_len(OP, "x", len, n)?;
        // SAFETY: checked views on this device.
        unsafe { self.ops.axpy(self.stream(), dtype, alpha, x_at, y_at, n) }
    }

    fn scale(&self, alpha: f32, x: ViewMut<'_>) -> Result<()> {
        const OP: &str = "scale";
        let dtype = compute_dtype(OP, "x", x.raw())?;
        let (x_at, n) = on_device(OP, "x", x.raw(), None)?;
        // SAFETY: a checked view on this device.
        unsafe { self.ops.scale(self.stream(), dtype, alpha, x_at, n) }
    }

    fn copy(&self, x: View<'_>, y: ViewMut<'_>) -> Result<()> {
        const OP: &str = "copy";
        let (y_at, n) = on_device(OP, "y", y.raw(), None)?;
        let (x_at, len) = on_device(OP, "x", x.raw(), Some(y.dtype()))?;
        same_len(OP, "x", len, n)?;
        // SAFETY: checked views; a view written through `y` aliases no other view (the ViewMut contract).
        unsafe {
            self.context
                .copy_on_compute(x_at, y_at, (n * y.dtype().bytes()) as usize)
        }?;
        Ok(())
    }

    fn upload(&self, host: View<'_>, y: ViewMut<'_>) -> Result<()> {
        const OP: &str = "upload";
        let (y_at, n) = on_device(OP, "y", y.raw(), None)?;
        if host.raw().kind != DeviceKind::Cpu {
            return Err(KernelError::Device {
                op: OP,
                operand: "host",
                actual: host.raw().kind,
                expected: DeviceKind::Cpu,
            });
        }
        let data = host.host_bytes().ok_or_else(|| KernelError::Shape {
            op: OP,
            operand: "host",
            actual: format!("row stride {}", host.raw().row_stride),
            expected: "a contiguous view".into(),
        })?;
        same_len(OP, "host", host.len() as u64, n)?;
        let slot_bytes = self.limits.upload_bytes_max.max(64);
        if data.len() > slot_bytes {
            return Err(KernelError::Index {
                op: OP,
                what: "bytes",
                value: data.len() as u64,
                max: slot_bytes as u64,
            });
        }
        let mut uploads = self.uploads.lock().expect("upload slots");
        let slot = uploads.next;
        uploads.next = (slot + 1) % UPLOADS_MAX;
        // The copy that read this slot UPLOADS_MAX uploads ago (long done).
        if let Some(fence) = uploads.fences[slot].take() {
            fence.wait()?;
        }
        // SAFETY: the slot lies in the pinned buffer (slot_bytes each) and no copy reads it now (its last one's fence passed above).
        let staged = unsafe { uploads.host.pointer().as_ptr().add(slot * slot_bytes) };
        // SAFETY: `data` fits the slot; the ranges are distinct allocations.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), staged, data.len()) };
        // SAFETY: the staged bytes stay until the fence recorded below passes; `y` is a checked view on this device, written by no one else (the ViewMut contract).
        unsafe { self.context.write_on_compute(staged, y_at, data.len()) }?;
        uploads.fences[slot] = Some(self.context.record(StreamKind::Compute)?);
        Ok(())
    }

    fn zero(&self, x: ViewMut<'_>) -> Result<()> {
        let (x_at, n) = on_device("zero", "x", x.raw(), None)?;
        // SAFETY: a checked view on this device.
        unsafe {
            self.context.fill_async(
                StreamKind::Compute,
                x_at,
                (n * x.dtype().bytes()) as usize,
                0,
            )
        }?;
        Ok(())
    }

    fn cast(&self, x: View<'_>, y: ViewMut<'_>) -> Result<()> {
        const OP: &str = "cast";
        let (y_at, n) = on_device(OP, "y", y.raw(), None)?;
        let (x_at, len) = on_device(OP, "x", x.raw(), None)?;
        same_len(OP, "x", len, n)?;
        if x.dtype() == y.dtype() {
            return self.copy(x, y);
        }
        // SAFETY: checked views on this device.
        unsafe {
            self.ops
                .cast(self.stream(), (x.dtype(), y.dtype()), x_at, y_at, n)
        }
    }

    fn layer_norm(
        &self,
        x: View<'_>,
        gamma: View<'_>,
        beta: View<'_>,
        out: ViewMut<'_>,
        saved: ViewMut<'_>,
    ) -> Result<()> {
        const OP: &str = "layer_norm";
        let (dtype, x_at, gamma_at, rows, cols) = norm_rows(OP, x.raw(), gamma.raw())?;
        let beta_at = sized(OP, "beta", beta.raw(), Some(Dtype::F32), cols)?;
        let out_at = sized(OP, "out", out.raw(), Some(dtype), rows * cols)?;
        let saved_at = sized(OP, "saved", saved.raw(), Some(Dtype::F32), 2 * rows)?;
        // SAFETY: checked views on this device.
        unsafe {
            self.ops.layer_norm(
                self.stream(),
                dtype,
                (x_at, gamma_at, beta_at, out_at, saved_at),
                rows,
                cols,
                LN_EPS,
            )
        }
    }

    fn layer_norm_backward(
        &self,
        dout: View<'_>,
        x: View<'_>,
        gamma: View<'_>,
        saved: View<'_>,
        dx: ViewMut<'_>,
        dgamma_dbeta: ViewMut<'_>,
    ) -> Result<()> {
        const OP: &str = "layer_norm_backward";
        let (dtype, x_at, gamma_at, rows, cols) = norm_rows(OP, x.raw(), gamma.raw())?;
        let n = rows * cols;
        let dout_at = sized(OP, "dout", dout.raw(), Some(dtype), n)?;
        let saved_at = sized(OP, "saved", saved.raw(), Some(Dtype::F32), 2 * rows)?;
        let dx_at = sized(OP, "dx", dx.raw(), Some(dtype), n)?;
        let f32 = Some(Dtype::F32);
        let dgb_at = sized(OP, "dgamma_dbeta", dgamma_dbeta.raw(), f32, 2 * cols)?;
        // SAFETY: checked views on this device.
        unsafe {
            self.ops.layer_norm_backward(
                self.stream(),
                dtype,
                (dout_at, x_at, gamma_at, saved_at, dx_at, dgb_at),
                rows,
                cols,
            )
        }
    }

    fn gelu(&self, x: View<'_>, out: ViewMut<'_>) -> Result<()> {
        const OP: &str = "gelu";
        let dtype = compute_dtype(OP, "x", x.raw())?;
        let (x_at, n) = on_device(OP, "x", x.raw(), None)?;
        let (out_at, len) = on_device(OP, "out", out.raw(), Some(dtype))?;
        same_len(OP, "out", len, n)?;
        // SAFETY: checked views on this device.
        unsafe { self.ops.gelu(self.stream(), dtype, x_at, out_at, n) }
    }

    fn gelu_backward(&self, dout: View<'_>, x: View<'_>, dx: ViewMut<'_>) -> Result<()> {
        const OP: &str = "gelu_backward";
        let dtype = compute_dtype(OP, "x", x.raw())?;
        let (x_at, n) = on_device(OP, "x", x.raw(), None)?;
        let (dout_at, dout_len) = on_device(OP, "dout", dout.raw(), Some(dtype))?;
        same_len(OP, "dout", dout_len, n)?;
        let (dx_at, dx_len) = on_device(OP, "dx", dx.raw(), Some(dtype))?;
        same_len(OP, "dx", dx_len, n)?;
        // SAFETY: checked views on this device.
        unsafe {
            self.ops
                .gelu_backward(self.stream(), dtype, (dout_at, x_at, dx_at), n)
        }
    }

    fn rms_norm(
        &self,
        x: View<'_>,
        gamma: View<'_>,
        eps: f32,
        out: ViewMut<'_>,
        saved: ViewMut<'_>,
    ) -> Result<()> {
        const OP: &str = "rms_norm";
        let (dtype, x_at, gamma_at, rows, cols) = norm_rows(OP, x.raw(), gamma.raw())?;
        let out_at = sized(OP, "out", out.raw(), Some(dtype), rows * cols)?;
        let saved_at = sized(OP, "saved", saved.raw(), Some(Dtype::F32), rows)?;
        // SAFETY: checked views on this device.
        unsafe {
            self.ops.rms_norm(
                self.stream(),
                dtype,
                (x_at, gamma_at, out_at, saved_at),
                rows,
                cols,
                eps,
            )
        }
    }

    fn rms_norm_backward(
        &self,
        dout: View<'_>,
        x: View<'_>,
        gamma: View<'_>,
        saved: View<'_>,
        dx: ViewMut<'_>,
        dgamma: ViewMut<'_>,
    ) -> Result<()> {
        const OP: &str = "rms_norm_backward";
        let (dtype, x_at, gamma_at, rows, cols) = norm_rows(OP, x.raw(), gamma.raw())?;
        let n = rows * cols;
        let dout_at = sized(OP, "dout", dout.raw(), Some(dtype), n)?;
        let saved_at = sized(OP, "saved", saved.raw(), Some(Dtype::F32), rows)?;
        let dx_at = sized(OP, "dx", dx.raw(), Some(dtype), n)?;
        let dgamma_at = sized(OP, "dgamma", dgamma.raw(), Some(Dtype::F32), cols)?;
        // SAFETY: checked views on this device.
        unsafe {
            self.ops.rms_norm_backward(
                self.stream(),
                dtype,
                (dout_at, x_at, gamma_at, saved_at, dx_at, dgamma_at),
                rows,
                cols,
            )
        }
    }

    fn rotary(
        &self,
        shape: Attention,
        position_ids: View<'_>,
        inv_freq: View<'_>,
        inverse: bool,
        qkv: ViewMut<'_>,
    ) -> Result<()> {
        const OP: &str = "rotary";
        let dtype = compute_dtype(OP, "qkv", qkv.raw())?;
        check_rotary_heads(OP, shape)?;
        let d = shape.head_dim;
        let (qkv_at, n) = on_device(OP, "qkv", qkv.raw(), Some(dtype))?;
        same_len(OP, "qkv", n, (shape.rows() * shape.qkv_width()) as u64)?;
        let (freq_at, freq_len) = on_device(OP, "inv_freq", inv_freq.raw(), Some(Dtype::F32))?;
        same_len(OP, "inv_freq", freq_len, (d / 2) as u64)?;
        let ids_at = position_ids_at(OP, position_ids, shape.rows())?;
        // SAFETY: checked views on this device.
        unsafe {
            self.ops.rotary(
                self.stream(),
                dtype,
                shape,
                (qkv_at, ids_at, freq_at),
                inverse,
            )
        }
    }

    fn swiglu(&self, gate_up: View<'_>, out: ViewMut<'_>) -> Result<()> {
        const OP: &str = "swiglu";
        check_swiglu_shapes(OP, gate_up.raw(), out.raw())?;
        let dtype = compute_dtype(OP, "out", out.raw())?;
        let f = out.raw().cols as u64;
        let (out_at, n) = on_device(OP, "out", out.raw(), None)?;
        let (gate_up_at, gate_up_len) = on_device(OP, "gate_up", gate_up.raw(), Some(dtype))?;
        same_len(OP, "gate_up", gate_up_len, 2 * n)?;
        // SAFETY: checked views on this device.
        unsafe {
            self.ops
                .swiglu(self.stream(), dtype, (gate_up_at, out_at), n / f.max(1), f)
        }
    }

    fn swiglu_backward(
        &self,
        dout: View<'_>,
        gate_up: View<'_>,
        dgate_up: ViewMut<'_>,
    ) -> Result<()> {
        const OP: &str = "swiglu_backward";
        check_swiglu_shapes(OP, gate_up.raw(), dout.raw())?;
        check_swiglu_shapes(OP, dgate_up.raw(), dout.raw())?;
        let dtype = compute_dtype(OP, "dout", dout.raw())?;
        let f = dout.raw().cols as u64;
        let (dout_at, n) = on_device(OP, "dout", dout.raw(), None)?;
        let (gate_up_at, gate_up_len) = on_device(OP, "gate_up", gate_up.raw(), Some(dtype))?;
        same_len(OP, "gate_up", gate_up_len, 2 * n)?;
        let (dgate_up_at, dgate_up_len) = on_device(OP, "dgate_up", dgate_up.raw(), Some(dtype))?;
        same_len(OP, "dgate_up", dgate_up_len, 2 * n)?;
        // SAFETY: checked views on this device.
        unsafe {
            self.ops.swiglu_backward(
                self.stream(),
                dtype,
                (dout_at, gate_up_at, dgate_up_at),
                n / f.max(1),
                f,
            )
        }
    }

    fn attention_saved_elems(&self, shape: Attention) -> usize {
        shape.batch * shape.heads * shape.seq
    }

    fn attention_workspace_elems(&self, shape: Attention) -> usize {
        shape.batch * shape.heads * shape.seq
    }

    fn attention(
        &self,
        shape: Attention,
        position_ids: View<'_>,
        qkv: View<'_>,
        out: ViewMut<'_>,
        saved: ViewMut<'_>,
        _workspace: ViewMut<'_>,
    ) -> Result<()> {
        const OP: &str = "attention";
        check_heads(OP, shape)?;
        let dtype = compute_dtype(OP, "qkv", qkv.raw())?;
        let (rows, hidden) = (shape.rows() as u64, shape.hidden() as u64);
        let (qkv_at, n) = on_device(OP, "qkv", qkv.raw(), None)?;
        same_len(OP, "qkv", n, rows * shape.qkv_width() as u64)?;
        let ids_at = position_ids_at(OP, position_ids, shape.rows())?;
        let (out_at, out_len) = on_device(OP, "out", out.raw(), Some(dtype))?;
        same_len(OP, "out", out_len, rows * hidden)?;
        let (lse_at, lse_len) = on_device(OP, "saved", saved.raw(), Some(Dtype::F32))?;
        same_len(
            OP,
            "saved",
            lse_len,
            self.attention_saved_elems(shape) as u64,
        )?;
        // SAFETY: checked views on this device.
        unsafe {
            self.ops.attention(
                self.stream(),
                dtype,
                shape,
                (qkv_at, ids_at, out_at, lse_at),
            )
        }
    }

    fn attention_backward(
        &self,
        shape: Attention,
        position_ids: View<'_>,
        qkv: View<'_>,
        out: View<'_>,
        saved: View<'_>,
        dout: View<'_>,
        dqkv: ViewMut<'_>,
        workspace: ViewMut<'_>,
    ) -> Result<()> {
        const OP: &str = "attention_backward";
        check_heads(OP, shape)?;
        let dtype = compute_dtype(OP, "qkv", qkv.raw())?;
        let (rows, hidden) = (shape.rows() as u64, shape.hidden() as u64);
        let (qkv_at, n) = on_device(OP, "qkv", qkv.raw(), None)?;
        same_len(OP, "qkv", n, rows * shape.qkv_width() as u64)?;
        let ids_at = position_ids_at(OP, position_ids, shape.rows())?;
        let (out_at, out_len) = on_device(OP, "out", out.raw(), Some(dtype))?;
        same_len(OP, "out", out_len, rows * hidden)?;
        let (lse_at, lse_len) = on_device(OP, "saved", saved.raw(), Some(Dtype::F32))?;
        same_len(
            OP,
            "saved",
            lse_len,
            self.attention_saved_elems(shape) as u64,
        )?;
        let (dout_at, dout_len) = on_device(OP, "dout", dout.raw(), Some(dtype))?;
        same_len(OP, "dout", dout_len, rows * hidden)?;
        let (dqkv_at, dqkv_len) = on_device(OP, "dqkv", dqkv.raw(), Some(dtype))?;
        same_len(OP, "dqkv", dqkv_len, n)?;
        let (dsum_at, dsum_len) = on_device(OP, "workspace", workspace.raw(), Some(Dtype::F32))?;
        if dsum_len < self.attention_workspace_elems(shape) as u64 {
            same_len(
                OP,
                "workspace",
                dsum_len,
                self.attention_workspace_elems(shape) as u64,
            )?;
        }
        // SAFETY: checked views on this device.
        unsafe {
            self.ops.attention_backward(
                self.stream(),
                dtype,
                shape,
                (qkv_at, ids_at, out_at, lse_at, dout_at, dqkv_at, dsum_at),
            )
        }
    }

    fn cross_entropy(
        &self,
        logits: View<'_>,
        targets: View<'_>,
        grad_scale: f32,
        dlogits: ViewMut<'_>,
    ) -> Result<Readback> {
        const OP: &str = "cross_entropy";
        let dtype = compute_dtype(OP, "logits", logits.raw())?;
        let (targets_at, rows) = on_device(OP, "targets", targets.raw(), Some(Dtype::U32))?;
        let (logits_at, n) = on_device(OP, "logits", logits.raw(), None)?;
        let vocab = n / rows.max(1);
        same_len(OP, "logits", n, vocab * rows)?;
        let (dlogits_at, d_len) = on_device(OP, "dlogits", dlogits.raw(), Some(dtype))?;
        same_len(OP, "dlogits", d_len, n)?;
        if rows as usize > self.limits.rows_max {
            return Err(KernelError::Index {
                op: OP,
                what: "rows",
                value: rows,
                max: self.limits.rows_max as u64,
            });
        }
        self.readback(Decode::Loss { vocab }, |slot| {
            // SAFETY: checked views; the rows' losses and the slot are the scratch's, used by this op alone on the one stream.
            unsafe {
                self.ops.cross_entropy(
                    self.stream(),
                    dtype,
                    (
                        logits_at,
                        targets_at,
                        dlogits_at,
                        self.row_losses(),
                        slot,
                        slot + 8,
                    ),
                    rows,
                    vocab,
                    grad_scale,
                )
            }
        })
    }

    fn attention_decode(
        &self,
        _shape: Attention,
        _len: usize,
        _q: View<'_>,
        _keys: View<'_>,
        _values: View<'_>,
        _out: ViewMut<'_>,
    ) -> Result<()> {
        Err(missing_kernel(
            "attention_decode",
            "attention over a key/value cache (generation)",
        ))
    }

    fn embedding(
        &self,
        table: View<'_>,
        positions: View<'_>,
        tokens: View<'_>,
        position_ids: View<'_>,
        seq: usize,
        out: ViewMut<'_>,
    ) -> Result<()> {
        const OP: &str = "embedding";
        let dtype = compute_dtype(OP, "out", out.raw())?;
        let (table_at, table_len) = on_device(OP, "table", table.raw(), Some(Dtype::F32))?;
        let (tokens_at, count) = on_device(OP, "tokens", tokens.raw(), Some(Dtype::U32))?;
        let (out_at, n) = on_device(OP, "out", out.raw(), None)?;
        let hidden = n / count.max(1);
        same_len(OP, "out", n, hidden * count)?;
        let positions_at = match positions.is_empty() {
            true => 0,
            false => {
                let (at, len) = on_device(OP, "positions", positions.raw(), Some(Dtype::F32))?;
                same_len(OP, "positions", len, seq as u64 * hidden)?;
                at
            }
        };
        let ids_at = position_ids_at(OP, position_ids, count as usize)?;
        let vocab = table_len / hidden.max(1);
        // The kernel flags a token outside the vocabulary (or an id past the
        // position table) in a scratch word nobody reads, and writes zeros
        // for it: the data's ids are checked against the vocabulary before
        // a run, position ids are made by the data loader within the
        // sequence, and cross-entropy's readback reports a bad token (its
        // targets are the same ids), without a sync here.
        // SAFETY: checked views on this device; the word is the scratch's.
        unsafe {
            self.ops.embedding(
                self.stream(),
                dtype,
                (
                    table_at,
                    positions_at,
                    tokens_at,
                    ids_at,
                    out_at,
                    self.unread_word(),
                ),
                count,
                seq as u64,
                hidden,
                vocab,
            )
        }
    }

    fn embedding_backward(
        &self,
        tokens: View<'_>,
        position_ids: View<'_>,
        seq: usize,
        dout: View<'_>,
        dtable: ViewMut<'_>,
        dpositions: ViewMut<'_>,
    ) -> Result<()> {
        const OP: &str = "embedding_backward";
        let dtype = compute_dtype(OP, "dout", dout.raw())?;
        let (tokens_at, count) = on_device(OP, "tokens", tokens.raw(), Some(Dtype::U32))?;
        let (dout_at, n) = on_device(OP, "dout", dout.raw(), None)?;
        let hidden = n / count.max(1);
        same_len(OP, "dout", n, hidden * count)?;
        let (dtable_at, dtable_len) = on_device(OP, "dtable", dtable.raw(), Some(Dtype::F32))?;
        let dpositions_at = match dpositions.is_empty() {
            true => 0,
            false => {
                let (at, len) = on_device(OP, "dpositions", dpositions.raw(), Some(Dtype::F32))?;
                same_len(OP, "dpositions", len, seq as u64 * hidden)?;
                at
            }
        };
        let ids_at = position_ids_at(OP, position_ids, count as usize)?;
        let vocab = dtable_len / hidden.max(1);
        // SAFETY: checked views on this device.
        unsafe {
            self.ops.embedding_backward(
                self.stream(),
                dtype,
                (tokens_at, ids_at, dout_at, dtable_at, dpositions_at),
                count,
                seq as u64,
                hidden,
                vocab,
            )
        }
    }

    fn adamw(
        &self,
        coefficients: &AdamCoefficients,
        grad: View<'_>,
        master: ViewMut<'_>,
        m: ViewMut<'_>,
        v: ViewMut<'_>,
        param: ViewMut<'_>,
    ) -> Result<()> {
        const OP: &str = "adamw";
        let (grad_at, n) = on_device(OP, "grad", grad.raw(), Some(Dtype::F32))?;
        let mut at = [0u64; 4];
        for (i, (name, raw, dtype)) in [
            ("master", master.raw(), Dtype::F32),
            ("m", m.raw(), Dtype::F32),
            ("v", v.raw(), Dtype::F32),
            ("param", param.raw(), Dtype::Bf16),
        ]
        .into_iter()
        .enumerate()
        {
            let (address, len) = on_device(OP, name, raw, Some(dtype))?;
            same_len(OP, name, len, n)?;
            at[i] = address;
        }
        // SAFETY: checked views on this device.
        unsafe {
            self.ops.adamw(
                self.stream(),
                coefficients,
                (grad_at, at[0], at[1], at[2], at[3]),
                n,
            )
        }
    }

    fn sum_squares(&self, x: View<'_>) -> Result<Readback> {
        const OP: &str = "sum_squares";
        let dtype = compute_dtype(OP, "x", x.raw())?;
        let (x_at, n) = on_device(OP, "x", x.raw(), None)?;
        self.readback(Decode::F64, |slot| {
            // SAFETY: a checked view; the partials and the slot are the scratch's.
            unsafe {
                self.ops
                    .sum_squares(self.stream(), dtype, x_at, n, self.partials(), slot)
            }
        })
    }

    fn non_finite(&self, x: View<'_>) -> Result<Readback> {
        const OP: &str = "non_finite";
        let dtype = compute_dtype(OP, "x", x.raw())?;
        let (x_at, n) = on_device(OP, "x", x.raw(), None)?;
        self.readback(Decode::Flag, |slot| {
            // SAFETY: a checked view; the slot is the scratch's (zeroed).
            unsafe { self.ops.non_finite(self.stream(), dtype, x_at, n, slot) }
        })
    }

    fn read_scalar(&self, x: View<'_>, index: usize) -> Result<Readback> {
        const OP: &str = "read_scalar";
        let raw = x.raw();
        let (x_at, n) = on_device(OP, "x", raw, None)?;
        if index as u64 >= n {
            return Err(KernelError::Shape {
                op: OP,
                operand: "index",
                actual: format!("index {index}"),
                expected: format!("an index below {n}"),
            });
        }
        let decode = match raw.dtype {
            Dtype::F32 => Decode::F32,
            Dtype::Bf16 => Decode::Bf16,
            Dtype::U32 => Decode::U32,
            other => {
                return Err(KernelError::Dtype {
                    op: OP,
                    backend: "cuda",
                    operand: "x",
                    dtype: other,
                    fix: "read f32, bf16 or u32 scalars",
                });
            }
        };
        let bytes = raw.dtype.bytes();
        self.readback(decode, |slot| {
            // SAFETY: one element inside a checked view, into the slot.
            unsafe {
                self.context
                    .copy_on_compute(x_at + index as u64 * bytes, slot, bytes as usize)
            }?;
            Ok(())
        })
    }
}

/// The device address of `position_ids` (u32, one per row of `rows`), or 0
/// where it is empty (each row's place in its sequence). Unlike the CPU
/// backend, the ids are not checked (that would read them back, a sync):
/// the engine's data loader makes them within each sequence, and the
/// kernels take an id past a row's place in its sequence as that place and
/// give an embedding row past the position table zeros.
fn position_ids_at(op: &'static str, position_ids: View<'_>, rows: usize) -> Result<u64> {
    if position_ids.is_empty() {
        return Ok(0);
    }
    let (at, len) = on_device(op, "position_ids", position_ids.raw(), Some(Dtype::U32))?;
    same_len(op, "position_ids", len, rows as u64)?;
    Ok(at)
}

/// The error of an op the CUDA backend has no kernel for yet.
fn missing_kernel(op: &'static str, what: &'static str) -> KernelError {
    KernelError::Unsupported {
        op,
        backend: "cuda",
        what,
        fix: "train this model on [device] kind = \"cpu\" until the GPU kernels for RMSNorm, rotary embeddings, SwiGLU and grouped-query attention land",
    }
}
