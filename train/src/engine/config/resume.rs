//! What a resumed run may change against the run its checkpoint came from:
//! where things live and how often they are saved may; what the run
//! computes (the model, the schedule, the batch, the data, the optimizer's
//! numbers) may not.

use super::TrainConfig;

/// The file in each checkpoint that holds the config of the run that wrote
/// it (what `strata train --print-config` shows): a resume starts from it.
pub const RUN_CONFIG: &str = "strata.toml";

/// Keys a resumed run may set differently: placement, sharding and budgets (another
/// machine), checkpoint cadence and place, the activation recompute choice
/// (recomputing gives the same bits) and the folder the first weights came
/// from (the checkpoint holds the weights now), the held-out evaluation
/// (it changes no step). A table name covers every key in it.
const FREE: [&str; 17] = [
    "placement",
    "parallel",
    "comm",
    "device",
    "host",
    "nvme",
    "runtime",
    "checkpoint",
    "eval",
    "optim.threads",
    "model.init_from",
    "data.cache_dir",
    "train.checkpoint_every",
    "train.checkpoint_dir",
    "train.checkpoints_kept",
    "train.lock_wait_s",
    "train.checkpoint_activations",
];

/// Keys a resumed run may set otherwise when their product, the global
/// batch, stays the same (another number of ranks).
const BATCH: [&str; 3] = [
    "train.ranks",
    "train.micro_batch",
    "train.grad_accumulation",
];

/// One key a resumed run sets otherwise than the run it resumes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Difference {
    /// The dotted key (`train.lr`).
    pub key: String,
    /// Its value in the checkpoint's run (`none` when absent).
    pub saved: String,
    /// Its value in this run.
    pub here: String,
}

impl std::fmt::Display for Difference {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} = {} in the checkpoint's run, {} in this one",
            self.key, self.saved, self.here
        )
    }
}

impl TrainConfig {
    /// Every key that would change what the run computes against `saved`,
    /// the config of the run a checkpoint comes from, in key order.
    /// `train.steps` is among them: whether a longer run may extend a
    /// finished one is the caller's to say (it knows the step).
    pub fn resume_differences(&self, saved: &TrainConfig) -> Vec<Difference> {
        let (mut here, mut there) = (Vec::new(), Vec::new());
        flatten(
            "",
            &serde_json::to_value(self).expect("serializes"),
            &mut here,
        );
        flatten(
            "",
            &serde_json::to_value(saved).expect("serializes"),
            &mut there,
        );
        let mut keys: Vec<&String> = here.iter().chain(&there).map(|(k, _)| k).collect();
        keys.sort();
        keys.dedup();
        let value = |list: &[(String, String)], key: &str| {
            list.iter()
                .find(|(k, _)| k == key)
                .map_or_else(|| "none".to_string(), |(_, v)| v.clone())
        };
        // The ranks may change with the global batch held: a checkpoint is
        // cut anew for another number of ranks, and the data numbers a
        // step's sequences across ranks.
        let global = |t: &super::TrainSettings| t.ranks * t.micro_batch * t.grad_accumulation;
        let (held, now) = (global(&saved.train), global(&self.train));
        let mut differences: Vec<Difference> = keys
            .into_iter()
            .filter(|key| {
                let free = FREE
                    .iter()
                    .any(|free| key == free || key.starts_with(&format!("{free}.")));
                let batch = held == now && BATCH.contains(&key.as_str());
                !(free || batch)
            })
            .filter_map(|key| {
                let (a, b) = (value(&there, key), value(&here, key));
                (a != b).then(|| Difference {
                    key: key.clone(),
                    saved: a,
                    here: b,
                })
            })
            .collect();
        if held != now {
            let shown = |t: &super::TrainSettings| {
                format!(
                    "{} x {} x {} = {}",
                    t.ranks,
                    t.micro_batch,
                    t.grad_accumulation,
                    global(t)
                )
            };
            differences.push(Difference {
                key: "the global batch (train.ranks x train.micro_batch x train.grad_accumulation)"
                    .into(),
                saved: shown(&saved.train),
                here: shown(&self.train),
            });
        }
        differences
    }
}

/// `value`'s leaves as (dotted key, JSON text); null leaves are left out
/// (an absent option).
fn flatten(prefix: &str, value: &serde_json::Value, out: &mut Vec<(String, String)>) {
    match value {
        serde_json::Value::Object(map) => {
            for (k, v) in map {
                let key = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                flatten(&key, v, out);
            }
        }
        serde_json::Value::Null => {}
        leaf => out.push((prefix.to_string(), leaf.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn where_things_live_may_change_and_what_the_run_computes_may_not() {
        let saved = TrainConfig::default();
        let mut moved = saved.clone();
        moved.placement.params = crate::Placement::Nvme;
        moved.host.budget = strata_storage::ByteSize(1 << 30);
        moved.train.checkpoint_every = 7;
        moved.train.checkpoint_dir = Some("elsewhere".into());
        moved.optim.threads = 3;
        assert_eq!(moved.resume_differences(&saved), Vec::new());

        let mut changed = saved.clone();
        changed.train.lr = 1e-4;
        changed.train.micro_batch = 2;
        changed.data.path = crate::DataPaths(vec!["other.txt".into()]);
        let found = changed.resume_differences(&saved);
        let keys: Vec<&str> = found.iter().map(|d| d.key.as_str()).collect();
        let global = "the global batch (train.ranks x train.micro_batch x train.grad_accumulation)";
        assert_eq!(keys, ["data.path", "train.lr", "train.micro_batch", global]);
        assert_eq!(found[0].saved, "none");
        assert_eq!(found[0].here, "\"other.txt\"");
        assert_eq!(found[1].saved, "0.003");
        assert_eq!(found[1].here, "0.0001");
        assert_eq!(
            found[2].to_string(),
            "train.micro_batch = 8 in the checkpoint's run, 2 in this one"
        );
        assert_eq!(
            found[3].to_string(),
            format!("{global} = 1 x 8 x 1 = 8 in the checkpoint's run, 1 x 2 x 1 = 2 in this one")
        );
    }

    #[test]
    fn the_ranks_may_change_with_the_global_batch_held() {
        let saved = TrainConfig::default();
        let mut wider = saved.clone();
        wider.train.ranks = 4;
        wider.train.micro_batch = 2;
        assert_eq!(wider.resume_differences(&saved), Vec::new());
        wider.train.grad_accumulation = 2;
        wider.train.micro_batch = 1;
        assert_eq!(wider.resume_differences(&saved), Vec::new());
        wider.train.micro_batch = 2;
        let keys: Vec<String> = wider
            .resume_differences(&saved)
            .into_iter()
            .map(|d| d.key)
            .collect();
        assert_eq!(keys.len(), 4, "{keys:?}");
    }

    #[test]
    fn a_schedule_table_is_compared_key_by_key() {
        let saved = TrainConfig::default();
        let mut changed = saved.clone();
        changed.train.steps += 1;
        changed.train.warmup_steps += 1;
        let keys: Vec<String> = changed
            .resume_differences(&saved)
            .into_iter()
            .map(|d| d.key)
            .collect();
        assert_eq!(keys, ["train.steps", "train.warmup_steps"]);
    }
}
