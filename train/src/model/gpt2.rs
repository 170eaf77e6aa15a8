//! GPT-2 (`"gpt2"`), the first architecture behind [`Model`]: token and
//! position embeddings, pre-LayerNorm blocks (causal multi-head attention,
//! a 4h GELU MLP), a final LayerNorm, an LM head tied to the token
//! embedding, cross-entropy; Hugging Face's `GPT2LMHeadModel` in and out.
//!
//! A hand-written forward and backward per block, so that the caller
//! decides when each block's parameters are present (what DeepSpeed does
//! with module hooks), written once over the ops of a [`Backend`] on
//! `strata_device` views: it never touches an element itself, so the same
//! code runs on every backend (on the CPU backend the numbers are those of
//! `strata_kernels::cpu`, bit for bit). Parameters of a block are one flat
//! `f32` view ([`BlockLayout`]); so are the embeddings and the final
//! LayerNorm, the outer group ([`EmbedLayout`]). Activations are in a
//! compute dtype, f32 or bf16: with bf16 the matrix products read a bf16
//! copy of the weights ([`Weights`]) and write bf16, biases, LayerNorm
//! parameters and statistics, log-sum-exps and every gradient of a
//! parameter stay f32. What a block keeps for its backward is one buffer of
//! the compute dtype ([`Buffers::kept`], its f32 parts read through
//! `as_dtype`): saving it between passes is one copy, and its size is the
//! backend's to say (a flash-style attention keeps less than the CPU's
//! probabilities).
//!
//! ```
//! use strata_device::{View, ViewMut};
//! use strata_kernels::{CpuBackend, no_position_ids};
//! use strata_train::model::Model;
//! use strata_train::model::gpt2::Gpt2;
//!
//! let config = Gpt2 { vocab: 4, seq: 2, hidden: 2, heads: 1, layers: 1 };
//! let embed = vec![0.5f32; config.embed_params()];
//! let (tokens, mut x) = ([1u32, 3], vec![0.0f32; 4]);
//! config.embed_forward(&CpuBackend, View::host_slice(&embed), View::host_slice(&tokens),
//!     no_position_ids(), ViewMut::host_slice(&mut x)).unwrap();
//! assert_eq!(x, [1.0; 4]);
//! ```

use std::ops::Range;

use strata_device::{Dtype, View, ViewMut};
use strata_kernels::{Attention, Backend, Matrix, Readback};

use super::init::fill_normal;
use super::{
    Arch, Architecture, Buffers, GroupSpec, HIDDEN_MAX, LAYERS_MAX, Model, ModelConfig, OuterCosts,
    Parts, SEQ_MAX, TensorSpec, TypedParts, VOCAB_MAX, Weights, attend_cached, check_sizes,
    expect_len,
};
use crate::error::{Result, bad};
use strata_storage::engine::SplitMix64;

/// A model's shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gpt2 {
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

impl Gpt2 {
    /// Checks the shape; the error names the field.
    pub fn validate(&self) -> Result<()> {
        check_sizes(&[
            ("model.vocab", self.vocab, VOCAB_MAX),
            ("model.seq", self.seq, SEQ_MAX),
            ("model.hidden", self.hidden, HIDDEN_MAX),
            ("model.heads", self.heads, self.hidden.max(1)),
            ("model.layers", self.layers, LAYERS_MAX),
        ])?;
        if !self.hidden.is_multiple_of(self.heads) {
            return Err(crate::error::bad(
                "model.hidden",
                self.hidden,
                format!("it must be a multiple of model.heads ({})", self.heads),
            ));
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
    pub fn new(config: &Gpt2) -> Self {
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
fn attention_shape(config: &Gpt2, batch: usize) -> Attention {
    Attention {
        batch,
        seq: config.seq,
        heads: config.heads,
        kv_heads: config.heads,
        head_dim: config.hidden / config.heads,
    }
}

/// The parts of [`BlockActivations`], in order: the block's input, ln1's
/// output and saved statistics, qkv, what attention saves, attention's
/// output, the residual after it, ln2's output and statistics, fc1's
/// output, GELU's output.
fn activation_parts(
    backend: &dyn Backend,
    config: &Gpt2,
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

/// The parts of [`BlockScratch`]: the attention ops' workspace, then the
/// gradients of attention's output, qkv, the first residual, ln2's
/// output, GELU's output, fc1's output and ln1's output.
fn scratch_parts(
    backend: &dyn Backend,
    config: &Gpt2,
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

/// The parts of [`HeadBuffers`]: the final LayerNorm's output and saved
/// statistics, the logits, their gradient, and the final LayerNorm
/// output's gradient.
fn head_parts(config: &Gpt2, rows: usize, dtype: Dtype) -> TypedParts<5> {
    let (n, h, v) = (rows, config.hidden, config.vocab);
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

/// A block's second half over `n` rows: `out = x1 + fc2(gelu(fc1(ln2(x1))))`,
/// keeping ln2's output and statistics, fc1's pre-activation and its GELU
/// in `[c, ln2, f, g]` (fc1 and its GELU in one fused GEMM where the backend
/// can, the pre-activation kept for the backward).
fn mlp(
    backend: &dyn Backend,
    p: &[View<'_>],
    n: usize,
    x1: View<'_>,
    [mut c, ln2, mut f, mut g]: [ViewMut<'_>; 4],
    mut out: ViewMut<'_>,
) -> Result<()> {
    let h = x1.len() / n.max(1);
    backend.layer_norm(x1, p[LN2_GAMMA], p[LN2_BETA], c.reborrow(), ln2)?;
    backend.gemm_bias_gelu(
        Matrix::n(c.view().matrix(n, h)?),
        Matrix::n(p[FC1_W].matrix(h, 4 * h)?),
        p[FC1_B],
        f.reborrow().matrix(n, 4 * h)?,
        g.reborrow().matrix(n, 4 * h)?,
    )?;
    linear(backend, g.view(), p[FC2_W], p[FC2_B], n, out.reborrow())?;
    backend.add(out, x1)?;
    Ok(())
}

/// One decoding step's working rows (f32): ln1's output and statistics,
/// qkv, attention's output, the residual after it, ln2's output and
/// statistics, fc1's pre-activation and its GELU.
fn decode_parts(h: usize) -> Parts<9> {
    Parts::new([h, 2, 3 * h, h, h, h, 2, 4 * h, 4 * h])
}

/// GPT-2's entry in the registry.
pub const ARCHITECTURE: Architecture = Architecture {
    name: "gpt2",
    source: "gpt2",
    build: Gpt2::build,
    for_params: Gpt2::for_params,
    from_hf_config: Gpt2::from_hf_config,
};

impl Gpt2 {
    /// The shape `[model]` gives, checked.
    pub fn new(config: &ModelConfig) -> Result<Gpt2> {
        if let Some(key) = config.optional_keys().first() {
            return Err(bad(
                key,
                "set",
                "GPT-2 has no such setting: leave it out, or choose an architecture that has it",
            ));
        }
        let gpt = Gpt2 {
            vocab: config.vocab,
            seq: config.seq,
            hidden: config.hidden,
            heads: config.heads,
            layers: config.layers,
        };
        gpt.validate()?;
        Ok(gpt)
    }

    /// [`Gpt2::new`] for the registry.
    fn build(config: &ModelConfig) -> Result<Box<dyn Model>> {
        Ok(Box::new(Gpt2::new(config)?))
    }

    /// The GPT-3 family's shape of about `params` parameters (or one grown
    /// at the 1T model's aspect), at 2048 tokens with GPT-2's 50257-token
    /// vocabulary.
    fn for_params(params: f64) -> Result<ModelConfig> {
        let dense = strata_scheduler::Model::for_params(params)?;
        Ok(ModelConfig {
            arch: Arch::named(ARCHITECTURE.name)?,
            vocab: dense.vocab as usize,
            seq: dense.seq as usize,
            hidden: dense.hidden as usize,
            heads: dense.heads as usize,
            layers: dense.layers as usize,
            ..ModelConfig::default()
        })
    }

    /// The outer group: the token embedding (also the LM head), the
    /// position embedding, the final LayerNorm; every one read in f32 (the
    /// tables are looked up).
    fn outer_group(&self) -> GroupSpec {
        let (h, layout) = (self.hidden, EmbedLayout::new(self));
        let names: [(&str, Vec<usize>); 4] = [
            ("wte.weight", vec![self.vocab, h]),
            ("wpe.weight", vec![self.seq, h]),
            ("ln_f.weight", vec![h]),
            ("ln_f.bias", vec![h]),
        ];
        let tensors = layout.tensors().zip(names);
        GroupSpec {
            name: "embed".into(),
            tensors: tensors
                .map(|((range, decays), (name, shape))| TensorSpec {
                    name: name.into(),
                    shape,
                    range,
                    decays,
                    reads_f32: true,
                })
                .collect(),
        }
    }

    /// Block `b`: Hugging Face's `Conv1D` weights are input-major, as
    /// strata keeps them, so each tensor is its range as it is.
    fn block_group(&self, b: usize) -> GroupSpec {
        let (h, layout) = (self.hidden, BlockLayout::new(self.hidden));
        let names: [(&str, Vec<usize>); 12] = [
            ("ln_1.weight", vec![h]),
            ("ln_1.bias", vec![h]),
            ("attn.c_attn.weight", vec![h, 3 * h]),
            ("attn.c_attn.bias", vec![3 * h]),
            ("attn.c_proj.weight", vec![h, h]),
            ("attn.c_proj.bias", vec![h]),
            ("ln_2.weight", vec![h]),
            ("ln_2.bias", vec![h]),
            ("mlp.c_fc.weight", vec![h, 4 * h]),
            ("mlp.c_fc.bias", vec![4 * h]),
            ("mlp.c_proj.weight", vec![4 * h, h]),
            ("mlp.c_proj.bias", vec![h]),
        ];
        GroupSpec {
            name: format!("block{b}"),
            tensors: layout
                .tensors()
                .zip(names)
                .map(|((range, matrix), (name, shape))| TensorSpec {
                    name: format!("h.{b}.{name}"),
                    shape,
                    range,
                    decays: matrix,
                    reads_f32: !matrix,
                })
                .collect(),
        }
    }
}

impl Model for Gpt2 {
    fn arch(&self) -> &'static str {
        ARCHITECTURE.name
    }

    fn seq(&self) -> usize {
        self.seq
    }

    fn vocab(&self) -> usize {
        self.vocab
    }

    fn layers(&self) -> usize {
        self.layers
    }

    fn stream_width(&self) -> usize {
        self.hidden
    }

    fn groups(&self) -> Vec<GroupSpec> {
        let blocks = (0..self.layers).map(|b| self.block_group(b));
        std::iter::once(self.outer_group()).chain(blocks).collect()
    }

    fn params(&self) -> usize {
        Gpt2::params(self)
    }

    fn init(&self, g: usize, seed: u64, out: &mut [f32]) {
        init_group(self, g, seed, out);
    }

    fn block_forward_flops(&self, tokens: usize) -> f64 {
        // qkv 3h^2, proj h^2, the MLP 8h^2 multiply-adds a token.
        24.0 * tokens as f64 * (self.hidden * self.hidden) as f64
    }

    fn outer_costs(&self) -> OuterCosts {
        // Lookups, and the tied head's three products of the vocabulary
        // (small beside a block's at GPT-2's vocabulary and widths).
        OuterCosts {
            embed: 0.125,
            head: 0.5,
        }
    }

    fn buffers(&self, backend: &dyn Backend, batch: usize, dtype: Dtype) -> Result<Buffers> {
        let acts = activation_parts(backend, self, batch, dtype);
        Ok(Buffers {
            batch,
            input_elems: acts.lens[0],
            acts: acts.alloc(backend)?,
            scratch: scratch_parts(backend, self, batch, dtype).alloc(backend)?,
            head: head_parts(self, batch * self.seq, dtype).alloc(backend)?,
            head_rows: batch * self.seq,
        })
    }

    fn head_buffers(&self, backend: &dyn Backend, rows: usize) -> Result<Buffers> {
        Ok(Buffers {
            batch: 0,
            input_elems: 0,
            acts: backend.alloc(Dtype::F32, 0)?,
            scratch: backend.alloc(Dtype::F32, 0)?,
            head: head_parts(self, rows, Dtype::F32).alloc(backend)?,
            head_rows: rows,
        })
    }

    fn embed_forward(
        &self,
        backend: &dyn Backend,
        embed: View<'_>,
        tokens: View<'_>,
        position_ids: View<'_>,
        x: ViewMut<'_>,
    ) -> Result<()> {
        let layout = EmbedLayout::new(self);
        expect_len("embedding parameters", embed.len(), layout.total)?;
        let [wte, wpe, _, _] = layout.parts.views(embed);
        backend.embedding(wte, wpe, tokens, position_ids, self.seq, x)?;
        Ok(())
    }

    fn block_forward(
        &self,
        backend: &dyn Backend,
        batch: usize,
        position_ids: View<'_>,
        params: Weights<'_>,
        x: View<'_>,
        buffers: &mut Buffers,
        out: ViewMut<'_>,
    ) -> Result<()> {
        let (n, h) = (batch * self.seq, self.hidden);
        let layout = BlockLayout::new(h);
        params.check("block parameters", layout.total)?;
        expect_len("block input", x.len(), n * h)?;
        expect_len("block output", out.len(), n * h)?;
        let p = layout.views(params);
        let dtype = buffers.dtype();
        let [workspace, ..] =
            scratch_parts(backend, self, batch, dtype).split(buffers.scratch.view_mut());
        let [
            input,
            mut a,
            ln1,
            mut qkv,
            saved,
            mut att,
            mut x1,
            c,
            ln2,
            f,
            g,
        ] = activation_parts(backend, self, batch, dtype).split(buffers.acts.view_mut());
        backend.copy(x, input)?;
        backend.layer_norm(x, p[LN1_GAMMA], p[LN1_BETA], a.reborrow(), ln1)?;
        linear(backend, a.view(), p[QKV_W], p[QKV_B], n, qkv.reborrow())?;
        backend.attention(
            attention_shape(self, batch),
            position_ids,
            qkv.view(),
            att.reborrow(),
            saved,
            workspace,
        )?;
        linear(backend, att.view(), p[PROJ_W], p[PROJ_B], n, x1.reborrow())?;
        backend.add(x1.reborrow(), x)?;
        mlp(backend, &p, n, x1.view(), [c, ln2, f, g], out)
    }

    fn block_backward(
        &self,
        backend: &dyn Backend,
        batch: usize,
        position_ids: View<'_>,
        params: Weights<'_>,
        dout: View<'_>,
        buffers: &mut Buffers,
        mut dx: ViewMut<'_>,
        dparams: ViewMut<'_>,
    ) -> Result<()> {
        let (n, h) = (batch * self.seq, self.hidden);
        let layout = BlockLayout::new(h);
        params.check("block parameters", layout.total)?;
        expect_len("block gradients", dparams.len(), layout.total)?;
        expect_len("block output gradient", dout.len(), n * h)?;
        expect_len("block input gradient", dx.len(), n * h)?;
        let p = layout.views(params);
        let dtype = buffers.dtype();
        let [x, a, ln1, qkv, saved, att, x1, c, ln2, f, g] =
            activation_parts(backend, self, batch, dtype).views(buffers.acts.view());
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
        let [
            workspace,
            mut datt,
            mut dqkv,
            mut dx1,
            mut dc,
            mut dg,
            mut df,
            mut da,
        ] = scratch_parts(backend, self, batch, dtype).split(buffers.scratch.view_mut());
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
            attention_shape(self, batch),
            position_ids,
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

    fn head_forward_backward(
        &self,
        backend: &dyn Backend,
        embed: Weights<'_>,
        x: View<'_>,
        targets: View<'_>,
        grad_scale: f32,
        buffers: &mut Buffers,
        mut dx: ViewMut<'_>,
        dembed: ViewMut<'_>,
    ) -> Result<Readback> {
        let (h, v) = (self.hidden, self.vocab);
        let n = targets.len();
        let layout = EmbedLayout::new(self);
        embed.check("embedding parameters", layout.total)?;
        expect_len("embedding gradients", dembed.len(), layout.total)?;
        expect_len("head input", x.len(), n * h)?;
        let [_, _, gamma, beta] = layout.parts.views(embed.f32);
        let wte = embed.compute.range(layout.range(0)).matrix(v, h)?;
        expect_len("head targets", n, buffers.batch * self.seq)?;
        let parts = head_parts(self, buffers.head_rows, buffers.dtype());
        let [mut hf, mut ln, mut logits, mut dlogits, mut dhf] =
            parts.split(buffers.head.view_mut());
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

    fn head_logits(
        &self,
        backend: &dyn Backend,
        embed: Weights<'_>,
        x: View<'_>,
        buffers: &mut Buffers,
        logits: ViewMut<'_>,
    ) -> Result<()> {
        let (h, v) = (self.hidden, self.vocab);
        let layout = EmbedLayout::new(self);
        embed.check("embedding parameters", layout.total)?;
        let n = x.len() / h;
        expect_len("head input", x.len(), n * h)?;
        let parts = head_parts(self, buffers.head_rows, buffers.dtype());
        if n * h > parts.lens[0] {
            expect_len("head buffers", parts.lens[0], n * h)?;
        }
        expect_len("logits", logits.len(), n * v)?;
        let [_, _, gamma, beta] = layout.parts.views(embed.f32);
        let wte = embed.compute.range(layout.range(0));
        let [hf, ln, ..] = parts.split(buffers.head.view_mut());
        let (mut hf, ln) = (hf.range(0..n * h), ln.range(0..2 * n));
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

    fn kv_cache_elems(&self, capacity: usize) -> usize {
        2 * capacity * self.hidden
    }

    fn decode_scratch_elems(&self) -> usize {
        decode_parts(self.hidden).total()
    }

    fn block_decode(
        &self,
        backend: &dyn Backend,
        params: Weights<'_>,
        position: usize,
        x: View<'_>,
        cache: ViewMut<'_>,
        scratch: ViewMut<'_>,
        out: ViewMut<'_>,
    ) -> Result<()> {
        let h = self.hidden;
        let layout = BlockLayout::new(h);
        params.check("block parameters", layout.total)?;
        expect_len("block input", x.len(), h)?;
        expect_len("block output", out.len(), h)?;
        expect_len("decode scratch", scratch.len(), self.decode_scratch_elems())?;
        let p = layout.views(params);
        let [mut a, ln1, mut qkv, mut att, mut x1, c, ln2, f, g] = decode_parts(h).split(scratch);
        backend.layer_norm(x, p[LN1_GAMMA], p[LN1_BETA], a.reborrow(), ln1)?;
        linear(backend, a.view(), p[QKV_W], p[QKV_B], 1, qkv.reborrow())?;
        let shape = attention_shape(self, 1);
        attend_cached(backend, shape, position, qkv.view(), cache, att.reborrow())?;
        linear(backend, att.view(), p[PROJ_W], p[PROJ_B], 1, x1.reborrow())?;
        backend.add(x1.reborrow(), x)?;
        mlp(backend, &p, 1, x1.view(), [c, ln2, f, g], out)
    }

    fn embed_backward(
        &self,
        backend: &dyn Backend,
        tokens: View<'_>,
        position_ids: View<'_>,
        dx: View<'_>,
        dembed: ViewMut<'_>,
    ) -> Result<()> {
        let layout = EmbedLayout::new(self);
        expect_len("embedding gradients", dembed.len(), layout.total)?;
        let [dwte, dwpe, _] = layout.split_grads(dembed);
        backend.embedding_backward(tokens, position_ids, self.seq, dx, dwte, dwpe)?;
        Ok(())
    }

    fn hf_config(&self) -> serde_json::Value {
        hf_config(self)
    }

    fn cost_model(&self, micro_batch: u64) -> strata_scheduler::Model {
        strata_scheduler::Model {
            micro_batch,
            ..strata_scheduler::Model::dense(
                self.layers as u32,
                self.hidden as u64,
                self.heads as u32,
                self.seq as u64,
                self.vocab as u64,
            )
        }
    }
}

/// GPT-2's initialization of group `g`, the same whatever the ranks: normal
/// (0, 0.02) weights, residual projections scaled by 1/sqrt(2 layers),
/// LayerNorm scales 1, biases 0.
fn init_group(gpt: &Gpt2, g: usize, seed: u64, out: &mut [f32]) {
    let mut rng = SplitMix64(seed ^ (g as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15));
    let h = gpt.hidden;
    if g == 0 {
        let layout = EmbedLayout::new(gpt);
        let matrices = gpt.vocab * h + gpt.seq * h;
        fill_normal(&mut out[..matrices], 0.02, &mut rng);
        out[matrices..matrices + h].fill(1.0);
        out[matrices + h..layout.total].fill(0.0);
        return;
    }
    let layout = BlockLayout::new(h);
    let residual = 0.02 / (2.0 * gpt.layers as f32).sqrt();
    // Parts in layout order: ln1 (g, b), qkv (w, b), proj (w, b), ln2 (g,
    // b), fc1 (w, b), fc2 (w, b).
    let sizes = [
        h,
        h,
        3 * h * h,
        3 * h,
        h * h,
        h,
        h,
        h,
        4 * h * h,
        4 * h,
        4 * h * h,
        h,
    ];
    let mut at = 0;
    for (part, size) in sizes.iter().enumerate() {
        let piece = &mut out[at..at + size];
        match part {
            0 | 6 => piece.fill(1.0),
            2 | 8 => fill_normal(piece, 0.02, &mut rng),
            4 | 10 => fill_normal(piece, residual, &mut rng),
            _ => piece.fill(0.0),
        }
        at += size;
    }
    debug_assert_eq!(at, layout.total);
}

/// A Hugging Face `GPT2Config` of `gpt` as strata computes it, for
/// `GPT2LMHeadModel.from_pretrained(step_dir)`: the tanh GELU
/// (`gelu_new`), the kernels' LayerNorm epsilon, attention scaled by
/// `1/sqrt(head_dim)` alone, the LM head tied to `wte`, no dropout, and no
/// BOS/EOS token (byte-level tokens have none; GPT-2's 50256 would lie
/// outside the vocabulary).
fn hf_config(gpt: &Gpt2) -> serde_json::Value {
    // Through its shortest decimal form, so that 1e-5f32 is written 1e-5.
    let epsilon: f64 = strata_kernels::cpu::ops::LN_EPS
        .to_string()
        .parse()
        .expect("a float's decimal form parses");
    serde_json::json!({
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        "vocab_size": gpt.vocab,
        "n_positions": gpt.seq,
        "n_ctx": gpt.seq,
        "n_embd": gpt.hidden,
        "n_layer": gpt.layers,
        "n_head": gpt.heads,
        "n_inner": 4 * gpt.hidden,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": epsilon,
        "scale_attn_weights": true,
        "scale_attn_by_inverse_layer_idx": false,
        "reorder_and_upcast_attn": false,
        "tie_word_embeddings": true,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "bos_token_id": null,
        "eos_token_id": null,
        "use_cache": true,
        "dtype": "float32",
        "torch_dtype": "float32",
    })
}

impl Gpt2 {
    /// The `[model]` table of a `GPT2Config`: `vocab_size`, `n_positions`
    /// (the position table's rows, so the sequence), `n_embd`, `n_layer`,
    /// `n_head`. What strata does not compute that way is refused by key:
    /// an `n_inner` other than 4 x `n_embd`, another activation than
    /// `gelu_new`, an untied head, another LayerNorm epsilon, attention
    /// scaled by the layer index.
    fn from_hf_config(json: &serde_json::Value) -> Result<ModelConfig> {
        let size = |key: &'static str| -> Result<usize> {
            json.get(key)
                .and_then(serde_json::Value::as_u64)
                .map(|v| v as usize)
                .ok_or_else(|| {
                    bad(
                        key,
                        json.get(key).map_or("(none)".into(), |v| v.to_string()),
                        "a GPT2Config gives it as a whole number",
                    )
                })
        };
        let config = ModelConfig {
            arch: Arch::named(ARCHITECTURE.name)?,
            vocab: size("vocab_size")?,
            seq: size("n_positions")?,
            hidden: size("n_embd")?,
            heads: size("n_head")?,
            layers: size("n_layer")?,
            ..ModelConfig::default()
        };
        let refuse = |key: &'static str, value: &serde_json::Value, fix: &str| {
            Err(bad(
                key,
                value,
                format!("{fix}: strata's GPT-2 computes only that"),
            ))
        };
        let null = serde_json::Value::Null;
        let get = |key: &str| json.get(key).unwrap_or(&null);
        match get("n_inner") {
            serde_json::Value::Null => {}
            v if v.as_u64() == Some(4 * config.hidden as u64) => {}
            v => return refuse("n_inner", v, "give null or 4 x n_embd"),
        }
        match get("activation_function") {
            serde_json::Value::Null => {}
            v if v.as_str() == Some("gelu_new") => {}
            v => return refuse("activation_function", v, "give \"gelu_new\""),
        }
        match get("tie_word_embeddings") {
            serde_json::Value::Null | serde_json::Value::Bool(true) => {}
            v => return refuse("tie_word_embeddings", v, "give true"),
        }
        match get("scale_attn_by_inverse_layer_idx") {
            serde_json::Value::Null | serde_json::Value::Bool(false) => {}
            v => return refuse("scale_attn_by_inverse_layer_idx", v, "give false"),
        }
        let epsilon = f64::from(strata_kernels::cpu::ops::LN_EPS);
        match get("layer_norm_epsilon") {
            serde_json::Value::Null => {}
            v if v.as_f64().is_some_and(|e| (e - epsilon).abs() <= 1e-9) => {}
            v => return refuse("layer_norm_epsilon", v, "give 1e-5"),
        }
        Gpt2::new(&config)?;
        Ok(config)
    }
}

#[cfg(test)]
mod hf;
#[cfg(test)]
mod tests;
