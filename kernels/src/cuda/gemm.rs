//! GEMMs through cuBLASLt's result layer: row-major `C = alpha op(A)
//! op(B) + beta C` for bf16 (or f32) A and B and f32 (or bf16) C, with the
//! matmul descriptor, the four layouts and the algorithm chosen once per
//! shape and kept (the heuristic query is not on the step path), and a
//! workspace the caller sizes inside the device budget. Optionally with a
//! fused [`Epilogue`] (bias; bias, GELU and the pre-activation kept; GELU's
//! derivative): where cuBLASLt has no algorithm for one, the call says so
//! and the caller runs the unfused ops.
//!
//! cuBLASLt is column-major. A row-major `r x c` matrix with row stride
//! `ld` is, read column-major, its `c x r` transpose with leading dimension
//! `ld`; so the row-major product `C = op(A) op(B)` is issued as the
//! column-major `C^T = op(B)^T op(A)^T`, B first.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Mutex;

use cudarc::cublaslt::{result, sys};
use cudarc::driver::safe::CudaStream;
use strata_device::cuda::{Library, probe_library};
use strata_device::{DeviceError, Dtype};

use crate::error::{KernelError, Result};

/// cuBLAS's `CUBLAS_OP_N` and `CUBLAS_OP_T` (a `cublasOperation_t`, an
/// int32, in the descriptor's TRANSA/TRANSB attributes).
const OP_N: i32 = 0;
const OP_T: i32 = 1;

/// Shapes whose plans are kept; past it the oldest is dropped (a model has
/// a few dozen).
pub const GEMM_PLANS_MAX: usize = 256;

/// What a GEMM does to its product on the way out, fused (cuBLASLt's
/// epilogues). Row-major: a bias has one element per column of C and is
/// added to every row; `aux` has C's shape with `aux_ld` elements between
/// row starts (a multiple of 8), in C's dtype.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Epilogue {
    /// C as computed.
    None,
    /// `C = AB + bias`.
    Bias {
        /// The bias vector's dtype.
        bias: Dtype,
    },
    /// `aux = AB + bias`, `C = gelu(aux)` (tanh form).
    GeluAuxBias {
        /// The bias vector's dtype.
        bias: Dtype,
        /// Elements between `aux`'s row starts.
        aux_ld: u64,
    },
    /// `C = AB * gelu'(aux)`, `aux` the GELU's input (its backward).
    DGelu {
        /// Elements between `aux`'s row starts.
        aux_ld: u64,
    },
}

impl Epilogue {
    fn code(self) -> u32 {
        use sys::cublasLtEpilogue_t as E;
        (match self {
            Epilogue::None => E::CUBLASLT_EPILOGUE_DEFAULT,
            Epilogue::Bias { .. } => E::CUBLASLT_EPILOGUE_BIAS,
            Epilogue::GeluAuxBias { .. } => E::CUBLASLT_EPILOGUE_GELU_AUX_BIAS,
            Epilogue::DGelu { .. } => E::CUBLASLT_EPILOGUE_DGELU,
        }) as u32
    }

    fn bias(self) -> Option<Dtype> {
        match self {
            Epilogue::Bias { bias } | Epilogue::GeluAuxBias { bias, .. } => Some(bias),
            Epilogue::None | Epilogue::DGelu { .. } => None,
        }
    }

    fn aux_ld(self) -> Option<u64> {
        match self {
            Epilogue::GeluAuxBias { aux_ld, .. } | Epilogue::DGelu { aux_ld } => Some(aux_ld),
            Epilogue::None | Epilogue::Bias { .. } => None,
        }
    }
}

/// One operand of a row-major GEMM: its dtype, stored rows and columns,
/// row stride (elements) and whether the product uses its transpose.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Operand {
    /// Element type.
    pub dtype: Dtype,
    /// Stored rows.
    pub rows: u64,
    /// Stored columns.
    pub cols: u64,
    /// Elements between row starts (at least `cols`).
    pub row_stride: u64,
    /// Use the transpose.
    pub transposed: bool,
}

impl Operand {
    /// Rows and columns as used in the product.
    pub fn used(&self) -> (u64, u64) {
        match self.transposed {
            false => (self.rows, self.cols),
            true => (self.cols, self.rows),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Shape {
    a: Operand,
    b: Operand,
    c: Operand,
    workspace_bytes: u64,
    epilogue: Epilogue,
}

/// A shape's descriptor, layouts and algorithm.
struct Plan {
    desc: sys::cublasLtMatmulDesc_t,
    /// Column-major B (issued first), A, then C (also D).
    layouts: [sys::cublasLtMatrixLayout_t; 3],
    algo: sys::cublasLtMatmulAlgo_t,
}

// SAFETY: the handles are plain pointers to cuBLASLt objects that are only
// used under the `Gemm`'s lock and destroyed once.
unsafe impl Send for Plan {}

/// Each shape's plan (None: a fused epilogue cuBLASLt has no algorithm for
/// at that shape), and the shapes in the order they were first seen.
type Plans = (HashMap<Shape, Option<Plan>>, Vec<Shape>);

/// A cuBLASLt handle and the plans of the shapes seen so far.
pub struct Gemm {
    handle: sys::cublasLtHandle_t,
    plans: Mutex<Plans>,
}

// SAFETY: cuBLASLt handles may be used from any thread (one call at a time
// per stream is the caller's, through the one compute stream); the plans
// are behind a lock.
unsafe impl Send for Gemm {}
// SAFETY: as above.
unsafe impl Sync for Gemm {}

fn cublas(op: &'static str) -> impl Fn(result::CublasError) -> KernelError {
    move |err| {
        KernelError::Failed(DeviceError::Cuda {
            op,
            cause: format!("{err:?}"),
        })
    }
}

fn data_type(op: &'static str, operand: &'static str, dtype: Dtype) -> Result<sys::cudaDataType> {
    match dtype {
        Dtype::F32 => Ok(sys::cudaDataType::CUDA_R_32F),
        Dtype::Bf16 => Ok(sys::cudaDataType::CUDA_R_16BF),
        other => Err(KernelError::Dtype {
            op,
            backend: "cuda",
            operand,
            dtype: other,
            fix: "use bf16 (or f32) operands",
        }),
    }
}

impl Gemm {
    /// A handle, after checking that cuBLASLt can be loaded.
    pub fn new() -> Result<Gemm> {
        probe_library(Library::CublasLt)?;
        let handle = result::create_handle().map_err(cublas("cublasLtCreate"))?;
        Ok(Gemm {
            handle,
            plans: Mutex::new((HashMap::new(), Vec::new())),
        })
    }

    /// Enqueues `C = alpha op(A) op(B) + beta C` on `stream` (row-major
    /// views; see [`Operand`]). `workspace` is a device address of
    /// `workspace_bytes` bytes (32 MiB serves Hopper).
    ///
    /// # Safety
    /// `a`, `b` and `c` are device addresses in `stream`'s context holding
    /// the operands as described, `workspace` as many bytes as said; all
    /// live, and `c` and `workspace` not used by other work, until the
    /// stream passes this call.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn matmul(
        &self,
        stream: &CudaStream,
        a: (Operand, u64),
        b: (Operand, u64),
        c: (Operand, u64),
        scales: (f32, f32),
        workspace: (u64, u64),
    ) -> Result<()> {
        // SAFETY: the caller's contract, passed on; no epilogue operand.
        let done = unsafe {
            self.matmul_fused(stream, a, b, c, scales, workspace, (Epilogue::None, 0, 0))
        }?;
        assert!(done, "a GEMM without an epilogue always has a plan");
        Ok(())
    }

    /// [`Gemm::matmul`] with `epilogue` fused, its bias at `bias_at` and
    /// its aux at `aux_at` (device addresses; 0 where it has none).
    /// Returns false, having enqueued nothing, where cuBLASLt has no
    /// algorithm for that epilogue at this shape (the caller then runs the
    /// unfused ops).
    ///
    /// # Safety
    /// As [`Gemm::matmul`]; the bias holds one element of its dtype per
    /// column of C, and aux C's rows at its row stride, both live until
    /// the stream passes this call (aux not used by other work).
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn matmul_fused(
        &self,
        stream: &CudaStream,
        (a, a_at): (Operand, u64),
        (b, b_at): (Operand, u64),
        (c, c_at): (Operand, u64),
        (alpha, beta): (f32, f32),
        (workspace, workspace_bytes): (u64, u64),
        (epilogue, bias_at, aux_at): (Epilogue, u64, u64),
    ) -> Result<bool> {
        const OP: &str = "gemm";
        let (m, k) = a.used();
        let (k2, n) = b.used();
        if k != k2 || c.used() != (m, n) || c.transposed {
            return Err(KernelError::Shape {
                op: OP,
                operand: "c",
                actual: format!("{m} x {k} times {k2} x {n} into {:?}", c.used()),
                expected: "op(a) m x k, op(b) k x n, c m x n (not transposed)".into(),
            });
        }
        for (name, operand) in [("a", &a), ("b", &b), ("c", &c)] {
            if operand.row_stride < operand.cols || operand.rows == 0 || operand.cols == 0 {
                return Err(KernelError::Shape {
                    op: OP,
                    operand: name,
                    actual: format!(
                        "{} x {} with row stride {}",
                        operand.rows, operand.cols, operand.row_stride
                    ),
                    expected: "non-empty, row stride at least the columns".into(),
                });
            }
        }
        if let Some(aux_ld) = epilogue.aux_ld()
            && (aux_ld < c.cols || !aux_ld.is_multiple_of(8))
        {
            return Err(KernelError::Shape {
                op: OP,
                operand: "aux",
                actual: format!("row stride {aux_ld} for {} columns", c.cols),
                expected: "a row stride of at least the columns, a multiple of 8".into(),
            });
        }
        let shape = Shape {
            a,
            b,
            c,
            workspace_bytes,
            epilogue,
        };
        let mut plans = self.plans.lock().expect("gemm plans");
        if !plans.0.contains_key(&shape) {
            let plan = match self.plan(&shape) {
                Ok(plan) => Some(plan),
                Err(Unplanned::NoAlgorithm) if epilogue != Epilogue::None => None,
                Err(Unplanned::Refused(cause)) => {
                    debug_assert!(epilogue != Epilogue::None, "only epilogues are refused");
                    tracing::warn!(
                        "cuBLASLt refused the fused {epilogue:?} for {a:?} x {b:?} into {c:?} \
                         ({cause}): this shape runs the GEMM and its epilogue as separate kernels"
                    );
                    None
                }
                Err(Unplanned::NoAlgorithm) => {
                    return Err(KernelError::Failed(DeviceError::Cuda {
                        op: "cublasLtMatmulAlgoGetHeuristic",
                        cause: format!(
                            "no algorithm for {a:?} x {b:?} into {c:?} with a {workspace_bytes} byte workspace"
                        ),
                    }));
                }
                Err(Unplanned::Failed(err)) => return Err(err),
            };
            if plans.1.len() == GEMM_PLANS_MAX {
                let oldest = plans.1.remove(0);
                if let Some(Some(old)) = plans.0.remove(&oldest) {
                    destroy(old);
                }
            }
            plans.0.insert(shape, plan);
            plans.1.push(shape);
        }
        let Some(plan) = &plans.0[&shape] else {
            return Ok(false);
        };
        // The operands' addresses live in the descriptor: set for this
        // call (under the lock; cuBLASLt reads them when the call is
        // enqueued).
        for (attribute, address) in [
            (
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                epilogue.bias().map(|_| bias_at),
            ),
            (
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER,
                epilogue.aux_ld().map(|_| aux_at),
            ),
        ] {
            if let Some(address) = address {
                // SAFETY: the descriptor is live; the attribute is a pointer (8 bytes).
                unsafe { set_desc(plan.desc, attribute, &address) }
                    .map_err(cublas("cublasLtMatmulDescSetAttribute"))?;
            }
        }
        let [b_layout, a_layout, c_layout] = plan.layouts;
        // SAFETY: the plan's objects are live (destroyed only on eviction or drop, under this lock); the addresses are the caller's contract; alpha and beta are f32 host scalars, the descriptor's scale type.
        unsafe {
            result::matmul(
                self.handle,
                plan.desc,
                (&alpha as *const f32).cast::<c_void>(),
                (&beta as *const f32).cast::<c_void>(),
                b_at as *const c_void,
                b_layout,
                a_at as *const c_void,
                a_layout,
                c_at as *const c_void,
                c_layout,
                c_at as *mut c_void,
                c_layout,
                &plan.algo,
                workspace as *mut c_void,
                workspace_bytes as usize,
                stream.cu_stream() as sys::cudaStream_t,
            )
        }
        .map_err(cublas("cublasLtMatmul"))?;
        Ok(true)
    }

    /// The descriptor, layouts and best algorithm of `shape`.
    fn plan(&self, shape: &Shape) -> std::result::Result<Plan, Unplanned> {
        const OP: &str = "gemm";
        let (a, b, c) = (shape.a, shape.b, shape.c);
        // cuBLASLt's bias is of D's type (its exceptions are integer and
        // fp8 GEMMs): an fp32 bias into a bf16 output has no algorithm (the
        // heuristic answers INVALID_VALUE, seen on an H200 with CUDA 13).
        if shape.epilogue.bias().is_some_and(|bias| bias != c.dtype) {
            return Err(Unplanned::NoAlgorithm);
        }
        let (a_type, b_type, c_type) = (
            data_type(OP, "a", a.dtype)?,
            data_type(OP, "b", b.dtype)?,
            data_type(OP, "c", c.dtype)?,
        );
        // Column-major, B first: X = B read column-major (its transpose).
        let layout = |dtype, operand: Operand| {
            result::create_matrix_layout(
                dtype,
                operand.cols,
                operand.rows,
                operand.row_stride as i64,
            )
            .map_err(cublas("cublasLtMatrixLayoutCreate"))
        };
        let desc = result::create_matmul_desc(
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            sys::cudaDataType::CUDA_R_32F,
        )
        .map_err(cublas("cublasLtMatmulDescCreate"))?;
        let mut plan = Plan {
            desc,
            layouts: [std::ptr::null_mut(); 3],
            algo: sys::cublasLtMatmulAlgo_t { data: [0; 8] },
        };
        let built = (|| {
            plan.layouts = [layout(b_type, b)?, layout(a_type, a)?, layout(c_type, c)?];
            // Read column-major, a stored operand is already the transpose
            // of itself: op(B)^T needs it as stored unless B is used
            // transposed (and likewise A).
            let (trans_x, trans_y) = (
                if b.transposed { OP_T } else { OP_N },
                if a.transposed { OP_T } else { OP_N },
            );
            use sys::cublasLtMatmulDescAttributes_t as A;
            let set_failed = cublas("cublasLtMatmulDescSetAttribute");
            for (attribute, value) in [
                (A::CUBLASLT_MATMUL_DESC_TRANSA, trans_x),
                (A::CUBLASLT_MATMUL_DESC_TRANSB, trans_y),
                (
                    A::CUBLASLT_MATMUL_DESC_EPILOGUE,
                    shape.epilogue.code() as i32,
                ),
            ] {
                // SAFETY: `desc` is live; the attribute is an int32 (an enum).
                unsafe { set_desc(desc, attribute, &value) }.map_err(&set_failed)?;
            }
            if let Some(bias) = shape.epilogue.bias() {
                let bias_type = data_type(OP, "bias", bias)? as i32;
                // SAFETY: as above; a cudaDataType (int32).
                unsafe { set_desc(desc, A::CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type) }
                    .map_err(&set_failed)?;
            }
            if let Some(aux_ld) = shape.epilogue.aux_ld() {
                let aux_ld = aux_ld as i64;
                let aux_type = c_type as i32;
                // SAFETY: as above; an int64 and a cudaDataType (int32).
                unsafe {
                    set_desc(desc, A::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &aux_ld).and_then(
                        |()| {
                            set_desc(
                                desc,
                                A::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE,
                                &aux_type,
                            )
                        },
                    )
                }
                .map_err(&set_failed)?;
            }
            let preference =
                result::create_matmul_pref().map_err(cublas("cublasLtMatmulPreferenceCreate"))?;
            let workspace = shape.workspace_bytes;
            // SAFETY: `preference` is live; the attribute is a u64.
            let set = unsafe {
                result::set_matmul_pref_attribute(
                    preference,
                    sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                    (&workspace as *const u64).cast(),
                    std::mem::size_of::<u64>(),
                )
            };
            let [x, y, d] = plan.layouts;
            // SAFETY: every object is live.
            let heuristic = set.and_then(|()| unsafe {
                result::get_matmul_algo_heuristic(self.handle, desc, x, y, d, d, preference)
            });
            // SAFETY: created above, not used after.
            let _ = unsafe { result::destroy_matmul_pref(preference) };
            let heuristic = heuristic.map_err(|err| match err.0 {
                sys::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED => Unplanned::NoAlgorithm,
                sys::cublasStatus_t::CUBLAS_STATUS_INVALID_VALUE
                    if shape.epilogue != Epilogue::None =>
                {
                    Unplanned::Refused(format!("{err:?}"))
                }
                _ => Unplanned::Failed(KernelError::Failed(DeviceError::Cuda {
                    op: "cublasLtMatmulAlgoGetHeuristic",
                    cause: format!(
                        "{err:?} for {:?} x {:?} into {:?} with a {} byte workspace and {:?}",
                        a, b, c, shape.workspace_bytes, shape.epilogue
                    ),
                })),
            })?;
            plan.algo = heuristic.algo;
            Ok(())
        })();
        match built {
            Ok(()) => Ok(plan),
            Err(err) => {
                destroy(plan);
                Err(err)
            }
        }
    }
}

/// Why a shape has no plan.
enum Unplanned {
    /// cuBLASLt has no algorithm for it.
    NoAlgorithm,
    /// cuBLASLt called a fused epilogue's descriptor invalid (a combination
    /// its documentation does not rule out, refused by this library
    /// version): the caller runs it unfused, and says so.
    Refused(String),
    /// Anything else.
    Failed(KernelError),
}

impl From<KernelError> for Unplanned {
    fn from(err: KernelError) -> Self {
        Unplanned::Failed(err)
    }
}

/// Sets one of `desc`'s attributes to `value`.
///
/// # Safety
/// `desc` is a live descriptor and `T` the attribute's type in cuBLASLt's
/// documentation.
unsafe fn set_desc<T>(
    desc: sys::cublasLtMatmulDesc_t,
    attribute: sys::cublasLtMatmulDescAttributes_t,
    value: &T,
) -> std::result::Result<(), result::CublasError> {
    // SAFETY: the caller's contract; `value` is `size_of::<T>()` readable bytes.
    unsafe {
        result::set_matmul_desc_attribute(
            desc,
            attribute,
            (value as *const T).cast(),
            std::mem::size_of::<T>(),
        )
    }
}

fn destroy(plan: Plan) {
    for layout in plan.layouts {
        if !layout.is_null() {
            // SAFETY: created by this plan, destroyed once.
            let _ = unsafe { result::destroy_matrix_layout(layout) };
        }
    }
    // SAFETY: as above.
    let _ = unsafe { result::destroy_matmul_desc(plan.desc) };
}

impl Drop for Gemm {
    fn drop(&mut self) {
        let (plans, _) = &mut *self.plans.lock().expect("gemm plans");
        for plan in plans.drain().filter_map(|(_, plan)| plan) {
            destroy(plan);
        }
        // SAFETY: created in `new`, destroyed once; no plan is left.
        let _ = unsafe { result::destroy_handle(self.handle) };
    }
}
