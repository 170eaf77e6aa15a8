//! SIGINT and SIGTERM during `strata train`, handled on a dedicated thread
//! with `sigwait`: the signals are blocked in every thread (the mask is
//! set before any is started, and threads inherit it), so the kernel
//! queues them for this thread instead of killing the process.
//!
//! The first signal asks the run to stop at its next step boundary (it
//! writes a final checkpoint and removes its swap files). A second signal,
//! or `--signal-grace` passing first, aborts the step in progress: every
//! wait of the run is cancelled ([`StopRequest::abort`]), the ranks return
//! within a bounded time, the swap files go, and `strata train` exits
//! 128 + the signal. Checkpoints are only ever published whole (written
//! under a temporary name, then renamed), so the last whole one stays.
//! Should the abort itself not end the process within [`ABORT_BOUND`] (a
//! compute op or an I/O request that does not return), or a third signal
//! come, the process exits there and then; the next run in the same
//! directories removes the swap files it leaves.

use std::time::{Duration, Instant};

use strata_train::StopRequest;

/// How long an aborted run may take to return before the process exits
/// regardless.
pub const ABORT_BOUND: Duration = Duration::from_secs(10);

/// The signals that stop a run.
const STOP_SIGNALS: [libc::c_int; 2] = [libc::SIGINT, libc::SIGTERM];

/// The set of [`STOP_SIGNALS`], blocked in this thread and every thread it
/// starts from now on.
#[derive(Clone, Copy)]
pub struct Blocked {
    set: libc::sigset_t,
}

// SAFETY: a sigset_t is a plain bit set; the functions given it only read it.
unsafe impl Send for Blocked {}

/// Blocks SIGINT and SIGTERM in the calling thread; call it before any
/// other thread starts, so that all inherit the mask.
pub fn block() -> std::io::Result<Blocked> {
    // SAFETY: sigset_t is plain data; sigemptyset initializes it fully.
    let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a valid, writable sigset_t.
    unsafe { libc::sigemptyset(&mut set) };
    for signal in STOP_SIGNALS {
        // SAFETY: `set` is initialized and the signal numbers are valid.
        unsafe { libc::sigaddset(&mut set, signal) };
    }
    // SAFETY: `set` is initialized; a null old-set pointer is allowed.
    let failed = unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) };
    if failed != 0 {
        return Err(std::io::Error::from_raw_os_error(failed));
    }
    Ok(Blocked { set })
}

impl Blocked {
    /// Waits for one of the blocked signals, at most `timeout` (forever
    /// without one); `None` when the time passed.
    fn wait(&self, timeout: Option<Duration>) -> Option<libc::c_int> {
        let deadline = timeout.map(|t| Instant::now() + t);
        loop {
            let signal = match deadline {
                None => {
                    let mut signal: libc::c_int = 0;
                    // SAFETY: `self.set` is initialized; `signal` is writable.
                    let failed = unsafe { libc::sigwait(&self.set, &mut signal) };
                    (failed == 0).then_some(signal)
                }
                Some(deadline) => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return None;
                    }
                    let timeout = libc::timespec {
                        tv_sec: left.as_secs() as libc::time_t,
                        tv_nsec: left.subsec_nanos() as libc::c_long,
                    };
                    let (set, no_info) = (&self.set, std::ptr::null_mut());
                    // SAFETY: `set` and `timeout` are initialized; a null siginfo pointer is allowed.
                    let signal = unsafe { libc::sigtimedwait(set, no_info, &timeout) };
                    (signal > 0).then_some(signal)
                }
            };
            // Anything else (EINTR, EAGAIN at the deadline) goes round.
            if let Some(signal) = signal {
                return Some(signal);
            }
        }
    }
}

/// The ranks `strata train --nproc` started, by rank: a pid while the
/// rank runs, `None` once it has been reaped (its pid may then be another
/// process's). The waiter reaps under the lock, so a signal never goes to
/// a reaped pid.
pub type Ranks = std::sync::Arc<std::sync::Mutex<Vec<Option<u32>>>>;

/// Starts the thread that passes every SIGINT and SIGTERM this process
/// gets on to each rank still running in `ranks` (which stop together at
/// a step boundary as a launched job does).
pub fn forward(blocked: Blocked, ranks: Ranks) -> std::io::Result<()> {
    std::thread::Builder::new()
        .name("strata-forward".into())
        .spawn(move || {
            while let Some(signal) = blocked.wait(None) {
                let ranks = ranks.lock().expect("ranks");
                for &pid in ranks.iter().flatten() {
                    // The pid is a child not yet reaped (the lock is held
                    // over the reaping): that rank's, running or a zombie.
                    // SAFETY: kill(2) takes any pid and signal number.
                    unsafe { libc::kill(pid as libc::pid_t, signal) };
                }
            }
        })
        .map(drop)
}

/// Makes `command`'s process end with this one: its own process group
/// (a terminal's Ctrl-C reaches this process alone, which passes it on
/// once), and SIGTERM should this process die first.
pub fn end_with_parent(command: &mut std::process::Command) {
    use std::os::unix::process::CommandExt;
    command.process_group(0);
    // The closure runs in the child between fork and exec.
    // SAFETY: it calls only prctl(2), which is async-signal-safe and
    // touches no memory of the parent's.
    unsafe {
        command.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// The signal's name.
pub fn name(signal: libc::c_int) -> &'static str {
    match signal {
        libc::SIGINT => "SIGINT",
        libc::SIGTERM => "SIGTERM",
        _ => "a signal",
    }
}

/// The exit status of a process stopped by `signal`, as shells report it.
pub fn exit_status(signal: libc::c_int) -> u8 {
    (128 + signal).clamp(0, 255) as u8
}

/// Starts the thread that turns the first signal into `stop`, and a second
/// one, or `grace` passing after the first, into an abort of the step in
/// progress (then, past [`ABORT_BOUND`] or at a third signal, an immediate
/// exit). `last_checkpoint` says, at that moment, what stays.
pub fn watch(
    blocked: Blocked,
    stop: StopRequest,
    grace: Duration,
    last_checkpoint: impl Fn() -> String + Send + 'static,
) -> std::io::Result<()> {
    std::thread::Builder::new()
        .name("strata-signals".into())
        .spawn(move || {
            let Some(first) = blocked.wait(None) else {
                return;
            };
            eprintln!(
                "\nstrata: {} received: stopping after the current step (with a checkpoint if the run writes them), within --signal-grace {:.0} s; a second signal aborts the step in progress",
                name(first),
                grace.as_secs_f64()
            );
            stop.request(first);
            let (code, why) = match blocked.wait(Some(grace)) {
                Some(second) => (second, format!("a second signal ({}) received", name(second))),
                None => (
                    first,
                    format!(
                        "the run did not stop within --signal-grace {:.0} s",
                        grace.as_secs_f64()
                    ),
                ),
            };
            eprintln!(
                "strata: {why}: aborting the step in progress; {}",
                last_checkpoint()
            );
            stop.abort(code);
            // The run returns by itself, normally well within the bound.
            let why = match blocked.wait(Some(ABORT_BOUND)) {
                Some(third) => format!("a third signal ({}) received", name(third)),
                None => format!(
                    "the aborted run did not return within {} s",
                    ABORT_BOUND.as_secs()
                ),
            };
            eprintln!(
                "strata: {why}: exiting now; {}. The next run in the same directories removes this one's swap files.",
                last_checkpoint()
            );
            std::process::exit(i32::from(exit_status(code)));
        })
        .map(drop)
}
