//! The three tiers, the links between neighbouring tiers, and what a tensor is.

use serde::{Deserialize, Serialize};

/// Where a copy of a tensor lives. Ordered from fastest to largest.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Tier {
    /// Device memory (GPU HBM, or the CPU device's budgeted arena).
    Device = 0,
    /// Pinned host RAM, in pools of fixed-size buffers.
    Host = 1,
    /// The NVMe swap store.
    Nvme = 2,
}

impl Tier {
    /// Every tier, fastest first.
    pub const ALL: [Tier; 3] = [Tier::Device, Tier::Host, Tier::Nvme];

    /// Position in [`Tier::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }

    /// The next larger, slower tier (where spills go).
    pub fn below(self) -> Option<Tier> {
        match self {
            Tier::Device => Some(Tier::Host),
            Tier::Host => Some(Tier::Nvme),
            Tier::Nvme => None,
        }
    }

    /// The next faster tier.
    pub fn above(self) -> Option<Tier> {
        match self {
            Tier::Device => None,
            Tier::Host => Some(Tier::Device),
            Tier::Nvme => Some(Tier::Host),
        }
    }

    /// Lower-case name, as in configs and reports.
    pub fn name(self) -> &'static str {
        match self {
            Tier::Device => "device",
            Tier::Host => "host",
            Tier::Nvme => "nvme",
        }
    }
}

impl std::fmt::Display for Tier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A direction between two neighbouring tiers. Every transfer uses one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Link {
    /// Pinned host buffer to the swap store.
    #[serde(rename = "host->nvme")]
    HostToNvme,
    /// Swap store to pinned host buffer (checksums verified).
    #[serde(rename = "nvme->host")]
    NvmeToHost,
    /// Pinned host buffer to device memory.
    #[serde(rename = "host->device")]
    HostToDevice,
    /// Device memory to pinned host buffer.
    #[serde(rename = "device->host")]
    DeviceToHost,
}

impl Link {
    /// Every link.
    pub const ALL: [Link; 4] = [
        Link::HostToNvme,
        Link::NvmeToHost,
        Link::HostToDevice,
        Link::DeviceToHost,
    ];

    /// The link between two neighbouring tiers.
    pub fn between(source: Tier, target: Tier) -> Link {
        match (source, target) {
            (Tier::Host, Tier::Nvme) => Link::HostToNvme,
            (Tier::Nvme, Tier::Host) => Link::NvmeToHost,
            (Tier::Host, Tier::Device) => Link::HostToDevice,
            (Tier::Device, Tier::Host) => Link::DeviceToHost,
            _ => panic!("no link from {source} to {target}: tiers are not neighbours"),
        }
    }

    /// Position in [`Link::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }

    /// Name as in reports and traces ("host->nvme").
    pub fn name(self) -> &'static str {
        match self {
            Link::HostToNvme => "host->nvme",
            Link::NvmeToHost => "nvme->host",
            Link::HostToDevice => "host->device",
            Link::DeviceToHost => "device->host",
        }
    }
}

impl std::fmt::Display for Link {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

pub use strata_device::Dtype;

/// What a tensor is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TensorKind {
    /// A parameter (or a shard of one).
    Param,
    /// A gradient.
    Grad,
    /// An optimizer state (master weights, moments).
    OptimizerState,
    /// An activation saved for backward.
    Activation,
}

/// Which part of the model a tensor belongs to.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Owner {
    /// Layer (block) index.
    pub layer: u32,
    /// Shard index (data-parallel rank that owns it).
    pub shard: u32,
}

/// Everything the registry knows about a tensor apart from where it is.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorMeta {
    /// Human-readable name, used in errors and traces.
    pub name: String,
    /// What it is for.
    pub kind: TensorKind,
    /// Element type.
    pub dtype: Dtype,
    /// Dimensions.
    pub shape: Vec<u64>,
    /// Layer and shard.
    pub owner: Owner,
}

impl TensorMeta {
    /// A tensor with owner layer 0, shard 0.
    pub fn new(name: impl Into<String>, kind: TensorKind, dtype: Dtype, shape: &[u64]) -> Self {
        Self {
            name: name.into(),
            kind,
            dtype,
            shape: shape.to_vec(),
            owner: Owner::default(),
        }
    }

    /// Elements (product of the shape; 1 for a scalar).
    pub fn elements(&self) -> u64 {
        self.shape.iter().product()
    }

    /// Bytes of its data.
    pub fn len_bytes(&self) -> u64 {
        self.elements() * self.dtype.bytes()
    }
}

/// A registered tensor. Plain data: ids are never reused within a runtime.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct TensorId(pub u64);

impl std::fmt::Display for TensorId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "#{}", self.0)
    }
}
