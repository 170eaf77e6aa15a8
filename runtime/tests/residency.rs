//! The residency manager on the CPU device, through every path: device only,
//! device + host, through NVMe, and at the smallest budgets that can work.

use strata_runtime::{
    Access, ClassConfig, DeviceChoice, DeviceConfig, Dtype, HostConfig, Runtime, RuntimeConfig,
    RuntimeError, TensorId, TensorKind, TensorMeta, Tier,
};
use strata_storage::{ByteSize, StorageConfig};

fn config(dir: &std::path::Path, device_bytes: u64, host_bytes: u64) -> RuntimeConfig {
    RuntimeConfig {
        device: DeviceConfig {
            kind: DeviceChoice::Cpu,
            budget: ByteSize(device_bytes),
            ..Default::default()
        },
        host: HostConfig {
            classes: vec![
                ClassConfig {
                    buffer_size: ByteSize(4096),
                    bytes: ByteSize(host_bytes / 4),
                },
                ClassConfig {
                    buffer_size: ByteSize(65536),
                    bytes: ByteSize(host_bytes / 4 * 3),
                },
            ],
            ..Default::default()
        },
        nvme: Some(StorageConfig {
            dirs: vec![dir.to_path_buf()],
            capacity: ByteSize(16 << 20),
            block_size: ByteSize(64 << 10),
            stripe_size: ByteSize(64 << 10),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn meta(name: &str, bytes: u64) -> TensorMeta {
    TensorMeta::new(name, TensorKind::Param, Dtype::F32, &[bytes / 4])
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u64).wrapping_mul(seed | 1).wrapping_add(seed >> 3) as u8)
        .collect()
}

fn fill(runtime: &Runtime, id: TensorId, tier: Tier, data: &[u8]) {
    let mut guard = runtime.acquire(id, tier, Access::Write).unwrap();
    guard.write_from(data).unwrap();
}

/// Bytes read from NVMe so far.
fn nvme_read_bytes(runtime: &Runtime) -> u64 {
    runtime.stats().link(strata_runtime::Link::NvmeToHost).bytes
}

fn read(runtime: &Runtime, id: TensorId, tier: Tier) -> Vec<u8> {
    let guard = runtime.acquire(id, tier, Access::Read).unwrap();
    let mut out = vec![0; guard.len_bytes() as usize];
    guard.read_into(&mut out).unwrap();
    out
}

/// Threads of the test's own that count the windows they commit.
struct Counting {
    threads: usize,
    calls: std::sync::atomic::AtomicUsize,
}

impl strata_runtime::Spread for Counting {
    fn threads(&self) -> usize {
        self.threads
    }
    fn each(&self, work: &(dyn Fn(usize) + Sync)) {
        self.calls
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        std::thread::scope(|scope| {
            for i in 0..self.threads {
                scope.spawn(move || work(i));
            }
        });
    }
}

#[test]
fn the_pinned_pool_is_committed_by_the_threads_lent_to_open_with() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let spread = Counting {
        threads: 3,
        calls: Default::default(),
    };
    let runtime = Runtime::open_with(
        &config(dir.path(), 1 << 20, 8 << 20),
        None,
        None,
        Some(&spread),
    )
    .unwrap();
    // Once per size class's region.
    assert_eq!(spread.calls.load(std::sync::atomic::Ordering::Relaxed), 2);
    // The pool works as any other, zeroed.
    let bytes = 65536 + 4096;
    let id = runtime.register(meta("w", bytes), Tier::Host).unwrap();
    assert!(read(&runtime, id, Tier::Host).iter().all(|&b| b == 0));
    let data = pattern(3, bytes as usize);
    fill(&runtime, id, Tier::Host, &data);
    assert_eq!(read(&runtime, id, Tier::Host), data);
}

#[test]
fn round_trip_through_every_tier() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let runtime = Runtime::new(&config(dir.path(), 1 << 20, 1 << 20)).unwrap();
    let bytes = 3 * 65536 + 3 * 4096 + 100 * 4;
    let id = runtime.register(meta("w", bytes), Tier::Host).unwrap();
    assert!(
        read(&runtime, id, Tier::Host).iter().all(|&b| b == 0),
        "registered zeroed"
    );
    let data = pattern(7, bytes as usize);
    fill(&runtime, id, Tier::Host, &data);
    runtime.move_to(id, Tier::Nvme).unwrap().wait().unwrap();
    assert_eq!(runtime.residency(id).unwrap(), vec![Tier::Nvme]);
    runtime.move_to(id, Tier::Device).unwrap().wait().unwrap();
    assert_eq!(
        runtime.residency(id).unwrap(),
        Tier::ALL.to_vec(),
        "moving up keeps lower copies"
    );
    assert_eq!(read(&runtime, id, Tier::Device), data);
    runtime.move_to(id, Tier::Host).unwrap().wait().unwrap();
    assert_eq!(runtime.residency(id).unwrap(), vec![Tier::Host, Tier::Nvme]);
    assert_eq!(read(&runtime, id, Tier::Host), data);
    let stats = runtime.stats();
    assert_eq!(stats.link(strata_runtime::Link::HostToNvme).bytes, bytes);
    assert_eq!(stats.link(strata_runtime::Link::HostToDevice).bytes, bytes);
    runtime.free(id).unwrap();
    let stats = runtime.stats();
    for tier in Tier::ALL {
        assert_eq!(stats.tier(tier).used_bytes, 0, "{tier} leaks");
    }
    assert_eq!(
        runtime.free_bytes(Tier::Host),
        stats.tier(Tier::Host).budget_bytes
    );
}

#[test]
fn writes_release_stale_copies() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let runtime = Runtime::new(&config(dir.path(), 1 << 20, 1 << 20)).unwrap();
    let id = runtime.register(meta("w", 65536), Tier::Host).unwrap();
    runtime.move_to(id, Tier::Device).unwrap().wait().unwrap();
    fill(&runtime, id, Tier::Device, &pattern(3, 65536));
    assert_eq!(runtime.residency(id).unwrap(), vec![Tier::Device]);
    runtime.move_to(id, Tier::Nvme).unwrap().wait().unwrap();
    assert_eq!(read_back(&runtime, id), pattern(3, 65536));
}

#[test]
fn overwrite_reads_nothing_and_releases_stale_copies() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let runtime = Runtime::new(&config(dir.path(), 1 << 20, 1 << 20)).unwrap();
    let bytes = 2 * 65536 + 4096;
    let id = runtime.register(meta("w", bytes), Tier::Host).unwrap();
    fill(&runtime, id, Tier::Host, &pattern(1, bytes as usize));
    runtime.move_to(id, Tier::Nvme).unwrap().wait().unwrap();
    let read_before = nvme_read_bytes(&runtime);
    runtime
        .overwrite(id, Tier::Host, &pattern(2, bytes as usize))
        .unwrap();
    assert_eq!(
        nvme_read_bytes(&runtime),
        read_before,
        "the old bytes are not fetched"
    );
    assert_eq!(
        runtime.residency(id).unwrap(),
        vec![Tier::Host],
        "the NVMe copy is stale"
    );
    assert_eq!(read(&runtime, id, Tier::Host), pattern(2, bytes as usize));
    // Over a resident copy too, and the wrong size is named.
    runtime
        .overwrite(id, Tier::Host, &pattern(3, bytes as usize))
        .unwrap();
    assert_eq!(read(&runtime, id, Tier::Host), pattern(3, bytes as usize));
    let err = runtime.overwrite(id, Tier::Device, &[0; 8]).unwrap_err();
    assert!(
        matches!(err, RuntimeError::SizeMismatch { given_bytes: 8, .. }),
        "{err}"
    );
}

#[test]
fn overwrite_with_writes_ranges_and_a_failed_write_keeps_the_old_bytes() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let runtime = Runtime::new(&config(dir.path(), 1 << 20, 1 << 20)).unwrap();
    // Chunks of 64 KiB and 4 KiB: ranges cross chunk boundaries.
    let bytes = 2 * 65536 + 4096;
    let id = runtime.register(meta("w", bytes), Tier::Host).unwrap();
    let old = pattern(1, bytes as usize);
    fill(&runtime, id, Tier::Host, &old);
    runtime.move_to(id, Tier::Nvme).unwrap().wait().unwrap();
    let new = pattern(9, bytes as usize);
    let read_before = nvme_read_bytes(&runtime);
    // Written in odd-sized ranges through a guard on fresh host space.
    runtime
        .overwrite_with(id, Tier::Host, |guard| {
            for start in (0..bytes as usize).step_by(5000) {
                let end = (start + 5000).min(bytes as usize);
                guard.write_range(start as u64, &new[start..end])?;
            }
            Ok::<_, RuntimeError>(())
        })
        .unwrap();
    assert_eq!(
        nvme_read_bytes(&runtime),
        read_before,
        "the old bytes are not fetched"
    );
    assert_eq!(runtime.residency(id).unwrap(), vec![Tier::Host]);
    let guard = runtime.acquire(id, Tier::Host, Access::Read).unwrap();
    let mut piece = vec![0; 70000];
    guard.read_range(60000, &mut piece).unwrap();
    assert_eq!(piece, new[60000..130000]);
    let err = guard.read_range(bytes - 10, &mut piece).unwrap_err();
    assert!(err.to_string().contains("range"), "{err}");
    drop(guard);
    assert_eq!(read(&runtime, id, Tier::Host), new);
    // A write that fails part way over fresh space: that copy is dropped
    // and the NVMe copy, still whole, stays the tensor's bytes.
    runtime.move_to(id, Tier::Nvme).unwrap().wait().unwrap();
    let err = runtime
        .overwrite_with(id, Tier::Host, |guard| {
            guard.write_range(0, &old[..4096])?;
            guard.write_range(bytes, &old[..1])
        })
        .unwrap_err();
    assert!(err.to_string().contains("range"), "{err}");
    assert_eq!(runtime.residency(id).unwrap(), vec![Tier::Nvme]);
    runtime.move_to(id, Tier::Host).unwrap().wait().unwrap();
    assert_eq!(read(&runtime, id, Tier::Host), new);
}

#[test]
fn releasing_a_duplicate_keeps_the_only_copy_in_one_look() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let runtime = Runtime::new(&config(dir.path(), 1 << 20, 1 << 20)).unwrap();
    let id = runtime.register(meta("g", 65536), Tier::Host).unwrap();
    fill(&runtime, id, Tier::Host, &pattern(8, 65536));
    runtime.copy_to(id, Tier::Device).unwrap().wait().unwrap();
    // Two copies: the host's goes.
    assert!(runtime.release_duplicate(id, Tier::Host).unwrap());
    assert_eq!(runtime.residency(id).unwrap(), vec![Tier::Device]);
    // The only copy stays, untouched, and plain `release` names it.
    assert!(!runtime.release_duplicate(id, Tier::Device).unwrap());
    assert_eq!(runtime.residency(id).unwrap(), vec![Tier::Device]);
    let error = runtime.release(id, Tier::Device).unwrap_err().to_string();
    assert!(
        error.contains("g in device") && error.contains("only copy"),
        "{error}"
    );
    // A copy in use is not dropped, a missing one is named.
    runtime.copy_to(id, Tier::Host).unwrap().wait().unwrap();
    let reader = runtime.acquire(id, Tier::Host, Access::Read).unwrap();
    assert!(runtime.release_duplicate(id, Tier::Host).is_err());
    drop(reader);
    assert!(runtime.release_duplicate(id, Tier::Nvme).is_err());
    assert_eq!(read(&runtime, id, Tier::Device), pattern(8, 65536));
}

#[test]
fn copy_to_and_evict_keep_the_copies_above() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let runtime = Runtime::new(&config(dir.path(), 1 << 20, 1 << 20)).unwrap();
    let id = runtime.register(meta("w", 65536), Tier::Host).unwrap();
    fill(&runtime, id, Tier::Host, &pattern(5, 65536));
    runtime.move_to(id, Tier::Device).unwrap().wait().unwrap();
    // A write-back to NVMe: a device reader is not held up by it, and
    // every copy stays.
    let reader = runtime.acquire(id, Tier::Device, Access::Read).unwrap();
    let writeback = runtime.copy_to(id, Tier::Nvme).unwrap();
    let second = runtime.acquire(id, Tier::Device, Access::Read).unwrap();
    drop((reader, second));
    writeback.wait().unwrap();
    assert_eq!(runtime.residency(id).unwrap(), Tier::ALL.to_vec());
    // Evicting the host copy leaves the device's.
    runtime
        .evict(id, Tier::Host, Tier::Nvme)
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(
        runtime.residency(id).unwrap(),
        vec![Tier::Device, Tier::Nvme]
    );
    assert_eq!(read(&runtime, id, Tier::Device), pattern(5, 65536));
    assert_eq!(read_back(&runtime, id), pattern(5, 65536));
}

fn read_back(runtime: &Runtime, id: TensorId) -> Vec<u8> {
    runtime.move_to(id, Tier::Host).unwrap().wait().unwrap();
    read(runtime, id, Tier::Host)
}

/// On a 1 MiB device: `left` and `right` (384 KiB each) moved back to the
/// host around `middle` (256 KiB), held in use on the device, so 768 KiB
/// are free in two pieces of 384 KiB; `big` (640 KiB, filled) waits on the
/// host. Returns `[left, middle, big]` and the guard holding `middle`.
fn fragmented(runtime: &Runtime) -> ([TensorId; 3], strata_runtime::Guard) {
    let kib = |k: u64| k << 10;
    let [left, middle, right, big] = [("left", 384), ("middle", 256), ("right", 384), ("big", 640)]
        .map(|(name, k)| runtime.register(meta(name, kib(k)), Tier::Host).unwrap());
    fill(runtime, big, Tier::Host, &pattern(7, kib(640) as usize));
    for id in [left, middle, right] {
        runtime.move_to(id, Tier::Device).unwrap().wait().unwrap();
    }
    let in_use = runtime.acquire(middle, Tier::Device, Access::Read).unwrap();
    for id in [left, right] {
        runtime.move_to(id, Tier::Host).unwrap().wait().unwrap();
    }
    ([left, middle, big], in_use)
}

/// Regression: a prefetch failed with "device budget exhausted" when the
/// bytes were free but split around a tensor in use (a gradient being
/// accumulated); a mover now waits for that tensor to be let go.
#[test]
fn a_move_waits_for_room_held_by_a_tensor_in_use() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let runtime = Runtime::new(&config(dir.path(), 1 << 20, 4 << 20)).unwrap();
    let kib = |k: u64| k << 10;
    let ([_, _, big], in_use) = fragmented(&runtime);
    let started = std::time::Instant::now();
    let fetch = runtime.move_to(big, Tier::Device).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(200));
    assert!(!fetch.is_done(), "it waits while the middle one is in use");
    drop(in_use);
    fetch.wait().unwrap();
    assert!(started.elapsed() >= std::time::Duration::from_millis(200));
    assert_eq!(
        read(&runtime, big, Tier::Device),
        pattern(7, kib(640) as usize)
    );
}

/// A cancelled runtime ends every wait on another party (a completion, an
/// acquire of a moving tensor, a mover waiting for room) within the
/// cancellation's poll, refuses new moves, keeps every copy as it was,
/// and drops at once.
#[test]
fn cancelling_ends_every_blocked_wait_within_a_bound_and_keeps_the_copies() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let mut config = config(dir.path(), 1 << 20, 4 << 20);
    // Without cancellation the fetch below would wait a minute for room.
    config.runtime.room_wait_ms = 60_000;
    let runtime = Runtime::new(&config).unwrap();
    let kib = |k: u64| k << 10;
    let ([left, middle, big], in_use) = fragmented(&runtime);
    let fetch = runtime.move_to(big, Tier::Device).unwrap();
    let cancel = runtime.cancel_token();
    let bound = std::time::Duration::from_secs(1);
    std::thread::scope(|scope| {
        let waiter = scope.spawn(|| fetch.wait());
        let writer = scope.spawn(|| runtime.acquire(big, Tier::Host, Access::Write).map(drop));
        std::thread::sleep(std::time::Duration::from_millis(300));
        assert!(
            !waiter.is_finished() && !writer.is_finished(),
            "both blocked"
        );
        let cancelled_at = std::time::Instant::now();
        cancel.cancel();
        // Both were still blocked 300 ms in (checked above: no lower bound
        // on their own clocks, which a busy machine may start late).
        let fetched = waiter.join().unwrap();
        assert!(
            matches!(fetched, Err(RuntimeError::Cancelled)),
            "{fetched:?}"
        );
        // The writer sees the cancellation, or the cancelled move ending
        // first (then the tensor is its to write): either way, at once.
        let acquired = writer.join().unwrap();
        assert!(
            matches!(acquired, Ok(()) | Err(RuntimeError::Cancelled)),
            "{acquired:?}"
        );
        assert!(
            cancelled_at.elapsed() < bound,
            "{:?}",
            cancelled_at.elapsed()
        );
    });
    assert!(matches!(
        runtime.move_to(left, Tier::Device),
        Err(RuntimeError::Cancelled)
    ));
    drop(in_use);
    // The fetch never took room: the tensor in use kept its device copy
    // (the mover may have written it down as well, as a spill would), the
    // fetched one has none.
    assert!(runtime.residency(middle).unwrap().contains(&Tier::Device));
    assert!(!runtime.residency(big).unwrap().contains(&Tier::Device));
    // Until the mover has dropped the cancelled fetch, an acquire of it is
    // refused rather than kept waiting; it is let go within the bound.
    let since = std::time::Instant::now();
    let guard = loop {
        match runtime.acquire(big, Tier::Host, Access::Read) {
            Err(RuntimeError::Cancelled) if since.elapsed() < bound => continue,
            other => break other.unwrap(),
        }
    };
    let mut data = vec![0; kib(640) as usize];
    guard.read_into(&mut data).unwrap();
    drop(guard);
    assert_eq!(data, pattern(7, kib(640) as usize));
    let dropped = std::time::Instant::now();
    drop(runtime);
    assert!(dropped.elapsed() < bound, "{:?}", dropped.elapsed());
}

#[test]
fn device_budget_spills_least_needed_and_never_the_one_in_use() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    // Device holds two 256 KiB tensors; a move waits briefly for room.
    let mut config = config(dir.path(), 512 << 10, 2 << 20);
    config.runtime.room_wait_ms = 100;
    let runtime = Runtime::new(&config).unwrap();
    let ids: Vec<TensorId> = (0..3)
        .map(|i| {
            runtime
                .register(meta(&format!("t{i}"), 256 << 10), Tier::Host)
                .unwrap()
        })
        .collect();
    for (i, id) in ids.iter().enumerate() {
        fill(&runtime, *id, Tier::Host, &pattern(i as u64 + 1, 256 << 10));
    }
    runtime
        .move_to(ids[0], Tier::Device)
        .unwrap()
        .wait()
        .unwrap();
    runtime
        .move_to(ids[1], Tier::Device)
        .unwrap()
        .wait()
        .unwrap();
    let in_use = runtime.acquire(ids[0], Tier::Device, Access::Read).unwrap();
    runtime.set_next_use(ids[1], 100).unwrap();
    runtime
        .move_to(ids[2], Tier::Device)
        .unwrap()
        .wait()
        .unwrap();
    assert!(
        runtime.residency(ids[0]).unwrap().contains(&Tier::Device),
        "in use: kept"
    );
    assert!(
        !runtime.residency(ids[1]).unwrap().contains(&Tier::Device),
        "spilled"
    );
    drop(in_use);
    // All three held by guards: nothing can be freed for a fourth.
    let _guards: Vec<_> = [ids[0], ids[2]]
        .iter()
        .map(|id| runtime.acquire(*id, Tier::Device, Access::Read).unwrap())
        .collect();
    let err = runtime
        .move_to(ids[1], Tier::Device)
        .unwrap()
        .wait()
        .unwrap_err();
    let RuntimeError::Move { cause, .. } = &err else {
        panic!("{err}")
    };
    assert!(
        matches!(**cause, RuntimeError::OutOfBudget { tier: Tier::Device, needed_bytes, unevictable_bytes, .. }
            if needed_bytes == 256 << 10 && unevictable_bytes == 512 << 10),
        "{err}"
    );
    assert!(err.to_string().contains("raise the device budget"), "{err}");
    for (i, id) in ids.iter().enumerate() {
        assert_eq!(
            read(&runtime, *id, Tier::Host),
            pattern(i as u64 + 1, 256 << 10)
        );
    }
}

#[test]
fn host_budget_spills_to_nvme_and_back() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    // Host holds 6 x 64 KiB buffers in the large class: 8 tensors of 64 KiB must spill.
    let runtime = Runtime::new(&config(dir.path(), 1 << 20, 512 << 10)).unwrap();
    let ids: Vec<TensorId> = (0..8)
        .map(|i| {
            let id = runtime
                .register(meta(&format!("t{i}"), 65536), Tier::Host)
                .unwrap();
            fill(&runtime, id, Tier::Host, &pattern(i as u64 + 11, 65536));
            id
        })
        .collect();
    let stats = runtime.stats();
    assert!(stats.spills_written >= 2, "{stats:?}");
    assert!(stats.tier(Tier::Host).peak_bytes <= stats.tier(Tier::Host).budget_bytes);
    for (i, id) in ids.iter().enumerate() {
        assert_eq!(read_back(&runtime, *id), pattern(i as u64 + 11, 65536));
    }
}

#[test]
fn no_nvme_tier_gives_a_clear_error() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let mut config = config(dir.path(), 1 << 20, 256 << 10);
    config.nvme = None;
    let runtime = Runtime::new(&config).unwrap();
    let _a = runtime.register(meta("a", 192 << 10), Tier::Host).unwrap();
    let err = runtime
        .register(meta("b", 192 << 10), Tier::Host)
        .unwrap_err();
    assert!(
        matches!(
            err,
            RuntimeError::NoSpillTier {
                tier: Tier::Host,
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("[nvme]"), "{err}");
}

#[test]
fn misuse_is_refused_with_names() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let runtime = Runtime::new(&config(dir.path(), 1 << 20, 1 << 20)).unwrap();
    let id = runtime
        .register(meta("layer0.w", 4096), Tier::Host)
        .unwrap();
    let err = runtime.acquire(id, Tier::Device, Access::Read).unwrap_err();
    assert!(
        err.to_string().contains("layer0.w") && err.to_string().contains("move it there first"),
        "{err}"
    );
    let guard = runtime.acquire(id, Tier::Host, Access::Read).unwrap();
    assert!(matches!(
        runtime.acquire(id, Tier::Host, Access::Write),
        Err(RuntimeError::InUse { .. })
    ));
    assert!(matches!(
        runtime.move_to(id, Tier::Nvme),
        Err(RuntimeError::InUse { .. })
    ));
    assert!(matches!(runtime.free(id), Err(RuntimeError::InUse { .. })));
    drop(guard);
    let mut guard = runtime.acquire(id, Tier::Host, Access::Write).unwrap();
    let err = guard.write_from(&[0; 5]).unwrap_err();
    assert!(
        matches!(
            err,
            RuntimeError::SizeMismatch {
                tensor_bytes: 4096,
                given_bytes: 5,
                ..
            }
        ),
        "{err}"
    );
    drop(guard);
    runtime.free(id).unwrap();
    assert!(matches!(
        runtime.free(id),
        Err(RuntimeError::UnknownTensor { .. })
    ));
}

#[test]
fn trace_records_transfers_and_waits() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let runtime = Runtime::new(&config(dir.path(), 1 << 20, 1 << 20)).unwrap();
    let id = runtime.register(meta("traced", 65536), Tier::Host).unwrap();
    runtime.move_to(id, Tier::Nvme).unwrap().wait().unwrap();
    runtime.move_to(id, Tier::Device).unwrap().wait().unwrap();
    // A tensor freed after it moved keeps its name in the trace.
    let gone = runtime
        .register(meta("freed-later", 65536), Tier::Host)
        .unwrap();
    runtime.move_to(gone, Tier::Nvme).unwrap().wait().unwrap();
    runtime.free(gone).unwrap();
    let mut out = Vec::new();
    runtime.write_trace(&mut out).unwrap();
    let trace: serde_json::Value = serde_json::from_slice(&out).unwrap();
    assert!(trace.to_string().contains("freed-later"));
    let names: Vec<&str> = trace["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["ph"] == "X")
        .map(|e| e["name"].as_str().unwrap())
        .collect();
    for link in ["host->nvme", "nvme->host", "host->device"] {
        assert!(names.contains(&link), "{names:?}");
    }
    assert!(trace.to_string().contains("traced"));
}

#[test]
fn trace_records_compute_spans_on_each_threads_lane() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let runtime = std::sync::Arc::new(Runtime::new(&config(dir.path(), 1 << 20, 1 << 20)).unwrap());
    let started = std::time::Instant::now();
    runtime.record_compute("block forward", 3, Some(1), started);
    let other = runtime.clone();
    std::thread::spawn(move || {
        strata_runtime::set_caller_lane(strata_runtime::OPTIMIZER_LANE);
        let started = std::time::Instant::now();
        std::thread::sleep(std::time::Duration::from_millis(2));
        other.record_update("optimizer", 2, 1_000_000, started);
    })
    .join()
    .unwrap();
    let mut out = Vec::new();
    runtime.write_trace(&mut out).unwrap();
    let trace: serde_json::Value = serde_json::from_slice(&out).unwrap();
    let events = trace["traceEvents"].as_array().unwrap();
    let span = |name: &str| {
        events
            .iter()
            .find(|e| e["ph"] == "X" && e["name"] == name)
            .unwrap_or_else(|| panic!("no {name} in {events:?}"))
            .clone()
    };
    let forward = span("block forward");
    assert_eq!(forward["cat"], "compute");
    assert_eq!(forward["tid"], strata_runtime::CALLER_LANE);
    assert_eq!(forward["args"]["group"], 3);
    assert_eq!(forward["args"]["micro_batch"], 1);
    let optimizer = span("optimizer");
    assert_eq!(optimizer["tid"], strata_runtime::OPTIMIZER_LANE);
    assert!(optimizer["args"]["micro_batch"].is_null());
    // An update shows its parameters and their rate over its span.
    assert_eq!(optimizer["args"]["params"], 1_000_000);
    let rate = optimizer["args"]["params_per_s"].as_f64().unwrap();
    let span_s = optimizer["dur"].as_f64().unwrap() / 1e6;
    assert!(
        (rate * span_s / 1e6 - 1.0).abs() < 1e-3,
        "{rate} over {span_s} s"
    );
    assert!(forward["args"]["params"].is_null());
    let lanes: Vec<&str> = events
        .iter()
        .filter(|e| e["ph"] == "M")
        .map(|e| e["args"]["name"].as_str().unwrap())
        .collect();
    assert!(
        lanes.contains(&"compute") && lanes.contains(&"cpu optimizer"),
        "{lanes:?}"
    );
}

/// Regression: a store refusal other than "out of space" (here extents_max)
/// was reported as a full NVMe tier; it now surfaces as itself.
#[test]
fn store_limits_surface_as_themselves() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let mut config = config(dir.path(), 1 << 20, 1 << 20);
    config.nvme.as_mut().unwrap().extents_max = 1;
    let runtime = Runtime::new(&config).unwrap();
    // Two chunks: one 64 KiB buffer and one 4 KiB buffer, so two extents.
    let id = runtime
        .register(meta("two_chunks", 65536 + 4096), Tier::Host)
        .unwrap();
    let err = runtime.move_to(id, Tier::Nvme).unwrap().wait().unwrap_err();
    assert!(err.to_string().contains("extents_max"), "{err}");
    assert_eq!(
        runtime.residency(id).unwrap(),
        vec![Tier::Host],
        "source kept"
    );
}

/// A guard's last-use fence (work still enqueued on the copy when the
/// guard ends): a move out of the copy waits for it, and the copy's memory
/// is not given to another tensor before it passes, while the guard itself
/// ends at once.
#[test]
fn a_copy_in_use_by_enqueued_work_is_neither_read_nor_reused_before_its_fence() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    // The device holds one tensor.
    let runtime = Runtime::new(&config(dir.path(), 64 << 10, 1 << 20)).unwrap();
    let id = runtime.register(meta("w", 65536), Tier::Device).unwrap();
    fill(&runtime, id, Tier::Device, &pattern(9, 65536));
    // "Compute" still runs on the device copy: its fence has not passed.
    let (fence, compute) = strata_device::Fence::host();
    let mut guard = runtime.acquire(id, Tier::Device, Access::Read).unwrap();
    guard.used_until(fence);
    drop(guard);
    let eviction = runtime.move_to(id, Tier::Host).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(50));
    assert!(
        !eviction.is_done(),
        "the move read the copy before its last use ended"
    );
    compute.finish();
    eviction.wait().unwrap();
    assert_eq!(read(&runtime, id, Tier::Host), pattern(9, 65536));

    // Released with work still enqueued: its room stays counted until the
    // fence passes; a tensor that needs the room waits for it (no spill).
    runtime.move_to(id, Tier::Device).unwrap().wait().unwrap();
    let free_before = runtime.free_bytes(Tier::Device);
    let (fence, compute) = strata_device::Fence::host();
    let mut guard = runtime.acquire(id, Tier::Device, Access::Read).unwrap();
    guard.used_until(fence);
    drop(guard);
    runtime.release(id, Tier::Device).unwrap();
    assert_eq!((free_before, runtime.free_bytes(Tier::Device)), (0, 0));
    let other = runtime.register(meta("x", 65536), Tier::Host).unwrap();
    fill(&runtime, other, Tier::Host, &pattern(3, 65536));
    let upload = runtime.move_to(other, Tier::Device).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(50));
    assert!(
        !upload.is_done(),
        "the room was reused before the fence passed"
    );
    compute.finish();
    upload.wait().unwrap();
    assert_eq!(read(&runtime, other, Tier::Device), pattern(3, 65536));
    assert_eq!(read(&runtime, id, Tier::Host), pattern(9, 65536));
    assert_eq!(runtime.stats().spills_written, 0);
}

/// Copies to the device whose fences are held back: (the copy's own fence,
/// the signal of the fence handed out for it).
type Held = std::sync::Mutex<
    Vec<(
        strata_device::Fence,
        std::sync::Arc<strata_device::HostSignal>,
    )>,
>;

/// The CPU device with copies to the device held back: their bytes are
/// copied, their fences pass only when the test calls `land`.
struct HeldDevice {
    inner: strata_runtime::CpuDevice,
    held: std::sync::Arc<Held>,
}

fn land(held: &Held) {
    for (fence, signal) in held.lock().unwrap().drain(..) {
        fence.wait().unwrap();
        signal.finish();
    }
}

impl strata_runtime::Device for HeldDevice {
    fn kind(&self) -> strata_runtime::DeviceKind {
        self.inner.kind()
    }
    fn describe(&self) -> String {
        "held cpu arena".into()
    }
    fn capacity_bytes(&self) -> u64 {
        self.inner.capacity_bytes()
    }
    fn alloc_host(
        &self,
        len_bytes: usize,
        commit: &strata_runtime::device::Commit<'_>,
    ) -> strata_runtime::Result<strata_storage::AlignedBuf> {
        self.inner.alloc_host(len_bytes, commit)
    }
    unsafe fn copy(
        &self,
        direction: strata_runtime::device::Direction,
        pieces: Vec<strata_runtime::device::CopyPiece>,
    ) -> strata_runtime::Result<strata_device::Fence> {
        // SAFETY: the caller's contract, passed on unchanged.
        let fence = unsafe { self.inner.copy(direction, pieces)? };
        if direction != strata_runtime::device::Direction::ToDevice {
            return Ok(fence);
        }
        let (held, signal) = strata_device::Fence::host();
        self.held.lock().unwrap().push((fence, signal));
        Ok(held)
    }
    fn fill(&self, device_offset: u64, len_bytes: u64, value: u8) -> strata_runtime::Result<()> {
        self.inner.fill(device_offset, len_bytes, value)
    }
    fn host_address(&self, device_offset: u64) -> Option<*mut u8> {
        self.inner.host_address(device_offset)
    }
    fn device_address(&self, device_offset: u64) -> u64 {
        self.inner.device_address(device_offset)
    }
    unsafe fn raw_copy(
        &self,
        direction: strata_runtime::device::Direction,
        host: *mut u8,
        device_offset: u64,
        len_bytes: usize,
    ) -> strata_runtime::Result<()> {
        // SAFETY: the caller's contract, passed on unchanged.
        unsafe {
            self.inner
                .raw_copy(direction, host, device_offset, len_bytes)
        }
    }
}

#[test]
fn a_move_to_the_device_hands_out_the_copy_behind_its_fence_without_blocking() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let config = config(dir.path(), 64 << 10, 1 << 20);
    let held = std::sync::Arc::new(Held::default());
    let device = HeldDevice {
        inner: strata_runtime::CpuDevice::new(64 << 10).unwrap(),
        held: held.clone(),
    };
    let runtime = Runtime::with_parts(&config, Box::new(device), None).unwrap();
    let id = runtime.register(meta("w", 65536), Tier::Host).unwrap();
    fill(&runtime, id, Tier::Host, &pattern(5, 65536));
    let host_free = runtime.free_bytes(Tier::Host);

    // The move completes once its copy is enqueued; the guard comes at
    // once, with the copy's fence to order after.
    runtime.move_to(id, Tier::Device).unwrap().wait().unwrap();
    let guard = runtime.acquire(id, Tier::Device, Access::Read).unwrap();
    assert!(!guard.ready().is_passed().unwrap());
    // Its bytes are counted when it is issued, its time when it lands.
    let h2d = |runtime: &Runtime| *runtime.stats().link(strata_runtime::Link::HostToDevice);
    assert_eq!((h2d(&runtime).transfers, h2d(&runtime).busy_ns), (1, 0));
    // The host copy it reads from is not reused meanwhile.
    runtime.release(id, Tier::Host).unwrap();
    assert_eq!(runtime.free_bytes(Tier::Host), host_free);

    // A host reader through the guard waits for the landing.
    let read = std::thread::scope(|scope| {
        let reader = scope.spawn(|| {
            let mut out = vec![0; 65536];
            guard.read_into(&mut out).unwrap();
            out
        });
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert!(!reader.is_finished(), "read the copy before it landed");
        land(&held);
        reader.join().unwrap()
    });
    assert_eq!(read, pattern(5, 65536));
    assert!(guard.ready().is_passed().unwrap());
    drop(guard);
    // Landed: accounted, and the host copy's room comes back.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while h2d(&runtime).busy_ns == 0 && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    assert!(h2d(&runtime).busy_ns > 0);
    assert!(runtime.free_bytes(Tier::Host) > host_free);
}

#[test]
fn zip_ranges_walks_copies_split_into_different_chunks_together() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let runtime = Runtime::new(&config(dir.path(), 1 << 20, 8 << 20)).unwrap();
    // 70,000 f32 and 3 x 70,000 f32: chunked by 64 KiB and 4 KiB buffers
    // at different places.
    let n = 70_000u64;
    let a = runtime.register(meta("a", 4 * n), Tier::Host).unwrap();
    let b = runtime.register(meta("b", 12 * n), Tier::Host).unwrap();
    let values: Vec<f32> = (0..n).map(|i| i as f32).collect();
    fill(&runtime, a, Tier::Host, bytemuck::cast_slice(&values));
    let read = runtime.acquire(a, Tier::Host, Access::Read).unwrap();
    let mut write = runtime.acquire(b, Tier::Host, Access::Write).unwrap();
    // b's second third gets a's values doubled, after the walk: the
    // stretches outlive the closure (as the engine hands them all to one
    // pool call).
    let mut stretches = Vec::new();
    let outputs = &mut [&mut write];
    strata_runtime::zip_ranges(
        [(&read, 0, 4)],
        outputs,
        [(0, 4 * n, 4)],
        n,
        |first, [x], [y]| stretches.push((first, x, y)),
    )
    .unwrap();
    assert!(stretches.len() > 2, "{} stretches", stretches.len());
    for (first, x, y) in stretches {
        let (x, y): (&[f32], &mut [f32]) = (bytemuck::cast_slice(x), bytemuck::cast_slice_mut(y));
        assert_eq!(x[0], first as f32);
        for (y, x) in y.iter_mut().zip(x) {
            *y = 2.0 * x;
        }
    }
    // Past the end: an error naming the range, nothing written.
    let past = strata_runtime::zip_ranges(
        [(&read, 4, 4)],
        &mut [],
        [],
        n,
        |_, _, _: [&mut [u8]; 0]| panic!("walked a range past the tensor's end"),
    );
    assert!(past.unwrap_err().to_string().contains("range"));
    // Sizes whose bytes wrap (2^62 x 4 is 0 in u64) or are zero: errors,
    // not ranges that pass the checks and are then walked.
    for (elems, elem) in [(1u64 << 62, 4u64), (n, 0)] {
        let wrapped = strata_runtime::zip_ranges(
            [(&read, 0, elem)],
            &mut [],
            [],
            elems,
            |_, _, _: [&mut [u8]; 0]| panic!("walked a range of {elems} x {elem} bytes"),
        );
        let err = wrapped.unwrap_err().to_string();
        assert!(err.contains("range") && err.contains("bytes"), "{err}");
    }
    drop((read, write));
    let out = read_back_range(&runtime, b, 4 * n, n);
    assert!(out.iter().enumerate().all(|(i, y)| *y == 2.0 * i as f32));
}

fn read_back_range(runtime: &Runtime, id: TensorId, offset: u64, n: u64) -> Vec<f32> {
    let guard = runtime.acquire(id, Tier::Host, Access::Read).unwrap();
    let mut out = vec![0f32; n as usize];
    guard
        .read_range(offset, bytemuck::cast_slice_mut(&mut out))
        .unwrap();
    out
}

/// A swap extent whose checksum fails is reported as corrupt, never as an
/// intact copy, and its bytes are not handed out.
#[test]
fn a_corrupt_swap_copy_is_named_corrupt_not_intact() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let runtime = Runtime::new(&config(dir.path(), 1 << 20, 1 << 20)).unwrap();
    let bytes = 2 * 65536;
    let id = runtime.register(meta("w", bytes), Tier::Host).unwrap();
    fill(&runtime, id, Tier::Host, &pattern(3, bytes as usize));
    runtime.move_to(id, Tier::Nvme).unwrap().wait().unwrap();
    assert_eq!(runtime.residency(id).unwrap(), vec![Tier::Nvme]);
    // Flip every bit of every swap file.
    for entry in walk(dir.path()) {
        let mut data = std::fs::read(&entry).unwrap();
        data.iter_mut().for_each(|b| *b = !*b);
        std::fs::write(&entry, data).unwrap();
    }
    let err = match runtime.move_to(id, Tier::Host) {
        Ok(completion) => completion.wait().unwrap_err(),
        Err(err) => err,
    };
    let text = err.to_string();
    assert!(
        text.contains("checksum mismatch") && text.contains("nvme copy is corrupt"),
        "{text}"
    );
    assert!(!text.contains("intact"), "{text}");
    assert_eq!(text.matches("checksum mismatch").count(), 1, "{text}");
}

fn walk(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            files.extend(walk(&path));
        } else {
            files.push(path);
        }
    }
    files
}

/// Bytes at `address`, read behind the runtime's back.
fn raw_bytes(address: u64, len: usize) -> Vec<u8> {
    // SAFETY: the address lies in the CPU device's arena or the pinned pool, which live as long as the runtime the caller holds, and no thread writes these bytes while the test reads them.
    unsafe { std::slice::from_raw_parts(address as *const u8, len) }.to_vec()
}

/// `runtime.poison_released`: a released device range and released host
/// buffers read NaN (0xFF bytes) once their last use has passed, never
/// before, and the tensor's remaining copy keeps its bytes.
#[test]
fn released_memory_is_poisoned_once_its_last_use_passes_and_not_before() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let mut config = config(dir.path(), 64 << 10, 1 << 20);
    config.runtime.poison_released = true;
    let runtime = Runtime::new(&config).unwrap();
    let data = pattern(7, 65536);
    assert!(data.chunks(4).all(|f| f != [0xFF; 4]));
    let id = runtime.register(meta("w", 65536), Tier::Host).unwrap();
    fill(&runtime, id, Tier::Host, &data);
    runtime.move_to(id, Tier::Device).unwrap().wait().unwrap();

    // A device copy still read by enqueued work keeps its bytes.
    let mut guard = runtime.acquire(id, Tier::Device, Access::Read).unwrap();
    let address = guard.device_address().unwrap();
    // Read behind the runtime's back below: wait for the copy to land.
    guard.ready().wait().unwrap();
    let (fence, compute) = strata_device::Fence::host();
    guard.used_until(fence);
    drop(guard);
    runtime.release(id, Tier::Device).unwrap();
    let trigger = || {
        // Any placement frees (and so poisons) the copies whose fences passed.
        let other = runtime.register(meta("x", 4096), Tier::Host).unwrap();
        runtime.free(other).unwrap();
    };
    trigger();
    assert!(raw_bytes(address, 65536) == data, "poisoned while in use");
    compute.finish();
    trigger();
    assert!(
        raw_bytes(address, 65536).iter().all(|b| *b == 0xFF),
        "a released device range past its last use is not poisoned"
    );

    // Host buffers: released once the data is on the device again.
    runtime.move_to(id, Tier::Device).unwrap().wait().unwrap();
    assert_eq!(read(&runtime, id, Tier::Device), data);
    let mut chunks = Vec::new();
    runtime
        .acquire(id, Tier::Host, Access::Read)
        .unwrap()
        .for_each_chunk(&mut |_, bytes| chunks.push((bytes.as_ptr() as u64, bytes.len())))
        .unwrap();
    runtime.release(id, Tier::Host).unwrap();
    trigger();
    for (address, len) in chunks {
        assert!(
            raw_bytes(address, len).iter().all(|b| *b == 0xFF),
            "a released host buffer is not poisoned"
        );
    }
    // The copy that stays is whole.
    assert_eq!(read(&runtime, id, Tier::Device), data);
}

/// `register_unfilled` spends no fill on a tensor written whole: over
/// poisoned memory it reads NaN until written, where `register` zeroes.
#[test]
fn an_unfilled_registration_is_not_zeroed_and_a_filled_one_is() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let mut config = config(dir.path(), 64 << 10, 1 << 20);
    config.runtime.poison_released = true;
    let runtime = Runtime::new(&config).unwrap();
    // The device holds one 64 KiB tensor: each registration gets the same range.
    let first = runtime.register(meta("a", 65536), Tier::Device).unwrap();
    fill(&runtime, first, Tier::Device, &pattern(2, 65536));
    runtime.free(first).unwrap();
    let unfilled = runtime
        .register_unfilled(meta("b", 65536), Tier::Device)
        .unwrap();
    assert!(
        read(&runtime, unfilled, Tier::Device)
            .iter()
            .all(|b| *b == 0xFF)
    );
    fill(&runtime, unfilled, Tier::Device, &pattern(4, 65536));
    assert_eq!(read(&runtime, unfilled, Tier::Device), pattern(4, 65536));
    runtime.free(unfilled).unwrap();
    let zeroed = runtime.register(meta("c", 65536), Tier::Device).unwrap();
    assert!(read(&runtime, zeroed, Tier::Device).iter().all(|b| *b == 0));
}

/// Tensors registered straight on NVMe: filled a chunk at a time from a
/// callback (asked only for the bytes before `zeros_from`, the rest zero)
/// and read back the same way, with nothing of the host budget taken (a
/// stale drive copy is not read), zeroed, or unfilled (a read
/// before the first write is refused, naming the tensor, not stale
/// bytes); a callback's error comes back as itself and leaves nothing
/// registered; without a swap store, refused naming `[nvme] dirs`.
#[test]
fn tensors_registered_on_nvme_are_filled_zeroed_or_unfilled() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let runtime = Runtime::new(&config(dir.path(), 64 << 10, 1 << 20)).unwrap();
    let len = 300 << 10;
    let data = pattern(7, len);
    let zeros_from = 200_000;
    let mut asked = Vec::new();
    let id = runtime
        .register_on_nvme(meta("states", len as u64), zeros_from, &mut |at, bytes| {
            asked.push((at, bytes.len()));
            bytes.copy_from_slice(&data[at as usize..at as usize + bytes.len()]);
            Ok::<(), RuntimeError>(())
        })
        .unwrap();
    // Every byte below zeros_from asked for once, in order, none past it.
    let mut next = 0;
    for &(at, n) in &asked {
        assert_eq!(at, next);
        next += n as u64;
    }
    assert_eq!(next, zeros_from);
    assert_eq!(runtime.residency(id).unwrap(), vec![Tier::Nvme]);
    let mut expected = data.clone();
    expected[zeros_from as usize..].fill(0);
    // Read back a chunk at a time, in order, straight from the drive.
    let mut streamed = Vec::new();
    runtime
        .read_from_nvme(id, &mut |at, bytes| {
            assert_eq!(at, streamed.len() as u64);
            streamed.extend_from_slice(bytes);
            Ok::<(), RuntimeError>(())
        })
        .unwrap();
    assert_eq!(streamed, expected);
    let host = runtime.stats().tier(Tier::Host).peak_bytes;
    assert_eq!(host, 0, "never on the host");
    assert_eq!(read_back(&runtime, id), expected);
    // A copy written on the host since is newer: the drive's is not read.
    fill(&runtime, id, Tier::Host, &pattern(8, len));
    let stale = runtime.read_from_nvme(id, &mut |_, _| Ok::<(), RuntimeError>(()));
    assert!(
        matches!(stale, Err(RuntimeError::NotResident { .. })),
        "{stale:?}"
    );
    runtime.free(id).unwrap();

    let zeroed = runtime.register(meta("m", 192 << 10), Tier::Nvme).unwrap();
    assert!(read_back(&runtime, zeroed).iter().all(|&b| b == 0));
    runtime.free(zeroed).unwrap();

    let unfilled = runtime
        .register_unfilled(meta("next.states", 192 << 10), Tier::Nvme)
        .unwrap();
    let err = runtime
        .move_to(unfilled, Tier::Host)
        .unwrap()
        .wait()
        .unwrap_err();
    assert!(err.to_string().contains("next.states"), "{err}");
    assert!(err.to_string().contains("holds no data"), "{err}");
    runtime.free(unfilled).unwrap();

    type Failed = Box<dyn std::error::Error>;
    let failed = runtime.register_on_nvme(meta("bad", 192 << 10), u64::MAX, &mut |at, _| {
        if at > 0 {
            Err(Failed::from("the source ran dry"))
        } else {
            Ok(())
        }
    });
    assert_eq!(failed.unwrap_err().to_string(), "the source ran dry");
    assert_eq!(
        runtime.stats().tier(Tier::Nvme).used_bytes,
        0,
        "nothing left registered"
    );

    let mut no_store = config(dir.path(), 64 << 10, 128 << 10);
    no_store.nvme = None;
    let runtime = Runtime::new(&no_store).unwrap();
    let err = runtime.register(meta("x", 4096), Tier::Nvme).unwrap_err();
    assert!(err.to_string().contains("[nvme] dirs"), "{err}");
}
