//! The model interface's seam: outside an architecture's own file
//! (`train/src/model/<arch>.rs`, and its folder of tests) and its line in
//! the registry, no Rust source of the workspace names an architecture or
//! one of its tensors. The names searched for come from the registry
//! itself: each architecture's name (and its stem without digits) and the
//! distinctive parts of its tensors' Hugging Face names (generic ones such
//! as `weight`, `bias` or `mlp` are left out), so a new architecture is
//! guarded as it is added.

use std::path::{Path, PathBuf};

use strata_train::ModelConfig;
use strata_train::model::{ARCHITECTURES, Arch};

/// Parts of tensor names too common to belong to one architecture.
const GENERIC: &[&str] = &[
    "weight", "bias", "attn", "mlp", "model", "layers", "layer", "norm", "embed", "self", "h",
    "lm_head",
];

/// Names of tools and formats that contain an architecture's stem but are
/// not about the architecture (a token file's format is nanoGPT's).
const NOT_ARCHITECTURES: &[&str] = &["nanogpt"];

/// The workspace's root.
fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// Every `.rs` file below `dir`, outside build output and hidden folders.
fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        let path = entry.path();
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with('.') || name == "target" {
            continue;
        }
        if path.is_dir() {
            sources(&path, out);
        } else if name.ends_with(".rs") {
            out.push(path);
        }
    }
}

/// The words that name `arch` or one of its tensors, lowercase.
fn words(arch: &'static str) -> Vec<String> {
    let config = ModelConfig {
        arch: Arch::named(arch).unwrap(),
        ..ModelConfig::default()
    };
    let model = config.build().unwrap();
    let mut words = vec![arch.to_lowercase()];
    let stem = arch.trim_end_matches(|c: char| c.is_ascii_digit() || c == '.');
    if stem.len() >= 3 {
        words.push(stem.to_lowercase());
    }
    for group in model.groups() {
        for tensor in &group.tensors {
            for part in tensor.name.split('.') {
                let part = part.to_lowercase();
                let numeric = part.chars().all(|c| c.is_ascii_digit());
                if !numeric && part.len() >= 3 && !GENERIC.contains(&part.as_str()) {
                    words.push(part);
                }
            }
        }
    }
    words.sort();
    words.dedup();
    words
}

/// Whether `word` stands in `line` as a word or the start of one (`abc`
/// in `abc-2` or in `abc.weight`), not inside another word.
fn names(line: &str, word: &str) -> bool {
    let bytes = line.as_bytes();
    line.match_indices(word).any(|(at, _)| {
        let before = at.checked_sub(1).map(|i| bytes[i]);
        !before.is_some_and(|b| b.is_ascii_alphanumeric() || b == b'_')
    })
}

#[test]
fn no_source_outside_an_architectures_file_names_it_or_its_tensors() {
    let root = root();
    let mut files = Vec::new();
    sources(&root, &mut files);
    assert!(
        files.len() > 50,
        "found {} sources under {root:?}",
        files.len()
    );
    let registry = root.join("train/src/model/mod.rs");
    let mut found = Vec::new();
    for (arch, source) in ARCHITECTURES.iter().map(|a| (a.name, a.source)) {
        let own_file = root.join(format!("train/src/model/{source}.rs"));
        let own_dir = root.join(format!("train/src/model/{source}"));
        let words = words(arch);
        for file in &files {
            if *file == own_file || file.starts_with(&own_dir) {
                continue;
            }
            let text = std::fs::read_to_string(file).unwrap();
            for (number, line) in text.lines().enumerate() {
                let mut line = line.to_lowercase();
                for tool in NOT_ARCHITECTURES {
                    line = line.replace(tool, "");
                }
                // The registry's lines name every architecture: its module
                // and its entry.
                let registry_line = line.contains("::architecture") || line.starts_with("pub mod ");
                if *file == registry && registry_line {
                    continue;
                }
                for word in &words {
                    if names(&line, word) {
                        let relative = file.strip_prefix(&root).unwrap();
                        found.push(format!(
                            "{}:{}: names {word:?} ({arch}): {}",
                            relative.display(),
                            number + 1,
                            line.trim()
                        ));
                    }
                }
            }
        }
    }
    assert!(
        found.is_empty(),
        "outside train/src/model/<arch>.rs, these name an architecture or its tensors:\n{}",
        found.join("\n")
    );
}

#[test]
fn the_search_finds_what_it_looks_for() {
    // The words of the first architecture, found where they stand.
    let arch = ARCHITECTURES[0].name;
    let words = words(arch);
    assert!(words.len() > 2, "{words:?}");
    for word in &words {
        assert!(names(&format!("x = {word}.weight"), word), "{word}");
        assert!(!names(&format!("x{word}"), word), "{word}");
    }
}
