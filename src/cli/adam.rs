//! `strata bench adam`: params/s and bytes/s of every CPU optimizer kernel
//! per size, thread count and instruction set, next to the memory roofline
//! measured in the same run.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::Args;
use serde::Serialize;
use strata::optim::bench::{BenchBuffers, BenchKernel, buffer_bytes, measure};
use strata::optim::{Isa, Pool, PoolConfig};

use super::chart::{Series, line_chart};
use super::{median, progress_bar};

/// Arguments of `strata bench adam`.
#[derive(Args, Debug)]
pub struct AdamArgs {
    /// Parameters per step: counts, with K/M/G meaning 2^10/2^20/2^30.
    #[arg(long, value_delimiter = ',', default_value = "1M,4M,16M,64M,256M")]
    params: Vec<String>,
    /// Thread counts; "all" is one per physical core.
    #[arg(long, value_delimiter = ',', default_value = "1,all")]
    threads: Vec<String>,
    /// Kernels to run (default: all of them).
    #[arg(long, value_delimiter = ',')]
    kernels: Vec<BenchKernel>,
    /// Instruction sets: "best", "all", or names (portable, avx2, avx512,
    /// avx512vaes, avx512bf16).
    #[arg(long, value_delimiter = ',', default_value = "best")]
    isa: Vec<String>,
    /// Rounds; each runs every kernel once, interleaved; medians reported.
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Minimum milliseconds per kernel per round (short kernels repeat).
    #[arg(long, default_value_t = 100)]
    round_ms: u64,
    /// Print one JSON document instead of a table.
    #[arg(long)]
    json: bool,
    /// Also draw params/s against size as an SVG chart.
    #[arg(long)]
    plot: Option<PathBuf>,
}

#[derive(Serialize, Debug)]
struct ResultRow {
    kernel: &'static str,
    isa: &'static str,
    params: usize,
    threads: usize,
    params_per_s: f64,
    bytes_per_s: f64,
    /// bytes/s over roofline_4r3w's at the same size, threads and isa.
    roofline_fraction: Option<f64>,
    seconds_median: f64,
    rounds: usize,
}

#[derive(Serialize)]
struct Report<'a> {
    results: &'a [ResultRow],
    /// Elements ahead of their loads the kernels prefetched (0: none).
    prefetch_elems: usize,
}

/// Parses "67108864", "64M", "1G".
fn parse_count(text: &str) -> anyhow::Result<usize> {
    let text = text.trim();
    let (digits, shift) = match text.chars().last() {
        Some('K' | 'k') => (&text[..text.len() - 1], 10),
        Some('M' | 'm') => (&text[..text.len() - 1], 20),
        Some('G' | 'g') => (&text[..text.len() - 1], 30),
        _ => (text, 0),
    };
    let count: usize = digits
        .parse()
        .with_context(|| format!("--params {text:?}: give a count such as 67108864 or 64M"))?;
    let count = count.checked_shl(shift).filter(|&n| n >> shift == count);
    match count {
        Some(n) if (1..=1 << 34).contains(&n) => Ok(n),
        _ => bail!("--params {text:?} is out of range: choose 1 to 16G parameters"),
    }
}

fn parse_threads(text: &str) -> anyhow::Result<Option<usize>> {
    match text.trim() {
        "all" => Ok(None),
        n => n
            .parse::<usize>()
            .ok()
            .filter(|&n| n >= 1)
            .map(Some)
            .with_context(|| format!("--threads {n:?}: give a count >= 1 or \"all\"")),
    }
}

fn parse_isas(names: &[String]) -> anyhow::Result<Vec<Isa>> {
    let mut isas = Vec::new();
    for name in names {
        match name.trim() {
            "best" => isas.push(Isa::chosen()),
            "all" => isas.extend(Isa::available()),
            other => isas.push(Isa::parse_available(other)?),
        }
    }
    isas.sort();
    isas.dedup();
    Ok(isas)
}

/// Runs the sweep.
pub fn run(args: AdamArgs) -> anyhow::Result<()> {
    if let Some(path) = &args.plot {
        super::chart::check_plot_path(path)?;
    }
    let mut sizes = args
        .params
        .iter()
        .map(|p| parse_count(p))
        .collect::<anyhow::Result<Vec<_>>>()?;
    sizes.dedup();
    let threads = args
        .threads
        .iter()
        .map(|t| parse_threads(t))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let isas = parse_isas(&args.isa)?;
    let kernels = if args.kernels.is_empty() {
        BenchKernel::ALL.to_vec()
    } else {
        args.kernels.clone()
    };
    if args.rounds == 0 {
        bail!("--rounds must be at least 1");
    }
    if let (Some(&largest), Some(available)) = (
        sizes.iter().max(),
        strata_storage::sys::mem_available_bytes(),
    ) {
        let needed = buffer_bytes(largest, &kernels);
        if needed > available {
            bail!(
                "{largest} parameters need {:.1} GiB of buffers for these kernels but only {:.1} GiB of memory is available: lower --params",
                needed as f64 / (1u64 << 30) as f64,
                available as f64 / (1u64 << 30) as f64
            );
        }
    }
    let pools = pools(&threads, &isas)?;
    let total = (sizes.len() * pools.len() * args.rounds * kernels.len()) as u64;
    let bar = progress_bar(
        total,
        args.json,
        "{bar:40} {pos}/{len} kernel runs {msg} ({elapsed})",
    );
    let mut results = Vec::new();
    for &params in &sizes {
        let mut buffers = BenchBuffers::new(params);
        for pool in &pools {
            bar.set_message(format!(
                "{params} params, {} threads, {}",
                pool.threads(),
                pool.isa()
            ));
            let round_min = Duration::from_millis(args.round_ms);
            let samples = measure(pool, &mut buffers, &kernels, args.rounds, round_min, || {
                bar.inc(1)
            })?;
            results.extend(rows(params, pool, samples));
        }
    }
    bar.finish_and_clear();
    if args.json {
        let report = Report {
            results: &results,
            prefetch_elems: strata::optim::prefetch_elems(),
        };
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print_table(&results);
        println!(
            "kernels prefetch {} elements ahead of their loads (STRATA_PREFETCH_ELEMS; 0: none)",
            strata::optim::prefetch_elems()
        );
    }
    if let Some(path) = &args.plot {
        plot(path, &results)?;
    }
    Ok(())
}

fn pools(threads: &[Option<usize>], isas: &[Isa]) -> anyhow::Result<Vec<Pool>> {
    let mut pools: Vec<Pool> = Vec::new();
    for &isa in isas {
        for &count in threads {
            let pool = Pool::new(PoolConfig {
                threads: count,
                isa: Some(isa),
                ..PoolConfig::default()
            })?;
            if !pools
                .iter()
                .any(|p| p.threads() == pool.threads() && p.isa() == isa)
            {
                pools.push(pool);
            }
        }
    }
    Ok(pools)
}

fn rows(
    params: usize,
    pool: &Pool,
    samples: Vec<strata::optim::bench::BenchSample>,
) -> Vec<ResultRow> {
    let mut rows: Vec<ResultRow> = samples
        .into_iter()
        .map(|mut sample| {
            let rounds = sample.seconds.len();
            let seconds = median(&mut sample.seconds);
            let params_per_s = params as f64 / seconds;
            ResultRow {
                kernel: sample.kernel.name(),
                isa: pool.isa().name(),
                params,
                threads: pool.threads(),
                params_per_s,
                bytes_per_s: params_per_s * sample.kernel.bytes_per_param() as f64,
                roofline_fraction: None,
                seconds_median: seconds,
                rounds,
            }
        })
        .collect();
    let roofline = rows
        .iter()
        .find(|r| r.kernel == BenchKernel::Roofline4r3w.name())
        .map(|r| r.bytes_per_s);
    if let Some(roofline) = roofline {
        rows.iter_mut()
            .for_each(|r| r.roofline_fraction = Some(r.bytes_per_s / roofline));
    }
    rows
}

fn print_table(results: &[ResultRow]) {
    println!(
        "{:<26} {:>10} {:>11} {:>7} {:>12} {:>9} {:>11}",
        "kernel", "isa", "params", "threads", "Gparams/s", "GB/s", "of roofline"
    );
    for r in results {
        let fraction = r
            .roofline_fraction
            .map_or("-".to_string(), |f| format!("{:.0}%", f * 100.0));
        println!(
            "{:<26} {:>10} {:>11} {:>7} {:>12.3} {:>9.2} {:>11}",
            r.kernel,
            r.isa,
            r.params,
            r.threads,
            r.params_per_s / 1e9,
            r.bytes_per_s / 1e9,
            fraction
        );
    }
}

fn plot(path: &std::path::Path, results: &[ResultRow]) -> anyhow::Result<()> {
    let mut series: Vec<Series> = Vec::new();
    for r in results {
        let name = format!("{} {}T {}", r.kernel, r.threads, r.isa);
        let point = (r.params as f64, r.params_per_s / 1e9);
        match series.iter_mut().find(|s| s.name == name) {
            Some(s) => s.points.push(point),
            None => series.push(Series {
                name,
                points: vec![point],
            }),
        }
    }
    line_chart(
        path,
        "CPU optimizer kernels",
        "parameters",
        "G params/s",
        &series,
        true,
    )?;
    eprintln!("chart written to {}", path.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_parse_with_binary_suffixes_and_refuse_nonsense() {
        assert_eq!(parse_count("67108864").unwrap(), 67_108_864);
        assert_eq!(parse_count("64M").unwrap(), 67_108_864);
        assert_eq!(parse_count("1k").unwrap(), 1024);
        assert!(parse_count("0").is_err());
        assert!(
            parse_count("lots")
                .unwrap_err()
                .to_string()
                .contains("--params")
        );
        assert!(parse_count("99999G").is_err());
        assert_eq!(parse_threads("all").unwrap(), None);
        assert!(parse_threads("0").is_err());
    }
}
