//! What the model-level integration tests share: one forward and backward
//! of a model on the CPU backend.

#![allow(dead_code)]

use strata_device::{Dtype, View, ViewMut};
use strata_kernels::{Backend, CpuBackend};
use strata_train::model::{Model, Weights};

/// One forward and backward of `model` over `tokens` (at `position_ids`:
/// empty, or each token's place in its document) against `targets`, on the
/// CPU backend in f32: the loss (the mean over every row) and each group's
/// gradient.
pub fn step_at(
    model: &dyn Model,
    groups: &[Vec<f32>],
    tokens: &[u32],
    position_ids: &[u32],
    targets: &[u32],
) -> (f64, Vec<Vec<f32>>) {
    let ids = View::host_slice(position_ids);
    let backend = CpuBackend;
    let batch = tokens.len() / model.seq();
    let n = tokens.len() * model.stream_width();
    let mut buffers = model.buffers(&backend, batch, Dtype::F32).unwrap();
    let mut kept = Vec::new();
    let mut x = vec![0f32; n];
    model
        .embed_forward(
            &backend,
            View::host_slice(&groups[0]),
            View::host_slice(tokens),
            ids,
            ViewMut::host_slice(&mut x),
        )
        .unwrap();
    for params in &groups[1..] {
        let mut y = vec![0f32; n];
        model
            .block_forward(
                &backend,
                batch,
                ids,
                Weights::from(View::host_slice(params)),
                View::host_slice(&x),
                &mut buffers,
                ViewMut::host_slice(&mut y),
            )
            .unwrap();
        let mut saved = backend.alloc(Dtype::F32, buffers.kept().len()).unwrap();
        backend.copy(buffers.kept(), saved.view_mut()).unwrap();
        kept.push(saved);
        x = y;
    }
    let mut grads: Vec<Vec<f32>> = groups.iter().map(|g| vec![0f32; g.len()]).collect();
    let mut dx = vec![0f32; n];
    let loss = model
        .head_forward_backward(
            &backend,
            Weights::from(View::host_slice(&groups[0])),
            View::host_slice(&x),
            View::host_slice(targets),
            1.0,
            &mut buffers,
            ViewMut::host_slice(&mut dx),
            ViewMut::host_slice(&mut grads[0]),
        )
        .unwrap()
        .get()
        .unwrap();
    for b in (0..model.layers()).rev() {
        backend.copy(kept[b].view(), buffers.kept_mut()).unwrap();
        let mut dprev = vec![0f32; n];
        model
            .block_backward(
                &backend,
                batch,
                ids,
                Weights::from(View::host_slice(&groups[b + 1])),
                View::host_slice(&dx),
                &mut buffers,
                ViewMut::host_slice(&mut dprev),
                ViewMut::host_slice(&mut grads[b + 1]),
            )
            .unwrap();
        dx = dprev;
    }
    model
        .embed_backward(
            &backend,
            View::host_slice(tokens),
            ids,
            View::host_slice(&dx),
            ViewMut::host_slice(&mut grads[0]),
        )
        .unwrap();
    (loss, grads)
}

/// [`step_at`] with each token at its place in its sequence.
pub fn step(
    model: &dyn Model,
    groups: &[Vec<f32>],
    tokens: &[u32],
    targets: &[u32],
) -> (f64, Vec<Vec<f32>>) {
    step_at(model, groups, tokens, &[], targets)
}

/// The committed fixture folder whose weights are bf16 (`fixtures/hf/make.py`'s).
pub fn bf16_folder() -> std::path::PathBuf {
    let mut found = std::fs::read_dir(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf"),
    )
    .unwrap()
    .map(|e| e.unwrap().path())
    .filter(|dir| {
        let config = std::fs::read_to_string(dir.join("config.json")).unwrap_or_default();
        let config: serde_json::Value = serde_json::from_str(&config).unwrap_or_default();
        config["dtype"] == "bfloat16"
    });
    let folder = found.next().expect("a fixture with bf16 weights");
    assert!(found.next().is_none(), "one fixture with bf16 weights");
    folder
}
