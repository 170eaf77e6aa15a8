//! `strata bench nvme`: what the drive does through strata's engines.

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::{Context, bail};
use clap::{Args, ValueEnum};
use serde::Serialize;
use strata_storage::bench::{PointResult, PointSpec, TestFile};
use strata_storage::{ByteSize, EngineKind, Op, probe_uring};

use super::chart::{Series, line_chart};

const DEFAULT_DIR: &str = "strata-nvme-bench";

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum RwChoice {
    Read,
    Write,
    Both,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum EngineChoice {
    Uring,
    Threads,
    All,
}

/// Options of `strata bench nvme`. Every list option sweeps its values.
#[derive(Args, Debug)]
pub struct NvmeArgs {
    /// Directory on the drive to measure (default: ./strata-nvme-bench, created and removed).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Size of the test file; every point moves all of it.
    #[arg(long, default_value = "1GiB")]
    size: ByteSize,
    /// Request sizes.
    #[arg(long, value_delimiter = ',', default_value = "128KiB,1MiB,8MiB")]
    block_size: Vec<ByteSize>,
    /// Requests in flight per ring.
    #[arg(long, value_delimiter = ',', default_value = "1,8,32,128")]
    queue_depth: Vec<usize>,
    /// Direction: read, write or both.
    #[arg(long, value_delimiter = ',', default_value = "both")]
    rw: Vec<RwChoice>,
    /// Engine: uring, threads or all.
    #[arg(long, value_delimiter = ',', default_value = "all")]
    engine: Vec<EngineChoice>,
    /// Rings (submitting threads), each over its own slice of the file.
    #[arg(long, value_delimiter = ',', default_value = "1")]
    rings: Vec<usize>,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
    /// Draw the sweep (GB/s against queue depth) as an SVG chart.
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Keep the laid-out test file for the next run.
    #[arg(long)]
    keep: bool,
}

#[derive(Serialize)]
struct Latency {
    p50: u64,
    p99: u64,
}

#[derive(Serialize)]
struct ResultRow {
    rw: Op,
    engine: EngineKind,
    block_size: u64,
    queue_depth: usize,
    rings: usize,
    bw_bytes: f64,
    iops: f64,
    lat_ns: Latency,
}

#[derive(Serialize, Clone)]
struct Best {
    engine: EngineKind,
    block_size: u64,
    queue_depth: usize,
    rings: usize,
    read_bw_bytes: Option<f64>,
    write_bw_bytes: Option<f64>,
}

#[derive(Serialize)]
struct Report {
    dir: PathBuf,
    size: u64,
    results: Vec<ResultRow>,
    best: Best,
}

fn specs(args: &NvmeArgs) -> anyhow::Result<Vec<PointSpec>> {
    let uring = probe_uring();
    let mut engines = Vec::new();
    for choice in &args.engine {
        match (choice, &uring) {
            (EngineChoice::Uring, Err(reason)) => bail!(
                "--engine uring: io_uring is unavailable here ({reason}); use --engine threads"
            ),
            (EngineChoice::All, Err(reason)) => {
                tracing::warn!("skipping the uring engine: {reason}");
                engines.push(EngineKind::Threads);
            }
            (EngineChoice::All, Ok(())) => engines.extend([EngineKind::Uring, EngineKind::Threads]),
            (EngineChoice::Uring, Ok(())) => engines.push(EngineKind::Uring),
            (EngineChoice::Threads, _) => engines.push(EngineKind::Threads),
        }
    }
    let mut ops = Vec::new();
    for rw in &args.rw {
        match rw {
            RwChoice::Read => ops.push(Op::Read),
            RwChoice::Write => ops.push(Op::Write),
            // Write first: it overwrites the laid-out file before it is read.
            RwChoice::Both => ops.extend([Op::Write, Op::Read]),
        }
    }
    dedup(&mut engines);
    dedup(&mut ops);
    for &depth in &args.queue_depth {
        if !(1..=strata_storage::QUEUE_DEPTH_MAX).contains(&depth) {
            bail!(
                "--queue-depth {depth} is out of range: use 1 to {}",
                strata_storage::QUEUE_DEPTH_MAX
            );
        }
    }
    for &rings in &args.rings {
        if !(1..=strata_storage::RINGS_MAX).contains(&rings) {
            bail!(
                "--rings {rings} is out of range: use 1 to {}",
                strata_storage::RINGS_MAX
            );
        }
    }
    let mut specs = Vec::new();
    for &engine in &engines {
        for &block in &args.block_size {
            for &queue_depth in &args.queue_depth {
                for &rings in &args.rings {
                    for &op in &ops {
                        specs.push(PointSpec {
                            op,
                            engine,
                            block_bytes: block.0,
                            queue_depth,
                            rings,
                        });
                    }
                }
            }
        }
    }
    Ok(specs)
}

fn dedup<T: PartialEq + Copy>(items: &mut Vec<T>) {
    let mut seen = Vec::new();
    items.retain(|item| {
        let fresh = !seen.contains(item);
        seen.push(*item);
        fresh
    });
}

/// Runs the sweep and prints the table (or JSON) and the recommendation.
pub fn run(args: NvmeArgs) -> anyhow::Result<()> {
    let specs = specs(&args)?;
    if args.size.0 == 0 {
        bail!("--size must be positive (e.g. 1GiB)");
    }
    for block in &args.block_size {
        if block.0 == 0 || !args.size.0.is_multiple_of(block.0) {
            bail!(
                "--size {} is not a multiple of --block-size {block}: use a size that is",
                args.size
            );
        }
    }
    let (dir, created) = match &args.dir {
        Some(dir) => (dir.clone(), false),
        None => {
            let dir = PathBuf::from(DEFAULT_DIR);
            let created = !dir.exists();
            std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
            (dir, created)
        }
    };
    let bar = super::progress_bar(
        args.size.0 * (specs.len() as u64 + 1),
        args.json,
        "{msg:28} [{bar:32}] {bytes}/{total_bytes} {binary_bytes_per_sec}",
    );
    bar.set_message("laying out the test file");
    let file = TestFile::prepare(&dir, args.size.0)?;
    bar.inc(args.size.0);
    let mut results = Vec::with_capacity(specs.len());
    for spec in &specs {
        bar.set_message(format!(
            "{} {} {} qd{}",
            spec.op,
            spec.engine,
            ByteSize(spec.block_bytes),
            spec.queue_depth
        ));
        let result = file.run(*spec, &mut |bytes| bar.inc(bytes))?;
        tracing::debug!(?result, "point measured");
        results.push(result);
    }
    bar.finish_and_clear();
    if args.keep {
        tracing::info!("kept the test file {}", file.path().display());
    } else {
        file.remove()?;
        if created {
            let _ = std::fs::remove_dir(&dir);
        }
    }
    let best = best(&results).context("the sweep measured nothing")?;
    if let Some(path) = &args.plot {
        plot(path, &dir, &results)?;
    }
    let report = Report {
        dir: dir.clone(),
        size: args.size.0,
        results: results.iter().map(row).collect(),
        best: best.clone(),
    };
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print_table(&report);
        print_recommendation(&dir, &best, results.len());
        if let Some(path) = &args.plot {
            println!("chart: {}", path.display());
        }
    }
    Ok(())
}

fn row(result: &PointResult) -> ResultRow {
    ResultRow {
        rw: result.spec.op,
        engine: result.spec.engine,
        block_size: result.spec.block_bytes,
        queue_depth: result.spec.queue_depth,
        rings: result.spec.rings,
        bw_bytes: result.bw_bytes.round(),
        iops: result.iops.round(),
        lat_ns: Latency {
            p50: result.latency_ns_p50,
            p99: result.latency_ns_p99,
        },
    }
}

type ConfigKey = (EngineKind, u64, usize, usize);

/// The configuration with the best harmonic mean of read and write bandwidth;
/// among those within 3% of it, the one pinning the least buffer memory.
fn best(results: &[PointResult]) -> Option<Best> {
    let mut configs: BTreeMap<ConfigKey, (Option<f64>, Option<f64>)> = BTreeMap::new();
    for r in results {
        let key = (
            r.spec.engine,
            r.spec.block_bytes,
            r.spec.queue_depth,
            r.spec.rings,
        );
        let entry = configs.entry(key).or_default();
        match r.spec.op {
            Op::Read => entry.0 = Some(r.bw_bytes),
            Op::Write => entry.1 = Some(r.bw_bytes),
        }
    }
    let score = |(read, write): &(Option<f64>, Option<f64>)| match (read, write) {
        (Some(r), Some(w)) => 2.0 / (1.0 / r + 1.0 / w),
        (Some(x), None) | (None, Some(x)) => *x,
        (None, None) => 0.0,
    };
    let top = configs.values().map(score).fold(0.0, f64::max);
    let memory = |key: &ConfigKey| key.1 * key.2 as u64 * key.3 as u64;
    let (key, bw) = configs
        .iter()
        .filter(|(_, bw)| score(bw) >= 0.97 * top)
        .min_by_key(|(key, _)| memory(key))?;
    Some(Best {
        engine: key.0,
        block_size: key.1,
        queue_depth: key.2,
        rings: key.3,
        read_bw_bytes: bw.0.map(f64::round),
        write_bw_bytes: bw.1.map(f64::round),
    })
}

fn gbps(bytes_per_s: f64) -> String {
    format!("{:.2}", bytes_per_s / 1e9)
}

fn print_table(report: &Report) {
    println!(
        "{:<6} {:<8} {:>7} {:>5} {:>5} {:>8} {:>9} {:>10} {:>10}",
        "rw", "engine", "block", "qd", "rings", "GB/s", "IOPS", "p50 us", "p99 us"
    );
    for row in &report.results {
        println!(
            "{:<6} {:<8} {:>7} {:>5} {:>5} {:>8} {:>9.0} {:>10.1} {:>10.1}",
            row.rw.to_string(),
            row.engine.to_string(),
            ByteSize(row.block_size).to_string(),
            row.queue_depth,
            row.rings,
            gbps(row.bw_bytes),
            row.iops,
            row.lat_ns.p50 as f64 / 1e3,
            row.lat_ns.p99 as f64 / 1e3,
        );
    }
}

fn print_recommendation(dir: &std::path::Path, best: &Best, points: usize) {
    let show =
        |bw: Option<f64>| bw.map_or("not measured".to_string(), |b| format!("{} GB/s", gbps(b)));
    println!();
    println!(
        "Best of {points} points (within 3% of the fastest, least buffer memory): read {}, write {}.",
        show(best.read_bw_bytes),
        show(best.write_bw_bytes)
    );
    println!("Paste into your strata config:");
    println!();
    println!("[storage]");
    println!("dirs = [{:?}]", dir.display().to_string());
    println!("engine = \"{}\"", best.engine);
    println!("block_size = \"{}\"", ByteSize(best.block_size));
    println!("queue_depth = {}", best.queue_depth);
    println!("rings = {}", best.rings);
}

fn plot(
    path: &std::path::Path,
    dir: &std::path::Path,
    results: &[PointResult],
) -> anyhow::Result<()> {
    let mut lines: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
    for r in results {
        let name = format!(
            "{} {} {} x{}",
            r.spec.op,
            r.spec.engine,
            ByteSize(r.spec.block_bytes),
            r.spec.rings
        );
        lines
            .entry(name)
            .or_default()
            .push((r.spec.queue_depth as f64, r.bw_bytes / 1e9));
    }
    let series: Vec<Series> = lines
        .into_iter()
        .map(|(name, mut points)| {
            points.sort_by(|a, b| a.0.total_cmp(&b.0));
            Series { name, points }
        })
        .collect();
    let title = format!("strata bench nvme: {}", dir.display());
    line_chart(
        path,
        &title,
        "queue depth (requests in flight per ring)",
        "GB/s",
        &series,
        true,
    )
}
