//! Generation against transformers: greedy decoding with strata's
//! key/value cache gives transformers' greedy `generate`, token for token,
//! for 32 new tokens after an 8-token prompt, on every committed tiny model
//! with the positions for it (one now: grouped-query heads, rope scaling;
//! `tests/fixtures/generate/make.py`:
//! transformers 5.24, torch 2.15, f32, eager attention; the prompt chosen
//! so that the top two logits stay at least 1e-3 apart at every step).

use std::path::Path;

use strata_train::generate::{Generator, Sampler, greedy};

fn ints(file: &safetensors::SafeTensors<'_>, name: &str) -> Vec<u32> {
    file.tensor(name)
        .unwrap()
        .data()
        .chunks_exact(4)
        .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as u32)
        .collect()
}

#[test]
fn greedy_generation_is_transformers_greedy_generate() {
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let mut compared = 0;
    for entry in std::fs::read_dir(fixtures.join("generate")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "safetensors") {
            continue;
        }
        let name = path.file_stem().unwrap().to_string_lossy().into_owned();
        let bytes = std::fs::read(&path).unwrap();
        let reference = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let (prompt, want) = (ints(&reference, "prompt"), ints(&reference, "generated"));
        let mut generator = Generator::open(&fixtures.join("hf").join(&name), None).unwrap();
        let mut next = 0;
        for &token in &prompt {
            next = greedy(generator.feed(token).unwrap());
        }
        let mut got = Vec::new();
        for _ in 0..want.len() {
            got.push(next);
            next = greedy(generator.feed(next).unwrap());
        }
        assert_eq!(
            got, want,
            "{name}: strata's greedy tokens, then transformers'"
        );
        assert_eq!(generator.position(), prompt.len() + want.len());
        // A sampler at temperature 0 is greedy.
        let mut again = Generator::open(&fixtures.join("hf").join(&name), None).unwrap();
        let mut sampler = Sampler::new(0.0, None, 3).unwrap();
        let mut logits = Vec::new();
        for &token in &prompt {
            logits = again.feed(token).unwrap().to_vec();
        }
        assert_eq!(sampler.next(&logits), want[0], "{name}");
        compared += 1;
    }
    assert!(compared > 0, "no generation fixture");
}

/// Feeding past the cache's positions is an error naming the capacity.
#[test]
fn a_generation_past_the_cache_is_refused_with_its_size() {
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let name = std::fs::read_dir(fixtures.join("generate"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .unwrap();
    let folder = fixtures
        .join("hf")
        .join(name.file_stem().unwrap().to_string_lossy().as_ref());
    let mut generator = Generator::open(&folder, None).unwrap();
    for _ in 0..generator.capacity() {
        generator.feed(1).unwrap();
    }
    let err = generator.feed(1).unwrap_err().to_string();
    assert!(err.contains("positions"), "{err}");
    let vocab = generator.model().vocab() as u32;
    let mut fresh = Generator::open(&folder, None).unwrap();
    let err = fresh.feed(vocab).unwrap_err().to_string();
    assert!(err.contains("vocabulary"), "{err}");
}

/// For every architecture, decoding a sequence a token at a time through
/// the key/value cache gives, at each position, the logits of the whole
/// sequence's forward (within 1e-5 of the largest).
#[test]
fn decoding_with_the_cache_is_the_forward_of_the_whole_sequence() {
    use strata_device::{View, ViewMut};
    use strata_kernels::CpuBackend;
    use strata_train::ModelConfig;
    use strata_train::model::{self, Arch};
    for architecture in model::ARCHITECTURES {
        let plain = ModelConfig {
            arch: Arch::named(architecture.name).unwrap(),
            vocab: 40,
            seq: 9,
            hidden: 16,
            heads: 4,
            layers: 2,
            ..ModelConfig::default()
        };
        // Grouped-query heads where the architecture has them.
        let grouped = ModelConfig {
            kv_heads: Some(2),
            ..plain.clone()
        };
        let config = if model::build(&grouped).is_ok() {
            grouped
        } else {
            plain
        };
        let model = model::build(&config).unwrap();
        let groups = model::initial_values(&*model, 5);
        let tokens: Vec<u32> = (0..9).map(|i| (i * 7 + 3) % 40).collect();
        let mut whole = vec![0f32; 9 * 40];
        let blocks: Vec<View<'_>> = groups[1..].iter().map(|g| View::host_slice(g)).collect();
        model::forward_logits(
            &*model,
            &CpuBackend,
            View::host_slice(&groups[0]),
            &blocks,
            View::host_slice(&tokens),
            ViewMut::host_slice(&mut whole),
        )
        .unwrap();
        let mut generator =
            Generator::new(model::build(&config).unwrap(), groups.clone(), 9).unwrap();
        let scale = whole.iter().fold(0f32, |m, v| m.max(v.abs()));
        for (i, &token) in tokens.iter().enumerate() {
            let logits = generator.feed(token).unwrap();
            for (got, want) in logits.iter().zip(&whole[i * 40..(i + 1) * 40]) {
                assert!(
                    (got - want).abs() <= 1e-5 * scale,
                    "{} position {i}: {got} vs {want}",
                    architecture.name
                );
            }
        }
    }
}
