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

    // Cross-entropy: the loss of uniform logits is ln(vocab); a bf16
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
    let halves = vec![half::bf16::ZERO; 2 * vocab];
    let err = backend
        .cross_entropy(
            View::host_slice(&halves),
            View::host_slice(&[0u32, 4]),
            1.0,
            ViewMut::host_slice(&mut dlogits),
        )
        .unwrap_err();
    assert!(
        err.to_string().contains("does not take bf16 for logits"),
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
