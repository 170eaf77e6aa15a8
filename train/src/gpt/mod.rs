//! A GPT-2-style model with a hand-written forward and backward per block,
//! so that the caller decides when each block's parameters are present
//! (what DeepSpeed does with module hooks): token and position embeddings,
//! pre-LayerNorm blocks (causal multi-head attention, GELU MLP), a final
//! LayerNorm, an LM head tied to the token embedding, cross-entropy.
//!
//! The model is written once over the ops of a [`Backend`] on
//! `strata_device` views: it never touches an element itself, so the same
//! code runs on every backend (on the CPU backend the numbers are those of
//! `strata_kernels::cpu`, bit for bit). Parameters of a block are one flat
//! `f32` view ([`BlockLayout`]); so are the embeddings ([`EmbedLayout`]).
//! Activations are in a compute dtype, f32 or bf16: with bf16 the matrix
//! products read a bf16 copy of the weights ([`Weights`]) and write bf16,
//! biases, LayerNorm parameters and statistics, log-sum-exps and every
//! gradient of a parameter stay f32. What a block keeps for its backward
//! is one buffer of the compute dtype ([`BlockActivations`], its f32 parts
//! read through `as_dtype`): saving it between passes is one copy, and its
//! size is the backend's to say (a flash-style attention keeps less than
//! the CPU's probabilities).
//!
//! ```
//! use strata_device::{View, ViewMut};
//! use strata_kernels::CpuBackend;
//! use strata_train::gpt::{GptConfig, embed_forward};
//!
//! let config = GptConfig { vocab: 4, seq: 2, hidden: 2, heads: 1, layers: 1 };
//! let embed = vec![0.5f32; config.embed_params()];
//! let (tokens, mut x) = ([1u32, 3], vec![0.0f32; 4]);
//! embed_forward(&CpuBackend, &config, View::host_slice(&embed), View::host_slice(&tokens),
//!     ViewMut::host_slice(&mut x)).unwrap();
//! assert_eq!(x, [1.0; 4]);
//! ```

use std::ops::Range;

use strata_device::{Buffer, Dtype, View, ViewMut};
use strata_kernels::{Attention, Backend, Matrix, Readback};

use crate::error::TrainError;

type Result<T> = std::result::Result<T, TrainError>;

/// The largest hidden size accepted (GPT-3 175B: 12288).
pub const HIDDEN_MAX: usize = 1 << 16;
/// The most blocks accepted (GPT-3 175B: 96).
pub const LAYERS_MAX: usize = 1 << 12;
/// The longest sequence accepted.
pub const SEQ_MAX: usize = 1 << 20;
/// The largest vocabulary accepted. With the other limits, every
/// parameter and activation count fits in 63 bits.
pub const VOCAB_MAX: usize = 1 << 24;

/// A model's shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GptConfig {
    /// Vocabulary (256 for byte-level tokens).
    pub vocab: usize,
    /// Sequence length (positions).
    pub seq: usize,
    /// Hidden size.
    pub hidden: usize,
    /// Attention heads; divides `hidden`.
    pub heads: usize,
    /// Blocks.
    pub layers: usize,
}

impl GptConfig {
    /// Checks the shape; the error names the field.
    pub fn validate(&self) -> Result<()> {
        let bad = |key, value: usize, fix: String| Err(crate::error::bad(key, value, fix));
        for (key, value) in [
            ("model.vocab", self.vocab),
            ("model.seq", self.seq),
            ("model.hidden", self.hidden),
            ("model.heads", self.heads),
            ("model.layers", self.layers),
        ] {
            if value == 0 {
                return bad(key, value, "it must be at least 1".into());
            }
        }
        if !self.hidden.is_multiple_of(self.heads) {
            return bad(
                "model.hidden",
                self.hidden,
                format!("it must be a multiple of model.heads ({})", self.heads),
            );
        }
        for (key, value, max) in [
            ("model.vocab", self.vocab, VOCAB_MAX),
            ("model.seq", self.seq, SEQ_MAX),
            ("model.hidden", self.hidden, HIDDEN_MAX),
            ("model.layers", self.layers, LAYERS_MAX),
        ] {
            if value > max {
                return bad(key, value, format!("use at most {max}"));
            }
        }
        Ok(())
    }

    /// Parameters of one block.
    pub fn block_params(&self) -> usize {
        BlockLayout::new(self.hidden).total
    }

    /// Parameters of the embeddings and the final LayerNorm.
    pub fn embed_params(&self) -> usize {
        EmbedLayout::new(self).total
    }

    /// All parameters.
    pub fn params(&self) -> usize {
        self.embed_params() + self.layers * self.block_params()
    }
}

/// Consecutive parts of one flat buffer, by their lengths.
#[derive(Debug, Clone, Copy)]
struct Parts<const N: usize> {
    lens: [usize; N],
    ends: [usize; N],
}

impl<const N: usize> Parts<N> {
    fn new(lens: [usize; N]) -> Self {
        let mut ends = lens;
        for i in 1..N {
            ends[i] += ends[i - 1];
        }
        Parts { lens, ends }
    }

    fn total(&self) -> usize {
        self.ends[N - 1]
    }

    /// Elements of parts `first..=last`.
    fn span(&self, first: usize, last: usize) -> Range<usize> {
        let start = if first == 0 { 0 } else { self.ends[first - 1] };
        start..self.ends[last]
    }

    fn range(&self, i: usize) -> Range<usize> {
        self.span(i, i)
    }

    fn split<'a>(&self, view: ViewMut<'a>) -> [ViewMut<'a>; N] {
        view.split_parts(self.lens)
    }

    fn views<'a>(&self, view: View<'a>) -> [View<'a>; N] {
        std::array::from_fn(|i| view.range(self.range(i)))
    }
}

/// Parts of one buffer of a compute dtype, some of them of another dtype
/// (f32 statistics in a bf16 buffer), each starting 16-byte aligned (what
/// the tensor-core kernels' 16-byte copies need).
#[derive(Debug, Clone, Copy)]
struct TypedParts<const N: usize> {
    /// Each part's elements, of its own dtype.
    lens: [usize; N],
    dtypes: [Dtype; N],
    /// The parts in the buffer's elements.
    parts: Parts<N>,
    /// The buffer's dtype.
    dtype: Dtype,
}

impl<const N: usize> TypedParts<N> {
    fn new(dtype: Dtype, parts: [(usize, Dtype); N]) -> Self {
        let unit = dtype.bytes() as usize;
        let in_buffer = parts.map(|(len, d)| (len * d.bytes() as usize).div_ceil(16) * 16 / unit);
        TypedParts {
            lens: parts.map(|p| p.0),
            dtypes: parts.map(|p| p.1),
            parts: Parts::new(in_buffer),
            dtype,
        }
    }

    fn total(&self) -> usize {
        self.parts.total()
    }

    /// A buffer for these parts on `backend`.
    fn alloc(&self, backend: &dyn Backend) -> Result<Buffer> {
        Ok(backend.alloc(self.dtype, self.total())?)
    }

    fn split<'a>(&self, view: ViewMut<'a>) -> [ViewMut<'a>; N] {
        let mut parts = self.parts.split(view).into_iter();
        std::array::from_fn(|i| {
            let part = parts.next().expect("N parts");
            let part = part
                .as_dtype(self.dtypes[i])
                .expect("parts start 16-byte aligned");
            part.range(0..self.lens[i])
        })
    }

    fn views<'a>(&self, view: View<'a>) -> [View<'a>; N] {
        std::array::from_fn(|i| self.view(view, i))
    }

    fn view<'a>(&self, view: View<'a>, i: usize) -> View<'a> {
        let part = view.range(self.parts.range(i));
        let part = part
            .as_dtype(self.dtypes[i])
            .expect("parts start 16-byte aligned");
        part.range(0..self.lens[i])
    }
}

/// A group's parameters as the ops read them: all of them in f32 (biases,
/// LayerNorm parameters, the embedding tables), and the same values in the
/// compute dtype for the matrix products (the same view when it is f32).
#[derive(Debug, Clone, Copy)]
pub struct Weights<'a> {
    /// Every parameter, f32.
    pub f32: View<'a>,
    /// Every parameter in the compute dtype (only its weight matrices are
    /// read).
    pub compute: View<'a>,
}

impl<'a> From<View<'a>> for Weights<'a> {
    /// f32 compute: one view serves both.
    fn from(view: View<'a>) -> Self {
        Weights {
            f32: view,
            compute: view,
        }
    }
}

impl<'a> Weights<'a> {
    fn check(&self, what: &'static str, total: usize) -> Result<()> {
        expect_len(what, self.f32.len(), total)?;
        expect_len(what, self.compute.len(), total)
    }
}

// A block's parameters, in layout order (weights stored input-major:
// `y = x W + b`).
const LN1_GAMMA: usize = 0;
const LN1_BETA: usize = 1;
const QKV_W: usize = 2;
const QKV_B: usize = 3;
const PROJ_W: usize = 4;
const PROJ_B: usize = 5;
const LN2_GAMMA: usize = 6;
const LN2_BETA: usize = 7;
const FC1_W: usize = 8;
const FC1_B: usize = 9;
const FC2_W: usize = 10;
const FC2_B: usize = 11;
/// The weight matrices among them.
const MATRICES: [usize; 4] = [QKV_W, PROJ_W, FC1_W, FC2_W];

/// Where each tensor of a block sits in its flat parameter view.
#[derive(Debug, Clone, Copy)]
pub struct BlockLayout {
    parts: Parts<12>,
    /// The gradients' cut: each LayerNorm's gamma and beta as one part
    /// (the backward writes them together).
    grads: Parts<10>,
    /// Parameters in the block.
    pub total: usize,
}

impl BlockLayout {
    /// The layout for hidden size `h`.
    pub fn new(h: usize) -> Self {
        let parts = Parts::new([
            h,
            h,
            h * 3 * h,
            3 * h,
            h * h,
            h,
            h,
            h,
            h * 4 * h,
            4 * h,
            4 * h * h,
            h,
        ]);
        let grads = Parts::new([
            2 * h,
            h * 3 * h,
            3 * h,
            h * h,
            h,
            2 * h,
            h * 4 * h,
            4 * h,
            4 * h * h,
            h,
        ]);
        BlockLayout {
            parts,
            grads,
            total: parts.total(),
        }
    }

    /// Elements of parameter tensor `i` (layout order: ln1 gamma, ln1
    /// beta, qkv weight, qkv bias, proj weight, proj bias, ln2 gamma, ln2
    /// beta, fc1 weight, fc1 bias, fc2 weight, fc2 bias).
    pub fn range(&self, i: usize) -> Range<usize> {
        self.parts.range(i)
    }

    /// Whether parameter `index` is a weight matrix (decayed by AdamW),
    /// not a bias or a LayerNorm scale.
    pub fn is_matrix(&self, index: usize) -> bool {
        MATRICES.iter().any(|&i| self.range(i).contains(&index))
    }

    /// Each tensor's elements, in layout order, and whether it is a weight
    /// matrix (decayed by AdamW).
    pub fn tensors(&self) -> impl Iterator<Item = (Range<usize>, bool)> + '_ {
        (0..12).map(|i| (self.range(i), MATRICES.contains(&i)))
    }

    /// The tensors a block reads in f32 whatever the compute dtype: its
    /// biases and LayerNorm parameters (a small part of it).
    pub fn vectors(&self) -> impl Iterator<Item = Range<usize>> + '_ {
        self.tensors()
            .filter(|(_, matrix)| !matrix)
            .map(|(range, _)| range)
    }

    /// Each tensor's view: weight matrices in the compute dtype, the rest
    /// f32.
    fn views<'a>(&self, weights: Weights<'a>) -> [View<'a>; 12] {
        let (f32s, compute) = (
            self.parts.views(weights.f32),
            self.parts.views(weights.compute),
        );
        std::array::from_fn(|i| match MATRICES.contains(&i) {
            true => compute[i],
            false => f32s[i],
        })
    }
}

/// Where each tensor of the embeddings sits: token embedding (`vocab x
/// hidden`, also the LM head), position embedding (`seq x hidden`), final
/// LayerNorm gamma and beta.
#[derive(Debug, Clone, Copy)]
pub struct EmbedLayout {
    parts: Parts<4>,
    /// Parameters.
    pub total: usize,
}

impl EmbedLayout {
    /// The layout for `config`.
    pub fn new(config: &GptConfig) -> Self {
        let h = config.hidden;
        let parts = Parts::new([config.vocab * h, config.seq * h, h, h]);
        EmbedLayout {
            parts,
            total: parts.total(),
        }
    }

    /// Elements of tensor `i` (token embedding, position embedding, final
    /// LayerNorm gamma, beta).
    pub fn range(&self, i: usize) -> Range<usize> {
        self.parts.range(i)
    }

    /// Whether parameter `index` is a weight matrix (the embeddings).
    pub fn is_matrix(&self, index: usize) -> bool {
        index < self.parts.ends[1]
    }

    /// Each tensor's elements, in layout order, and whether it is a weight
    /// matrix (the two embeddings are; the final LayerNorm's are not).
    pub fn tensors(&self) -> impl Iterator<Item = (Range<usize>, bool)> + '_ {
        (0..4).map(|i| (self.range(i), i < 2))
    }

    /// The embeddings' gradients cut as the backward writes them: token
    /// embedding, position embedding, and the final LayerNorm's gamma and
    /// beta together.
    fn split_grads<'a>(&self, dembed: ViewMut<'a>) -> [ViewMut<'a>; 3] {
        let lens = self.parts.lens;
        dembed.split_parts([lens[0], lens[1], lens[2] + lens[3]])
    }
}

/// The attention shape of `batch` sequences.
fn attention_shape(config: &GptConfig, batch: usize) -> Attention {
    Attention {
        batch,
        seq: config.seq,
        heads: config.heads,
        head_dim: config.hidden / config.heads,
    }
}

/// The parts of [`BlockActivations`], in order: the block's input, ln1's
/// output and saved statistics, qkv, what attention saves, attention's
/// output, the residual after it, ln2's output and statistics, fc1's
/// output, GELU's output.
fn activation_parts(
    backend: &dyn Backend,
    config: &GptConfig,
    batch: usize,
    dtype: Dtype,
) -> TypedParts<11> {
    let (n, h) = (batch * config.seq, config.hidden);
    let attention = backend.attention_saved_elems(attention_shape(config, batch));
    let f32 = Dtype::F32;
    TypedParts::new(
        dtype,
        [
            (n * h, dtype),
            (n * h, dtype),
            (2 * n, f32),
            (n * 3 * h, dtype),
            (attention, f32),
            (n * h, dtype),
            (n * h, dtype),
            (n * h, dtype),
            (2 * n, f32),
            (n * 4 * h, dtype),
            (n * 4 * h, dtype),
        ],
    )
}

/// What a block's forward keeps for its backward, for `batch` sequences,
/// in one buffer. With activation checkpointing only the input is kept
/// between passes, and [`block_forward`] is run again into this before the
/// backward.
#[derive(Debug)]
pub struct BlockActivations {
    buffer: Buffer,
    parts: TypedParts<11>,
}

impl BlockActivations {
    /// Buffers for `batch` sequences of `config.seq` tokens on `backend`,
    /// the activations `dtype` (f32 or bf16).
    pub fn new(
        backend: &dyn Backend,
        config: &GptConfig,
        batch: usize,
        dtype: Dtype,
    ) -> Result<Self> {
        let parts = activation_parts(backend, config, batch, dtype);
        Ok(BlockActivations {
            buffer: parts.alloc(backend)?,
            parts,
        })
    }

    /// Bytes these buffers hold.
    pub fn bytes(&self) -> u64 {
        self.buffer.bytes()
    }

    /// Everything kept, as one view: what a run without checkpointing
    /// saves between forward and backward.
    pub fn view(&self) -> View<'_> {
        self.buffer.view()
    }

    /// Everything kept, to restore what [`BlockActivations::view`] saved.
    pub fn view_mut(&mut self) -> ViewMut<'_> {
        self.buffer.view_mut()
    }

    /// The forward's input (what activation checkpointing keeps).
    pub fn input(&self) -> View<'_> {
        self.parts.view(self.buffer.view(), 0)
    }

    /// The activations' dtype (what the saved views are read as).
    pub fn dtype(&self) -> Dtype {
        self.parts.dtype
    }
}

/// The parts of [`BlockScratch`]: the attention ops' workspace, then the
/// gradients of attention's output, qkv, the first residual, ln2's
/// output, GELU's output, fc1's output and ln1's output.
fn scratch_parts(
    backend: &dyn Backend,
    config: &GptConfig,
    batch: usize,
    dtype: Dtype,
) -> TypedParts<8> {
    let (n, h) = (batch * config.seq, config.hidden);
    let workspace = backend.attention_workspace_elems(attention_shape(config, batch));
    TypedParts::new(
        dtype,
        [
            (workspace, Dtype::F32),
            (n * h, dtype),
            (n * 3 * h, dtype),
            (n * h, dtype),
            (n * h, dtype),
            (n * 4 * h, dtype),
            (n * 4 * h, dtype),
            (n * h, dtype),
        ],
    )
}

/// Working buffers of a block, sized once, in one buffer.
#[derive(Debug)]
pub struct BlockScratch {
    buffer: Buffer,
    parts: TypedParts<8>,
}

impl BlockScratch {
    /// Buffers for `batch` sequences on `backend`, the activation
    /// gradients `dtype` (f32 or bf16).
    pub fn new(
        backend: &dyn Backend,
        config: &GptConfig,
        batch: usize,
        dtype: Dtype,
    ) -> Result<Self> {
        let parts = scratch_parts(backend, config, batch, dtype);
        Ok(BlockScratch {
            buffer: parts.alloc(backend)?,
            parts,
        })
    }

    /// Bytes these buffers hold.
    pub fn bytes(&self) -> u64 {
        self.buffer.bytes()
    }

    /// The attention ops' workspace.
    fn workspace(&mut self) -> ViewMut<'_> {
        let [workspace, ..] = self.parts.split(self.buffer.view_mut());
        workspace
    }
}

/// A linear layer: `y = x w + b`, with `x` `rows x inputs` (one fused
/// GEMM where the backend has the epilogue).
fn linear(
    backend: &dyn Backend,
    x: View<'_>,
    w: View<'_>,
    b: View<'_>,
    rows: usize,
    y: ViewMut<'_>,
) -> Result<()> {
    let (inputs, outputs) = (x.len() / rows.max(1), b.len());
    backend.gemm_bias(
        Matrix::n(x.matrix(rows, inputs)?),
        Matrix::n(w.matrix(inputs, outputs)?),
        b,
        y.matrix(rows, outputs)?,
    )?;
    Ok(())
}

/// A linear layer's parameter gradients: `dw += x^T dy`, `db +=
/// colsum(dy)`, with `x` `rows x inputs`.
fn linear_param_grads(
    backend: &dyn Backend,
    x: View<'_>,
    dy: View<'_>,
    rows: usize,
    dw: ViewMut<'_>,
    db: ViewMut<'_>,
) -> Result<()> {
    let (inputs, outputs) = (x.len() / rows.max(1), db.len());
    backend.gemm(
        Matrix::t(x.matrix(rows, inputs)?),
        Matrix::n(dy.matrix(rows, outputs)?),
        1.0,
        1.0,
        dw.matrix(inputs, outputs)?,
    )?;
    backend.bias_grad(dy, db)?;
    Ok(())
}

/// A linear layer's backward: `dw += x^T dy`, `db += colsum(dy)`,
/// `dx = dy w^T`, with `x` `rows x inputs` and `w` `inputs x outputs`.
#[allow(clippy::too_many_arguments)]
fn linear_backward(
    backend: &dyn Backend,
    x: View<'_>,
    w: View<'_>,
    dy: View<'_>,
    rows: usize,
    dw: ViewMut<'_>,
    db: ViewMut<'_>,
    dx: ViewMut<'_>,
) -> Result<()> {
    let (inputs, outputs) = (x.len() / rows.max(1), db.len());
    linear_param_grads(backend, x, dy, rows, dw, db)?;
    backend.gemm(
        Matrix::n(dy.matrix(rows, outputs)?),
        Matrix::t(w.matrix(inputs, outputs)?),
        1.0,
        0.0,
        dx.matrix(rows, inputs)?,
    )?;
    Ok(())
}

/// Checks that `view` holds `expected` elements; the error names it.
fn expect_len(what: &'static str, view_len: usize, expected: usize) -> Result<()> {
    if view_len != expected {
        return Err(TrainError::Shape {
            what,
            actual: view_len,
            expected,
        });
    }
    Ok(())
}

/// One block's forward for `batch` sequences: `out = block(x)`, keeping
/// what the backward needs in `acts`.
#[allow(clippy::too_many_arguments)]
pub fn block_forward<'w>(
    backend: &dyn Backend,
    config: &GptConfig,
    batch: usize,
    params: impl Into<Weights<'w>>,
    x: View<'_>,
    acts: &mut BlockActivations,
    scratch: &mut BlockScratch,
    mut out: ViewMut<'_>,
) -> Result<()> {
    let (n, h) = (batch * config.seq, config.hidden);
    let layout = BlockLayout::new(h);
    let params = params.into();
    params.check("block parameters", layout.total)?;
    expect_len("block input", x.len(), n * h)?;
    expect_len("block output", out.len(), n * h)?;
    let p = layout.views(params);
    let parts = acts.parts;
    let [
        input,
        mut a,
        ln1,
        mut qkv,
        saved,
        mut att,
        mut x1,
        mut c,
        ln2,
        mut f,
        mut g,
    ] = parts.split(acts.buffer.view_mut());
    backend.copy(x, input)?;
    backend.layer_norm(x, p[LN1_GAMMA], p[LN1_BETA], a.reborrow(), ln1)?;
    linear(backend, a.view(), p[QKV_W], p[QKV_B], n, qkv.reborrow())?;
    backend.attention(
        attention_shape(config, batch),
        qkv.view(),
        att.reborrow(),
        saved,
        scratch.workspace(),
    )?;
    linear(backend, att.view(), p[PROJ_W], p[PROJ_B], n, x1.reborrow())?;
    backend.add(x1.reborrow(), x)?;
    backend.layer_norm(x1.view(), p[LN2_GAMMA], p[LN2_BETA], c.reborrow(), ln2)?;
    // fc1 and its GELU in one fused GEMM where the backend can, keeping
    // the pre-activation for the backward.
    backend.gemm_bias_gelu(
        Matrix::n(c.view().matrix(n, h)?),
        Matrix::n(p[FC1_W].matrix(h, 4 * h)?),
        p[FC1_B],
        f.reborrow().matrix(n, 4 * h)?,
        g.reborrow().matrix(n, 4 * h)?,
    )?;
    linear(backend, g.view(), p[FC2_W], p[FC2_B], n, out.reborrow())?;
    backend.add(out, x1.view())?;
    Ok(())
}

/// One block's backward from the activations of its forward: writes `dx`
/// and adds the parameter gradients to `dparams`.
#[allow(clippy::too_many_arguments)]
pub fn block_backward<'w>(
    backend: &dyn Backend,
    config: &GptConfig,
    batch: usize,
    params: impl Into<Weights<'w>>,
    acts: &BlockActivations,
    dout: View<'_>,
    scratch: &mut BlockScratch,
    mut dx: ViewMut<'_>,
    dparams: ViewMut<'_>,
) -> Result<()> {
    let (n, h) = (batch * config.seq, config.hidden);
    let layout = BlockLayout::new(h);
    let params = params.into();
    params.check("block parameters", layout.total)?;
    expect_len("block gradients", dparams.len(), layout.total)?;
    expect_len("block output gradient", dout.len(), n * h)?;
    expect_len("block input gradient", dx.len(), n * h)?;
    let p = layout.views(params);
    let [x, a, ln1, qkv, saved, att, x1, c, ln2, f, g] = acts.parts.views(acts.buffer.view());
    let [
        dln1,
        dwqkv,
        dbqkv,
        dwproj,
        dbproj,
        dln2,
        dwfc1,
        dbfc1,
        dwfc2,
        dbfc2,
    ] = layout.grads.split(dparams);
    let scratch_parts = scratch.parts;
    let [
        workspace,
        mut datt,
        mut dqkv,
        mut dx1,
        mut dc,
        mut dg,
        mut df,
        mut da,
    ] = scratch_parts.split(scratch.buffer.view_mut());
    // MLP: fc2's parameter gradients, then the gradient through fc2 and
    // the GELU in one fused GEMM where the backend can (`dg` its scratch).
    linear_param_grads(backend, g, dout, n, dwfc2, dbfc2)?;
    backend.gemm_dgelu(
        Matrix::n(dout.matrix(n, h)?),
        Matrix::t(p[FC2_W].matrix(4 * h, h)?),
        f.matrix(n, 4 * h)?,
        dg.reborrow().matrix(n, 4 * h)?,
        df.reborrow().matrix(n, 4 * h)?,
    )?;
    linear_backward(
        backend,
        c,
        p[FC1_W],
        df.view(),
        n,
        dwfc1,
        dbfc1,
        dc.reborrow(),
    )?;
    backend.copy(dout, dx1.reborrow())?;
    backend.layer_norm_backward(dc.view(), x1, p[LN2_GAMMA], ln2, dx1.reborrow(), dln2)?;
    // Attention.
    linear_backward(
        backend,
        att,
        p[PROJ_W],
        dx1.view(),
        n,
        dwproj,
        dbproj,
        datt.reborrow(),
    )?;
    backend.attention_backward(
        attention_shape(config, batch),
        qkv,
        att,
        saved,
        datt.view(),
        dqkv.reborrow(),
        workspace,
    )?;
    linear_backward(
        backend,
        a,
        p[QKV_W],
        dqkv.view(),
        n,
        dwqkv,
        dbqkv,
        da.reborrow(),
    )?;
    backend.copy(dx1.view(), dx.reborrow())?;
    backend.layer_norm_backward(da.view(), x, p[LN1_GAMMA], ln1, dx, dln1)?;
    Ok(())
}

/// The embeddings' forward: `x[b, t] = wte[tokens[b, t]] + wpe[t]`.
pub fn embed_forward(
    backend: &dyn Backend,
    config: &GptConfig,
    embed: View<'_>,
    tokens: View<'_>,
    x: ViewMut<'_>,
) -> Result<()> {
    let layout = EmbedLayout::new(config);
    expect_len("embedding parameters", embed.len(), layout.total)?;
    let [wte, wpe, _, _] = layout.parts.views(embed);
    backend.embedding(wte, wpe, tokens, config.seq, x)?;
    Ok(())
}

/// The parts of [`HeadBuffers`]: the final LayerNorm's output and saved
/// statistics, the logits, their gradient, and the final LayerNorm
/// output's gradient.
fn head_parts(config: &GptConfig, batch: usize, dtype: Dtype) -> TypedParts<5> {
    let (n, h, v) = (batch * config.seq, config.hidden, config.vocab);
    TypedParts::new(
        dtype,
        [
            (n * h, dtype),
            (2 * n, Dtype::F32),
            (n * v, dtype),
            (n * v, dtype),
            (n * h, dtype),
        ],
    )
}

/// Buffers of the head (final LayerNorm, tied LM head, loss), in one
/// buffer.
#[derive(Debug)]
pub struct HeadBuffers {
    buffer: Buffer,
    parts: TypedParts<5>,
}

impl HeadBuffers {
    /// Buffers for `batch` sequences on `backend`, the activations and
    /// logits `dtype` (f32 or bf16).
    pub fn new(
        backend: &dyn Backend,
        config: &GptConfig,
        batch: usize,
        dtype: Dtype,
    ) -> Result<Self> {
        let parts = head_parts(config, batch, dtype);
        Ok(HeadBuffers {
            buffer: parts.alloc(backend)?,
            parts,
        })
    }

    /// Bytes these buffers hold.
    pub fn bytes(&self) -> u64 {
        self.buffer.bytes()
    }
}

/// The head's forward and backward: the mean cross-entropy of the last
/// block's output `x` against `targets`; writes `dx` and adds to the
/// embedding gradients `dembed` (tied LM head, final LayerNorm), both
/// multiplied by `grad_scale`. The loss is read back without waiting for
/// the device.
#[allow(clippy::too_many_arguments)]
pub fn head_forward_backward<'w>(
    backend: &dyn Backend,
    config: &GptConfig,
    embed: impl Into<Weights<'w>>,
    x: View<'_>,
    targets: View<'_>,
    grad_scale: f32,
    buffers: &mut HeadBuffers,
    mut dx: ViewMut<'_>,
    dembed: ViewMut<'_>,
) -> Result<Readback> {
    let (h, v) = (config.hidden, config.vocab);
    let n = targets.len();
    let layout = EmbedLayout::new(config);
    let embed = embed.into();
    embed.check("embedding parameters", layout.total)?;
    expect_len("embedding gradients", dembed.len(), layout.total)?;
    expect_len("head input", x.len(), n * h)?;
    let [_, _, gamma, beta] = layout.parts.views(embed.f32);
    let wte = embed.compute.range(layout.range(0)).matrix(v, h)?;
    let parts = buffers.parts;
    let [mut hf, mut ln, mut logits, mut dlogits, mut dhf] = parts.split(buffers.buffer.view_mut());
    backend.layer_norm(x, gamma, beta, hf.reborrow(), ln.reborrow())?;
    let hf = hf.view().matrix(n, h)?;
    backend.gemm(
        Matrix::n(hf),
        Matrix::t(wte),
        1.0,
        0.0,
        logits.reborrow().matrix(n, v)?,
    )?;
    let loss = backend.cross_entropy(logits.view(), targets, grad_scale, dlogits.reborrow())?;
    let dlogits = dlogits.view().matrix(n, v)?;
    backend.gemm(
        Matrix::n(dlogits),
        Matrix::n(wte),
        1.0,
        0.0,
        dhf.reborrow().matrix(n, h)?,
    )?;
    let [dwte, _, dnorm] = layout.split_grads(dembed);
    backend.gemm(
        Matrix::t(dlogits),
        Matrix::n(hf),
        1.0,
        1.0,
        dwte.matrix(v, h)?,
    )?;
    backend.zero(dx.reborrow())?;
    backend.layer_norm_backward(dhf.view(), x, gamma, ln.view(), dx, dnorm)?;
    Ok(loss)
}

/// The head's forward alone: the logits (`rows x vocab`) of the last
/// block's output `x` through the final LayerNorm and the tied LM head.
pub fn head_logits<'w>(
    backend: &dyn Backend,
    config: &GptConfig,
    embed: impl Into<Weights<'w>>,
    x: View<'_>,
    buffers: &mut HeadBuffers,
    logits: ViewMut<'_>,
) -> Result<()> {
    let (h, v) = (config.hidden, config.vocab);
    let layout = EmbedLayout::new(config);
    let embed = embed.into();
    embed.check("embedding parameters", layout.total)?;
    let n = x.len() / h;
    expect_len("head input", x.len(), n * h)?;
    expect_len("head buffers", buffers.parts.lens[0], n * h)?;
    expect_len("logits", logits.len(), n * v)?;
    let [_, _, gamma, beta] = layout.parts.views(embed.f32);
    let wte = embed.compute.range(layout.range(0));
    let parts = buffers.parts;
    let [mut hf, ln, ..] = parts.split(buffers.buffer.view_mut());
    backend.layer_norm(x, gamma, beta, hf.reborrow(), ln)?;
    backend.gemm(
        Matrix::n(hf.view().matrix(n, h)?),
        Matrix::t(wte.matrix(v, h)?),
        1.0,
        0.0,
        logits.matrix(n, v)?,
    )?;
    Ok(())
}

/// The whole model's forward for inference: the logits (`tokens x
/// vocab`) of `tokens` (whole sequences of `config.seq`), from the
/// embeddings' parameters and each block's. It allocates its buffers on
/// `backend` (one block's activations, not the model's) and returns once
/// the backend has written `logits` (an evaluation, not a step's path).
pub fn forward_logits(
    backend: &dyn Backend,
    config: &GptConfig,
    embed: View<'_>,
    blocks: &[View<'_>],
    tokens: View<'_>,
    logits: ViewMut<'_>,
) -> Result<()> {
    let batch = tokens.len() / config.seq;
    expect_len("tokens", tokens.len(), batch.max(1) * config.seq)?;
    expect_len("blocks", blocks.len(), config.layers)?;
    let n = batch * config.seq;
    let mut acts = BlockActivations::new(backend, config, batch, Dtype::F32)?;
    let mut scratch = BlockScratch::new(backend, config, batch, Dtype::F32)?;
    let mut head = HeadBuffers::new(backend, config, batch, Dtype::F32)?;
    let mut x = backend.alloc(Dtype::F32, n * config.hidden)?;
    let mut y = backend.alloc(Dtype::F32, n * config.hidden)?;
    embed_forward(backend, config, embed, tokens, x.view_mut())?;
    for &params in blocks {
        block_forward(
            backend,
            config,
            batch,
            params,
            x.view(),
            &mut acts,
            &mut scratch,
            y.view_mut(),
        )?;
        std::mem::swap(&mut x, &mut y);
    }
    head_logits(backend, config, embed, x.view(), &mut head, logits)?;
    // The buffers above are freed on return: the ops must be done with them.
    backend.record()?.wait()?;
    Ok(())
}

/// The embeddings' backward: adds `dx` to the rows of the token and
/// position embeddings it came from.
pub fn embed_backward(
    backend: &dyn Backend,
    config: &GptConfig,
    tokens: View<'_>,
    dx: View<'_>,
    dembed: ViewMut<'_>,
) -> Result<()> {
    let layout = EmbedLayout::new(config);
    expect_len("embedding gradients", dembed.len(), layout.total)?;
    let [dwte, dwpe, _] = layout.split_grads(dembed);
    backend.embedding_backward(tokens, config.seq, dx, dwte, dwpe)?;
    Ok(())
}

#[cfg(test)]
mod tests;
