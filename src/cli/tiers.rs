//! `strata bench tiers`: every path through the runtime next to the raw path.

use anyhow::bail;
use clap::Args;
use serde::Serialize;
use strata_runtime::bench::{TiersRound, TiersSpec, tiers_vs_raw};
use strata_runtime::{DeviceChoice, DeviceConfig, Link};
use strata_storage::ByteSize;

/// Options of `strata bench tiers`.
#[derive(Args, Debug)]
pub struct TiersArgs {
    #[command(flatten)]
    drive: super::DriveArgs,
    /// Tensor size moved on every path.
    #[arg(long, default_value = "1GiB")]
    size: ByteSize,
    /// auto, cpu or cuda.
    #[arg(long, default_value = "auto")]
    device: DeviceChoice,
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    ordinal: usize,
    /// Rounds (runtime and raw alternate which goes first); medians reported.
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

#[derive(Serialize)]
struct Row {
    path: &'static str,
    bytes_per_s: f64,
    raw_bytes_per_s: f64,
    ratio: f64,
}

#[derive(Serialize)]
struct Report {
    device: String,
    size: u64,
    rounds: usize,
    results: Vec<Row>,
}

/// Runs the comparison and prints medians and ratios.
pub fn run(args: TiersArgs) -> anyhow::Result<()> {
    if args.rounds == 0 {
        bail!("--rounds must be at least 1");
    }
    let size = args.size.0;
    if size == 0 || !size.is_multiple_of(4096) {
        bail!(
            "--size {}: use a positive multiple of 4 KiB (e.g. 1GiB)",
            args.size
        );
    }
    // The tensor in the pinned pool and the raw path's own buffer, and
    // unless the device is a GPU its arena: two or three times the size.
    let copies: u64 = if args.device == DeviceChoice::Cuda {
        2
    } else {
        3
    };
    let available = strata_storage::sys::mem_available_bytes().unwrap_or(u64::MAX);
    if size.saturating_mul(copies) > available {
        let arena = if copies == 3 {
            ", the CPU device's arena"
        } else {
            ""
        };
        let available_gib = available as f64 / f64::from(1u32 << 30);
        bail!(
            "--size {} needs about {copies} x that in host memory (the pool, the raw path's buffer{arena}), more than the {available_gib:.1} GiB available: lower --size",
            args.size,
        );
    }
    let spec = TiersSpec {
        nvme: args.drive.storage_config()?,
        device: DeviceConfig {
            kind: args.device,
            ordinal: args.ordinal,
            ..Default::default()
        },
        size_bytes: args.size.0,
        rounds: args.rounds,
    };
    let bar = super::progress_bar(
        args.rounds as u64,
        args.json,
        "{msg} [{bar:32}] round {pos}/{len}",
    );
    bar.set_message("runtime vs raw, every link");
    let (device, rounds) = tiers_vs_raw(&spec, &mut |done| bar.set_position(done as u64))?;
    bar.finish_and_clear();
    let column = |f: &dyn Fn(&TiersRound) -> f64| {
        super::median(&mut rounds.iter().map(f).collect::<Vec<_>>())
    };
    let results: Vec<Row> = Link::ALL
        .iter()
        .map(|link| {
            let i = link.index();
            Row {
                path: link.name(),
                bytes_per_s: column(&|r| r.runtime_bytes_per_s[i]).round(),
                raw_bytes_per_s: column(&|r| r.raw_bytes_per_s[i]).round(),
                ratio: column(&|r| r.runtime_bytes_per_s[i] / r.raw_bytes_per_s[i]),
            }
        })
        .collect();
    let report = Report {
        device,
        size: args.size.0,
        rounds: args.rounds,
        results,
    };
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
        return Ok(());
    }
    println!(
        "{} tensor on {}, {} rounds alternating, medians:",
        args.size, report.device, args.rounds
    );
    println!(
        "{:<14} {:>14} {:>10} {:>8}",
        "path", "runtime GB/s", "raw GB/s", "ratio"
    );
    for row in &report.results {
        println!(
            "{:<14} {:>14.2} {:>10.2} {:>8.3}",
            row.path,
            row.bytes_per_s / 1e9,
            row.raw_bytes_per_s / 1e9,
            row.ratio
        );
    }
    println!(
        "raw: host<->nvme is the storage engine over the same swap blocks; host<->device is one memcpy (cpu) or one cudaMemcpyAsync from pinned memory (cuda)"
    );
    Ok(())
}
