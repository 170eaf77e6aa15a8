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
enum EngineSelect {
    Uring,
    Threads,
    All,
}

/// Options of `strata bench nvme`. Every option that takes a list sweeps it.
#[derive(Args, Debug)]
pub struct NvmeArgs {
    /// Directories on the drives to measure, one test file each (default:
    /// ./strata-nvme-bench, created and removed).
    #[arg(long, value_delimiter = ',')]
    dir: Vec<PathBuf>,
    /// Sizes of the test file; every point moves all of it.
    #[arg(long, value_delimiter = ',', default_value = "1GiB")]
    size: Vec<ByteSize>,
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
    engine: Vec<EngineSelect>,
    /// Rings (submitting threads), each over its own slice of the file.
    #[arg(long, value_delimiter = ',', default_value = "1")]
    rings: Vec<usize>,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
    /// Draw the sweep (GB/s against queue depth) as an SVG chart.
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Keep the laid-out test files for the next run.
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
    dir: PathBuf,
    size: u64,
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
    results: Vec<ResultRow>,
    best: Best,
}

/// One point, with the drive and file size it was measured on.
struct Measured {
    dir: PathBuf,
    size: u64,
    point: PointResult,
}

fn specs(args: &NvmeArgs) -> anyhow::Result<Vec<PointSpec>> {
    let uring = probe_uring();
    let mut engines = Vec::new();
    for choice in &args.engine {
        match (choice, &uring) {
            (EngineSelect::Uring, Err(reason)) => bail!(
                "--engine uring: io_uring is unavailable here ({reason}); use --engine threads"
            ),
            (EngineSelect::All, Err(reason)) => {
                tracing::warn!("skipping the uring engine: {reason}");
                engines.push(EngineKind::Threads);
            }
            (EngineSelect::All, Ok(())) => engines.extend([EngineKind::Uring, EngineKind::Threads]),
            (EngineSelect::Uring, Ok(())) => engines.push(EngineKind::Uring),
            (EngineSelect::Threads, _) => engines.push(EngineKind::Threads),
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
    if let Some(path) = &args.plot {
        super::chart::check_plot_path(path)?;
    }
    if let Some(zero) = args.block_size.iter().find(|b| b.0 == 0) {
        bail!("--block-size {zero}: a block must be positive (e.g. 1MiB)");
    }
    let specs = specs(&args)?;
    for size in &args.size {
        if size.0 == 0 {
            bail!("--size must be positive (e.g. 1GiB)");
        }
        for block in &args.block_size {
            if size.0 % block.0 != 0 {
                bail!(
                    "--size {size} is not a multiple of --block-size {block}: use a size that is"
                );
            }
        }
    }
    let (dirs, created) = if args.dir.is_empty() {
        let dir = PathBuf::from(DEFAULT_DIR);
        let created = !dir.exists();
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        (vec![dir], created)
    } else {
        (args.dir.clone(), false)
    };
    let per_dir: u64 = args
        .size
        .iter()
        .map(|s| s.0 * (specs.len() as u64 + 1))
        .sum();
    let bar = super::progress_bar(
        per_dir * dirs.len() as u64,
        args.json,
        "{msg:36} [{bar:32}] {bytes}/{total_bytes} {binary_bytes_per_sec}",
    );
    let mut measured = Vec::with_capacity(specs.len() * dirs.len() * args.size.len());
    for dir in &dirs {
        for size in &args.size {
            bar.set_message(format!("laying out {size} in {}", dir.display()));
            let file = TestFile::prepare(dir, size.0)?;
            bar.inc(size.0);
            for spec in &specs {
                let label = format!(
                    "{} {} {} qd{}",
                    spec.op,
                    spec.engine,
                    ByteSize(spec.block_bytes),
                    spec.queue_depth
                );
                bar.set_message(label);
                let point = file.run(*spec, &mut |bytes| bar.inc(bytes))?;
                tracing::debug!(?point, "point measured");
                measured.push(Measured {
                    dir: dir.clone(),
                    size: size.0,
                    point,
                });
            }
            if args.keep {
                tracing::info!("kept the test file {}", file.path().display());
            } else {
                file.remove()?;
            }
        }
    }
    bar.finish_and_clear();
    if created && !args.keep {
        let _ = std::fs::remove_dir(&dirs[0]);
    }
    let best = best(&measured).context("the sweep measured nothing")?;
    let report = Report {
        results: measured.iter().map(row).collect(),
        best: best.clone(),
    };
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print_table(&report, dirs.len() > 1 || args.size.len() > 1);
        print_recommendation(&dirs, &best, measured.len());
    }
    // After the results: a chart that fails loses nothing measured.
    if let Some(path) = &args.plot {
        plot(path, &measured)?;
        if !args.json {
            println!("chart: {}", path.display());
        }
    }
    Ok(())
}

fn row(measured: &Measured) -> ResultRow {
    let result = &measured.point;
    ResultRow {
        dir: measured.dir.clone(),
        size: measured.size,
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
type ReadWrite = (Option<f64>, Option<f64>);

fn lower(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// The configuration with the best harmonic mean of read and write bandwidth
/// on its slowest drive and size (a stripe runs at its slowest member's
/// speed); among those within 3% of it, the one pinning the least buffer memory.
fn best(measured: &[Measured]) -> Option<Best> {
    let mut configs: BTreeMap<ConfigKey, ReadWrite> = BTreeMap::new();
    for m in measured {
        let spec = m.point.spec;
        let entry = configs
            .entry((spec.engine, spec.block_bytes, spec.queue_depth, spec.rings))
            .or_default();
        match spec.op {
            Op::Read => entry.0 = lower(entry.0, Some(m.point.bw_bytes)),
            Op::Write => entry.1 = lower(entry.1, Some(m.point.bw_bytes)),
        }
    }
    let score = |(read, write): &ReadWrite| match (read, write) {
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

fn print_table(report: &Report, show_file: bool) {
    if show_file {
        print!("{:<24} {:>7} ", "dir", "size");
    }
    println!(
        "{:<6} {:<8} {:>7} {:>5} {:>5} {:>8} {:>9} {:>10} {:>10}",
        "rw", "engine", "block", "qd", "rings", "GB/s", "IOPS", "p50 us", "p99 us"
    );
    for row in &report.results {
        if show_file {
            print!(
                "{:<24} {:>7} ",
                row.dir.display().to_string(),
                ByteSize(row.size).to_string()
            );
        }
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

fn print_recommendation(dirs: &[PathBuf], best: &Best, points: usize) {
    let show =
        |bw: Option<f64>| bw.map_or("not measured".to_string(), |b| format!("{} GB/s", gbps(b)));
    println!();
    println!(
        "Best of {points} points (within 3% of the fastest on the slowest drive, least buffer memory): read {}, write {}.",
        show(best.read_bw_bytes),
        show(best.write_bw_bytes)
    );
    println!(
        "Paste into the config of `strata train --config` (with placement.params or placement.optimizer = \"nvme\"; add capacity = the room a rank may use):"
    );
    println!();
    println!("[nvme]");
    let dirs: Vec<String> = dirs
        .iter()
        .map(|d| format!("{:?}", d.display().to_string()))
        .collect();
    println!("dirs = [{}]", dirs.join(", "));
    println!("engine = \"{}\"", best.engine);
    println!("block_size = \"{}\"", ByteSize(best.block_size));
    println!("queue_depth = {}", best.queue_depth);
    println!("rings = {}", best.rings);
}

fn plot(path: &std::path::Path, measured: &[Measured]) -> anyhow::Result<()> {
    let several = measured
        .iter()
        .any(|m| m.dir != measured[0].dir || m.size != measured[0].size);
    let mut lines: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
    for m in measured {
        let spec = m.point.spec;
        let mut name = format!(
            "{} {} {} x{}",
            spec.op,
            spec.engine,
            ByteSize(spec.block_bytes),
            spec.rings
        );
        if several {
            name = format!("{name} {} {}", m.dir.display(), ByteSize(m.size));
        }
        lines
            .entry(name)
            .or_default()
            .push((spec.queue_depth as f64, m.point.bw_bytes / 1e9));
    }
    let series: Vec<Series> = lines
        .into_iter()
        .map(|(name, mut points)| {
            points.sort_by(|a, b| a.0.total_cmp(&b.0));
            Series { name, points }
        })
        .collect();
    let dirs: std::collections::BTreeSet<String> = measured
        .iter()
        .map(|m| m.dir.display().to_string())
        .collect();
    let title = format!(
        "strata bench nvme: {}",
        dirs.into_iter().collect::<Vec<_>>().join(", ")
    );
    line_chart(
        path,
        &title,
        "queue depth (requests in flight per ring)",
        "GB/s",
        &series,
        true,
    )
}
