//! A checkpoint's step directory opens in Hugging Face transformers as it
//! is (`config.json` beside `model.safetensors`), and transformers'
//! `GPT2LMHeadModel` computes strata's logits from it: any difference
//! between strata's model and GPT-2's shows here. Without Python's
//! transformers and torch only the files are checked, and the comparison
//! says it was skipped.

use std::path::{Path, PathBuf};
use std::process::Command;

use super::Gpt2;
use crate::model::forward_logits;
use crate::{ByteCorpus, Checkpoint, RunOptions, TrainConfig, run};
use serde_json::Value;
use strata_device::{View, ViewMut};
use strata_kernels::CpuBackend;
use strata_storage::ByteSize;

/// Largest difference allowed between transformers' fp32 logits and
/// strata's (logits up to ~6 here): the two sum in different orders,
/// nothing more. Measured: 2e-6, a few ulps. Exact (erf) GELU in place of
/// the tanh form moves them by ~6e-5, so a looser bound (1e-4) would let
/// that mismatch through.
const LOGITS_DIFF_MAX: f32 = 1e-5;

/// The tokens both models read (byte-level).
const TOKENS: &[u8; 16] = b"the lazy dog. a ";

fn corpus(seq: usize) -> ByteCorpus {
    let text =
        "the quick brown fox jumps over the lazy dog. a stitch in time saves nine. ".repeat(200);
    ByteCorpus::new(text.into_bytes(), seq).unwrap()
}

/// A tiny model trained a few steps at a high learning rate, so that its
/// weights are not GPT-2's small initial ones, whose activations would
/// hide more of a difference between the models.
fn tiny(dir: &Path) -> TrainConfig {
    let mut config = TrainConfig::default();
    config.model.seq = TOKENS.len();
    config.model.hidden = 32;
    config.model.heads = 2;
    config.model.layers = 2;
    config.train.steps = 4;
    config.train.micro_batch = 4;
    config.train.lr = 0.05;
    config.train.lr_min = 0.05;
    config.train.warmup_steps = 0;
    config.train.clip_norm = 0.0;
    config.train.checkpoint_dir = Some(dir.join("ckpt"));
    // The master weights exactly, to compare logits at f32's precision.
    config.checkpoint.weights_dtype = crate::hf::WeightsDtype::F32;
    config.device.budget = ByteSize(2 << 20);
    config.host.budget = ByteSize(4 << 20);
    config.nvme.as_mut().unwrap().dirs = vec![dir.join("swap")];
    config.nvme.as_mut().unwrap().capacity = ByteSize(64 << 20);
    config
}

/// Trains `config` and returns its last checkpoint's step directory.
fn trained(config: &TrainConfig) -> PathBuf {
    let summary = run(
        config,
        &corpus(TOKENS.len()),
        &RunOptions::default(),
        &mut |_| {},
    )
    .unwrap();
    summary.checkpoints.last().unwrap().clone()
}

fn read_json(path: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

/// A tensor's name and shape.
type Named = (String, Vec<usize>);

/// GPT-2's tensors of the embeddings and of each block, in strata's layout
/// order (`EmbedLayout`, `BlockLayout`), with their shapes: written out
/// here again, not taken from the model's groups, so that a mistake there
/// shows.
fn gpt2_names(gpt: &Gpt2) -> (Vec<Named>, Vec<Vec<Named>>) {
    let (h, v, s) = (gpt.hidden, gpt.vocab, gpt.seq);
    let embed = [
        ("wte.weight", vec![v, h]),
        ("wpe.weight", vec![s, h]),
        ("ln_f.weight", vec![h]),
        ("ln_f.bias", vec![h]),
    ]
    .map(|(name, shape)| (name.to_string(), shape))
    .to_vec();
    let blocks = (0..gpt.layers)
        .map(|b| {
            [
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
            ]
            .map(|(name, shape)| (format!("h.{b}.{name}"), shape))
            .to_vec()
        })
        .collect();
    (embed, blocks)
}

/// The named tensors of `file` concatenated, each checked for its shape.
fn concatenated(file: &safetensors::SafeTensors<'_>, names: &[Named]) -> Vec<f32> {
    let mut out = Vec::new();
    for (name, shape) in names {
        let tensor = file.tensor(name).unwrap();
        assert_eq!(tensor.dtype(), safetensors::Dtype::F32, "{name}");
        assert_eq!(tensor.shape(), shape.as_slice(), "{name}");
        out.extend(
            tensor
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        );
    }
    out
}

/// strata's logits (`TOKENS.len() x vocab`) from the step directory's
/// `model.safetensors`, which must hold GPT-2's tensors and no others.
fn strata_logits(step: &Path, gpt: &Gpt2) -> Vec<f32> {
    let bytes = std::fs::read(step.join("model.safetensors")).unwrap();
    let (_, metadata) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let format = metadata.metadata().as_ref().and_then(|m| m.get("format"));
    assert_eq!(
        format.map(String::as_str),
        Some("pt"),
        "transformers' header"
    );
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let (embed_names, block_names) = gpt2_names(gpt);
    let mut expected: Vec<&str> = embed_names
        .iter()
        .chain(block_names.iter().flatten())
        .map(|(name, _)| name.as_str())
        .collect();
    let mut found = file.names();
    expected.sort_unstable();
    found.sort_unstable();
    assert_eq!(found, expected, "no lm_head.weight: it is tied to wte");
    let embed = concatenated(&file, &embed_names);
    let blocks: Vec<Vec<f32>> = block_names
        .iter()
        .map(|names| concatenated(&file, names))
        .collect();
    let block_views: Vec<View<'_>> = blocks.iter().map(|b| View::host_slice(b)).collect();
    let tokens: Vec<u32> = TOKENS.iter().map(|&b| u32::from(b)).collect();
    let mut logits = vec![0.0f32; tokens.len() * gpt.vocab];
    forward_logits(
        gpt,
        &CpuBackend,
        View::host_slice(&embed),
        &block_views,
        View::host_slice(&tokens),
        ViewMut::host_slice(&mut logits),
    )
    .unwrap();
    logits
}

/// Loads the step directory with `GPT2LMHeadModel.from_pretrained`, fails
/// on anything missing, unexpected or mismatched, and prints the logits
/// of the tokens in argv[2], and those of the same weights with exact
/// (erf) GELU, to show that the comparison can tell the two apart.
const TRANSFORMERS: &str = r#"
import json, sys
import torch
from transformers import GPT2LMHeadModel

path, tokens = sys.argv[1], json.loads(sys.argv[2])
model, info = GPT2LMHeadModel.from_pretrained(path, output_loading_info=True)
bad = {key: [str(x) for x in value] for key, value in info.items() if value}
assert not bad, f"loading info is not empty: {bad}"
assert model.dtype == torch.float32, model.dtype
assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr(), "lm_head not tied"
erf = GPT2LMHeadModel.from_pretrained(path, activation_function="gelu")

def logits(m):
    with torch.no_grad():
        return m.eval()(torch.tensor([tokens])).logits[0].flatten().tolist()

print(json.dumps({"logits": logits(model), "erf_logits": logits(erf)}))
"#;

/// Why transformers cannot be used here, if it cannot.
fn transformers_missing() -> Option<String> {
    match Command::new("python3")
        .args(["-c", "import transformers, torch"])
        .output()
    {
        Err(err) => Some(format!("no python3: {err}")),
        Ok(out) if !out.status.success() => {
            let stderr = String::from_utf8_lossy(&out.stderr);
            Some(format!(
                "transformers or torch is not importable: {}",
                stderr.trim().lines().last().unwrap_or("")
            ))
        }
        Ok(_) => None,
    }
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn a_step_directory_opens_in_transformers_with_strata_logits() {
    let dir = tempfile::tempdir().unwrap();
    let config = tiny(dir.path());
    let gpt = Gpt2::new(&config.model).unwrap();
    let step = trained(&config);

    let hf = read_json(&step.join("config.json"));
    let expected = serde_json::json!({
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        "vocab_size": 256,
        "n_positions": 16,
        "n_ctx": 16,
        "n_embd": 32,
        "n_layer": 2,
        "n_head": 2,
        "n_inner": 128,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5,
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
    });
    assert_eq!(hf, expected);
    let checkpoint = Checkpoint::open(&step).unwrap();
    assert!(checkpoint.meta.files.contains_key("config.json"));
    checkpoint.read_file("config.json").unwrap();

    let ours = strata_logits(&step, &gpt);
    if let Some(reason) = transformers_missing() {
        println!("skipped: {reason}");
        return;
    }
    let tokens: Vec<u32> = TOKENS.iter().map(|&b| u32::from(b)).collect();
    let out = Command::new("python3")
        .args(["-c", TRANSFORMERS])
        .arg(&step)
        .arg(serde_json::to_string(&tokens).unwrap())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "transformers failed:\n{stderr}");
    eprintln!("transformers' stderr:\n{stderr}");
    let printed: Value = serde_json::from_slice(&out.stdout).unwrap();
    let floats = |key: &str| -> Vec<f32> {
        serde_json::from_value::<Vec<f64>>(printed[key].clone())
            .unwrap()
            .into_iter()
            .map(|x| x as f32)
            .collect()
    };
    let (theirs, erf) = (floats("logits"), floats("erf_logits"));
    let diff = max_abs_diff(&ours, &theirs);
    let erf_diff = max_abs_diff(&ours, &erf);
    let scale = ours.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    println!(
        "max |logit| {scale:.3}, max diff vs transformers {diff:e} (gelu_new), {erf_diff:e} (exact gelu)"
    );
    assert!(
        diff <= LOGITS_DIFF_MAX,
        "transformers' logits differ from strata's by {diff:e} (at most {LOGITS_DIFF_MAX:e})"
    );
    assert!(
        erf_diff > 2.0 * LOGITS_DIFF_MAX,
        "exact GELU's logits differ by only {erf_diff:e}: the comparison cannot tell GELU's forms apart"
    );
}

/// config.json is checked on resume like the other files, and a checkpoint
/// from before it existed still resumes.
#[test]
fn config_json_is_checksummed_on_resume_and_checkpoints_without_it_resume() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = tiny(dir.path());
    config.train.steps = 2;
    let step = trained(&config);
    let mut more = config.clone();
    more.train.steps = 3;
    more.train.checkpoint_dir = None;
    let resume = |from: &Path| {
        let options = RunOptions {
            resume: Some(from.to_path_buf()),
            ..RunOptions::default()
        };
        run(&more, &corpus(TOKENS.len()), &options, &mut |_| {})
    };

    let original = std::fs::read(step.join("config.json")).unwrap();
    let mut edited = original.clone();
    let at = edited.iter().position(|&b| b == b'2').unwrap();
    edited[at] = b'3';
    std::fs::write(step.join("config.json"), &edited).unwrap();
    let err = resume(&step).unwrap_err().to_string();
    assert!(
        err.contains("config.json") && err.contains("corrupt"),
        "{err}"
    );

    // As written before config.json: neither the file nor its checksum.
    std::fs::remove_file(step.join("config.json")).unwrap();
    let mut meta = read_json(&step.join("meta.json"));
    meta["files"].as_object_mut().unwrap().remove("config.json");
    std::fs::write(step.join("meta.json"), meta.to_string()).unwrap();
    // As written before meta.json's own checksum was recorded.
    std::fs::remove_file(step.join("meta.json.xxh3")).unwrap();
    let summary = resume(&step).unwrap();
    assert_eq!(
        summary.steps, 1,
        "step 3 alone, after the checkpoint of step 2"
    );
}
