//! `strata checkpoint verify`: is a checkpoint whole, without training.

use std::path::PathBuf;

use anyhow::Context;
use strata_train::Checkpoint;

/// What to do with a checkpoint.
#[derive(clap::Subcommand, Debug)]
pub enum CheckpointCommand {
    /// Check every file of a checkpoint against its checksum (meta.json's
    /// own included) and that nothing unlisted lies beside them. Exit
    /// status: 0 the checkpoint is whole; 1 it is not (unreadable,
    /// corrupt, incomplete, or not a checkpoint); 2 bad arguments.
    Verify(VerifyArgs),
}

/// `strata checkpoint verify`.
#[derive(clap::Args, Debug)]
pub struct VerifyArgs {
    /// A step directory (step-NNNNNNNN) or a run's checkpoint directory
    /// (then the one `latest` names).
    dir: PathBuf,
    /// Print one JSON document instead of lines.
    #[arg(long)]
    json: bool,
}

/// Runs `strata checkpoint ...`.
pub fn run(command: CheckpointCommand) -> anyhow::Result<()> {
    let CheckpointCommand::Verify(args) = command;
    let checkpoint = Checkpoint::open(&args.dir)
        .with_context(|| format!("{} is not a whole checkpoint", args.dir.display()))?;
    let files = checkpoint
        .verify()
        .with_context(|| format!("{} is not a whole checkpoint", checkpoint.dir.display()))?;
    let meta_checksummed = checkpoint.meta_checksummed();
    if args.json {
        let files: Vec<_> = files
            .iter()
            .map(|(name, bytes)| serde_json::json!({ "name": name, "bytes": bytes }))
            .collect();
        let report = serde_json::json!({
            "dir": checkpoint.dir,
            "step": checkpoint.meta.step,
            "whole": true,
            "meta_json_checksummed": meta_checksummed,
            "files": files,
        });
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    println!(
        "{} (step {}):",
        checkpoint.dir.display(),
        checkpoint.meta.step
    );
    for (name, bytes) in &files {
        println!("  ok  {name} ({bytes} bytes)");
    }
    if meta_checksummed {
        println!("  ok  meta.json (checksum in meta.json.xxh3)");
    } else {
        println!("  ok  meta.json (parsed; written before strata recorded its checksum)");
    }
    println!("whole: every file matches its checksum");
    Ok(())
}
