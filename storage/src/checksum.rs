//! [`checksum`]: the per-chunk checksum, a leaf that the store (which records
//! one per chunk written) and the service (which verifies reads against it)
//! both use.

/// The checksum of one chunk (xxh3, 64 bits).
pub fn checksum(data: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(data)
}
