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

    /// Refuses, by a closed-form count and before anything proportional to
    /// the model is planned or allocated, a model and batch whose rank
    /// cannot fit its tiers: the model states each tier holds between uses
    /// (two bf16 parameter sets, two optimizer-state sets, the fp32
    /// gradient) and, on the device, the least compute workspace (one
    /// block's gathered parameters and gradient, the streams between
    /// blocks). The counts are lower bounds: what passes may still not fit
    /// the plan, which says so with its own numbers. Needs the limits
    /// [`validate`](Self::validate) checks first (they keep every count
    /// within 64 bits; the arithmetic saturates regardless).
    fn check_memory(&self) -> Result<()> {
        let model = self.model.build()?;
        let world = self.train.ranks as u64;
        let groups: Vec<u64> = model.groups().iter().map(|g| g.params() as u64).collect();
        // Every group is cut into `world` equal shards (padded).
        let shard = |params: u64| params.div_ceil(world);
        let shard_params = groups
            .iter()
            .fold(0u64, |sum, &params| sum.saturating_add(shard(params)));
        let state_bytes = self.optim.state_dtype.bytes_per_param() as u64;
        let mut homed = [0u64; 3];
        let mut add = |tier: Tier, bytes_per_param: u64| {
            let bytes = shard_params.saturating_mul(bytes_per_param);
            homed[tier.index()] = homed[tier.index()].saturating_add(bytes);
        };
        add(self.placement.params.tier(), 2 * 2);
        add(self.placement.optimizer.tier(), 2 * state_bytes);
        let grads = if self.placement.optimizer == Placement::Device {
            Tier::Device
        } else {
            Tier::Host
        };
        add(grads, 4);
        let group_max = shard(groups.iter().copied().max().unwrap_or(0)).saturating_mul(world);
        let stream = [self.train.micro_batch, model.seq(), model.stream_width()]
            .iter()
            .fold(1u64, |n, &d| n.saturating_mul(d as u64));
        let in_flight = self.train.in_flight() as u64;
        // Gathered parameters and gradient (fp32), y and dx, and each
        // micro-batch in flight's x and dy (fp32).
        let workspace = group_max
            .saturating_mul(8)
            .saturating_add(stream.saturating_mul(4).saturating_mul(2 + 2 * in_flight));
        let states = format!(
            "{} parameters per rank: bf16 parameters x2 sets on {:?}, {:?} optimizer states x2 on {:?}, fp32 gradients",
            shard_params, self.placement.params, self.optim.state_dtype, self.placement.optimizer
        );
        let device_needed = homed[Tier::Device.index()].saturating_add(workspace);
        if device_needed > self.device.budget.0 {
            return Err(TrainError::Memory {
                what: "the model states placed on the device and the compute workspace".into(),
                tier: "device",
                needed_bytes: device_needed,
                budget_key: "device.budget",
                budget_bytes: self.device.budget.0,
                detail: format!(
                    "{} bytes of model states ({states}) and a workspace of at least {workspace} bytes (one block's gathered fp32 parameters and gradient, {} fp32 activations per stream: micro_batch x seq x hidden)",
                    homed[Tier::Device.index()],
                    stream
                ),
                fix: "raise device.budget, place params or optimizer on cpu or nvme, use more train.ranks, or make the model or train.micro_batch smaller".into(),
            });
        }
        let tiers: [(Tier, &'static str, &'static str, u64); 2] = [
            (Tier::Host, "host", "host.budget", self.host.budget.0),
            (
                Tier::Nvme,
                "nvme",
                "nvme.capacity",
                self.nvme.as_ref().map_or(0, |n| n.capacity.0),
            ),
        ];
        for (tier, name, key, budget) in tiers {
            let needed = homed[tier.index()];
            if needed > budget {
                return Err(TrainError::Memory {
                    what: "the model states placed there".into(),
                    tier: name,
                    needed_bytes: needed,
                    budget_key: key,
                    budget_bytes: budget,
                    detail: states,
                    fix: format!(
                        "raise {key}, place params or optimizer elsewhere, use more train.ranks, or make the model smaller"
                    ),
                });
            }
        }
        Ok(())
    }

    /// What a run on a CUDA device cannot do yet: several ranks (no NCCL
    /// yet), or optimizer states on the device in another dtype than fp32.
    pub(super) fn cuda_constraints(&self) -> Result<()> {
        if let Some(missing) = self.model.build().ok().and_then(|m| m.cuda_missing()) {
            return Err(bad(
                "model.arch",
                self.model.arch,
                format!(
                    "the CUDA backend has no kernels for its {missing} yet: set device.kind = \"cpu\" (\"auto\" picks the CPU for it)"
                ),
            ));
        }
        if self.train.ranks > 1 {
            return Err(bad(
                "train.ranks",
                self.train.ranks,
                "device.kind = \"cuda\" trains one rank for now (collectives between GPUs need NCCL, not built yet): set train.ranks = 1, or device.kind = \"cpu\"",
            ));
        }
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

#[cfg(test)]
mod tests {
    use super::*;

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
