//! The config's checks before anything is opened: limits, hyperparameters
//! by their own keys, the device's constraints, and the closed-form count
//! of what each tier must hold (`check_memory`).

use strata_storage::ByteSize;

use strata_runtime::DeviceChoice;
pub use strata_scheduler::StateDtype;

use crate::error::bad;
use crate::error::{Result, TrainError};
use strata_runtime::Tier;

use super::*;

impl TrainConfig {
    /// Checks ranges and the relations between fields (not yet whether
    /// the placement fits: [`crate::engine::Engine::new`] plans that).
    pub fn validate(&self) -> Result<()> {
        self.model.build()?;
        if self.checkpoint.max_shard_size.0 == 0 {
            return Err(bad(
                "checkpoint.max_shard_size",
                self.checkpoint.max_shard_size,
                "give the largest safetensors file, e.g. \"5GiB\"",
            ));
        }
        self.validate_data()?;
        let (ranks, k) = (self.train.ranks, self.parallel.shard_degree);
        // (One rank: a launcher's processes are the ranks, checked again
        // once their number is known.)
        if k > 0 && ranks > 1 && (k > ranks || ranks % k != 0) {
            return Err(bad(
                "parallel.shard_degree",
                k,
                format!(
                    "give a divisor of train.ranks = {ranks} (the ranks each state is sharded over; the groups of them are replicas), or 0 for all of them"
                ),
            ));
        }
        let timeout = self.comm.timeout_s;
        if !(timeout.is_finite() && (0.1..=super::COMM_TIMEOUT_S_MAX).contains(&timeout)) {
            return Err(bad(
                "comm.timeout_s",
                timeout,
                format!(
                    "give the seconds a collective waits for its peers, 0.1 to {}",
                    super::COMM_TIMEOUT_S_MAX
                ),
            ));
        }
        let t = &self.train;
        if t.steps == 0 {
            return Err(bad("train.steps", t.steps, "run at least 1 step"));
        }
        if !(1..=MICRO_BATCH_MAX).contains(&t.micro_batch) {
            return Err(bad(
                "train.micro_batch",
                t.micro_batch,
                format!("use 1 to {MICRO_BATCH_MAX} sequences"),
            ));
        }
        if !(1..=GRAD_ACCUMULATION_MAX).contains(&t.grad_accumulation) {
            return Err(bad(
                "train.grad_accumulation",
                t.grad_accumulation,
                format!("use 1 to {GRAD_ACCUMULATION_MAX}"),
            ));
        }
        if !(1..=RANKS_MAX).contains(&t.ranks) {
            return Err(bad("train.ranks", t.ranks, format!("use 1 to {RANKS_MAX}")));
        }
        if !(t.lr > 0.0 && t.lr.is_finite()) {
            return Err(bad(
                "train.lr",
                t.lr,
                "use a positive, finite learning rate",
            ));
        }
        if t.schedule == Schedule::Cosine && !(t.lr_min >= 0.0 && t.lr_min <= t.lr) {
            return Err(bad("train.lr_min", t.lr_min, "use 0 to train.lr"));
        }
        t.schedule.validate()?;
        if !(0.0..=LOCK_WAIT_S_MAX).contains(&t.lock_wait_s) {
            return Err(bad(
                "train.lock_wait_s",
                t.lock_wait_s,
                format!("use 0 to {LOCK_WAIT_S_MAX} seconds"),
            ));
        }
        if !(t.clip_norm >= 0.0 && t.clip_norm.is_finite()) {
            return Err(bad(
                "train.clip_norm",
                t.clip_norm,
                "use 0 (off) or a positive norm",
            ));
        }
        t.adam(t.lr).validate().map_err(|err| named(err, t.lr))?;
        strata_optim::LossScaler::new(t.scaler()).map_err(|err| named(err, t.loss_scale))?;
        if t.loss_scale_dynamic && t.loss_scale_hysteresis == 0 {
            return Err(bad(
                "train.loss_scale_hysteresis",
                0,
                "use at least 1 (back off at the first overflow)",
            ));
        }
        if t.loss_scale_dynamic && !(t.loss_scale_min > 0.0 && t.loss_scale_min <= t.loss_scale) {
            return Err(bad(
                "train.loss_scale_min",
                t.loss_scale_min,
                format!(
                    "use a scale above 0 and at most train.loss_scale ({})",
                    t.loss_scale
                ),
            ));
        }
        if self.device.kind == DeviceChoice::Cuda {
            self.cuda_constraints()?;
        }
        if let (Some(seed), false) = (
            self.optim.rounding_seed,
            self.optim.state_dtype.stochastic(),
        ) {
            return Err(bad(
                "optim.rounding_seed",
                seed,
                format!(
                    "optim.state_dtype = {:?} rounds nothing stochastically: remove optim.rounding_seed, or set optim.state_dtype = \"bf16-moments\" or \"bf16\"",
                    self.optim.state_dtype.name()
                ),
            ));
        }
        if self.uses_nvme() && self.nvme.is_none() {
            return Err(bad(
                "placement",
                "nvme",
                "add an [nvme] table with dirs, or place params and optimizer on device or cpu",
            ));
        }
        if let Some(place) = self.placement.gradients {
            let optimizer = self.placement.optimizer;
            // Where the optimizer reads them, or with its states on NVMe.
            let fits =
                place == optimizer || (place == Placement::Cpu && optimizer == Placement::Nvme);
            if !fits {
                let allowed = match optimizer {
                    Placement::Device => "\"device\"",
                    Placement::Cpu => "\"cpu\"",
                    Placement::Nvme => "\"cpu\" or \"nvme\"",
                };
                return Err(bad(
                    "placement.gradients",
                    format!("{:?}", place.name()),
                    format!(
                        "the optimizer reads gradients where they live: with placement.optimizer = {:?} use {allowed}, or remove the key",
                        optimizer.name()
                    ),
                ));
            }
        }
        if let StateCache::Bytes(bytes) = self.placement.state_cache
            && bytes >= self.host.budget.0
        {
            return Err(bad(
                "placement.state_cache",
                ByteSize(bytes),
                format!(
                    "it must leave the plans part of host.budget ({}): lower it, or use \"auto\"",
                    self.host.budget
                ),
            ));
        }
        self.rank_runtime(0, 0)?.validate()?;
        self.check_memory()
    }

    /// What each tier must hold at the least for a rank, by a closed-form
    /// count (before anything proportional to the model is planned or
    /// allocated), part by part: the model states between uses (two
    /// 16-bit parameter sets on the parameters' tier, two optimizer-state
    /// sets on the optimizer's, the fp32 gradient on the device when the
    /// optimizer is there, else on the host) and, on the device, the least
    /// compute workspace (one block's gathered parameters and gradient,
    /// the streams between blocks). Lower bounds: what fits may still not
    /// fit the plan, which says so with its own numbers. Needs the limits
    /// [`validate`](Self::validate) checks first (they keep every count
    /// within 64 bits; the arithmetic saturates regardless).
    pub fn tier_needs(&self) -> Result<[Vec<(&'static str, u64)>; 3]> {
        let model = self.model.build()?;
        let shard_params = shard_params(&*model, self.shards() as u64);
        let state_bytes = self.optim.state_dtype.bytes_per_param() as u64;
        let mut needs: [Vec<(&'static str, u64)>; 3] = Default::default();
        let mut add = |tier: Tier, part: &'static str, bytes_per_param: u64| {
            needs[tier.index()].push((part, shard_params.saturating_mul(bytes_per_param)));
        };
        add(
            self.placement.params.tier(),
            "16-bit parameters (two sets)",
            2 * 2,
        );
        add(
            self.placement.optimizer.tier(),
            "optimizer states (master weights and moments, two sets)",
            2 * state_bytes,
        );
        // Gradients stay where the optimizer reads them (or on NVMe, by
        // placement.gradients): f32 for the device's AdamW; for the CPU
        // optimizer, in the compute dtype (bf16 on a GPU under "auto"; a
        // device not yet resolved counts the lower bound, bf16).
        let (grad_part, grad_bytes) = match (
            self.placement.optimizer,
            self.train.compute_dtype,
            self.device.kind,
        ) {
            (Placement::Device, _, _) => ("fp32 gradients (on the device with the optimizer)", 4),
            (_, ComputeDtype::F32, _) | (_, ComputeDtype::Auto, DeviceChoice::Cpu) => (
                "fp32 gradients (placement.gradients, by default with the optimizer)",
                4,
            ),
            _ => (
                "bf16 gradients (placement.gradients, by default with the optimizer)",
                2,
            ),
        };
        add(self.placement.gradients_tier(), grad_part, grad_bytes);
        let largest = model.groups().iter().map(|g| g.params() as u64).max();
        let shards = self.shards() as u64;
        let group_max = largest.unwrap_or(0).div_ceil(shards).saturating_mul(shards);
        let stream = [self.train.micro_batch, model.seq(), model.stream_width()]
            .iter()
            .fold(1u64, |n, &d| n.saturating_mul(d as u64));
        let in_flight = self.train.in_flight() as u64;
        // Gathered parameters and gradient (fp32), y and dx, and each
        // micro-batch in flight's x and dy (fp32).
        needs[Tier::Device.index()].push((
            "compute workspace (one block's gathered fp32 parameters and gradient)",
            group_max.saturating_mul(8),
        ));
        needs[Tier::Device.index()].push((
            "activations between blocks (micro_batch x seq x hidden, fp32, per micro-batch in flight)",
            stream.saturating_mul(4).saturating_mul(2 + 2 * in_flight),
        ));
        Ok(needs)
    }

    /// Each tier's budget and the key that sets it.
    fn budgets(&self) -> [(&'static str, u64); 3] {
        [
            ("device.budget", self.device.budget.0),
            ("host.budget", self.host.budget.0),
            (
                "nvme.capacity",
                self.nvme.as_ref().map_or(0, |n| n.capacity.0),
            ),
        ]
    }

    /// Refuses a model and batch whose rank cannot fit its tiers by
    /// [`TrainConfig::tier_needs`] (see [`TrainConfig::check_needs`]).
    fn check_memory(&self) -> Result<()> {
        self.check_needs(&self.budgets(), &Keys::CONFIG)
    }

    /// Refuses a rank whose [`TrainConfig::tier_needs`] pass `budgets` (a
    /// budget per tier, with the name of what sets it), naming the tier,
    /// what fills it in GiB and the fixes that would make every tier fit,
    /// each checked by counting again: the smallest budget, and other
    /// placements, more ranks or a smaller micro-batch where one of them
    /// does (named as `keys` says: a config's keys, or `strata plan`'s
    /// flags). `strata train` and `strata plan` both count with it.
    pub fn check_needs(&self, budgets: &[(&'static str, u64); 3], keys: &Keys) -> Result<()> {
        let needs = self.tier_needs()?;
        let Some((tier, needed)) = short_tier(&needs, budgets) else {
            return Ok(());
        };
        let (budget_key, budget_bytes) = budgets[tier.index()];
        let parts: Vec<String> = needs[tier.index()]
            .iter()
            .filter(|(_, bytes)| *bytes > 0)
            .map(|(part, bytes)| format!("{part} {}", strata_scheduler::gib(*bytes)))
            .collect();
        let mut fixes = vec![format!(
            "raise {budget_key} to at least {}",
            strata_scheduler::gib(needed)
        )];
        let fits = |edit: &dyn Fn(&mut TrainConfig)| {
            let mut other = self.clone();
            edit(&mut other);
            other
                .tier_needs()
                .is_ok_and(|needs| short_tier(&needs, budgets).is_none())
        };
        for place in [Placement::Nvme, Placement::Cpu, Placement::Device] {
            if place != self.placement.optimizer && fits(&|c| c.placement.optimizer = place) {
                fixes.push(format!(
                    "set {} {}",
                    keys.optimizer,
                    keys.quote(place.name())
                ));
            }
            if place != self.placement.params && fits(&|c| c.placement.params = place) {
                fixes.push(format!("set {} {}", keys.params, keys.quote(place.name())));
            }
        }
        if keys.config
            && self.placement.optimizer == Placement::Nvme
            && self.placement.gradients != Some(Placement::Nvme)
            && fits(&|c| c.placement.gradients = Some(Placement::Nvme))
        {
            fixes.push("set placement.gradients = \"nvme\"".into());
        }
        // More ranks split the states, but each rank of a config has its
        // own budgets (the machine gives them all), and a config's ranks
        // are threads, which cannot share a GPU: offered to a config only
        // on the CPU device, with what it takes in all.
        let ranks_apply = !keys.config || self.device.kind == DeviceChoice::Cpu;
        if ranks_apply
            && let Some(ranks) = first_true(self.train.ranks + 1, keys.ranks_max, &|r| {
                fits(&|c| c.train.ranks = r)
            })
        {
            fixes.push(if keys.config {
                format!(
                    "shard over {} {ranks} (each rank has its own {budget_key}: {} in all)",
                    keys.ranks,
                    strata_scheduler::gib(budget_bytes.saturating_mul(ranks as u64))
                )
            } else {
                format!("shard over {} {ranks}", keys.ranks)
            });
        }
        // The largest smaller micro-batch that fits: one below the first
        // that does not, counting up from 1.
        let smaller = self.train.micro_batch.saturating_sub(1);
        let largest_fitting =
            match first_true(1, smaller, &|mb| !fits(&|c| c.train.micro_batch = mb)) {
                Some(failing) => failing.checked_sub(1).filter(|&mb| mb >= 1),
                None => Some(smaller).filter(|&mb| mb >= 1),
            };
        if tier == Tier::Device
            && let Some(mb) = largest_fitting
        {
            fixes.push(format!(
                "lower {} to {mb} (accumulate more micro-batches to keep the batch)",
                keys.micro_batch
            ));
        }
        let nvme_unset = tier == Tier::Nvme && budget_bytes == 0 && keys.config;
        Err(TrainError::Memory {
            what: parts.join(", "),
            tier: match tier {
                Tier::Device => "device",
                Tier::Host => "host",
                Tier::Nvme => "nvme",
            },
            needed_bytes: needed,
            budget_key,
            budget_bytes,
            detail: format!(
                "{} parameters per rank, states {:?}; a closed-form lower bound, counted before anything is allocated",
                shard_params(&*self.model.build()?, self.shards() as u64),
                self.optim.state_dtype.name()
            ),
            fix: if nvme_unset {
                format!("add an [nvme] table, or {}", fixes.join(", or "))
            } else {
                fixes.join(", or ")
            },
        })
    }

    /// What a run on a CUDA device cannot do yet: an architecture or data
    /// layout without kernels, or optimizer states on the device in another
    /// dtype than fp32. (Ranks as threads cannot share the one GPU: the
    /// engine refuses them, [`TrainConfig::gpu_ranks_as_threads`].)
    /// Several ranks as threads of this process on a GPU: refused (each
    /// GPU rank is a process of its own, NCCL between them). Several ranks
    /// on `auto` take the CPU device, processes too: every rank decides
    /// alike, and ranks on GPUs are asked for by name (`cuda`).
    pub fn gpu_ranks_as_threads(&self) -> Result<()> {
        match (self.device.kind, self.train.ranks) {
            (DeviceChoice::Cuda | DeviceChoice::Auto, 2..) => Err(bad(
                "train.ranks",
                self.train.ranks,
                format!(
                    "ranks as threads of one process share its one GPU: start a process per GPU (strata train --nproc {n}, torchrun --nproc-per-node {n} --no-python strata train, or mpirun -n {n}), or set device.kind = \"cpu\"",
                    n = self.train.ranks
                ),
            )),
            _ => Ok(()),
        }
    }

    pub(super) fn cuda_constraints(&self) -> Result<()> {
        if self.placement.optimizer == Placement::Device
            && self.optim.state_dtype != StateDtype::Fp32
        {
            return Err(bad(
                "optim.state_dtype",
                format!("{:?}", self.optim.state_dtype.name()),
                "optimizer states on a CUDA device are fp32 for now (the device AdamW kernel keeps fp32 master weights and moments): set optim.state_dtype = \"fp32\", or place the optimizer on cpu or nvme",
            ));
        }
        Ok(())
    }
}

/// How [`TrainConfig::check_needs`] names the settings its fixes change.
#[derive(Clone, Copy, Debug)]
pub struct Keys {
    /// Where the parameters live.
    pub params: &'static str,
    /// Where the optimizer states live.
    pub optimizer: &'static str,
    /// The ranks that shard the states.
    pub ranks: &'static str,
    /// The most ranks to suggest.
    pub ranks_max: usize,
    /// Sequences per micro-batch.
    pub micro_batch: &'static str,
    /// Whether these are a config's keys (`key = "value"`), not flags.
    pub config: bool,
}

impl Keys {
    /// A config file's keys.
    pub const CONFIG: Keys = Keys {
        params: "placement.params =",
        optimizer: "placement.optimizer =",
        ranks: "train.ranks =",
        ranks_max: RANKS_MAX,
        micro_batch: "train.micro_batch",
        config: true,
    };

    fn quote(&self, value: &str) -> String {
        if self.config {
            format!("\"{value}\"")
        } else {
            value.to_string()
        }
    }
}

/// Parameters per rank of `world`: every group cut into `world` equal
/// shards (padded).
fn shard_params(model: &dyn crate::model::Model, world: u64) -> u64 {
    model.groups().iter().fold(0u64, |sum, g| {
        sum.saturating_add((g.params() as u64).div_ceil(world))
    })
}

/// The smallest `x` in `lo..=hi` for which `holds(x)`, by bisection: the
/// counts are monotone in ranks and micro-batch (a bound as large as
/// `strata plan`'s GPU count takes a few dozen counts, not one a value).
/// None when it holds nowhere in the range.
fn first_true(lo: usize, hi: usize, holds: &dyn Fn(usize) -> bool) -> Option<usize> {
    if lo > hi || !holds(hi) {
        return None;
    }
    let (mut lo, mut hi) = (lo, hi);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if holds(mid) {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    Some(lo)
}

/// The first tier whose need in `needs` (parts per tier, from
/// [`TrainConfig::tier_needs`]) passes its budget in `budgets`: the tier,
/// the need.
fn short_tier(
    needs: &[Vec<(&'static str, u64)>; 3],
    budgets: &[(&'static str, u64); 3],
) -> Option<(Tier, u64)> {
    Tier::ALL.into_iter().find_map(|tier| {
        let needed = needs[tier.index()]
            .iter()
            .fold(0u64, |sum, (_, bytes)| sum.saturating_add(*bytes));
        (needed > budgets[tier.index()].1).then_some((tier, needed))
    })
}

impl TrainConfig {
    /// `[data]`'s keys agree: JSONL and supervised JSONL need a
    /// tokenizer, token files take none, a text field only means something
    /// for JSONL, prompt and response fields only for supervised JSONL.
    fn validate_data(&self) -> Result<()> {
        use super::DataFormat;
        let d = &self.data;
        match (d.format, &d.tokenizer) {
            (DataFormat::Jsonl, None) => {
                return Err(bad(
                    "data.format",
                    "jsonl",
                    "set data.tokenizer (--tokenizer DIR): JSONL documents (every .jsonl file --data names is read as JSONL) are tokenized with the model's tokenizer",
                ));
            }
            (DataFormat::Sft, None) => {
                return Err(bad(
                    "data.format",
                    "sft",
                    "set data.tokenizer (--tokenizer DIR): supervised JSONL (prompts and responses) is tokenized with the model's tokenizer",
                ));
            }
            (DataFormat::Tokens, Some(tokenizer)) => {
                return Err(bad(
                    "data.tokenizer",
                    tokenizer.display(),
                    "token files are tokenized already: leave data.tokenizer out, or give texts or JSONL (--data)",
                ));
            }
            _ => {}
        }
        if d.path.is_empty() && (d.tokenizer.is_some() || d.format.is_json_lines()) {
            return Err(bad(
                "data.path",
                "none",
                "name the texts or JSONL files to tokenize (--data FILE... or [data] path); the bundled text is read a byte per token",
            ));
        }
        if d.text_field.is_some() && d.format != DataFormat::Jsonl {
            return Err(bad(
                "data.text_field",
                d.text_field(),
                "a text field names a JSONL line's document: set data.format = \"jsonl\", or leave it out",
            ));
        }
        if let Some(id) = d
            .eos_id
            .filter(|_| d.attention != super::DataAttention::Document)
        {
            return Err(bad(
                "data.eos_id",
                id,
                "an end-of-document id tells packed documents apart: set data.attention = \"document\", or leave it out",
            ));
        }
        let e = &self.eval;
        if e.every > 0 && e.path.is_empty() {
            return Err(bad(
                "eval.every",
                e.every,
                "name the held-out files to evaluate on with eval.path (read as [data] reads its own), or set eval.every = 0",
            ));
        }
        if e.every > 0 && e.windows == 0 {
            return Err(bad(
                "eval.windows",
                0,
                "read at least one window an evaluation",
            ));
        }
        for (key, set) in [
            ("data.prompt_field", &d.prompt_field),
            ("data.response_field", &d.response_field),
        ] {
            if let Some(field) = set.as_deref().filter(|_| d.format != DataFormat::Sft) {
                return Err(bad(
                    key,
                    field,
                    "prompt and response fields name a supervised line's parts: set data.format = \"sft\" (--sft), or leave it out",
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `[eval] data` names the held-out files as `[eval] path` does.
    #[test]
    fn eval_data_is_another_name_for_eval_path() {
        let by = |key: &str| {
            TrainConfig::from_toml(&format!("[eval]\nevery = 5\n{key} = \"val.txt\"\n"))
                .unwrap()
                .eval
        };
        assert_eq!(by("data"), by("path"));
        assert_eq!(by("data").path.0, [std::path::PathBuf::from("val.txt")]);
    }

    /// Supervised data needs a tokenizer; its prompt and response fields
    /// mean nothing for other formats.
    #[test]
    fn supervised_data_keys_are_checked_against_the_format() {
        let err = |toml: &str| TrainConfig::from_toml(toml).unwrap_err().to_string();
        let e = err("[data]\npath = \"a.jsonl\"\nformat = \"sft\"\n");
        assert!(
            e.contains("data.format") && e.contains("data.tokenizer"),
            "{e}"
        );
        let e = err(
            "[data]\npath = \"a.jsonl\"\nformat = \"jsonl\"\ntokenizer = \"t\"\nprompt_field = \"q\"\n",
        );
        assert!(
            e.contains("data.prompt_field") && e.contains("--sft"),
            "{e}"
        );
        let ok = "[data]\npath = \"a.jsonl\"\nformat = \"sft\"\ntokenizer = \"t\"\nprompt_field = \"q\"\nresponse_field = \"a\"\n";
        let config = TrainConfig::from_toml(ok).unwrap();
        assert_eq!(
            (config.data.prompt_field(), config.data.response_field()),
            ("q", "a")
        );
    }

    /// `[model] arch` names an architecture of the registry, or the error
    /// lists them; left out, the default; written out, read back.
    #[test]
    fn an_unknown_architecture_in_the_model_table_is_named() {
        let toml = "[model]\narch = \"nope\"\n";
        let err = TrainConfig::from_toml(toml).unwrap_err().to_string();
        assert!(err.contains("arch \"nope\" is not known"), "{err}");
        let config = TrainConfig::from_toml("[model]\nlayers = 2\n").unwrap();
        assert_eq!(config.model.arch.name(), crate::model::default_arch());
        let again = TrainConfig::from_toml(&config.to_toml().unwrap()).unwrap();
        assert_eq!(again, config);
    }

    /// A value of the wrong type or an unknown key is shown with its line
    /// and section (serde's message names neither the key nor the table).
    #[test]
    fn parse_errors_show_the_line_and_its_section() {
        let err = TrainConfig::from_toml("[train]\nsteps = 3\n\n[optim]\nthreads = -1\n")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("at line 5 (`threads = -1`, in [optim])"),
            "{err}"
        );
        let err = TrainConfig::from_toml("[train]\nstepz = 3\n")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("stepz") && err.contains("in [train])"),
            "{err}"
        );
    }

    /// Optimizer and loss-scale values strata-optim refuses are named by
    /// their own `[train]` key and value (not `train = <lr>`), and a scale
    /// whose reciprocal overflows is refused here, not at the first step.
    #[test]
    fn refused_hyperparameters_name_their_own_key_and_value() {
        let text = |edit: &dyn Fn(&mut TrainConfig)| {
            let mut config = TrainConfig::default();
            edit(&mut config);
            config.validate().unwrap_err().to_string()
        };
        type Edit = dyn Fn(&mut TrainConfig);
        let cases: [(&Edit, &str); 6] = [
            (
                &|c| c.train.beta1 = 1.5,
                "train.beta1 = 1.5: beta1 must be in [0, 1)",
            ),
            (&|c| c.train.beta2 = -0.1, "train.beta2 = -0.1"),
            (&|c| c.train.eps = f64::NAN, "train.eps = NaN"),
            (&|c| c.train.weight_decay = -1.0, "train.weight_decay = -1"),
            (
                &|c| c.train.loss_scale = f32::NAN,
                "train.loss_scale = NaN: loss_scale must be",
            ),
            (
                &|c| {
                    c.train.loss_scale = 1e-45;
                    c.train.loss_scale_min = 1e-45;
                },
                "train.loss_scale = 1.401298464324817e-45: loss_scale must be finite and at least 1/f32::MAX",
            ),
        ];
        for (edit, expected) in cases {
            let got = text(edit);
            assert!(got.contains(expected), "{got}");
        }
    }

    /// Budgets the machine cannot give are refused naming the budget, the
    /// memory in GiB and the most that fits; what fits passes.
    #[test]
    fn budgets_past_the_machines_memory_are_refused_with_the_most_that_fits() {
        let gib = 1u64 << 30;
        let mut config = TrainConfig::default();
        config.device.budget = ByteSize(80 * gib);
        config.host.budget = ByteSize(gib);
        let refused = |c: &TrainConfig, gpu: Option<u64>| {
            c.check_machine_with(Some(24 * gib), gpu)
                .unwrap_err()
                .to_string()
        };
        let err = refused(&config, None);
        assert!(
            err.contains("device.budget = 80GiB")
                && err.contains("need 81.00 GiB of memory")
                && err.contains("may take 24.00 GiB")
                && err.contains("set device.budget to at most 23.00 GiB"),
            "{err}"
        );
        config.device.budget = ByteSize(8 * gib);
        config.train.ranks = 4;
        let err = refused(&config, None);
        assert!(
            err.contains("set device.budget to at most 5.00 GiB"),
            "{err}"
        );
        config.train.ranks = 2;
        config.check_machine_with(Some(24 * gib), None).unwrap();
        // Each budget alone takes it all: they are to shrink together.
        let mut both = config.clone();
        both.train.ranks = 1;
        both.device.budget = ByteSize(30 * gib);
        both.host.budget = ByteSize(30 * gib);
        let err = refused(&both, None);
        assert!(
            err.contains("lower them together to at most 24.00 GiB per rank"),
            "{err}"
        );
        config.check_machine_with(None, None).unwrap();
        // On a GPU the device budget is the GPU's; the host's the process's.
        config.device.kind = DeviceChoice::Cuda;
        config.device.budget = ByteSize(200 * gib);
        let err = refused(&config, Some(141 * gib));
        assert!(err.contains("GPU 0 has 141.00 GiB in all"), "{err}");
        // Several ranks on GPUs leave NCCL its room beside the budget.
        config.device.budget = ByteSize(140 * gib + gib / 2);
        let err = refused(&config, Some(141 * gib));
        assert!(
            err.contains(
                "2 ranks on GPUs need 1.00 GiB of it beside the budget for NCCL's buffers"
            ) && err.contains("at most 126.90 GiB"),
            "{err}"
        );
        config.device.budget = ByteSize(100 * gib);
        config.host.budget = ByteSize(20 * gib);
        let err = refused(&config, Some(141 * gib));
        assert!(
            err.contains("set host.budget to at most 12.00 GiB"),
            "{err}"
        );
    }

    /// A tier that does not fit is named with what fills it in GiB and
    /// fixes that would make every tier fit (checked by counting again).
    #[test]
    fn a_tier_that_does_not_fit_names_its_parts_and_fixes_that_fit() {
        let mut config = TrainConfig::default();
        config.host.budget = ByteSize(4 << 20);
        let err = config.validate().unwrap_err().to_string();
        assert!(
            err.contains("the host tier needs at least 6.4 MiB (16-bit parameters (two sets) 3.2 MiB, fp32 gradients")
                && err.contains("raise host.budget to at least 6.4 MiB")
                && err.contains("shard over train.ranks = 2"),
            "{err}"
        );
        let mut fixed = config.clone();
        fixed.host.budget = ByteSize((6.4 * (1 << 20) as f64) as u64 + (64 << 10));
        fixed.validate().unwrap();
        fixed = config.clone();
        fixed.train.ranks = 2;
        fixed.validate().unwrap();
    }

    /// `auto` takes the GPU when one answers and the run can train there,
    /// else the CPU device with the reason; `cpu` and `cuda` stay as asked.
    #[test]
    fn auto_takes_the_gpu_only_when_one_answers_and_the_run_fits_it() {
        let gpu = || Ok(());
        let none = || Err("the CUDA driver reports no device".to_string());
        let mut config = TrainConfig::default();
        config.device.kind = DeviceChoice::Auto;
        let (resolved, why) = config.with_device_resolved_by(gpu);
        assert_eq!((resolved.device.kind, why), (DeviceChoice::Cuda, None));
        let (resolved, why) = config.with_device_resolved_by(none);
        assert_eq!(resolved.device.kind, DeviceChoice::Cpu);
        assert!(why.unwrap().contains("no device"));
        // What CUDA cannot run yet goes to the CPU device, GPU or not.
        let mut ranks = config.clone();
        ranks.train.ranks = 2;
        let (resolved, why) = ranks.with_device_resolved_by(gpu);
        assert_eq!(resolved.device.kind, DeviceChoice::Cpu);
        assert!(why.unwrap().contains("train.ranks"));
        let mut states = config.clone();
        states.placement.optimizer = Placement::Device;
        states.optim.state_dtype = StateDtype::Bf16;
        let (resolved, why) = states.with_device_resolved_by(gpu);
        assert_eq!(resolved.device.kind, DeviceChoice::Cpu);
        assert!(why.unwrap().contains("optim.state_dtype"));
        for kind in [DeviceChoice::Cpu, DeviceChoice::Cuda] {
            config.device.kind = kind;
            let (resolved, why) = config.with_device_resolved_by(none);
            assert_eq!((resolved.device.kind, why), (kind, None));
        }
    }
}
