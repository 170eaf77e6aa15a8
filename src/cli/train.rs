//! `strata train`: a model (`[model] arch`) trained with its model states
//! tiered across device memory, pinned host RAM and NVMe, ZeRO-3 sharded
//! over ranks; with no arguments, a small model on the text bundled in
//! `examples/data/`, swapping to `./strata-train-swap`.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::Args;
use strata_runtime::Link;
use strata_train::{self as engine, ByteCorpus, RunOptions, RunSummary, TrainConfig, TrainError};

/// The text `strata train` learns by default (byte tokens).
pub const DEFAULT_TEXT: &str = include_str!("../../examples/data/tiers.txt");

/// Options of `strata train`.
#[derive(Args, Debug)]
pub struct TrainArgs {
    /// A TOML config ([model], [train], [data], [placement], [device],
    /// [host], [nvme], [runtime], [checkpoint]); see examples/configs/.
    /// Without it: the built-in small model, states on NVMe under
    /// ./strata-train-swap (removed at the end of the run), or, with
    /// --resume, the config of the run the checkpoint comes from.
    #[arg(long)]
    config: Option<PathBuf>,
    /// A DeepSpeed config (ds_config.json) to run: its keys override the
    /// fields of --config (or the defaults) they map to, and the flags
    /// below override both; see docs/deepspeed-config.md.
    #[arg(long, value_name = "FILE")]
    deepspeed: Option<PathBuf>,
    /// Print the strata config (TOML) the options come to, and exit
    /// without training.
    #[arg(long)]
    print_config: bool,
    /// Steps to run (train.steps; a train.warmup_steps as long as the run
    /// or longer is cut to a quarter of it, with a warning). On --resume:
    /// only to extend a finished run.
    #[arg(long)]
    steps: Option<u64>,
    /// Peak learning rate (train.lr).
    #[arg(long)]
    lr: Option<f64>,
    /// Sequences per rank per micro-batch (train.micro_batch).
    #[arg(long)]
    micro_batch: Option<usize>,
    /// Micro-batches per step (train.grad_accumulation).
    #[arg(long)]
    grad_accumulation: Option<usize>,
    /// Seed of the initial weights and the data order (train.seed).
    #[arg(long)]
    seed: Option<u64>,
    /// Texts to train on instead of the bundled one (byte tokens), files
    /// or directories of them (sets [data] path and format = "text").
    #[arg(long, num_args = 1.., value_name = "FILE", conflicts_with = "tokens")]
    data: Vec<PathBuf>,
    /// Files of token ids to train on (little-endian, see --token-dtype;
    /// nanoGPT's train.bin is u16), or directories of such shards, mapped,
    /// not read into memory; the model's vocab must cover their ids (sets
    /// [data] path and format = "tokens").
    #[arg(long, num_args = 1.., value_name = "FILE")]
    tokens: Vec<PathBuf>,
    /// The model's tokenizer (a Hugging Face folder holding tokenizer.json,
    /// or the file) for --data: texts and JSONL (`.jsonl`, a document per
    /// line in its "text" field) are tokenized with it once, on every
    /// core, into a cache beside the data (sets [data] tokenizer).
    #[arg(long, value_name = "DIR", conflicts_with = "tokens")]
    tokenizer: Option<PathBuf>,
    /// Read the JSONL files of --data (or [data] path) as supervised
    /// fine-tuning data: each line a "prompt" and its "response"
    /// ([data] prompt_field, response_field), or chat "messages" through
    /// the tokenizer's chat template, the loss on the responses' (the
    /// assistant turns') tokens alone (sets [data] format = "sft"; needs
    /// --tokenizer).
    #[arg(long, conflicts_with = "tokens")]
    sft: bool,
    /// How --tokens stores each id: u16 (default) or u32.
    #[arg(long, requires = "tokens")]
    token_dtype: Option<engine::TokenDtype>,
    /// Start from a Hugging Face model folder (config.json and safetensors
    /// weights, one file or shards with an index; bf16, fp16 or f32):
    /// its config gives [model] (a [model] key that disagrees is refused;
    /// model.seq may be shorter), its weights the initial values, read
    /// group by group straight into their tiers (sets model.init_from).
    #[arg(long, value_name = "DIR")]
    init_from: Option<PathBuf>,
    /// Resume from a checkpoint (a step-* directory, or a checkpoint_dir
    /// whose `latest` names one): alone, it continues the run as it was
    /// (the checkpoint holds its config, data and placement); a flag or
    /// config that would change what the run computes is refused.
    /// `auto`: the newest whole checkpoint of the run's checkpoint
    /// directory (--checkpoint-dir or train.checkpoint_dir) if it has one,
    /// else a fresh start there (for launchers that restart failed jobs
    /// with the same command; a directory named auto is `./auto`).
    #[arg(long)]
    resume: Option<PathBuf>,
    /// Write checkpoints here (train.checkpoint_dir; on --resume, by
    /// default the directory resumed from).
    #[arg(long)]
    checkpoint_dir: Option<PathBuf>,
    /// Start a new run in a checkpoint directory that holds another run's
    /// checkpoints (refused without it unless --resume).
    #[arg(long)]
    overwrite: bool,
    /// Stop after this step (the schedule still spans train.steps): to
    /// interrupt and resume.
    #[arg(long)]
    stop_after: Option<u64>,
    /// Print a step line every N steps (and the first and last); each
    /// step's full record goes to metrics.jsonl beside the checkpoints.
    #[arg(long, value_name = "N", default_value_t = LOG_EVERY_DEFAULT)]
    log_every: u64,
    /// Write rank 0's Chrome/Perfetto trace of transfers, spills and waits.
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Print a JSON summary as the last line.
    #[arg(long)]
    json: bool,
    /// Run the ranks as N processes of this machine (torchrun's variables,
    /// rank 0 listening at a free local port; collectives over TCP), for
    /// a machine without a launcher: train.ranks must be 1 or N.
    /// SIGINT/SIGTERM reach every rank.
    #[arg(long, value_name = "N")]
    nproc: Option<usize>,
    /// Seconds a run may take after SIGINT or SIGTERM to finish its step
    /// and write a final checkpoint; past it (or at a second signal) it
    /// exits at once, keeping the last whole checkpoint. Schedulers
    /// (Slurm, Kubernetes) give about 30 s before SIGKILL.
    #[arg(long, value_name = "SECONDS", default_value_t = SIGNAL_GRACE_DEFAULT_S)]
    signal_grace: f64,
}

/// `--signal-grace`'s default: under the 30 s most schedulers give.
const SIGNAL_GRACE_DEFAULT_S: f64 = 25.0;
/// `--log-every`'s default (DeepSpeed's `steps_per_print`).
const LOG_EVERY_DEFAULT: u64 = 10;

/// Where the run's config starts: a file, a checkpoint's own, or the
/// built-in default.
enum Base {
    File(String),
    Checkpoint,
    Default,
}

/// The run's config: `--config` (or, resuming, the checkpoint's run's
/// config, or the defaults), then `--deepspeed`'s keys, then the flags.
/// What `load_config` comes to: the config, whether the user's file set
/// `nvme.create_dirs`, and the step resumed from.
struct Loaded {
    config: TrainConfig,
    create_dirs_set: bool,
    resumed_step: Option<u64>,
}

fn load_config(args: &TrainArgs) -> anyhow::Result<Loaded> {
    let checkpoint = match &args.resume {
        Some(path) => Some(engine::Checkpoint::open(path)?),
        None => None,
    };
    let saved = match &checkpoint {
        Some(checkpoint) => checkpoint.run_config()?,
        None => None,
    };
    let (mut config, base) = match (&args.config, saved) {
        (Some(path), _) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("cannot read config {}", path.display()))?;
            let config = TrainConfig::from_toml(&text)
                .with_context(|| format!("config {}", path.display()))?;
            (config, Base::File(text))
        }
        (None, Some(saved)) => (saved, Base::Checkpoint),
        (None, None) => {
            if let Some(checkpoint) = &checkpoint {
                tracing::warn!(
                    "{}: the checkpoint holds no {} (it comes from an older strata): the run starts \
                     from the built-in config; pass the run's --config if it had one",
                    checkpoint.dir.display(),
                    engine::RUN_CONFIG
                );
            }
            (TrainConfig::default(), Base::Default)
        }
    };
    if let Some(dir) = &args.init_from {
        config.model.init_from = Some(dir.clone());
    }
    // [model] from the folder's config.json, before anything else reads it
    // (a checkpoint's config has it already, and the folder may be gone).
    if !matches!(base, Base::Checkpoint) || args.init_from.is_some() {
        let model_keys = match &base {
            Base::File(text) => TrainConfig::model_keys_in(text),
            _ => Default::default(),
        };
        config = config.with_init_from(&model_keys)?;
    }
    if let Some(path) = &args.deepspeed {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read --deepspeed {}", path.display()))?;
        let mapping = engine::from_deepspeed_json(&text, Some(&config))
            .with_context(|| format!("--deepspeed {}", path.display()))?;
        if !mapping.ignored.is_empty() {
            tracing::warn!(
                "--deepspeed {}: these keys have no strata meaning and are ignored (see docs/deepspeed-config.md):\n  {}",
                path.display(),
                mapping.ignored.join("\n  ")
            );
        }
        for note in &mapping.notes {
            tracing::warn!("--deepspeed {}: {note}", path.display());
        }
        config = mapping.config;
        if matches!(base, Base::Default) {
            // A DeepSpeed config takes the machine it runs on, not the
            // built-in demo's tiny budgets and CPU device.
            let (sized, said) = config.with_budgets_for_this_machine()?;
            tracing::info!(
                "--deepspeed without --config: device.kind = \"auto\", {said} (set them in a --config to choose)"
            );
            config = sized;
        }
    }
    let t = &mut config.train;
    if let Some(lr) = args.lr {
        t.lr = lr;
    }
    if let Some(micro_batch) = args.micro_batch {
        t.micro_batch = micro_batch;
    }
    if let Some(grad_accumulation) = args.grad_accumulation {
        t.grad_accumulation = grad_accumulation;
    }
    if let Some(seed) = args.seed {
        t.seed = seed;
    }
    if let Some(steps) = args.steps {
        if steps == 0 {
            bail!("--steps must be at least 1");
        }
        t.steps = steps;
        // A warmup that would not end within the run is cut to a quarter
        // of it, and said so; one that ends within it is left as set (a
        // silent cut changed the schedule of runs that named their steps,
        // and of a resumed run against the one it resumes).
        let warmup = t.warmup_steps;
        if t.schedule == engine::Schedule::Cosine && warmup >= steps {
            t.warmup_steps = steps / 4;
            tracing::warn!(
                "--steps {steps}: train.warmup_steps {warmup} would not end within the run; \
                 warming up for {} steps (a quarter of it) instead",
                t.warmup_steps
            );
        }
    }
    // However set (a file, a DeepSpeed schedule, a flag), a warmup that
    // outlasts the run is said: the rate would never reach train.lr.
    if let Some(warmup) = config.train.warmup_len()
        && warmup > 0
        && warmup >= config.train.steps
    {
        tracing::warn!(
            "the warmup ({warmup} steps) is at least as long as the run (train.steps = {}): \
             the learning rate never reaches train.lr = {}; shorten the warmup or lengthen the run",
            config.train.steps,
            config.train.lr
        );
    }
    // However they were named, the files are recorded by their absolute
    // paths: a resume from another directory reads the same files.
    let (paths, flag, format) = match (args.data.is_empty(), args.tokens.is_empty()) {
        (false, _) => (
            &args.data,
            "--data",
            engine::DataFormat::of_texts(&args.data),
        ),
        (true, false) => (&args.tokens, "--tokens", engine::DataFormat::Tokens),
        (true, true) => (&config.data.path.0, "data.path", config.data.format),
    };
    let format = if args.sft {
        engine::DataFormat::Sft
    } else {
        format
    };
    let paths = paths
        .iter()
        .map(|path| absolute(path, flag))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let given = !args.data.is_empty() || !args.tokens.is_empty();
    let tokenizer = match &args.tokenizer {
        Some(dir) => Some(dir.as_path()),
        // Token files take no tokenizer; texts keep the config's.
        None if !args.tokens.is_empty() => None,
        None => config.data.tokenizer.as_deref(),
    };
    let tokenizer = tokenizer
        .map(|dir| absolute(dir, "--tokenizer (data.tokenizer)"))
        .transpose()?;
    config.data = engine::DataConfig {
        path: engine::DataPaths(paths),
        token_dtype: if !args.tokens.is_empty() {
            args.token_dtype.unwrap_or_default()
        } else if given {
            Default::default()
        } else {
            config.data.token_dtype
        },
        tokenizer,
        // Where the cache is, from anywhere a resume runs.
        cache_dir: config
            .data
            .cache_dir
            .as_deref()
            .map(std::path::absolute)
            .transpose()?,
        // A text field is JSONL's alone, prompt and response fields
        // supervised data's.
        ..config.data.as_format(format)
    };
    // The held-out files too, from anywhere a resume runs.
    config.eval.path = engine::DataPaths(
        config
            .eval
            .path
            .0
            .iter()
            .map(|path| absolute(path, "eval.path"))
            .collect::<anyhow::Result<Vec<_>>>()?,
    );
    if let Some(dir) = &args.checkpoint_dir {
        config.train.checkpoint_dir = Some(dir.clone());
    } else if let (Some(checkpoint), Some(given)) = (&checkpoint, &args.resume) {
        // Resumed: checkpoints go on where they were found (the directory
        // given, or the one holding the step directory given) - unless
        // the step is not the one that directory's `latest` names: the
        // later checkpoints there are another future of the run, which
        // this one's would be mixed with (and pruned against).
        let step_dir = absolute(&checkpoint.dir, "--resume")?;
        let root = if given.join("latest").exists() {
            absolute(given, "--resume")?
        } else {
            step_dir
                .parent()
                .map_or_else(|| step_dir.clone(), Path::to_path_buf)
        };
        let latest = std::fs::read_to_string(root.join("latest")).unwrap_or_default();
        if step_dir.file_name().and_then(|n| n.to_str()) != Some(latest.trim()) {
            bail!(
                "--resume {}: {} names {}, a later checkpoint of the run: give --checkpoint-dir (a new directory) to go on from this step, so that its checkpoints and the later ones stay apart",
                given.display(),
                root.join("latest").display(),
                latest.trim()
            );
        }
        config.train.checkpoint_dir = Some(root);
    }
    if config.train.checkpoint_dir.is_none() && config.train.checkpoint_every > 0 {
        // Said at once: found out at a SIGTERM, it costs the steps since.
        tracing::warn!(
            "train.checkpoint_every = {} but no checkpoint directory: the run writes no \
             checkpoints; pass --checkpoint-dir or set train.checkpoint_dir",
            config.train.checkpoint_every
        );
    }
    config.validate()?;
    // Only a file the user wrote sets a safety switch for a file printed
    // from it (the built-in default creates its own swap directory; a
    // config started from it must not create a mistyped one).
    let create_dirs_set = match &base {
        Base::File(text) => text
            .parse::<toml::Table>()
            .ok()
            .and_then(|t| t.get("nvme")?.get("create_dirs").cloned())
            .is_some(),
        _ => false,
    };
    Ok(Loaded {
        config,
        create_dirs_set,
        resumed_step: checkpoint.map(|c| c.meta.step),
    })
}

/// The corpus `[data]` names, or the bundled text; texts with a tokenizer
/// are tokenized first (or their cache found), with a progress bar.
pub(super) fn open_data(config: &TrainConfig, json: bool) -> anyhow::Result<engine::Corpus> {
    let data = &config.data;
    let (corpus, eos) = read_data(config, json)?;
    if data.attention != engine::DataAttention::Document {
        return Ok(corpus);
    }
    let Some(eos) = data.eos_id.or(eos) else {
        bail!(
            "data.attention = \"document\": documents are told apart by their end-of-text token, and {}: set data.eos_id to the end-of-document id",
            match data.tokenizer {
                Some(_) => "the tokenizer's tokenizer_config.json names no eos_token",
                None => "token files and texts name none",
            }
        );
    };
    tracing::info!(
        "documents kept apart: each starts after token {eos}, its positions from 0, attending to itself alone"
    );
    Ok(corpus.with_documents(eos))
}

/// The corpus `[data]` names, and the tokenizer's end-of-text id when it
/// was tokenized.
fn read_data(config: &TrainConfig, json: bool) -> anyhow::Result<(engine::Corpus, Option<u32>)> {
    let (data, seq) = (&config.data, config.model.seq);
    if data.path.is_empty() {
        return Ok((
            ByteCorpus::new(DEFAULT_TEXT.as_bytes().to_vec(), seq)?,
            None,
        ));
    }
    if data.tokenizer.is_none() {
        return Ok((engine::Corpus::open(data, seq)?, None));
    }
    let bar = super::progress_bar(
        engine::tokenize_bytes(data)?,
        json,
        "{spinner} tokenizing [{bar:30}] {bytes}/{total_bytes} ({elapsed})",
    );
    let started = std::time::Instant::now();
    let tokenized = engine::tokenize(data, config.model.vocab, &|n| bar.inc(n))?;
    bar.finish_and_clear();
    if tokenized.reused {
        tracing::info!(
            "tokenized data from the cache {} ({} documents, {} tokens)",
            tokenized.path.display(),
            tokenized.documents,
            tokenized.tokens
        );
    } else {
        let seconds = started.elapsed().as_secs_f64();
        tracing::info!(
            "tokenized {} documents into {} tokens in {seconds:.1} s ({:.0} tokens/s), cached in {}",
            tokenized.documents,
            tokenized.tokens,
            tokenized.tokens as f64 / seconds,
            tokenized.path.display()
        );
    }
    if tokenized.masked {
        tracing::info!(
            "loss masks: {} of the {} tokens are loss targets (the responses and their ends of text)",
            tokenized.targets,
            tokenized.tokens
        );
    }
    Ok((
        engine::Corpus::open_tokenized(&tokenized, seq)?,
        tokenized.eos,
    ))
}

/// `path` made absolute (a checkpoint's config names it from any directory),
/// or an error naming the flag when it does not exist.
pub(super) fn absolute(path: &Path, flag: &str) -> anyhow::Result<PathBuf> {
    std::fs::canonicalize(path)
        .with_context(|| format!("{flag} {}: cannot find the file", path.display()))
}

/// Runs `strata train`: exits 0, or 128 + the signal that stopped it.
pub fn run(mut args: TrainArgs) -> anyhow::Result<ExitCode> {
    let auto_resumed = resolve_auto_resume(&mut args)?;
    if !(args.signal_grace.is_finite() && args.signal_grace >= 0.0) {
        bail!(
            "--signal-grace {} is not a number of seconds: give one at least 0 (default {SIGNAL_GRACE_DEFAULT_S})",
            args.signal_grace
        );
    }
    // Before any thread starts, so that every one inherits the mask.
    let blocked = super::signals::block().context("block SIGINT and SIGTERM for the run")?;
    let Loaded {
        config,
        create_dirs_set,
        resumed_step,
    } = load_config(&args)?;
    if args.print_config {
        let mut shown = config.clone();
        if let Some(nvme) = shown.nvme.as_mut().filter(|_| !create_dirs_set) {
            nvme.create_dirs = false;
        }
        print!("{}", shown.to_toml()?);
        return Ok(ExitCode::SUCCESS);
    }
    // A launcher restarting a job that had already written its last
    // checkpoint (it failed after): nothing is left to do.
    let stop = args
        .stop_after
        .unwrap_or(config.train.steps)
        .min(config.train.steps);
    if let (true, Some(step)) = (auto_resumed, resumed_step)
        && step >= stop
    {
        eprintln!(
            "--resume auto: the newest checkpoint in {} is of step {step}, where this run stops: it is finished",
            args.resume.as_deref().unwrap_or(Path::new(".")).display()
        );
        return Ok(ExitCode::SUCCESS);
    }
    // Ranks as processes when a launcher started this one.
    let launch = engine::Launch::of_this_process()?;
    if let Some(launch) = &launch {
        if let Some(nproc) = args.nproc {
            bail!(
                "--nproc {nproc} in a process {} started: the launcher starts the ranks; drop --nproc",
                launch.launcher.name()
            );
        }
        launch.check_ranks(config.train.ranks)?;
    }
    let corpus = open_data(&config, args.json)?;
    if let Some(nproc) = args.nproc {
        if config.train.ranks != 1 && config.train.ranks != nproc {
            bail!(
                "train.ranks = {} and --nproc {nproc}: each process is one rank; set train.ranks = 1 or {nproc} (or give --nproc {})",
                config.train.ranks,
                config.train.ranks
            );
        }
        // The data was read (and any tokenizing cached) once, here.
        drop(corpus);
        return super::nproc::run(nproc, config.comm.timeout_s, blocked);
    }
    if args.stop_after == Some(0) {
        bail!("--stop-after 0 runs no step: give the step to stop after, from 1");
    }
    // Held-out data, read as the training data is (format, tokenizer).
    let eval = match config.eval.every {
        0 => None,
        _ => {
            let held_out = TrainConfig {
                data: config.eval.data(&config.data),
                ..config.clone()
            };
            let eval = open_data(&held_out, args.json).context("[eval] path")?;
            tracing::info!(
                "eval: every {} steps, the first {} of {} windows of {}",
                config.eval.every,
                config.eval.windows.min(eval.windows()),
                eval.windows(),
                config.eval.path.0.len().to_string() + " file(s)"
            );
            Some(eval)
        }
    };
    let options = RunOptions {
        stop_after: args.stop_after,
        resume: args.resume.clone(),
        trace: args.trace.clone(),
        overwrite: args.overwrite,
        eval,
        ..RunOptions::default()
    };
    let grace = Duration::from_secs_f64(args.signal_grace);
    let dir = config.train.checkpoint_dir.clone();
    super::signals::watch(blocked, options.stop.clone(), grace, move || {
        last_checkpoint(dir.as_deref())
    })
    .context("start the signal thread")?;
    tracing::info!(
        "on SIGINT or SIGTERM the run stops after its current step{}, within --signal-grace {:.0} s; past it, or at a second signal, it aborts the step",
        if config.train.checkpoint_dir.is_some() {
            " and writes a checkpoint"
        } else {
            ""
        },
        args.signal_grace
    );
    let total = options
        .stop_after
        .unwrap_or(config.train.steps)
        .min(config.train.steps);
    let bar = super::progress_bar(
        total,
        args.json,
        "{spinner} step {pos}/{len} [{bar:30}] {msg} ({elapsed})",
    );
    tracing::info!(
        "training {} parameters ({} {} layers, hidden {}), {} rank(s), params on {:?}, optimizer on {:?}",
        config.model.build()?.params(),
        config.model.arch,
        config.model.layers,
        config.model.hidden,
        config.train.ranks,
        config.placement.params,
        config.placement.optimizer,
    );
    let t = &config.train;
    tracing::info!(
        "data: {}, {} order",
        corpus.describe(t.sequences_per_step()),
        match config.data.order {
            engine::DataOrder::Epoch => "epoch",
            engine::DataOrder::Random => "random",
        }
    );
    // The built-in default's swap directory, when this run creates it, is
    // removed when the run ends, however it ends (a checkpoint, not the
    // swap, is what a resume reads) - once the run has trained a step, so
    // holding the directory's lock: a run refused at the lock removes
    // nothing. Never one that holds the run's other outputs.
    let defaults = TrainConfig::default()
        .nvme
        .map(|n| n.dirs)
        .unwrap_or_default();
    let outputs: Vec<&Path> = [
        config.train.checkpoint_dir.as_deref(),
        args.trace.as_deref(),
    ]
    .into_iter()
    .flatten()
    .collect();
    // (Not under a launcher: every process's rank has its own
    // subdirectory there, which it empties itself.)
    let launched = launch.as_ref().is_some_and(|l| l.world > 1);
    let created: Vec<PathBuf> = match &config.nvme {
        Some(nvme)
            if nvme.create_dirs && config.uses_nvme() && nvme.dirs == defaults && !launched =>
        {
            nvme.dirs
                .iter()
                .filter(|dir| !dir.exists())
                .filter(|dir| !outputs.iter().any(|out| out.starts_with(dir)))
                .cloned()
                .collect()
        }
        _ => Vec::new(),
    };
    let swap = RemoveOnDrop {
        dirs: created,
        armed: std::cell::Cell::new(false),
    };
    if args.log_every == 0 {
        bail!(
            "--log-every 0 prints no step: give a number of steps from 1 (default {LOG_EVERY_DEFAULT})"
        );
    }
    let mut metrics = Metrics::new(config.train.checkpoint_dir.as_deref(), resumed_step);
    let mut moved_before = [0u64; 4];
    let mut timing = StopTiming::default();
    let ranks = match &launch {
        Some(launch) if launch.world > 1 => Ranks::Processes(open_process_rank(launch, &config)?),
        _ => Ranks::Threads,
    };
    let mut on_step = |progress: engine::Progress<'_>| {
        let r = progress.report;
        timing.observe(
            r.seconds,
            progress.checkpoint_s.or(progress.checkpoint_estimate_s),
            args.signal_grace,
        );
        let moved: [u64; 4] = [0, 1, 2, 3].map(|i| progress.stats.links[i].bytes);
        let step_moved: [u64; 4] = [0, 1, 2, 3].map(|i| moved[i] - moved_before[i]);
        moved_before = moved;
        // The engine holds its directories now: the metrics file and the
        // swap directory are this run's.
        swap.armed.set(true);
        metrics.write(r, &step_moved);
        let tokens_per_s = r.tokens as f64 / r.seconds;
        bar.set_position(r.step);
        bar.set_message(format!(
            "loss {:.4}  lr {:.2e}  {:.0} tok/s",
            r.loss, r.lr, tokens_per_s
        ));
        let note = if r.skipped {
            "  (overflow: skipped)"
        } else if r.clip < 1.0 {
            "  (clipped)"
        } else {
            ""
        };
        if bar.is_hidden()
            && !args.json
            && (r.step.is_multiple_of(args.log_every) || r.step == 1 || r.step == total)
        {
            let eval = r
                .eval_loss
                .map_or_else(String::new, |loss| format!("  eval {loss:.4}"));
            eprintln!(
                "step {:>5}  loss {:.4}{eval}  lr {:.2e}  {:.0} tok/s  {:.2} s{note}",
                r.step, r.loss, r.lr, tokens_per_s, r.seconds,
            );
        } else if let Some(loss) = r.eval_loss.filter(|_| !args.json) {
            // An evaluation is said even between the logged steps.
            tracing::info!("step {}: eval loss {loss:.4}", r.step);
        }
        // Stats' links are in `Link` order: h->nvme, nvme->h, h->d, d->h.
        tracing::debug!(
            "step {}: grad-norm {:.3} clip {:.3} loss-scale {} {}; waited {:.0} ms for the optimizer, which ran at {:.3} G params/s; moved h->d {} d->h {} nvme->h {} h->nvme {}",
            r.step,
            r.grad_norm,
            r.clip,
            r.loss_scale,
            if r.late {
                "(updated during the next forward)"
            } else {
                "(updated before the next forward)"
            },
            r.optimizer_wait_s * 1e3,
            r.optimizer_params_per_s / 1e9,
            strata_scheduler::gib(step_moved[Link::HostToDevice.index()]),
            strata_scheduler::gib(step_moved[Link::DeviceToHost.index()]),
            strata_scheduler::gib(step_moved[Link::NvmeToHost.index()]),
            strata_scheduler::gib(step_moved[Link::HostToNvme.index()]),
        );
    };
    let (summary, rank, held) = match ranks {
        Ranks::Threads => (
            engine::run(&config, &corpus, &options, &mut on_step).map(Some),
            None,
            None,
        ),
        Ranks::Processes(process) => {
            let rank = process.rank.collective.rank();
            let outcome =
                engine::run_process(&config, &corpus, &options, process.rank, &mut on_step);
            (outcome, Some(rank), Some(process.world))
        }
    };
    // Every rank of a job leaves together once rank 0 has said its piece:
    // a launcher ends the job at the first process that exits non-zero
    // (143 after a SIGTERM), which must not cut rank 0 short.
    let timeout = Duration::from_secs_f64(config.comm.timeout_s);
    let leave = |held: Option<World>, code: ExitCode| {
        if let Some(world) = held {
            rendezvous(world, timeout);
        }
        code
    };
    bar.finish_and_clear();
    let summary = match summary {
        Err(TrainError::Aborted { code }) => {
            eprintln!(
                "aborted mid-step by {}: {}{}",
                super::signals::name(code),
                last_checkpoint(config.train.checkpoint_dir.as_deref()),
                match &config.train.checkpoint_dir {
                    Some(dir) if dir.join("latest").exists() =>
                        format!("; go on with: strata train --resume {}", dir.display()),
                    _ => String::new(),
                }
            );
            return Ok(ExitCode::from(super::signals::exit_status(code)));
        }
        Err(err) => {
            let Some(rank) = rank else {
                return Err(err.into());
            };
            let own = !(err.is_peer_left() || err.is_cancelled());
            let err = anyhow::Error::new(err).context(format!(
                "rank {rank} of {}",
                launch.as_ref().map_or(1, |l| l.world)
            ));
            if own && let Some(world) = &held {
                // This rank's own failure: every other rank stops now
                // rather than a timeout later, after this says why.
                eprintln!("error: {err:#}");
                abort_job(world);
            }
            return Err(err);
        }
        Ok(Some(summary)) => summary,
        // A rank other than 0 of a job: rank 0 reports.
        Ok(None) => {
            let code = match options.stop.requested() {
                Some(signal) => ExitCode::from(super::signals::exit_status(signal)),
                None => ExitCode::SUCCESS,
            };
            return Ok(leave(held, code));
        }
    };
    print_summary(&summary, config.model.layers, args.json)?;
    let Some(signal) = summary.stopped_by else {
        return Ok(leave(held, ExitCode::SUCCESS));
    };
    eprintln!(
        "stopped by {} after step {}{}",
        super::signals::name(signal),
        summary.last_step,
        match (&config.train.checkpoint_dir, summary.checkpoints.last()) {
            (Some(dir), Some(_)) =>
                format!("; go on with: strata train --resume {}", dir.display()),
            _ => " (no checkpoint: the run writes none)".into(),
        }
    );
    Ok(leave(
        held,
        ExitCode::from(super::signals::exit_status(signal)),
    ))
}

/// `--resume auto`: resume from the checkpoint directory's newest whole
/// checkpoint when it has one (true), else start the run there.
fn resolve_auto_resume(args: &mut TrainArgs) -> anyhow::Result<bool> {
    if args.resume.as_deref() != Some(Path::new("auto")) {
        return Ok(false);
    }
    let dir = match (&args.checkpoint_dir, &args.config) {
        (Some(dir), _) => Some(dir.clone()),
        (None, Some(path)) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("cannot read config {}", path.display()))?;
            TrainConfig::from_toml(&text)
                .with_context(|| format!("config {}", path.display()))?
                .train
                .checkpoint_dir
        }
        (None, None) => None,
    };
    let Some(dir) = dir else {
        bail!(
            "--resume auto resumes from the run's checkpoint directory: give --checkpoint-dir or set train.checkpoint_dir"
        );
    };
    if dir.join("latest").exists() {
        tracing::info!("--resume auto: resuming from {}", dir.display());
        args.resume = Some(dir);
        return Ok(true);
    }
    tracing::info!(
        "--resume auto: no checkpoint in {} yet: the run starts there",
        dir.display()
    );
    args.resume = None;
    args.checkpoint_dir = Some(dir);
    Ok(false)
}

/// What stays when the run is stopped mid-step: the checkpoint `latest`
/// names in `dir`, read at that moment.
fn last_checkpoint(dir: Option<&Path>) -> String {
    let Some(dir) = dir else {
        return "the run writes no checkpoints".into();
    };
    match std::fs::read_to_string(dir.join("latest")) {
        Ok(name) => format!(
            "the last whole checkpoint is {}",
            dir.join(name.trim()).display()
        ),
        Err(_) => format!("no checkpoint was written in {} yet", dir.display()),
    }
}

/// Says once how long a stop takes (a step, then a checkpoint), as soon as
/// both were measured, and warns when that passes `--signal-grace`.
#[derive(Default)]
struct StopTiming {
    step_s: Option<f64>,
    checkpoint_s: Option<f64>,
    said: bool,
}

impl StopTiming {
    fn observe(&mut self, step_s: f64, checkpoint_s: Option<f64>, grace_s: f64) {
        // The first step also warms caches: the second is the estimate.
        self.step_s = Some(self.step_s.map_or(step_s, |first: f64| first.min(step_s)));
        self.checkpoint_s = checkpoint_s.or(self.checkpoint_s);
        let (Some(step), Some(checkpoint)) = (self.step_s, self.checkpoint_s) else {
            return;
        };
        if self.said {
            return;
        }
        self.said = true;
        let stop = step + checkpoint;
        if stop > grace_s {
            tracing::warn!(
                "a stop takes about {stop:.1} s (a step {step:.1} s, a checkpoint {checkpoint:.1} s), more than --signal-grace {grace_s:.0} s: a signal may end the run mid-step, keeping the checkpoint before"
            );
        } else {
            tracing::info!(
                "a stop takes about {stop:.1} s (a step {step:.1} s, a checkpoint {checkpoint:.1} s), within --signal-grace {grace_s:.0} s"
            );
        }
    }
}

fn mib(bytes: u64) -> String {
    format!("{:.1}MiB", bytes as f64 / (1 << 20) as f64)
}

/// `path` for this run's records: emptied for a new run; for one resumed
/// from `resumed`, rewritten (by rename) with only the records up to that
/// step, then appended to.
fn open_metrics(path: &Path, resumed: Option<u64>) -> std::io::Result<std::fs::File> {
    use std::io::Write;
    if let Some(step) = resumed
        && let Ok(text) = std::fs::read_to_string(path)
    {
        let kept: String = text
            .lines()
            .filter(|line| {
                serde_json::from_str::<serde_json::Value>(line)
                    .ok()
                    .and_then(|r| r["step"].as_u64())
                    .is_some_and(|s| s <= step)
            })
            .map(|line| format!("{line}\n"))
            .collect();
        let tmp = path.with_extension("jsonl.tmp");
        let mut file = std::fs::File::create(&tmp)?;
        file.write_all(kept.as_bytes())?;
        file.sync_all()?;
        std::fs::rename(&tmp, path)?;
    }
    std::fs::OpenOptions::new()
        .create(true)
        .append(resumed.is_some())
        .write(true)
        .truncate(resumed.is_none())
        .open(path)
}

/// Directories removed when dropped once armed (errors warned about).
struct RemoveOnDrop {
    dirs: Vec<PathBuf>,
    armed: std::cell::Cell<bool>,
}

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        if !self.armed.get() {
            return;
        }
        for dir in &self.dirs {
            if let Err(err) = std::fs::remove_dir_all(dir)
                && err.kind() != std::io::ErrorKind::NotFound
            {
                tracing::warn!("cannot remove the swap directory {}: {err}", dir.display());
            }
        }
    }
}

/// Every step's record as one JSON line in `metrics.jsonl` beside the
/// checkpoints: opened at the first step (the engine holds the directory
/// then), started afresh by a new run, and, on a resume, kept up to the
/// step resumed from and appended to (so a file read after a resume holds
/// each step once). A failure to write is warned about once and ends the
/// file, not the run.
struct Metrics {
    dir: Option<PathBuf>,
    resumed_step: Option<u64>,
    file: Option<(PathBuf, std::io::BufWriter<std::fs::File>)>,
}

/// The file `Metrics` writes in the checkpoint directory.
const METRICS_FILE: &str = "metrics.jsonl";

impl Metrics {
    fn new(dir: Option<&Path>, resumed_step: Option<u64>) -> Metrics {
        Metrics {
            dir: dir.map(Path::to_path_buf),
            resumed_step,
            file: None,
        }
    }

    /// The file, opened as this run keeps it; None after a failure.
    fn open(&mut self) -> Option<&mut (PathBuf, std::io::BufWriter<std::fs::File>)> {
        if self.file.is_none() {
            let dir = self.dir.take()?;
            let path = dir.join(METRICS_FILE);
            match open_metrics(&path, self.resumed_step) {
                Ok(file) => self.file = Some((path, std::io::BufWriter::new(file))),
                Err(err) => tracing::warn!(
                    "cannot write {}: {err}; the run goes on without a metrics file",
                    path.display()
                ),
            }
        }
        self.file.as_mut()
    }

    fn write(&mut self, report: &engine::StepReport, moved: &[u64; 4]) {
        use std::io::Write;
        let Some((path, out)) = self.open() else {
            return;
        };
        let mut line = serde_json::to_value(report).expect("a step report serializes");
        line["moved_bytes"] = serde_json::json!({
            "host_to_device": moved[Link::HostToDevice.index()],
            "device_to_host": moved[Link::DeviceToHost.index()],
            "nvme_to_host": moved[Link::NvmeToHost.index()],
            "host_to_nvme": moved[Link::HostToNvme.index()],
        });
        line["unix_time_s"] = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64())
            .into();
        let written = writeln!(out, "{line}").and_then(|()| out.flush());
        if let Err(err) = written {
            tracing::warn!(
                "cannot write {}: {err}; the run goes on without more metrics",
                path.display()
            );
            self.file = None;
        }
    }
}

fn print_summary(summary: &RunSummary, layers: usize, json: bool) -> anyhow::Result<()> {
    println!(
        "trained {} steps: loss {:.4} -> {:.4}, {:.0} tokens/s",
        summary.steps, summary.loss_first, summary.loss_last, summary.tokens_per_s
    );
    println!(
        "model states {} per rank, {:.1}x the device budget of {}",
        mib(summary.model_state_bytes),
        summary.model_state_bytes as f64 / summary.budget_bytes.device as f64,
        mib(summary.budget_bytes.device),
    );
    println!(
        "activations: {} of {layers} blocks recompute their forward in backward (train.checkpoint_activations)",
        summary.recomputed_blocks
    );
    println!("peak memory per tier (rank 0), measured against the plan's prediction:");
    println!(
        "  {:<8} {:>12} {:>12} {:>12} {:>8}",
        "tier", "budget", "peak", "predicted", "error"
    );
    let budget = summary.budget_bytes.as_array();
    let peak = summary.peak_bytes.as_array();
    let predicted = summary.predicted_peak_bytes.as_array();
    for (i, name) in ["device", "host", "nvme"].iter().enumerate() {
        let error = if peak[i] == 0 {
            0.0
        } else {
            100.0 * (predicted[i] as f64 - peak[i] as f64) / peak[i] as f64
        };
        println!(
            "  {:<8} {:>12} {:>12} {:>12} {:>7.1}%",
            name,
            mib(budget[i]),
            mib(peak[i]),
            mib(predicted[i]),
            error
        );
    }
    println!(
        "  (device includes the {} compute workspace)",
        mib(summary.workspace_bytes)
    );
    if summary.state_cache_bytes > 0 {
        println!(
            "  (host includes the {} state cache)",
            mib(summary.state_cache_bytes)
        );
    }
    let moved = summary.moved_bytes;
    println!(
        "moved per link (rank 0): host->device {}, device->host {}, nvme->host {}, host->nvme {}",
        strata_scheduler::gib(moved[Link::HostToDevice.index()]),
        strata_scheduler::gib(moved[Link::DeviceToHost.index()]),
        strata_scheduler::gib(moved[Link::NvmeToHost.index()]),
        strata_scheduler::gib(moved[Link::HostToNvme.index()]),
    );
    for path in &summary.checkpoints {
        println!("checkpoint: {}", path.display());
    }
    for failure in &summary.checkpoint_failures {
        println!(
            "checkpoint of step {} NOT written (the run went on): {}",
            failure.step, failure.cause
        );
    }
    if json {
        println!("{}", serde_json::to_string(summary)?);
    }
    Ok(())
}

/// Where the run's ranks are.
enum Ranks {
    /// Threads of this process (`train.ranks`).
    Threads,
    /// This process is one rank of a launched job.
    Processes(ProcessMember),
}

/// This process's rank of a launched job, and what its collective needs
/// to live until the run ends.
struct ProcessMember {
    rank: engine::ProcessRank,
    world: World,
}

/// What a launched job's collective lives on.
enum World {
    /// MPI, initialized until the run ends (mpirun, srun, PMI launchers).
    #[cfg(feature = "mpi")]
    Mpi(strata_comm::MpiWorld),
    /// A socket to every other rank (torchrun, `--nproc`).
    Tcp(strata_comm::TcpWorld),
}

/// Waits (up to `timeout`) until every rank of the job is here, then
/// lets the world go (MPI is finalized where no collective was given up).
fn rendezvous(world: World, timeout: Duration) {
    use strata_comm::Collective;
    let met = match &world {
        #[cfg(feature = "mpi")]
        World::Mpi(world) => world.group(1, timeout).all_reduce_scalars(&mut [0.0]),
        World::Tcp(world) => world.group(1, timeout).all_reduce_scalars(&mut [0.0]),
    };
    if let Err(err) = met {
        tracing::warn!("the ranks' last rendezvous: {err}");
    }
}

/// Ends every process of the job at once: MPI aborts the job; over TCP
/// this process exits, and its closed sockets end every peer's next
/// exchange, naming this rank.
fn abort_job(world: &World) -> ! {
    match world {
        #[cfg(feature = "mpi")]
        World::Mpi(world) => world.abort(1),
        World::Tcp(_) => std::process::exit(1),
    }
}

/// This process's member of the job `launch` describes: over TCP for
/// torchrun (and `--nproc`) and srun, over MPI for mpirun and PMI
/// launchers (a build with `--features mpi`).
fn open_process_rank(
    launch: &engine::Launch,
    config: &TrainConfig,
) -> anyhow::Result<ProcessMember> {
    let ranked = TrainConfig {
        train: engine::TrainSettings {
            ranks: launch.world,
            ..config.train.clone()
        },
        ..config.clone()
    };
    let elems_max = engine::collective_elems_max(&ranked, launch.world)?;
    let timeout = Duration::from_secs_f64(config.comm.timeout_s);
    if launch.launcher.is_mpi() {
        return open_mpi_rank(launch, elems_max, timeout);
    }
    let master = launch
        .master
        .clone()
        .expect("a launch over TCP has its master");
    let world = strata_comm::TcpWorld::connect(&strata_comm::Rendezvous {
        rank: launch.rank,
        world: launch.world,
        master,
        store: launch.store.clone(),
        // Processes start (and read their data) at their own pace.
        timeout: timeout.max(RENDEZVOUS_MIN),
    })
    .with_context(|| format!("rank {} of {}", launch.rank, launch.world))?;
    let group = world.group(elems_max, timeout);
    Ok(member(group, launch, World::Tcp(world)))
}

/// This process's member of the job: `group`, over `world`.
fn member<T: strata_comm::Transport + 'static>(
    group: strata_comm::Pairwise<T>,
    launch: &engine::Launch,
    world: World,
) -> ProcessMember {
    let cancel = group.cancel_token();
    ProcessMember {
        rank: engine::ProcessRank {
            collective: Box::new(group),
            cancel,
            local_world: launch.local_world,
            local_rank: launch.local_rank,
            launcher_binds: !matches!(launch.launcher, engine::Launcher::Torchrun),
        },
        world,
    }
}

/// The least time the ranks of a job are given to find each other.
const RENDEZVOUS_MIN: Duration = Duration::from_secs(60);

#[cfg(feature = "mpi")]
fn open_mpi_rank(
    launch: &engine::Launch,
    elems_max: usize,
    timeout: Duration,
) -> anyhow::Result<ProcessMember> {
    let world = strata_comm::MpiWorld::init()?;
    if (world.rank(), world.world()) != (launch.rank, launch.world) {
        bail!(
            "{} says rank {} of {}, and MPI says rank {} of {}: launch strata with the MPI it was built against",
            launch.launcher.name(),
            launch.rank,
            launch.world,
            world.rank(),
            world.world()
        );
    }
    let group = world.group(elems_max, timeout);
    Ok(member(group, launch, World::Mpi(world)))
}

#[cfg(not(feature = "mpi"))]
fn open_mpi_rank(launch: &engine::Launch, _: usize, _: Duration) -> anyhow::Result<ProcessMember> {
    bail!(
        "launched by {} ({} processes), and this strata was built without MPI: build it with cargo build --release --features mpi (Debian: apt-get install libopenmpi-dev openmpi-bin libclang-dev), or start the ranks with strata train --nproc {} or torchrun",
        launch.launcher.name(),
        launch.world,
        launch.world
    )
}
