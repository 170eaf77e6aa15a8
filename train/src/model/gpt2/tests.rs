//! Gradient check of the whole model against central finite differences
//! on a tiny shape.

use super::*;
use crate::error::TrainError;
use strata_kernels::CpuBackend;

const CPU: &dyn Backend = &CpuBackend;

fn v(x: &[f32]) -> View<'_> {
    View::host_slice(x)
}

fn w(x: &mut [f32]) -> ViewMut<'_> {
    ViewMut::host_slice(x)
}

/// One block's and the head's buffers for [`BATCH`] sequences in f32.
fn buffers() -> Buffers {
    CONFIG.buffers(CPU, BATCH, Dtype::F32).unwrap()
}

const CONFIG: Gpt2 = Gpt2 {
    vocab: 11,
    seq: 5,
    hidden: 8,
    heads: 2,
    layers: 2,
};
const BATCH: usize = 2;

/// Deterministic, varied parameter values (no RNG needed for a check).
fn values(count: usize, salt: f32, scale: f32) -> Vec<f32> {
    (0..count)
        .map(|i| scale * ((i as f32 + 1.0) * 0.618 + salt).sin())
        .collect()
}

struct Params {
    embed: Vec<f32>,
    blocks: Vec<Vec<f32>>,
}

fn model() -> Params {
    let mut embed = values(CONFIG.embed_params(), 0.3, 0.5);
    let layout = EmbedLayout::new(&CONFIG);
    // The final LayerNorm near identity, as at initialisation.
    for g in &mut embed[layout.range(2)] {
        *g = 1.0 + 0.1 * *g;
    }
    let blocks = (0..CONFIG.layers)
        .map(|l| {
            let mut p = values(CONFIG.block_params(), l as f32, 0.3);
            let layout = BlockLayout::new(CONFIG.hidden);
            for part in [0, 6] {
                for g in &mut p[layout.range(part)] {
                    *g = 1.0 + 0.1 * *g;
                }
            }
            p
        })
        .collect();
    Params { embed, blocks }
}

fn tokens() -> (Vec<u32>, Vec<u32>) {
    let n = BATCH * CONFIG.seq;
    let tokens = (0..n).map(|i| (i * 7 % CONFIG.vocab) as u32).collect();
    let targets = (0..n)
        .map(|i| ((i * 3 + 1) % CONFIG.vocab) as u32)
        .collect();
    (tokens, targets)
}

/// Loss and gradients (embeddings, then each block).
fn loss_and_grads(m: &Params) -> (f32, Vec<f32>, Vec<Vec<f32>>) {
    let (tokens, targets) = tokens();
    let n = BATCH * CONFIG.seq;
    let h = CONFIG.hidden;
    // Each block keeps its own activations until its backward.
    let mut acts: Vec<Buffers> = (0..CONFIG.layers).map(|_| buffers()).collect();
    let mut x = vec![0.0; n * h];
    let tokens = View::host_slice(&tokens);
    CONFIG
        .embed_forward(
            CPU,
            v(&m.embed),
            tokens,
            strata_kernels::no_position_ids(),
            w(&mut x),
        )
        .unwrap();
    let mut next = vec![0.0; n * h];
    for (l, p) in m.blocks.iter().enumerate() {
        CONFIG
            .block_forward(
                CPU,
                BATCH,
                strata_kernels::no_position_ids(),
                v(p).into(),
                v(&x),
                &mut acts[l],
                w(&mut next),
            )
            .unwrap();
        std::mem::swap(&mut x, &mut next);
    }
    let mut head = buffers();
    let mut dembed = vec![0.0; CONFIG.embed_params()];
    let mut dx = vec![0.0; n * h];
    let loss = CONFIG
        .head_forward_backward(
            CPU,
            v(&m.embed).into(),
            v(&x),
            View::host_slice(&targets),
            1.0,
            &mut head,
            w(&mut dx),
            w(&mut dembed),
        )
        .unwrap()
        .get()
        .unwrap() as f32;
    let mut dblocks = vec![vec![0.0; CONFIG.block_params()]; CONFIG.layers];
    let mut dprev = vec![0.0; n * h];
    for l in (0..CONFIG.layers).rev() {
        CONFIG
            .block_backward(
                CPU,
                BATCH,
                strata_kernels::no_position_ids(),
                v(&m.blocks[l]).into(),
                v(&dx),
                &mut acts[l],
                w(&mut dprev),
                w(&mut dblocks[l]),
            )
            .unwrap();
        std::mem::swap(&mut dx, &mut dprev);
    }
    CONFIG
        .embed_backward(
            CPU,
            tokens,
            strata_kernels::no_position_ids(),
            v(&dx),
            w(&mut dembed),
        )
        .unwrap();
    (loss, dembed, dblocks)
}

fn loss(m: &Params) -> f32 {
    loss_and_grads(m).0
}

#[test]
fn gradients_match_finite_differences() {
    let mut m = model();
    let (base, dembed, dblocks) = loss_and_grads(&m);
    assert!(base.is_finite() && base > 0.0);
    // Central differences in f32: 5e-3 balances rounding against
    // curvature (worst relative error seen 0.7%).
    let eps = 5e-3f32;
    let mut checked = 0;
    let mut check = |analytic: f32, plus: f32, minus: f32, what: &str| {
        let numeric = (plus - minus) / (2.0 * eps);
        let error = (analytic - numeric).abs() / (analytic.abs().max(numeric.abs()).max(1e-2));
        assert!(
            error < 2e-2,
            "{what}: analytic {analytic:e}, numeric {numeric:e}"
        );
        checked += 1;
    };
    // Every embedding and block parameter at a stride that visits each of
    // their tensors.
    for i in (0..dembed.len()).step_by(7) {
        let old = m.embed[i];
        m.embed[i] = old + eps;
        let plus = loss(&m);
        m.embed[i] = old - eps;
        let minus = loss(&m);
        m.embed[i] = old;
        check(dembed[i], plus, minus, &format!("embed[{i}]"));
    }
    for (l, grads) in dblocks.iter().enumerate() {
        for i in (0..grads.len()).step_by(5) {
            let old = m.blocks[l][i];
            m.blocks[l][i] = old + eps;
            let plus = loss(&m);
            m.blocks[l][i] = old - eps;
            let minus = loss(&m);
            m.blocks[l][i] = old;
            check(grads[i], plus, minus, &format!("block {l} [{i}]"));
        }
    }
    assert!(checked > 300, "{checked} checked");
}

#[test]
fn recomputed_forward_gives_the_same_gradients() {
    // Activation checkpointing: running a block's forward again from its
    // input before the backward changes nothing.
    let m = model();
    let (tokens, _) = tokens();
    let n = BATCH * CONFIG.seq;
    let h = CONFIG.hidden;
    let mut x = vec![0.0; n * h];
    CONFIG
        .embed_forward(
            CPU,
            v(&m.embed),
            View::host_slice(&tokens),
            strata_kernels::no_position_ids(),
            w(&mut x),
        )
        .unwrap();
    let mut out = vec![0.0; n * h];
    let dout = values(n * h, 2.0, 1.0);
    let mut grads = [
        vec![0.0; CONFIG.block_params()],
        vec![0.0; CONFIG.block_params()],
    ];
    let mut dx = [vec![0.0; n * h], vec![0.0; n * h]];
    for (grads, dx) in grads.iter_mut().zip(&mut dx) {
        let mut acts = buffers();
        let p = v(&m.blocks[0]);
        CONFIG
            .block_forward(
                CPU,
                BATCH,
                strata_kernels::no_position_ids(),
                p.into(),
                v(&x),
                &mut acts,
                w(&mut out),
            )
            .unwrap();
        assert_eq!(acts.input().host::<f32>().unwrap(), &x[..]);
        CONFIG
            .block_backward(
                CPU,
                BATCH,
                strata_kernels::no_position_ids(),
                p.into(),
                v(&dout),
                &mut acts,
                w(dx),
                w(grads),
            )
            .unwrap();
    }
    assert_eq!(grads[0], grads[1]);
    assert_eq!(dx[0], dx[1]);
}

#[test]
fn buffers_of_the_wrong_size_are_named_errors() {
    let m = model();
    let n = BATCH * CONFIG.seq;
    let h = CONFIG.hidden;
    let mut acts = buffers();
    let (x, mut out) = (vec![0.0; n * h - 1], vec![0.0; n * h]);
    let p = v(&m.blocks[0]);
    let error = CONFIG
        .block_forward(
            CPU,
            BATCH,
            strata_kernels::no_position_ids(),
            p.into(),
            v(&x),
            &mut acts,
            w(&mut out),
        )
        .unwrap_err();
    assert!(
        matches!(
            error,
            TrainError::Shape {
                what: "block input",
                actual: 79,
                expected: 80
            }
        ),
        "{error}"
    );
    // A token outside the vocabulary is the kernel's error, not a panic.
    let (tokens, mut x) = (vec![CONFIG.vocab as u32; n], vec![0.0; n * h]);
    let error = CONFIG
        .embed_forward(
            CPU,
            v(&m.embed),
            View::host_slice(&tokens),
            strata_kernels::no_position_ids(),
            w(&mut x),
        )
        .unwrap_err();
    assert!(
        error.to_string().contains("outside the vocabulary"),
        "{error}"
    );
}

#[test]
fn bad_shapes_are_named() {
    let mut c = CONFIG;
    c.heads = 3;
    let error = c.validate().unwrap_err().to_string();
    assert!(
        error.contains("model.hidden") && error.contains("model.heads"),
        "{error}"
    );
    c.heads = 0;
    assert!(
        c.validate()
            .unwrap_err()
            .to_string()
            .contains("model.heads")
    );
    assert!(CONFIG.validate().is_ok());
    assert_eq!(CONFIG.block_params(), 12 * 64 + 13 * 8);
}

#[test]
fn a_config_json_strata_would_compute_otherwise_is_refused_by_key() {
    let mut json = CONFIG.hf_config();
    assert_eq!(Gpt2::from_hf_config(&json).unwrap().hidden, CONFIG.hidden);
    for (key, value) in [
        ("n_inner", serde_json::json!(3 * CONFIG.hidden)),
        ("activation_function", serde_json::json!("relu")),
        ("tie_word_embeddings", serde_json::json!(false)),
        ("scale_attn_by_inverse_layer_idx", serde_json::json!(true)),
        ("layer_norm_epsilon", serde_json::json!(1e-6)),
        ("n_embd", serde_json::json!("eight")),
    ] {
        let kept = json[key].clone();
        json[key] = value;
        let err = Gpt2::from_hf_config(&json).unwrap_err().to_string();
        assert!(err.contains(key), "{key}: {err}");
        json[key] = kept;
    }
    // A shape strata refuses is named as the config's key.
    json["n_head"] = serde_json::json!(3);
    let err = Gpt2::from_hf_config(&json).unwrap_err().to_string();
    assert!(err.contains("model.hidden"), "{err}");
}
