//! Documents packed into one sequence with position ids restarting at each
//! (block-diagonal causal attention): for every architecture, the packed
//! sequence's loss is the sum of the documents' losses each computed alone,
//! within 1e-6, and so is every parameter's gradient (1e-5 of the largest).

use strata_kernels::IGNORE_TARGET;
use strata_train::ModelConfig;
use strata_train::model::{self, Arch};

mod common;
use common::{step, step_at};

const SEQ: usize = 12;

/// A sequence of `SEQ` rows holding `document` from row 0 (the rest
/// padding of token 0, no target), alone.
fn alone(document: &[u32]) -> (Vec<u32>, Vec<u32>) {
    let mut tokens = document.to_vec();
    tokens.resize(SEQ, 0);
    let mut targets: Vec<u32> = document[1..].to_vec();
    targets.resize(SEQ, IGNORE_TARGET);
    (tokens, targets)
}

#[test]
fn a_packed_sequence_is_its_documents_each_alone() {
    let documents: [&[u32]; 2] = [&[3, 17, 5, 9, 30], &[8, 8, 21, 2, 40, 11]];
    // Packed: the documents, then a row of padding (a third document).
    let mut tokens: Vec<u32> = documents.concat();
    tokens.push(0);
    let ids: Vec<u32> = documents
        .iter()
        .flat_map(|d| 0..d.len() as u32)
        .chain([0])
        .collect();
    // Each document's last row predicts nothing: the next is another's.
    let mut targets = Vec::new();
    for d in documents {
        targets.extend_from_slice(&d[1..]);
        targets.push(IGNORE_TARGET);
    }
    targets.push(IGNORE_TARGET);
    assert_eq!((tokens.len(), ids.len(), targets.len()), (SEQ, SEQ, SEQ));
    for architecture in model::ARCHITECTURES {
        let config = ModelConfig {
            arch: Arch::named(architecture.name).unwrap(),
            vocab: 48,
            seq: SEQ,
            hidden: 16,
            heads: 2,
            layers: 2,
            ..ModelConfig::default()
        };
        let model = model::build(&config).unwrap();
        let groups = model::initial_values(&*model, 11);
        let (packed, packed_grads) = step_at(&*model, &groups, &tokens, &ids, &targets);
        // The losses are means over every row: sums, times the rows.
        let mut sum = 0.0;
        let mut grads: Vec<Vec<f32>> = groups.iter().map(|g| vec![0f32; g.len()]).collect();
        for d in documents {
            let (tokens, targets) = alone(d);
            let (loss, g) = step(&*model, &groups, &tokens, &targets);
            sum += loss;
            for (total, part) in grads.iter_mut().zip(&g) {
                for (t, p) in total.iter_mut().zip(part) {
                    *t += p;
                }
            }
        }
        let relative = (packed - sum).abs() / sum.abs();
        eprintln!(
            "{}: packed loss {packed}, the documents alone {sum} (relative {relative:e})",
            architecture.name
        );
        assert!(
            relative <= 1e-6,
            "{}: packed {packed}, alone {sum} (relative {relative:e})",
            architecture.name
        );
        let scale = grads.iter().flatten().fold(0f32, |m, v| m.max(v.abs()));
        let worst = packed_grads
            .iter()
            .flatten()
            .zip(grads.iter().flatten())
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(
            worst <= 1e-5 * scale,
            "{}: a gradient off by {worst:e} of {scale:e}",
            architecture.name
        );
        // Without the ids, the second document attends to the first and
        // sits at other positions: not the same loss.
        let (causal, _) = step(&*model, &groups, &tokens, &targets);
        assert!(
            (causal - sum).abs() > 1e-4 * sum.abs(),
            "{}",
            architecture.name
        );
    }
}
