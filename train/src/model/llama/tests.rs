//! The family's head in chunks against one chunk, its configs and what it
//! refuses. (Its numbers against transformers: `tests/hf_fixtures.rs`.)

use strata_device::{Dtype, View, ViewMut};
use strata_kernels::CpuBackend;

use super::*;

fn config(variant: Variant) -> ModelConfig {
    ModelConfig {
        arch: Arch::named(variant.name).unwrap(),
        vocab: 11,
        seq: 5,
        hidden: 8,
        heads: 4,
        layers: 2,
        kv_heads: Some(2),
        ffn: Some(12),
        tie_embeddings: Some(false),
        ..ModelConfig::default()
    }
}

/// The head's loss and gradients with `logit_rows` rows of logits at once.
fn head(model: &Llama, outer: &[f32], x: &[f32], targets: &[u32]) -> (f64, Vec<f32>, Vec<f32>) {
    let backend = CpuBackend;
    let mut buffers = model.buffers(&backend, 2, Dtype::F32).unwrap();
    let (mut dx, mut douter) = (vec![0f32; x.len()], vec![0f32; outer.len()]);
    let loss = model
        .head_forward_backward(
            &backend,
            Weights::from(View::host_slice(outer)),
            View::host_slice(x),
            View::host_slice(targets),
            0.5,
            &mut buffers,
            ViewMut::host_slice(&mut dx),
            ViewMut::host_slice(&mut douter),
        )
        .unwrap()
        .get()
        .unwrap();
    (loss, dx, douter)
}

#[test]
fn the_head_in_chunks_of_rows_is_the_head_in_one() {
    for tied in [false, true] {
        let mut whole = Llama::new(
            LLAMA,
            &ModelConfig {
                tie_embeddings: Some(tied),
                ..config(LLAMA)
            },
        )
        .unwrap();
        whole.logit_rows = 10;
        let mut chunked = whole.clone();
        chunked.logit_rows = 3;
        let mut outer = vec![0f32; whole.groups()[0].params()];
        whole.init(0, 7, &mut outer);
        let x: Vec<f32> = (0..10 * 8)
            .map(|i| ((i * 37 % 17) as f32 - 8.0) / 8.0)
            .collect();
        let targets: Vec<u32> = (0..10).map(|i| (i * 7 % 11) as u32).collect();
        let (loss, dx, douter) = head(&whole, &outer, &x, &targets);
        let (loss_c, dx_c, douter_c) = head(&chunked, &outer, &x, &targets);
        assert!((loss - loss_c).abs() < 1e-6 * loss, "{loss} vs {loss_c}");
        for (a, b) in dx.iter().zip(&dx_c).chain(douter.iter().zip(&douter_c)) {
            assert!((a - b).abs() < 1e-6, "{a} vs {b}");
        }
        assert!(douter.iter().any(|g| *g != 0.0));
    }
}

#[test]
fn a_large_vocabulary_holds_one_chunk_of_logits() {
    let model = Llama::new(
        LLAMA,
        &ModelConfig {
            vocab: 128_256,
            seq: 2048,
            ..config(LLAMA)
        },
    )
    .unwrap();
    let parts = model.head_parts(8, Dtype::Bf16);
    // Two chunks of logits (and their gradient), not 8 x 2048 rows each.
    assert!(parts.lens[2] <= LOGITS_CHUNK_ELEMS, "{}", parts.lens[2]);
    assert!(parts.lens[2] * 2 < 8 * 2048 * 128_256 / 8);
}

#[test]
fn configs_read_back_and_what_is_not_computed_is_refused_by_key() {
    for variant in [LLAMA, MISTRAL, QWEN2] {
        let model = Llama::new(variant, &config(variant)).unwrap();
        assert_eq!(model.params(), model.cost_model(1).params() as usize);
        let json = model.hf_config();
        assert_eq!(json["architectures"][0], variant.class);
        let read = Llama::from_hf_config(variant, &json).unwrap();
        assert_eq!(Llama::new(variant, &read).unwrap().hf_config(), json);
    }
    let refused = |variant: Variant, patch: serde_json::Value| -> String {
        let mut json = Llama::new(variant, &config(variant)).unwrap().hf_config();
        for (k, v) in patch.as_object().unwrap() {
            json[k] = v.clone();
        }
        Llama::from_hf_config(variant, &json)
            .unwrap_err()
            .to_string()
    };
    let err = refused(LLAMA, serde_json::json!({"hidden_act": "gelu"}));
    assert!(err.contains("hidden_act") && err.contains("silu"), "{err}");
    let err = refused(LLAMA, serde_json::json!({"mlp_bias": true}));
    assert!(err.contains("mlp_bias"), "{err}");
    let err = refused(
        LLAMA,
        serde_json::json!({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}),
    );
    assert!(err.contains("rope_type") && err.contains("yarn"), "{err}");
    let err = refused(LLAMA, serde_json::json!({"head_dim": 6}));
    assert!(err.contains("head_dim"), "{err}");
    // A window shorter than the model's positions: sequences fit the
    // window, and longer ones are refused naming it.
    let mut json = Llama::new(MISTRAL, &config(MISTRAL)).unwrap().hf_config();
    json["sliding_window"] = 4.into();
    json["max_position_embeddings"] = 64.into();
    let read = Llama::from_hf_config(MISTRAL, &json).unwrap();
    assert_eq!((read.seq, read.max_positions), (4, Some(64)));
    // Qwen2's window applies only where use_sliding_window says so
    // (transformers' default: false).
    let mut json = Llama::new(QWEN2, &config(QWEN2)).unwrap().hf_config();
    json["sliding_window"] = 4.into();
    json.as_object_mut().unwrap().remove("use_sliding_window");
    assert_eq!(
        Llama::from_hf_config(QWEN2, &json).unwrap().sliding_window,
        None
    );
    json["use_sliding_window"] = true.into();
    assert_eq!(
        Llama::from_hf_config(QWEN2, &json).unwrap().sliding_window,
        Some(4)
    );
    let err = Llama::new(MISTRAL, &ModelConfig { seq: 5, ..read })
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("model.sliding_window") && err.contains("model.seq <= 4"),
        "{err}"
    );
    let err = Llama::new(
        LLAMA,
        &ModelConfig {
            sliding_window: Some(8),
            ..config(LLAMA)
        },
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("no attention window"), "{err}");
    let err = Llama::new(
        LLAMA,
        &ModelConfig {
            kv_heads: Some(3),
            ..config(LLAMA)
        },
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("model.kv_heads") && err.contains("divide"),
        "{err}"
    );
    let err = Llama::new(
        LLAMA,
        &ModelConfig {
            max_positions: Some(4),
            ..config(LLAMA)
        },
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("model.seq") && err.contains("at most 4"),
        "{err}"
    );
    // The default architecture, without them, refuses the family's keys by name.
    let err = ModelConfig {
        kv_heads: Some(2),
        ..ModelConfig::default()
    }
    .build()
    .unwrap_err()
    .to_string();
    assert!(err.contains("model.kv_heads"), "{err}");
}

#[test]
fn scaled_frequencies_keep_the_high_scale_the_low_and_blend_between() {
    let scaling = RopeScaling {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_positions: 64,
    };
    let plain = inv_freq(8, 10_000.0, None);
    let scaled = inv_freq(8, 10_000.0, Some(&scaling));
    // Wavelengths 2 pi / f: 6.3 (< 16: kept), 63 (between 16 and 64:
    // blended), 628 and 6283 (> 64: divided by 8).
    assert_eq!(scaled[0], plain[0]);
    assert!(scaled[1] < plain[1] && scaled[1] > plain[1] / 8.0);
    assert!((scaled[2] - plain[2] / 8.0).abs() < 1e-9);
    assert!((scaled[3] - plain[3] / 8.0).abs() < 1e-9);
}

/// `--params` near a Llama 3 size picks its published shape (70B is
/// hidden 8192, 80 layers, 64 heads, 8 key/value heads); far from every
/// one, the dense table's.
#[test]
fn a_size_near_a_llama_3_model_takes_its_shape() {
    let arch = crate::model::architecture("llama").unwrap();
    let c = (arch.for_params)(70e9).unwrap();
    assert_eq!(
        (c.hidden, c.layers, c.heads, c.kv_heads, c.ffn, c.vocab),
        (8192, 80, 64, Some(8), Some(28672), 128_256)
    );
    let params = c.build().unwrap().params() as f64;
    assert!((params / 70.55e9 - 1.0).abs() < 0.01, "{params}");
    let c = (arch.for_params)(8e9).unwrap();
    assert_eq!((c.hidden, c.layers, c.ffn), (4096, 32, Some(14336)));
    let c = (arch.for_params)(1.2e9).unwrap();
    assert_eq!((c.hidden, c.tie_embeddings), (2048, Some(true)));
    // 1T is past 405B by more than 1.5x: the dense table's shape.
    let c = (arch.for_params)(1e12).unwrap();
    assert_ne!(c.hidden, 16384);
}

#[test]
fn keys_a_config_leaves_out_take_transformers_defaults() {
    // A config.json written by hand, trimmed or from another version may
    // leave any key out: transformers' class takes its default.
    let minimal = serde_json::json!({
        "hidden_size": 64,
        "num_attention_heads": 16,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "vocab_size": 100,
    });
    let read = |variant: Variant, patch: serde_json::Value| -> ModelConfig {
        let mut json = minimal.clone();
        for (k, v) in patch.as_object().unwrap() {
            json[k] = v.clone();
        }
        Llama::from_hf_config(variant, &json).unwrap()
    };
    let llama = read(LLAMA, serde_json::json!({}));
    assert_eq!(llama.kv_heads, Some(16));
    assert_eq!(llama.norm_eps, Some(1e-6));
    assert_eq!(llama.rope_theta, Some(10_000.0));
    assert_eq!(llama.tie_embeddings, Some(false));
    assert_eq!((llama.seq, llama.max_positions), (2048, None));
    // Mistral: 8 key/value heads and a window of 4096 unless the config
    // says otherwise; null is no window (and kv heads as many as heads).
    let mistral = read(MISTRAL, serde_json::json!({}));
    assert_eq!(mistral.kv_heads, Some(8));
    assert_eq!(mistral.sliding_window, Some(4096));
    assert_eq!((mistral.seq, mistral.max_positions), (4096, Some(131_072)));
    let mistral = read(
        MISTRAL,
        serde_json::json!({"sliding_window": null, "num_key_value_heads": null}),
    );
    assert_eq!((mistral.sliding_window, mistral.kv_heads), (None, Some(16)));
    // Qwen2: 32 key/value heads (16 query heads cannot share them: the
    // config is refused by name), no window.
    let mut json = minimal.clone();
    json["num_attention_heads"] = 32.into();
    json["hidden_size"] = 128.into();
    let qwen = Llama::from_hf_config(QWEN2, &json).unwrap();
    assert_eq!((qwen.kv_heads, qwen.sliding_window), (Some(32), None));
    assert_eq!(qwen.seq, 32_768);
    // Its window of 4096 applies where use_sliding_window says so.
    json["use_sliding_window"] = true.into();
    let qwen = Llama::from_hf_config(QWEN2, &json).unwrap();
    assert_eq!((qwen.sliding_window, qwen.seq), (Some(4096), 4096));
    let err = Llama::from_hf_config(QWEN2, &minimal)
        .unwrap_err()
        .to_string();
    assert!(err.contains("kv_heads"), "{err}");
}
