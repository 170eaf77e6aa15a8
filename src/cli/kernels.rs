//! `strata bench kernels`: the attention's forward and backward and a GEMM
//! on the compute backend, in TFLOPS.

use anyhow::{Context, bail};
use clap::Args;
use serde::Serialize;
use strata_device::Dtype;
use strata_kernels::bench::{KernelBench, KernelRow, run as run_bench};
use strata_kernels::{Attention, Backend, CpuBackend};
use strata_runtime::DeviceChoice;

/// Options of `strata bench kernels`.
#[derive(Args, Debug)]
pub struct KernelsArgs {
    /// auto (cuda when a GPU is present), cpu or cuda.
    #[arg(long, default_value = "auto")]
    device: DeviceChoice,
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    ordinal: usize,
    /// Sequences per attention call [default: 4 on a GPU, 1 on the CPU].
    #[arg(long)]
    batch: Option<usize>,
    /// Tokens per sequence [default: 1024 on a GPU, 256 on the CPU].
    #[arg(long)]
    seq: Option<usize>,
    /// Attention heads [default: 16 on a GPU, 4 on the CPU].
    #[arg(long)]
    heads: Option<usize>,
    /// Head dim [default: 128 on a GPU, 64 on the CPU].
    #[arg(long)]
    head_dim: Option<usize>,
    /// GEMM shape MxNxK [default: 8192x8192x8192 on a GPU, 1024x1024x1024 on
    /// the CPU].
    #[arg(long, value_parser = parse_gemm)]
    gemm: Option<[usize; 3]>,
    /// Input element type, bf16 or f32 [default: bf16 on a GPU; the CPU
    /// backend takes f32 only].
    #[arg(long, value_parser = parse_dtype)]
    dtype: Option<Dtype>,
    /// Rounds; each runs every op, interleaved; medians reported.
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Least milliseconds per op per round (short ops repeat).
    #[arg(long, default_value_t = 200)]
    round_ms: u64,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

fn parse_gemm(text: &str) -> Result<[usize; 3], String> {
    let parts: Vec<&str> = text.split(['x', 'X']).collect();
    let sizes: Option<Vec<usize>> = parts.iter().map(|p| p.trim().parse().ok()).collect();
    match sizes.as_deref() {
        Some(&[m, n, k]) if m > 0 && n > 0 && k > 0 => Ok([m, n, k]),
        _ => Err(format!(
            "{text:?} is not MxNxK with three positive sizes (e.g. 4096x4096x4096)"
        )),
    }
}

fn parse_dtype(text: &str) -> Result<Dtype, String> {
    match text {
        "bf16" => Ok(Dtype::Bf16),
        "f32" | "fp32" => Ok(Dtype::F32),
        other => Err(format!("{other:?} is not bf16 or f32")),
    }
}

#[derive(Serialize)]
struct Row {
    op: &'static str,
    shape: String,
    dtype: &'static str,
    path: &'static str,
    ms: f64,
    tflops: f64,
    calls_per_round: usize,
}

#[derive(Serialize)]
struct Report {
    device: String,
    rounds: usize,
    flops: &'static str,
    results: Vec<Row>,
}

/// Runs the ops and prints medians.
pub fn run(args: KernelsArgs) -> anyhow::Result<()> {
    if args.rounds == 0 {
        bail!("--rounds must be at least 1");
    }
    let cuda = match args.device {
        DeviceChoice::Cpu => false,
        DeviceChoice::Cuda => true,
        DeviceChoice::Auto => strata_device::cuda::probe_device().is_ok(),
    };
    let pick = |gpu: usize, cpu: usize| if cuda { gpu } else { cpu };
    let attention = Attention::mha(
        args.batch.unwrap_or(pick(4, 1)),
        args.seq.unwrap_or(pick(1024, 256)),
        args.heads.unwrap_or(pick(16, 4)),
        args.head_dim.unwrap_or(pick(128, 64)),
    );
    let dtype = args
        .dtype
        .unwrap_or(if cuda { Dtype::Bf16 } else { Dtype::F32 });
    if !cuda && dtype != Dtype::F32 {
        bail!(
            "--dtype {}: the CPU backend computes in f32 only; use --dtype f32 or --device cuda",
            dtype.name()
        );
    }
    let side = pick(8192, 1024);
    let bench = KernelBench {
        attention,
        gemm: args.gemm.unwrap_or([side; 3]),
        dtype,
        rounds: args.rounds,
        round_ms: args.round_ms,
        upload_bytes_max: 64 << 20,
    };
    let (rows, device, path) = if cuda {
        let context = strata_device::cuda::Context::open(args.ordinal)
            .with_context(|| format!("opening CUDA device {}", args.ordinal))?;
        let limits = strata_kernels::cuda::CudaLimits {
            rows_max: 1,
            upload_bytes_max: bench.upload_bytes_max,
        };
        let backend = strata_kernels::cuda::CudaBackend::new(context.clone(), limits)?;
        let rows = run_bench(&backend, &bench)?;
        let path = match backend.attention_on_tensor_cores(dtype, attention) {
            true => "tensor cores",
            false => "cuda cores",
        };
        (
            rows,
            format!("cuda:{} ({})", args.ordinal, backend.name()),
            path,
        )
    } else {
        (run_bench(&CpuBackend, &bench)?, "cpu".to_string(), "cpu")
    };
    let report = Report {
        device,
        rounds: args.rounds,
        flops: "causal attention forward 4 b h s^2 d / 2, backward 2.5x; gemm 2 m n k",
        results: rows.iter().map(|r| row(r, path)).collect(),
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    println!(
        "device {} ({} rounds, medians; {})",
        report.device, report.rounds, report.flops
    );
    println!(
        "{:<20} {:<22} {:>5} {:<13} {:>10} {:>9}",
        "op", "shape", "dtype", "path", "ms", "TFLOPS"
    );
    for r in &report.results {
        println!(
            "{:<20} {:<22} {:>5} {:<13} {:>10.3} {:>9.2}",
            r.op, r.shape, r.dtype, r.path, r.ms, r.tflops
        );
    }
    Ok(())
}

fn row(r: &KernelRow, attention_path: &'static str) -> Row {
    Row {
        op: r.op,
        shape: r.shape.clone(),
        dtype: r.dtype.name(),
        path: match (r.op, attention_path) {
            ("gemm", "cpu") => "cpu",
            ("gemm", _) => "cublaslt",
            _ => attention_path,
        },
        ms: r.seconds * 1e3,
        tflops: r.tflops(),
        calls_per_round: r.calls,
    }
}
