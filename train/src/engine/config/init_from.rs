//! `[model] init_from`: the shape a Hugging Face folder's `config.json`
//! gives, merged with the `[model]` keys a config sets (a key that
//! disagrees is refused naming both values; `seq` may be any length up to
//! the model's positions), and the check a run makes before it plans
//! anything.

use std::collections::BTreeSet;

use crate::error::{Result, TrainError};
use crate::hf::HfFolder;

use super::*;

/// The sequence length a run starting from a folder trains at when its
/// config sets none: the model's positions, at most this.
pub const INIT_SEQ_DEFAULT_MAX: usize = 2048;

/// Keys that may differ from `config.json`: the sequence a run trains at,
/// the folder itself, and the positions the checkpoints' config.json gives
/// (where the architecture takes them as a setting).
const FREE_KEYS: [&str; 3] = ["seq", "init_from", "max_positions"];

impl TrainConfig {
    /// The `[model]` keys a TOML config sets (what [`TrainConfig::with_init_from`]
    /// checks against `config.json`).
    pub fn model_keys_in(text: &str) -> BTreeSet<String> {
        let table: toml::Table = toml::from_str(text).unwrap_or_default();
        table
            .get("model")
            .and_then(toml::Value::as_table)
            .map(|model| model.keys().cloned().collect())
            .unwrap_or_default()
    }

    /// This config with `[model]` from `model.init_from`'s `config.json`
    /// (unchanged without it): the architecture and shape are the folder's;
    /// a key in `set` (the `[model]` keys the run's config gives) that
    /// disagrees is refused naming both values; `max_positions` is the
    /// config's if set (refused where the architecture's positions are a
    /// table, whose rows the folder gives), else the folder's; `seq` is the
    /// config's if set (at most the positions), else the positions up to
    /// [`INIT_SEQ_DEFAULT_MAX`].
    pub fn with_init_from(&self, set: &BTreeSet<String>) -> Result<TrainConfig> {
        let Some(dir) = &self.model.init_from else {
            return Ok(self.clone());
        };
        let folder = HfFolder::open(dir)?;
        let mut theirs = folder.model_config()?;
        let ours = &self.model;
        let (a, b) = (model_json(ours), model_json(&theirs));
        for key in set.iter().filter(|k| !FREE_KEYS.contains(&k.as_str())) {
            let (mine, given) = (a.get(key), b.get(key));
            if mine != given {
                return Err(TrainError::HfFolder {
                    path: dir.join("config.json"),
                    problem: format!(
                        "it gives model.{key} = {}, the run's [model] sets {}",
                        show(given),
                        show(mine)
                    ),
                    fix: format!(
                        "leave model.{key} out of [model] (the folder's config.json gives the shape), or start from a model of that shape"
                    ),
                });
            }
        }
        // The positions the written config.json gives: the run's, where
        // its [model] sets them and the architecture takes them as a
        // setting (not the rows of a table of parameters), else the
        // folder's.
        let folder_positions = theirs.max_positions.unwrap_or(theirs.seq);
        let positions = match (set.contains("max_positions"), ours.max_positions) {
            (true, Some(mine)) if mine != folder_positions => {
                let probe = ModelConfig {
                    seq: theirs.seq.min(mine),
                    max_positions: Some(mine),
                    ..theirs.clone()
                };
                if let Err(err) = probe.build() {
                    return Err(TrainError::HfFolder {
                        path: dir.join("config.json"),
                        problem: format!(
                            "its model has {folder_positions} positions, and the run's [model] sets max_positions = {mine}: {err}"
                        ),
                        fix: "leave model.max_positions out of [model] (the folder's config.json gives them)".into(),
                    });
                }
                mine
            }
            _ => folder_positions,
        };
        theirs.max_positions = Some(positions);
        theirs.seq = if set.contains("seq") {
            ours.seq
        } else {
            theirs.seq.min(INIT_SEQ_DEFAULT_MAX).min(positions)
        };
        if theirs.max_positions == Some(theirs.seq) {
            theirs.max_positions = None;
        }
        theirs.init_from = Some(dir.clone());
        if theirs.seq != positions && theirs.build().is_err() {
            // An architecture whose positions are a table of parameters
            // trains at exactly its rows.
            let without = ModelConfig {
                seq: positions,
                max_positions: None,
                ..theirs.clone()
            };
            if without.build().is_ok() {
                return Err(TrainError::HfFolder {
                    path: dir.join("config.json"),
                    problem: format!(
                        "its model has a table of {positions} positions, and the run's model.seq is {}",
                        theirs.seq
                    ),
                    fix: format!("train this model at model.seq = {positions}"),
                });
            }
        }
        let resolved = TrainConfig {
            model: theirs,
            ..self.clone()
        };
        resolved.validate()?;
        Ok(resolved)
    }

    /// Before a run plans anything: `model.init_from` opens, its
    /// `config.json` describes this run's `[model]` (every key but the
    /// sequence), and it holds every tensor of the model, of its shape and
    /// a dtype strata reads. Returns the folder (None without one).
    pub fn check_init_from(&self) -> Result<Option<HfFolder>> {
        let Some(dir) = &self.model.init_from else {
            return Ok(None);
        };
        let folder = HfFolder::open(dir)?;
        let theirs = folder.model_config()?;
        let (a, b) = (model_json(&self.model), model_json(&theirs));
        for (key, given) in b.iter().filter(|(k, _)| !FREE_KEYS.contains(&k.as_str())) {
            let mine = a.get(key);
            if mine != Some(given) {
                return Err(TrainError::HfFolder {
                    path: dir.join("config.json"),
                    problem: format!(
                        "it gives model.{key} = {}, the run's [model] has {}",
                        show(Some(given)),
                        show(mine)
                    ),
                    fix: "take [model] from the folder (TrainConfig::with_init_from; strata train --init-from does)".into(),
                });
            }
        }
        folder.check(self.model.build()?.as_ref())?;
        Ok(Some(folder))
    }
}

/// `[model]` as a JSON object, key by key.
fn model_json(model: &ModelConfig) -> serde_json::Map<String, serde_json::Value> {
    match serde_json::to_value(model).expect("a model config serializes") {
        serde_json::Value::Object(map) => map,
        _ => unreachable!("a struct serializes as an object"),
    }
}

fn show(value: Option<&serde_json::Value>) -> String {
    value.map_or("nothing (its default)".into(), |v| v.to_string())
}
