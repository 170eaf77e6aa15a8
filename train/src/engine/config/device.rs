//! The device `auto` resolves to, and each rank's runtime tables (its
//! device, host and NVMe budgets, its swap directories).

use strata_storage::ByteSize;

use strata_runtime::{DeviceChoice, DeviceConfig, RuntimeConfig};

use crate::error::Result;
use crate::error::bad;

use super::*;

/// The share of a GPU's memory a machine-sized config gives the device.
const DEVICE_SHARE_GPU: f64 = 0.9;

/// Device memory a GPU keeps beside `device.budget` for NCCL's own
/// buffers when several ranks run on GPUs (its channels' FIFOs and
/// proxies: hundreds of MiB a communicator, a few with hybrid sharding).
const NCCL_DEVICE_RESERVE_BYTES: u64 = 1 << 30;
/// The shares of the memory the process may take that a machine-sized
/// config gives the CPU device and the pinned host pool.
const DEVICE_SHARE_CPU: f64 = 0.25;
const HOST_SHARE: f64 = 0.5;
/// The least budget a machine-sized config gives a tier.
const MACHINE_BUDGET_MIN: u64 = 256 << 20;

impl TrainConfig {
    /// This config with `device.kind = "auto"` and budgets sized for this
    /// machine instead of the small demo's (what `strata train --deepspeed`
    /// without `--config` runs with, as DeepSpeed takes the machine it
    /// runs on): `device.budget` 90% of the GPU's memory, or, without a
    /// GPU, up to a quarter of the memory this process may take;
    /// `host.budget` up to half of it. The pinned pool is committed whole,
    /// so without a GPU each budget is also held to twice what the
    /// closed-form count says the run needs there (at least 256 MiB).
    /// Also what was read and chosen, for a log line.
    pub fn with_budgets_for_this_machine(&self) -> Result<(TrainConfig, String)> {
        let mut config = self.clone();
        config.device.kind = DeviceChoice::Auto;
        let needs = self.tier_needs()?;
        let need = |tier: strata_runtime::Tier| -> f64 {
            let bytes = needs[tier.index()]
                .iter()
                .fold(0u64, |sum, (_, b)| sum.saturating_add(*b));
            (2 * bytes).max(MACHINE_BUDGET_MIN) as f64
        };
        let mib = |bytes: f64| ByteSize((bytes as u64) & !((1 << 20) - 1));
        let available = strata_storage::sys::mem_available_bytes();
        let gpu = match config.with_device_resolved().0.device.kind {
            DeviceChoice::Cuda => {
                strata_device::cuda::device_total_bytes(config.device.ordinal).ok()
            }
            _ => None,
        };
        let mut said = Vec::new();
        match (gpu, available) {
            (Some(total), _) => {
                config.device.budget = mib(total as f64 * DEVICE_SHARE_GPU);
                said.push(format!(
                    "device.budget = {} ({:.0}% of GPU {}'s {})",
                    config.device.budget,
                    DEVICE_SHARE_GPU * 100.0,
                    config.device.ordinal,
                    strata_scheduler::gib(total)
                ));
            }
            (None, Some(bytes)) => {
                config.device.budget =
                    mib((bytes as f64 * DEVICE_SHARE_CPU).min(need(strata_runtime::Tier::Device)));
                said.push(format!(
                    "device.budget = {} (the CPU device: twice the count's need, at most a quarter of the {} this process may take)",
                    config.device.budget,
                    strata_scheduler::gib(bytes)
                ));
            }
            (None, None) => {}
        }
        if let Some(bytes) = available {
            let share = bytes as f64 * HOST_SHARE;
            config.host.budget = mib(match gpu {
                Some(_) => share,
                None => share.min(need(strata_runtime::Tier::Host)),
            });
            said.push(format!(
                "host.budget = {} (at most half of the {} this process may take)",
                config.host.budget,
                strata_scheduler::gib(bytes)
            ));
        }
        Ok((config, said.join(", ")))
    }

    /// Refuses, before anything is allocated, budgets this machine cannot
    /// give (a resolved config: `device.kind` is `cpu` or `cuda`): on the
    /// CPU device every rank's device and host budgets come from the
    /// memory this process may take; on a GPU the device budget from the
    /// GPU's memory and the host budgets from the process's.
    pub fn check_machine(&self) -> Result<()> {
        self.check_machine_with(
            strata_storage::sys::mem_available_bytes(),
            strata_device::cuda::device_total_bytes(self.device.ordinal).ok(),
        )
    }

    /// [`TrainConfig::check_machine`] with the memory the process may take
    /// and the GPU's, as read.
    pub(crate) fn check_machine_with(
        &self,
        available: Option<u64>,
        gpu: Option<u64>,
    ) -> Result<()> {
        let gib = strata_scheduler::gib;
        let ranks = self.train.ranks as u64;
        if self.device.kind == DeviceChoice::Cuda
            && let Some(total) = gpu
            && self.device.budget.0 > total
        {
            return Err(bad(
                "device.budget",
                self.device.budget,
                format!(
                    "GPU {} has {} in all: set device.budget to at most {} (leave room for the CUDA context), or \"auto\" sizing with --deepspeed",
                    self.device.ordinal,
                    gib(total),
                    gib((total as f64 * DEVICE_SHARE_GPU) as u64)
                ),
            ));
        }
        if self.device.kind == DeviceChoice::Cuda
            && ranks > 1
            && let Some(total) = gpu
            && self.device.budget.0 > total.saturating_sub(NCCL_DEVICE_RESERVE_BYTES)
        {
            return Err(bad(
                "device.budget",
                self.device.budget,
                format!(
                    "GPU {} has {} in all, and {ranks} ranks on GPUs need {} of it beside the budget for NCCL's buffers: set device.budget to at most {}",
                    self.device.ordinal,
                    gib(total),
                    gib(NCCL_DEVICE_RESERVE_BYTES),
                    gib(((total as f64 * DEVICE_SHARE_GPU) as u64)
                        .min(total.saturating_sub(NCCL_DEVICE_RESERVE_BYTES)))
                ),
            ));
        }
        let Some(available) = available else {
            return Ok(());
        };
        let cpu = self.device.kind == DeviceChoice::Cpu;
        let per_rank = self.host.budget.0 + if cpu { self.device.budget.0 } else { 0 };
        let needed = per_rank.saturating_mul(ranks);
        if needed <= available {
            return Ok(());
        }
        let (key, value) = if cpu && self.device.budget.0 >= self.host.budget.0 {
            ("device.budget", self.device.budget)
        } else {
            ("host.budget", self.host.budget)
        };
        let other = per_rank - value.0;
        let most = (available / ranks).saturating_sub(other);
        // What the budgets come to, against what the machine gives.
        let asked = format!(
            "{ranks} rank(s) x ({}host.budget {}) need {} of memory, and this process may take {} (MemAvailable, its cgroup's limit, ulimit -v)",
            if cpu {
                format!("device.budget {} on the CPU device + ", self.device.budget)
            } else {
                String::new()
            },
            self.host.budget,
            gib(needed),
            gib(available),
        );
        let fix = if most < (64 << 20) {
            // The other budget alone takes (nearly) all of it.
            format!(
                "lower them together to at most {} per rank{}",
                gib(available / ranks),
                if ranks > 1 {
                    ", or train fewer ranks"
                } else {
                    ""
                }
            )
        } else {
            format!(
                "set {key} to at most {}{}",
                gib(most),
                if cpu {
                    " (on the CPU device, the device's memory is this machine's too)"
                } else {
                    ""
                }
            )
        };
        Err(bad(key, value, format!("{asked}: {fix}")))
    }

    /// This config with `device.kind = "auto"` made `cuda` or `cpu`: the
    /// GPU when a driver and a device answer and the run can train there
    /// ([`TrainConfig::cuda_constraints`]), else the CPU device, with the
    /// reason (`None` when nothing was decided or the GPU was taken). The
    /// engine still goes to the CPU device when the GPU's backend does not
    /// open (an architecture strata does not compile for, no cuBLASLt or
    /// NVRTC, a bad ordinal).
    pub fn with_device_resolved(&self) -> (TrainConfig, Option<String>) {
        self.with_device_resolved_by(strata_device::cuda::probe_device)
    }

    /// [`TrainConfig::with_device_resolved`] with `probe` telling whether a
    /// GPU answers (and why not).
    pub(crate) fn with_device_resolved_by(
        &self,
        probe: impl FnOnce() -> std::result::Result<(), String>,
    ) -> (TrainConfig, Option<String>) {
        let mut resolved = self.clone();
        if self.device.kind != DeviceChoice::Auto {
            return (resolved, None);
        }
        let why_not = match self
            .cuda_constraints()
            .and_then(|()| self.gpu_ranks_as_threads())
        {
            Err(err) => Some(err.to_string()),
            Ok(()) => probe().err(),
        };
        resolved.device.kind = match why_not {
            None => DeviceChoice::Cuda,
            Some(_) => DeviceChoice::Cpu,
        };
        (resolved, why_not)
    }

    /// Rank `rank`'s runtime settings with `workspace_bytes` of the device
    /// budget held for compute buffers (the rest is the tier the plan
    /// uses); each rank swaps to its own subdirectory.
    pub fn rank_runtime(&self, rank: usize, workspace_bytes: u64) -> Result<RuntimeConfig> {
        let device_budget = self.device.budget.0;
        if device_budget == 0 {
            return Err(bad(
                "device.budget",
                self.device.budget,
                "the device needs room for the compute workspace (one block's activations, gathered parameters and gradients) and the tensors the plan places there: give it a size, e.g. \"256MiB\"",
            ));
        }
        if workspace_bytes >= device_budget {
            return Err(bad(
                "device.budget",
                self.device.budget,
                format!(
                    "the compute workspace alone needs {workspace_bytes} bytes (one block's activations, gathered parameters and gradients): raise device.budget above that, or lower train.micro_batch or model.seq"
                ),
            ));
        }
        let nvme = self
            .nvme
            .clone()
            .filter(|_| self.uses_nvme())
            .map(|mut nvme| {
                nvme.dirs = nvme
                    .dirs
                    .iter()
                    .map(|d| d.join(format!("rank{rank}")))
                    .collect();
                nvme
            });
        let mut host = self.host.clone();
        if host.classes.is_empty() {
            // Shards are megabytes, not powers of two: one class of 256 KiB
            // buffers (also the NVMe request size) wastes at most that per
            // tensor, where size classes would run one class dry.
            host.classes = vec![strata_runtime::ClassConfig {
                buffer_size: ByteSize(HOST_BUFFER_BYTES),
                bytes: ByteSize(host.budget.0 / HOST_BUFFER_BYTES * HOST_BUFFER_BYTES),
            }];
        }
        Ok(RuntimeConfig {
            device: DeviceConfig {
                budget: ByteSize(device_budget - workspace_bytes),
                // The engine resolves `auto` first
                // (`with_device_resolved`); left unresolved, the CPU device.
                kind: match self.device.kind {
                    DeviceChoice::Cuda => DeviceChoice::Cuda,
                    DeviceChoice::Cpu | DeviceChoice::Auto => DeviceChoice::Cpu,
                },
                ..self.device.clone()
            },
            host,
            nvme,
            runtime: self.runtime.clone(),
        })
    }
}
