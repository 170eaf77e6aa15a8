//! A seeded fault injector around a real engine, for tests and simulation.

use std::collections::HashMap;
use std::io;

use super::{EngineKind, RawCompletion, RawEngine, RawRequest};
use crate::error::Op;

/// Probability of each fault, per completed request.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct FaultRates {
    /// The request fails with EIO.
    pub eio: f64,
    /// A write fails with ENOSPC.
    pub enospc: f64,
    /// The request comes back -EAGAIN (nothing claimed to be moved).
    pub eagain: f64,
    /// The request reports a short, block-aligned transfer.
    pub short: f64,
    /// A read succeeds but one bit of the data is flipped.
    pub flip: f64,
    /// The completion is held back for up to [`DELAY_MAX`] (seeded), so
    /// that the other threads' work interleaves differently.
    pub delay: f64,
}

/// The longest injected delay.
pub const DELAY_MAX: std::time::Duration = std::time::Duration::from_micros(500);

/// How many faults of each kind were injected.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FaultCounts {
    /// EIO results.
    pub eio: u64,
    /// ENOSPC results.
    pub enospc: u64,
    /// EAGAIN results.
    pub eagain: u64,
    /// Short transfers.
    pub short: u64,
    /// Flipped bits.
    pub flip: u64,
}

/// Wraps a real engine and rewrites its completions. Each fault is decided
/// by a hash of (seed, direction, file, offset, length, attempt), the
/// attempt counting earlier requests at the same place: the same requests
/// meet the same faults in whatever order they complete, so a failure
/// replays from its seed under any interleaving of threads. Faults never
/// claim that more was transferred than really was, so a correct caller
/// always ends with either the right bytes or an error.
pub struct FaultEngine<E> {
    inner: E,
    rates: FaultRates,
    seed: u64,
    /// Per (op, file, offset): requests seen so far (the attempt number).
    attempts: HashMap<(bool, u32, u64), u32>,
    /// The generator of the completion being rewritten (keyed by it).
    rng: SplitMix64,
    requests: HashMap<u64, RawRequest>,
    counts: FaultCounts,
    counts_out: std::sync::Arc<std::sync::Mutex<FaultCounts>>,
}

// SAFETY: the stored requests' pointers are only dereferenced (to flip a bit)
// by the thread that owns this engine, under `RawEngine::push`'s contract.
unsafe impl<E: Send> Send for FaultEngine<E> {}

impl<E: RawEngine> FaultEngine<E> {
    /// Wraps `inner`; the same seed and the same requests inject the same faults.
    pub fn new(inner: E, rates: FaultRates, seed: u64) -> Self {
        Self {
            inner,
            rates,
            seed,
            attempts: HashMap::new(),
            rng: SplitMix64(seed),
            requests: HashMap::new(),
            counts: FaultCounts::default(),
            counts_out: Default::default(),
        }
    }

    /// A shared view of the counts, readable after the engine moved into a queue.
    pub fn counts_handle(&self) -> std::sync::Arc<std::sync::Mutex<FaultCounts>> {
        self.counts_out.clone()
    }

    fn roll(&mut self, probability: f64) -> bool {
        probability > 0.0 && self.rng.next_f64() < probability
    }

    fn inject(&mut self, req: &RawRequest, result: i32) -> i32 {
        let write = req.op == Op::Write;
        let attempt = self
            .attempts
            .entry((write, req.file, req.offset))
            .or_insert(0);
        *attempt += 1;
        let key = [
            self.seed,
            u64::from(write),
            u64::from(req.file),
            req.offset,
            u64::from(req.len),
            u64::from(*attempt),
        ];
        self.rng = SplitMix64(key.iter().fold(0, |h, &k| SplitMix64(h ^ k).next_u64()));
        if self.roll(self.rates.delay) {
            let micros = self.rng.next_u64() % DELAY_MAX.as_micros() as u64;
            std::thread::sleep(std::time::Duration::from_micros(micros));
        }
        if result < 0 {
            return result;
        }
        if self.roll(self.rates.eio) {
            self.counts.eio += 1;
            return -libc::EIO;
        }
        if req.op == Op::Write && self.roll(self.rates.enospc) {
            self.counts.enospc += 1;
            return -libc::ENOSPC;
        }
        if self.roll(self.rates.eagain) {
            self.counts.eagain += 1;
            return -libc::EAGAIN;
        }
        let moved = result as u32;
        if moved > 4096 && self.roll(self.rates.short) {
            self.counts.short += 1;
            let blocks = moved / 4096;
            let kept = 1 + (self.rng.next_u64() % u64::from(blocks - 1).max(1)) as u32;
            return (kept.min(blocks - 1).max(1) * 4096) as i32;
        }
        if req.op == Op::Read && moved > 0 && self.roll(self.rates.flip) {
            self.counts.flip += 1;
            let byte = (self.rng.next_u64() % u64::from(moved)) as usize;
            let bit = self.rng.next_u64() % 8;
            // The buffer is ours until this completion is returned (push's contract).
            // SAFETY: the read into ptr..ptr+moved has completed, and `byte` < moved.
            unsafe { *req.ptr.add(byte) ^= 1 << bit };
        }
        result
    }
}

impl<E: RawEngine> RawEngine for FaultEngine<E> {
    fn kind(&self) -> EngineKind {
        self.inner.kind()
    }

    fn depth_max(&self) -> usize {
        self.inner.depth_max()
    }

    fn set_files(&mut self, fds: &[std::os::fd::RawFd]) -> io::Result<()> {
        self.inner.set_files(fds)
    }

    unsafe fn push(&mut self, req: RawRequest) {
        self.requests.insert(req.tag, req);
        // SAFETY: forwarded from our caller.
        unsafe { self.inner.push(req) };
    }

    fn submit_and_wait(&mut self, min: usize, out: &mut Vec<RawCompletion>) -> io::Result<()> {
        let start = out.len();
        self.inner.submit_and_wait(min, out)?;
        for completion in &mut out[start..] {
            let req = self
                .requests
                .remove(&completion.tag)
                .expect("completion for a request that was never pushed");
            completion.result = self.inject(&req, completion.result);
        }
        *self.counts_out.lock().expect("fault counts lock") = self.counts;
        Ok(())
    }

    unsafe fn register_buffers(&mut self, regions: &[(*mut u8, usize)]) -> bool {
        // SAFETY: forwarded from our caller.
        unsafe { self.inner.register_buffers(regions) }
    }
}

/// A small, well-known seeded generator (SplitMix64); enough for fault rolls.
#[derive(Clone, Debug)]
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        *self = self.jumped(1);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// The generator `draws` draws ahead: its state moves by a fixed step
    /// per draw, so streams can be cut into pieces drawn in parallel.
    pub fn jumped(&self, draws: u64) -> SplitMix64 {
        SplitMix64(
            self.0
                .wrapping_add(draws.wrapping_mul(0x9E37_79B9_7F4A_7C15)),
        )
    }
}
