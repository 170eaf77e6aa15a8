//! `strata bench tiers`' measurement in a tiny mode, so it cannot rot.

use strata_runtime::bench::{TiersSpec, tiers_vs_raw};
use strata_runtime::{DeviceChoice, DeviceConfig};
use strata_storage::StorageConfig;

#[test]
fn tiny_tiers_bench_runs_every_path() {
    // Under target/, on the real disk: /tmp may be tmpfs, where direct I/O
    // (which the raw side needs) is refused.
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let spec = TiersSpec {
        nvme: StorageConfig {
            dirs: vec![dir.path().to_path_buf()],
            ..Default::default()
        },
        device: DeviceConfig {
            kind: DeviceChoice::Cpu,
            ..Default::default()
        },
        size_bytes: 20 << 20,
        rounds: 2,
    };
    let (device, rounds) = tiers_vs_raw(&spec, &mut |_| {}).unwrap();
    assert!(device.starts_with("cpu device"), "{device}");
    assert_eq!(rounds.len(), 2);
    for round in rounds {
        for link in 0..4 {
            assert!(round.runtime_bytes_per_s[link] > 0.0 && round.raw_bytes_per_s[link] > 0.0);
        }
    }
}
