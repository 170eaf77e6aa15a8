//! [`CpuBackend`]: every op on the calling thread, through the free
//! functions of [`super::gemm`] and [`super::ops`], so the model's numbers
//! on the CPU device are theirs bit for bit.
//!
//! Activations may be bf16 where the CUDA kernels take them: such an op
//! widens its bf16 operands into f32 copies, runs the f32 op on them, and
//! rounds what it wrote back to bf16 once (to nearest even), as the GPU's
//! kernels compute in fp32 and round once on store. That path allocates
//! per call: it is the reference for the bf16 kernels and for the engine's
//! bf16 compute on a small CPU run, not the CPU's fast path.

use half::bf16;
use strata_device::{Buffer, DeviceKind, Dtype, Element, Fence, Raw, View, ViewMut};
use strata_optim::{AdamCoefficients, Isa, LowPrecisionMut, Moments, Values, adam_step};

use super::gemm::{Strided, gemm_strided};
use super::ops;
use crate::backend::{
    Attention, Backend, IGNORE_TARGET, Matrix, Readback, check_heads, check_rotary_heads,
    check_swiglu_shapes,
};
use crate::error::{KernelError, Result, same_len};

/// The CPU reference backend.
#[derive(Clone, Copy, Debug, Default)]
pub struct CpuBackend;

fn slice<'a, T: Element>(
    op: &'static str,
    operand: &'static str,
    view: View<'a>,
) -> Result<&'a [T]> {
    check(op, operand, view.raw().kind, view.dtype(), T::DTYPE)?;
    Ok(view.host::<T>().expect("checked: host memory"))
}

fn slice_mut<'a, T: Element>(
    op: &'static str,
    operand: &'static str,
    view: ViewMut<'a>,
) -> Result<&'a mut [T]> {
    check(op, operand, view.raw().kind, view.dtype(), T::DTYPE)?;
    Ok(view.into_host::<T>().expect("checked: host memory"))
}

fn check(
    op: &'static str,
    operand: &'static str,
    kind: DeviceKind,
    dtype: Dtype,
    want: Dtype,
) -> Result<()> {
    if kind != DeviceKind::Cpu {
        return Err(KernelError::Device {
            op,
            operand,
            actual: kind,
            expected: DeviceKind::Cpu,
        });
    }
    if dtype != want {
        return Err(KernelError::Dtype {
            op,
            backend: "cpu",
            operand,
            dtype,
            fix: "the CPU backend computes in f32 or bf16 (u32 for token ids)",
        });
    }
    Ok(())
}

/// `Shape` unless the view has no gaps between its rows.
fn is_contiguous(op: &'static str, operand: &'static str, raw: Raw) -> Result<()> {
    if raw.is_contiguous() {
        return Ok(());
    }
    Err(KernelError::Shape {
        op,
        operand,
        actual: format!("row stride {}", raw.row_stride),
        expected: "a contiguous view".into(),
    })
}

fn contiguous<'a, T: Element>(
    op: &'static str,
    operand: &'static str,
    view: View<'a>,
) -> Result<&'a [T]> {
    is_contiguous(op, operand, view.raw())?;
    slice(op, operand, view)
}

fn contiguous_mut<'a, T: Element>(
    op: &'static str,
    operand: &'static str,
    view: ViewMut<'a>,
) -> Result<&'a mut [T]> {
    is_contiguous(op, operand, view.raw())?;
    slice_mut(op, operand, view)
}

/// [`contiguous`], holding exactly `len` elements.
fn sized<'a, T: Element>(
    op: &'static str,
    operand: &'static str,
    view: View<'a>,
    len: usize,
) -> Result<&'a [T]> {
    let slice = contiguous(op, operand, view)?;
    same_len(op, operand, slice.len(), len)?;
    Ok(slice)
}

/// [`contiguous_mut`], holding exactly `len` elements.
fn sized_mut<'a, T: Element>(
    op: &'static str,
    operand: &'static str,
    view: ViewMut<'a>,
    len: usize,
) -> Result<&'a mut [T]> {
    let slice = contiguous_mut(op, operand, view)?;
    same_len(op, operand, slice.len(), len)?;
    Ok(slice)
}

/// Whether any of these views is bf16 (the op then runs widened).
fn any_bf16(raws: &[Raw]) -> bool {
    raws.iter().any(|r| r.dtype == Dtype::Bf16)
}

/// A contiguous f32 copy (`rows x cols`) of a host view of f32 or bf16.
fn wide(op: &'static str, operand: &'static str, view: View<'_>) -> Result<Buffer> {
    let raw = view.raw();
    let mut copy = Buffer::host(Dtype::F32, raw.len())?;
    let dst = copy.as_mut_slice::<f32>().expect("a host f32 buffer");
    let rows = |f: &mut dyn FnMut(usize, usize)| {
        for r in 0..raw.rows {
            for c in 0..raw.cols {
                f(r * raw.cols + c, r * raw.row_stride + c);
            }
        }
    };
    match raw.dtype {
        Dtype::Bf16 => {
            let src = slice::<bf16>(op, operand, view)?;
            rows(&mut |to, from| dst[to] = src[from].to_f32());
        }
        _ => {
            let src = slice::<f32>(op, operand, view)?;
            rows(&mut |to, from| dst[to] = src[from]);
        }
    }
    Ok(copy)
}

/// [`wide`] of an operand the op writes (its current values, which some
/// ops add to).
fn wide_mut(op: &'static str, operand: &'static str, view: &ViewMut<'_>) -> Result<Buffer> {
    wide(op, operand, view.view())
}

/// `copy` (from [`wide`]) shaped like the view it came from.
fn shaped(copy: &Buffer, like: Raw) -> View<'_> {
    copy.view()
        .matrix(like.rows, like.cols)
        .expect("a copy holds its view's elements")
}

/// [`shaped`], to write.
fn shaped_mut(copy: &mut Buffer, like: Raw) -> ViewMut<'_> {
    copy.view_mut()
        .matrix(like.rows, like.cols)
        .expect("a copy holds its view's elements")
}

/// Writes an f32 copy back into the view it was widened from, rounding to
/// bf16 (nearest even, NaN kept) where the view is bf16.
fn narrow(op: &'static str, operand: &'static str, copy: &Buffer, into: ViewMut<'_>) -> Result<()> {
    let raw = into.raw();
    let src = copy.as_slice::<f32>().expect("a host f32 buffer");
    match raw.dtype {
        Dtype::Bf16 => {
            let dst = slice_mut::<bf16>(op, operand, into)?;
            for r in 0..raw.rows {
                for c in 0..raw.cols {
                    dst[r * raw.row_stride + c] = bf16::from_f32(src[r * raw.cols + c]);
                }
            }
        }
        _ => {
            let dst = slice_mut::<f32>(op, operand, into)?;
            for r in 0..raw.rows {
                dst[r * raw.row_stride..][..raw.cols]
                    .copy_from_slice(&src[r * raw.cols..][..raw.cols]);
            }
        }
    }
    Ok(())
}

fn operand<'a>(op: &'static str, name: &'static str, m: Matrix<'a>) -> Result<Strided<'a>> {
    let raw = m.view.raw();
    let data = slice::<f32>(op, name, m.view)?;
    let (rows, cols) = m.shape();
    let (row_stride, col_stride) = if m.transposed {
        (1, raw.row_stride)
    } else {
        (raw.row_stride, 1)
    };
    Ok(Strided {
        data,
        rows,
        cols,
        row_stride,
        col_stride,
    })
}

impl CpuBackend {
    /// Every (sequence, head) pair.
    fn heads(shape: Attention) -> impl Iterator<Item = (usize, usize)> {
        (0..shape.batch).flat_map(move |b| (0..shape.heads).map(move |h| (b, h)))
    }

    /// The attention workspace, checked, as one head's q, k, v, o, dq, dk,
    /// dv (`seq x head_dim` each) and its dp (`seq x seq`).
    fn attention_workspace<'a>(
        &self,
        op: &'static str,
        shape: Attention,
        workspace: ViewMut<'a>,
    ) -> Result<([&'a mut [f32]; 7], &'a mut [f32])> {
        let ws = sized_mut::<f32>(
            op,
            "workspace",
            workspace,
            self.attention_workspace_elems(shape),
        )?;
        let (heads, dp) = ws.split_at_mut(7 * shape.seq * shape.head_dim);
        let mut parts = heads.chunks_exact_mut(shape.seq * shape.head_dim);
        let parts = std::array::from_fn(|_| parts.next().expect("seven parts"));
        Ok((parts, dp))
    }
}

/// `position_ids` as attention reads them: empty (each row's place in its
/// sequence), or one u32 per row of `rows`, each at most the row's place
/// in its sequence of `seq` (a document starts in the sequence).
fn read_position_ids<'a>(
    op: &'static str,
    ids: View<'a>,
    rows: usize,
    seq: usize,
) -> Result<&'a [u32]> {
    let ids = read_positions(op, ids, rows, None)?;
    if let Some((row, &id)) = ids
        .iter()
        .enumerate()
        .find(|&(row, &id)| id as usize > row % seq.max(1))
    {
        return Err(KernelError::Index {
            op,
            what: "position_ids (a row's place in its document, at most its place in its sequence)",
            value: u64::from(id),
            max: (row % seq.max(1)) as u64,
        });
    }
    Ok(ids)
}

/// `position_ids` as positions (rotary angles, a position table's rows):
/// empty, or one u32 per row of `rows`, each below `limit` when there is
/// one (the table's rows).
fn read_positions<'a>(
    op: &'static str,
    ids: View<'a>,
    rows: usize,
    limit: Option<usize>,
) -> Result<&'a [u32]> {
    if ids.is_empty() {
        return Ok(&[]);
    }
    let ids = sized::<u32>(op, "position_ids", ids, rows)?;
    if let Some(limit) = limit
        && let Some(&id) = ids.iter().find(|&&id| id as usize >= limit)
    {
        return Err(KernelError::Index {
            op,
            what: "position_ids (a position, below the position table's rows)",
            value: u64::from(id),
            max: limit.saturating_sub(1) as u64,
        });
    }
    Ok(ids)
}

/// Sequence `b`'s position ids (of `seq` rows), or none.
fn sequence_ids(ids: &[u32], b: usize, seq: usize) -> &[u32] {
    ids.get(b * seq..(b + 1) * seq).unwrap_or(&[])
}

/// Query head `head`'s query and its key/value head's key and value, from
/// row `row0` on, into `[q, k, v]`.
fn gather_qkv(qkv: &[f32], shape: Attention, row0: usize, head: usize, into: [&mut [f32]; 3]) {
    let (s, d, width) = (shape.seq, shape.head_dim, shape.qkv_width());
    for (col, buffer) in qkv_columns(shape, head).into_iter().zip(into) {
        gather(qkv, width, row0, col, s, d, buffer);
    }
}

/// The first columns of query head `head`'s query, and of its key/value
/// head's key and value, in a packed `q | k | v` row.
fn qkv_columns(shape: Attention, head: usize) -> [usize; 3] {
    let (d, kv) = (shape.head_dim, head / shape.group().max(1));
    [
        head * d,
        shape.hidden() + kv * d,
        shape.hidden() + shape.kv_hidden() + kv * d,
    ]
}

/// Copies rows `row0..row0 + rows`, columns `col..col + d` of a matrix of
/// row width `width` into the contiguous `rows x d` buffer.
fn gather(
    matrix: &[f32],
    width: usize,
    row0: usize,
    col: usize,
    rows: usize,
    d: usize,
    out: &mut [f32],
) {
    for i in 0..rows {
        let from = (row0 + i) * width + col;
        out[i * d..(i + 1) * d].copy_from_slice(&matrix[from..from + d]);
    }
}

/// Writes the contiguous `rows x d` buffer into rows `row0..row0 + rows`,
/// columns `col..col + d` of a matrix of row width `width`, or adds it
/// there (`add`).
#[allow(clippy::too_many_arguments)]
fn scatter(
    buffer: &[f32],
    width: usize,
    row0: usize,
    col: usize,
    rows: usize,
    d: usize,
    add: bool,
    matrix: &mut [f32],
) {
    for i in 0..rows {
        let to = &mut matrix[(row0 + i) * width + col..][..d];
        let from = &buffer[i * d..(i + 1) * d];
        if add {
            to.iter_mut().zip(from).for_each(|(t, f)| *t += f);
        } else {
            to.copy_from_slice(from);
        }
    }
}

/// `c = op(a) op(b)` for contiguous `m x k` and `k x n` (as used).
#[allow(clippy::too_many_arguments)]
fn product(
    a: &[f32],
    a_t: bool,
    b: &[f32],
    b_t: bool,
    m: usize,
    k: usize,
    n: usize,
    c: &mut [f32],
) {
    let op = |data, rows, cols, t: bool| Strided {
        data,
        rows,
        cols,
        row_stride: if t { 1 } else { cols },
        col_stride: if t { rows } else { 1 },
    };
    gemm_strided(op(a, m, k, a_t), op(b, k, n, b_t), 1.0, 0.0, c, n);
}

impl Backend for CpuBackend {
    fn kind(&self) -> DeviceKind {
        DeviceKind::Cpu
    }

    fn name(&self) -> &'static str {
        "cpu"
    }

    fn alloc(&self, dtype: Dtype, len: usize) -> Result<Buffer> {
        Ok(Buffer::host(dtype, len)?)
    }

    fn record(&self) -> Result<Fence> {
        Ok(Fence::ready())
    }

    fn wait(&self, fence: &Fence) -> Result<()> {
        Ok(fence.wait()?)
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
        if any_bf16(&[a.view.raw(), b.view.raw(), c.raw()]) {
            let (wa, wb, mut wc) = (
                wide(OP, "a", a.view)?,
                wide(OP, "b", b.view)?,
                wide_mut(OP, "c", &c)?,
            );
            let (a_raw, b_raw, c_raw) = (a.view.raw(), b.view.raw(), c.raw());
            let a = Matrix {
                view: shaped(&wa, a_raw),
                transposed: a.transposed,
            };
            let b = Matrix {
                view: shaped(&wb, b_raw),
                transposed: b.transposed,
            };
            self.gemm(a, b, alpha, beta, shaped_mut(&mut wc, c_raw))?;
            return narrow(OP, "c", &wc, c);
        }
        let ((m, k), (kb, n)) = (a.shape(), b.shape());
        let (c_rows, c_cols, c_stride) = (c.raw().rows, c.raw().cols, c.raw().row_stride);
        if kb != k || c_rows != m || c_cols != n {
            return Err(KernelError::Shape {
                op: OP,
                operand: "operands",
                actual: format!("a {m} x {k}, b {kb} x {n}, c {c_rows} x {c_cols}"),
                expected: "a m x k, b k x n, c m x n".into(),
            });
        }
        let (a, b) = (operand(OP, "a", a)?, operand(OP, "b", b)?);
        let c = slice_mut::<f32>(OP, "c", c)?;
        gemm_strided(a, b, alpha, beta, c, c_stride);
        Ok(())
    }

    fn add_bias(&self, x: ViewMut<'_>, bias: View<'_>) -> Result<()> {
        if any_bf16(&[x.raw()]) {
            let mut wx = wide_mut("add_bias", "x", &x)?;
            self.add_bias(shaped_mut(&mut wx, x.raw()), bias)?;
            return narrow("add_bias", "x", &wx, x);
        }
        let bias = contiguous::<f32>("add_bias", "bias", bias)?;
        let x = contiguous_mut::<f32>("add_bias", "x", x)?;
        same_len("add_bias", "x", x.len() % bias.len().max(1), 0)?;
        ops::add_bias(x, bias);
        Ok(())
    }

    fn bias_grad(&self, dy: View<'_>, dbias: ViewMut<'_>) -> Result<()> {
        if any_bf16(&[dy.raw()]) {
            let wdy = wide("bias_grad", "dy", dy)?;
            return self.bias_grad(shaped(&wdy, dy.raw()), dbias);
        }
        let dy = contiguous::<f32>("bias_grad", "dy", dy)?;
        let dbias = contiguous_mut::<f32>("bias_grad", "dbias", dbias)?;
        same_len("bias_grad", "dy", dy.len() % dbias.len().max(1), 0)?;
        ops::bias_backward(dy, dbias);
        Ok(())
    }

    fn add(&self, y: ViewMut<'_>, x: View<'_>) -> Result<()> {
        self.axpy(1.0, x, y)
    }

    fn axpy(&self, alpha: f32, x: View<'_>, y: ViewMut<'_>) -> Result<()> {
        if any_bf16(&[x.raw(), y.raw()]) {
            let (wx, mut wy) = (wide("axpy", "x", x)?, wide_mut("axpy", "y", &y)?);
            self.axpy(alpha, shaped(&wx, x.raw()), shaped_mut(&mut wy, y.raw()))?;
            return narrow("axpy", "y", &wy, y);
        }
        let x = contiguous::<f32>("axpy", "x", x)?;
        let y = contiguous_mut::<f32>("axpy", "y", y)?;
        same_len("axpy", "x", x.len(), y.len())?;
        if alpha == 1.0 {
            // Exactly `y += x` (what the model's residuals add).
            for (v, a) in y.iter_mut().zip(x) {
                *v += a;
            }
        } else {
            for (v, a) in y.iter_mut().zip(x) {
                *v += alpha * a;
            }
        }
        Ok(())
    }

    fn scale(&self, alpha: f32, x: ViewMut<'_>) -> Result<()> {
        if any_bf16(&[x.raw()]) {
            let mut wx = wide_mut("scale", "x", &x)?;
            self.scale(alpha, shaped_mut(&mut wx, x.raw()))?;
            return narrow("scale", "x", &wx, x);
        }
        for v in contiguous_mut::<f32>("scale", "x", x)? {
            *v *= alpha;
        }
        Ok(())
    }

    fn copy(&self, x: View<'_>, y: ViewMut<'_>) -> Result<()> {
        same_len("copy", "y", y.len(), x.len())?;
        match x.dtype() {
            Dtype::F32 => {
                contiguous_mut::<f32>("copy", "y", y)?.copy_from_slice(contiguous("copy", "x", x)?)
            }
            Dtype::U32 => {
                contiguous_mut::<u32>("copy", "y", y)?.copy_from_slice(contiguous("copy", "x", x)?)
            }
            Dtype::Bf16 => {
                contiguous_mut::<bf16>("copy", "y", y)?.copy_from_slice(contiguous("copy", "x", x)?)
            }
            Dtype::F16 => contiguous_mut::<half::f16>("copy", "y", y)?
                .copy_from_slice(contiguous("copy", "x", x)?),
        }
        Ok(())
    }

    fn upload(&self, host: View<'_>, y: ViewMut<'_>) -> Result<()> {
        self.copy(host, y)
    }

    fn zero(&self, x: ViewMut<'_>) -> Result<()> {
        match x.dtype() {
            Dtype::F32 => contiguous_mut::<f32>("zero", "x", x)?.fill(0.0),
            Dtype::U32 => contiguous_mut::<u32>("zero", "x", x)?.fill(0),
            Dtype::Bf16 => contiguous_mut::<bf16>("zero", "x", x)?.fill(bf16::ZERO),
            Dtype::F16 => contiguous_mut::<half::f16>("zero", "x", x)?.fill(half::f16::ZERO),
        }
        Ok(())
    }

    fn cast(&self, x: View<'_>, y: ViewMut<'_>) -> Result<()> {
        same_len("cast", "y", y.len(), x.len())?;
        match (x.dtype(), y.dtype()) {
            (Dtype::Bf16, Dtype::F32) => {
                let x = contiguous::<bf16>("cast", "x", x)?;
                for (o, v) in contiguous_mut::<f32>("cast", "y", y)?.iter_mut().zip(x) {
                    *o = f32::from(*v);
                }
            }
            (Dtype::F32, Dtype::Bf16) => {
                let x = contiguous::<f32>("cast", "x", x)?;
                for (o, v) in contiguous_mut::<bf16>("cast", "y", y)?.iter_mut().zip(x) {
                    *o = bf16::from_f32(*v);
                }
            }
            (from, _) => {
                return Err(KernelError::Dtype {
                    op: "cast",
                    backend: "cpu",
                    operand: "x",
                    dtype: from,
                    fix: "the CPU backend casts between f32 and bf16",
                });
            }
        }
        Ok(())
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
        if any_bf16(&[x.raw(), out.raw()]) {
            let (wx, mut wout) = (wide(OP, "x", x)?, wide_mut(OP, "out", &out)?);
            self.layer_norm(
                shaped(&wx, x.raw()),
                gamma,
                beta,
                shaped_mut(&mut wout, out.raw()),
                saved,
            )?;
            return narrow(OP, "out", &wout, out);
        }
        let (gamma, beta) = (
            contiguous::<f32>(OP, "gamma", gamma)?,
            contiguous::<f32>(OP, "beta", beta)?,
        );
        let cols = gamma.len();
        same_len(OP, "beta", beta.len(), cols)?;
        let x = contiguous::<f32>(OP, "x", x)?;
        let rows = x.len() / cols.max(1);
        same_len(OP, "x", x.len(), rows * cols)?;
        let out = sized_mut::<f32>(OP, "out", out, x.len())?;
        let saved = sized_mut::<f32>(OP, "saved", saved, 2 * rows)?;
        let (mean, rstd) = saved.split_at_mut(rows);
        ops::layer_norm(x, gamma, beta, cols, out, mean, rstd);
        Ok(())
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
        if any_bf16(&[dout.raw(), x.raw(), dx.raw()]) {
            let (wdout, wx, mut wdx) = (
                wide(OP, "dout", dout)?,
                wide(OP, "x", x)?,
                wide_mut(OP, "dx", &dx)?,
            );
            self.layer_norm_backward(
                shaped(&wdout, dout.raw()),
                shaped(&wx, x.raw()),
                gamma,
                saved,
                shaped_mut(&mut wdx, dx.raw()),
                dgamma_dbeta,
            )?;
            return narrow(OP, "dx", &wdx, dx);
        }
        let gamma = contiguous::<f32>(OP, "gamma", gamma)?;
        let cols = gamma.len();
        let (dout, x) = (
            contiguous::<f32>(OP, "dout", dout)?,
            contiguous::<f32>(OP, "x", x)?,
        );
        let rows = x.len() / cols.max(1);
        same_len(OP, "dout", dout.len(), x.len())?;
        let saved = sized::<f32>(OP, "saved", saved, 2 * rows)?;
        let dx = sized_mut::<f32>(OP, "dx", dx, x.len())?;
        let dgb = sized_mut::<f32>(OP, "dgamma_dbeta", dgamma_dbeta, 2 * cols)?;
        let (dgamma, dbeta) = dgb.split_at_mut(cols);
        let (mean, rstd) = saved.split_at(rows);
        ops::layer_norm_backward(dout, x, gamma, mean, rstd, cols, dx, dgamma, dbeta);
        Ok(())
    }

    fn gelu(&self, x: View<'_>, out: ViewMut<'_>) -> Result<()> {
        if any_bf16(&[x.raw(), out.raw()]) {
            let (wx, mut wout) = (wide("gelu", "x", x)?, wide_mut("gelu", "out", &out)?);
            self.gelu(shaped(&wx, x.raw()), shaped_mut(&mut wout, out.raw()))?;
            return narrow("gelu", "out", &wout, out);
        }
        let x = contiguous::<f32>("gelu", "x", x)?;
        let out = sized_mut::<f32>("gelu", "out", out, x.len())?;
        ops::gelu(x, out);
        Ok(())
    }

    fn gelu_backward(&self, dout: View<'_>, x: View<'_>, dx: ViewMut<'_>) -> Result<()> {
        const OP: &str = "gelu_backward";
        if any_bf16(&[dout.raw(), x.raw(), dx.raw()]) {
            let (wdout, wx, mut wdx) = (
                wide(OP, "dout", dout)?,
                wide(OP, "x", x)?,
                wide_mut(OP, "dx", &dx)?,
            );
            self.gelu_backward(
                shaped(&wdout, dout.raw()),
                shaped(&wx, x.raw()),
                shaped_mut(&mut wdx, dx.raw()),
            )?;
            return narrow(OP, "dx", &wdx, dx);
        }
        let (dout, x) = (
            contiguous::<f32>("gelu_backward", "dout", dout)?,
            contiguous::<f32>("gelu_backward", "x", x)?,
        );
        let dx = contiguous_mut::<f32>("gelu_backward", "dx", dx)?;
        same_len("gelu_backward", "dout", dout.len(), x.len())?;
        same_len("gelu_backward", "dx", dx.len(), x.len())?;
        ops::gelu_backward(dout, x, dx);
        Ok(())
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
        if any_bf16(&[x.raw(), out.raw()]) {
            let (wx, mut wout) = (wide(OP, "x", x)?, wide_mut(OP, "out", &out)?);
            self.rms_norm(
                shaped(&wx, x.raw()),
                gamma,
                eps,
                shaped_mut(&mut wout, out.raw()),
                saved,
            )?;
            return narrow(OP, "out", &wout, out);
        }
        let gamma = contiguous::<f32>(OP, "gamma", gamma)?;
        let cols = gamma.len();
        let x = contiguous::<f32>(OP, "x", x)?;
        let rows = x.len() / cols.max(1);
        same_len(OP, "x", x.len(), rows * cols)?;
        let out = sized_mut::<f32>(OP, "out", out, x.len())?;
        let saved = sized_mut::<f32>(OP, "saved", saved, rows)?;
        ops::rms_norm(x, gamma, eps, out, saved);
        Ok(())
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
        if any_bf16(&[dout.raw(), x.raw(), dx.raw()]) {
            let (wdout, wx, mut wdx) = (
                wide(OP, "dout", dout)?,
                wide(OP, "x", x)?,
                wide_mut(OP, "dx", &dx)?,
            );
            self.rms_norm_backward(
                shaped(&wdout, dout.raw()),
                shaped(&wx, x.raw()),
                gamma,
                saved,
                shaped_mut(&mut wdx, dx.raw()),
                dgamma,
            )?;
            return narrow(OP, "dx", &wdx, dx);
        }
        let gamma = contiguous::<f32>(OP, "gamma", gamma)?;
        let cols = gamma.len();
        let (dout, x) = (
            contiguous::<f32>(OP, "dout", dout)?,
            contiguous::<f32>(OP, "x", x)?,
        );
        let rows = x.len() / cols.max(1);
        same_len(OP, "x", x.len(), rows * cols)?;
        same_len(OP, "dout", dout.len(), x.len())?;
        let saved = sized::<f32>(OP, "saved", saved, rows)?;
        let dx = sized_mut::<f32>(OP, "dx", dx, x.len())?;
        let dgamma = sized_mut::<f32>(OP, "dgamma", dgamma, cols)?;
        ops::rms_norm_backward(dout, x, gamma, saved, dx, dgamma);
        Ok(())
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
        if any_bf16(&[qkv.raw()]) {
            let mut wqkv = wide_mut(OP, "qkv", &qkv)?;
            self.rotary(
                shape,
                position_ids,
                inv_freq,
                inverse,
                shaped_mut(&mut wqkv, qkv.raw()),
            )?;
            return narrow(OP, "qkv", &wqkv, qkv);
        }
        check_rotary_heads(OP, shape)?;
        let d = shape.head_dim;
        let inv_freq = sized::<f32>(OP, "inv_freq", inv_freq, d / 2)?;
        let width = shape.qkv_width();
        let ids = read_positions(OP, position_ids, shape.rows(), None)?;
        let qkv = sized_mut::<f32>(OP, "qkv", qkv, shape.rows() * width)?;
        // The queries' and the keys' heads (the values are not turned).
        let turned = shape.heads + shape.kv_heads;
        for (r, row) in qkv.chunks_exact_mut(width).enumerate() {
            let position = ids.get(r).map_or(r % shape.seq.max(1), |&p| p as usize);
            for head in row[..turned * d].chunks_exact_mut(d) {
                ops::rotate(head, inv_freq, position, inverse);
            }
        }
        Ok(())
    }

    fn swiglu(&self, gate_up: View<'_>, out: ViewMut<'_>) -> Result<()> {
        const OP: &str = "swiglu";
        if any_bf16(&[gate_up.raw(), out.raw()]) {
            let (wgu, mut wout) = (wide(OP, "gate_up", gate_up)?, wide_mut(OP, "out", &out)?);
            self.swiglu(
                shaped(&wgu, gate_up.raw()),
                shaped_mut(&mut wout, out.raw()),
            )?;
            return narrow(OP, "out", &wout, out);
        }
        let f = out.raw().cols;
        check_swiglu_shapes(OP, gate_up.raw(), out.raw())?;
        let gate_up = contiguous::<f32>(OP, "gate_up", gate_up)?;
        let out = contiguous_mut::<f32>(OP, "out", out)?;
        same_len(OP, "gate_up", gate_up.len(), 2 * out.len())?;
        ops::swiglu(gate_up, f, out);
        Ok(())
    }

    fn swiglu_backward(
        &self,
        dout: View<'_>,
        gate_up: View<'_>,
        dgate_up: ViewMut<'_>,
    ) -> Result<()> {
        const OP: &str = "swiglu_backward";
        if any_bf16(&[dout.raw(), gate_up.raw(), dgate_up.raw()]) {
            let (wdout, wgu, mut wdgu) = (
                wide(OP, "dout", dout)?,
                wide(OP, "gate_up", gate_up)?,
                wide_mut(OP, "dgate_up", &dgate_up)?,
            );
            self.swiglu_backward(
                shaped(&wdout, dout.raw()),
                shaped(&wgu, gate_up.raw()),
                shaped_mut(&mut wdgu, dgate_up.raw()),
            )?;
            return narrow(OP, "dgate_up", &wdgu, dgate_up);
        }
        let f = dout.raw().cols;
        check_swiglu_shapes(OP, gate_up.raw(), dout.raw())?;
        let dout = contiguous::<f32>(OP, "dout", dout)?;
        let gate_up = sized::<f32>(OP, "gate_up", gate_up, 2 * dout.len())?;
        let dgate_up = sized_mut::<f32>(OP, "dgate_up", dgate_up, gate_up.len())?;
        ops::swiglu_backward(dout, gate_up, f, dgate_up);
        Ok(())
    }

    fn attention_saved_elems(&self, shape: Attention) -> usize {
        // The probabilities of every head: the CPU keeps the s x s matrix
        // (a flash-style GPU kernel keeps one log-sum-exp per row).
        shape.batch * shape.heads * shape.seq * shape.seq
    }

    fn attention_workspace_elems(&self, shape: Attention) -> usize {
        // q, k, v, o, dq, dk, dv of one head, and its dp.
        7 * shape.seq * shape.head_dim + shape.seq * shape.seq
    }

    fn attention(
        &self,
        shape: Attention,
        position_ids: View<'_>,
        qkv: View<'_>,
        out: ViewMut<'_>,
        saved: ViewMut<'_>,
        workspace: ViewMut<'_>,
    ) -> Result<()> {
        const OP: &str = "attention";
        if any_bf16(&[qkv.raw(), out.raw()]) {
            let (wqkv, mut wout) = (wide(OP, "qkv", qkv)?, wide_mut(OP, "out", &out)?);
            self.attention(
                shape,
                position_ids,
                shaped(&wqkv, qkv.raw()),
                shaped_mut(&mut wout, out.raw()),
                saved,
                workspace,
            )?;
            return narrow(OP, "out", &wout, out);
        }
        check_heads(OP, shape)?;
        let (s, d, h) = (shape.seq, shape.head_dim, shape.hidden());
        let ids = read_position_ids(OP, position_ids, shape.rows(), s)?;
        let qkv = sized::<f32>(OP, "qkv", qkv, shape.rows() * shape.qkv_width())?;
        let out = sized_mut::<f32>(OP, "out", out, shape.rows() * h)?;
        let probs_all = sized_mut::<f32>(OP, "saved", saved, self.attention_saved_elems(shape))?;
        let ([q, k, v, o, ..], _) = self.attention_workspace(OP, shape, workspace)?;
        let scale = 1.0 / (d as f32).sqrt();
        for (b, head) in Self::heads(shape) {
            let row0 = b * s;
            gather_qkv(qkv, shape, row0, head, [&mut *q, &mut *k, &mut *v]);
            let probs = &mut probs_all[(b * shape.heads + head) * s * s..][..s * s];
            product(q, false, k, true, s, d, s, probs);
            ops::causal_softmax(probs, s, scale, sequence_ids(ids, b, s));
            product(probs, false, v, false, s, s, d, o);
            scatter(o, h, row0, head * d, s, d, false, out);
        }
        Ok(())
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
        if any_bf16(&[qkv.raw(), out.raw(), dout.raw(), dqkv.raw()]) {
            let (wqkv, wout, wdout, mut wdqkv) = (
                wide(OP, "qkv", qkv)?,
                wide(OP, "out", out)?,
                wide(OP, "dout", dout)?,
                wide_mut(OP, "dqkv", &dqkv)?,
            );
            self.attention_backward(
                shape,
                position_ids,
                shaped(&wqkv, qkv.raw()),
                shaped(&wout, out.raw()),
                saved,
                shaped(&wdout, dout.raw()),
                shaped_mut(&mut wdqkv, dqkv.raw()),
                workspace,
            )?;
            return narrow(OP, "dqkv", &wdqkv, dqkv);
        }
        check_heads(OP, shape)?;
        let (s, d, h) = (shape.seq, shape.head_dim, shape.hidden());
        let ids = read_position_ids(OP, position_ids, shape.rows(), s)?;
        let qkv = sized::<f32>(OP, "qkv", qkv, shape.rows() * shape.qkv_width())?;
        // The saved probabilities give everything `out` would.
        sized::<f32>(OP, "out", out, shape.rows() * h)?;
        let probs_all = sized::<f32>(OP, "saved", saved, self.attention_saved_elems(shape))?;
        let dout = sized::<f32>(OP, "dout", dout, shape.rows() * h)?;
        let dqkv = sized_mut::<f32>(OP, "dqkv", dqkv, qkv.len())?;
        let ([q, k, v, o, dq, dk, dv], dp) = self.attention_workspace(OP, shape, workspace)?;
        let scale = 1.0 / (d as f32).sqrt();
        let width = shape.qkv_width();
        for (b, head) in Self::heads(shape) {
            let row0 = b * s;
            let probs = &probs_all[(b * shape.heads + head) * s * s..][..s * s];
            gather_qkv(qkv, shape, row0, head, [&mut *q, &mut *k, &mut *v]);
            gather(dout, h, row0, head * d, s, d, o);
            product(o, false, v, true, s, d, s, dp);
            product(probs, true, o, false, s, s, d, dv);
            ops::causal_softmax_backward(probs, dp, s, scale, sequence_ids(ids, b, s));
            product(dp, false, k, false, s, s, d, dq);
            product(dp, true, q, false, s, s, d, dk);
            // A key/value head's gradients sum over its group of query
            // heads, in head order: the first writes them, the rest add.
            let first = head % shape.group() == 0;
            let columns = qkv_columns(shape, head);
            for (part, buffer) in [&*dq, &*dk, &*dv].into_iter().enumerate() {
                let add = part > 0 && !first;
                scatter(buffer, width, row0, columns[part], s, d, add, dqkv);
            }
        }
        Ok(())
    }

    fn attention_decode(
        &self,
        shape: Attention,
        len: usize,
        q: View<'_>,
        keys: View<'_>,
        values: View<'_>,
        out: ViewMut<'_>,
    ) -> Result<()> {
        const OP: &str = "attention_decode";
        check_heads(OP, shape)?;
        let (d, kv) = (shape.head_dim, shape.kv_hidden());
        let q = sized::<f32>(OP, "q", q, shape.hidden())?;
        let keys = sized::<f32>(OP, "keys", keys, len * kv)?;
        let values = sized::<f32>(OP, "values", values, len * kv)?;
        let out = sized_mut::<f32>(OP, "out", out, shape.hidden())?;
        if len == 0 {
            return Err(KernelError::Index {
                op: OP,
                what: "cached rows (the new row's own at least)",
                value: 0,
                max: 0,
            });
        }
        let scale = 1.0 / (d as f32).sqrt();
        for head in 0..shape.heads {
            let column = head / shape.group().max(1) * d;
            ops::attend_one(
                &q[head * d..(head + 1) * d],
                (keys, values),
                (kv, column),
                scale,
                &mut out[head * d..(head + 1) * d],
            );
        }
        Ok(())
    }

    fn cross_entropy(
        &self,
        logits: View<'_>,
        targets: View<'_>,
        grad_scale: f32,
        dlogits: ViewMut<'_>,
    ) -> Result<Readback> {
        const OP: &str = "cross_entropy";
        if any_bf16(&[logits.raw(), dlogits.raw()]) {
            let (wlogits, mut wdlogits) = (
                wide(OP, "logits", logits)?,
                wide_mut(OP, "dlogits", &dlogits)?,
            );
            let loss = self.cross_entropy(
                shaped(&wlogits, logits.raw()),
                targets,
                grad_scale,
                shaped_mut(&mut wdlogits, dlogits.raw()),
            )?;
            narrow(OP, "dlogits", &wdlogits, dlogits)?;
            return Ok(loss);
        }
        let targets = contiguous::<u32>(OP, "targets", targets)?;
        let logits = contiguous::<f32>(OP, "logits", logits)?;
        let vocab = logits.len() / targets.len().max(1);
        same_len(OP, "logits", logits.len(), vocab * targets.len())?;
        if let Some((position, &token)) = targets
            .iter()
            .enumerate()
            .find(|(_, t)| **t as usize >= vocab && **t != IGNORE_TARGET)
        {
            return Err(KernelError::Token {
                op: OP,
                token,
                position,
                vocab,
            });
        }
        let dlogits = sized_mut::<f32>(OP, "dlogits", dlogits, logits.len())?;
        let loss = ops::cross_entropy(logits, targets, vocab, grad_scale, IGNORE_TARGET, dlogits);
        Ok(Readback::ready(f64::from(loss)))
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
        if any_bf16(&[out.raw()]) {
            let mut wout = wide_mut(OP, "out", &out)?;
            self.embedding(
                table,
                positions,
                tokens,
                position_ids,
                seq,
                shaped_mut(&mut wout, out.raw()),
            )?;
            return narrow(OP, "out", &wout, out);
        }
        let (table, positions) = (
            contiguous::<f32>(OP, "table", table)?,
            contiguous::<f32>(OP, "positions", positions)?,
        );
        let tokens = contiguous::<u32>(OP, "tokens", tokens)?;
        let ids = read_positions(OP, position_ids, tokens.len(), Some(seq))?;
        let out = contiguous_mut::<f32>(OP, "out", out)?;
        let hidden = out.len() / tokens.len().max(1);
        same_len(OP, "out", out.len(), hidden * tokens.len())?;
        if !positions.is_empty() {
            same_len(OP, "positions", positions.len(), seq * hidden)?;
        }
        let vocab = table.len() / hidden.max(1);
        for (i, (&token, row)) in tokens.iter().zip(out.chunks_exact_mut(hidden)).enumerate() {
            if token as usize >= vocab {
                return Err(KernelError::Token {
                    op: OP,
                    token,
                    position: i,
                    vocab,
                });
            }
            let te = &table[token as usize * hidden..][..hidden];
            if positions.is_empty() {
                row.copy_from_slice(te);
                continue;
            }
            let place = ids.get(i).map_or(i % seq, |&p| p as usize);
            let pe = &positions[place * hidden..][..hidden];
            for j in 0..hidden {
                row[j] = te[j] + pe[j];
            }
        }
        Ok(())
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
        if any_bf16(&[dout.raw()]) {
            let wdout = wide(OP, "dout", dout)?;
            return self.embedding_backward(
                tokens,
                position_ids,
                seq,
                shaped(&wdout, dout.raw()),
                dtable,
                dpositions,
            );
        }
        let tokens = contiguous::<u32>(OP, "tokens", tokens)?;
        let ids = read_positions(OP, position_ids, tokens.len(), Some(seq))?;
        let dout = contiguous::<f32>(OP, "dout", dout)?;
        let hidden = dout.len() / tokens.len().max(1);
        let dtable = contiguous_mut::<f32>(OP, "dtable", dtable)?;
        let dpositions = contiguous_mut::<f32>(OP, "dpositions", dpositions)?;
        if !dpositions.is_empty() {
            same_len(OP, "dpositions", dpositions.len(), seq * hidden)?;
        }
        let vocab = dtable.len() / hidden.max(1);
        for (i, (&token, row)) in tokens.iter().zip(dout.chunks_exact(hidden)).enumerate() {
            if token as usize >= vocab {
                return Err(KernelError::Token {
                    op: OP,
                    token,
                    position: i,
                    vocab,
                });
            }
            let te = &mut dtable[token as usize * hidden..][..hidden];
            for j in 0..hidden {
                te[j] += row[j];
            }
            if dpositions.is_empty() {
                continue;
            }
            let place = ids.get(i).map_or(i % seq, |&p| p as usize);
            let pe = &mut dpositions[place * hidden..][..hidden];
            for j in 0..hidden {
                pe[j] += row[j];
            }
        }
        Ok(())
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
        let grad = contiguous::<f32>(OP, "grad", grad)?;
        let n = grad.len();
        let master = sized_mut::<f32>(OP, "master", master, n)?;
        let m = sized_mut::<f32>(OP, "m", m, n)?;
        let v = sized_mut::<f32>(OP, "v", v, n)?;
        let param = sized_mut::<bf16>(OP, "param", param, n)?;
        adam_step(
            Isa::chosen(),
            coefficients,
            master,
            Values::F32(grad),
            Moments::F32 { m, v },
            Some(LowPrecisionMut::Bf16(param)),
        );
        Ok(())
    }

    fn sum_squares(&self, x: View<'_>) -> Result<Readback> {
        let x = contiguous::<f32>("sum_squares", "x", x)?;
        // The optimizer's kernel (f64 sums, in its ISA's lane order), so a
        // norm is the same bits whether the engine takes it here or there.
        Ok(Readback::ready(
            strata_optim::grad_norm(strata_optim::Isa::chosen(), strata_optim::Values::F32(x))
                .sum_squares,
        ))
    }

    fn non_finite(&self, x: View<'_>) -> Result<Readback> {
        let x = contiguous::<f32>("non_finite", "x", x)?;
        Ok(Readback::ready(f64::from(u8::from(
            x.iter().any(|v| !v.is_finite()),
        ))))
    }

    fn read_scalar(&self, x: View<'_>, index: usize) -> Result<Readback> {
        let x = contiguous::<f32>("read_scalar", "x", x)?;
        let value = x.get(index).ok_or(KernelError::Shape {
            op: "read_scalar",
            operand: "x",
            actual: format!("{} elements", x.len()),
            expected: format!("more than {index}"),
        })?;
        Ok(Readback::ready(f64::from(*value)))
    }
}
