//! Deterministic simulation (seeded): random sequences of register, use,
//! write, move and free across the tiers, with tiny budgets and injected
//! storage faults (EIO, ENOSPC, EAGAIN, short transfers, flipped bits) and
//! out-of-memory faults (a device or host placement refused as if the tier
//! were full: the runtime must spill, or fail with `OutOfMemory`).
//! After every operation: no budget is exceeded, no tensor is lost or
//! changed, a hard fault was injected exactly when an operation failed
//! because of storage, and an operation failed out of memory only when an
//! out-of-memory fault was injected. At the end no buffer, device range or
//! extent leaks.
//!
//! One mover, one ring and queue depth 1 keep the I/O order, and so the
//! faults, a function of the seed. A failing seed is printed; replay it with
//! `STRATA_SIM_SEED=<seed> cargo test -p strata-runtime --test simulation`;
//! run more seeds with `STRATA_SIM_SEEDS=<count>` (benches/soak.sh).

use std::collections::HashMap;

use strata_runtime::{
    Access, ClassConfig, CpuDevice, DeviceChoice, DeviceConfig, Dtype, HostConfig, LimitsConfig,
    MemoryFaults, Runtime, RuntimeConfig, RuntimeError, TensorId, TensorKind, TensorMeta, Tier,
};
use strata_storage::engine::SplitMix64;
use strata_storage::{ByteSize, EngineChoice, FaultCounts, FaultRates, StorageConfig, SwapStore};

const DEVICE_BYTES: u64 = 256 << 10;
const OPS_PER_SEED: usize = 150;
const SEEDS: u64 = 24;
const TENSORS_MAX: usize = 10;

struct Sim {
    seed: u64,
    rng: SplitMix64,
    runtime: Runtime,
    store: SwapStore,
    /// Tensor -> (bytes, checksum of its data).
    model: HashMap<TensorId, (u64, u64)>,
    failures: usize,
    /// Operations that failed out of memory.
    ooms: usize,
}

fn hard_faults(counts: FaultCounts) -> u64 {
    counts.eio + counts.enospc + counts.flip
}

/// Placements refused by an injected out-of-memory fault, per placement.
const OOM_RATE: f64 = 0.03;

fn out_of_memory(err: &RuntimeError) -> bool {
    match err {
        RuntimeError::OutOfMemory { .. } => true,
        RuntimeError::Move { cause, .. } => out_of_memory(cause),
        _ => false,
    }
}

fn caused_by_storage(err: &RuntimeError) -> bool {
    match err {
        RuntimeError::Storage(_) => true,
        RuntimeError::Move { cause, .. } => caused_by_storage(cause),
        _ => false,
    }
}

fn data(seed: u64, len: u64) -> Vec<u8> {
    let mut rng = SplitMix64(seed);
    (0..len).map(|_| rng.next_u64() as u8).collect()
}

fn checksum(bytes: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(bytes)
}

impl Sim {
    fn new(seed: u64, dir: &std::path::Path) -> Self {
        let nvme = StorageConfig {
            dirs: vec![dir.to_path_buf()],
            capacity: ByteSize(1 << 20),
            engine: EngineChoice::Threads,
            block_size: ByteSize(16 << 10),
            stripe_size: ByteSize(16 << 10),
            queue_depth: 1,
            rings: 1,
            ..Default::default()
        };
        let rates = FaultRates {
            eio: 0.01,
            enospc: 0.01,
            eagain: 0.03,
            short: 0.03,
            flip: 0.01,
            delay: 0.0,
        };
        let store = SwapStore::open_faulty(&nvme, rates, seed).expect("store opens");
        let config = RuntimeConfig {
            device: DeviceConfig {
                kind: DeviceChoice::Cpu,
                budget: ByteSize(DEVICE_BYTES),
                ..Default::default()
            },
            host: HostConfig {
                classes: vec![
                    ClassConfig {
                        buffer_size: ByteSize(4096),
                        bytes: ByteSize(64 << 10),
                    },
                    ClassConfig {
                        buffer_size: ByteSize(32 << 10),
                        bytes: ByteSize(256 << 10),
                    },
                ],
                ..Default::default()
            },
            nvme: Some(nvme),
            runtime: LimitsConfig {
                movers: 2,
                ..Default::default()
            },
        };
        let device = Box::new(CpuDevice::new(DEVICE_BYTES).unwrap());
        let runtime =
            Runtime::with_parts(&config, device, Some(store.clone())).expect("runtime starts");
        runtime.inject_memory_faults(MemoryFaults {
            rate: OOM_RATE,
            seed,
        });
        Self {
            seed,
            rng: SplitMix64(seed ^ 0x51_3a7a),
            runtime,
            store,
            model: HashMap::new(),
            failures: 0,
            ooms: 0,
        }
    }

    fn below(&mut self, n: u64) -> u64 {
        self.rng.next_u64() % n
    }

    fn pick(&mut self) -> Option<TensorId> {
        let mut ids: Vec<TensorId> = self.model.keys().copied().collect();
        ids.sort();
        if ids.is_empty() {
            return None;
        }
        Some(ids[self.below(ids.len() as u64) as usize])
    }

    fn tier(&mut self) -> Tier {
        Tier::ALL[self.below(3) as usize]
    }

    /// Runs one operation; returns its errors (several for a batch of moves).
    fn step(&mut self) -> Vec<RuntimeError> {
        let mut errors = Vec::new();
        match self.below(10) {
            0 | 1 if self.model.len() < TENSORS_MAX => {
                let len = 4 * (1 + self.below(24 << 10));
                let tier = if self.below(2) == 0 {
                    Tier::Host
                } else {
                    Tier::Device
                };
                let meta = TensorMeta::new("t", TensorKind::Activation, Dtype::F32, &[len / 4]);
                match self.runtime.register(meta, tier) {
                    Ok(id) => {
                        let bytes = data(self.rng.next_u64(), len);
                        let mut guard = self.runtime.acquire(id, tier, Access::Write).unwrap();
                        guard.write_from(&bytes).unwrap();
                        drop(guard);
                        self.model.insert(id, (len, checksum(&bytes)));
                    }
                    Err(err) => errors.push(err),
                }
            }
            2..=4 => {
                if let Some(id) = self.pick() {
                    let tier = self.tier();
                    match self.runtime.move_to(id, tier) {
                        Ok(done) => errors.extend(done.wait().err()),
                        Err(err) => errors.push(err),
                    }
                }
            }
            5 => {
                // A batch of moves in flight at once, waited together.
                let mut pending = Vec::new();
                for _ in 0..3 {
                    if let Some(id) = self.pick() {
                        let tier = self.tier();
                        match self.runtime.move_to(id, tier) {
                            Ok(done) => pending.push(done),
                            Err(RuntimeError::Moving { .. }) => {}
                            Err(err) => errors.push(err),
                        }
                    }
                }
                errors.extend(pending.into_iter().filter_map(|done| done.wait().err()));
            }
            6 => {
                if let Some(id) = self.pick() {
                    let resident = self.runtime.residency(id).unwrap();
                    if let Some(&tier) = resident.iter().find(|t| **t != Tier::Nvme) {
                        let len = self.model[&id].0;
                        let bytes = data(self.rng.next_u64(), len);
                        let mut guard = self.runtime.acquire(id, tier, Access::Write).unwrap();
                        guard.write_from(&bytes).unwrap();
                        drop(guard);
                        self.model.insert(id, (len, checksum(&bytes)));
                    }
                }
            }
            7 => {
                if let Some(id) = self.pick() {
                    self.runtime.free(id).unwrap();
                    self.model.remove(&id);
                }
            }
            _ => {
                // Use: a read guard pins the copy while other tensors move.
                if let Some(id) = self.pick() {
                    let resident = self.runtime.residency(id).unwrap();
                    if let Some(&tier) = resident.iter().find(|t| **t != Tier::Nvme) {
                        let guard = self.runtime.acquire(id, tier, Access::Read).unwrap();
                        if let Some(other) = self.pick() {
                            let target = self.tier();
                            match self.runtime.move_to(other, target) {
                                Ok(done) => errors.extend(done.wait().err()),
                                Err(err) => errors.push(err),
                            }
                        }
                        assert!(
                            self.runtime.residency(id).unwrap().contains(&tier),
                            "seed {}: a copy in use was evicted",
                            self.seed
                        );
                        drop(guard);
                    }
                }
            }
        }
        errors
    }

    fn check_invariants(&self, step: usize) {
        let stats = self.runtime.stats();
        for tier in Tier::ALL {
            let t = stats.tier(tier);
            assert!(
                t.used_bytes <= t.budget_bytes && t.peak_bytes <= t.budget_bytes,
                "seed {} step {step}: {tier} over budget: {t:?}",
                self.seed
            );
        }
        for (id, (len, sum)) in &self.model {
            let resident = self.runtime.residency(*id).unwrap();
            assert!(
                !resident.is_empty(),
                "seed {} step {step}: tensor {id} lost",
                self.seed
            );
            for tier in resident.into_iter().filter(|t| *t != Tier::Nvme) {
                let guard = self.runtime.acquire(*id, tier, Access::Read).unwrap();
                let mut bytes = vec![0; *len as usize];
                guard.read_into(&mut bytes).unwrap();
                assert_eq!(
                    checksum(&bytes),
                    *sum,
                    "seed {} step {step}: tensor {id} changed in {tier}",
                    self.seed
                );
            }
        }
    }

    fn run(&mut self) {
        for step in 0..OPS_PER_SEED {
            let before = hard_faults(self.store.fault_counts().unwrap());
            let ooms_before = self.runtime.stats().ooms_injected;
            let errors = self.step();
            let injected = hard_faults(self.store.fault_counts().unwrap()) - before;
            let ooms_injected = self.runtime.stats().ooms_injected - ooms_before;
            let ooms = errors.iter().filter(|e| out_of_memory(e)).count();
            assert!(
                ooms == 0 || ooms_injected > 0,
                "seed {} step {step}: out of memory with no fault injected: {errors:?}",
                self.seed
            );
            self.ooms += ooms;
            let storage_errors = errors.iter().filter(|e| caused_by_storage(e)).count();
            for err in errors.iter().filter(|e| !caused_by_storage(e)) {
                assert!(
                    matches!(
                        err,
                        RuntimeError::OutOfBudget { .. }
                            | RuntimeError::OutOfMemory { .. }
                            | RuntimeError::Move { .. }
                            | RuntimeError::InUse { .. }
                    ),
                    "seed {} step {step}: unexpected error {err}",
                    self.seed
                );
            }
            assert_eq!(
                injected > 0,
                storage_errors > 0,
                "seed {} step {step}: {injected} hard fault(s) injected but {storage_errors} storage error(s) surfaced: {errors:?}",
                self.seed
            );
            self.failures += storage_errors;
            self.check_invariants(step);
        }
    }

    /// Reads every tensor back to the host (retrying reads that hit a
    /// fault: the data on disk is intact), checks it, frees it, and checks
    /// that every byte of every tier is free again.
    fn drain(mut self) {
        let mut ids: Vec<TensorId> = self.model.keys().copied().collect();
        ids.sort();
        for id in ids {
            let (len, sum) = self.model[&id];
            let mut tries = 0;
            while let Err(err) = self.runtime.move_to(id, Tier::Host).unwrap().wait() {
                tries += 1;
                assert!(
                    (caused_by_storage(&err) || out_of_memory(&err)) && tries < 50,
                    "seed {}: tensor {id} unreadable: {err}",
                    self.seed
                );
            }
            let guard = self.runtime.acquire(id, Tier::Host, Access::Read).unwrap();
            let mut bytes = vec![0; len as usize];
            guard.read_into(&mut bytes).unwrap();
            assert_eq!(
                checksum(&bytes),
                sum,
                "seed {}: tensor {id} changed",
                self.seed
            );
            drop(guard);
            self.runtime.free(id).unwrap();
            self.model.remove(&id);
        }
        let stats = self.runtime.stats();
        for tier in Tier::ALL {
            assert_eq!(
                stats.tier(tier).used_bytes,
                0,
                "seed {}: {tier} leaks",
                self.seed
            );
        }
        assert_eq!(
            self.runtime.free_bytes(Tier::Host),
            stats.tier(Tier::Host).budget_bytes,
            "seed {}: host buffers leak",
            self.seed
        );
        assert_eq!(
            self.runtime.free_bytes(Tier::Device),
            DEVICE_BYTES,
            "seed {}: device ranges leak",
            self.seed
        );
        assert_eq!(
            self.store.free_bytes(),
            self.store.capacity_bytes(),
            "seed {}: extents leak",
            self.seed
        );
    }
}

/// Storage faults surfaced, out-of-memory faults injected, and operations
/// that failed out of memory.
fn run_seed(seed: u64) -> [u64; 3] {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let mut sim = Sim::new(seed, dir.path());
    sim.run();
    let counts = [
        sim.failures as u64,
        sim.runtime.stats().ooms_injected,
        sim.ooms as u64,
    ];
    sim.drain();
    counts
}

#[test]
fn seeded_simulation_with_storage_faults() {
    let seeds: Vec<u64> = match std::env::var("STRATA_SIM_SEED") {
        Ok(seed) => vec![seed.parse().expect("STRATA_SIM_SEED is a number")],
        Err(_) => {
            let count = std::env::var("STRATA_SIM_SEEDS")
                .map(|n| n.parse().expect("STRATA_SIM_SEEDS is a number"))
                .unwrap_or(SEEDS);
            (0..count).map(|i| 0x5eed_0000 + i).collect()
        }
    };
    let [mut failures, mut ooms_injected, mut ooms_failed] = [0; 3];
    for seed in seeds {
        let outcome = std::panic::catch_unwind(|| run_seed(seed));
        match outcome {
            Ok([f, injected, failed]) => {
                failures += f;
                ooms_injected += injected;
                ooms_failed += failed;
            }
            Err(panic) => {
                eprintln!(
                    "simulation failed for seed {seed}; replay with STRATA_SIM_SEED={seed} cargo test -p strata-runtime --test simulation"
                );
                std::panic::resume_unwind(panic);
            }
        }
    }
    eprintln!(
        "simulation: {failures} injected storage faults surfaced as errors; {ooms_injected} placements refused out of memory, {ooms_failed} operations failed for it (the rest were spilled around)"
    );
    if std::env::var("STRATA_SIM_SEED").is_err() {
        assert!(
            failures > 0 && ooms_injected > 0,
            "the fault rates injected nothing: the test would not notice a swallowed fault"
        );
    }
}
