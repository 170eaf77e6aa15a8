//! Supervised conversations through the tokenizer's chat template against
//! transformers (`tests/fixtures/chat/make.py`: transformers 5.24): each
//! `messages` line of a `format = "sft"` file is tokenized to the ids of
//! transformers' `apply_chat_template(messages, tokenize=True)`, then the
//! end of text, and its loss targets are the tokens transformers'
//! `return_assistant_tokens_mask` marks (the assistant turns and their
//! ends of turn), the rest marked NOT_A_TARGET.

use std::path::Path;

use strata_train::{DataConfig, DataFormat, DataPaths, NOT_A_TARGET, tokenize};

#[test]
fn chat_messages_tokenize_as_transformers_apply_chat_template() {
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/chat");
    let expected: Vec<serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(fixtures.join("expected.json")).unwrap())
            .unwrap();
    let cache = tempfile::tempdir().unwrap();
    let data = DataConfig {
        path: DataPaths(vec![fixtures.join("chats.jsonl")]),
        format: DataFormat::Sft,
        tokenizer: Some(fixtures.join("tokenizer")),
        cache_dir: Some(cache.path().to_path_buf()),
        ..DataConfig::default()
    };
    let tokenized = tokenize(&data, 1 << 16, &|_| {}).unwrap();
    assert!(tokenized.masked);
    let eos = tokenized.eos.expect("the fixture names an end of text");
    let stream: Vec<u32> = std::fs::read(&tokenized.path)
        .unwrap()
        .chunks_exact(4)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    let mut at = 0;
    for (n, want) in expected.iter().enumerate() {
        let ids: Vec<u32> = want["input_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        let mask: Vec<bool> = want["assistant_masks"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() == 1)
            .collect();
        let got = &stream[at..at + ids.len()];
        let got_ids: Vec<u32> = got.iter().map(|t| t & !NOT_A_TARGET).collect();
        assert_eq!(got_ids, ids, "conversation {n}: ids");
        let got_mask: Vec<bool> = got.iter().map(|t| t & NOT_A_TARGET == 0).collect();
        assert_eq!(got_mask, mask, "conversation {n}: loss targets");
        assert!(mask.iter().any(|&m| m), "conversation {n} has targets");
        // Then the end of text, a target (the conversation ends there).
        assert_eq!(stream[at + ids.len()], eos, "conversation {n}: end of text");
        at += ids.len() + 1;
    }
    assert_eq!(at, stream.len());
    // A conversation without the template's tokenizer is refused by line.
    let plain = tempfile::tempdir().unwrap();
    std::fs::copy(
        fixtures.join("tokenizer/tokenizer.json"),
        plain.path().join("tokenizer.json"),
    )
    .unwrap();
    let err = tokenize(
        &DataConfig {
            tokenizer: Some(plain.path().to_path_buf()),
            ..data.clone()
        },
        1 << 16,
        &|_| {},
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("line 1 holds chat messages") && err.contains("chat_template"),
        "{err}"
    );
}
