//! strata-train: model architectures written once over the kernels'
//! `Backend` and comm's `Collective` behind one interface ([`model`]: each
//! in its own file, found by name in one registry), and the training engine
//! that runs them with their states tiered by `strata-runtime` under
//! `strata-scheduler`'s plans: [`Engine`] (one data-parallel rank, a few
//! parts that own their fields: `Engine::new(config, collective)`, then
//! `engine.step(tokens)`), [`run`] (whole runs, ranks as threads,
//! checkpoints) and [`TrainConfig`]; [`evaluate`]: a model's loss and
//! perplexity over held-out data, its parameters placed as in training; [`generate`]: a trained model, decoded
//! a token at a time with a key/value cache.
//!
//! ```no_run
//! use strata_train::{ByteCorpus, RunOptions, TrainConfig, run};
//! let config = TrainConfig::default();
//! let corpus = ByteCorpus::new(std::fs::read("input.txt")?, config.model.seq)?;
//! let summary = run(&config, &corpus, &RunOptions::default(), &mut |_progress| {})?;
//! println!("final loss {}", summary.losses.last().unwrap());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod crash;
pub mod engine;
mod error;
pub mod generate;
pub mod hf;
pub mod model;

pub use engine::{
    ByteCorpus, COMM_TIMEOUT_S_DEFAULT, Checkpoint, CheckpointFailure, CheckpointMeta,
    Checkpointing, CommConfig, ComputeDtype, Corpus, DATA_FILES_MAX, DOCUMENT_START, DataAttention,
    DataConfig, DataFormat, DataOrder, DataPaths, DataPosition, DataReader, DeepSpeedMapping,
    Difference, EVAL_WINDOWS_DEFAULT, Engine, EvalConfig, Evaluation, Faults,
    GRAD_ACCUMULATION_MAX, Keys, Launch, Launcher, ModelConfig, NOT_A_TARGET, OptimConfig,
    ParallelConfig, Placement, PlacementConfig, Prediction, ProcessRank, Progress, RANKS_MAX,
    ROUNDING_STOCHASTIC, RUN_CONFIG, RunOptions, RunSummary, Schedule, StateCache, StateDtype,
    StepReport, StopRequest, TextTokenizer, TierBytes, TokenDtype, Tokenized, TrainConfig,
    TrainSettings, WarmupType, collective_elems_max, evaluate, from_deepspeed_json, run,
    run_process, tokenize, tokenize_bytes, window_start,
};
pub use error::{Result, TrainError};
