//! The model's element-wise and row kernels, free functions over slices.
//! Each has a scalar form only: they are memory-bound next to the matrix
//! products, which go through the GEMM crate. GELU, whose `tanh` is not,
//! cuts long slices across rayon's threads.

use rayon::prelude::*;

/// LayerNorm epsilon.
pub const LN_EPS: f32 = 1e-5;

/// `out = (x - mean) * rstd * gamma + beta` per row of `cols`; saves each
/// row's mean and 1/std for the backward pass.
pub fn layer_norm(
    x: &[f32],
    gamma: &[f32],
    beta: &[f32],
    cols: usize,
    out: &mut [f32],
    mean: &mut [f32],
    rstd: &mut [f32],
) {
    for (r, (row, o)) in x
        .chunks_exact(cols)
        .zip(out.chunks_exact_mut(cols))
        .enumerate()
    {
        let m = row.iter().sum::<f32>() / cols as f32;
        let var = row.iter().map(|v| (v - m) * (v - m)).sum::<f32>() / cols as f32;
        let s = 1.0 / (var + LN_EPS).sqrt();
        for j in 0..cols {
            o[j] = (row[j] - m) * s * gamma[j] + beta[j];
        }
        mean[r] = m;
        rstd[r] = s;
    }
}

/// Backward of [`layer_norm`]: adds to `dx`, `dgamma` and `dbeta`.
#[allow(clippy::too_many_arguments)]
pub fn layer_norm_backward(
    dout: &[f32],
    x: &[f32],
    gamma: &[f32],
    mean: &[f32],
    rstd: &[f32],
    cols: usize,
    dx: &mut [f32],
    dgamma: &mut [f32],
    dbeta: &mut [f32],
) {
    let n = cols as f32;
    for (r, ((d, row), dxr)) in dout
        .chunks_exact(cols)
        .zip(x.chunks_exact(cols))
        .zip(dx.chunks_exact_mut(cols))
        .enumerate()
    {
        let (m, s) = (mean[r], rstd[r]);
        let mut sum_dxhat = 0.0;
        let mut sum_dxhat_xhat = 0.0;
        for j in 0..cols {
            let xhat = (row[j] - m) * s;
            let dxhat = d[j] * gamma[j];
            sum_dxhat += dxhat;
            sum_dxhat_xhat += dxhat * xhat;
            dgamma[j] += d[j] * xhat;
            dbeta[j] += d[j];
        }
        for j in 0..cols {
            let xhat = (row[j] - m) * s;
            let dxhat = d[j] * gamma[j];
            dxr[j] += s * (dxhat - sum_dxhat / n - xhat * sum_dxhat_xhat / n);
        }
    }
}

const GELU_C: f32 = 0.797_884_6; // sqrt(2 / pi)

/// Elements below which an elementwise op stays on the caller's thread.
const PARALLEL_ELEMS_MIN: usize = 1 << 15;
/// Elements per piece of an elementwise op cut across rayon's threads
/// (some 100 us of `tanh`). Each element is computed as on one thread, so
/// the bits do not depend on the cut.
const PIECE_ELEMS: usize = 1 << 14;

/// GELU, tanh approximation (transformers' `gelu_new`). libm's `tanh`
/// made it about a third of a small model's step on one core, so a long
/// slice is cut across threads.
pub fn gelu(x: &[f32], out: &mut [f32]) {
    assert_eq!(x.len(), out.len(), "gelu: x and out differ in length");
    if x.len() < PARALLEL_ELEMS_MIN {
        return gelu_piece(x, out);
    }
    out.par_chunks_mut(PIECE_ELEMS)
        .zip(x.par_chunks(PIECE_ELEMS))
        .for_each(|(out, x)| gelu_piece(x, out));
}

fn gelu_piece(x: &[f32], out: &mut [f32]) {
    for (o, &v) in out.iter_mut().zip(x) {
        let t = (GELU_C * (v + 0.044_715 * v * v * v)).tanh();
        *o = 0.5 * v * (1.0 + t);
    }
}

/// Backward of [`gelu`]: `dx = dout * gelu'(x)`, cut across threads as it.
pub fn gelu_backward(dout: &[f32], x: &[f32], dx: &mut [f32]) {
    assert!(
        dout.len() == x.len() && x.len() == dx.len(),
        "gelu_backward: dout, x and dx differ in length"
    );
    if x.len() < PARALLEL_ELEMS_MIN {
        return gelu_backward_piece(dout, x, dx);
    }
    dx.par_chunks_mut(PIECE_ELEMS)
        .zip(dout.par_chunks(PIECE_ELEMS))
        .zip(x.par_chunks(PIECE_ELEMS))
        .for_each(|((dx, dout), x)| gelu_backward_piece(dout, x, dx));
}

fn gelu_backward_piece(dout: &[f32], x: &[f32], dx: &mut [f32]) {
    for ((g, &d), &v) in dx.iter_mut().zip(dout).zip(x) {
        let u = GELU_C * (v + 0.044_715 * v * v * v);
        let t = u.tanh();
        let du = GELU_C * (1.0 + 3.0 * 0.044_715 * v * v);
        *g = d * (0.5 * (1.0 + t) + 0.5 * v * (1.0 - t * t) * du);
    }
}

/// Adds `bias` to every row of `x`.
pub fn add_bias(x: &mut [f32], bias: &[f32]) {
    for row in x.chunks_exact_mut(bias.len()) {
        for (v, b) in row.iter_mut().zip(bias) {
            *v += b;
        }
    }
}

/// Adds the column sums of `d` to `dbias`.
pub fn bias_backward(d: &[f32], dbias: &mut [f32]) {
    for row in d.chunks_exact(dbias.len()) {
        for (b, v) in dbias.iter_mut().zip(row) {
            *b += v;
        }
    }
}

/// The first column row `i` of a sequence sees: 0, or with `position_ids`
/// (the rows' places in their documents) the row its document starts at.
fn first_seen(position_ids: &[u32], i: usize) -> usize {
    position_ids.get(i).map_or(0, |&p| i - p as usize)
}

/// Row-wise causal softmax of `scores` (`rows x rows`, row `i` sees
/// columns `first..=i`, `first` being 0 or, with `position_ids`, the
/// start of its document: `i - position_ids[i]`), scaled by `scale`, in
/// place; masked entries become 0.
pub fn causal_softmax(scores: &mut [f32], rows: usize, scale: f32, position_ids: &[u32]) {
    for (i, row) in scores.chunks_exact_mut(rows).enumerate() {
        let first = first_seen(position_ids, i);
        let seen = &mut row[first..=i];
        let max = seen
            .iter()
            .fold(f32::NEG_INFINITY, |m, &v| m.max(v * scale));
        let mut sum = 0.0;
        for v in seen.iter_mut() {
            *v = (*v * scale - max).exp();
            sum += *v;
        }
        for v in seen.iter_mut() {
            *v /= sum;
        }
        row[..first].fill(0.0);
        row[i + 1..].fill(0.0);
    }
}

/// Backward of [`causal_softmax`] in place: `dp` (gradient of the
/// probabilities `p`) becomes the gradient of the raw scores.
pub fn causal_softmax_backward(
    p: &[f32],
    dp: &mut [f32],
    rows: usize,
    scale: f32,
    position_ids: &[u32],
) {
    for (i, (pr, dr)) in p
        .chunks_exact(rows)
        .zip(dp.chunks_exact_mut(rows))
        .enumerate()
    {
        let first = first_seen(position_ids, i);
        let dot: f32 = pr[first..=i]
            .iter()
            .zip(&dr[first..=i])
            .map(|(a, b)| a * b)
            .sum();
        for j in first..=i {
            dr[j] = pr[j] * (dr[j] - dot) * scale;
        }
        dr[..first].fill(0.0);
        dr[i + 1..].fill(0.0);
    }
}

/// One query's attention over cached rows (online softmax: one pass, no
/// scratch): `out = sum_j softmax_j(scale q.k_j) v_j` over every row `j`
/// of `keys` and `values` (rows of `width`, the head's `d` elements from
/// `column`).
pub fn attend_one(
    query: &[f32],
    (keys, values): (&[f32], &[f32]),
    (width, column): (usize, usize),
    scale: f32,
    out: &mut [f32],
) {
    let d = query.len();
    let (mut max, mut sum) = (f32::NEG_INFINITY, 0.0f32);
    out.fill(0.0);
    for (key, value) in keys.chunks_exact(width).zip(values.chunks_exact(width)) {
        let (key, value) = (&key[column..column + d], &value[column..column + d]);
        let score = query.iter().zip(key).map(|(a, b)| a * b).sum::<f32>() * scale;
        if score > max {
            let shrink = (max - score).exp();
            sum *= shrink;
            for o in out.iter_mut() {
                *o *= shrink;
            }
            max = score;
        }
        let weight = (score - max).exp();
        sum += weight;
        for (o, v) in out.iter_mut().zip(value) {
            *o += weight * v;
        }
    }
    for o in out.iter_mut() {
        *o /= sum;
    }
}

/// Softmax cross-entropy of each row of `logits` against `targets`;
/// writes `dlogits` (the gradient of the mean over rows, times
/// `grad_scale`: a loss scale, or a share of a larger batch) and returns
/// the mean loss. A row whose target is `ignore` adds no loss and gets a
/// zero gradient; the mean still divides by every row.
pub fn cross_entropy(
    logits: &[f32],
    targets: &[u32],
    cols: usize,
    grad_scale: f32,
    ignore: u32,
    dlogits: &mut [f32],
) -> f32 {
    let rows = targets.len();
    let per_row = grad_scale / rows as f32;
    let mut loss = 0.0f64;
    for ((row, d), &t) in logits
        .chunks_exact(cols)
        .zip(dlogits.chunks_exact_mut(cols))
        .zip(targets)
    {
        if t == ignore {
            d.fill(0.0);
            continue;
        }
        let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
        let sum: f32 = row.iter().map(|v| (v - max).exp()).sum();
        let log_sum = sum.ln() + max;
        loss += f64::from(log_sum - row[t as usize]);
        for (dj, &v) in d.iter_mut().zip(row) {
            *dj = (v - log_sum).exp() * per_row;
        }
        d[t as usize] -= per_row;
    }
    (loss / rows as f64) as f32
}

/// RMSNorm: `out = x * rstd * gamma` per row of `cols`, with `rstd =
/// 1 / sqrt(mean(x^2) + eps)` (transformers' RMSNorm in f32); saves
/// each row's `rstd` for the backward pass.
pub fn rms_norm(x: &[f32], gamma: &[f32], eps: f32, out: &mut [f32], rstd: &mut [f32]) {
    let cols = gamma.len();
    for ((row, o), r) in x
        .chunks_exact(cols)
        .zip(out.chunks_exact_mut(cols))
        .zip(rstd.iter_mut())
    {
        let mean_square = row.iter().map(|v| v * v).sum::<f32>() / cols as f32;
        let s = 1.0 / (mean_square + eps).sqrt();
        for j in 0..cols {
            o[j] = gamma[j] * (row[j] * s);
        }
        *r = s;
    }
}

/// Backward of [`rms_norm`]: adds to `dx` and `dgamma`.
pub fn rms_norm_backward(
    dout: &[f32],
    x: &[f32],
    gamma: &[f32],
    rstd: &[f32],
    dx: &mut [f32],
    dgamma: &mut [f32],
) {
    let cols = gamma.len();
    let n = cols as f32;
    for (((d, row), dxr), &s) in dout
        .chunks_exact(cols)
        .zip(x.chunks_exact(cols))
        .zip(dx.chunks_exact_mut(cols))
        .zip(rstd)
    {
        let mut dot = 0.0;
        for j in 0..cols {
            let xhat = row[j] * s;
            dot += d[j] * gamma[j] * xhat;
            dgamma[j] += d[j] * xhat;
        }
        for j in 0..cols {
            let xhat = row[j] * s;
            dxr[j] += s * (d[j] * gamma[j] - xhat * dot / n);
        }
    }
}

/// Rotary position embeddings in place on one head's `d` elements at
/// `position`: element `i` and `i + d/2` turn by `position * inv_freq[i]`
/// (backwards when `inverse`).
pub fn rotate(head: &mut [f32], inv_freq: &[f32], position: usize, inverse: bool) {
    let half = inv_freq.len();
    let (first, second) = head.split_at_mut(half);
    for ((x1, x2), &f) in first.iter_mut().zip(second.iter_mut()).zip(inv_freq) {
        // transformers: the angle in f32 (position x inv_freq), then its
        // cosine and sine.
        let angle = position as f32 * f;
        let (sin, cos) = angle.sin_cos();
        let sin = if inverse { -sin } else { sin };
        let (a, b) = (*x1, *x2);
        *x1 = a * cos - b * sin;
        *x2 = b * cos + a * sin;
    }
}

/// SiLU (`x * sigmoid(x)`).
fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// SwiGLU per row: `out = silu(gate) * up`, `gate_up` holding each row's
/// gate then its up projection (`2 f` columns), `out` `f` columns.
pub fn swiglu(gate_up: &[f32], f: usize, out: &mut [f32]) {
    for (gu, o) in gate_up.chunks_exact(2 * f).zip(out.chunks_exact_mut(f)) {
        let (gate, up) = gu.split_at(f);
        for j in 0..f {
            o[j] = silu(gate[j]) * up[j];
        }
    }
}

/// Backward of [`swiglu`]: writes `dgate_up` from `dout` (`f` columns).
pub fn swiglu_backward(dout: &[f32], gate_up: &[f32], f: usize, dgate_up: &mut [f32]) {
    for ((d, gu), dgu) in dout
        .chunks_exact(f)
        .zip(gate_up.chunks_exact(2 * f))
        .zip(dgate_up.chunks_exact_mut(2 * f))
    {
        let (gate, up) = gu.split_at(f);
        let (dgate, dup) = dgu.split_at_mut(f);
        for j in 0..f {
            let sig = 1.0 / (1.0 + (-gate[j]).exp());
            let silu = gate[j] * sig;
            dup[j] = d[j] * silu;
            dgate[j] = d[j] * up[j] * sig * (1.0 + gate[j] * (1.0 - sig));
        }
    }
}
