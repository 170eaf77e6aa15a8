//! [`RuntimeConfig`]: the `[device]`, `[host]`, `[nvme]` and `[runtime]`
//! settings. Every field has a default; unknown keys are rejected by name.

use serde::{Deserialize, Serialize};
use strata_storage::{ByteSize, StorageConfig};

use crate::error::{Result, RuntimeError};

/// Most size classes in the pinned host pool.
pub const CLASSES_MAX: usize = 8;
/// Most mover threads.
pub const MOVERS_MAX: usize = 64;
/// Alignment of every host buffer size (direct I/O and pages).
pub const HOST_BUFFER_ALIGN_BYTES: u64 = 4096;

/// Which device stands at the top tier.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceChoice {
    /// CUDA when a driver and a device are present, else the CPU device.
    #[default]
    Auto,
    /// A budgeted host arena that stands in for device memory.
    Cpu,
    /// A CUDA device, or an error saying why none can be used.
    Cuda,
}

impl std::str::FromStr for DeviceChoice {
    type Err = String;
    fn from_str(text: &str) -> Result<Self, String> {
        match text {
            "auto" => Ok(DeviceChoice::Auto),
            "cpu" => Ok(DeviceChoice::Cpu),
            "cuda" => Ok(DeviceChoice::Cuda),
            other => Err(format!("unknown device {other:?}: use auto, cpu or cuda")),
        }
    }
}

/// The `[device]` table.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DeviceConfig {
    /// auto, cpu or cuda.
    pub kind: DeviceChoice,
    /// CUDA device ordinal.
    pub ordinal: usize,
    /// Device memory the runtime may use, reserved at start.
    pub budget: ByteSize,
}

impl Default for DeviceConfig {
    fn default() -> Self {
        Self {
            kind: DeviceChoice::Auto,
            ordinal: 0,
            budget: ByteSize(1 << 30),
        }
    }
}

/// One size class of the pinned pool: `bytes` of memory cut into buffers of
/// `buffer_size`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClassConfig {
    /// Size of each buffer (a multiple of 4 KiB).
    pub buffer_size: ByteSize,
    /// Memory of this class (rounded down to whole buffers).
    pub bytes: ByteSize,
}

/// The `[host]` table.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HostConfig {
    /// Pinned host memory, allocated at start. Ignored when `classes` is set.
    pub budget: ByteSize,
    /// Size classes; empty means 1/16 of the budget in 64 KiB buffers, 3/16
    /// in 1 MiB and 12/16 in 16 MiB (scaled down for budgets under 256 MiB).
    pub classes: Vec<ClassConfig>,
    /// Fail at start if the pool cannot be page-locked (otherwise warn and
    /// run unlocked).
    pub require_locked: bool,
}

impl Default for HostConfig {
    fn default() -> Self {
        Self {
            budget: ByteSize(2 << 30),
            classes: Vec::new(),
            require_locked: false,
        }
    }
}

impl HostConfig {
    /// The size classes, smallest buffers first, with `bytes` rounded down to
    /// whole buffers (classes that get no buffer are dropped).
    pub fn resolved_classes(&self) -> Vec<ClassConfig> {
        let mut classes = if self.classes.is_empty() {
            default_classes(self.budget.0)
        } else {
            self.classes.clone()
        };
        classes.sort_by_key(|class| class.buffer_size.0);
        classes
            .into_iter()
            .map(|class| ClassConfig {
                buffer_size: class.buffer_size,
                bytes: ByteSize(class.bytes.0 / class.buffer_size.0 * class.buffer_size.0),
            })
            .filter(|class| class.bytes.0 > 0)
            .collect()
    }

    /// Pool bytes after rounding to whole buffers.
    pub fn pool_bytes(&self) -> u64 {
        self.resolved_classes().iter().map(|c| c.bytes.0).sum()
    }
}

/// 1/16 of the budget in small buffers, 3/16 in medium and 12/16 in large
/// ones: 64 KiB, 1 MiB and 16 MiB for budgets of 256 MiB and more; smaller
/// budgets scale the sizes down so that every class holds several buffers.
fn default_classes(budget: u64) -> Vec<ClassConfig> {
    let large_bytes = budget - budget / 16 * 4;
    let large = prev_power_of_two(large_bytes / 4).clamp(HOST_BUFFER_ALIGN_BYTES, 16 << 20);
    let medium = (large / 16).max(HOST_BUFFER_ALIGN_BYTES);
    let small = (medium / 16).max(HOST_BUFFER_ALIGN_BYTES);
    let mut classes: Vec<ClassConfig> = Vec::with_capacity(3);
    for (size, bytes) in [
        (small, budget / 16),
        (medium, budget / 16 * 3),
        (large, large_bytes),
    ] {
        match classes.iter_mut().find(|c| c.buffer_size.0 == size) {
            Some(class) => class.bytes.0 += bytes,
            None => classes.push(ClassConfig {
                buffer_size: ByteSize(size),
                bytes: ByteSize(bytes),
            }),
        }
    }
    classes
}

fn prev_power_of_two(value: u64) -> u64 {
    if value == 0 {
        0
    } else {
        1 << (63 - value.leading_zeros())
    }
}

/// The `[runtime]` table: limits and threads.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LimitsConfig {
    /// Threads that carry out NVMe moves; each runs one move at a time.
    pub movers: usize,
    /// Of the movers, how many read from NVMe (the others write to it).
    /// One reads in the order the reads were asked for, so the one needed
    /// first lands first rather than sharing the drive with later ones; a
    /// single read keeps the drive's queue full by itself.
    pub read_movers: usize,
    /// How long a mover waits for room held by copies in use or moving
    /// (or split around them) before its move fails with the numbers.
    pub room_wait_ms: u64,
    /// Moves waiting for a mover before `move_to` blocks.
    pub moves_queued_max: usize,
    /// Tensors registered at once.
    pub tensors_max: usize,
    /// Events kept for the Chrome trace (later ones are counted, not kept).
    pub trace_events_max: usize,
    /// Debug mode: every released device range and host buffer is filled
    /// with 0xFF bytes (NaN in f32, bf16 and f16) once its last use has
    /// passed, on the GPU on the host->device copy stream, so that anything
    /// still reading a range after its release reads NaN (a missed fence
    /// turns into a NaN loss instead of a silently wrong one). Costs a fill
    /// per release; off by default.
    pub poison_released: bool,
}

impl Default for LimitsConfig {
    fn default() -> Self {
        Self {
            movers: 4,
            read_movers: 1,
            room_wait_ms: 5000,
            moves_queued_max: 1024,
            tensors_max: 1 << 20,
            trace_events_max: 1 << 16,
            poison_released: false,
        }
    }
}

/// All of the runtime's settings.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RuntimeConfig {
    /// The top tier.
    pub device: DeviceConfig,
    /// Pinned host pools.
    pub host: HostConfig,
    /// The NVMe tier; absent means no NVMe tier (host spills fail).
    pub nvme: Option<StorageConfig>,
    /// Limits and threads.
    pub runtime: LimitsConfig,
}

/// A [`RuntimeError::Config`] naming the key, its value and the fix.
pub(crate) fn bad(key: &'static str, value: impl ToString, fix: impl Into<String>) -> RuntimeError {
    RuntimeError::Config {
        key,
        value: value.to_string(),
        fix: fix.into(),
    }
}

impl RuntimeConfig {
    /// Checks ranges and the relations between fields.
    pub fn validate(&self) -> Result<()> {
        if self.device.budget.0 == 0 {
            return Err(bad(
                "device.budget",
                self.device.budget,
                "use at least 1 MiB",
            ));
        }
        let classes = self.host.resolved_classes();
        if classes.is_empty() {
            return Err(bad(
                "host.budget",
                self.host.budget,
                "the pinned pool holds no buffer: use at least 64 KiB (or one buffer per class)",
            ));
        }
        if classes.len() > CLASSES_MAX {
            return Err(bad(
                "host.classes",
                classes.len(),
                format!("use at most {CLASSES_MAX} size classes"),
            ));
        }
        for class in &classes {
            if class.buffer_size.0 == 0
                || !class.buffer_size.0.is_multiple_of(HOST_BUFFER_ALIGN_BYTES)
            {
                return Err(bad(
                    "host.classes.buffer_size",
                    class.buffer_size,
                    "use a non-zero multiple of 4 KiB",
                ));
            }
        }
        for pair in classes.windows(2) {
            if pair[0].buffer_size == pair[1].buffer_size {
                return Err(bad(
                    "host.classes.buffer_size",
                    pair[0].buffer_size,
                    "each size class needs its own buffer size",
                ));
            }
        }
        if let Some(nvme) = &self.nvme {
            nvme.validate()?;
        }
        let limits = &self.runtime;
        if limits.movers < 2 || limits.movers > MOVERS_MAX {
            return Err(bad(
                "runtime.movers",
                limits.movers,
                format!("use 2..={MOVERS_MAX} (at least one reads from NVMe, one writes)"),
            ));
        }
        if limits.read_movers == 0 || limits.read_movers >= limits.movers {
            return Err(bad(
                "runtime.read_movers",
                limits.read_movers,
                format!(
                    "use 1..={} (fewer than runtime.movers = {}: the others write)",
                    limits.movers - 1,
                    limits.movers
                ),
            ));
        }
        for (key, value) in [
            ("runtime.moves_queued_max", limits.moves_queued_max),
            ("runtime.tensors_max", limits.tensors_max),
        ] {
            if value == 0 {
                return Err(bad(key, value, "use at least 1"));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_classes_split_the_budget() {
        let host = HostConfig {
            budget: ByteSize(1 << 30),
            ..Default::default()
        };
        let classes = host.resolved_classes();
        assert_eq!(classes.len(), 3);
        assert_eq!(classes[0].buffer_size.0, 64 << 10);
        assert_eq!(host.pool_bytes(), 1 << 30);
    }

    #[test]
    fn readme_config_parses() {
        let text = r#"
[device]
kind = "cuda"
budget = "70GiB"
[host]
classes = [{ buffer_size = "16MiB", bytes = "200GiB" }, { buffer_size = "1MiB", bytes = "48GiB" }]
[nvme]
dirs = ["/mnt/nvme0"]
capacity = "2TiB"
[runtime]
movers = 4
"#;
        let config: RuntimeConfig = toml::from_str(text).unwrap();
        assert_eq!(config.device.kind, DeviceChoice::Cuda);
        assert_eq!(config.host.pool_bytes(), 248 << 30);
        assert_eq!(config.nvme.unwrap().capacity.0, 2 << 40);
    }

    #[test]
    fn unknown_keys_are_named() {
        let err = toml::from_str::<RuntimeConfig>("[host]\nbudgett = \"1GiB\"\n").unwrap_err();
        assert!(err.to_string().contains("budgett"), "{err}");
    }

    #[test]
    fn movers_split_into_readers_and_writers_or_are_refused_by_name() {
        let with = |movers, read_movers| RuntimeConfig {
            runtime: LimitsConfig {
                movers,
                read_movers,
                ..Default::default()
            },
            ..Default::default()
        };
        assert!(with(4, 1).validate().is_ok());
        assert!(with(2, 1).validate().is_ok());
        for (movers, readers, key) in [
            (1, 1, "runtime.movers"),
            (4, 0, "runtime.read_movers"),
            (4, 4, "runtime.read_movers"),
        ] {
            let err = with(movers, readers).validate().unwrap_err().to_string();
            assert!(err.contains(key), "{movers}/{readers}: {err}");
        }
    }

    #[test]
    fn tiny_budgets_scale_buffer_sizes() {
        let host = HostConfig {
            budget: ByteSize(1 << 20),
            ..Default::default()
        };
        let sizes: Vec<u64> = host
            .resolved_classes()
            .iter()
            .map(|c| c.buffer_size.0)
            .collect();
        assert_eq!(sizes, vec![4 << 10, 8 << 10, 128 << 10]);
        assert_eq!(host.pool_bytes(), 1 << 20);
        assert!(
            RuntimeConfig {
                host,
                ..Default::default()
            }
            .validate()
            .is_ok()
        );
    }
}
