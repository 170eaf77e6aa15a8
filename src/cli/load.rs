//! `strata bench load`: a Hugging Face model loaded and saved at scale.
//! A random model of the given shape (by default 1,235,814,400 parameters:
//! hidden 2048, 16 blocks, 32 query heads over 8 key/value heads, an MLP of
//! 8192, a tied 128,256-token vocabulary) is
//! written as a Hugging Face folder of bf16 shards (or `--from` names
//! one), its files are evicted from the page cache, and `strata train
//! --init-from` runs a few steps from it with parameters, gradients and
//! states on NVMe (host budget by default a quarter of the weights),
//! checkpointing
//! once; then the disk's rates are measured (`strata bench nvme`).
//! Reported: the time until the first step against the disk's bound (the
//! file bytes over the read rate, plus the bytes written over the write
//! rate), and the run's peak memory (its VmHWM, mapped pages included)
//! against the host and device budgets plus 1 GiB.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{Context, bail};
use clap::Args;
use strata_storage::ByteSize;
use strata_train::hf::{Planned, ShardWriter, WeightsDtype};
use strata_train::model::{self, Arch, ModelConfig};

/// Options of `strata bench load`.
#[derive(Args, Debug)]
pub struct LoadArgs {
    /// Where the model folder, the swap files and the checkpoint go (on
    /// the drive to measure); removed afterwards unless --keep.
    #[arg(long)]
    dir: PathBuf,
    /// Start from this Hugging Face folder instead of a random model.
    #[arg(long, value_name = "DIR")]
    from: Option<PathBuf>,
    /// The architecture of the random model (default: the first registered
    /// one that builds the shape).
    #[arg(long)]
    arch: Option<String>,
    /// The random model's blocks.
    #[arg(long, default_value_t = 16)]
    layers: usize,
    /// Its hidden size.
    #[arg(long, default_value_t = 2048)]
    hidden: usize,
    /// Its query heads.
    #[arg(long, default_value_t = 32)]
    heads: usize,
    /// Its key/value heads.
    #[arg(long, default_value_t = 8)]
    kv_heads: usize,
    /// Its MLP width.
    #[arg(long, default_value_t = 8192)]
    ffn: usize,
    /// Its vocabulary.
    #[arg(long, default_value_t = 128_256)]
    vocab: usize,
    /// Tokens per sequence of the run.
    #[arg(long, default_value_t = 64)]
    seq: usize,
    /// Steps of the run (a checkpoint after the last).
    #[arg(long, default_value_t = 3)]
    steps: u64,
    /// The run's host budget (default: a quarter of the weights' bytes).
    #[arg(long)]
    host_budget: Option<ByteSize>,
    /// The run's device budget (default: what its compute workspace
    /// needs, with room).
    #[arg(long)]
    device_budget: Option<ByteSize>,
    /// The largest safetensors shard written.
    #[arg(long, default_value = "1GiB")]
    max_shard_size: ByteSize,
    /// The optimizer states' dtype (fp32, bf16-moments, bf16).
    #[arg(long, default_value = "fp32")]
    state_dtype: String,
    /// Bytes of the disk measurement (`strata bench nvme --size`).
    #[arg(long, default_value = "1GiB")]
    nvme_size: ByteSize,
    /// Seconds between the two disk measurements after the run.
    #[arg(long, default_value_t = 60)]
    rest_s: u64,
    /// Keep the folder, swap files and checkpoint.
    #[arg(long)]
    keep: bool,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

/// The random model's `[model]` table (the architecture's own defaults
/// for everything the flags do not set), of `--arch` or else the first
/// registered architecture that builds it.
fn shape(args: &LoadArgs) -> anyhow::Result<ModelConfig> {
    let of = |arch: Arch| ModelConfig {
        arch,
        ..table(args)
    };
    if let Some(name) = &args.arch {
        return Ok(of(Arch::named(name)?));
    }
    model::ARCHITECTURES
        .iter()
        .map(|a| of(Arch::named(a.name).expect("registered")))
        .find(|config| config.build().is_ok())
        .context("no registered architecture builds this shape: give --arch")
}

/// The shape's `[model]` keys.
fn table(args: &LoadArgs) -> ModelConfig {
    ModelConfig {
        vocab: args.vocab,
        seq: args.seq,
        hidden: args.hidden,
        heads: args.heads,
        layers: args.layers,
        kv_heads: Some(args.kv_heads),
        ffn: Some(args.ffn),
        tie_embeddings: Some(true),
        max_positions: Some(131_072.max(args.seq)),
        ..ModelConfig::default()
    }
}

/// Writes a random model of `config`'s shape into `dir` as a Hugging Face
/// folder of bf16 shards, one group in memory at a time; its bytes.
fn write_random(config: &ModelConfig, dir: &Path, max_shard: u64) -> anyhow::Result<u64> {
    let model = model::build(config)?;
    std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    let groups = model.groups();
    let planned = groups
        .iter()
        .flat_map(|g| &g.tensors)
        .map(|t| Planned {
            name: t.name.clone(),
            shape: t.shape.clone(),
            dtype: WeightsDtype::Bf16,
        })
        .collect();
    let mut writer = ShardWriter::new(dir, "model", planned, max_shard);
    let mut values = Vec::new();
    for (g, group) in groups.iter().enumerate() {
        values.clear();
        values.resize(group.params(), 0f32);
        model.init(g, 1, &mut values);
        for t in &group.tensors {
            writer.write(&t.name, &values[t.range.clone()])?;
        }
    }
    writer.finish()?;
    let mut hf = model.hf_config();
    hf["torch_dtype"] = "bfloat16".into();
    hf["dtype"] = "bfloat16".into();
    std::fs::write(dir.join("config.json"), serde_json::to_vec_pretty(&hf)?)?;
    Ok(model.params() as u64 * 2)
}

/// fsyncs every file of `dir` and drops it from the page cache; their
/// bytes.
fn evict(dir: &Path) -> anyhow::Result<u64> {
    let mut bytes = 0;
    for entry in std::fs::read_dir(dir)?.flatten() {
        let file = std::fs::File::open(entry.path())?;
        file.sync_all()?;
        bytes += file.metadata()?.len();
        use std::os::fd::AsRawFd;
        // SAFETY: a valid descriptor for the call's duration.
        let rc = unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        if rc != 0 {
            bail!(
                "posix_fadvise(DONTNEED) of {}: error {rc}",
                entry.path().display()
            );
        }
    }
    Ok(bytes)
}

/// The disk's best read and write rates (bytes/s) from `strata bench nvme`.
fn disk_rates(dir: &Path, size: ByteSize) -> anyhow::Result<(f64, f64)> {
    let out = Command::new(std::env::current_exe()?)
        .args([
            "bench",
            "nvme",
            "--json",
            "--rw",
            "both",
            "--size",
            &size.to_string(),
        ])
        // The swap store's request size and depth (its log line at a
        // run's start): the rates strata's own I/O reaches.
        .args(["--block-size", "1MiB", "--queue-depth", "32"])
        .arg("--dir")
        .arg(dir)
        .env("STRATA_LOG", "warn")
        .stderr(Stdio::inherit())
        .output()
        .context("run strata bench nvme")?;
    if !out.status.success() {
        bail!("strata bench nvme failed in {}", dir.display());
    }
    let report: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    let rate = |key: &str| {
        report["best"][key]
            .as_f64()
            .context("bench nvme's best rates")
    };
    Ok((rate("read_bw_bytes")?, rate("write_bw_bytes")?))
}

/// What the run said: when the engine was ready (seconds from launch),
/// the load's bytes read and written, its seconds, and the run's summary.
struct Observed {
    ready_s: f64,
    read_bytes: u64,
    written_bytes: u64,
    load_s: f64,
    summary: serde_json::Value,
    peak_bytes: u64,
    /// The run's log lines up to its first step, with their times.
    timeline: Vec<String>,
}

/// Runs `strata train` with `args` and watches its log.
fn observe(dir: &Path, args: &[String]) -> anyhow::Result<Observed> {
    let started = Instant::now();
    let mut child = Command::new(std::env::current_exe()?)
        .args(args)
        .current_dir(dir)
        .env("STRATA_LOG", "info")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("start strata train")?;
    let stdout = child.stdout.take().expect("piped");
    let reader = std::thread::spawn(move || {
        let mut text = String::new();
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            text.push_str(&line);
            text.push('\n');
        }
        text
    });
    let (mut ready_s, mut load) = (None, None);
    let (mut log, mut timeline) = (Vec::new(), Vec::new());
    for line in BufReader::new(child.stderr.take().expect("piped"))
        .lines()
        .map_while(Result::ok)
    {
        if ready_s.is_none() {
            // The run's log up to its first step, each line with its time
            // since launch: where the startup went.
            let at = started.elapsed().as_secs_f64();
            timeline.push(format!("{at:7.2} s  {}", after_level(&line)));
            if line.contains("ready in") {
                ready_s = Some(at);
            }
        }
        if let Some(at) = line.find("parameters loaded from") {
            load = Some(line[at..].to_string());
        }
        log.push(line);
    }
    let status = child.wait()?;
    let stdout = reader.join().expect("the reader thread");
    if !status.success() {
        bail!("strata train failed:\n{}", log.join("\n"));
    }
    // SAFETY: getrusage fills the struct it is given.
    let peak_bytes = unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_CHILDREN, &mut usage);
        usage.ru_maxrss as u64 * 1024
    };
    let load = load.context("the run did not report its load (parameters loaded from ...)")?;
    let number = |key: &str| -> anyhow::Result<f64> {
        let key = format!("{key}=");
        let at = load.find(&key).context("a load figure")? + key.len();
        let text: String = load[at..]
            .trim_start()
            .chars()
            .take_while(|c| c.is_ascii_digit() || *c == '.')
            .collect();
        Ok(text.parse()?)
    };
    let summary = stdout
        .lines()
        .last()
        .and_then(|l| serde_json::from_str(l).ok())
        .context("the run's JSON summary")?;
    Ok(Observed {
        ready_s: ready_s.context("the run did not say it was ready")?,
        read_bytes: number("read_bytes")? as u64,
        written_bytes: number("written_bytes")? as u64,
        load_s: number("seconds")?,
        summary,
        peak_bytes,
        timeline,
    })
}

/// A log line without its timestamp: from its level on.
fn after_level(line: &str) -> &str {
    ["ERROR", "WARN", "INFO", "DEBUG", "TRACE"]
        .iter()
        .filter_map(|level| line.find(level))
        .min()
        .map_or(line, |at| &line[at..])
}

/// Runs `strata bench load`.
pub fn run(args: LoadArgs) -> anyhow::Result<()> {
    if args.steps == 0 {
        bail!("--steps must be at least 1");
    }
    std::fs::create_dir_all(&args.dir)
        .with_context(|| format!("--dir {}: cannot create it", args.dir.display()))?;
    let dir = args.dir.canonicalize()?;
    let (folder, generated) = match &args.from {
        Some(from) => (from.canonicalize()?, None),
        None => {
            let folder = dir.join("model");
            let config = shape(&args)?;
            let started = Instant::now();
            write_random(&config, &folder, args.max_shard_size.0)?;
            (folder, Some(started.elapsed().as_secs_f64()))
        }
    };
    let file_bytes = evict(&folder)?;
    let model_config = strata_train::hf::HfFolder::open(&folder)?.model_config()?;
    let model = model::build(&ModelConfig {
        seq: args.seq,
        max_positions: Some(
            model_config
                .max_positions
                .unwrap_or(model_config.seq)
                .max(args.seq),
        ),
        ..model_config
    })?;
    let params = model.params() as u64;
    let weights = params * 2;
    let host = args.host_budget.map_or(weights / 4, |b| b.0).max(64 << 20);
    let group_max = model.groups().iter().map(|g| g.params()).max().unwrap_or(0) as u64;
    // The largest group gathered in f32 with its f32 gradient (8 bytes a
    // parameter) beside its bf16 shard and its next one (4), and room for
    // the rest of the workspace and the plan (4 more, and 512 MiB).
    let device = args
        .device_budget
        .map_or(group_max * 16 + (512 << 20), |b| b.0);
    let state_bytes: u64 = match args.state_dtype.as_str() {
        "fp32" => 12,
        "bf16-moments" => 8,
        "bf16" => 6,
        other => bail!("--state-dtype {other}: give fp32, bf16-moments or bf16"),
    };
    let capacity = params * (4 + 2 * state_bytes + 4) + (1 << 30);
    let tokens = dir.join("tokens.bin");
    let ids: Vec<u8> = (0..(1u64 << 18))
        .flat_map(|i| ((i.wrapping_mul(2_654_435_761) % model.vocab() as u64) as u32).to_le_bytes())
        .collect();
    std::fs::write(&tokens, ids)?;
    let config = format!(
        "[train]\nsteps = {steps}\nmicro_batch = 1\nwarmup_steps = 0\ncheckpoint_every = {steps}\ncheckpoint_dir = \"ckpt\"\n\
         [placement]\nparams = \"nvme\"\noptimizer = \"nvme\"\ngradients = \"nvme\"\n[optim]\nstate_dtype = \"{}\"\n\
         [device]\nbudget = \"{device}B\"\n[host]\nbudget = \"{host}B\"\n\
         [nvme]\ndirs = [\"swap\"]\ncapacity = \"{capacity}B\"\ncreate_dirs = true\n\
         [model]\nseq = {}\n",
        args.state_dtype,
        args.seq,
        steps = args.steps,
    );
    std::fs::write(dir.join("load.toml"), config)?;
    let run_args: Vec<String> = [
        "train",
        "--config",
        "load.toml",
        "--init-from",
        folder.to_str().context("a UTF-8 path")?,
        "--tokens",
        "tokens.bin",
        "--token-dtype",
        "u32",
        "--overwrite",
        "--json",
    ]
    .map(String::from)
    .to_vec();
    // The run is the first child: its peak is the children's peak (read
    // as it exits, before the disk measurements start).
    let seen = observe(&dir, &run_args)?;
    // The disk measured after the run, and again after a rest: a virtual
    // disk's rate can fall for a while after a burst of writes. The bound
    // takes the faster of the two, the stricter one.
    let after = disk_rates(&dir, args.nvme_size)?;
    std::thread::sleep(std::time::Duration::from_secs(args.rest_s));
    let rested = disk_rates(&dir, args.nvme_size)?;
    let (read_rate, write_rate) = (after.0.max(rested.0), after.1.max(rested.1));
    let bound_s = file_bytes as f64 / read_rate + seen.written_bytes as f64 / write_rate;
    let ratio = seen.ready_s / bound_s;
    let memory_bound = host + device + (1 << 30);
    if !args.keep {
        for name in ["swap", "ckpt", "tokens.bin", "load.toml"] {
            let path = dir.join(name);
            let _ = std::fs::remove_dir_all(&path).or_else(|_| std::fs::remove_file(&path));
        }
        if generated.is_some() {
            std::fs::remove_dir_all(&folder)?;
        }
    }
    let report = serde_json::json!({
        "params": params,
        "file_bytes": file_bytes,
        "generated_s": generated,
        "read_bw_bytes": read_rate,
        "write_bw_bytes": write_rate,
        "disk_after_run_bytes_per_s": [after.0, after.1],
        "disk_rested_bytes_per_s": [rested.0, rested.1],
        "load_read_bytes": seen.read_bytes,
        "load_written_bytes": seen.written_bytes,
        "load_s": seen.load_s,
        "first_step_s": seen.ready_s,
        "bound_s": bound_s,
        "ratio": ratio,
        "host_budget_bytes": host,
        "device_budget_bytes": device,
        "peak_bytes": seen.peak_bytes,
        "peak_bound_bytes": memory_bound,
        "startup": seen.timeline,
        "steps": seen.summary["steps"],
        "loss_first": seen.summary["loss_first"],
        "loss_last": seen.summary["loss_last"],
    });
    if args.json {
        println!("{report}");
        return Ok(());
    }
    let gb = |b: f64| b / 1e9;
    println!(
        "model: {params} parameters, {:.2} GB of bf16 shards in {}",
        gb(file_bytes as f64),
        folder.display()
    );
    println!(
        "disk: read {:.2} GB/s, write {:.2} GB/s (strata bench nvme: {:.2}/{:.2} right after the run, {:.2}/{:.2} after {} s of rest)",
        gb(read_rate),
        gb(write_rate),
        gb(after.0),
        gb(after.1),
        gb(rested.0),
        gb(rested.1),
        args.rest_s
    );
    println!(
        "load: {:.2} GB read from disk, {:.2} GB written to the tiers, in {:.1} s",
        gb(seen.read_bytes as f64),
        gb(seen.written_bytes as f64),
        seen.load_s
    );
    println!("the run's log until its first step (seconds since launch):");
    for line in &seen.timeline {
        println!("  {line}");
    }
    println!(
        "first step after {:.1} s; bound {:.1} s = {:.2} GB / {:.2} GB/s + {:.2} GB / {:.2} GB/s; ratio {ratio:.2} (target <= 1.3)",
        seen.ready_s,
        bound_s,
        gb(file_bytes as f64),
        gb(read_rate),
        gb(seen.written_bytes as f64),
        gb(write_rate)
    );
    println!(
        "peak memory (VmHWM) {:.2} GB; host {:.2} + device {:.2} + 1 GiB = {:.2} GB",
        gb(seen.peak_bytes as f64),
        gb(host as f64),
        gb(device as f64),
        gb(memory_bound as f64)
    );
    println!(
        "trained {} steps from it: loss {} -> {}, checkpoint written",
        seen.summary["steps"], seen.summary["loss_first"], seen.summary["loss_last"]
    );
    Ok(())
}
