//! Kernel benchmarks on a [`Backend`]: the causal attention's forward and
//! backward and one GEMM, timed on the backend's stream (launches, then a
//! host wait on a fence), rounds interleaved, medians reported with the
//! TFLOPS they mean.
//!
//! FLOPs are counted as FlashAttention counts them, so numbers compare
//! with published ones: a causal forward is `4 b h s^2 d / 2` (two
//! `s x s x d` products per head, half of them masked), its backward 2.5x
//! that; a GEMM is `2 m n k`.

use std::time::{Duration, Instant};

use half::bf16;
use strata_device::{Buffer, Dtype, View};

use crate::error::{KernelError, Result};
use crate::{Attention, Backend, Matrix};

/// What [`run`] measures.
#[derive(Clone, Copy, Debug)]
pub struct KernelBench {
    /// The attention's shape.
    pub attention: Attention,
    /// The GEMM's `m`, `n`, `k` (`a` is `m x k`, `b` `k x n`, `c` f32).
    pub gemm: [usize; 3],
    /// The inputs' element type (the GEMM's output is f32 either way).
    pub dtype: Dtype,
    /// Rounds; each runs every op once, interleaved.
    pub rounds: usize,
    /// Least time per op per round (short ops repeat).
    pub round_ms: u64,
    /// The most bytes one upload carries (the backend's limit).
    pub upload_bytes_max: usize,
}

/// One op's result.
#[derive(Clone, Debug)]
pub struct KernelRow {
    /// `attention_forward`, `attention_backward` or `gemm`.
    pub op: &'static str,
    /// The shape, as people write it.
    pub shape: String,
    /// The inputs' element type.
    pub dtype: Dtype,
    /// FLOPs of one call.
    pub flops: f64,
    /// Median seconds per call.
    pub seconds: f64,
    /// Calls per round.
    pub calls: usize,
}

impl KernelRow {
    /// TFLOPS at the median.
    pub fn tflops(&self) -> f64 {
        self.flops / self.seconds / 1e12
    }
}

/// FLOPs of a causal attention's forward (or backward), as FlashAttention
/// counts them.
pub fn attention_flops(shape: Attention, backward: bool) -> f64 {
    let (b, h, s, d) = (
        shape.batch as f64,
        shape.heads as f64,
        shape.seq as f64,
        shape.head_dim as f64,
    );
    let forward = 4.0 * b * h * s * s * d / 2.0;
    if backward { 2.5 * forward } else { forward }
}

/// The most bytes of device memory one op's operands may take (a bench
/// that asks for more is refused before anything is allocated).
pub const BENCH_BYTES_MAX: u64 = 64 << 30;

/// Measures the attention's forward and backward and the GEMM on
/// `backend`. Inputs are deterministic values in [-2, 2) (scaled for the
/// GEMM's reductions); every op reads only what earlier ops wrote.
pub fn run(backend: &dyn Backend, bench: &KernelBench) -> Result<Vec<KernelRow>> {
    let a = bench.attention;
    let [m, n, k] = bench.gemm;
    let elems = |what: &'static str, parts: &[usize]| -> Result<usize> {
        let total = parts
            .iter()
            .try_fold(1usize, |acc, &p| acc.checked_mul(p))
            .filter(|&e| (e as u64).saturating_mul(4) <= BENCH_BYTES_MAX)
            .ok_or(KernelError::Index {
                op: "bench",
                what,
                value: parts
                    .iter()
                    .fold(1u64, |acc, &p| acc.saturating_mul(p as u64)),
                max: BENCH_BYTES_MAX / 4,
            })?;
        Ok(total)
    };
    if [a.batch, a.seq, a.heads, a.head_dim, m, n, k].contains(&0) {
        return Err(KernelError::Shape {
            op: "bench",
            operand: "shape",
            actual: format!("{a:?}, gemm {m} x {n} x {k}"),
            expected: "every size at least 1".into(),
        });
    }
    let rows = elems("attention rows", &[a.batch, a.seq])?;
    let qkv_len = elems("qkv elements", &[rows, 3, a.heads, a.head_dim])?;
    let out_len = qkv_len / 3;
    let per_row = elems("attention rows x heads", &[rows, a.heads])?;
    let saved_len = backend.attention_saved_elems(a);
    let workspace_len = backend.attention_workspace_elems(a).max(per_row);
    elems("attention saved elements", &[saved_len])?;
    elems("attention workspace elements", &[workspace_len])?;
    let (a_len, b_len, c_len) = (
        elems("gemm a", &[m, k])?,
        elems("gemm b", &[k, n])?,
        elems("gemm c", &[m, n])?,
    );
    let dtype = bench.dtype;
    let filled = |len: usize, seed: u64, scale: f32| -> Result<Buffer> {
        let mut buffer = backend.alloc(dtype, len)?;
        fill(backend, &mut buffer, seed, scale, bench.upload_bytes_max)?;
        Ok(buffer)
    };
    let mut buffers = Buffers {
        qkv: filled(qkv_len, 1, 1.0)?,
        dout: filled(out_len, 2, 1.0)?,
        out: backend.alloc(dtype, out_len)?,
        dqkv: backend.alloc(dtype, qkv_len)?,
        saved: backend.alloc(Dtype::F32, saved_len)?,
        workspace: backend.alloc(Dtype::F32, workspace_len)?,
        a: filled(a_len, 3, 1.0 / (k as f32).sqrt())?,
        b: filled(b_len, 4, 1.0)?,
        c: backend.alloc(Dtype::F32, c_len)?,
    };
    let attention_shape = format!("b{} s{} h{} d{}", a.batch, a.seq, a.heads, a.head_dim);
    let ops = [
        (
            Op::Forward,
            attention_shape.clone(),
            attention_flops(a, false),
        ),
        (Op::Backward, attention_shape, attention_flops(a, true)),
        (
            Op::Gemm,
            format!("{m} x {n} x {k}"),
            2.0 * m as f64 * n as f64 * k as f64,
        ),
    ];
    let mut call = |op: Op| buffers.call(backend, op, a, bench.gemm);
    // The forward first, so that the backward reads a real `saved`; then a
    // warm-up of each (compiles, plans, caches) sized so a round takes
    // round_ms.
    call(Op::Forward)?;
    let least = Duration::from_millis(bench.round_ms.max(1));
    let mut calls = [1usize; 3];
    for (i, (op, _, _)) in ops.iter().enumerate() {
        let once = timed(backend, 1, || call(*op))?;
        let per_call = timed(backend, 1, || call(*op))?
            .min(once)
            .max(Duration::from_micros(1));
        calls[i] = (least.as_secs_f64() / per_call.as_secs_f64())
            .ceil()
            .clamp(1.0, 1e6) as usize;
    }
    let mut samples = [(); 3].map(|()| Vec::with_capacity(bench.rounds.max(1)));
    for _ in 0..bench.rounds.max(1) {
        for (i, (op, _, _)) in ops.iter().enumerate() {
            let elapsed = timed(backend, calls[i], || call(*op))?;
            samples[i].push(elapsed.as_secs_f64() / calls[i] as f64);
        }
    }
    Ok(ops
        .into_iter()
        .zip(samples)
        .zip(calls)
        .map(|(((op, shape, flops), mut s), calls)| {
            s.sort_by(f64::total_cmp);
            KernelRow {
                op: op.name(),
                shape,
                dtype,
                flops,
                seconds: s[s.len() / 2],
                calls,
            }
        })
        .collect())
}

#[derive(Clone, Copy)]
enum Op {
    Forward,
    Backward,
    Gemm,
}

impl Op {
    fn name(self) -> &'static str {
        match self {
            Op::Forward => "attention_forward",
            Op::Backward => "attention_backward",
            Op::Gemm => "gemm",
        }
    }
}

/// The operands of every op measured.
struct Buffers {
    qkv: Buffer,
    dout: Buffer,
    out: Buffer,
    dqkv: Buffer,
    saved: Buffer,
    workspace: Buffer,
    a: Buffer,
    b: Buffer,
    c: Buffer,
}

impl Buffers {
    fn call(
        &mut self,
        backend: &dyn Backend,
        op: Op,
        shape: Attention,
        [m, n, k]: [usize; 3],
    ) -> Result<()> {
        match op {
            Op::Forward => backend.attention(
                shape,
                crate::no_position_ids(),
                self.qkv.view(),
                self.out.view_mut(),
                self.saved.view_mut(),
                self.workspace.view_mut(),
            ),
            Op::Backward => backend.attention_backward(
                shape,
                crate::no_position_ids(),
                self.qkv.view(),
                self.out.view(),
                self.saved.view(),
                self.dout.view(),
                self.dqkv.view_mut(),
                self.workspace.view_mut(),
            ),
            Op::Gemm => backend.gemm(
                Matrix::n(self.a.view().matrix(m, k)?),
                Matrix::n(self.b.view().matrix(k, n)?),
                1.0,
                0.0,
                self.c.view_mut().matrix(m, n)?,
            ),
        }
    }
}

/// `calls` runs of `op`, then a host wait on the backend's fence.
fn timed(
    backend: &dyn Backend,
    calls: usize,
    mut op: impl FnMut() -> Result<()>,
) -> Result<Duration> {
    backend.record()?.wait()?;
    let start = Instant::now();
    for _ in 0..calls {
        op()?;
    }
    backend.record()?.wait()?;
    Ok(start.elapsed())
}

/// Fills `buffer` with deterministic values in `[-2, 2) x scale`, uploaded
/// in pieces of at most `upload_bytes_max` bytes.
fn fill(
    backend: &dyn Backend,
    buffer: &mut Buffer,
    seed: u64,
    scale: f32,
    upload_bytes_max: usize,
) -> Result<()> {
    let dtype = buffer.dtype();
    let piece = (upload_bytes_max / dtype.bytes() as usize).max(1);
    let value = |i: u64| {
        let x = (i ^ seed)
            .wrapping_mul(0x9e37_79b9_7f4a_7c15)
            .rotate_left(17);
        ((x >> 40) as f32 / (1u64 << 24) as f32 * 4.0 - 2.0) * scale
    };
    let len = buffer.len();
    for start in (0..len).step_by(piece) {
        let end = (start + piece).min(len);
        let target = buffer.view_mut().range(start..end);
        match dtype {
            Dtype::Bf16 => {
                let host: Vec<bf16> = (start..end)
                    .map(|i| bf16::from_f32(value(i as u64)))
                    .collect();
                backend.upload(View::host_slice(&host), target)?;
            }
            _ => {
                let host: Vec<f32> = (start..end).map(|i| value(i as u64)).collect();
                backend.upload(View::host_slice(&host), target)?;
            }
        }
        // Each upload's host copy lives until here: wait for it.
        backend.record()?.wait()?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::CpuBackend;

    #[test]
    fn flops_follow_flash_attentions_count() {
        let shape = Attention {
            batch: 1,
            seq: 1024,
            heads: 16,
            kv_heads: 16,
            head_dim: 128,
        };
        // 4 * 16 * 1024^2 * 128 / 2
        assert_eq!(attention_flops(shape, false), 4_294_967_296.0);
        assert_eq!(attention_flops(shape, true), 2.5 * 4_294_967_296.0);
    }

    #[test]
    fn a_tiny_bench_runs_on_the_cpu_and_an_absurd_one_is_refused() {
        let bench = KernelBench {
            attention: Attention {
                batch: 1,
                seq: 17,
                heads: 2,
                kv_heads: 2,
                head_dim: 8,
            },
            gemm: [16, 24, 8],
            dtype: Dtype::F32,
            rounds: 3,
            round_ms: 1,
            upload_bytes_max: 256,
        };
        let rows = run(&CpuBackend, &bench).unwrap();
        let ops: Vec<_> = rows.iter().map(|r| r.op).collect();
        assert_eq!(ops, ["attention_forward", "attention_backward", "gemm"]);
        for row in &rows {
            assert!(row.seconds > 0.0 && row.tflops().is_finite(), "{row:?}");
            assert!(row.calls >= 1);
        }
        assert_eq!(rows[2].flops, 2.0 * 16.0 * 24.0 * 8.0);
        let absurd = KernelBench {
            gemm: [1 << 20, 1 << 20, 8],
            ..bench
        };
        let err = run(&CpuBackend, &absurd).unwrap_err().to_string();
        assert!(
            err.contains("gemm c") && err.contains("index limit"),
            "{err}"
        );
        let empty = KernelBench {
            gemm: [0, 1, 1],
            ..bench
        };
        let err = run(&CpuBackend, &empty).unwrap_err().to_string();
        assert!(err.contains("at least 1"), "{err}");
    }
}
