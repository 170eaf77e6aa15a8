//! Which window each sample of a run reads, in the epoch order: every
//! window once per epoch, in an order shuffled by the seed and the epoch.
//!
//! The shuffle is a keyed bijection computed per index (a Feistel network
//! over the smallest power-of-four domain that holds the windows, walked
//! back into range), so it needs no table of windows, allocates nothing
//! and gives any sample's window in constant time: a rank reads its slice
//! of a step without knowing the others', and a run resumed at sample `s`
//! reads exactly what the uninterrupted run read from `s` on.

/// Rounds of the network: 4 make a pseudorandom permutation of the domain
/// (Luby-Rackoff); two more for margin on small domains.
const ROUNDS: usize = 6;

/// A permutation of `0..n` keyed by a seed and an epoch.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Shuffle {
    n: u64,
    /// Bits of each half of a domain index.
    half_bits: u32,
    keys: [u64; ROUNDS],
}

impl Shuffle {
    /// The order of epoch `epoch` of `n` windows (`n` at least 1).
    pub(crate) fn new(n: u64, seed: u64, epoch: u64) -> Shuffle {
        assert!(n > 0, "a shuffle of no windows");
        let bits = u64::BITS - (n - 1).leading_zeros();
        let mut keys = [0; ROUNDS];
        for (round, key) in keys.iter_mut().enumerate() {
            *key = super::mix(seed, epoch, round as u64);
        }
        Shuffle {
            n,
            half_bits: bits.div_ceil(2),
            keys,
        }
    }

    /// The window at position `i` of the epoch.
    pub(crate) fn at(&self, i: u64) -> u64 {
        assert!(i < self.n, "position {i} of an epoch of {}", self.n);
        // Cycle walking: the network permutes the whole domain, and
        // following it from a position in range until it lands in range
        // again permutes the range (the domain is under 4n, so a few
        // rounds on average).
        let mut x = i;
        loop {
            x = self.network(x);
            if x < self.n {
                return x;
            }
        }
    }

    fn network(&self, x: u64) -> u64 {
        let mask = (1u64 << self.half_bits) - 1;
        let (mut left, mut right) = (x >> self.half_bits, x & mask);
        for key in self.keys {
            let next = left ^ (finalize(right ^ key) & mask);
            left = right;
            right = next;
        }
        (left << self.half_bits) | right
    }
}

/// SplitMix64's finalizer.
pub(super) fn finalize(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Where sample `sample` of a run (numbered from 0 across every step,
/// micro-batch and rank) falls: its epoch and its window.
pub(crate) fn epoch_window(seed: u64, sample: u64, windows: u64) -> (u64, u64) {
    let (epoch, position) = (sample / windows, sample % windows);
    (epoch, Shuffle::new(windows, seed, epoch).at(position))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn epoch(n: u64, seed: u64, epoch: u64) -> Vec<u64> {
        let shuffle = Shuffle::new(n, seed, epoch);
        (0..n).map(|i| shuffle.at(i)).collect()
    }

    #[test]
    fn every_epoch_is_a_permutation_of_the_windows() {
        for n in [1, 2, 3, 4, 5, 7, 16, 17, 100, 1000, 4097, 65_537] {
            for e in 0..3 {
                let mut order = epoch(n, 42, e);
                order.sort_unstable();
                assert!(
                    order.iter().copied().eq(0..n),
                    "epoch {e} of {n} windows is not a permutation"
                );
            }
        }
    }

    #[test]
    fn epochs_and_seeds_shuffle_differently_and_each_repeats_itself() {
        let n = 1000;
        let first = epoch(n, 7, 0);
        assert_eq!(first, epoch(n, 7, 0));
        assert_ne!(first, epoch(n, 7, 1), "another epoch, another order");
        assert_ne!(first, epoch(n, 8, 0), "another seed, another order");
        assert_ne!(first, (0..n).collect::<Vec<_>>(), "shuffled");
        // Shuffled well enough that neighbours do not stay neighbours:
        // of 999 adjacent pairs, few are adjacent windows.
        let adjacent = first
            .windows(2)
            .filter(|w| w[0].abs_diff(w[1]) == 1)
            .count();
        assert!(adjacent < 20, "{adjacent} adjacent pairs");
    }

    #[test]
    fn samples_run_through_epochs_in_order() {
        let n = 37;
        let seen: Vec<(u64, u64)> = (0..3 * n).map(|s| epoch_window(5, s, n)).collect();
        for e in 0..3 {
            let mut windows: Vec<u64> = seen[(e * n) as usize..][..n as usize]
                .iter()
                .map(|&(epoch, window)| {
                    assert_eq!(epoch, e);
                    window
                })
                .collect();
            windows.sort_unstable();
            assert!(windows.into_iter().eq(0..n));
        }
    }
}
