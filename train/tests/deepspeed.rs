//! `--deepspeed`: DeepSpeed configs mapped onto strata's, the learning rate
//! at every step against DeepSpeed's own scheduler classes, and the
//! generated mapping table.

use std::path::{Path, PathBuf};
use std::process::Command;

use strata_train::engine::deepspeed::{KEYS, Treatment, rule, table_markdown};
use strata_train::{Placement, Schedule, TrainConfig, TrainError, WarmupType, from_deepspeed_json};

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

fn map(json: &str) -> strata_train::DeepSpeedMapping {
    from_deepspeed_json(json, None).unwrap_or_else(|err| panic!("{json}: {err}"))
}

/// The key a refused config names.
fn refused_key(json: &str) -> String {
    match from_deepspeed_json(json, None) {
        Err(TrainError::DeepSpeed { key, .. }) => key,
        Err(other) => panic!("{json}: not a DeepSpeed error: {other}"),
        Ok(_) => panic!("{json}: accepted"),
    }
}

fn example(name: &str) -> String {
    let path = workspace().join("examples/configs/deepspeed").join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|err| panic!("{}: {err}", path.display()))
}

#[test]
fn every_example_config_maps_and_reads_back_from_its_toml() {
    let dir = workspace().join("examples/configs/deepspeed");
    let mut seen = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|ext| ext != "json") {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        let mapping = from_deepspeed_json(&text, None)
            .unwrap_or_else(|err| panic!("{}: {err}", path.display()));
        let toml = mapping.config.to_toml().unwrap();
        let back = TrainConfig::from_toml(&toml)
            .unwrap_or_else(|err| panic!("{}: {err}\n{toml}", path.display()));
        assert_eq!(back, mapping.config, "{}:\n{toml}", path.display());
        seen += 1;
    }
    assert!(seen >= 3, "the example configs are in {}", dir.display());
}

#[test]
fn zero_offload_stage_2_with_a_cpu_optimizer() {
    let mapping = map(&example("zero2-offload-cpu.json"));
    let c = &mapping.config;
    assert_eq!((c.train.micro_batch, c.train.grad_accumulation), (8, 2));
    assert_eq!(c.placement.params, Placement::Device);
    assert_eq!(c.placement.optimizer, Placement::Cpu);
    assert_eq!(
        (c.train.lr, c.train.beta1, c.train.beta2),
        (3e-4, 0.9, 0.95)
    );
    assert_eq!(c.train.loss_scale, 65536.0);
    assert!(c.train.loss_scale_dynamic);
    assert_eq!(c.train.loss_scale_growth_interval, 1000);
    assert_eq!(c.train.loss_scale_hysteresis, 2);
    assert_eq!(
        c.train.schedule,
        Schedule::WarmupDecayLr {
            warmup_min_lr: 0.0,
            warmup_num_steps: 20,
            warmup_type: WarmupType::Log,
            total_num_steps: Some(300),
        }
    );
    assert_eq!(
        mapping.ignored,
        [
            "steps_per_print",
            "wall_clock_breakdown",
            "zero_optimization.allgather_bucket_size",
            "zero_optimization.allgather_partitions",
            "zero_optimization.contiguous_gradients",
            "zero_optimization.overlap_comm",
            "zero_optimization.reduce_bucket_size",
            "zero_optimization.reduce_scatter",
        ]
    );
    assert!(mapping.notes.iter().any(|note| note.contains("bf16")));
}

#[test]
fn zero_infinity_on_nvme_with_aio() {
    let mapping = map(&example("zero3-infinity-nvme.json"));
    let c = &mapping.config;
    assert_eq!(c.placement.params, Placement::Nvme);
    assert_eq!(c.placement.optimizer, Placement::Nvme);
    let nvme = c.nvme.as_ref().unwrap();
    assert_eq!(nvme.dirs, [PathBuf::from("strata-train-swap")]);
    assert_eq!(
        (nvme.block_size.0, nvme.queue_depth, nvme.rings),
        (1 << 20, 16, 1)
    );
    assert_eq!(
        (c.train.loss_scale, c.train.loss_scale_dynamic),
        (1.0, false)
    );
    assert!(matches!(
        c.train.schedule,
        Schedule::WarmupCosineLr {
            warmup_type: WarmupType::Linear,
            total_num_steps: Some(300),
            ..
        }
    ));
    for key in [
        "zero_optimization.offload_param.buffer_count",
        "zero_optimization.offload_param.max_in_cpu",
        "zero_optimization.stage3_prefetch_bucket_size",
        "zero_optimization.stage3_max_reuse_distance",
    ] {
        assert!(
            mapping.ignored.iter().any(|k| k == key),
            "{key} in {:?}",
            mapping.ignored
        );
    }
    assert!(!mapping.ignored.iter().any(|k| k.starts_with("aio.")));
}

#[test]
fn hugging_face_auto_takes_the_base_config() {
    let mut base = TrainConfig::default();
    base.train.lr = 5e-4;
    base.train.beta2 = 0.98;
    base.train.micro_batch = 4;
    base.train.grad_accumulation = 3;
    base.train.clip_norm = 0.5;
    base.train.warmup_steps = 7;
    let mapping = from_deepspeed_json(&example("hf-trainer-auto.json"), Some(&base)).unwrap();
    let t = &mapping.config.train;
    assert_eq!(
        (t.lr, t.beta2, t.eps, t.weight_decay),
        (5e-4, 0.98, base.train.eps, base.train.weight_decay)
    );
    assert_eq!(
        (t.micro_batch, t.grad_accumulation, t.clip_norm),
        (4, 3, 0.5)
    );
    assert_eq!(
        t.schedule,
        Schedule::WarmupLr {
            warmup_min_lr: 0.0,
            warmup_num_steps: 7,
            warmup_type: WarmupType::Log
        }
    );
    // bf16 "auto" wins over fp16 "auto": no loss scaling, as DeepSpeed's bf16.
    assert_eq!((t.loss_scale, t.loss_scale_dynamic), (1.0, false));
    assert_eq!(mapping.config.placement.params, Placement::Cpu);
    assert_eq!(mapping.config.placement.optimizer, Placement::Cpu);
    // "auto" on keys strata ignores is not read, so not refused.
    assert!(
        mapping
            .ignored
            .iter()
            .any(|k| k == "zero_optimization.stage3_prefetch_bucket_size")
    );
}

#[test]
fn absent_sections_keep_the_base_and_present_ones_take_deepspeed_defaults() {
    let mut base = TrainConfig::default();
    base.train.lr = 5e-4;
    base.train.weight_decay = 0.2;
    let kept =
        from_deepspeed_json(r#"{"train_micro_batch_size_per_gpu": 2}"#, Some(&base)).unwrap();
    assert_eq!(kept.config.train.lr, 5e-4);
    assert_eq!(kept.config.placement, base.placement);
    assert_eq!(kept.config.train.schedule, Schedule::Cosine);
    assert_eq!(kept.config.train.micro_batch, 2);
    let whole = from_deepspeed_json(
        r#"{"optimizer": {"type": "adam", "params": {"lr": 1e-4}}}"#,
        Some(&base),
    )
    .unwrap();
    let t = &whole.config.train;
    assert_eq!(
        (t.lr, t.beta1, t.beta2, t.eps, t.weight_decay),
        (1e-4, 0.9, 0.999, 1e-8, 0.0)
    );
    // The base's cosine schedule stays, its floor in proportion to the peak.
    assert_eq!(t.schedule, Schedule::Cosine);
    assert!(
        (t.lr_min - base.train.lr_min / 5.0).abs() < 1e-18,
        "{}",
        t.lr_min
    );
}

#[test]
fn batch_sizes_are_derived_and_checked_as_deepspeed_does() {
    let mut base = TrainConfig::default();
    base.train.ranks = 2;
    let derived = |json: &str| {
        let t = from_deepspeed_json(json, Some(&base)).unwrap().config.train;
        (t.micro_batch, t.grad_accumulation)
    };
    assert_eq!(
        derived(r#"{"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}"#),
        (4, 4)
    );
    assert_eq!(
        derived(r#"{"train_batch_size": 32, "gradient_accumulation_steps": 2}"#),
        (8, 2)
    );
    assert_eq!(derived(r#"{"train_batch_size": 32}"#), (16, 1));
    assert_eq!(
        derived(r#"{"train_batch_size": "auto", "gradient_accumulation_steps": 3}"#),
        (8, 3)
    );
    let refused = from_deepspeed_json(
        r#"{"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4}"#,
        Some(&base),
    )
    .unwrap_err()
    .to_string();
    assert!(
        refused.contains("train_batch_size") && refused.contains("train.ranks = 2"),
        "{refused}"
    );
}

#[test]
fn values_strata_cannot_honor_are_refused_by_key() {
    let cases = [
        (
            r#"{"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}}"#,
            "zero_optimization.offload_optimizer.ratio",
        ),
        (r#"{"aio": {"use_gds": true}}"#, "aio.use_gds"),
        (
            r#"{"optimizer": {"type": "Lamb", "params": {}}}"#,
            "optimizer.type",
        ),
        (
            r#"{"optimizer": {"type": "Adam", "params": {"adam_w_mode": false, "weight_decay": 0.1}}}"#,
            "optimizer.params.adam_w_mode",
        ),
        (
            r#"{"optimizer": {"type": "Adam", "params": {"amsgrad": true}}}"#,
            "optimizer.params.amsgrad",
        ),
        (
            r#"{"scheduler": {"type": "OneCycle", "params": {}}}"#,
            "scheduler.type",
        ),
        (
            r#"{"scheduler": {"type": "WarmupLR", "params": {"total_num_steps": 10}}}"#,
            "scheduler.params.total_num_steps",
        ),
        (
            r#"{"scheduler": {"type": "WarmupDecayLR", "params": {}}}"#,
            "scheduler.params.total_num_steps",
        ),
        (
            r#"{"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "exp"}}}"#,
            "scheduler.params.warmup_type",
        ),
        (
            r#"{"fp16": {"enabled": true}, "bf16": {"enabled": true}}"#,
            "fp16.enabled",
        ),
        (r#"{"bf16": {"enabled": false}}"#, "bf16.enabled"),
        (
            r#"{"fp16": {"enabled": true, "consecutive_hysteresis": true}}"#,
            "fp16.consecutive_hysteresis",
        ),
        (
            r#"{"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}"#,
            "zero_optimization.offload_param.device",
        ),
        (
            r#"{"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}"#,
            "zero_optimization.offload_param.nvme_path",
        ),
        (
            r#"{"zero_optimization": {"stage": "auto"}}"#,
            "zero_optimization.stage",
        ),
        (
            r#"{"aio": {"intra_op_parallelism": 2, "thread_count": 4}}"#,
            "aio.thread_count",
        ),
        (r#"{"aio": {"block_size": 1000}}"#, "aio.block_size"),
        (r#"{"gradient_clipping": "high"}"#, "gradient_clipping"),
        (r#"[1, 2]"#, "(file)"),
        (r#"{"train_batch_size": 8,"#, "(file)"),
    ];
    for (json, key) in cases {
        assert_eq!(refused_key(json), key, "{json}");
    }
    // Where the two agree, L2 Adam without weight decay is AdamW.
    map(r#"{"optimizer": {"type": "Adam", "params": {"adam_w_mode": false, "weight_decay": 0}}}"#);
    // The old name of intra_op_parallelism sets the rings too.
    let rings = map(r#"{"aio": {"thread_count": 2}}"#)
        .config
        .nvme
        .unwrap()
        .rings;
    assert_eq!(rings, 2);
}

#[test]
fn keys_without_strata_meaning_are_listed_sorted() {
    let mapping = map(
        r#"{"steps_per_print": 5, "tensorboard": {"enabled": true, "output_path": "x"},
            "bf16": {"enabled": true, "immediate_grad_update": true, "no_such_key": 1}}"#,
    );
    assert_eq!(
        mapping.ignored,
        [
            "bf16.immediate_grad_update",
            "bf16.no_such_key",
            "steps_per_print",
            "tensorboard.enabled",
            "tensorboard.output_path"
        ]
    );
}

/// A top-level key DeepSpeed does not read is a typo that would drop its
/// section whole: refused, naming the nearest key DeepSpeed reads.
#[test]
fn an_unknown_top_level_key_is_refused_with_the_nearest_one() {
    let err = strata_train::from_deepspeed_json(
        r#"{"train_micro_batch_size_per_gpu": 2, "zero_optimisation": {"stage": 3}}"#,
        None,
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("zero_optimisation") && err.contains("did you mean \"zero_optimization\"?"),
        "{err}"
    );
    let err = strata_train::from_deepspeed_json(r#"{"no_such_key": 1}"#, None)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("DeepSpeed has no top-level key \"no_such_key\": remove it"),
        "{err}"
    );
}

#[test]
fn fp16_static_and_dynamic_loss_scales() {
    let t = map(r#"{"fp16": {"enabled": true, "loss_scale": 128}}"#)
        .config
        .train;
    assert_eq!((t.loss_scale, t.loss_scale_dynamic), (128.0, false));
    let scaler = t.scaler();
    assert_eq!((scaler.growth_factor, scaler.min_scale), (1.0, 128.0));
    let t = map(
        r#"{"fp16": {"enabled": true, "initial_scale_power": 12, "loss_scale_window": 50, "hysteresis": 3, "min_loss_scale": 4}}"#,
    )
    .config
    .train;
    assert_eq!(
        (
            t.loss_scale,
            t.loss_scale_growth_interval,
            t.loss_scale_hysteresis,
            t.loss_scale_min
        ),
        (4096.0, 50, 3, 4.0)
    );
    // A disabled fp16 section is not read: its keys are not warned about.
    assert!(
        map(r#"{"fp16": {"enabled": false, "hysteresis": 9}, "bf16": {"enabled": true}}"#)
            .ignored
            .is_empty()
    );
}

/// A value for each key of the table that a valid config can hold all at
/// once (fp16 on, a WarmupDecayLR scheduler, everything on NVMe).
fn sample_value(key: &str) -> Option<serde_json::Value> {
    use serde_json::json;
    let name = key.rsplit('.').next().unwrap();
    Some(match key {
        // Read only without a `bf16` section; WarmupCosineLR's params only
        // with that scheduler (the DeepSpeed comparison covers them).
        "bfloat16.enabled"
        | "scheduler.params.warmup_min_ratio"
        | "scheduler.params.cos_min_ratio" => {
            return None;
        }
        "train_batch_size" | "train_micro_batch_size_per_gpu" => json!(8),
        "gradient_accumulation_steps" | "gradient_clipping" => json!(1),
        "bf16.enabled" => json!(false),
        "fp16.enabled" => json!(true),
        "fp16.loss_scale" => json!(0),
        "fp16.initial_scale_power" => json!(16),
        "optimizer.type" => json!("AdamW"),
        "optimizer.params.betas" => json!([0.9, 0.99]),
        "optimizer.params.lr" | "scheduler.params.warmup_max_lr" => json!(1e-3),
        "optimizer.params.weight_decay" | "scheduler.params.warmup_min_lr" => json!(0),
        "scheduler.type" => json!("WarmupDecayLR"),
        "scheduler.params.warmup_type" => json!("linear"),
        "scheduler.params.last_batch_iteration" => json!(-1),
        "scheduler.params.total_num_steps" => json!(100),
        "zero_optimization.stage" => json!(3),
        "aio.block_size" => json!(1 << 20),
        "zero_optimization.offload_optimizer.ratio" => json!(1.0),
        // Every rank (the sample run has one).
        "zero_optimization.zero_hpz_partition_size" => json!(1),
        _ => match name {
            "*" => json!(1),
            "device" => json!("nvme"),
            "nvme_path" => json!("swap"),
            "adam_w_mode" | "bias_correction" | "pin_memory" | "pipeline_read"
            | "pipeline_write" => json!(true),
            "amsgrad"
            | "consecutive_hysteresis"
            | "use_gds"
            | "single_submit"
            | "overlap_events" => json!(false),
            _ => json!(2),
        },
    })
}

#[test]
fn every_table_key_the_mapper_reads_is_mapped_and_every_mapped_key_is_read() {
    let mut json = serde_json::Map::new();
    for rule in KEYS {
        let Some(value) = sample_value(rule.key) else {
            continue;
        };
        let key = rule.key.replace(".*", ".x");
        let mut parts: Vec<&str> = key.split('.').collect();
        let last = parts.pop().unwrap();
        let mut map = &mut json;
        for part in parts {
            map = map
                .entry(part)
                .or_insert_with(|| serde_json::json!({}))
                .as_object_mut()
                .unwrap();
        }
        map.insert(last.to_string(), value);
    }
    let text = serde_json::Value::Object(json).to_string();
    let mapping = from_deepspeed_json(&text, None).unwrap_or_else(|err| panic!("{text}: {err}"));
    let mut leaves = Vec::new();
    leaves_of(&serde_json::from_str(&text).unwrap(), "", &mut leaves);
    assert!(leaves.len() + 3 >= KEYS.len(), "{leaves:?}");
    for key in leaves {
        let rule = rule(&key).unwrap_or_else(|| panic!("{key} is not in KEYS"));
        let ignored = mapping.ignored.contains(&key);
        assert_eq!(
            ignored,
            rule.treatment == Treatment::Ignored,
            "{key}: the table says {:?}, the mapper {}",
            rule.treatment,
            if ignored { "ignores it" } else { "reads it" }
        );
    }
}

fn leaves_of(value: &serde_json::Value, prefix: &str, leaves: &mut Vec<String>) {
    if let serde_json::Value::Object(map) = value {
        for (key, inner) in map {
            let path = if prefix.is_empty() {
                key.clone()
            } else {
                format!("{prefix}.{key}")
            };
            if inner.is_object() {
                leaves_of(inner, &path, leaves);
            } else {
                leaves.push(path);
            }
        }
    }
}

#[test]
fn the_committed_table_is_the_generated_one() {
    let path = workspace().join("docs/deepspeed-config.md");
    let generated = table_markdown();
    if std::env::var_os("STRATA_BLESS").is_some() {
        std::fs::write(&path, &generated).unwrap();
        return;
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == generated,
        "{} differs from the table KEYS generates: regenerate it with \
         `STRATA_BLESS=1 cargo test -p strata-train --test deepspeed`",
        path.display()
    );
}

/// The learning rates of strata's schedule, steps 1 to `steps`, for a
/// DeepSpeed config.
fn strata_lrs(json: &str, steps: u64) -> Vec<f64> {
    let mut base = TrainConfig::default();
    base.train.steps = steps;
    let t = from_deepspeed_json(json, Some(&base)).unwrap().config.train;
    (1..=steps).map(|step| t.lr_at(step)).collect()
}

fn close(a: f64, b: f64) -> bool {
    a == b || (a - b).abs() <= 1e-12 * a.abs().max(b.abs())
}

#[test]
fn schedules_by_hand() {
    // WarmupLR, log: DeepSpeed's first two steps run at warmup_min_lr
    // (iterations -1 and 0), then min + (max - min) ln(i + 1) / ln(n).
    let lrs = strata_lrs(
        r#"{"scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0001, "warmup_max_lr": 0.001, "warmup_num_steps": 10}}}"#,
        20,
    );
    assert_eq!(lrs[0], 0.0001);
    assert_eq!(lrs[1], 0.0001);
    assert!(close(lrs[2], 0.0001 + 0.0009 * 2f64.ln() / 10f64.ln()));
    assert!(close(lrs[10], 0.001));
    assert_eq!(lrs[19], 0.001);
    // WarmupDecayLR, linear: i / n in warmup, then (total - i) / (total - n).
    let lrs = strata_lrs(
        r#"{"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_max_lr": 0.001, "warmup_num_steps": 4, "warmup_type": "linear", "total_num_steps": 12}}}"#,
        20,
    );
    let expected = [
        0.0, 0.0, 0.25, 0.5, 0.75, 1.0, 0.875, 0.75, 0.625, 0.5, 0.375, 0.25, 0.125, 0.0, 0.0,
    ];
    for (step, ratio) in expected.iter().enumerate() {
        assert!(
            close(lrs[step], 0.001 * ratio),
            "step {}: {} vs {}",
            step + 1,
            lrs[step],
            0.001 * ratio
        );
    }
    // WarmupCosineLR: 0 before the first scheduler step, then a ratio of
    // lr; half way through the cosine the ratio is (1 + cos_min) / 2.
    let lrs = strata_lrs(
        r#"{"optimizer": {"type": "AdamW", "params": {"lr": 0.002}},
            "scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 2, "warmup_type": "linear", "warmup_min_ratio": 0.5, "cos_min_ratio": 0.2, "total_num_steps": 10}}}"#,
        14,
    );
    assert_eq!(lrs[0], 0.0);
    assert!(close(lrs[1], 0.002 * 0.5));
    assert!(close(lrs[2], 0.002 * 0.75));
    // Iteration 6: real step 5 of 8: cos(pi 5/8).
    let ratio = 0.2 + 0.8 * (1.0 + (std::f64::consts::PI * 5.0 / 8.0).cos()) / 2.0;
    assert!(close(lrs[7], 0.002 * ratio));
    assert!(close(lrs[13], 0.002 * 0.2));
}

/// DeepSpeed's scheduler classes, run over `steps` steps for each config:
/// the rate its optimizer holds at each step (before `step()`).
const DEEPSPEED_SCRIPT: &str = r#"
import json, sys
import torch
from deepspeed.runtime import lr_schedules
cases = json.loads(sys.argv[1])
for index, case in enumerate(cases):
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=case["lr"])
    scheduler = getattr(lr_schedules, case["type"])(optimizer, **case["params"])
    for step in range(1, case["steps"] + 1):
        print("LR", index, step, repr(float(optimizer.param_groups[0]["lr"])))
        optimizer.step()
        scheduler.step()
"#;

#[test]
fn schedules_match_deepspeed_at_every_step() {
    let probe = Command::new("python3")
        .args(["-c", "import deepspeed, torch"])
        .output();
    match probe {
        Ok(output) if output.status.success() => {}
        Ok(output) => {
            let stderr = String::from_utf8_lossy(&output.stderr);
            println!(
                "skipped: python3 cannot import deepspeed: {}",
                stderr.lines().last().unwrap_or("")
            );
            return;
        }
        Err(err) => {
            println!("skipped: no python3 ({err})");
            return;
        }
    }
    let steps = 200u64;
    let lr = 0.0007;
    let schedulers = [
        (
            "WarmupLR",
            serde_json::json!({"warmup_min_lr": 1e-5, "warmup_max_lr": lr, "warmup_num_steps": 50}),
        ),
        (
            "WarmupLR",
            serde_json::json!({"warmup_max_lr": lr, "warmup_num_steps": 37, "warmup_type": "linear"}),
        ),
        (
            "WarmupLR",
            serde_json::json!({"warmup_max_lr": lr, "warmup_num_steps": 1}),
        ),
        (
            "WarmupDecayLR",
            serde_json::json!({"warmup_min_lr": 0, "warmup_max_lr": lr, "warmup_num_steps": 20, "total_num_steps": 150}),
        ),
        (
            "WarmupDecayLR",
            serde_json::json!({"warmup_min_lr": 1e-6, "warmup_max_lr": lr, "warmup_num_steps": 33, "warmup_type": "linear", "total_num_steps": 180}),
        ),
        (
            "WarmupDecayLR",
            serde_json::json!({"warmup_max_lr": lr, "warmup_num_steps": 300, "total_num_steps": 100}),
        ),
        (
            "WarmupCosineLR",
            serde_json::json!({"warmup_num_steps": 30, "total_num_steps": 160}),
        ),
        (
            "WarmupCosineLR",
            serde_json::json!({"warmup_min_ratio": 0.01, "warmup_num_steps": 20, "cos_min_ratio": 0.1, "warmup_type": "linear", "total_num_steps": 200}),
        ),
        (
            "WarmupCosineLR",
            serde_json::json!({"warmup_min_ratio": 0.2, "warmup_num_steps": 250, "cos_min_ratio": 0.0, "total_num_steps": 120}),
        ),
    ];
    let cases: Vec<serde_json::Value> = schedulers
        .iter()
        .map(|(kind, params)| serde_json::json!({"type": kind, "params": params, "lr": lr, "steps": steps}))
        .collect();
    let output = Command::new("python3")
        .args([
            "-c",
            DEEPSPEED_SCRIPT,
            &serde_json::Value::Array(cases).to_string(),
        ])
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let mut deepspeed = vec![Vec::new(); schedulers.len()];
    for line in String::from_utf8_lossy(&output.stdout).lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        if let ["LR", index, _step, value] = fields[..] {
            deepspeed[index.parse::<usize>().unwrap()].push(value.parse::<f64>().unwrap());
        }
    }
    for (index, (kind, params)) in schedulers.iter().enumerate() {
        let json = serde_json::json!({
            "optimizer": {"type": "AdamW", "params": {"lr": lr}},
            "scheduler": {"type": kind, "params": params},
        });
        let ours = strata_lrs(&json.to_string(), steps);
        assert_eq!(deepspeed[index].len(), steps as usize, "{kind} {params}");
        for (step, (a, b)) in ours.iter().zip(&deepspeed[index]).enumerate() {
            assert!(
                close(*a, *b),
                "{kind} {params} step {}: strata {a}, DeepSpeed {b}",
                step + 1
            );
        }
    }
    println!(
        "compared {} schedules x {steps} steps with DeepSpeed's classes",
        schedulers.len()
    );
}

#[test]
fn the_default_schedule_is_unchanged_and_configs_print_as_toml() {
    // strata's own schedule, as it was before `[train.schedule]`.
    let t = TrainConfig::default().train;
    for step in 1..=t.steps + 10 {
        let old = if step <= t.warmup_steps {
            t.lr * step as f64 / t.warmup_steps.max(1) as f64
        } else {
            let span = t.steps.saturating_sub(t.warmup_steps).max(1) as f64;
            let progress = ((step - t.warmup_steps) as f64 / span).min(1.0);
            t.lr_min + 0.5 * (t.lr - t.lr_min) * (1.0 + (std::f64::consts::PI * progress).cos())
        };
        assert_eq!(t.lr_at(step).to_bits(), old.to_bits(), "step {step}");
    }
    let scaler = t.scaler();
    let defaults = strata_optim_defaults();
    assert_eq!(
        (scaler.hysteresis, scaler.min_scale, scaler.growth_factor),
        defaults
    );
    for config in [TrainConfig::default(), {
        let mut c = TrainConfig::default();
        c.placement.optimizer = Placement::Cpu;
        c.train.checkpoint_dir = Some("ckpt \"dir\"".into());
        c
    }] {
        let text = config.to_toml().unwrap();
        assert_eq!(TrainConfig::from_toml(&text).unwrap(), config, "{text}");
    }
    // Existing configs, which have no [train.schedule], read as before.
    for name in [
        "offload.toml",
        "resident.toml",
        "zero3-1rank.toml",
        "zero3-2rank.toml",
    ] {
        let path = workspace().join("examples/configs").join(name);
        let config = TrainConfig::from_toml(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(config.train.schedule, Schedule::Cosine, "{name}");
        assert!(config.train.loss_scale_dynamic, "{name}");
    }
}

/// The loss scaler's defaults the new `[train]` keys must keep.
fn strata_optim_defaults() -> (u32, f32, f32) {
    (1, 1.0, 2.0)
}
