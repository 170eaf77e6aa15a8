//! `strata train --nproc N`: N ranks as N processes of this machine, for
//! a machine without a launcher. Each is this binary with the same
//! arguments (less `--nproc`) and torchrun's variables (`RANK`,
//! `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`,
//! `MASTER_PORT` at a free local port, where rank 0 listens), so a rank
//! runs exactly as under torchrun. SIGINT and SIGTERM are passed on to
//! every rank once (the ranks have process groups of their own, so a
//! terminal's Ctrl-C reaches this process alone), and they get SIGTERM
//! should this process die. The ranks find a rank that went away
//! themselves (its sockets close); should one hang past the collectives'
//! timeout after another failed, it is killed here.

use std::ffi::OsString;
use std::process::{Child, Command, ExitCode, ExitStatus};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

use super::signals::Blocked;

/// Ranks `--nproc` may start.
pub const NPROC_MAX: usize = 1024;
/// What a rank is given beyond the collectives' timeout to exit by itself
/// once another has failed.
const GRACE_AFTER_FAILURE: Duration = Duration::from_secs(30);

/// This process's arguments without `--nproc N` (or `--nproc=N`).
fn arguments_without_nproc() -> Vec<OsString> {
    let mut out = Vec::new();
    let mut args = std::env::args_os().skip(1);
    while let Some(arg) = args.next() {
        match arg.to_str() {
            Some("--nproc") => {
                args.next();
            }
            Some(text) if text.starts_with("--nproc=") => {}
            _ => out.push(arg),
        }
    }
    out
}

/// How a rank ended, in words, and its exit status as a shell reports it.
fn ended(status: ExitStatus) -> (String, u8) {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => (format!("exited with status {code}"), code as u8),
        (None, Some(signal)) => (
            format!("was killed by signal {signal}"),
            (128 + signal).clamp(0, 255) as u8,
        ),
        _ => ("ended".into(), 1),
    }
}

/// Starts `nproc` ranks of this command and waits for every one; exits
/// with rank 0's status if it failed, else the lowest failed rank's (0
/// when all succeeded). `timeout_s` is the run's `[comm] timeout_s`.
pub fn run(nproc: usize, timeout_s: f64, blocked: Blocked) -> anyhow::Result<ExitCode> {
    if nproc == 0 || nproc > NPROC_MAX {
        bail!("--nproc {nproc}: give a number of processes from 1 to {NPROC_MAX}");
    }
    let exe = std::env::current_exe().context("find this strata binary to start the ranks")?;
    let port = strata_comm::free_port().context("find a free port for rank 0 to listen at")?;
    let args = arguments_without_nproc();
    let mut children: Vec<Child> = Vec::with_capacity(nproc);
    for rank in 0..nproc {
        let mut command = Command::new(&exe);
        super::signals::end_with_parent(&mut command);
        let spawned = command
            .args(&args)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", nproc.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("LOCAL_WORLD_SIZE", nproc.to_string())
            .env("GROUP_RANK", "0")
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            // Rank 0 listens itself: there is no agent's store.
            .env_remove("TORCHELASTIC_USE_AGENT_STORE")
            .spawn();
        match spawned {
            Ok(child) => children.push(child),
            Err(err) => {
                for child in &mut children {
                    let _ = child.kill();
                    let _ = child.wait();
                }
                return Err(err).with_context(|| format!("start rank {rank} ({})", exe.display()));
            }
        }
    }
    tracing::info!(
        "--nproc {nproc}: ranks as processes {:?}, rank 0 listening at 127.0.0.1:{port}",
        children.iter().map(Child::id).collect::<Vec<_>>()
    );
    let running: super::signals::Ranks = std::sync::Arc::new(std::sync::Mutex::new(
        children.iter().map(|c| Some(c.id())).collect(),
    ));
    super::signals::forward(blocked, running.clone())
        .context("start the thread that passes signals on to the ranks")?;
    let mut statuses: Vec<Option<(String, u8)>> = vec![None; nproc];
    let mut first_failure: Option<(usize, Instant)> = None;
    let bound = Duration::from_secs_f64(timeout_s) + GRACE_AFTER_FAILURE;
    while statuses.iter().any(Option::is_none) {
        for (rank, child) in children.iter_mut().enumerate() {
            if statuses[rank].is_some() {
                continue;
            }
            // Reaped under the lock the signals are passed on under.
            let mut pids = running.lock().expect("ranks");
            let reaped = child.try_wait().context("wait for a rank")?;
            if reaped.is_some() {
                pids[rank] = None;
            }
            drop(pids);
            if let Some(status) = reaped {
                let (words, code) = ended(status);
                if code != 0 {
                    eprintln!("strata train --nproc: rank {rank} of {nproc} {words}");
                    first_failure.get_or_insert((rank, Instant::now()));
                }
                statuses[rank] = Some((words, code));
            }
        }
        if let Some((failed, at)) = first_failure
            && at.elapsed() > bound
        {
            for (rank, child) in children.iter_mut().enumerate() {
                if statuses[rank].is_none() {
                    eprintln!(
                        "strata train --nproc: rank {rank} still runs {:.0} s after rank {failed} failed: killing it",
                        at.elapsed().as_secs_f64()
                    );
                    let _ = child.kill();
                }
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let codes: Vec<u8> = statuses.iter().flatten().map(|(_, code)| *code).collect();
    let code = match codes[0] {
        0 => codes.iter().copied().find(|&c| c != 0).unwrap_or(0),
        failed => failed,
    };
    Ok(ExitCode::from(code))
}
