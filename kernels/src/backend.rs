//! The [`Backend`] trait: the ops a transformer step needs, at op
//! granularity, over `strata_device` views.
//!
//! Ops are enqueued on the backend's one compute stream and return once
//! enqueued; their errors surface at the next fence ([`Backend::record`]).
//! A buffer's next user waits for the fence of its last use: a copy stream
//! ([`Backend::wait`] makes the compute stream wait, not the host). On the
//! CPU backend every op runs on the calling thread before it returns, so
//! fences are already passed and the numbers are those of the free
//! functions in [`crate::cpu`], bit for bit.
//!
//! No reduction uses atomics: a backend's results are the same bits run to
//! run. What an op saves for its backward is opaque to the caller; the
//! backend says how many elements it needs ([`Backend::attention_saved_elems`]),
//! so the planner can count them.

use strata_device::{Buffer, DeviceKind, Dtype, Fence, View, ViewMut};
use strata_optim::AdamCoefficients;

use crate::error::Result;

/// A GEMM operand: a `rows x cols` view, used as itself or transposed.
#[derive(Clone, Copy, Debug)]
pub struct Matrix<'a> {
    /// The stored matrix (row-major, any row stride).
    pub view: View<'a>,
    /// Use its transpose.
    pub transposed: bool,
}

impl<'a> Matrix<'a> {
    /// The view as stored.
    pub fn n(view: View<'a>) -> Matrix<'a> {
        Matrix {
            view,
            transposed: false,
        }
    }

    /// The view's transpose.
    pub fn t(view: View<'a>) -> Matrix<'a> {
        Matrix {
            view,
            transposed: true,
        }
    }

    /// Rows and columns as used in the product.
    pub fn shape(&self) -> (usize, usize) {
        let raw = self.view.raw();
        if self.transposed {
            (raw.cols, raw.rows)
        } else {
            (raw.rows, raw.cols)
        }
    }
}

/// The shape of a causal self-attention over packed `q | k | v` rows:
/// `heads` query heads, then `kv_heads` key heads and as many value heads
/// (grouped-query attention when fewer: query head `i` reads key/value
/// head `i / (heads / kv_heads)`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Attention {
    /// Sequences.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// Query heads.
    pub heads: usize,
    /// Key and value heads; divides `heads` (equal to it: multi-head
    /// attention).
    pub kv_heads: usize,
    /// Elements per head.
    pub head_dim: usize,
}

impl Attention {
    /// Multi-head attention: as many key/value heads as query heads.
    pub fn mha(batch: usize, seq: usize, heads: usize, head_dim: usize) -> Attention {
        Attention {
            batch,
            seq,
            heads,
            kv_heads: heads,
            head_dim,
        }
    }

    /// Hidden width (`heads x head_dim`): the queries', and the output's.
    pub fn hidden(&self) -> usize {
        self.heads * self.head_dim
    }

    /// Width of the keys (and of the values): `kv_heads x head_dim`.
    pub fn kv_hidden(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// Width of a packed `q | k | v` row.
    pub fn qkv_width(&self) -> usize {
        self.hidden() + 2 * self.kv_hidden()
    }

    /// Query heads per key/value head.
    pub fn group(&self) -> usize {
        self.heads / self.kv_heads.max(1)
    }

    /// Token rows (`batch x seq`).
    pub fn rows(&self) -> usize {
        self.batch * self.seq
    }
}

/// Position ids for ops that take them when every row's position is its
/// place in its sequence (no documents packed): an empty view.
pub fn no_position_ids() -> View<'static> {
    View::host_slice::<u32>(&[])
}

/// The target of a row that is not a loss target ([`Backend::cross_entropy`]):
/// transformers' label -100, a prompt token in supervised fine-tuning.
pub const IGNORE_TARGET: u32 = u32::MAX;

/// A scalar computed on the device, readable once its fence passes
/// (a loss, a norm), without synchronizing the whole device.
pub struct Readback {
    fence: Fence,
    value: Value,
}

enum Value {
    Ready(f64),
    /// In slot `slot` of a backend's host-visible readback slots, once the
    /// fence has passed.
    Slot(std::sync::Arc<dyn ReadbackSlots>, usize),
    /// A weighted sum of other readbacks (a loss taken in chunks).
    Sum(Vec<(Readback, f64)>),
}

/// Where a backend's readbacks land: host-visible slots, each read once
/// after its fence and then given back (no allocation per readback).
pub trait ReadbackSlots: Send + Sync {
    /// The value in `slot` (its fence has passed), or the error it holds
    /// (a token outside the vocabulary, found on the device).
    fn read(&self, slot: usize) -> Result<f64>;

    /// Gives `slot` back.
    fn release(&self, slot: usize);
}

impl std::fmt::Debug for Readback {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.value {
            Value::Ready(value) => write!(f, "Readback({value})"),
            Value::Slot(_, slot) => write!(f, "Readback(slot {slot})"),
            Value::Sum(parts) => write!(f, "Readback(sum of {})", parts.len()),
        }
    }
}

impl Readback {
    /// A value already on the host.
    pub fn ready(value: f64) -> Readback {
        Readback {
            fence: Fence::ready(),
            value: Value::Ready(value),
        }
    }

    /// A value that lands in `slot` of `slots` once `fence` passes.
    pub fn pending(
        fence: Fence,
        slots: std::sync::Arc<dyn ReadbackSlots>,
        slot: usize,
    ) -> Readback {
        Readback {
            fence,
            value: Value::Slot(slots, slot),
        }
    }

    /// `sum(weight x value)` of `parts`, readable once each part is (the
    /// mean of a loss taken in chunks, each weighted by its share).
    pub fn weighted_sum(parts: Vec<(Readback, f64)>) -> Readback {
        Readback {
            fence: Fence::ready(),
            value: Value::Sum(parts),
        }
    }

    /// Waits for the fence and returns the value.
    pub fn get(mut self) -> Result<f64> {
        self.fence.wait()?;
        match &mut self.value {
            Value::Ready(value) => Ok(*value),
            Value::Slot(slots, slot) => slots.read(*slot),
            Value::Sum(parts) => {
                let mut sum = 0.0;
                for (part, weight) in parts.drain(..) {
                    sum += part.get()? * weight;
                }
                Ok(sum)
            }
        }
    }
}

impl Drop for Readback {
    fn drop(&mut self) {
        if let Value::Slot(slots, slot) = &self.value {
            // A slot given back before its copy lands would be overwritten
            // under it: wait (a dropped readback is rare, never per step).
            let _ = self.fence.wait();
            slots.release(*slot);
        }
    }
}

/// Compute on one device. Every op checks its operands' sizes, dtypes and
/// device before it enqueues anything.
pub trait Backend: Send + Sync {
    /// The device the backend computes on.
    fn kind(&self) -> DeviceKind;

    /// A short name for messages ("cpu").
    fn name(&self) -> &'static str;

    /// `len` zeroed elements of `dtype` on the backend's device.
    fn alloc(&self, dtype: Dtype, len: usize) -> Result<Buffer>;

    /// A fence after every op enqueued so far.
    fn record(&self) -> Result<Fence>;

    /// Makes the compute stream wait for `fence` (an upload that must land
    /// before the next op reads it).
    fn wait(&self, fence: &Fence) -> Result<()>;

    /// `c = alpha * a * b + beta * c`; `beta = 1` accumulates (gradients
    /// in fp32).
    fn gemm(
        &self,
        a: Matrix<'_>,
        b: Matrix<'_>,
        alpha: f32,
        beta: f32,
        c: ViewMut<'_>,
    ) -> Result<()>;

    /// Adds `bias` to every row of `x` (`rows x bias.len()`).
    fn add_bias(&self, x: ViewMut<'_>, bias: View<'_>) -> Result<()>;

    /// `c = a b + bias` (the bias added to every row): a linear layer's
    /// forward, one fused GEMM where the backend can; by default
    /// [`Backend::gemm`] then [`Backend::add_bias`].
    fn gemm_bias(
        &self,
        a: Matrix<'_>,
        b: Matrix<'_>,
        bias: View<'_>,
        c: ViewMut<'_>,
    ) -> Result<()> {
        unfused::gemm_bias(self, a, b, bias, c)
    }

    /// `pre = a b + bias`, `out = gelu(pre)`: a linear layer and its GELU,
    /// keeping the pre-activation for the backward; fused where the backend
    /// can. By default [`Backend::gemm_bias`] then [`Backend::gelu`].
    fn gemm_bias_gelu(
        &self,
        a: Matrix<'_>,
        b: Matrix<'_>,
        bias: View<'_>,
        pre: ViewMut<'_>,
        out: ViewMut<'_>,
    ) -> Result<()> {
        unfused::gemm_bias_gelu(self, a, b, bias, pre, out)
    }

    /// `dx = (a b) * gelu'(pre)`: the gradient through a GELU of the
    /// product that feeds it (`pre` the GELU's input); fused where the
    /// backend can, else through `product` (scratch of `dx`'s shape) with
    /// [`Backend::gemm`] then [`Backend::gelu_backward`].
    fn gemm_dgelu(
        &self,
        a: Matrix<'_>,
        b: Matrix<'_>,
        pre: View<'_>,
        product: ViewMut<'_>,
        dx: ViewMut<'_>,
    ) -> Result<()> {
        unfused::gemm_dgelu(self, a, b, pre, product, dx)
    }

    /// Adds the column sums of `dy` (`rows x dbias.len()`) to `dbias`.
    fn bias_grad(&self, dy: View<'_>, dbias: ViewMut<'_>) -> Result<()>;

    /// `y += x`, element-wise (residual connections, accumulation).
    fn add(&self, y: ViewMut<'_>, x: View<'_>) -> Result<()>;

    /// `y += alpha * x`.
    fn axpy(&self, alpha: f32, x: View<'_>, y: ViewMut<'_>) -> Result<()>;

    /// `x *= alpha`.
    fn scale(&self, alpha: f32, x: ViewMut<'_>) -> Result<()>;

    /// Copies `x` into `y` (same dtype and length; device to device).
    fn copy(&self, x: View<'_>, y: ViewMut<'_>) -> Result<()>;

    /// Copies host memory `host` (a CPU view) into `y` on the backend's
    /// device, in stream order with the ops around it: small per-step
    /// inputs (token ids). `host` may change once this returns.
    fn upload(&self, host: View<'_>, y: ViewMut<'_>) -> Result<()>;

    /// Sets every element of `x` to zero.
    fn zero(&self, x: ViewMut<'_>) -> Result<()>;

    /// Converts `x` into `y`'s dtype (round to nearest even when narrowing).
    fn cast(&self, x: View<'_>, y: ViewMut<'_>) -> Result<()>;

    /// LayerNorm of each row of `x` (`rows x gamma.len()`) into `out`;
    /// `saved` (`2 x rows`) keeps each row's mean and 1/std.
    fn layer_norm(
        &self,
        x: View<'_>,
        gamma: View<'_>,
        beta: View<'_>,
        out: ViewMut<'_>,
        saved: ViewMut<'_>,
    ) -> Result<()>;

    /// LayerNorm's backward: adds to `dx`, and to `dgamma_dbeta`
    /// (`gamma.len()` of dgamma then as many of dbeta).
    fn layer_norm_backward(
        &self,
        dout: View<'_>,
        x: View<'_>,
        gamma: View<'_>,
        saved: View<'_>,
        dx: ViewMut<'_>,
        dgamma_dbeta: ViewMut<'_>,
    ) -> Result<()>;

    /// GELU (tanh form) of `x` into `out`.
    fn gelu(&self, x: View<'_>, out: ViewMut<'_>) -> Result<()>;

    /// GELU's backward: `dx = dout * gelu'(x)`.
    fn gelu_backward(&self, dout: View<'_>, x: View<'_>, dx: ViewMut<'_>) -> Result<()>;

    /// RMSNorm of each row of `x` (`rows x gamma.len()`) into `out`:
    /// `x / sqrt(mean(x^2) + eps) * gamma`; `saved` (`rows`) keeps each
    /// row's 1/rms.
    fn rms_norm(
        &self,
        x: View<'_>,
        gamma: View<'_>,
        eps: f32,
        out: ViewMut<'_>,
        saved: ViewMut<'_>,
    ) -> Result<()>;

    /// RMSNorm's backward: adds to `dx` and to `dgamma`.
    fn rms_norm_backward(
        &self,
        dout: View<'_>,
        x: View<'_>,
        gamma: View<'_>,
        saved: View<'_>,
        dx: ViewMut<'_>,
        dgamma: ViewMut<'_>,
    ) -> Result<()>;

    /// Rotary position embeddings, in place on the queries and keys of
    /// `qkv` (`rows x shape.qkv_width()`): in each head, element `i` and
    /// `i + head_dim / 2` turn by the angle `position x inv_freq[i]`
    /// (transformers' `rotate_half` pairing), the position being the row's
    /// `position_ids` entry (empty: its place in its sequence). `inverse`
    /// turns them back (the backward, applied to the gradients).
    fn rotary(
        &self,
        shape: Attention,
        position_ids: View<'_>,
        inv_freq: View<'_>,
        inverse: bool,
        qkv: ViewMut<'_>,
    ) -> Result<()>;

    /// SwiGLU: `out = silu(gate) * up`, with `gate_up` (`rows x 2 f`) the
    /// gate in its first `f` columns and the up projection in the rest.
    fn swiglu(&self, gate_up: View<'_>, out: ViewMut<'_>) -> Result<()>;

    /// SwiGLU's backward: writes `dgate_up` from `dout` (`rows x f`).
    fn swiglu_backward(
        &self,
        dout: View<'_>,
        gate_up: View<'_>,
        dgate_up: ViewMut<'_>,
    ) -> Result<()>;

    /// Elements the attention forward saves for its backward.
    fn attention_saved_elems(&self, shape: Attention) -> usize;

    /// Elements of scratch the attention ops need.
    fn attention_workspace_elems(&self, shape: Attention) -> usize;

    /// Causal attention over `qkv` (`rows x qkv_width`) into `out` (`rows x
    /// hidden`), keeping what the backward needs in `saved`. With
    /// `position_ids` (u32, one per row; empty: each row's place in its
    /// sequence) row `r` attends to the rows of its sequence from
    /// `r - position_ids[r]` to `r`: ids that restart at 0 per document
    /// make it block-diagonal, no attention across the documents packed
    /// into a sequence. An id past the row's place in its sequence is
    /// refused (rotary takes any position, the embedding any row of its
    /// position table: decoding reads them one row at a time).
    fn attention(
        &self,
        shape: Attention,
        position_ids: View<'_>,
        qkv: View<'_>,
        out: ViewMut<'_>,
        saved: ViewMut<'_>,
        workspace: ViewMut<'_>,
    ) -> Result<()>;

    /// Attention's backward: writes `dqkv` from `dout`, given the
    /// forward's `position_ids`, `qkv`, `out` and `saved`.
    #[allow(clippy::too_many_arguments)]
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
    ) -> Result<()>;

    /// Decoding: one new row's attention over a key/value cache. `q` is
    /// its queries (`shape.heads x shape.head_dim`), `keys` and `values`
    /// the cache's first `len` rows (`len x shape.kv_hidden()`, the new
    /// row's own last), `out` its output (`shape.hidden()`); grouped-query
    /// heads as in [`Backend::attention`], whose row `len - 1` of a
    /// sequence of `len` it equals. `shape.batch` and `shape.seq` are not
    /// read.
    fn attention_decode(
        &self,
        shape: Attention,
        len: usize,
        q: View<'_>,
        keys: View<'_>,
        values: View<'_>,
        out: ViewMut<'_>,
    ) -> Result<()>;

    /// Softmax cross-entropy of each row of `logits` (`rows x vocab`)
    /// against `targets` (u32): writes `dlogits` (the gradient of the
    /// mean, times `grad_scale`) and returns the mean loss. A row whose
    /// target is [`IGNORE_TARGET`] adds nothing (no loss, zero gradient)
    /// and still counts in the mean's divisor, `rows`: a caller that means
    /// the mean over the counted rows scales by `rows / counted`.
    fn cross_entropy(
        &self,
        logits: View<'_>,
        targets: View<'_>,
        grad_scale: f32,
        dlogits: ViewMut<'_>,
    ) -> Result<Readback>;

    /// `out[i] = table[tokens[i]] + positions[position_ids[i]]` (rows of
    /// `hidden`; an empty `position_ids`: `i % seq`); an empty `positions`
    /// adds nothing (a model without a position table).
    fn embedding(
        &self,
        table: View<'_>,
        positions: View<'_>,
        tokens: View<'_>,
        position_ids: View<'_>,
        seq: usize,
        out: ViewMut<'_>,
    ) -> Result<()>;

    /// The embedding's backward: adds each row of `dout` to the rows of
    /// `dtable` and `dpositions` it came from, in token order (no atomics);
    /// an empty `dpositions` takes nothing; `position_ids` as the
    /// forward's.
    #[allow(clippy::too_many_arguments)]
    fn embedding_backward(
        &self,
        tokens: View<'_>,
        position_ids: View<'_>,
        seq: usize,
        dout: View<'_>,
        dtable: ViewMut<'_>,
        dpositions: ViewMut<'_>,
    ) -> Result<()>;

    /// One fused AdamW step over optimizer states resident on the device
    /// (a resident placement): reads the fp32 gradient `grad`, updates the
    /// fp32 `master` weights and moments `m` and `v` in place, and writes
    /// their bf16 compute copy to `param`, all `grad.len()` long.
    /// `coefficients` carry the step's learning rate, bias corrections,
    /// weight decay and gradient scale (1 / loss scale times the clip
    /// coefficient), as `strata_optim` derives them; an overflowed step is
    /// the caller's to skip. The update's arithmetic is `strata_optim`'s,
    /// element by element.
    #[allow(clippy::too_many_arguments)]
    fn adamw(
        &self,
        coefficients: &AdamCoefficients,
        grad: View<'_>,
        master: ViewMut<'_>,
        m: ViewMut<'_>,
        v: ViewMut<'_>,
        param: ViewMut<'_>,
    ) -> Result<()>;

    /// The sum of squares of `x`, in f64 (a gradient norm's partial).
    fn sum_squares(&self, x: View<'_>) -> Result<Readback>;

    /// Whether `x` holds an infinity or a NaN (1) or not (0).
    fn non_finite(&self, x: View<'_>) -> Result<Readback>;

    /// Element `index` of `x` as f64, without a device-wide sync.
    fn read_scalar(&self, x: View<'_>, index: usize) -> Result<Readback>;
}

/// `Shape` unless the key/value heads divide the query heads (both
/// backends' attention and rotary check it first).
pub(crate) fn check_heads(op: &'static str, shape: Attention) -> Result<()> {
    if shape.kv_heads == 0 || !shape.heads.is_multiple_of(shape.kv_heads) {
        return Err(crate::KernelError::Shape {
            op,
            operand: "kv_heads",
            actual: format!("{} key/value heads", shape.kv_heads),
            expected: format!("a divisor of the {} query heads", shape.heads),
        });
    }
    Ok(())
}

/// [`check_heads`], and `Shape` unless a head's elements pair up (rotary
/// turns element `i` with `i + head_dim / 2`).
pub(crate) fn check_rotary_heads(op: &'static str, shape: Attention) -> Result<()> {
    check_heads(op, shape)?;
    if !shape.head_dim.is_multiple_of(2) {
        return Err(crate::KernelError::Shape {
            op,
            operand: "head_dim",
            actual: format!("{} elements a head", shape.head_dim),
            expected: "an even number".into(),
        });
    }
    Ok(())
}

/// `Shape` unless `gate_up` is `out`'s rows with twice its columns (a
/// SwiGLU's gate and up projections side by side).
pub(crate) fn check_swiglu_shapes(
    op: &'static str,
    gate_up: strata_device::Raw,
    out: strata_device::Raw,
) -> Result<()> {
    if gate_up.rows != out.rows || gate_up.cols != 2 * out.cols {
        return Err(crate::KernelError::Shape {
            op,
            operand: "gate_up",
            actual: format!("{} x {}", gate_up.rows, gate_up.cols),
            expected: format!("{} x {}", out.rows, 2 * out.cols),
        });
    }
    Ok(())
}

/// The fused GEMMs as their ops one after another: the trait's defaults,
/// and a backend's fallback where it cannot fuse.
pub(crate) mod unfused {
    use strata_device::{View, ViewMut};

    use super::{Backend, Matrix};
    use crate::error::Result;

    /// [`Backend::gemm_bias`]: the product, then the bias.
    pub(crate) fn gemm_bias<B: Backend + ?Sized>(
        backend: &B,
        a: Matrix<'_>,
        b: Matrix<'_>,
        bias: View<'_>,
        mut c: ViewMut<'_>,
    ) -> Result<()> {
        backend.gemm(a, b, 1.0, 0.0, c.reborrow())?;
        backend.add_bias(c, bias)
    }

    /// [`Backend::gemm_bias_gelu`]: [`Backend::gemm_bias`], then the GELU.
    pub(crate) fn gemm_bias_gelu<B: Backend + ?Sized>(
        backend: &B,
        a: Matrix<'_>,
        b: Matrix<'_>,
        bias: View<'_>,
        mut pre: ViewMut<'_>,
        out: ViewMut<'_>,
    ) -> Result<()> {
        backend.gemm_bias(a, b, bias, pre.reborrow())?;
        backend.gelu(pre.view(), out)
    }

    /// [`Backend::gemm_dgelu`]: the product into `product`, then GELU's
    /// backward.
    pub(crate) fn gemm_dgelu<B: Backend + ?Sized>(
        backend: &B,
        a: Matrix<'_>,
        b: Matrix<'_>,
        pre: View<'_>,
        mut product: ViewMut<'_>,
        dx: ViewMut<'_>,
    ) -> Result<()> {
        backend.gemm(a, b, 1.0, 0.0, product.reborrow())?;
        backend.gelu_backward(product.view(), pre, dx)
    }
}
