//! [`StorageConfig`]: the `[storage]` table of a strata config file.

use std::path::PathBuf;

use crate::engine::{EngineKind, probe_uring};
use crate::error::{Result, StorageError};
use crate::size::ByteSize;

/// Most requests in flight per ring.
pub const QUEUE_DEPTH_MAX: usize = 4096;
/// Most rings (I/O threads) per store.
pub const RINGS_MAX: usize = 64;
/// Largest single request (the kernel caps one transfer below 2 GiB).
pub const BLOCK_BYTES_MAX: u64 = 256 << 20;
/// Most swap directories (drives) one store stripes over.
pub const DIRS_MAX: usize = 64;

/// Which engine a store runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EngineChoice {
    /// io_uring if the probe passes, else threads (the reason is logged).
    #[default]
    Auto,
    /// io_uring, or an error saying why it cannot run.
    Uring,
    /// The pread/pwrite thread pool.
    Threads,
}

impl EngineChoice {
    /// Settles `Auto` by probing; logs which engine runs and why.
    pub fn resolve(self) -> Result<EngineKind> {
        match self {
            EngineChoice::Threads => Ok(EngineKind::Threads),
            EngineChoice::Uring => probe_uring()
                .map(|()| EngineKind::Uring)
                .map_err(|reason| StorageError::UringUnavailable { reason }),
            EngineChoice::Auto => match probe_uring() {
                Ok(()) => {
                    tracing::debug!("engine: uring (io_uring probe passed)");
                    Ok(EngineKind::Uring)
                }
                Err(reason) => {
                    tracing::info!("engine: threads, because io_uring is unavailable: {reason}");
                    Ok(EngineKind::Threads)
                }
            },
        }
    }
}

impl std::str::FromStr for EngineChoice {
    type Err = String;
    fn from_str(text: &str) -> Result<Self, String> {
        match text {
            "auto" => Ok(EngineChoice::Auto),
            "uring" | "io_uring" => Ok(EngineChoice::Uring),
            "threads" => Ok(EngineChoice::Threads),
            other => Err(format!(
                "unknown engine {other:?}: use auto, uring or threads"
            )),
        }
    }
}

/// Settings of the NVMe tier. Every field has a default; unknown keys are
/// rejected by name when parsed from TOML.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StorageConfig {
    /// Swap directories, one per drive; large extents stripe across them.
    pub dirs: Vec<PathBuf>,
    /// Swap capacity over all directories, preallocated at start.
    pub capacity: ByteSize,
    /// auto, uring or threads.
    pub engine: EngineChoice,
    /// Size of one request, and of one checksummed chunk.
    pub block_size: ByteSize,
    /// Requests in flight per ring.
    pub queue_depth: usize,
    /// Rings, each on its own thread.
    pub rings: usize,
    /// Bytes placed on one directory before moving to the next.
    pub stripe_size: ByteSize,
    /// Bound on EAGAIN resubmissions of one request.
    pub retries_max: u32,
    /// Most live extents.
    pub extents_max: usize,
    /// Create missing `dirs` (`strata train` does; off, a missing
    /// directory is an error, so that swap never lands on whatever disk
    /// holds its parent because of a typo or an unmounted drive).
    pub create_dirs: bool,
}

impl Default for StorageConfig {
    fn default() -> Self {
        Self {
            dirs: vec![PathBuf::from("strata-swap")],
            capacity: ByteSize(4 << 30),
            engine: EngineChoice::Auto,
            block_size: ByteSize(1 << 20),
            queue_depth: 32,
            rings: 1,
            stripe_size: ByteSize(1 << 20),
            retries_max: crate::queue::RETRIES_MAX_DEFAULT,
            extents_max: 1 << 20,
            create_dirs: false,
        }
    }
}

fn bad(key: &'static str, value: impl ToString, fix: impl Into<String>) -> StorageError {
    StorageError::Config {
        key,
        value: value.to_string(),
        fix: fix.into(),
    }
}

impl StorageConfig {
    /// Checks ranges and the relations between fields.
    pub fn validate(&self) -> Result<()> {
        if self.dirs.is_empty() || self.dirs.len() > DIRS_MAX {
            return Err(bad(
                "dirs",
                self.dirs.len(),
                format!("give 1 to {DIRS_MAX} directories"),
            ));
        }
        if !(1..=QUEUE_DEPTH_MAX).contains(&self.queue_depth) {
            return Err(bad(
                "queue_depth",
                self.queue_depth,
                format!("use 1 to {QUEUE_DEPTH_MAX}"),
            ));
        }
        if !(1..=RINGS_MAX).contains(&self.rings) {
            return Err(bad("rings", self.rings, format!("use 1 to {RINGS_MAX}")));
        }
        let block = self.block_size.0;
        if block == 0 || !block.is_multiple_of(4096) || block > BLOCK_BYTES_MAX {
            return Err(bad(
                "block_size",
                self.block_size,
                format!("use a multiple of 4KiB up to {}", ByteSize(BLOCK_BYTES_MAX)),
            ));
        }
        if self.stripe_size.0 == 0 || !self.stripe_size.0.is_multiple_of(block) {
            return Err(bad(
                "stripe_size",
                self.stripe_size,
                format!("use a multiple of block_size ({})", self.block_size),
            ));
        }
        let per_dir = self.capacity.0.div_ceil(self.dirs.len() as u64);
        if per_dir < self.stripe_size.0 {
            return Err(bad(
                "capacity",
                self.capacity,
                format!(
                    "use at least stripe_size x dirs = {}",
                    ByteSize(self.stripe_size.0 * self.dirs.len() as u64)
                ),
            ));
        }
        if self.extents_max == 0 {
            return Err(bad("extents_max", 0, "use at least 1"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_keys_are_named() {
        let err = toml::from_str::<StorageConfig>("queue_depht = 8")
            .unwrap_err()
            .to_string();
        assert!(err.contains("queue_depht"), "{err}");
    }

    #[test]
    fn sizes_parse_from_strings_and_numbers() {
        let config: StorageConfig =
            toml::from_str("block_size = \"128KiB\"\nstripe_size = 262144\ncapacity = \"1GiB\"")
                .unwrap();
        assert_eq!(config.block_size, ByteSize(128 << 10));
        assert_eq!(config.stripe_size, ByteSize(256 << 10));
        config.validate().unwrap();
    }

    #[test]
    fn inconsistent_settings_say_what_to_change() {
        let config = StorageConfig {
            stripe_size: ByteSize(3 << 20),
            block_size: ByteSize(2 << 20),
            ..Default::default()
        };
        let err = config.validate().unwrap_err().to_string();
        assert!(
            err.contains("stripe_size") && err.contains("multiple of block_size"),
            "{err}"
        );
        let config = StorageConfig {
            queue_depth: 0,
            ..Default::default()
        };
        assert!(
            config
                .validate()
                .unwrap_err()
                .to_string()
                .contains("queue_depth")
        );
    }
}
