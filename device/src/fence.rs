//! Streams, and fences that order work across them.
//!
//! Work is enqueued on a stream: the device's one compute stream, or one
//! of its two copy streams. A [`Fence`] marks a point on a stream; another
//! stream (or the host) waits on it instead of on the whole device. On the
//! CPU device compute runs on the calling thread, so its fences are
//! [`Fence::ready`] or a copy engine's completion flag.

use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use cudarc::driver::safe::CudaEvent;

use crate::error::{DeviceError, Result};

/// Which of a device's streams.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum StreamKind {
    /// The one stream kernels run on.
    Compute,
    /// Host to device copies.
    CopyToDevice,
    /// Device to host copies.
    CopyToHost,
    /// Collectives between devices (NCCL), ordered after compute by events.
    Collective,
}

impl StreamKind {
    /// Lower-case name, for messages and traces.
    pub fn name(self) -> &'static str {
        match self {
            StreamKind::Compute => "compute",
            StreamKind::CopyToDevice => "host->device copy",
            StreamKind::CopyToHost => "device->host copy",
            StreamKind::Collective => "collective",
        }
    }
}

/// What a waiter checks while the work before a watched fence runs: work
/// that depends on other parties (a collective waits for its peers) can
/// fail or hang where the device cannot see it.
pub trait Watch: Send + Sync {
    /// While the work runs: `Err` ends the wait with the cause (a peer's
    /// failure, a cancel, a deadline passed); the watch has already
    /// stopped the work.
    fn check(&self) -> std::result::Result<(), String>;
    /// Once the event has passed: `Err` when the work was stopped rather
    /// than done (an aborted collective's kernels end early), so that its
    /// results are not taken for good.
    fn completed(&self) -> std::result::Result<(), String>;
}

/// An event recorded on a stream (inside a [`Fence`]).
pub struct Event {
    pub(crate) event: CudaEvent,
    pub(crate) stream: StreamKind,
    /// Checked while waiting: the wait polls the event instead of blocking.
    pub(crate) watch: Option<Arc<dyn Watch>>,
}

impl Event {
    /// Polls between checks of a watch: spins first (a collective that is
    /// nearly done), then sleeps this long.
    const WATCH_SLEEP: Duration = Duration::from_micros(50);
    const WATCH_SPINS: u32 = 200;

    pub(crate) fn synchronize(&self) -> Result<()> {
        let Some(watch) = &self.watch else {
            return self
                .event
                .synchronize()
                .map_err(|err| DeviceError::Enqueued {
                    stream: self.stream.name(),
                    cause: format!("{err:?}"),
                });
        };
        for poll in 0u32.. {
            if self.is_complete()? {
                return watch.completed().map_err(|cause| self.stopped(cause));
            }
            watch.check().map_err(|cause| self.stopped(cause))?;
            match poll < Self::WATCH_SPINS {
                true => std::thread::yield_now(),
                false => std::thread::sleep(Self::WATCH_SLEEP),
            }
        }
        unreachable!("the poll loop returns")
    }

    fn stopped(&self, cause: String) -> DeviceError {
        DeviceError::Stopped {
            stream: self.stream.name(),
            cause,
        }
    }

    /// Whether the work is done; a watched event's work also checked (done
    /// rather than stopped; still running and not failed).
    pub(crate) fn is_passed(&self) -> Result<bool> {
        let complete = self.is_complete()?;
        match (&self.watch, complete) {
            (None, _) => Ok(complete),
            (Some(watch), true) => watch.completed().map(|()| true),
            (Some(watch), false) => watch.check().map(|()| false),
        }
        .map_err(|cause| self.stopped(cause))
    }

    pub(crate) fn is_complete(&self) -> Result<bool> {
        self.event
            .try_is_complete()
            .map_err(|err| DeviceError::Enqueued {
                stream: self.stream.name(),
                cause: format!("{err:?}"),
            })
    }
}

/// A completion flag a host thread sets (the CPU device's copy engines).
#[derive(Default)]
pub struct HostSignal {
    finished: Mutex<bool>,
    ready: Condvar,
}

impl HostSignal {
    /// Marks the work done and wakes every waiter.
    pub fn finish(&self) {
        *self.finished.lock().expect("signal lock") = true;
        self.ready.notify_all();
    }

    fn wait(&self) {
        let mut finished = self.finished.lock().expect("signal lock");
        while !*finished {
            finished = self.ready.wait(finished).expect("signal lock");
        }
    }

    fn is_set(&self) -> bool {
        *self.finished.lock().expect("signal lock")
    }
}

/// A point in a stream's work: what the next user of a buffer waits for.
/// Clones name the same point (a copy's fence is both the new copy's
/// "ready" and the source's "last use").
#[derive(Clone)]
#[must_use = "a fence must be waited on (or handed to the next user) before its buffers are reused"]
pub enum Fence {
    /// Already passed (work done on the calling thread).
    Ready,
    /// Set by a host thread when its work is done.
    Host(Arc<HostSignal>),
    /// An event recorded on a CUDA stream.
    Cuda(Arc<Event>),
}

impl Fence {
    /// A fence that has already passed.
    pub fn ready() -> Fence {
        Fence::Ready
    }

    /// A fence a host thread will set through the returned signal.
    pub fn host() -> (Fence, Arc<HostSignal>) {
        let signal = Arc::new(HostSignal::default());
        (Fence::Host(signal.clone()), signal)
    }

    /// Blocks the calling thread until the work before the fence is done.
    /// Errors of enqueued work surface here.
    pub fn wait(&self) -> Result<()> {
        match self {
            Fence::Ready => Ok(()),
            Fence::Host(signal) => {
                signal.wait();
                Ok(())
            }
            Fence::Cuda(event) => event.synchronize(),
        }
    }

    /// Whether the work before the fence is done, without blocking.
    pub fn is_passed(&self) -> Result<bool> {
        match self {
            Fence::Ready => Ok(true),
            Fence::Host(signal) => Ok(signal.is_set()),
            Fence::Cuda(event) => event.is_passed(),
        }
    }
}

impl std::fmt::Debug for Fence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Fence::Ready => f.write_str("Fence::Ready"),
            Fence::Host(signal) => write!(f, "Fence::Host(set: {})", signal.is_set()),
            Fence::Cuda(event) => match event.watch {
                Some(_) => f.write_str("Fence::Cuda(watched)"),
                None => f.write_str("Fence::Cuda"),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_host_fence_passes_when_its_signal_is_set_from_another_thread() {
        let (fence, signal) = Fence::host();
        assert!(!fence.is_passed().unwrap());
        let setter = std::thread::spawn(move || signal.finish());
        fence.wait().unwrap();
        assert!(fence.is_passed().unwrap());
        setter.join().unwrap();
        assert!(Fence::ready().is_passed().unwrap());
    }
}
