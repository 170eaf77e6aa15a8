//! Kernel benchmarks on a [`Backend`]: causal attentions' forward and
//! backward (multi-head, grouped-query, documents packed into sequences)
//! and one GEMM, timed on the backend's stream (launches, then a host wait
//! on a fence), rounds interleaved, medians reported with the TFLOPS they
//! mean.
//!
//! FLOPs are counted as FlashAttention counts them, so numbers compare
//! with published ones: a causal forward is `4 b h s^2 d / 2` (two
//! `s x s x d` products per query head, half of them masked), its backward
//! 2.5x that; with packed documents `s^2` is the sum of the documents'
//! squared lengths (what the kernels compute); a GEMM is `2 m n k`.

use std::time::{Duration, Instant};

use half::bf16;
use strata_device::{Buffer, Dtype, View};

use crate::error::{KernelError, Result};
use crate::{Attention, Backend, Matrix};

/// One attention [`run`] measures.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionCase {
    /// Its shape (`kv_heads` below `heads`: grouped-query).
    pub shape: Attention,
    /// Each sequence cut into documents of this many tokens (the last may
    /// be shorter), kept apart by position ids; `None`: one causal
    /// sequence.
    pub documents: Option<usize>,
}

impl AttentionCase {
    /// The shape as people write it: `b4 s1024 h32 kv8 d128 docs 300`.
    pub fn label(&self) -> String {
        let a = self.shape;
        let kv = match a.kv_heads == a.heads {
            true => String::new(),
            false => format!(" kv{}", a.kv_heads),
        };
        let docs = self
            .documents
            .map_or(String::new(), |l| format!(" docs {l}"));
        format!(
            "b{} s{} h{}{kv} d{}{docs}",
            a.batch, a.seq, a.heads, a.head_dim
        )
    }

    /// Each sequence's position ids: restarting at 0 at each document.
    pub fn position_ids(&self) -> Vec<u32> {
        let (b, s) = (self.shape.batch, self.shape.seq);
        match self.documents {
            None => Vec::new(),
            Some(len) => (0..b * s).map(|i| ((i % s) % len.max(1)) as u32).collect(),
        }
    }
}

/// What [`run`] measures.
#[derive(Clone, Debug)]
pub struct KernelBench {
    /// The attentions, each timed forward and backward.
    pub attentions: Vec<AttentionCase>,
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
    /// Which of [`KernelBench::attentions`] (`None`: the GEMM).
    pub attention: Option<usize>,
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
/// counts them: `4 b h s^2 d / 2`, `s^2` summed over the documents of
/// `documents` tokens where a sequence packs them.
pub fn attention_flops(shape: Attention, documents: Option<usize>, backward: bool) -> f64 {
    let (b, h, d) = (
        shape.batch as f64,
        shape.heads as f64,
        shape.head_dim as f64,
    );
    let s = shape.seq;
    let squares = match documents {
        None => (s as f64).powi(2),
        Some(len) => {
            let len = len.clamp(1, s.max(1));
            let (whole, rest) = (s / len, s % len);
            whole as f64 * (len as f64).powi(2) + (rest as f64).powi(2)
        }
    };
    let forward = 4.0 * b * h * squares * d / 2.0;
    if backward { 2.5 * forward } else { forward }
}

/// The most bytes of device memory one op's operands may take (a bench
/// that asks for more is refused before anything is allocated).
pub const BENCH_BYTES_MAX: u64 = 64 << 30;

/// Measures the attention's forward and backward and the GEMM on
/// `backend`. Inputs are deterministic values in [-2, 2) (scaled for the
/// GEMM's reductions); every op reads only what earlier ops wrote.
pub fn run(backend: &dyn Backend, bench: &KernelBench) -> Result<Vec<KernelRow>> {
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
    for case in &bench.attentions {
        let a = case.shape;
        let sizes = [a.batch, a.seq, a.heads, a.kv_heads, a.head_dim];
        if sizes.contains(&0) || case.documents == Some(0) || !a.heads.is_multiple_of(a.kv_heads) {
            return Err(KernelError::Shape {
                op: "bench",
                operand: "attention",
                actual: case.label(),
                expected: "every size at least 1, key/value heads dividing the query heads".into(),
            });
        }
    }
    if [m, n, k].contains(&0) {
        return Err(KernelError::Shape {
            op: "bench",
            operand: "gemm",
            actual: format!("{m} x {n} x {k}"),
            expected: "every size at least 1".into(),
        });
    }
    let dtype = bench.dtype;
    let filled = |len: usize, seed: u64, scale: f32| -> Result<Buffer> {
        let mut buffer = backend.alloc(dtype, len)?;
        fill(backend, &mut buffer, seed, scale, bench.upload_bytes_max)?;
        Ok(buffer)
    };
    let mut attentions = Vec::with_capacity(bench.attentions.len());
    for case in &bench.attentions {
        let a = case.shape;
        let rows = elems("attention rows", &[a.batch, a.seq])?;
        let qkv_len = elems(
            "qkv elements",
            &[rows, a.heads + 2 * a.kv_heads, a.head_dim],
        )?;
        let out_len = elems("attention output elements", &[rows, a.heads, a.head_dim])?;
        let per_row = elems("attention rows x heads", &[rows, a.heads])?;
        let saved_len = backend.attention_saved_elems(a);
        let workspace_len = backend.attention_workspace_elems(a).max(per_row);
        elems("attention saved elements", &[saved_len])?;
        elems("attention workspace elements", &[workspace_len])?;
        let ids = case.position_ids();
        let mut position_ids = backend.alloc(Dtype::U32, ids.len())?;
        for (piece, at) in ids
            .chunks((bench.upload_bytes_max / 4).max(1))
            .zip((0..).step_by((bench.upload_bytes_max / 4).max(1)))
        {
            let target = position_ids.view_mut().range(at..at + piece.len());
            backend.upload(View::host_slice(piece), target)?;
            backend.record()?.wait()?;
        }
        attentions.push(AttentionBuffers {
            qkv: filled(qkv_len, 1, 1.0)?,
            dout: filled(out_len, 2, 1.0)?,
            out: backend.alloc(dtype, out_len)?,
            dqkv: backend.alloc(dtype, qkv_len)?,
            saved: backend.alloc(Dtype::F32, saved_len)?,
            workspace: backend.alloc(Dtype::F32, workspace_len)?,
            position_ids,
        });
    }
    let (a_len, b_len, c_len) = (
        elems("gemm a", &[m, k])?,
        elems("gemm b", &[k, n])?,
        elems("gemm c", &[m, n])?,
    );
    let mut buffers = Buffers {
        attentions,
        a: filled(a_len, 3, 1.0 / (k as f32).sqrt())?,
        b: filled(b_len, 4, 1.0)?,
        c: backend.alloc(Dtype::F32, c_len)?,
    };
    let mut ops = Vec::new();
    for (i, case) in bench.attentions.iter().enumerate() {
        let (label, docs) = (case.label(), case.documents);
        ops.push((
            Op::Forward(i),
            label.clone(),
            attention_flops(case.shape, docs, false),
        ));
        ops.push((
            Op::Backward(i),
            label,
            attention_flops(case.shape, docs, true),
        ));
    }
    ops.push((
        Op::Gemm,
        format!("{m} x {n} x {k}"),
        2.0 * m as f64 * n as f64 * k as f64,
    ));
    let cases = &bench.attentions;
    let mut call = |op: Op| buffers.call(backend, op, cases, bench.gemm);
    // Each forward first, so that the backward reads a real `saved`; then
    // a warm-up of each (compiles, plans, caches) sized so a round takes
    // round_ms.
    for i in 0..cases.len() {
        call(Op::Forward(i))?;
    }
    let least = Duration::from_millis(bench.round_ms.max(1));
    let mut calls = vec![1usize; ops.len()];
    for (i, (op, _, _)) in ops.iter().enumerate() {
        let once = timed(backend, 1, || call(*op))?;
        let per_call = timed(backend, 1, || call(*op))?
            .min(once)
            .max(Duration::from_micros(1));
        calls[i] = (least.as_secs_f64() / per_call.as_secs_f64())
            .ceil()
            .clamp(1.0, 1e6) as usize;
    }
    let mut samples = vec![Vec::with_capacity(bench.rounds.max(1)); ops.len()];
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
                attention: op.attention(),
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
    /// Attention `i`'s forward.
    Forward(usize),
    /// Attention `i`'s backward.
    Backward(usize),
    Gemm,
}

impl Op {
    fn name(self) -> &'static str {
        match self {
            Op::Forward(_) => "attention_forward",
            Op::Backward(_) => "attention_backward",
            Op::Gemm => "gemm",
        }
    }

    fn attention(self) -> Option<usize> {
        match self {
            Op::Forward(i) | Op::Backward(i) => Some(i),
            Op::Gemm => None,
        }
    }
}

/// One attention's operands.
struct AttentionBuffers {
    qkv: Buffer,
    dout: Buffer,
    out: Buffer,
    dqkv: Buffer,
    saved: Buffer,
    workspace: Buffer,
    /// Empty without packed documents.
    position_ids: Buffer,
}

/// The operands of every op measured.
struct Buffers {
    attentions: Vec<AttentionBuffers>,
    a: Buffer,
    b: Buffer,
    c: Buffer,
}

impl Buffers {
    fn call(
        &mut self,
        backend: &dyn Backend,
        op: Op,
        cases: &[AttentionCase],
        [m, n, k]: [usize; 3],
    ) -> Result<()> {
        match op {
            Op::Forward(i) => {
                let x = &mut self.attentions[i];
                backend.attention(
                    cases[i].shape,
                    x.position_ids.view(),
                    x.qkv.view(),
                    x.out.view_mut(),
                    x.saved.view_mut(),
                    x.workspace.view_mut(),
                )
            }
            Op::Backward(i) => {
                let x = &mut self.attentions[i];
                backend.attention_backward(
                    cases[i].shape,
                    x.position_ids.view(),
                    x.qkv.view(),
                    x.out.view(),
                    x.saved.view(),
                    x.dout.view(),
                    x.dqkv.view_mut(),
                    x.workspace.view_mut(),
                )
            }
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
        let shape = Attention::mha(1, 1024, 16, 128);
        // 4 * 16 * 1024^2 * 128 / 2
        assert_eq!(attention_flops(shape, None, false), 4_294_967_296.0);
        assert_eq!(attention_flops(shape, None, true), 2.5 * 4_294_967_296.0);
        // Documents of 300: three whole and one of 124.
        let packed = attention_flops(shape, Some(300), false);
        let squares = 3.0 * 300f64.powi(2) + 124f64.powi(2);
        assert_eq!(packed, 4.0 * 16.0 * squares * 128.0 / 2.0);
        // Key/value heads do not change the count: every query head
        // computes its products.
        let gqa = Attention {
            kv_heads: 4,
            ..shape
        };
        assert_eq!(attention_flops(gqa, None, false), 4_294_967_296.0);
    }

    #[test]
    fn a_tiny_bench_runs_on_the_cpu_and_an_absurd_one_is_refused() {
        let mha = AttentionCase {
            shape: Attention::mha(1, 17, 2, 8),
            documents: None,
        };
        let gqa = AttentionCase {
            shape: Attention {
                batch: 2,
                seq: 19,
                heads: 4,
                kv_heads: 2,
                head_dim: 8,
            },
            documents: Some(7),
        };
        assert_eq!(gqa.label(), "b2 s19 h4 kv2 d8 docs 7");
        assert_eq!(
            &gqa.position_ids()[..9],
            &[0, 1, 2, 3, 4, 5, 6, 0, 1],
            "ids restart at each document"
        );
        assert_eq!(gqa.position_ids()[19], 0, "and at each sequence");
        let bench = KernelBench {
            attentions: vec![mha, gqa],
            gemm: [16, 24, 8],
            dtype: Dtype::F32,
            rounds: 3,
            round_ms: 1,
            upload_bytes_max: 256,
        };
        let rows = run(&CpuBackend, &bench).unwrap();
        let ops: Vec<_> = rows.iter().map(|r| (r.op, r.attention)).collect();
        assert_eq!(
            ops,
            [
                ("attention_forward", Some(0)),
                ("attention_backward", Some(0)),
                ("attention_forward", Some(1)),
                ("attention_backward", Some(1)),
                ("gemm", None)
            ]
        );
        for row in &rows {
            assert!(row.seconds > 0.0 && row.tflops().is_finite(), "{row:?}");
            assert!(row.calls >= 1);
        }
        assert_eq!(rows[4].flops, 2.0 * 16.0 * 24.0 * 8.0);
        let absurd = KernelBench {
            gemm: [1 << 20, 1 << 20, 8],
            ..bench.clone()
        };
        let err = run(&CpuBackend, &absurd).unwrap_err().to_string();
        assert!(
            err.contains("gemm c") && err.contains("index limit"),
            "{err}"
        );
        let empty = KernelBench {
            gemm: [0, 1, 1],
            ..bench.clone()
        };
        let err = run(&CpuBackend, &empty).unwrap_err().to_string();
        assert!(err.contains("at least 1"), "{err}");
        let uneven = KernelBench {
            attentions: vec![AttentionCase {
                shape: Attention {
                    kv_heads: 3,
                    ..gqa.shape
                },
                documents: None,
            }],
            ..bench
        };
        let err = run(&CpuBackend, &uneven).unwrap_err().to_string();
        assert!(err.contains("dividing the query heads"), "{err}");
    }
}
