//! [`Tier`]: where a copy of a tensor lives. A leaf: the error type and the
//! trace both name tiers (the trace re-exports it).

use serde::Serialize;

/// Where a copy of a tensor lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Tier {
    /// GPU memory.
    Device,
    /// Pinned host RAM.
    Host,
    /// The NVMe swap store.
    Nvme,
}

impl Tier {
    /// All tiers, fastest first; `ALL[t.index()] == t`.
    pub const ALL: [Tier; 3] = [Tier::Device, Tier::Host, Tier::Nvme];

    /// 0, 1, 2 from fastest to slowest.
    pub fn index(self) -> usize {
        self as usize
    }

    /// The bit of this tier in a copy mask.
    pub fn bit(self) -> u8 {
        1 << self.index()
    }

    /// The next tier down, if any.
    pub fn below(self) -> Option<Tier> {
        match self {
            Tier::Device => Some(Tier::Host),
            Tier::Host => Some(Tier::Nvme),
            Tier::Nvme => None,
        }
    }

    /// The next tier up, if any.
    pub fn above(self) -> Option<Tier> {
        match self {
            Tier::Device => None,
            Tier::Host => Some(Tier::Device),
            Tier::Nvme => Some(Tier::Host),
        }
    }

    /// The neighbour of this tier in the direction of `target` (itself
    /// when it is `target`).
    pub fn toward(self, target: Tier) -> Tier {
        match self.index().cmp(&target.index()) {
            std::cmp::Ordering::Greater => {
                self.above().expect("a tier below another has one above")
            }
            std::cmp::Ordering::Less => self.below().expect("a tier above another has one below"),
            std::cmp::Ordering::Equal => self,
        }
    }
}

impl std::fmt::Display for Tier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Tier::Device => "device",
            Tier::Host => "host",
            Tier::Nvme => "nvme",
        })
    }
}
