//! `strata bench swap`: a tensor through the swap store against the raw engine.

use anyhow::bail;
use clap::Args;
use serde::Serialize;
use strata_storage::ByteSize;
use strata_storage::bench::{SwapRound, swap_vs_raw};

/// Options of `strata bench swap`.
#[derive(Args, Debug)]
pub struct SwapArgs {
    #[command(flatten)]
    drive: super::DriveArgs,
    /// Tensor size.
    #[arg(long, default_value = "1GiB")]
    size: ByteSize,
    /// Alternating rounds (raw, then store), medians reported.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

#[derive(Serialize)]
struct Report {
    size: u64,
    rounds: usize,
    raw_write_bw_bytes: f64,
    store_write_bw_bytes: f64,
    write_ratio: f64,
    raw_read_bw_bytes: f64,
    store_read_bw_bytes: f64,
    read_ratio: f64,
}

/// Runs the comparison and prints medians and ratios.
pub fn run(args: SwapArgs) -> anyhow::Result<()> {
    if args.rounds == 0 {
        bail!("--rounds must be at least 1");
    }
    let config = args.drive.storage_config()?;
    let bar = super::progress_bar(
        args.rounds as u64,
        args.json,
        "{msg} [{bar:32}] round {pos}/{len}",
    );
    bar.set_message("raw engine vs swap store");
    let rounds = swap_vs_raw(&config, args.size.0, args.rounds, &mut |done| {
        bar.set_position(done as u64)
    })?;
    bar.finish_and_clear();
    let column =
        |f: fn(&SwapRound) -> f64| super::median(&mut rounds.iter().map(f).collect::<Vec<_>>());
    let report = Report {
        size: args.size.0,
        rounds: args.rounds,
        raw_write_bw_bytes: column(|r| r.raw_write_bw_bytes).round(),
        store_write_bw_bytes: column(|r| r.store_write_bw_bytes).round(),
        write_ratio: column(|r| r.store_write_bw_bytes / r.raw_write_bw_bytes),
        raw_read_bw_bytes: column(|r| r.raw_read_bw_bytes).round(),
        store_read_bw_bytes: column(|r| r.store_read_bw_bytes).round(),
        read_ratio: column(|r| r.store_read_bw_bytes / r.raw_read_bw_bytes),
    };
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
        return Ok(());
    }
    println!(
        "{} tensor, {} rounds alternating, medians:",
        args.size, args.rounds
    );
    println!(
        "{:<6} {:>12} {:>16} {:>8}",
        "", "raw GB/s", "swap store GB/s", "ratio"
    );
    println!(
        "{:<6} {:>12.2} {:>16.2} {:>8.3}",
        "write",
        report.raw_write_bw_bytes / 1e9,
        report.store_write_bw_bytes / 1e9,
        report.write_ratio
    );
    println!(
        "{:<6} {:>12.2} {:>16.2} {:>8.3}",
        "read",
        report.raw_read_bw_bytes / 1e9,
        report.store_read_bw_bytes / 1e9,
        report.read_ratio
    );
    Ok(())
}
