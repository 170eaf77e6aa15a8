//! The device `auto` resolves to, and each rank's runtime tables (its
//! device, host and NVMe budgets, its swap directories).

use strata_storage::ByteSize;

use strata_runtime::{DeviceChoice, DeviceConfig, RuntimeConfig};

use crate::error::Result;
use crate::error::bad;

use super::*;

impl TrainConfig {
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
        let why_not = match self.cuda_constraints() {
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
