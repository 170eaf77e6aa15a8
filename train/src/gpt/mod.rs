//! A GPT-2-style model with a hand-written forward and backward per block,
//! so that the caller decides when each block's parameters are present
//! (what DeepSpeed does with module hooks): token and position embeddings,
//! pre-LayerNorm blocks (causal multi-head attention, GELU MLP), a final
//! LayerNorm, an LM head tied to the token embedding, cross-entropy.
//!
//! Parameters of a block are one flat `f32` slice ([`BlockLayout`]); so are
//! the embeddings ([`EmbedLayout`]). Matrix products go through
//! `matrixmultiply` ([`gemm`]); the rest are the kernels in [`kernels`].

use crate::error::TrainError;
use strata_kernels::cpu::gemm::{Operand, gemm};
use strata_kernels::cpu::ops::*;

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
    pub fn validate(&self) -> Result<(), TrainError> {
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
        if self.vocab > u32::MAX as usize {
            return bad("model.vocab", self.vocab, "at most 2^32 tokens".into());
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

/// Where each tensor of a block sits in its flat parameter slice.
#[derive(Debug, Clone, Copy)]
pub struct BlockLayout {
    /// Offsets of ln1 gamma, ln1 beta, qkv weight, qkv bias, proj weight,
    /// proj bias, ln2 gamma, ln2 beta, fc1 weight, fc1 bias, fc2 weight,
    /// fc2 bias, and the end.
    offsets: [usize; 13],
    /// Parameters in the block.
    pub total: usize,
}

impl BlockLayout {
    /// The layout for hidden size `h` (weights stored input-major:
    /// `y = x W + b`).
    pub fn new(h: usize) -> Self {
        let sizes = [
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
        ];
        let mut offsets = [0; 13];
        for (i, size) in sizes.iter().enumerate() {
            offsets[i + 1] = offsets[i] + size;
        }
        BlockLayout {
            offsets,
            total: offsets[12],
        }
    }

    fn part<'a>(&self, p: &'a [f32], i: usize) -> &'a [f32] {
        &p[self.offsets[i]..self.offsets[i + 1]]
    }

    /// Whether parameter `index` is a weight matrix (decayed by AdamW),
    /// not a bias or a LayerNorm scale.
    pub fn is_matrix(&self, index: usize) -> bool {
        [2, 4, 8, 10]
            .iter()
            .any(|&i| (self.offsets[i]..self.offsets[i + 1]).contains(&index))
    }
}

/// Where each tensor of the embeddings sits: token embedding (`vocab x
/// hidden`, also the LM head), position embedding (`seq x hidden`), final
/// LayerNorm gamma and beta.
#[derive(Debug, Clone, Copy)]
pub struct EmbedLayout {
    offsets: [usize; 5],
    /// Parameters.
    pub total: usize,
}

impl EmbedLayout {
    /// The layout for `config`.
    pub fn new(config: &GptConfig) -> Self {
        let h = config.hidden;
        let sizes = [config.vocab * h, config.seq * h, h, h];
        let mut offsets = [0; 5];
        for (i, size) in sizes.iter().enumerate() {
            offsets[i + 1] = offsets[i] + size;
        }
        EmbedLayout {
            offsets,
            total: offsets[4],
        }
    }

    /// Whether parameter `index` is a weight matrix (the embeddings).
    pub fn is_matrix(&self, index: usize) -> bool {
        index < self.offsets[2]
    }
}

/// What a block's forward keeps for its backward, for `batch` sequences.
/// With activation checkpointing only the input is kept between passes,
/// and [`block_forward`] is run again into this before the backward.
#[derive(Debug)]
pub struct BlockActivations {
    x: Vec<f32>,
    a: Vec<f32>,
    mean1: Vec<f32>,
    rstd1: Vec<f32>,
    qkv: Vec<f32>,
    probs: Vec<f32>,
    att: Vec<f32>,
    x1: Vec<f32>,
    c: Vec<f32>,
    mean2: Vec<f32>,
    rstd2: Vec<f32>,
    f: Vec<f32>,
    g: Vec<f32>,
}

impl BlockActivations {
    /// Buffers for `batch` sequences of `config.seq` tokens.
    pub fn new(config: &GptConfig, batch: usize) -> Self {
        let (n, h) = (batch * config.seq, config.hidden);
        BlockActivations {
            x: vec![0.0; n * h],
            a: vec![0.0; n * h],
            mean1: vec![0.0; n],
            rstd1: vec![0.0; n],
            qkv: vec![0.0; n * 3 * h],
            probs: vec![0.0; batch * config.heads * config.seq * config.seq],
            att: vec![0.0; n * h],
            x1: vec![0.0; n * h],
            c: vec![0.0; n * h],
            mean2: vec![0.0; n],
            rstd2: vec![0.0; n],
            f: vec![0.0; n * 4 * h],
            g: vec![0.0; n * 4 * h],
        }
    }

    fn parts(&self) -> [&Vec<f32>; 13] {
        [
            &self.x,
            &self.a,
            &self.mean1,
            &self.rstd1,
            &self.qkv,
            &self.probs,
            &self.att,
            &self.x1,
            &self.c,
            &self.mean2,
            &self.rstd2,
            &self.f,
            &self.g,
        ]
    }

    /// Floats these buffers hold.
    pub fn floats(&self) -> usize {
        self.parts().iter().map(|v| v.len()).sum()
    }

    /// Bytes these buffers hold.
    pub fn bytes(&self) -> u64 {
        4 * self.floats() as u64
    }

    /// The forward's input (what activation checkpointing keeps).
    pub fn input(&self) -> &[f32] {
        &self.x
    }

    /// Copies every buffer, in order, into `out` (`floats()` long): what a
    /// run without checkpointing keeps between forward and backward.
    pub fn save(&self, out: &mut [f32]) {
        assert_eq!(out.len(), self.floats(), "saved activations");
        let mut at = 0;
        for part in self.parts() {
            out[at..at + part.len()].copy_from_slice(part);
            at += part.len();
        }
    }

    /// The inverse of [`BlockActivations::save`].
    pub fn load(&mut self, from: &[f32]) {
        assert_eq!(from.len(), self.floats(), "saved activations");
        let mut at = 0;
        for part in [
            &mut self.x,
            &mut self.a,
            &mut self.mean1,
            &mut self.rstd1,
            &mut self.qkv,
            &mut self.probs,
            &mut self.att,
            &mut self.x1,
            &mut self.c,
            &mut self.mean2,
            &mut self.rstd2,
            &mut self.f,
            &mut self.g,
        ] {
            let len = part.len();
            part.copy_from_slice(&from[at..at + len]);
            at += len;
        }
    }
}

/// Working buffers of a block's backward, sized once.
#[derive(Debug)]
pub struct BlockScratch {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    o: Vec<f32>,
    dp: Vec<f32>,
    dq: Vec<f32>,
    dk: Vec<f32>,
    dv: Vec<f32>,
    datt: Vec<f32>,
    dqkv: Vec<f32>,
    dx1: Vec<f32>,
    dc: Vec<f32>,
    dg: Vec<f32>,
    df: Vec<f32>,
    da: Vec<f32>,
}

impl BlockScratch {
    /// Buffers for `batch` sequences.
    pub fn new(config: &GptConfig, batch: usize) -> Self {
        let (n, h, s) = (batch * config.seq, config.hidden, config.seq);
        let d = h / config.heads;
        BlockScratch {
            q: vec![0.0; s * d],
            k: vec![0.0; s * d],
            v: vec![0.0; s * d],
            o: vec![0.0; s * d],
            dp: vec![0.0; s * s],
            dq: vec![0.0; s * d],
            dk: vec![0.0; s * d],
            dv: vec![0.0; s * d],
            datt: vec![0.0; n * h],
            dqkv: vec![0.0; n * 3 * h],
            dx1: vec![0.0; n * h],
            dc: vec![0.0; n * h],
            dg: vec![0.0; n * 4 * h],
            df: vec![0.0; n * 4 * h],
            da: vec![0.0; n * h],
        }
    }
}

impl BlockScratch {
    /// Bytes these buffers hold.
    pub fn bytes(&self) -> u64 {
        let s = self;
        let floats: usize = [
            &s.q, &s.k, &s.v, &s.o, &s.dp, &s.dq, &s.dk, &s.dv, &s.datt, &s.dqkv, &s.dx1, &s.dc,
            &s.dg, &s.df, &s.da,
        ]
        .iter()
        .map(|v| v.len())
        .sum();
        4 * floats as u64
    }
}

/// One attention head's block of a row-major matrix: `rows` rows from
/// `row0`, `d` columns from `col`, copied to and from a contiguous
/// `rows x d` buffer.
#[derive(Clone, Copy)]
struct HeadBlock {
    row0: usize,
    rows: usize,
    col: usize,
    d: usize,
}

impl HeadBlock {
    /// Pairs of (range in the matrix of row width `width`, columns shifted
    /// by `part`; range in the buffer), one per row.
    fn rows(
        self,
        width: usize,
        part: usize,
    ) -> impl Iterator<Item = (std::ops::Range<usize>, std::ops::Range<usize>)> {
        (0..self.rows).map(move |i| {
            let from = (self.row0 + i) * width + part + self.col;
            (from..from + self.d, i * self.d..(i + 1) * self.d)
        })
    }

    fn gather(self, matrix: &[f32], width: usize, part: usize, buffer: &mut [f32]) {
        for (m, b) in self.rows(width, part) {
            buffer[b].copy_from_slice(&matrix[m]);
        }
    }

    fn scatter(self, buffer: &[f32], width: usize, part: usize, matrix: &mut [f32]) {
        for (m, b) in self.rows(width, part) {
            matrix[m].copy_from_slice(&buffer[b]);
        }
    }

    /// This head's query, key and value from `qkv` (`rows x 3h`).
    fn gather_qkv(self, qkv: &[f32], h: usize, q: &mut [f32], k: &mut [f32], v: &mut [f32]) {
        for (part, buffer) in [q, k, v].into_iter().enumerate() {
            self.gather(qkv, 3 * h, part * h, buffer);
        }
    }
}

/// A linear layer's backward: `dw += x^T dy`, `db += colsum(dy)`,
/// `dx = dy w^T`, with `x` `rows x inputs` and `w` `inputs x outputs`.
#[allow(clippy::too_many_arguments)]
fn linear_backward(
    x: &[f32],
    w: &[f32],
    dy: &[f32],
    rows: usize,
    inputs: usize,
    outputs: usize,
    dw: &mut [f32],
    db: &mut [f32],
    dx: &mut [f32],
) {
    gemm(
        Operand::t(x, inputs, rows),
        Operand::new(dy, rows, outputs),
        1.0,
        dw,
    );
    bias_backward(dy, db);
    gemm(
        Operand::new(dy, rows, outputs),
        Operand::t(w, outputs, inputs),
        0.0,
        dx,
    );
}

/// A linear layer: `y = x w + b`.
fn linear(x: &[f32], w: &[f32], b: &[f32], rows: usize, inputs: usize, y: &mut [f32]) {
    gemm(
        Operand::new(x, rows, inputs),
        Operand::new(w, inputs, b.len()),
        0.0,
        y,
    );
    add_bias(y, b);
}

/// One block's forward for `batch` sequences: `out = block(x)`, keeping
/// what the backward needs in `acts`.
pub fn block_forward(
    config: &GptConfig,
    batch: usize,
    params: &[f32],
    x: &[f32],
    acts: &mut BlockActivations,
    scratch: &mut BlockScratch,
    out: &mut [f32],
) {
    let (s, h, heads) = (config.seq, config.hidden, config.heads);
    let (n, d) = (batch * s, h / heads);
    let layout = BlockLayout::new(h);
    assert_eq!(params.len(), layout.total, "block parameters");
    assert_eq!(x.len(), n * h, "block input");
    let p = |i| layout.part(params, i);
    acts.x.copy_from_slice(x);
    layer_norm(
        x,
        p(0),
        p(1),
        h,
        &mut acts.a,
        &mut acts.mean1,
        &mut acts.rstd1,
    );
    linear(&acts.a, p(2), p(3), n, h, &mut acts.qkv);
    let scale = 1.0 / (d as f32).sqrt();
    for b in 0..batch {
        for head in 0..heads {
            let block = HeadBlock {
                row0: b * s,
                rows: s,
                col: head * d,
                d,
            };
            block.gather_qkv(&acts.qkv, h, &mut scratch.q, &mut scratch.k, &mut scratch.v);
            let probs = &mut acts.probs[(b * heads + head) * s * s..][..s * s];
            gemm(
                Operand::new(&scratch.q, s, d),
                Operand::t(&scratch.k, d, s),
                0.0,
                probs,
            );
            causal_softmax(probs, s, scale);
            gemm(
                Operand::new(probs, s, s),
                Operand::new(&scratch.v, s, d),
                0.0,
                &mut scratch.o,
            );
            block.scatter(&scratch.o, h, 0, &mut acts.att);
        }
    }
    linear(&acts.att, p(4), p(5), n, h, &mut acts.x1);
    for (v, xi) in acts.x1.iter_mut().zip(x) {
        *v += xi;
    }
    layer_norm(
        &acts.x1,
        p(6),
        p(7),
        h,
        &mut acts.c,
        &mut acts.mean2,
        &mut acts.rstd2,
    );
    linear(&acts.c, p(8), p(9), n, h, &mut acts.f);
    gelu(&acts.f, &mut acts.g);
    linear(&acts.g, p(10), p(11), n, 4 * h, out);
    for (v, x1) in out.iter_mut().zip(&acts.x1) {
        *v += x1;
    }
}

/// One block's backward from the activations of its forward: writes `dx`
/// and adds the parameter gradients to `dparams`.
#[allow(clippy::too_many_arguments)]
pub fn block_backward(
    config: &GptConfig,
    batch: usize,
    params: &[f32],
    acts: &BlockActivations,
    dout: &[f32],
    scratch: &mut BlockScratch,
    dx: &mut [f32],
    dparams: &mut [f32],
) {
    let (s, h, heads) = (config.seq, config.hidden, config.heads);
    let (n, d) = (batch * s, h / heads);
    let layout = BlockLayout::new(h);
    assert_eq!(dparams.len(), layout.total, "block gradients");
    let p = |i| layout.part(params, i);
    let o = layout.offsets;
    let (ln1g, rest) = dparams.split_at_mut(o[1]);
    let (ln1b, rest) = rest.split_at_mut(o[2] - o[1]);
    let (wqkv, rest) = rest.split_at_mut(o[3] - o[2]);
    let (bqkv, rest) = rest.split_at_mut(o[4] - o[3]);
    let (wproj, rest) = rest.split_at_mut(o[5] - o[4]);
    let (bproj, rest) = rest.split_at_mut(o[6] - o[5]);
    let (ln2g, rest) = rest.split_at_mut(o[7] - o[6]);
    let (ln2b, rest) = rest.split_at_mut(o[8] - o[7]);
    let (wfc1, rest) = rest.split_at_mut(o[9] - o[8]);
    let (bfc1, rest) = rest.split_at_mut(o[10] - o[9]);
    let (wfc2, bfc2) = rest.split_at_mut(o[11] - o[10]);
    // MLP.
    linear_backward(
        &acts.g,
        p(10),
        dout,
        n,
        4 * h,
        h,
        wfc2,
        bfc2,
        &mut scratch.dg,
    );
    gelu_backward(&scratch.dg, &acts.f, &mut scratch.df);
    linear_backward(
        &acts.c,
        p(8),
        &scratch.df,
        n,
        h,
        4 * h,
        wfc1,
        bfc1,
        &mut scratch.dc,
    );
    scratch.dx1.copy_from_slice(dout);
    layer_norm_backward(
        &scratch.dc,
        &acts.x1,
        p(6),
        &acts.mean2,
        &acts.rstd2,
        h,
        &mut scratch.dx1,
        ln2g,
        ln2b,
    );
    // Attention.
    linear_backward(
        &acts.att,
        p(4),
        &scratch.dx1,
        n,
        h,
        h,
        wproj,
        bproj,
        &mut scratch.datt,
    );
    let scale = 1.0 / (d as f32).sqrt();
    for b in 0..batch {
        for head in 0..heads {
            let probs = &acts.probs[(b * heads + head) * s * s..][..s * s];
            let block = HeadBlock {
                row0: b * s,
                rows: s,
                col: head * d,
                d,
            };
            block.gather_qkv(&acts.qkv, h, &mut scratch.q, &mut scratch.k, &mut scratch.v);
            block.gather(&scratch.datt, h, 0, &mut scratch.o);
            gemm(
                Operand::new(&scratch.o, s, d),
                Operand::t(&scratch.v, d, s),
                0.0,
                &mut scratch.dp,
            );
            gemm(
                Operand::t(probs, s, s),
                Operand::new(&scratch.o, s, d),
                0.0,
                &mut scratch.dv,
            );
            causal_softmax_backward(probs, &mut scratch.dp, s, scale);
            gemm(
                Operand::new(&scratch.dp, s, s),
                Operand::new(&scratch.k, s, d),
                0.0,
                &mut scratch.dq,
            );
            gemm(
                Operand::t(&scratch.dp, s, s),
                Operand::new(&scratch.q, s, d),
                0.0,
                &mut scratch.dk,
            );
            for (part, buffer) in [&scratch.dq, &scratch.dk, &scratch.dv]
                .into_iter()
                .enumerate()
            {
                block.scatter(buffer, 3 * h, part * h, &mut scratch.dqkv);
            }
        }
    }
    linear_backward(
        &acts.a,
        p(2),
        &scratch.dqkv,
        n,
        h,
        3 * h,
        wqkv,
        bqkv,
        &mut scratch.da,
    );
    dx.copy_from_slice(&scratch.dx1);
    layer_norm_backward(
        &scratch.da,
        &acts.x,
        p(0),
        &acts.mean1,
        &acts.rstd1,
        h,
        dx,
        ln1g,
        ln1b,
    );
}

/// The embeddings' forward: `x[b, t] = wte[tokens[b, t]] + wpe[t]`.
pub fn embed_forward(config: &GptConfig, embed: &[f32], tokens: &[u32], x: &mut [f32]) {
    let (s, h) = (config.seq, config.hidden);
    let layout = EmbedLayout::new(config);
    let (wte, wpe) = (
        &embed[..layout.offsets[1]],
        &embed[layout.offsets[1]..layout.offsets[2]],
    );
    for (i, (&token, row)) in tokens.iter().zip(x.chunks_exact_mut(h)).enumerate() {
        let (te, pe) = (&wte[token as usize * h..][..h], &wpe[(i % s) * h..][..h]);
        for j in 0..h {
            row[j] = te[j] + pe[j];
        }
    }
}

/// Buffers of the head (final LayerNorm, tied LM head, loss).
#[derive(Debug)]
pub struct HeadBuffers {
    hf: Vec<f32>,
    mean: Vec<f32>,
    rstd: Vec<f32>,
    logits: Vec<f32>,
    dlogits: Vec<f32>,
    dhf: Vec<f32>,
}

impl HeadBuffers {
    /// Buffers for `batch` sequences.
    pub fn new(config: &GptConfig, batch: usize) -> Self {
        let (n, h) = (batch * config.seq, config.hidden);
        HeadBuffers {
            hf: vec![0.0; n * h],
            mean: vec![0.0; n],
            rstd: vec![0.0; n],
            logits: vec![0.0; n * config.vocab],
            dlogits: vec![0.0; n * config.vocab],
            dhf: vec![0.0; n * h],
        }
    }
}

impl HeadBuffers {
    /// Bytes these buffers hold.
    pub fn bytes(&self) -> u64 {
        let b = self;
        let floats: usize = [&b.hf, &b.mean, &b.rstd, &b.logits, &b.dlogits, &b.dhf]
            .iter()
            .map(|v| v.len())
            .sum();
        4 * floats as u64
    }
}

/// The head's forward and backward: the mean cross-entropy of the last
/// block's output `x` against `targets`; writes `dx` and adds to the
/// embedding gradients `dembed` (tied LM head, final LayerNorm), both
/// multiplied by `grad_scale`.
#[allow(clippy::too_many_arguments)]
pub fn head_forward_backward(
    config: &GptConfig,
    embed: &[f32],
    x: &[f32],
    targets: &[u32],
    grad_scale: f32,
    buffers: &mut HeadBuffers,
    dx: &mut [f32],
    dembed: &mut [f32],
) -> f32 {
    let (h, v) = (config.hidden, config.vocab);
    let n = targets.len();
    let layout = EmbedLayout::new(config);
    let o = layout.offsets;
    let wte = &embed[..o[1]];
    let (gamma, beta) = (&embed[o[2]..o[3]], &embed[o[3]..o[4]]);
    layer_norm(
        x,
        gamma,
        beta,
        h,
        &mut buffers.hf,
        &mut buffers.mean,
        &mut buffers.rstd,
    );
    gemm(
        Operand::new(&buffers.hf, n, h),
        Operand::t(wte, h, v),
        0.0,
        &mut buffers.logits,
    );
    let loss = cross_entropy(
        &buffers.logits,
        targets,
        v,
        grad_scale,
        &mut buffers.dlogits,
    );
    gemm(
        Operand::new(&buffers.dlogits, n, v),
        Operand::new(wte, v, h),
        0.0,
        &mut buffers.dhf,
    );
    let (dwte, rest) = dembed.split_at_mut(o[1]);
    gemm(
        Operand::t(&buffers.dlogits, v, n),
        Operand::new(&buffers.hf, n, h),
        1.0,
        dwte,
    );
    let (dgamma, dbeta) = rest[o[2] - o[1]..].split_at_mut(h);
    dx.fill(0.0);
    layer_norm_backward(
        &buffers.dhf,
        x,
        gamma,
        &buffers.mean,
        &buffers.rstd,
        h,
        dx,
        dgamma,
        dbeta,
    );
    loss
}

/// The embeddings' backward: adds `dx` to the rows of the token and
/// position embeddings it came from.
pub fn embed_backward(config: &GptConfig, tokens: &[u32], dx: &[f32], dembed: &mut [f32]) {
    let (s, h) = (config.seq, config.hidden);
    let layout = EmbedLayout::new(config);
    let (dwte, rest) = dembed.split_at_mut(layout.offsets[1]);
    let dwpe = &mut rest[..layout.offsets[2] - layout.offsets[1]];
    for (i, (&token, row)) in tokens.iter().zip(dx.chunks_exact(h)).enumerate() {
        let te = &mut dwte[token as usize * h..][..h];
        for j in 0..h {
            te[j] += row[j];
        }
        let pe = &mut dwpe[(i % s) * h..][..h];
        for j in 0..h {
            pe[j] += row[j];
        }
    }
}

#[cfg(test)]
mod tests;
