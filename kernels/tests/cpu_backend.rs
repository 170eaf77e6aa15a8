//! The CPU backend's ops against scalar f64 references, on odd shapes,
//! strided and transposed views; and its errors.

use strata_device::{Buffer, Dtype, View, ViewMut};
use strata_kernels::{Attention, Backend, CpuBackend, KernelError, Matrix};

fn values(count: usize, salt: u64) -> Vec<f32> {
    let mut state = salt.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..count)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

#[test]
fn gemm_takes_transposed_and_strided_views_with_alpha_and_beta() {
    let backend = CpuBackend;
    let (m, k, n) = (7, 5, 3);
    // `a` is the transpose of a 5 x 7 matrix; `b` is columns 2..5 of a
    // 5 x 9 matrix (row stride 9).
    let a_stored = values(k * m, 1);
    let b_stored = values(k * 9, 2);
    let mut c = values(m * n, 3);
    let c0 = c.clone();
    let a = Matrix::t(View::host_slice(&a_stored).matrix(k, m).unwrap());
    let b = Matrix::n(
        View::host_slice(&b_stored)
            .matrix(k, 9)
            .unwrap()
            .columns(2..5),
    );
    backend
        .gemm(
            a,
            b,
            0.5,
            2.0,
            ViewMut::host_slice(&mut c).matrix(m, n).unwrap(),
        )
        .unwrap();
    for i in 0..m {
        for j in 0..n {
            let dot: f64 = (0..k)
                .map(|p| f64::from(a_stored[p * m + i]) * f64::from(b_stored[p * 9 + 2 + j]))
                .sum();
            let expected = 0.5 * dot + 2.0 * f64::from(c0[i * n + j]);
            assert!(
                (f64::from(c[i * n + j]) - expected).abs() < 1e-5,
                "({i}, {j})"
            );
        }
    }
    let err = backend
        .gemm(
            a,
            b,
            1.0,
            0.0,
            ViewMut::host_slice(&mut c).matrix(n, m).unwrap(),
        )
        .unwrap_err();
    assert!(
        err.to_string().contains("a 7 x 5, b 5 x 3, c 3 x 7"),
        "{err}"
    );
}

/// Causal attention in f64: `out[t] = sum_{u <= t} softmax(q_t . k_u / sqrt(d)) v_u`.
fn attention_reference(shape: Attention, qkv: &[f32]) -> Vec<f64> {
    let (s, d, h) = (shape.seq, shape.head_dim, shape.hidden());
    let mut out = vec![0.0; shape.rows() * h];
    let at = |row: usize, col: usize| f64::from(qkv[row * 3 * h + col]);
    for b in 0..shape.batch {
        for head in 0..shape.heads {
            for t in 0..s {
                let scores: Vec<f64> = (0..=t)
                    .map(|u| {
                        (0..d)
                            .map(|i| at(b * s + t, head * d + i) * at(b * s + u, h + head * d + i))
                            .sum::<f64>()
                            / (d as f64).sqrt()
                    })
                    .collect();
                let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let sum: f64 = scores.iter().map(|v| (v - max).exp()).sum();
                for i in 0..d {
                    out[(b * s + t) * h + head * d + i] = (0..=t)
                        .map(|u| {
                            (scores[u] - max).exp() / sum * at(b * s + u, 2 * h + head * d + i)
                        })
                        .sum();
                }
            }
        }
    }
    out
}

#[test]
fn attention_matches_the_f64_reference_and_its_backward_the_finite_differences() {
    let backend = CpuBackend;
    // Odd sizes: 2 sequences of 5 tokens, 3 heads of 3.
    let shape = Attention {
        batch: 2,
        seq: 5,
        heads: 3,
        kv_heads: 3,
        head_dim: 3,
    };
    let h = shape.hidden();
    let qkv = values(shape.rows() * 3 * h, 4);
    let mut saved = backend
        .alloc(Dtype::F32, backend.attention_saved_elems(shape))
        .unwrap();
    let mut workspace = backend
        .alloc(Dtype::F32, backend.attention_workspace_elems(shape))
        .unwrap();
    let forward = |qkv: &[f32], saved: &mut Buffer, workspace: &mut Buffer| {
        let mut out = vec![0.0f32; shape.rows() * h];
        backend
            .attention(
                shape,
                strata_kernels::no_position_ids(),
                View::host_slice(qkv),
                ViewMut::host_slice(&mut out),
                saved.view_mut(),
                workspace.view_mut(),
            )
            .unwrap();
        out
    };
    let out = forward(&qkv, &mut saved, &mut workspace);
    for (got, want) in out.iter().zip(attention_reference(shape, &qkv)) {
        assert!((f64::from(*got) - want).abs() < 1e-5, "{got} vs {want}");
    }
    // d(sum(out * dout))/d(qkv) against central differences.
    let dout = values(out.len(), 5);
    let mut dqkv = vec![0.0f32; qkv.len()];
    backend
        .attention_backward(
            shape,
            strata_kernels::no_position_ids(),
            View::host_slice(&qkv),
            View::host_slice(&out),
            saved.view(),
            View::host_slice(&dout),
            ViewMut::host_slice(&mut dqkv),
            workspace.view_mut(),
        )
        .unwrap();
    let objective = |qkv: &[f32]| -> f64 {
        attention_reference(shape, qkv)
            .iter()
            .zip(&dout)
            .map(|(o, d)| o * f64::from(*d))
            .sum()
    };
    for index in (0..qkv.len()).step_by(7) {
        let eps = 1e-3;
        let (mut plus, mut minus) = (qkv.clone(), qkv.clone());
        plus[index] += eps;
        minus[index] -= eps;
        let numeric = (objective(&plus) - objective(&minus)) / (2.0 * f64::from(eps));
        assert!(
            (f64::from(dqkv[index]) - numeric).abs() < 2e-3,
            "qkv[{index}]: {} vs {numeric}",
            dqkv[index]
        );
    }
}

#[test]
fn layer_norm_embedding_and_cross_entropy_check_their_operands_by_name() {
    let backend = CpuBackend;
    let (rows, cols) = (3, 4);
    let x = values(rows * cols, 6);
    let (gamma, beta) = (values(cols, 7), values(cols, 8));
    let mut out = vec![0.0f32; rows * cols];
    let mut saved = vec![0.0f32; 2 * rows];
    backend
        .layer_norm(
            View::host_slice(&x),
            View::host_slice(&gamma),
            View::host_slice(&beta),
            ViewMut::host_slice(&mut out),
            ViewMut::host_slice(&mut saved),
        )
        .unwrap();
    for r in 0..rows {
        let row = &x[r * cols..][..cols];
        let mean = row.iter().map(|&v| f64::from(v)).sum::<f64>() / cols as f64;
        let var = row
            .iter()
            .map(|&v| (f64::from(v) - mean).powi(2))
            .sum::<f64>()
            / cols as f64;
        for j in 0..cols {
            let want = (f64::from(row[j]) - mean) / (var + 1e-5).sqrt() * f64::from(gamma[j])
                + f64::from(beta[j]);
            assert!((f64::from(out[r * cols + j]) - want).abs() < 1e-5);
        }
    }
    let mut short = vec![0.0f32; rows];
    let err = backend
        .layer_norm(
            View::host_slice(&x),
            View::host_slice(&gamma),
            View::host_slice(&beta),
            ViewMut::host_slice(&mut out),
            ViewMut::host_slice(&mut short),
        )
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("layer_norm: saved has 3 elements but 6 elements"),
        "{err}"
    );

    // A token id outside the vocabulary is named, not read out of bounds.
    let (vocab, hidden, seq) = (5, 2, 2);
    let (table, positions) = (values(vocab * hidden, 9), values(seq * hidden, 10));
    let mut embedded = vec![0.0f32; 2 * hidden];
    let err = backend
        .embedding(
            View::host_slice(&table),
            View::host_slice(&positions),
            View::host_slice(&[1u32, 5]),
            strata_kernels::no_position_ids(),
            seq,
            ViewMut::host_slice(&mut embedded),
        )
        .unwrap_err();
    assert!(
        matches!(
            err,
            KernelError::Token {
                token: 5,
                position: 1,
                vocab: 5,
                ..
            }
        ),
        "{err}"
    );

    // Cross-entropy: the loss of uniform logits is ln(vocab); an f16
    // operand is refused by name on the CPU backend.
    let logits = vec![0.0f32; 2 * vocab];
    let mut dlogits = vec![0.0f32; 2 * vocab];
    let loss = backend
        .cross_entropy(
            View::host_slice(&logits),
            View::host_slice(&[0u32, 4]),
            1.0,
            ViewMut::host_slice(&mut dlogits),
        )
        .unwrap()
        .get()
        .unwrap();
    assert!((loss - (vocab as f64).ln()).abs() < 1e-6);
    let halves = vec![half::f16::ZERO; 2 * vocab];
    let err = backend
        .cross_entropy(
            View::host_slice(&halves),
            View::host_slice(&[0u32, 4]),
            1.0,
            ViewMut::host_slice(&mut dlogits),
        )
        .unwrap_err();
    assert!(
        err.to_string().contains("does not take f16 for logits"),
        "{err}"
    );
}

#[test]
fn casts_copies_and_reductions_read_back_without_a_device_sync() {
    let backend = CpuBackend;
    let x = [1.0f32, -2.5, 3.0];
    let mut narrow = backend.alloc(Dtype::Bf16, 3).unwrap();
    backend
        .cast(View::host_slice(&x), narrow.view_mut())
        .unwrap();
    let mut wide = [0.0f32; 3];
    backend
        .cast(narrow.view(), ViewMut::host_slice(&mut wide))
        .unwrap();
    assert_eq!(wide, x);
    assert_eq!(
        backend
            .sum_squares(View::host_slice(&x))
            .unwrap()
            .get()
            .unwrap(),
        16.25
    );
    assert_eq!(
        backend
            .non_finite(View::host_slice(&x))
            .unwrap()
            .get()
            .unwrap(),
        0.0
    );
    let bad = [1.0f32, f32::NAN];
    assert_eq!(
        backend
            .non_finite(View::host_slice(&bad))
            .unwrap()
            .get()
            .unwrap(),
        1.0
    );
    let mut y = [1.0f32; 3];
    backend
        .axpy(2.0, View::host_slice(&x), ViewMut::host_slice(&mut y))
        .unwrap();
    assert_eq!(y, [3.0, -4.0, 7.0]);
    assert_eq!(
        backend
            .read_scalar(View::host_slice(&y), 2)
            .unwrap()
            .get()
            .unwrap(),
        7.0
    );
    backend.zero(ViewMut::host_slice(&mut y)).unwrap();
    assert_eq!(y, [0.0; 3]);
    assert!(backend.read_scalar(View::host_slice(&y), 3).is_err());
}

#[test]
fn fused_adamw_matches_the_f64_reference_for_ten_steps() {
    use strata_optim::AdamConfig;
    use strata_optim::reference::{State64, adam};
    let backend = CpuBackend;
    let n = 37;
    let config = AdamConfig::adamw(1e-2);
    let mut master = values(n, 11);
    let (mut m, mut v) = (vec![0.0f32; n], vec![0.0f32; n]);
    let mut param = vec![half::bf16::ZERO; n];
    let mut exact: Vec<State64> = master
        .iter()
        .map(|&p| State64 {
            p: f64::from(p),
            ..State64::default()
        })
        .collect();
    let grad_scale = 0.5f32;
    for step in 1..=10u64 {
        let grad = values(n, 100 + step);
        let coefficients = config.coefficients(step, grad_scale).unwrap();
        backend
            .adamw(
                &coefficients,
                View::host_slice(&grad),
                ViewMut::host_slice(&mut master),
                ViewMut::host_slice(&mut m),
                ViewMut::host_slice(&mut v),
                ViewMut::host_slice(&mut param),
            )
            .unwrap();
        for (x, g) in exact.iter_mut().zip(&grad) {
            *x = adam(&config, step, f64::from(grad_scale), f64::from(*g), *x);
        }
    }
    for i in 0..n {
        let (p, e) = (f64::from(master[i]), exact[i]);
        assert!(
            (p - e.p).abs() <= 1e-5 * e.p.abs().max(1e-2),
            "master[{i}] {p} vs {}",
            e.p
        );
        assert!(
            (f64::from(v[i]) - e.s2).abs() <= 1e-5 * e.s2.abs().max(1e-6),
            "v[{i}]"
        );
        assert_eq!(param[i], half::bf16::from_f32(master[i]), "param[{i}]");
    }
    // Operands of different lengths are named, before anything is written.
    let before = master.clone();
    let error = backend
        .adamw(
            &config.coefficients(11, 1.0).unwrap(),
            View::host_slice(&values(n, 1)),
            ViewMut::host_slice(&mut master),
            ViewMut::host_slice(&mut m),
            ViewMut::host_slice(&mut v[..n - 1]),
            ViewMut::host_slice(&mut param),
        )
        .unwrap_err();
    assert!(
        error.to_string().contains("adamw: v has 36 elements"),
        "{error}"
    );
    assert_eq!(master, before);
}

/// bf16 values as bf16, and the same values as f32.
fn bf16s(values: &[f32]) -> (Vec<half::bf16>, Vec<f32>) {
    let h: Vec<half::bf16> = values.iter().map(|&x| half::bf16::from_f32(x)).collect();
    let f = h.iter().map(|x| x.to_f32()).collect();
    (h, f)
}

fn rounded(values: &[f32]) -> Vec<u16> {
    values
        .iter()
        .map(|&x| half::bf16::from_f32(x).to_bits())
        .collect()
}

fn bits(values: &[half::bf16]) -> Vec<u16> {
    values.iter().map(|x| x.to_bits()).collect()
}

/// bf16 activations: each op computes in f32 on the widened values and
/// rounds what it writes once, so it equals the f32 op on the same values
/// with its output rounded, bit for bit (strided and transposed operands
/// included); f32 operands beside bf16 ones (parameters, statistics,
/// gradients) stay f32.
#[test]
fn bf16_operands_compute_in_f32_and_round_once_on_store() {
    let cpu = CpuBackend;
    // GEMM: a transposed bf16 `a`, a strided bf16 `b`, into bf16 and into
    // f32 (accumulating, beta = 1).
    let (m, k, n) = (6, 5, 4);
    let (a16, a32) = bf16s(&values(k * m, 20));
    let (b16, b32) = bf16s(&values(k * 7, 21));
    let a = |v| Matrix::t(v);
    let (av16, av32) = (
        View::host_slice(&a16).matrix(k, m).unwrap(),
        View::host_slice(&a32).matrix(k, m).unwrap(),
    );
    let (bv16, bv32) = (
        View::host_slice(&b16).matrix(k, 7).unwrap().columns(1..5),
        View::host_slice(&b32).matrix(k, 7).unwrap().columns(1..5),
    );
    let mut want = vec![0.0f32; m * n];
    fn w(c: &mut [f32], m: usize, n: usize) -> ViewMut<'_> {
        ViewMut::host_slice(c).matrix(m, n).unwrap()
    }
    cpu.gemm(a(av32), Matrix::n(bv32), 1.0, 0.0, w(&mut want, m, n))
        .unwrap();
    let mut got16 = vec![half::bf16::ZERO; m * n];
    cpu.gemm(
        a(av16),
        Matrix::n(bv16),
        1.0,
        0.0,
        ViewMut::host_slice(&mut got16).matrix(m, n).unwrap(),
    )
    .unwrap();
    assert_eq!(bits(&got16), rounded(&want));
    let start = values(m * n, 22);
    let (mut got32, mut want32) = (start.clone(), start);
    cpu.gemm(a(av16), Matrix::n(bv16), 1.0, 1.0, w(&mut got32, m, n))
        .unwrap();
    cpu.gemm(a(av32), Matrix::n(bv32), 1.0, 1.0, w(&mut want32, m, n))
        .unwrap();
    assert_eq!(got32, want32);

    // LayerNorm forward and backward, GELU, a residual add.
    let (rows, cols) = (3, 8);
    let (x16, x32) = bf16s(&values(rows * cols, 23));
    let (gamma, beta) = (values(cols, 24), values(cols, 25));
    let (mut out16, mut out32) = (vec![half::bf16::ZERO; rows * cols], vec![0.0; rows * cols]);
    let (mut saved16, mut saved32) = (vec![0.0f32; 2 * rows], vec![0.0f32; 2 * rows]);
    let ln = |x: View, out: ViewMut, saved: &mut [f32]| {
        cpu.layer_norm(
            x,
            View::host_slice(&gamma),
            View::host_slice(&beta),
            out,
            ViewMut::host_slice(saved),
        )
        .unwrap()
    };
    ln(
        View::host_slice(&x16),
        ViewMut::host_slice(&mut out16),
        &mut saved16,
    );
    ln(
        View::host_slice(&x32),
        ViewMut::host_slice(&mut out32),
        &mut saved32,
    );
    assert_eq!(bits(&out16), rounded(&out32));
    assert_eq!(saved16, saved32);
    let (dout16, dout32) = bf16s(&values(rows * cols, 26));
    let (dx_start16, dx_start32) = bf16s(&values(rows * cols, 27));
    let (mut dx16, mut dx32) = (dx_start16, dx_start32);
    let (mut dgb16, mut dgb32) = (vec![0.0f32; 2 * cols], vec![0.0f32; 2 * cols]);
    cpu.layer_norm_backward(
        View::host_slice(&dout16),
        View::host_slice(&x16),
        View::host_slice(&gamma),
        View::host_slice(&saved16),
        ViewMut::host_slice(&mut dx16),
        ViewMut::host_slice(&mut dgb16),
    )
    .unwrap();
    cpu.layer_norm_backward(
        View::host_slice(&dout32),
        View::host_slice(&x32),
        View::host_slice(&gamma),
        View::host_slice(&saved32),
        ViewMut::host_slice(&mut dx32),
        ViewMut::host_slice(&mut dgb32),
    )
    .unwrap();
    assert_eq!(bits(&dx16), rounded(&dx32), "dx adds to what it held");
    assert_eq!(dgb16, dgb32);
    cpu.gelu(View::host_slice(&x16), ViewMut::host_slice(&mut out16))
        .unwrap();
    cpu.gelu(View::host_slice(&x32), ViewMut::host_slice(&mut out32))
        .unwrap();
    assert_eq!(bits(&out16), rounded(&out32));
    cpu.add(ViewMut::host_slice(&mut out16), View::host_slice(&x16))
        .unwrap();
    let sum: Vec<f32> = out16.iter().map(|v| v.to_f32()).collect();
    let expected: Vec<f32> = rounded(&out32)
        .iter()
        .zip(&x32)
        .map(|(o, x)| half::bf16::from_bits(*o).to_f32() + x)
        .collect();
    assert_eq!(rounded(&sum), rounded(&expected));

    // Attention forward and backward.
    let shape = Attention {
        batch: 1,
        seq: 5,
        heads: 2,
        kv_heads: 2,
        head_dim: 4,
    };
    let h = shape.hidden();
    let (qkv16, qkv32) = bf16s(&values(shape.rows() * 3 * h, 28));
    let mut saved = vec![0.0f32; cpu.attention_saved_elems(shape)];
    let mut workspace = vec![0.0f32; cpu.attention_workspace_elems(shape)];
    let (mut att16, mut att32) = (
        vec![half::bf16::ZERO; shape.rows() * h],
        vec![0.0f32; shape.rows() * h],
    );
    cpu.attention(
        shape,
        strata_kernels::no_position_ids(),
        View::host_slice(&qkv16),
        ViewMut::host_slice(&mut att16),
        ViewMut::host_slice(&mut saved),
        ViewMut::host_slice(&mut workspace),
    )
    .unwrap();
    let saved16 = saved.clone();
    cpu.attention(
        shape,
        strata_kernels::no_position_ids(),
        View::host_slice(&qkv32),
        ViewMut::host_slice(&mut att32),
        ViewMut::host_slice(&mut saved),
        ViewMut::host_slice(&mut workspace),
    )
    .unwrap();
    assert_eq!(bits(&att16), rounded(&att32));
    assert_eq!(saved16, saved);
    let (d16, d32) = bf16s(&values(shape.rows() * h, 29));
    let att16_as32: Vec<f32> = att16.iter().map(|v| v.to_f32()).collect();
    let (mut dqkv16, mut dqkv32) = (
        vec![half::bf16::ZERO; qkv16.len()],
        vec![0.0f32; qkv16.len()],
    );
    cpu.attention_backward(
        shape,
        strata_kernels::no_position_ids(),
        View::host_slice(&qkv16),
        View::host_slice(&att16),
        View::host_slice(&saved),
        View::host_slice(&d16),
        ViewMut::host_slice(&mut dqkv16),
        ViewMut::host_slice(&mut workspace),
    )
    .unwrap();
    cpu.attention_backward(
        shape,
        strata_kernels::no_position_ids(),
        View::host_slice(&qkv32),
        View::host_slice(&att16_as32),
        View::host_slice(&saved),
        View::host_slice(&d32),
        ViewMut::host_slice(&mut dqkv32),
        ViewMut::host_slice(&mut workspace),
    )
    .unwrap();
    assert_eq!(bits(&dqkv16), rounded(&dqkv32));

    // Cross-entropy over bf16 logits, and the embeddings.
    let (tokens, vocab) = (4usize, 6usize);
    let (l16, l32) = bf16s(&values(tokens * vocab, 30));
    let targets: Vec<u32> = vec![0, 5, 2, 3];
    let (mut dl16, mut dl32) = (
        vec![half::bf16::ZERO; tokens * vocab],
        vec![0.0f32; tokens * vocab],
    );
    let loss16 = cpu
        .cross_entropy(
            View::host_slice(&l16),
            View::host_slice(&targets),
            0.5,
            ViewMut::host_slice(&mut dl16),
        )
        .unwrap()
        .get()
        .unwrap();
    let loss32 = cpu
        .cross_entropy(
            View::host_slice(&l32),
            View::host_slice(&targets),
            0.5,
            ViewMut::host_slice(&mut dl32),
        )
        .unwrap()
        .get()
        .unwrap();
    assert_eq!(loss16, loss32);
    assert_eq!(bits(&dl16), rounded(&dl32));
    let hidden = 3;
    let (table, positions) = (values(vocab * hidden, 31), values(2 * hidden, 32));
    let (mut e16, mut e32) = (
        vec![half::bf16::ZERO; tokens * hidden],
        vec![0.0f32; tokens * hidden],
    );
    for out in [ViewMut::host_slice(&mut e16), ViewMut::host_slice(&mut e32)] {
        cpu.embedding(
            View::host_slice(&table),
            View::host_slice(&positions),
            View::host_slice(&targets),
            strata_kernels::no_position_ids(),
            2,
            out,
        )
        .unwrap();
    }
    assert_eq!(bits(&e16), rounded(&e32));
    let (mut dt16, mut dt32) = (vec![0.0f32; vocab * hidden], vec![0.0f32; vocab * hidden]);
    let (mut dp16, mut dp32) = (vec![0.0f32; 2 * hidden], vec![0.0f32; 2 * hidden]);
    cpu.embedding_backward(
        View::host_slice(&targets),
        strata_kernels::no_position_ids(),
        2,
        View::host_slice(&e16),
        ViewMut::host_slice(&mut dt16),
        ViewMut::host_slice(&mut dp16),
    )
    .unwrap();
    let e16_as32: Vec<f32> = e16.iter().map(|v| v.to_f32()).collect();
    cpu.embedding_backward(
        View::host_slice(&targets),
        strata_kernels::no_position_ids(),
        2,
        View::host_slice(&e16_as32),
        ViewMut::host_slice(&mut dt32),
        ViewMut::host_slice(&mut dp32),
    )
    .unwrap();
    assert_eq!((dt16, dp16), (dt32, dp32));
    // A dtype the backend does not compute in is still named.
    let f16s = [half::f16::ZERO; 4];
    let err = cpu
        .gelu(
            View::host_slice(&f16s),
            ViewMut::host_slice(&mut [0.0f32; 4]),
        )
        .unwrap_err()
        .to_string();
    assert!(err.contains("f32 or bf16"), "{err}");
}

/// Central differences of `objective` at every `step`-th element of `x`
/// against `analytic`.
fn check_gradient(
    what: &str,
    x: &[f32],
    analytic: &[f32],
    step: usize,
    objective: impl Fn(&[f32]) -> f64,
) {
    for index in (0..x.len()).step_by(step) {
        let eps = 1e-3;
        let (mut plus, mut minus) = (x.to_vec(), x.to_vec());
        plus[index] += eps;
        minus[index] -= eps;
        let numeric = (objective(&plus) - objective(&minus)) / (2.0 * f64::from(eps));
        assert!(
            (f64::from(analytic[index]) - numeric).abs() < 2e-3 * (1.0 + numeric.abs()),
            "{what}[{index}]: {} vs {numeric}",
            analytic[index]
        );
    }
}

#[test]
fn grouped_query_attention_is_multi_head_attention_with_each_key_value_head_repeated() {
    let backend = CpuBackend;
    // 6 query heads over 2 key/value heads of 4; 2 sequences of 5 tokens.
    let gqa = Attention {
        batch: 2,
        seq: 5,
        heads: 6,
        kv_heads: 2,
        head_dim: 4,
    };
    let mha = Attention::mha(2, 5, 6, 4);
    let (d, rows) = (gqa.head_dim, gqa.rows());
    let packed = values(rows * gqa.qkv_width(), 11);
    // The same attention as multi-head: key/value head j copied to query
    // heads 3j, 3j+1, 3j+2.
    let repeat = |packed: &[f32]| -> Vec<f32> {
        let mut wide = Vec::with_capacity(rows * mha.qkv_width());
        for row in packed.chunks_exact(gqa.qkv_width()) {
            wide.extend_from_slice(&row[..gqa.hidden()]);
            for part in 0..2 {
                let at = gqa.hidden() + part * gqa.kv_hidden();
                for head in 0..gqa.heads {
                    let kv = head / gqa.group();
                    wide.extend_from_slice(&row[at + kv * d..][..d]);
                }
            }
        }
        wide
    };
    let run = |shape: Attention, qkv: &[f32], dout: &[f32]| -> (Vec<f32>, Vec<f32>) {
        let mut saved = backend
            .alloc(Dtype::F32, backend.attention_saved_elems(shape))
            .unwrap();
        let mut workspace = backend
            .alloc(Dtype::F32, backend.attention_workspace_elems(shape))
            .unwrap();
        let mut out = vec![0.0f32; shape.rows() * shape.hidden()];
        backend
            .attention(
                shape,
                strata_kernels::no_position_ids(),
                View::host_slice(qkv),
                ViewMut::host_slice(&mut out),
                saved.view_mut(),
                workspace.view_mut(),
            )
            .unwrap();
        let mut dqkv = vec![f32::NAN; qkv.len()];
        backend
            .attention_backward(
                shape,
                strata_kernels::no_position_ids(),
                View::host_slice(qkv),
                View::host_slice(&out),
                saved.view(),
                View::host_slice(dout),
                ViewMut::host_slice(&mut dqkv),
                workspace.view_mut(),
            )
            .unwrap();
        (out, dqkv)
    };
    let dout = values(rows * gqa.hidden(), 12);
    let (out, dqkv) = run(gqa, &packed, &dout);
    let (out_mha, dqkv_mha) = run(mha, &repeat(&packed), &dout);
    assert_eq!(out, out_mha);
    for (r, (row, wide)) in dqkv
        .chunks_exact(gqa.qkv_width())
        .zip(dqkv_mha.chunks_exact(mha.qkv_width()))
        .enumerate()
    {
        assert_eq!(row[..gqa.hidden()], wide[..mha.hidden()], "dq, row {r}");
        for part in 0..2 {
            for kv in 0..gqa.kv_heads {
                for i in 0..d {
                    let got = row[gqa.hidden() + part * gqa.kv_hidden() + kv * d + i];
                    let want: f32 = (0..gqa.group())
                        .map(|g| {
                            let head = kv * gqa.group() + g;
                            wide[mha.hidden() + part * mha.hidden() + head * d + i]
                        })
                        .sum();
                    assert!(
                        (got - want).abs() < 1e-6,
                        "row {r} part {part}: {got} vs {want}"
                    );
                }
            }
        }
    }
    // Heads that do not divide are refused by name.
    let odd = Attention { kv_heads: 4, ..gqa };
    let err = backend
        .attention(
            odd,
            strata_kernels::no_position_ids(),
            View::host_slice(&packed),
            ViewMut::host_slice(&mut vec![0.0; rows * gqa.hidden()]),
            backend.alloc(Dtype::F32, 1).unwrap().view_mut(),
            backend.alloc(Dtype::F32, 1).unwrap().view_mut(),
        )
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("kv_heads") && err.contains("6 query heads"),
        "{err}"
    );
}

#[test]
fn rms_norm_matches_the_f64_reference_and_its_backward_the_finite_differences() {
    let backend = CpuBackend;
    let (rows, cols, eps) = (5, 7, 1e-6f32);
    let x = values(rows * cols, 21);
    let gamma: Vec<f32> = values(cols, 22).iter().map(|g| 1.0 + g).collect();
    let reference = |x: &[f32]| -> Vec<f64> {
        x.chunks_exact(cols)
            .flat_map(|row| {
                let ms = row.iter().map(|v| f64::from(*v).powi(2)).sum::<f64>() / cols as f64;
                let s = 1.0 / (ms + f64::from(eps)).sqrt();
                row.iter()
                    .zip(&gamma)
                    .map(move |(v, g)| f64::from(*v) * s * f64::from(*g))
                    .collect::<Vec<_>>()
            })
            .collect()
    };
    let (mut out, mut saved) = (vec![0.0f32; x.len()], vec![0.0f32; rows]);
    backend
        .rms_norm(
            View::host_slice(&x),
            View::host_slice(&gamma),
            eps,
            ViewMut::host_slice(&mut out),
            ViewMut::host_slice(&mut saved),
        )
        .unwrap();
    for (got, want) in out.iter().zip(reference(&x)) {
        assert!((f64::from(*got) - want).abs() < 1e-5, "{got} vs {want}");
    }
    let dout = values(x.len(), 23);
    let (mut dx, mut dgamma) = (vec![0.0f32; x.len()], vec![0.0f32; cols]);
    backend
        .rms_norm_backward(
            View::host_slice(&dout),
            View::host_slice(&x),
            View::host_slice(&gamma),
            View::host_slice(&saved),
            ViewMut::host_slice(&mut dx),
            ViewMut::host_slice(&mut dgamma),
        )
        .unwrap();
    let dot = |y: Vec<f64>| -> f64 { y.iter().zip(&dout).map(|(a, b)| a * f64::from(*b)).sum() };
    check_gradient("dx", &x, &dx, 1, |x| dot(reference(x)));
    // dgamma: the sum over rows of dout * x * rstd.
    for j in 0..cols {
        let want: f64 = (0..rows)
            .map(|r| f64::from(dout[r * cols + j] * x[r * cols + j] * saved[r]))
            .sum();
        assert!((f64::from(dgamma[j]) - want).abs() < 1e-5, "dgamma[{j}]");
    }
}

#[test]
fn rotary_turns_queries_and_keys_by_position_and_back() {
    let backend = CpuBackend;
    let shape = Attention {
        batch: 2,
        seq: 3,
        heads: 4,
        kv_heads: 2,
        head_dim: 4,
    };
    let inv_freq = [1.0f32, 0.01];
    let qkv = values(shape.rows() * shape.qkv_width(), 31);
    let mut turned = qkv.clone();
    backend
        .rotary(
            shape,
            strata_kernels::no_position_ids(),
            View::host_slice(&inv_freq),
            false,
            ViewMut::host_slice(&mut turned),
        )
        .unwrap();
    let width = shape.qkv_width();
    for r in 0..shape.rows() {
        let position = (r % shape.seq) as f64;
        for head in 0..(shape.heads + shape.kv_heads) {
            let at = r * width + head * 4;
            for i in 0..2 {
                let angle = position * f64::from(inv_freq[i]);
                let (a, b) = (f64::from(qkv[at + i]), f64::from(qkv[at + i + 2]));
                let want = [
                    a * angle.cos() - b * angle.sin(),
                    b * angle.cos() + a * angle.sin(),
                ];
                for (got, want) in [turned[at + i], turned[at + i + 2]].iter().zip(want) {
                    assert!((f64::from(*got) - want).abs() < 1e-6, "row {r} head {head}");
                }
            }
        }
        // The values are not turned.
        let v = r * width + shape.hidden() + shape.kv_hidden();
        assert_eq!(turned[v..(r + 1) * width], qkv[v..(r + 1) * width]);
    }
    let mut back = turned.clone();
    backend
        .rotary(
            shape,
            strata_kernels::no_position_ids(),
            View::host_slice(&inv_freq),
            true,
            ViewMut::host_slice(&mut back),
        )
        .unwrap();
    for (a, b) in back.iter().zip(&qkv) {
        assert!((a - b).abs() < 1e-6);
    }
    let err = backend
        .rotary(
            shape,
            strata_kernels::no_position_ids(),
            View::host_slice(&inv_freq[..1]),
            false,
            ViewMut::host_slice(&mut back),
        )
        .unwrap_err()
        .to_string();
    assert!(err.contains("inv_freq"), "{err}");
}

#[test]
fn swiglu_matches_its_definition_and_its_backward_the_finite_differences() {
    let backend = CpuBackend;
    let (rows, f) = (3, 5);
    let gate_up: Vec<f32> = values(rows * 2 * f, 41).iter().map(|v| 3.0 * v).collect();
    let reference = |gu: &[f32]| -> Vec<f64> {
        gu.chunks_exact(2 * f)
            .flat_map(|row| {
                (0..f).map(move |j| {
                    let g = f64::from(row[j]);
                    g / (1.0 + (-g).exp()) * f64::from(row[f + j])
                })
            })
            .collect()
    };
    let mut out = vec![0.0f32; rows * f];
    backend
        .swiglu(
            View::host_slice(&gate_up).matrix(rows, 2 * f).unwrap(),
            ViewMut::host_slice(&mut out).matrix(rows, f).unwrap(),
        )
        .unwrap();
    for (got, want) in out.iter().zip(reference(&gate_up)) {
        assert!((f64::from(*got) - want).abs() < 1e-5, "{got} vs {want}");
    }
    let dout = values(rows * f, 42);
    let mut dgate_up = vec![0.0f32; gate_up.len()];
    backend
        .swiglu_backward(
            View::host_slice(&dout).matrix(rows, f).unwrap(),
            View::host_slice(&gate_up).matrix(rows, 2 * f).unwrap(),
            ViewMut::host_slice(&mut dgate_up)
                .matrix(rows, 2 * f)
                .unwrap(),
        )
        .unwrap();
    check_gradient("dgate_up", &gate_up, &dgate_up, 1, |gu| {
        reference(gu)
            .iter()
            .zip(&dout)
            .map(|(a, b)| a * f64::from(*b))
            .sum()
    });
    // A flat view cannot say where the gate ends: refused.
    let err = backend
        .swiglu(
            View::host_slice(&gate_up),
            ViewMut::host_slice(&mut out).matrix(rows, f).unwrap(),
        )
        .unwrap_err()
        .to_string();
    assert!(err.contains("gate_up") && err.contains("3 x 10"), "{err}");
}

/// A row whose target is `IGNORE_TARGET` adds no loss and gets a zero
/// gradient; the others' loss and gradient are those of the rows alone,
/// the mean still over every row (the caller rescales to its count).
#[test]
fn ignored_targets_add_no_loss_and_no_gradient() {
    use strata_kernels::IGNORE_TARGET;
    let cpu = CpuBackend;
    let vocab = 7;
    let logits = values(5 * vocab, 40);
    let targets = [3, IGNORE_TARGET, 6, IGNORE_TARGET, 0];
    let mut dl = vec![1.0f32; logits.len()];
    let loss = cpu
        .cross_entropy(
            View::host_slice(&logits),
            View::host_slice(&targets),
            2.0,
            ViewMut::host_slice(&mut dl),
        )
        .unwrap()
        .get()
        .unwrap();
    // The counted rows alone, each as a batch of one (mean = its loss).
    let mut want_loss = 0.0;
    for (row, &target) in targets.iter().enumerate() {
        let cut = &logits[row * vocab..][..vocab];
        let d = &dl[row * vocab..][..vocab];
        if target == IGNORE_TARGET {
            assert!(d.iter().all(|&x| x == 0.0), "row {row}: {d:?}");
            continue;
        }
        let mut alone = vec![0.0f32; vocab];
        let one = cpu
            .cross_entropy(
                View::host_slice(cut),
                View::host_slice(&targets[row..=row]),
                2.0 / 5.0,
                ViewMut::host_slice(&mut alone),
            )
            .unwrap()
            .get()
            .unwrap();
        want_loss += one / 5.0;
        assert_eq!(d, alone.as_slice(), "row {row}");
    }
    assert!(
        (loss - want_loss).abs() < 1e-6,
        "{loss} against {want_loss}"
    );
    // An id past the vocabulary is still refused.
    let err = cpu
        .cross_entropy(
            View::host_slice(&logits),
            View::host_slice(&[3, 7, 6, 1, 0]),
            1.0,
            ViewMut::host_slice(&mut dl),
        )
        .unwrap_err();
    assert!(matches!(err, KernelError::Token { token: 7, .. }), "{err}");
}

/// Documents packed into one sequence with position ids restarting at 0:
/// attention (and its backward) and rotary embeddings give each document
/// what it gets alone, and the embedding reads each row's position by its
/// id; an id past a row's place in its sequence is refused.
#[test]
fn position_ids_keep_packed_documents_apart() {
    let cpu = CpuBackend;
    let shape = |seq| Attention {
        batch: 1,
        seq,
        heads: 2,
        kv_heads: 1,
        head_dim: 4,
    };
    let (lens, seq) = ([3usize, 4], 7);
    let ids: Vec<u32> = lens.iter().flat_map(|&n| 0..n as u32).collect();
    let packed = shape(seq);
    let width = packed.qkv_width();
    let qkv = values(seq * width, 50);
    let dout = values(seq * packed.hidden(), 51);
    // Forward, backward and rotary of `rows` alone, or packed with `ids`.
    let run = |shape: Attention, ids: &[u32], qkv: &[f32], dout: &[f32]| {
        let mut saved = vec![0.0f32; cpu.attention_saved_elems(shape)];
        let mut workspace = vec![0.0f32; cpu.attention_workspace_elems(shape)];
        let mut out = vec![0.0f32; dout.len()];
        let ids = View::host_slice(ids);
        cpu.attention(
            shape,
            ids,
            View::host_slice(qkv),
            ViewMut::host_slice(&mut out),
            ViewMut::host_slice(&mut saved),
            ViewMut::host_slice(&mut workspace),
        )
        .unwrap();
        let mut dqkv = vec![0.0f32; qkv.len()];
        cpu.attention_backward(
            shape,
            ids,
            View::host_slice(qkv),
            View::host_slice(&out),
            View::host_slice(&saved),
            View::host_slice(dout),
            ViewMut::host_slice(&mut dqkv),
            ViewMut::host_slice(&mut workspace),
        )
        .unwrap();
        let mut turned = qkv.to_vec();
        let inv_freq = [1.0f32, 0.25];
        cpu.rotary(
            shape,
            ids,
            View::host_slice(&inv_freq),
            false,
            ViewMut::host_slice(&mut turned),
        )
        .unwrap();
        (out, dqkv, turned)
    };
    let together = run(packed, &ids, &qkv, &dout);
    let mut row = 0;
    for &n in &lens {
        let h = packed.hidden();
        let alone = run(
            shape(n),
            &[],
            &qkv[row * width..(row + n) * width],
            &dout[row * h..(row + n) * h],
        );
        let close = |what: &str, got: &[f32], want: &[f32]| {
            for (g, w) in got.iter().zip(want) {
                assert!(
                    (g - w).abs() <= 1e-6 * w.abs().max(1.0),
                    "{what}: {g} vs {w}"
                );
            }
        };
        close("out", &together.0[row * h..(row + n) * h], &alone.0);
        close(
            "dqkv",
            &together.1[row * width..(row + n) * width],
            &alone.1,
        );
        close(
            "rotary",
            &together.2[row * width..(row + n) * width],
            &alone.2,
        );
        row += n;
    }
    // The embedding adds the position row each id names.
    let (hidden, vocab) = (2, 3);
    let (table, positions) = (values(vocab * hidden, 52), values(seq * hidden, 53));
    let tokens: Vec<u32> = (0..seq as u32).map(|i| i % vocab as u32).collect();
    let mut out = vec![0.0f32; seq * hidden];
    cpu.embedding(
        View::host_slice(&table),
        View::host_slice(&positions),
        View::host_slice(&tokens),
        View::host_slice(&ids),
        seq,
        ViewMut::host_slice(&mut out),
    )
    .unwrap();
    for (i, row) in out.chunks_exact(hidden).enumerate() {
        let (t, p) = (tokens[i] as usize, ids[i] as usize);
        for j in 0..hidden {
            assert_eq!(row[j], table[t * hidden + j] + positions[p * hidden + j]);
        }
    }
    // A document cannot start before its sequence does.
    let mut bad = ids.clone();
    bad[4] = 5;
    let mut out = vec![0.0f32; seq * packed.hidden()];
    let err = cpu
        .attention(
            packed,
            View::host_slice(&bad),
            View::host_slice(&qkv),
            ViewMut::host_slice(&mut out),
            ViewMut::host_slice(&mut vec![0.0; cpu.attention_saved_elems(packed)]),
            ViewMut::host_slice(&mut vec![0.0; cpu.attention_workspace_elems(packed)]),
        )
        .unwrap_err();
    assert!(
        matches!(
            err,
            KernelError::Index {
                value: 5,
                max: 4,
                ..
            }
        ),
        "{err}"
    );
}

/// Decoding: a row's attention over a key/value cache of the rows up to
/// it is that row of the causal attention over the sequence, for every
/// length and with grouped-query heads.
#[test]
fn attention_decode_is_the_last_row_of_causal_attention() {
    let cpu = CpuBackend;
    for len in 1..=6 {
        let shape = Attention {
            batch: 1,
            seq: len,
            heads: 4,
            kv_heads: 2,
            head_dim: 3,
        };
        let (h, kv, width) = (shape.hidden(), shape.kv_hidden(), shape.qkv_width());
        let qkv = values(len * width, 60 + len as u64);
        let mut out = vec![0.0f32; len * h];
        cpu.attention(
            shape,
            strata_kernels::no_position_ids(),
            View::host_slice(&qkv),
            ViewMut::host_slice(&mut out),
            ViewMut::host_slice(&mut vec![0.0; cpu.attention_saved_elems(shape)]),
            ViewMut::host_slice(&mut vec![0.0; cpu.attention_workspace_elems(shape)]),
        )
        .unwrap();
        let rows = |from: usize| -> Vec<f32> {
            qkv.chunks_exact(width)
                .flat_map(|r| r[from..from + kv].to_vec())
                .collect()
        };
        let (keys, vals) = (rows(h), rows(h + kv));
        let mut one = vec![0.0f32; h];
        cpu.attention_decode(
            shape,
            len,
            View::host_slice(&qkv[(len - 1) * width..][..h]),
            View::host_slice(&keys),
            View::host_slice(&vals),
            ViewMut::host_slice(&mut one),
        )
        .unwrap();
        for (got, want) in one.iter().zip(&out[(len - 1) * h..]) {
            assert!((got - want).abs() <= 1e-6, "len {len}: {got} vs {want}");
        }
    }
}
