//! `[placement]` and `[optim]`: where each class of model state lives,
//! how far ahead the plan fetches, the state cache, the optimizer's
//! threads and state dtype.

use serde::{Deserialize, Serialize};
use strata_storage::ByteSize;

pub use strata_scheduler::StateDtype;

use strata_runtime::Tier;

/// Where a class of model state lives between uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Placement {
    /// Device memory.
    Device,
    /// Pinned host memory.
    Cpu,
    /// The NVMe swap store.
    Nvme,
}

impl Placement {
    /// The tier.
    pub fn tier(self) -> Tier {
        match self {
            Placement::Device => Tier::Device,
            Placement::Cpu => Tier::Host,
            Placement::Nvme => Tier::Nvme,
        }
    }

    /// The name a config writes.
    pub fn name(self) -> &'static str {
        match self {
            Placement::Device => "device",
            Placement::Cpu => "cpu",
            Placement::Nvme => "nvme",
        }
    }
}

/// The `[placement]` table: where each class of model state lives, and how
/// far ahead the plan fetches.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PlacementConfig {
    /// bf16 parameter shards (the compute copies).
    pub params: Placement,
    /// fp32 master weights and Adam moments; the optimizer runs on the CPU
    /// unless this is `device`.
    pub optimizer: Placement,
    /// Gradient shards between their reduce-scatter and their update.
    /// Absent: where the optimizer reads them (the host, or the device
    /// with the optimizer there). `"nvme"` (only with `optimizer =
    /// "nvme"`): written to the drive as backward produces them and read
    /// back for the update, for a host budget that cannot hold a step's
    /// gradients (2 or 4 bytes a parameter) - at the price of that traffic.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gradients: Option<Placement>,
    /// Ops the plan may fetch ahead.
    pub prefetch_ops: u32,
    /// Ops ahead of backward that offloaded activations are fetched.
    pub activation_horizon_ops: u32,
    /// Host memory, out of `host.budget`, that keeps the optimizer states a
    /// late update just wrote (the first blocks', as many as fit) until the
    /// next step's update reads them, so that it does not wait for the
    /// drive; their write-backs wait for backward. Only with `optimizer =
    /// "nvme"`. `"auto"`: a quarter of the host budget, or none when the
    /// plans do not fit beside it; `0`: off.
    pub state_cache: StateCache,
}

impl PlacementConfig {
    /// Where the optimizer reads gradients and runs its updates: the
    /// device with its states there, else the host.
    pub fn optimizer_tier(&self) -> Tier {
        match self.optimizer {
            Placement::Device => Tier::Device,
            _ => Tier::Host,
        }
    }

    /// Where the gradient shards live: `gradients`, or where the optimizer
    /// reads them.
    pub fn gradients_tier(&self) -> Tier {
        self.gradients
            .map_or_else(|| self.optimizer_tier(), Placement::tier)
    }
}

/// The `[optim]` table: how the CPU optimizer runs and keeps its states.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OptimConfig {
    /// Threads of each rank's CPU optimizer pool; 0: the physical cores
    /// this process may use less two (left to the kernel-launch thread and
    /// the movers), shared among the ranks, at least one.
    pub threads: u32,
    /// How the optimizer states are kept.
    pub state_dtype: StateDtype,
    /// Seeds the stochastic rounding of bf16 states; absent: `train.seed`.
    /// Runs that differ only here differ only by their rounding, which is
    /// how to measure what rounding noise alone does to a loss curve.
    pub rounding_seed: Option<u64>,
}

impl Default for OptimConfig {
    fn default() -> Self {
        OptimConfig {
            threads: 0,
            state_dtype: StateDtype::Fp32,
            rounding_seed: None,
        }
    }
}

/// [`PlacementConfig::state_cache`]: a size, or `auto`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "SizeOrWord", into = "SizeOrWord")]
pub enum StateCache {
    /// A quarter of the host budget, or none when the plans need it.
    Auto,
    /// This many bytes.
    Bytes(u64),
}

/// How a [`StateCache`] is written: `"auto"`, `"160MiB"` or bytes.
#[derive(Clone, Serialize, Deserialize)]
#[serde(untagged)]
enum SizeOrWord {
    Bytes(u64),
    Text(String),
}

impl TryFrom<SizeOrWord> for StateCache {
    type Error = String;

    fn try_from(value: SizeOrWord) -> std::result::Result<Self, String> {
        match value {
            SizeOrWord::Bytes(bytes) => Ok(StateCache::Bytes(bytes)),
            SizeOrWord::Text(text) if text == "auto" => Ok(StateCache::Auto),
            SizeOrWord::Text(text) => text
                .parse::<ByteSize>()
                .map(|size| StateCache::Bytes(size.0))
                .map_err(|err| format!("placement.state_cache: {err}, or \"auto\"")),
        }
    }
}

impl From<StateCache> for SizeOrWord {
    fn from(cache: StateCache) -> Self {
        match cache {
            StateCache::Auto => SizeOrWord::Text("auto".into()),
            StateCache::Bytes(bytes) => SizeOrWord::Text(ByteSize(bytes).to_string()),
        }
    }
}

impl Default for PlacementConfig {
    fn default() -> Self {
        PlacementConfig {
            params: Placement::Cpu,
            optimizer: Placement::Nvme,
            gradients: None,
            prefetch_ops: 4,
            activation_horizon_ops: 2,
            state_cache: StateCache::Auto,
        }
    }
}
