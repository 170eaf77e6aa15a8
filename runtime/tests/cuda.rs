//! The same residency paths on a CUDA device. Skipped, saying why, where no
//! GPU can be used; run for real on a GPU machine.

use strata_runtime::bench::{TiersSpec, tiers_vs_raw};
use strata_runtime::{
    Access, DeviceChoice, DeviceConfig, Dtype, Link, Runtime, RuntimeConfig, TensorKind,
    TensorMeta, Tier,
};
use strata_storage::{ByteSize, StorageConfig};

fn gpu_or_skip(test: &str) -> bool {
    match strata_runtime::device::cuda_available() {
        Ok(()) => true,
        Err(reason) => {
            eprintln!("skipped {test}: no CUDA device ({reason})");
            false
        }
    }
}

#[test]
fn cuda_round_trip_keeps_every_byte() {
    if !gpu_or_skip("cuda_round_trip_keeps_every_byte") {
        return;
    }
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let config = RuntimeConfig {
        device: DeviceConfig {
            kind: DeviceChoice::Cuda,
            budget: ByteSize(64 << 20),
            ..Default::default()
        },
        nvme: Some(StorageConfig {
            dirs: vec![dir.path().to_path_buf()],
            capacity: ByteSize(256 << 20),
            ..Default::default()
        }),
        host: strata_runtime::HostConfig {
            budget: ByteSize(256 << 20),
            ..Default::default()
        },
        ..Default::default()
    };
    let runtime = Runtime::new(&config).unwrap();
    let bytes = (40 << 20) + 4096 * 3 + 8;
    let id = runtime
        .register(
            TensorMeta::new("w", TensorKind::Param, Dtype::Bf16, &[bytes / 2]),
            Tier::Device,
        )
        .unwrap();
    let zeros = {
        runtime.move_to(id, Tier::Host).unwrap().wait().unwrap();
        let guard = runtime.acquire(id, Tier::Host, Access::Read).unwrap();
        let mut out = vec![1; bytes as usize];
        guard.read_into(&mut out).unwrap();
        out
    };
    assert!(
        zeros.iter().all(|&b| b == 0),
        "registered on the GPU zeroed"
    );
    let data: Vec<u8> = (0..bytes).map(|i| (i * 31 + 7) as u8).collect();
    runtime
        .acquire(id, Tier::Host, Access::Write)
        .unwrap()
        .write_from(&data)
        .unwrap();
    runtime.move_to(id, Tier::Device).unwrap().wait().unwrap();
    let guard = runtime.acquire(id, Tier::Device, Access::Read).unwrap();
    assert!(guard.device_address().is_some());
    // The GPU copy read through its guard (one synchronous copy).
    let mut direct = vec![0; bytes as usize];
    guard.read_into(&mut direct).unwrap();
    assert_eq!(direct, data, "a GPU copy read through its guard");
    drop(guard);
    runtime.move_to(id, Tier::Nvme).unwrap().wait().unwrap();
    runtime.move_to(id, Tier::Device).unwrap().wait().unwrap();
    runtime.release(id, Tier::Host).unwrap();
    runtime.release(id, Tier::Nvme).unwrap();
    runtime.move_to(id, Tier::Host).unwrap().wait().unwrap();
    let guard = runtime.acquire(id, Tier::Host, Access::Read).unwrap();
    let mut out = vec![0; bytes as usize];
    guard.read_into(&mut out).unwrap();
    assert_eq!(
        out, data,
        "host -> nvme -> host -> device -> host changed bytes"
    );
    assert!(runtime.stats().link(Link::DeviceToHost).bytes >= bytes);
    // Overwritten on the GPU from host bytes, read back there: first with
    // no device copy (fresh space, nothing uploaded), then over one.
    drop(guard);
    runtime.release(id, Tier::Device).ok();
    assert!(!runtime.residency(id).unwrap().contains(&Tier::Device));
    let uploaded = runtime.stats().link(Link::HostToDevice).bytes;
    let flipped: Vec<u8> = data.iter().map(|b| !b).collect();
    runtime.overwrite(id, Tier::Device, &flipped).unwrap();
    assert_eq!(
        runtime.stats().link(Link::HostToDevice).bytes,
        uploaded,
        "a whole overwrite moved the old bytes up first"
    );
    let guard = runtime.acquire(id, Tier::Device, Access::Read).unwrap();
    guard.read_into(&mut out).unwrap();
    assert_eq!(out, flipped, "a GPU copy overwritten through the runtime");
    drop(guard);
    runtime.overwrite(id, Tier::Device, &data).unwrap();
    let guard = runtime.acquire(id, Tier::Device, Access::Read).unwrap();
    guard.read_into(&mut out).unwrap();
    assert_eq!(out, data, "a GPU copy overwritten in place");
}

#[test]
fn cuda_tiny_tiers_bench() {
    if !gpu_or_skip("cuda_tiny_tiers_bench") {
        return;
    }
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let spec = TiersSpec {
        nvme: StorageConfig {
            dirs: vec![dir.path().to_path_buf()],
            ..Default::default()
        },
        device: DeviceConfig {
            kind: DeviceChoice::Cuda,
            ..Default::default()
        },
        size_bytes: 32 << 20,
        rounds: 2,
    };
    let (device, rounds) = tiers_vs_raw(&spec, &mut |_| {}).unwrap();
    assert!(!device.is_empty());
    for round in rounds {
        assert!(round.runtime_bytes_per_s.iter().all(|&bw| bw > 0.0));
    }
}
