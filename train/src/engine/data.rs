//! Byte-level training data: a text, and which windows of it each step,
//! micro-batch and rank reads (a function of the seed and the step alone,
//! so a resumed run reads what an uninterrupted one would).

use crate::error::Result;
use crate::error::bad;

/// A text as byte tokens (vocabulary 256).
#[derive(Clone, Debug)]
pub struct ByteCorpus {
    bytes: Vec<u8>,
    /// The largest token (byte) in it.
    max_token: u8,
}

impl ByteCorpus {
    /// A corpus of `bytes`; it must hold more than one window.
    pub fn new(bytes: Vec<u8>, seq: usize) -> Result<ByteCorpus> {
        if bytes.len() <= seq + 1 {
            return Err(bad(
                "data",
                format!("{} bytes", bytes.len()),
                format!("give a text longer than model.seq + 1 = {} bytes", seq + 1),
            ));
        }
        let max_token = bytes.iter().copied().max().unwrap_or(0);
        Ok(ByteCorpus { bytes, max_token })
    }

    /// Errors unless a model of `vocab` tokens covers every token.
    pub fn check_vocab(&self, vocab: usize) -> Result<()> {
        let max = usize::from(self.max_token);
        if max >= vocab {
            let at = self.bytes.iter().position(|&b| usize::from(b) >= vocab);
            return Err(bad(
                "model.vocab",
                vocab,
                format!(
                    "the data holds token {max} (byte {} first at offset {}): use a vocab above {max} (256 covers every byte)",
                    self.bytes[at.unwrap_or(0)],
                    at.unwrap_or(0)
                ),
            ));
        }
        Ok(())
    }

    /// Bytes in the corpus.
    pub fn len(&self) -> usize {
        self.bytes.len()
    }

    /// Whether it is empty (never: [`ByteCorpus::new`] refuses that).
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    /// Rank `rank`'s tokens for step `step`: for each of `accumulation`
    /// micro-batches, `micro_batch` windows of `seq + 1` bytes. The
    /// windows of a step are numbered across ranks, so `world` ranks of
    /// `micro_batch` read what one rank of `world x micro_batch` reads.
    #[allow(clippy::too_many_arguments)]
    pub fn step_tokens(
        &self,
        seed: u64,
        step: u64,
        rank: usize,
        world: usize,
        accumulation: usize,
        micro_batch: usize,
        seq: usize,
        out: &mut [u32],
    ) {
        assert_eq!(
            out.len(),
            accumulation * micro_batch * (seq + 1),
            "step tokens"
        );
        let starts = (self.bytes.len() - seq - 1) as u64;
        let mut windows = out.chunks_exact_mut(seq + 1);
        for m in 0..accumulation {
            for i in 0..micro_batch {
                let global = (m * world + rank) * micro_batch + i;
                let start = (mix(seed, step, global as u64) % starts) as usize;
                let window = windows.next().expect("sized above");
                for (token, &byte) in window.iter_mut().zip(&self.bytes[start..start + seq + 1]) {
                    *token = u32::from(byte);
                }
            }
        }
    }
}

/// SplitMix64's finalizer over the three inputs.
fn mix(seed: u64, step: u64, window: u64) -> u64 {
    let mut z = seed
        .wrapping_mul(0x9e37_79b9_7f4a_7c15)
        .wrapping_add(step.wrapping_mul(0xbf58_476d_1ce4_e5b9))
        .wrapping_add(window.wrapping_mul(0x94d0_49bb_1331_11eb));
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_ranks_read_what_one_rank_of_twice_the_batch_reads() {
        let corpus = ByteCorpus::new((0..=255u8).cycle().take(5000).collect(), 16).unwrap();
        let (seq, accumulation) = (16, 2);
        let mut one = vec![0; accumulation * 4 * (seq + 1)];
        corpus.step_tokens(7, 3, 0, 1, accumulation, 4, seq, &mut one);
        let mut halves = Vec::new();
        for rank in 0..2 {
            let mut part = vec![0; accumulation * 2 * (seq + 1)];
            corpus.step_tokens(7, 3, rank, 2, accumulation, 2, seq, &mut part);
            halves.push(part);
        }
        let window = 2 * (seq + 1);
        for m in 0..accumulation {
            let joined: Vec<u32> = [
                &halves[0][m * window..][..window],
                &halves[1][m * window..][..window],
            ]
            .concat();
            assert_eq!(joined, one[m * 2 * window..][..2 * window]);
        }
        let mut other_step = vec![0; one.len()];
        corpus.step_tokens(7, 4, 0, 1, accumulation, 4, seq, &mut other_step);
        assert_ne!(one, other_step, "steps read different windows");
    }

    #[test]
    fn a_text_shorter_than_a_window_is_refused() {
        let err = ByteCorpus::new(b"short".to_vec(), 64).unwrap_err();
        assert!(err.to_string().contains("longer than model.seq"), "{err}");
    }
}
