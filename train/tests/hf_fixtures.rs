//! strata's architectures against transformers on the committed fixtures
//! (`tests/fixtures/hf/make.py`: a tiny random model of each registered
//! architecture, one folder each by its name, with grouped-query heads,
//! untied and tied heads, rope scaling, biases and bf16 weights among
//! them), each saved sharded: strata opens each folder, and its f32 logits and loss match
//! transformers' within 1e-5 (relative to the largest) and every
//! parameter's gradient within 1e-4. Where `STRATA_FIXTURE_PYTHON` names a
//! Python with the pinned torch and transformers, the fixtures are made
//! afresh into a temporary folder first and compared live.

use std::path::{Path, PathBuf};

use strata_device::{View, ViewMut};
use strata_kernels::CpuBackend;
use strata_train::hf::HfFolder;
use strata_train::model;

mod common;
use common::step;

/// The fixtures' sequence length (make.py's SEQ).
const SEQ: usize = 8;

fn committed() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf")
}

/// The folders to compare: made afresh where a Python is named, else the
/// committed ones.
fn fixtures() -> (PathBuf, Option<tempfile::TempDir>) {
    let Ok(python) = std::env::var("STRATA_FIXTURE_PYTHON") else {
        return (committed(), None);
    };
    let dir = tempfile::tempdir().unwrap();
    let status = std::process::Command::new(python)
        .arg(committed().join("make.py"))
        .arg(dir.path())
        .status()
        .unwrap();
    assert!(status.success(), "make.py failed");
    (dir.path().to_path_buf(), Some(dir))
}

/// The named f32 (or i32, as u32) tensor of a safetensors file.
fn tensor<T: Copy>(file: &safetensors::SafeTensors<'_>, name: &str, f: fn([u8; 4]) -> T) -> Vec<T> {
    let view = file
        .tensor(name)
        .unwrap_or_else(|e| panic!("{name}: {e:?}"));
    view.data()
        .chunks_exact(4)
        .map(|b| f([b[0], b[1], b[2], b[3]]))
        .collect()
}

/// `max |got - want| <= tolerance * max |want|`.
fn close(what: &str, got: &[f32], want: &[f32], tolerance: f64) {
    assert_eq!(got.len(), want.len(), "{what}");
    let scale = want
        .iter()
        .fold(0f64, |m, v| m.max(f64::from(v.abs())))
        .max(1e-30);
    let worst = got
        .iter()
        .zip(want)
        .map(|(a, b)| f64::from((a - b).abs()))
        .fold(0f64, f64::max);
    assert!(
        worst <= tolerance * scale,
        "{what}: off by {worst:e}, more than {tolerance:e} x {scale:e}"
    );
}

#[test]
fn every_fixture_loads_and_matches_transformers_logits_loss_and_gradients() {
    let (root, _made) = fixtures();
    for name in model::ARCHITECTURES.iter().map(|a| a.name) {
        let dir = root.join(name);
        let folder = HfFolder::open(&dir).unwrap();
        let mut config = folder.model_config().unwrap();
        assert_eq!(config.arch.name(), name);
        config.seq = SEQ;
        let model = model::build(&config).unwrap();
        folder.check(model.as_ref()).unwrap();
        let specs = model.groups();
        let groups: Vec<Vec<f32>> = specs
            .iter()
            .map(|g| {
                let mut values = vec![0f32; g.params()];
                folder.read_group(g, &mut values).unwrap();
                values
            })
            .collect();
        let bytes = std::fs::read(dir.join("reference.safetensors")).unwrap();
        let reference = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let as_u32 = |b: [u8; 4]| i32::from_le_bytes(b) as u32;
        let tokens = tensor(&reference, "input_ids", as_u32);
        let targets = tensor(&reference, "targets", as_u32);
        // Logits.
        let mut logits = vec![0f32; tokens.len() * model.vocab()];
        let blocks: Vec<View<'_>> = groups[1..].iter().map(|g| View::host_slice(g)).collect();
        model::forward_logits(
            model.as_ref(),
            &CpuBackend,
            View::host_slice(&groups[0]),
            &blocks,
            View::host_slice(&tokens),
            ViewMut::host_slice(&mut logits),
        )
        .unwrap();
        close(
            &format!("{name} logits"),
            &logits,
            &tensor(&reference, "logits", f32::from_le_bytes),
            1e-5,
        );
        // Loss and gradients.
        let (loss, grads) = step(model.as_ref(), &groups, &tokens, &targets);
        let want = tensor(&reference, "loss", f32::from_le_bytes)[0];
        assert!(
            (loss - f64::from(want)).abs() <= 1e-5 * f64::from(want.abs()),
            "{name} loss {loss} vs transformers' {want}"
        );
        let mut compared = 0;
        for (spec, grad) in specs.iter().zip(&grads) {
            for t in &spec.tensors {
                // transformers' parameter name: the tensor's, or under the
                // base model's prefix.
                let key = reference
                    .names()
                    .into_iter()
                    .find(|k| {
                        k.strip_prefix("grad.").is_some_and(|k| {
                            k == t.name || k.split_once('.').is_some_and(|(_, rest)| rest == t.name)
                        })
                    })
                    .unwrap_or_else(|| panic!("{name}: no reference gradient for {}", t.name))
                    .to_string();
                close(
                    &format!("{name} {key}"),
                    &grad[t.range.clone()],
                    &tensor(&reference, &key, f32::from_le_bytes),
                    1e-4,
                );
                compared += 1;
            }
        }
        let in_reference = reference
            .names()
            .iter()
            .filter(|n| n.starts_with("grad."))
            .count();
        assert_eq!(
            compared, in_reference,
            "{name}: every parameter's gradient compared"
        );
    }
}
