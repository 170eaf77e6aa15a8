//! `strata bench kernels`: attentions' forward and backward (multi-head,
//! grouped-query, packed documents) and a GEMM on the compute backend, in
//! TFLOPS, with torch's `scaled_dot_product_attention` on the same shapes
//! beside them when torch is importable (`sdpa_bench.py`).

use std::path::PathBuf;

use anyhow::{Context, bail};
use clap::Args;
use serde::Serialize;
use strata_device::Dtype;
use strata_kernels::bench::{AttentionCase, KernelBench, KernelRow, run as run_bench};
use strata_kernels::{Attention, Backend, CpuBackend};
use strata_runtime::DeviceChoice;

/// The torch side, run by `python -c` with the shapes as one JSON argument.
const SDPA_BENCH: &str = include_str!("sdpa_bench.py");

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
    /// Attention (query) heads [default: 16 on a GPU, 4 on the CPU].
    #[arg(long)]
    heads: Option<usize>,
    /// Key/value heads, dividing the query heads [default: as many].
    #[arg(long)]
    kv_heads: Option<usize>,
    /// Head dim [default: 128 on a GPU, 64 on the CPU].
    #[arg(long)]
    head_dim: Option<usize>,
    /// Pack documents of this many tokens into each sequence (attention
    /// within each) [default: one causal sequence].
    #[arg(long)]
    documents: Option<usize>,
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
    /// Leave torch's scaled_dot_product_attention out.
    #[arg(long)]
    no_torch: bool,
    /// The Python that runs torch's side.
    #[arg(long, default_value = "python3")]
    python: PathBuf,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

/// The attentions measured when no shape option is given: the bar
/// shape, a grouped-query one (32 query heads over 8) and the first with
/// packed documents (boundaries inside the kernels' tiles); smaller on the
/// CPU.
fn default_attentions(cuda: bool) -> Vec<AttentionCase> {
    let case = |shape, documents| AttentionCase { shape, documents };
    let gqa = |batch, seq, heads, kv_heads, head_dim| Attention {
        batch,
        seq,
        heads,
        kv_heads,
        head_dim,
    };
    match cuda {
        true => vec![
            case(Attention::mha(4, 1024, 16, 128), None),
            case(gqa(2, 2048, 32, 8, 128), None),
            case(Attention::mha(4, 1024, 16, 128), Some(300)),
        ],
        false => vec![
            case(Attention::mha(1, 256, 4, 64), None),
            case(gqa(1, 256, 4, 1, 64), None),
            case(Attention::mha(1, 256, 4, 64), Some(100)),
        ],
    }
}

/// torch's median seconds per call of one attention's op: (which of the
/// bench's attentions, `attention_forward` or `attention_backward`,
/// seconds).
type TorchTime = (usize, String, f64);

/// torch's version and times for each (attention, op), or why there are
/// none.
fn torch_sdpa(
    args: &KernelsArgs,
    cuda: bool,
    bench: &KernelBench,
) -> Result<(String, Vec<TorchTime>), String> {
    let attentions: Vec<serde_json::Value> = bench
        .attentions
        .iter()
        .map(|c| {
            serde_json::json!({
                "batch": c.shape.batch,
                "seq": c.shape.seq,
                "heads": c.shape.heads,
                "kv_heads": c.shape.kv_heads,
                "head_dim": c.shape.head_dim,
                "documents": c.documents,
            })
        })
        .collect();
    let spec = serde_json::json!({
        "device": if cuda { "cuda" } else { "cpu" },
        "ordinal": args.ordinal,
        "dtype": bench.dtype.name(),
        "rounds": bench.rounds,
        "round_ms": bench.round_ms,
        "attentions": attentions,
    });
    let output = std::process::Command::new(&args.python)
        .arg("-c")
        .arg(SDPA_BENCH)
        .arg(spec.to_string())
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(|err| format!("{} did not start: {err}", args.python.display()))?;
    let text = String::from_utf8_lossy(&output.stdout);
    let report: serde_json::Value = serde_json::from_str(text.trim()).map_err(|_| {
        let stderr = String::from_utf8_lossy(&output.stderr);
        let last = stderr.lines().last().unwrap_or("no output");
        format!("torch's side failed ({}): {last}", output.status)
    })?;
    if let Some(error) = report["error"].as_str() {
        return Err(error.to_string());
    }
    let version = report["torch"].as_str().unwrap_or("?").to_string();
    let rows = report["results"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or(&[])
        .iter()
        .filter_map(|r| {
            Some((
                r["attention"].as_u64()? as usize,
                r["op"].as_str()?.to_string(),
                r["seconds"].as_f64()?,
            ))
        })
        .collect();
    Ok((version, rows))
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
    /// torch's time over strata's for the same attention and op (above 1:
    /// strata is faster); absent without torch.
    #[serde(skip_serializing_if = "Option::is_none")]
    vs_torch: Option<f64>,
}

#[derive(Serialize)]
struct Report {
    device: String,
    rounds: usize,
    flops: &'static str,
    /// torch's version when its side ran, else why not.
    torch: String,
    results: Vec<Row>,
    /// torch's scaled_dot_product_attention on the same shapes.
    torch_results: Vec<Row>,
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
    let shaped = [args.batch, args.seq, args.heads, args.kv_heads]
        .iter()
        .chain([&args.head_dim, &args.documents])
        .any(Option::is_some);
    let attentions = match shaped {
        false => default_attentions(cuda),
        true => {
            let heads = args.heads.unwrap_or(pick(16, 4));
            vec![AttentionCase {
                shape: Attention {
                    batch: args.batch.unwrap_or(pick(4, 1)),
                    seq: args.seq.unwrap_or(pick(1024, 256)),
                    heads,
                    kv_heads: args.kv_heads.unwrap_or(heads),
                    head_dim: args.head_dim.unwrap_or(pick(128, 64)),
                },
                documents: args.documents,
            }]
        }
    };
    if let Some(case) = attentions
        .iter()
        .find(|c| c.shape.kv_heads == 0 || !c.shape.heads.is_multiple_of(c.shape.kv_heads))
    {
        bail!(
            "--kv-heads {}: key/value heads must divide the {} query heads (grouped-query attention)",
            case.shape.kv_heads,
            case.shape.heads
        );
    }
    if args.documents == Some(0) {
        bail!("--documents 0: a document holds at least one token");
    }
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
        attentions,
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
        let path = match bench
            .attentions
            .iter()
            .all(|c| backend.attention_on_tensor_cores(dtype, c.shape))
        {
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
    let torch = match args.no_torch {
        true => Err("left out (--no-torch)".to_string()),
        false => torch_sdpa(&args, cuda, &bench),
    };
    let torch_seconds = |r: &KernelRow| -> Option<f64> {
        let (_, rows) = torch.as_ref().ok()?;
        let i = r.attention?;
        rows.iter()
            .find(|(a, op, _)| *a == i && op == r.op)
            .map(|(_, _, s)| *s)
    };
    let torch_results = rows
        .iter()
        .filter_map(|r| {
            let seconds = torch_seconds(r)?;
            Some(Row {
                path: "torch sdpa",
                ms: seconds * 1e3,
                tflops: r.flops / seconds / 1e12,
                calls_per_round: 0,
                vs_torch: None,
                ..row(r, path, None)
            })
        })
        .collect();
    let report = Report {
        device,
        rounds: args.rounds,
        flops: "causal attention forward 4 b h s^2 d / 2 (s^2 summed over packed documents), backward 2.5x; gemm 2 m n k",
        torch: match &torch {
            Ok((version, _)) => format!("torch {version}"),
            Err(why) => why.clone(),
        },
        results: rows
            .iter()
            .map(|r| row(r, path, torch_seconds(r)))
            .collect(),
        torch_results,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    println!(
        "device {} ({} rounds, medians; {}); beside: {}",
        report.device, report.rounds, report.flops, report.torch
    );
    println!(
        "{:<20} {:<30} {:>5} {:<13} {:>10} {:>9} {:>9}",
        "op", "shape", "dtype", "path", "ms", "TFLOPS", "vs torch"
    );
    for r in report.results.iter().chain(&report.torch_results) {
        let ratio = r.vs_torch.map_or(String::new(), |x| format!("{x:.2}x"));
        println!(
            "{:<20} {:<30} {:>5} {:<13} {:>10.3} {:>9.2} {:>9}",
            r.op, r.shape, r.dtype, r.path, r.ms, r.tflops, ratio
        );
    }
    Ok(())
}

/// A result as reported; `torch_seconds` the same op's time under torch.
fn row(r: &KernelRow, attention_path: &'static str, torch_seconds: Option<f64>) -> Row {
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
        vs_torch: torch_seconds.map(|t| t / r.seconds),
    }
}
