//! Launching `ops.cu`'s and `attention.cu`'s kernels: the modules compiled
//! for the device's architecture and loaded once, each kernel looked up
//! once (those with over 48 KiB of dynamic shared memory opted in then),
//! and one launcher per op that takes device addresses and element counts.
//!
//! Launchers enqueue on the stream they are given and return: no
//! synchronization, no allocation. Sizes are checked against the grid's
//! limits here; that the addresses hold as many elements as the counts
//! say is the caller's contract (the backend derives both from one view).

use std::sync::Arc;

use cudarc::driver::safe::{CudaContext, CudaFunction, CudaStream, LaunchConfig, PushKernelArg};
use cudarc::driver::{DeviceRepr, sys};
use cudarc::nvrtc::Ptx;
use strata_device::{DeviceError, Dtype};
use strata_optim::AdamCoefficients;

use super::{
    ATTENTION_NAME, ATTENTION_SOURCE, BLOCK, FLASH_HEAD_DIMS, FLASH_PER_HEAD_DIM, OPS_NAME,
    OPS_PER_DTYPE, OPS_SINGLE, OPS_SOURCE, flash_shared_bytes, nvrtc,
};
use crate::error::{KernelError, Result};

/// An op of `ops.cu` defined for f32 and bf16 elements, in
/// [`OPS_PER_DTYPE`] order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[allow(missing_docs)]
pub enum Op {
    Gelu,
    GeluBackward,
    Add,
    Axpy,
    Scale,
    AddBias,
    BiasGrad,
    LayerNorm,
    LayerNormBackwardDx,
    LayerNormBackwardParams,
    CrossEntropy,
    Embedding,
    EmbeddingBackward,
    RmsNorm,
    RmsNormBackwardDx,
    RmsNormBackwardGamma,
    Rotary,
    Swiglu,
    SwigluBackward,
    SumSquaresPartials,
    NonFinite,
    AttentionForward,
    AttentionBackwardDq,
    AttentionBackwardDkv,
}

/// A kernel of `ops.cu` defined once, in [`OPS_SINGLE`] order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[allow(missing_docs)]
pub enum Single {
    CastF32Bf16,
    CastBf16F32,
    SumPartials,
    MeanF32,
    AdamwBf16,
}

/// Blocks of the first pass of a sum of squares (`ops.cu`'s SUM_BLOCKS).
pub const SUM_BLOCKS: u32 = 256;

/// The most blocks an element-wise launch uses, per multiprocessor (grid-
/// stride loops cover the rest).
const BLOCKS_PER_SM: u32 = 8;

/// The largest head the attention kernels take (`ops.cu`'s HEAD_DIM_MAX).
pub const HEAD_DIM_MAX: usize = 128;

/// Query (or key) rows per block of the attention kernels (ATTN_ROWS).
const ATTN_ROWS: u32 = 64;

/// Query rows (and keys) per block of the tensor-core attention
/// (`attention.cu`'s FLASH_ROWS, FLASH_KEYS).
pub const FLASH_ROWS: usize = 64;

/// Threads per block of the tensor-core attention (FLASH_THREADS).
const FLASH_THREADS: u32 = 128;

/// The attention's shape as the kernels take it (`ops.cu`'s `AttnShape`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct AttnShape {
    batch: u64,
    seq: u64,
    heads: u64,
    kv_heads: u64,
    head_dim: u64,
}

// SAFETY: a #[repr(C)] struct of five u64, as the kernel's struct.
unsafe impl DeviceRepr for AttnShape {}

/// `strata_optim`'s Adam constants as the kernel takes them (`ops.cu`'s
/// `AdamCoefficients`: nine floats).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct AdamArgs([f32; 9]);

// SAFETY: a #[repr(C)] array of f32, laid out as the kernel's struct of
// nine floats; any bits are a valid value.
unsafe impl DeviceRepr for AdamArgs {}

/// `ops.cu` loaded into one context.
pub struct Ops {
    per_dtype: Vec<[CudaFunction; 2]>,
    single: Vec<CudaFunction>,
    /// `attention.cu`'s forward, dq and dkv per [`FLASH_HEAD_DIMS`] entry.
    flash: Vec<[CudaFunction; 3]>,
    flash_dsum: CudaFunction,
    /// False when `STRATA_FLASH_ATTENTION=0` was set at load: every
    /// attention takes the CUDA-core kernels (to tell a tensor-core fault
    /// from another).
    flash_enabled: bool,
    multiprocessors: u32,
}

fn driver(op: &'static str) -> impl Fn(cudarc::driver::DriverError) -> KernelError {
    move |err| {
        KernelError::Failed(DeviceError::Cuda {
            op,
            cause: format!("{err:?}"),
        })
    }
}

impl Ops {
    /// Compiles `ops.cu` for the context's device (or takes this process's
    /// earlier compile) and loads every kernel.
    pub fn load(context: &Arc<CudaContext>) -> Result<Ops> {
        let attribute = |a| context.attribute(a).map_err(driver("cuDeviceGetAttribute"));
        let major =
            attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
        let minor =
            attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
        let multiprocessors =
            attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
        let arch = (major * 10 + minor) as u32;
        let function = module(context, OPS_NAME, OPS_SOURCE, arch)?;
        let per_dtype = OPS_PER_DTYPE
            .iter()
            .map(|op| {
                Ok([
                    function(&format!("{op}_f32"))?,
                    function(&format!("{op}_bf16"))?,
                ])
            })
            .collect::<Result<Vec<_>>>()?;
        let single = OPS_SINGLE
            .iter()
            .map(|name| function(name))
            .collect::<Result<Vec<_>>>()?;
        let function = module(context, ATTENTION_NAME, ATTENTION_SOURCE, arch)?;
        let flash = FLASH_HEAD_DIMS
            .iter()
            .map(|&d| {
                let kernels = FLASH_PER_HEAD_DIM.map(|k| (k, function(&format!("{k}_d{d}"))));
                let [forward, dq, dkv] = kernels.map(|(name, f)| {
                    let f = f?;
                    // Past 48 KiB a kernel must opt in to its dynamic
                    // shared memory before it is launched.
                    f.set_attribute(
                        sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                        flash_shared_bytes(name, d) as i32,
                    )
                    .map_err(driver("cuFuncSetAttribute"))?;
                    Ok::<_, KernelError>(f)
                });
                Ok([forward?, dq?, dkv?])
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Ops {
            per_dtype,
            single,
            flash,
            flash_dsum: function("flash_dsum")?,
            flash_enabled: std::env::var_os("STRATA_FLASH_ATTENTION").is_none_or(|v| v != "0"),
            multiprocessors: multiprocessors.max(1) as u32,
        })
    }

    fn kernel(&self, op: &'static str, which: Op, dtype: Dtype) -> Result<&CudaFunction> {
        let column = match dtype {
            Dtype::F32 => 0,
            Dtype::Bf16 => 1,
            other => {
                return Err(KernelError::Dtype {
                    op,
                    backend: "cuda",
                    operand: "its tensors",
                    dtype: other,
                    fix: "use f32 or bf16",
                });
            }
        };
        Ok(&self.per_dtype[which as usize][column])
    }

    /// A grid-stride launch over `n` items: enough blocks to fill the
    /// device, no more.
    fn spread(&self, n: u64) -> LaunchConfig {
        let wanted = n.div_ceil(u64::from(BLOCK)).max(1);
        let blocks = wanted.min(u64::from(self.multiprocessors * BLOCKS_PER_SM)) as u32;
        LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    /// One block per row (grid-stride over rows beyond the grid).
    fn per_row(&self, rows: u64) -> LaunchConfig {
        let blocks = rows.clamp(1, u64::from(self.multiprocessors * 32)) as u32;
        LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    fn one_block() -> LaunchConfig {
        LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: 0,
        }
    }
}

/// `source` compiled for `arch` (or this process's earlier compile) and
/// loaded into `context`: its kernels by name.
fn module(
    context: &Arc<CudaContext>,
    name: &'static str,
    source: &str,
    arch: u32,
) -> Result<impl Fn(&str) -> Result<CudaFunction>> {
    let cubin = nvrtc::compile(name, source, arch)?;
    let module = context
        .load_module(Ptx::from_binary(cubin.image.clone()))
        .map_err(driver("cuModuleLoadData"))?;
    Ok(move |kernel: &str| {
        module
            .load_function(kernel)
            .map_err(driver("cuModuleGetFunction"))
    })
}

/// Enqueues `function` with `args` (each a `&T: DeviceRepr`).
macro_rules! launch {
    ($stream:expr, $function:expr, $config:expr, $op:literal, [$($arg:expr),* $(,)?]) => {{
        let mut builder = $stream.launch_builder($function);
        $(builder.arg($arg);)*
        // SAFETY: the kernel's parameters are, in order, the types pushed here (ops.cu's signature); the addresses are the caller's contract (see the launcher's `# Safety`).
        unsafe { builder.launch($config) }
            .map(drop)
            .map_err(driver($op))
    }};
}

impl Ops {
    /// `out = gelu(x)`, `n` elements of `dtype`.
    ///
    /// # Safety
    /// `x` and `out` are device addresses in the stream's context holding
    /// `n` elements of `dtype` each, live until the stream passes this
    /// launch; `out` is not read or written by other work meanwhile.
    pub unsafe fn gelu(
        &self,
        stream: &CudaStream,
        dtype: Dtype,
        x: u64,
        out: u64,
        n: u64,
    ) -> Result<()> {
        let f = self.kernel("gelu", Op::Gelu, dtype)?;
        launch!(stream, f, self.spread(n), "gelu", [&x, &out, &n])
    }

    /// `dx = dout * gelu'(x)`.
    ///
    /// # Safety
    /// As [`Ops::gelu`], for `dout`, `x` and `dx`.
    pub unsafe fn gelu_backward(
        &self,
        stream: &CudaStream,
        dtype: Dtype,
        (dout, x, dx): (u64, u64, u64),
        n: u64,
    ) -> Result<()> {
        let f = self.kernel("gelu_backward", Op::GeluBackward, dtype)?;
        launch!(
            stream,
            f,
            self.spread(n),
            "gelu_backward",
            [&dout, &x, &dx, &n]
        )
    }

    /// `y += alpha * x` (`alpha` 1: `y += x`).
    ///
    /// # Safety
    /// As [`Ops::gelu`], for `x` and `y`.
    pub unsafe fn axpy(
        &self,
        stream: &CudaStream,
        dtype: Dtype,
        alpha: f32,
        x: u64,
        y: u64,
        n: u64,
    ) -> Result<()> {
        if alpha == 1.0 {
            let f = self.kernel("add", Op::Add, dtype)?;
            return launch!(stream, f, self.spread(n), "add", [&y, &x, &n]);
        }
        let f = self.kernel("axpy", Op::Axpy, dtype)?;
        launch!(stream, f, self.spread(n), "axpy", [&alpha, &x, &y, &n])
    }

    /// `x *= alpha`.
    ///
    /// # Safety
    /// As [`Ops::gelu`], for `x`.
    pub unsafe fn scale(
        &self,
        stream: &CudaStream,
        dtype: Dtype,
        alpha: f32,
        x: u64,
        n: u64,
    ) -> Result<()> {
        let f = self.kernel("scale", Op::Scale, dtype)?;
        launch!(stream, f, self.spread(n), "scale", [&alpha, &x, &n])
    }

    /// Adds the f32 `bias` (`cols`) to every row of `x` (`rows x cols`).
    ///
    /// # Safety
    /// As [`Ops::gelu`], for `x` (`rows x cols` of `dtype`) and `bias`
    /// (`cols` f32).
    pub unsafe fn add_bias(
        &self,
        stream: &CudaStream,
        dtype: Dtype,
        x: u64,
        bias: u64,
        rows: u64,
        cols: u64,
    ) -> Result<()> {
        let f = self.kernel("add_bias", Op::AddBias, dtype)?;
        let n = checked(rows, cols, "add_bias")?;
        launch!(
            stream,
            f,
            self.spread(n),
            "add_bias",
            [&x, &bias, &rows, &cols]
        )
    }

    /// Adds the column sums of `dy` (`rows x cols`) to the f32 `dbias`.
    ///
    /// # Safety
    /// As [`Ops::add_bias`], `dy` for `x` and `dbias` for `bias`.
    pub unsafe fn bias_grad(
        &self,
        stream: &CudaStream,
        dtype: Dtype,
        dy: u64,
        dbias: u64,
        rows: u64,
        cols: u64,
    ) -> Result<()> {
        let f = self.kernel("bias_grad", Op::BiasGrad, dtype)?;
        checked(rows, cols, "bias_grad")?;
        launch!(
            stream,
            f,
            self.spread(cols),
            "bias_grad",
            [&dy, &dbias, &rows, &cols]
        )
    }

    /// LayerNorm of each row of `x` into `out`; the f32 `saved` (`2 x
    /// rows`) gets each row's mean, then each row's 1/std.
    ///
    /// # Safety
    /// `x` and `out` hold `rows x cols` of `dtype`, `gamma` and `beta`
    /// `cols` f32, `saved` `2 x rows` f32, as in [`Ops::gelu`].
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn layer_norm(
        &self,
        stream: &CudaStream,
        dtype: Dtype,
        (x, gamma, beta, out, saved): (u64, u64, u64, u64, u64),
        rows: u64,
        cols: u64,
        eps: f32,
    ) -> Result<()> {
        let f = self.kernel("layer_norm", Op::LayerNorm, dtype)?;
        checked(rows, cols, "layer_norm")?;
        let rstd = saved + rows * 4;
        launch!(
            stream,
            f,
            self.per_row(rows),
            "layer_norm",
            [&x, &gamma, &beta, &out, &saved, &rstd, &rows, &cols, &eps]
        )
    }

    /// LayerNorm's backward: adds to `dx` (`rows x cols` of `dtype`) and to
    /// the f32 `dgamma_dbeta` (`cols` of dgamma, then `cols` of dbeta).
    ///
    /// # Safety
    /// As [`Ops::layer_norm`]; `dout` and `dx` like `x`, `dgamma_dbeta`
    /// `2 x cols` f32.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn layer_norm_backward(
        &self,
        stream: &CudaStream,
        dtype: Dtype,
        (dout, x, gamma, saved, dx, dgamma_dbeta): (u64, u64, u64, u64, u64, u64),
        rows: u64,
        cols: u64,
    ) -> Result<()> {
        checked(rows, cols, "layer_norm_backward")?;
        let (mean, rstd) = (saved, saved + rows * 4);
        let f = self.kernel("layer_norm_backward", Op::LayerNormBackwardDx, dtype)?;
        launch!(
            stream,
            f,
            self.per_row(rows),
            "layer_norm_backward",
            [&dout, &x, &gamma, &mean, &rstd, &dx, &rows, &cols]
        )?;
        let f = self.kernel("layer_norm_backward", Op::LayerNormBackwardParams, dtype)?;
        let dbeta = dgamma_dbeta + cols * 4;
        launch!(
            stream,
            f,
            self.spread(cols),
            "layer_norm_backward",
            [&dout, &x, &mean, &rstd, &dgamma_dbeta, &dbeta, &rows, &cols]
        )
    }

    /// Softmax cross-entropy of each row of `logits` (`rows x vocab`)
    /// against the u32 `targets`: the gradient of the mean loss times
    /// `grad_scale` into `dlogits`, each row's loss into the f32
    /// `row_loss`, then their mean into the f64 at `mean`. A target outside
    /// the vocabulary writes its row + 1 to the u64 at `bad` (zero it
    /// first).
    ///
    /// # Safety
    /// `logits` and `dlogits` hold `rows x vocab` of `dtype`, `targets`
    /// `rows` u32, `row_loss` `rows` f32, `mean` one f64, `bad` one u64, as
    /// in [`Ops::gelu`].
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn cross_entropy(
        &self,
        stream: &CudaStream,
        dtype: Dtype,
        (logits, targets, dlogits, row_loss, mean, bad): (u64, u64, u64, u64, u64, u64),
        rows: u64,
        vocab: u64,
        grad_scale: f32,
    ) -> Result<()> {
        checked(rows, vocab, "cross_entropy")?;
        let f = self.kernel("cross_entropy", Op::CrossEntropy, dtype)?;
        launch!(
            stream,
            f,
            self.per_row(rows),
            "cross_entropy",
            [
                &logits,
                &targets,
                &rows,
                &vocab,
                &grad_scale,
                &dlogits,
                &row_loss,
                &bad
            ]
        )?;
        let f = &self.single[Single::MeanF32 as usize];
        launch!(
            stream,
            f,
            Self::one_block(),
            "cross_entropy",
            [&row_loss, &rows, &mean]
        )
    }

    /// `out[i] = table[tokens[i]] + positions[p]`, rows of `hidden`
    /// (`table` and `positions` f32, `out` of `dtype`), `p` the row's
    /// position id (`ids`), or `i % seq` where `ids` is 0; a `positions` of
    /// 0 adds nothing. A token outside the vocabulary (or an id past the
    /// position table) writes its row + 1 to the u64 at `bad`.
    ///
    /// # Safety
    /// `table` holds `vocab x hidden` f32, `positions` `seq x hidden` f32
    /// (or is 0), `tokens` `count` u32, `ids` `count` u32 (or is 0), `out`
    /// `count x hidden` of `dtype`, `bad` one u64, as in [`Ops::gelu`].
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn embedding(
        &self,
        stream: &CudaStream,
        dtype: Dtype,
        (table, positions, tokens, ids, out, bad): (u64, u64, u64, u64, u64, u64),
        count: u64,
        seq: u64,
        hidden: u64,
        vocab: u64,
    ) -> Result<()> {
        let n = checked(count, hidden, "embedding")?;
        checked(vocab, hidden, "embedding")?;
        let f = self.kernel("embedding", Op::Embedding, dtype)?;
        launch!(
            stream,
            f,
            self.spread(n),
            "embedding",
            [
                &table, &positions, &tokens, &ids, &count, &seq, &hidden, &vocab, &out, &bad
            ]
        )
    }

    /// The embedding's backward: adds each row of `dout` to the f32 rows of
    /// `dtable` and `dpositions` (none where 0) it came from, in token
    /// order.
    ///
    /// # Safety
    /// As [`Ops::embedding`], `dout` for `out`, `dtable` for `table`,
    /// `dpositions` for `positions`.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn embedding_backward(
        &self,
        stream: &CudaStream,
        dtype: Dtype,
        (tokens, ids, dout, dtable, dpositions): (u64, u64, u64, u64, u64),
        count: u64,
        seq: u64,
        hidden: u64,
        vocab: u64,
    ) -> Result<()> {
        checked(count, hidden, "embedding_backward")?;
        checked(vocab, hidden, "embedding_backward")?;
        let f = self.kernel("embedding_backward", Op::EmbeddingBackward, dtype)?;
        launch!(
            stream,
            f,
            self.spread(hidden),
            "embedding_backward",
            [
                &tokens,
                &ids,
                &count,
                &seq,
                &hidden,
                &vocab,
                &dout,
                &dtable,
                &dpositions
            ]
        )
    }

    /// RMSNorm of each row of `x` into `out`: `gamma * x / sqrt(mean(x^2) +
    /// eps)`, each row's 1/rms into the f32 `rstd` (`rows`).
    ///
    /// # Safety
    /// `x` and `out` hold `rows x cols` of `dtype`, `gamma` `cols` f32,
    /// `rstd` `rows` f32, as in [`Ops::gelu`].
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn rms_norm(
        &self,
        stream: &CudaStream,
        dtype: Dtype,
        (x, gamma, out, rstd): (u64, u64, u64, u64),
        rows: u64,
        cols: u64,
        eps: f32,
    ) -> Result<()> {
        checked(rows, cols, "rms_norm")?;
        let f = self.kernel("rms_norm", Op::RmsNorm, dtype)?;
        launch!(
            stream,
            f,
            self.per_row(rows),
            "rms_norm",
            [&x, &gamma, &out, &rstd, &rows, &cols, &eps]
        )
    }

    /// RMSNorm's backward: adds to `dx` (`rows x cols` of `dtype`) and to
    /// the f32 `dgamma` (`cols`, summed over rows in order).
    ///
    /// # Safety
    /// As [`Ops::rms_norm`]; `dout` and `dx` like `x`, `dgamma` like
    /// `gamma`.
    pub unsafe fn rms_norm_backward(
        &self,
        stream: &CudaStream,
        dtype: Dtype,
        (dout, x, gamma, rstd, dx, dgamma): (u64, u64, u64, u64, u64, u64),
        rows: u64,
        cols: u64,
    ) -> Result<()> {
        checked(rows, cols, "rms_norm_backward")?;
        let f = self.kernel("rms_norm_backward", Op::RmsNormBackwardDx, dtype)?;
        launch!(
            stream,
            f,
            self.per_row(rows),
            "rms_norm_backward",
            [&dout, &x, &gamma, &rstd, &dx, &rows, &cols]
        )?;
        let f = self.kernel("rms_norm_backward", Op::RmsNormBackwardGamma, dtype)?;
        launch!(
            stream,
            f,
            self.spread(cols),
            "rms_norm_backward",
            [&dout, &x, &rstd, &dgamma, &rows, &cols]
        )
    }

    /// Rotary position embeddings in place on the query and key heads of
    /// `qkv` (`shape.rows() x shape.qkv_width()` of `dtype`): in each head,
    /// element `k` and `k + head_dim / 2` turn by `position x inv_freq[k]`
    /// (back where `inverse`), the position the row's u32 id in `ids`, or
    /// its place in its sequence where `ids` is 0.
    ///
    /// # Safety
    /// `qkv` holds those elements, `inv_freq` `head_dim / 2` f32, `ids`
    /// `shape.rows()` u32 (or is 0), as in [`Ops::gelu`].
    pub unsafe fn rotary(
        &self,
        stream: &CudaStream,
        dtype: Dtype,
        shape: crate::Attention,
        (qkv, ids, inv_freq): (u64, u64, u64),
        inverse: bool,
    ) -> Result<()> {
        let (rows, seq) = (shape.rows() as u64, shape.seq as u64);
        let width = shape.qkv_width() as u64;
        let turned = (shape.heads + shape.kv_heads) as u64;
        let half = (shape.head_dim / 2) as u64;
        let n = checked(checked(rows, turned, "rotary")?, half, "rotary")?;
        let sign: f32 = if inverse { -1.0 } else { 1.0 };
        let f = self.kernel("rotary", Op::Rotary, dtype)?;
        launch!(
            stream,
            f,
            self.spread(n),
            "rotary",
            [
                &qkv, &ids, &inv_freq, &rows, &seq, &width, &turned, &half, &sign
            ]
        )
    }

    /// SwiGLU: `out` (`rows x f`) = silu(gate) * up, `gate_up` (`rows x 2
    /// f`) each row's gate then its up projection.
    ///
    /// # Safety
    /// The addresses hold those sizes of `dtype`, as in [`Ops::gelu`].
    pub unsafe fn swiglu(
        &self,
        stream: &CudaStream,
        dtype: Dtype,
        (gate_up, out): (u64, u64),
        rows: u64,
        f: u64,
    ) -> Result<()> {
        // The gate and up halves: `2 n` elements read.
        let n = checked(rows, f, "swiglu")?;
        checked(n, 2, "swiglu")?;
        let kernel = self.kernel("swiglu", Op::Swiglu, dtype)?;
        launch!(
            stream,
            kernel,
            self.spread(n),
            "swiglu",
            [&gate_up, &out, &rows, &f]
        )
    }

    /// SwiGLU's backward: `dgate_up` (like `gate_up`) from `dout` (like
    /// `out`).
    ///
    /// # Safety
    /// As [`Ops::swiglu`].
    pub unsafe fn swiglu_backward(
        &self,
        stream: &CudaStream,
        dtype: Dtype,
        (dout, gate_up, dgate_up): (u64, u64, u64),
        rows: u64,
        f: u64,
    ) -> Result<()> {
        let n = checked(rows, f, "swiglu_backward")?;
        checked(n, 2, "swiglu_backward")?;
        let kernel = self.kernel("swiglu_backward", Op::SwigluBackward, dtype)?;
        launch!(
            stream,
            kernel,
            self.spread(n),
            "swiglu_backward",
            [&dout, &gate_up, &dgate_up, &rows, &f]
        )
    }

    /// The sum of squares of `x` into the f64 at `out`, through `partials`
    /// ([`SUM_BLOCKS`] f64 of scratch), in a fixed order.
    ///
    /// # Safety
    /// `x` holds `n` of `dtype`, `partials` [`SUM_BLOCKS`] f64, `out` one
    /// f64, as in [`Ops::gelu`].
    pub unsafe fn sum_squares(
        &self,
        stream: &CudaStream,
        dtype: Dtype,
        x: u64,
        n: u64,
        partials: u64,
        out: u64,
    ) -> Result<()> {
        let f = self.kernel("sum_squares", Op::SumSquaresPartials, dtype)?;
        let config = LaunchConfig {
            grid_dim: (SUM_BLOCKS, 1, 1),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        launch!(stream, f, config, "sum_squares", [&x, &n, &partials])?;
        let f = &self.single[Single::SumPartials as usize];
        launch!(
            stream,
            f,
            Self::one_block(),
            "sum_squares",
            [&partials, &SUM_BLOCKS, &out]
        )
    }

    /// Sets the u32 at `flag` to 1 if `x` holds an infinity or a NaN (zero
    /// it first).
    ///
    /// # Safety
    /// `x` holds `n` of `dtype`, `flag` one u32, as in [`Ops::gelu`].
    pub unsafe fn non_finite(
        &self,
        stream: &CudaStream,
        dtype: Dtype,
        x: u64,
        n: u64,
        flag: u64,
    ) -> Result<()> {
        let f = self.kernel("non_finite", Op::NonFinite, dtype)?;
        launch!(stream, f, self.spread(n), "non_finite", [&x, &n, &flag])
    }

    /// Converts `n` elements between f32 and bf16 (round to nearest even).
    ///
    /// # Safety
    /// `x` holds `n` of `from`, `y` `n` of `to`, as in [`Ops::gelu`].
    pub unsafe fn cast(
        &self,
        stream: &CudaStream,
        (from, to): (Dtype, Dtype),
        x: u64,
        y: u64,
        n: u64,
    ) -> Result<()> {
        let which = match (from, to) {
            (Dtype::F32, Dtype::Bf16) => Single::CastF32Bf16,
            (Dtype::Bf16, Dtype::F32) => Single::CastBf16F32,
            _ => {
                return Err(KernelError::Dtype {
                    op: "cast",
                    backend: "cuda",
                    operand: "x",
                    dtype: from,
                    fix: "cast between f32 and bf16 (a copy for the same dtype)",
                });
            }
        };
        let f = &self.single[which as usize];
        launch!(stream, f, self.spread(n), "cast", [&x, &y, &n])
    }

    /// One AdamW step over `n` states resident on the device: the f32
    /// `grad` in, f32 `master`, `m`, `v` updated in place, their bf16 copy
    /// to `param`.
    ///
    /// # Safety
    /// `grad`, `master`, `m`, `v` hold `n` f32 and `param` `n` bf16, as in
    /// [`Ops::gelu`].
    pub unsafe fn adamw(
        &self,
        stream: &CudaStream,
        coefficients: &AdamCoefficients,
        (grad, master, m, v, param): (u64, u64, u64, u64, u64),
        n: u64,
    ) -> Result<()> {
        let k = AdamArgs(coefficients.to_array());
        let f = &self.single[Single::AdamwBf16 as usize];
        launch!(
            stream,
            f,
            self.spread(n),
            "adamw",
            [&k, &grad, &master, &m, &v, &param, &n]
        )
    }
}

impl Ops {
    /// The attention's shape and grid (a block per `ATTN_ROWS` rows of each
    /// query head), checked against the kernels' limits.
    fn attention_grid(
        op: &'static str,
        shape: crate::Attention,
    ) -> Result<(AttnShape, LaunchConfig)> {
        let limit = |what: &'static str, value: usize, max: usize| match value <= max && value > 0 {
            true => Ok(()),
            false => Err(KernelError::Index {
                op,
                what,
                value: value as u64,
                max: max as u64,
            }),
        };
        limit("head_dim", shape.head_dim, HEAD_DIM_MAX)?;
        limit("heads", shape.heads, 65_535)?;
        limit("kv_heads", shape.kv_heads, shape.heads)?;
        if !shape.heads.is_multiple_of(shape.kv_heads) {
            return Err(KernelError::Index {
                op,
                what: "kv_heads (a divisor of the query heads)",
                value: shape.kv_heads as u64,
                max: shape.heads as u64,
            });
        }
        limit("batch", shape.batch, 65_535)?;
        limit("seq", shape.seq, (u32::MAX as usize) * ATTN_ROWS as usize)?;
        let config = LaunchConfig {
            grid_dim: (
                shape.seq.div_ceil(ATTN_ROWS as usize) as u32,
                shape.heads as u32,
                shape.batch as u32,
            ),
            block_dim: (ATTN_ROWS, 1, 1),
            shared_mem_bytes: 0,
        };
        let args = AttnShape {
            batch: shape.batch as u64,
            seq: shape.seq as u64,
            heads: shape.heads as u64,
            kv_heads: shape.kv_heads as u64,
            head_dim: shape.head_dim as u64,
        };
        Ok((args, config))
    }

    /// A grid of [`Ops::attention_grid`]'s with a block per key/value head
    /// rather than per query head: the key side of the backward, which sums
    /// a key/value head's query heads in order.
    fn per_kv_head(config: &LaunchConfig, shape: crate::Attention) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (config.grid_dim.0, shape.kv_heads as u32, config.grid_dim.2),
            ..*config
        }
    }

    /// Causal attention over `qkv` (`rows x qkv_width` of `dtype`) into
    /// `out` (`rows x hidden`), each row's log-sum-exp into the f32 `lse`
    /// (`batch x heads x seq`, what the backward needs). Grouped-query heads
    /// read their key/value head in place. With `ids` (u32 position ids,
    /// one per row; 0: none) row `t` sees the keys from `t - ids[t]` to
    /// itself: no attention across the documents packed into a sequence.
    ///
    /// # Safety
    /// The addresses hold those sizes, as in [`Ops::gelu`]; each id is at
    /// most its row's place in its sequence (a larger one is taken as that
    /// place).
    pub unsafe fn attention(
        &self,
        stream: &CudaStream,
        dtype: Dtype,
        shape: crate::Attention,
        (qkv, ids, out, lse): (u64, u64, u64, u64),
    ) -> Result<()> {
        let (args, config) = Self::attention_grid("attention", shape)?;
        if let Some(flash) = self.flash_for(dtype, shape, &[qkv, out]) {
            let config = Self::flash_config(&config, "flash_forward", shape);
            let f = &flash[0];
            return launch!(
                stream,
                f,
                config,
                "attention",
                [&args, &ids, &qkv, &out, &lse]
            );
        }
        let f = self.kernel("attention", Op::AttentionForward, dtype)?;
        launch!(
            stream,
            f,
            config,
            "attention",
            [&args, &ids, &qkv, &out, &lse]
        )
    }

    /// Whether [`Ops::attention`] and [`Ops::attention_backward`] run this
    /// attention on tensor cores (`attention.cu`) with these addresses.
    pub fn attention_on_tensor_cores(
        &self,
        dtype: Dtype,
        shape: crate::Attention,
        addresses: &[u64],
    ) -> bool {
        self.flash_for(dtype, shape, addresses).is_some()
    }

    /// The tensor-core kernels for this attention, when they take it: bf16,
    /// a head dim they are built for, every address 16-byte aligned (their
    /// copies move 16 bytes), and not turned off.
    fn flash_for(
        &self,
        dtype: Dtype,
        shape: crate::Attention,
        addresses: &[u64],
    ) -> Option<&[CudaFunction; 3]> {
        let at = FLASH_HEAD_DIMS.iter().position(|&d| d == shape.head_dim)?;
        let aligned = addresses.iter().all(|a| a % 16 == 0);
        (self.flash_enabled && dtype == Dtype::Bf16 && aligned).then(|| &self.flash[at])
    }

    /// The CUDA-core attention's grid, as the tensor-core kernels take it:
    /// FLASH_THREADS threads and `kernel`'s dynamic shared memory.
    fn flash_config(config: &LaunchConfig, kernel: &str, shape: crate::Attention) -> LaunchConfig {
        const _: () = assert!(FLASH_ROWS == ATTN_ROWS as usize);
        LaunchConfig {
            grid_dim: config.grid_dim,
            block_dim: (FLASH_THREADS, 1, 1),
            shared_mem_bytes: flash_shared_bytes(kernel, shape.head_dim),
        }
    }

    /// Attention's backward: `dqkv` (like `qkv`) from `dout` (like `out`),
    /// with the forward's `ids`, `out` and `lse` and `dsum` (`batch x heads
    /// x seq` f32) of scratch.
    ///
    /// # Safety
    /// As [`Ops::attention`]; `dsum` holds `batch x heads x seq` f32.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn attention_backward(
        &self,
        stream: &CudaStream,
        dtype: Dtype,
        shape: crate::Attention,
        (qkv, ids, out, lse, dout, dqkv, dsum): (u64, u64, u64, u64, u64, u64, u64),
    ) -> Result<()> {
        let (args, config) = Self::attention_grid("attention_backward", shape)?;
        if let Some(flash) = self.flash_for(dtype, shape, &[qkv, out, dout, dqkv]) {
            // D = rowsum(dout * out) first, one warp per (row, head).
            let rows = checked(
                shape.rows() as u64,
                shape.heads as u64,
                "attention_backward",
            )?;
            let warps_per_block = u64::from(BLOCK / 32);
            let blocks = rows
                .div_ceil(warps_per_block)
                .min(u64::from(self.multiprocessors * BLOCKS_PER_SM * 4))
                as u32;
            let dsum_config = LaunchConfig {
                grid_dim: (blocks.max(1), 1, 1),
                block_dim: (BLOCK, 1, 1),
                shared_mem_bytes: 0,
            };
            let f = &self.flash_dsum;
            launch!(
                stream,
                f,
                dsum_config,
                "attention_backward",
                [&args, &out, &dout, &dsum]
            )?;
            // dq per query head, then dk and dv per key/value head.
            let grids = [config, Self::per_kv_head(&config, shape)];
            for ((f, kernel), grid) in flash[1..].iter().zip(&FLASH_PER_HEAD_DIM[1..]).zip(grids) {
                let config = Self::flash_config(&grid, kernel, shape);
                launch!(
                    stream,
                    f,
                    config,
                    "attention_backward",
                    [&args, &ids, &qkv, &dout, &lse, &dsum, &dqkv]
                )?;
            }
            return Ok(());
        }
        let f = self.kernel("attention_backward", Op::AttentionBackwardDq, dtype)?;
        launch!(
            stream,
            f,
            config,
            "attention_backward",
            [&args, &ids, &qkv, &lse, &dout, &dqkv, &dsum]
        )?;
        let f = self.kernel("attention_backward", Op::AttentionBackwardDkv, dtype)?;
        launch!(
            stream,
            f,
            Self::per_kv_head(&config, shape),
            "attention_backward",
            [&args, &ids, &qkv, &lse, &dout, &dsum, &dqkv]
        )
    }
}

/// `a x b`, or the index error naming the op.
fn checked(a: u64, b: u64, op: &'static str) -> Result<u64> {
    a.checked_mul(b).ok_or(KernelError::Index {
        op,
        what: "elements",
        value: u64::MAX,
        max: u64::MAX,
    })
}
