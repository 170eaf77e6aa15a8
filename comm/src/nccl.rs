//! NCCL: collectives between GPUs, on cudarc's raw `sys` layer (not its
//! safe `Comm`, which owns its stream and panics on a failed abort).
//!
//! An [`Nccl`] member runs every operation on device buffers on its GPU's
//! collective stream ([`StreamKind::Collective`]), ordered after the work
//! enqueued so far on the compute stream, and returns a watched fence: a
//! waiter polls the completion event and, between polls, the
//! communicator's asynchronous error, the run's cancellation and the
//! group's deadline (`[comm] timeout_s`, counted from when the collective
//! stream reaches the operation). Any of them aborts the communicator, and
//! the group refuses every later call (`Abandoned`); a fence whose event
//! passed after an abort is an error too (aborted kernels end early): no
//! wait blocks in a plain event wait on a peer that may be gone, and no
//! stopped collective's output is taken for good. Point-to-point transfers
//! of device memory are refused (a send and its receive would need one
//! NCCL group); NCCL newer than cudarc's bindings (2.30) is refused by
//! name.
//!
//! The communicator is non-blocking (`blocking = 0` in its config): its
//! creation, its splits and an enqueue may answer `ncclInProgress`, and are
//! polled the same way. The unique id reaches every rank over the host
//! group it is built on (TCP under torchrun, srun and `--nproc`; MPI under
//! mpirun), which also carries host operands and the scalar sums. Sums of
//! 16-bit floats are NCCL's own (rounded at each step of its ring or
//! tree), not the host backends' fp32 sum rounded once.
//!
//! A split is one NCCL call over the whole parent group
//! (`ncclCommSplit`): every rank of the parent splits at once, each naming
//! its own part of one partition of the ranks (shard groups, replica
//! groups), in the same order.

use std::ffi::{CStr, c_int, c_void};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use cudarc::nccl::sys;
use strata_device::cuda::{Context, Library, probe_library};
use strata_device::{Cancel, DeviceKind, Dtype, Fence, Raw, StreamKind, View, ViewMut, Watch};

use crate::in_process::{contiguous, same_dtype, world_times};
use crate::{Collective, CommError, Result};

/// The config's magic and the version this layout is (`NCCL_API_MAGIC`,
/// `NCCL_VERSION(2, 30, 0)`): a library reads the fields it knows and
/// takes its defaults for the rest.
const CONFIG_MAGIC: u32 = 0xcafe_beef;
const CONFIG_VERSION: u32 = 2 * 10_000 + 30 * 100;
/// `NCCL_CONFIG_UNDEF_INT`: the library's default.
const UNDEF: c_int = c_int::MIN;
/// Creating a communicator waits at least this long for every rank.
const INIT_MIN: Duration = Duration::from_secs(60);
/// Polls of a pending call: spins first, then sleeps this long.
const POLL_SLEEP: Duration = Duration::from_micros(50);
const POLL_SPINS: u32 = 200;
/// A communicator dropped waits at most this long for its pending work to
/// flush (`ncclCommFinalize`) before it is aborted.
const FINALIZE_MAX: Duration = Duration::from_secs(10);
/// The newest NCCL whose result codes cudarc's bindings know (a newer
/// library may return a code the Rust enum cannot hold).
const NEWEST: (u32, u32) = (2, 30);

/// The NCCL library's version (`ncclGetVersion`), probed first: a missing
/// library is a typed error naming the files looked for.
pub fn nccl_version() -> Result<(u32, u32, u32)> {
    probe_library(Library::Nccl)?;
    let mut code: c_int = 0;
    // SAFETY: the library is present; the call writes one int.
    let result = unsafe { sys::ncclGetVersion(&mut code) };
    check("ncclGetVersion", result, None)?;
    Ok(version_parts(code as u32))
}

/// `ncclGetVersion`'s code as (major, minor, patch): `X*10000 + Y*100 +
/// Z` from 2.9 on, `X*1000 + Y*100 + Z` before.
fn version_parts(code: u32) -> (u32, u32, u32) {
    match code >= 10_000 {
        true => (code / 10_000, code % 10_000 / 100, code % 100),
        false => (code / 1000, code % 1000 / 100, code % 100),
    }
}

/// A non-blocking communicator's config: `NCCL_CONFIG_INITIALIZER` with
/// `blocking = 0`.
fn config() -> sys::ncclConfig_t {
    sys::ncclConfig_t {
        size: std::mem::size_of::<sys::ncclConfig_t>(),
        magic: CONFIG_MAGIC,
        version: CONFIG_VERSION,
        blocking: 0,
        cgaClusterSize: UNDEF,
        minCTAs: UNDEF,
        maxCTAs: UNDEF,
        netName: std::ptr::null(),
        splitShare: UNDEF,
        trafficClass: UNDEF,
        commName: std::ptr::null(),
        collnetEnable: UNDEF,
        CTAPolicy: UNDEF,
        shrinkShare: UNDEF,
        nvlsCTAs: UNDEF,
        nChannelsPerNetPeer: UNDEF,
        nvlinkCentricSched: UNDEF,
        graphUsageMode: UNDEF,
        numRmaCtx: UNDEF,
        maxP2pPeers: UNDEF,
    }
}

/// NCCL's type for `dtype`.
fn nccl_dtype(dtype: Dtype) -> sys::ncclDataType_t {
    match dtype {
        Dtype::F32 => sys::ncclDataType_t::ncclFloat32,
        Dtype::Bf16 => sys::ncclDataType_t::ncclBfloat16,
        Dtype::F16 => sys::ncclDataType_t::ncclFloat16,
        Dtype::U32 => sys::ncclDataType_t::ncclUint32,
    }
}

/// `Nccl` unless `result` is success (or, for a non-blocking call, in
/// progress), with the library's last words for `comm`.
fn check(op: &'static str, result: sys::ncclResult_t, comm: Option<sys::ncclComm_t>) -> Result<()> {
    use sys::ncclResult_t::{ncclInProgress, ncclSuccess};
    if matches!(result, ncclSuccess | ncclInProgress) {
        return Ok(());
    }
    Err(CommError::Nccl {
        op,
        code: format!("{result:?}"),
        detail: last_error(comm),
    })
}

/// `ncclGetLastError`'s text (empty when it says nothing), copied at once.
/// NCCL keeps one buffer for the process, which its own threads may
/// rewrite meanwhile: the words can be another failure's, but the read is
/// of a fixed, NUL-terminated buffer.
fn last_error(comm: Option<sys::ncclComm_t>) -> String {
    let comm = comm.unwrap_or(std::ptr::null_mut());
    // The library is loaded (a call preceded this); a null communicator
    // is allowed.
    // SAFETY: a loaded library, a null or live communicator.
    let text = unsafe { sys::ncclGetLastError(comm) };
    if text.is_null() {
        return String::new();
    }
    // Non-null: NCCL's static NUL-terminated buffer, which lives as long
    // as the library.
    // SAFETY: a valid C string for the read.
    unsafe { CStr::from_ptr(text) }
        .to_string_lossy()
        .into_owned()
}

/// A communicator, live or aborted.
struct Comm {
    raw: sys::ncclComm_t,
    aborted: bool,
}

// An NCCL communicator may be used from any thread, one call at a time:
// every use goes through the `Mutex` in `Shared`.
// SAFETY: one thread at a time, by that lock.
unsafe impl Send for Comm {}

impl Comm {
    /// Aborts the communicator (its pending work is dropped, its peers'
    /// waits fail): after it the handle is gone.
    fn abort(&mut self) {
        if !self.aborted {
            self.aborted = true;
            // Nothing uses the handle after (`aborted` is checked before
            // every call).
            // SAFETY: a live communicator, aborted once.
            let _ = unsafe { sys::ncclCommAbort(self.raw) };
        }
    }

    /// The communicator's asynchronous state: `Ok(true)` when the last
    /// call has completed, `Ok(false)` while it is in progress.
    fn settled(&self, op: &'static str) -> Result<bool> {
        let mut state = sys::ncclResult_t::ncclSuccess;
        // Callers check `aborted`; the call writes one result.
        // SAFETY: a live communicator and a valid out-pointer.
        let result = unsafe { sys::ncclCommGetAsyncError(self.raw, &mut state) };
        check(op, result, Some(self.raw))?;
        check(op, state, Some(self.raw))?;
        Ok(state == sys::ncclResult_t::ncclSuccess)
    }

    /// Polls until the last call completes, against `cancel` and `waited`;
    /// aborts the communicator on any failure.
    fn settle(
        &mut self,
        op: &'static str,
        bytes: u64,
        waited: Duration,
        cancel: &Cancel,
    ) -> Result<()> {
        let started = Instant::now();
        for poll in 0u32.. {
            let failure = match self.settled(op) {
                Ok(true) => return Ok(()),
                Ok(false) if cancel.is_cancelled() => CommError::Cancelled,
                Ok(false) if started.elapsed() > waited => CommError::Timeout {
                    op,
                    bytes,
                    peers: Vec::new(),
                    waited_s: started.elapsed().as_secs_f64(),
                },
                Ok(false) => {
                    pause(poll);
                    continue;
                }
                Err(err) => err,
            };
            self.abort();
            return Err(failure);
        }
        unreachable!("the poll loop returns")
    }
}

/// What a member and the fences of its operations share.
struct Shared {
    comm: Mutex<Comm>,
    cancel: Cancel,
    timeout: Duration,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Comm> {
        self.comm
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The live communicator, or `Abandoned`.
    fn live(&self, op: &'static str) -> Result<MutexGuard<'_, Comm>> {
        let comm = self.lock();
        match comm.aborted {
            true => Err(CommError::Abandoned { op }),
            false => Ok(comm),
        }
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        let waited = self.timeout.min(FINALIZE_MAX);
        let comm = self.comm.get_mut().unwrap_or_else(|p| p.into_inner());
        if comm.aborted {
            return;
        }
        // Finalized (its pending work flushed) within the deadline, then
        // destroyed; aborted if it cannot be.
        // SAFETY: a live communicator, finalized once.
        let finalized = unsafe { sys::ncclCommFinalize(comm.raw) };
        let flushed = check("ncclCommFinalize", finalized, Some(comm.raw))
            .and_then(|()| comm.settle("ncclCommFinalize", 0, waited, &self.cancel));
        match flushed {
            // SAFETY: finalized; destroyed once, never used after.
            Ok(()) => drop(unsafe { sys::ncclCommDestroy(comm.raw) }),
            // A failed finalize call, or one that did not flush in time
            // (`settle` aborted that one already; an abort is once).
            Err(_) => comm.abort(),
        }
    }
}

fn pause(poll: u32) {
    match poll < POLL_SPINS {
        true => std::thread::yield_now(),
        false => std::thread::sleep(POLL_SLEEP),
    }
}

/// A pending operation's watch: its communicator's asynchronous error, the
/// run's cancel, and its deadline, counted from when the collective stream
/// reached it (`begun`: the compute it waited for is not the peers').
struct Pending {
    shared: Arc<Shared>,
    op: &'static str,
    bytes: u64,
    begun: Fence,
    since: Mutex<Option<Instant>>,
}

impl Pending {
    fn aborted(&self) -> String {
        format!(
            "{}: the communicator was aborted (an earlier failure, a cancel or a timeout), so its results cannot be trusted",
            self.op
        )
    }
}

impl Watch for Pending {
    fn check(&self) -> std::result::Result<(), String> {
        if self.shared.cancel.is_cancelled() {
            self.shared.lock().abort();
            return Err(CommError::Cancelled.to_string());
        }
        // Another thread enqueueing holds the communicator: still pending.
        let Ok(mut comm) = self.shared.comm.try_lock() else {
            return Ok(());
        };
        if comm.aborted {
            return Err(self.aborted());
        }
        let since = {
            let mut since = self.since.lock().unwrap_or_else(|p| p.into_inner());
            if since.is_none() && self.begun.is_passed().map_err(|e| e.to_string())? {
                *since = Some(Instant::now());
            }
            *since
        };
        let failure = match (comm.settled(self.op), since) {
            (Err(err), _) => err.to_string(),
            (Ok(_), Some(since)) if since.elapsed() > self.shared.timeout => CommError::Timeout {
                op: self.op,
                bytes: self.bytes,
                peers: Vec::new(),
                waited_s: since.elapsed().as_secs_f64(),
            }
            .to_string(),
            (Ok(_), _) => return Ok(()),
        };
        comm.abort();
        Err(failure)
    }

    fn completed(&self) -> std::result::Result<(), String> {
        match self.shared.lock().aborted {
            true => Err(self.aborted()),
            false => Ok(()),
        }
    }
}

/// Where an operation's operands are.
enum Operands {
    /// All in host memory: the host group carries them.
    Host,
    /// All on this member's GPU.
    Device,
}

/// This rank's member of a group of GPUs over NCCL (module docs).
pub struct Nccl {
    shared: Arc<Shared>,
    host: Box<dyn Collective>,
    context: Arc<Context>,
    rank: usize,
    world: usize,
    elems_max: usize,
}

impl Nccl {
    /// Creates the communicator of `host`'s ranks on `context`'s GPU: rank
    /// 0 makes the unique id and broadcasts it over `host`, every rank
    /// joins (waiting up to `timeout`, at least a minute, for all). Every
    /// rank of `host` calls it at once. Its waits end on `host`'s
    /// cancellation.
    pub fn connect(
        host: Box<dyn Collective>,
        context: Arc<Context>,
        elems_max: usize,
        timeout: Duration,
    ) -> Result<Nccl> {
        const OP: &str = "ncclCommInitRankConfig";
        let cancel = host.cancellation().unwrap_or_default();
        let (major, minor, patch) = nccl_version()?;
        if (major, minor) > NEWEST {
            return Err(CommError::Unsupported {
                op: "NCCL",
                why: format!(
                    "NCCL {major}.{minor}.{patch} is newer than the {}.{} strata's bindings know (its result codes may differ): put NCCL {}.{} or older first on LD_LIBRARY_PATH",
                    NEWEST.0, NEWEST.1, NEWEST.0, NEWEST.1
                ),
            });
        }
        context.bind()?;
        let (rank, world) = (host.rank(), host.world());
        // The id's 128 bytes, then rank 0's word on whether it has one: a
        // rank 0 that could not make it fails every rank at once.
        let mut words = [0u32; 33];
        let mut made = Ok(());
        if rank == 0 {
            let mut id = sys::ncclUniqueId { internal: [0; 128] };
            // SAFETY: the library is present; the call writes the id.
            let result = unsafe { sys::ncclGetUniqueId(&mut id) };
            made = check("ncclGetUniqueId", result, None);
            bytemuck::cast_slice_mut::<u32, u8>(&mut words[..32])
                .iter_mut()
                .zip(id.internal)
                .for_each(|(sent, byte)| *sent = byte as u8);
            words[32] = u32::from(made.is_err());
        }
        host.broadcast(0, ViewMut::host_slice(&mut words))?.wait()?;
        made?;
        if words[32] != 0 {
            return Err(CommError::Unsupported {
                op: "ncclGetUniqueId",
                why: "rank 0 could not make NCCL's unique id; its own error says why".into(),
            });
        }
        let mut id = sys::ncclUniqueId { internal: [0; 128] };
        for (byte, &came) in id
            .internal
            .iter_mut()
            .zip(bytemuck::cast_slice::<u32, u8>(&words[..32]))
        {
            *byte = came as std::ffi::c_char;
        }
        let mut raw: sys::ncclComm_t = std::ptr::null_mut();
        let mut config = config();
        // The context is bound on this thread; every rank passes the same
        // id and world.
        // SAFETY: `raw` and `config` outlive the call.
        let result = unsafe {
            sys::ncclCommInitRankConfig(&mut raw, world as c_int, id, rank as c_int, &mut config)
        };
        check(OP, result, None)?;
        Self::member(raw, host, context, elems_max, timeout, cancel, OP)
    }

    /// A member over the communicator `raw`, once its creation completed.
    fn member(
        raw: sys::ncclComm_t,
        host: Box<dyn Collective>,
        context: Arc<Context>,
        elems_max: usize,
        timeout: Duration,
        cancel: Cancel,
        op: &'static str,
    ) -> Result<Nccl> {
        let shared = Arc::new(Shared {
            comm: Mutex::new(Comm {
                raw,
                aborted: false,
            }),
            cancel,
            timeout,
        });
        shared
            .lock()
            .settle(op, 0, timeout.max(INIT_MIN), &shared.cancel)?;
        Ok(Nccl {
            shared,
            rank: host.rank(),
            world: host.world(),
            host,
            context,
            elems_max,
        })
    }

    fn limit(&self, elems: usize) -> Result<()> {
        crate::within_limit(elems, self.elems_max)
    }

    /// Where `operands` are: all host (the host group's), or all on the
    /// GPU and contiguous; `Unreachable` or `Shape` otherwise.
    fn operands(op: &'static str, operands: &[(&'static str, Raw)]) -> Result<Operands> {
        let on_device = |raw: &Raw| raw.kind == DeviceKind::Cuda;
        if operands.iter().all(|(_, raw)| !on_device(raw)) {
            return Ok(Operands::Host);
        }
        for (what, raw) in operands {
            if !on_device(raw) {
                return Err(CommError::Unreachable {
                    op,
                    what,
                    kind: raw.kind,
                });
            }
            contiguous(op, what, raw)?;
        }
        Ok(Operands::Device)
    }

    /// Enqueues `call` (given the communicator and the collective stream)
    /// after the compute stream's work so far, and returns its watched
    /// fence.
    fn enqueue(
        &self,
        op: &'static str,
        bytes: u64,
        call: impl FnOnce(sys::ncclComm_t, sys::cudaStream_t) -> sys::ncclResult_t,
    ) -> Result<Fence> {
        let mut comm = self.shared.live(op)?;
        self.context.bind()?;
        let inputs = self.context.record(StreamKind::Compute)?;
        self.context.wait_on(StreamKind::Collective, &inputs)?;
        // Where the peers' part begins: the deadline counts from here.
        let begun = self.context.record(StreamKind::Collective)?;
        let stream = self.context.raw_stream(StreamKind::Collective) as sys::cudaStream_t;
        let result = call(comm.raw, stream);
        if let Err(err) = check(op, result, Some(comm.raw)) {
            comm.abort();
            return Err(err);
        }
        // A non-blocking enqueue may still be in progress: settled before
        // the next call, as NCCL asks.
        comm.settle(op, bytes, self.shared.timeout, &self.shared.cancel)?;
        drop(comm);
        let watch = Arc::new(Pending {
            shared: self.shared.clone(),
            op,
            bytes,
            begun,
            since: Mutex::new(None),
        });
        Ok(self.context.record_watched(StreamKind::Collective, watch)?)
    }

    /// `Dtype` unless `dtype` can be summed.
    fn summable(op: &'static str, dtype: Dtype) -> Result<()> {
        match dtype {
            Dtype::U32 => Err(CommError::Dtype {
                op,
                dtype,
                why: "sums are of floats",
            }),
            _ => Ok(()),
        }
    }
}

/// A device view's address as NCCL takes it.
fn address(raw: &Raw) -> *mut c_void {
    raw.start_address() as usize as *mut c_void
}

fn bytes_of(raw: &Raw) -> u64 {
    raw.len() as u64 * raw.dtype.bytes()
}

impl Collective for Nccl {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn cancellation(&self) -> Option<Cancel> {
        Some(self.shared.cancel.clone())
    }

    fn all_gather(&self, shard: View<'_>, out: ViewMut<'_>) -> Result<Fence> {
        const OP: &str = "all_gather";
        same_dtype(OP, shard.dtype(), out.dtype())?;
        world_times(OP, "output", (out.len(), shard.len(), self.world))?;
        self.limit(shard.len())?;
        let (send, recv) = (shard.raw(), out.raw());
        if let Operands::Host = Self::operands(OP, &[("shard", send), ("output", recv)])? {
            return self.host.all_gather(shard, out);
        }
        self.enqueue(OP, bytes_of(&recv), |comm, stream| {
            // Both views are contiguous device memory of this GPU, sized as
            // NCCL reads and writes them, and by the trait's contract their
            // buffers are neither reused nor freed before the fence passes.
            // SAFETY: valid device ranges for the whole operation (above).
            unsafe {
                sys::ncclAllGather(
                    address(&send),
                    address(&recv),
                    send.len(),
                    nccl_dtype(send.dtype),
                    comm,
                    stream,
                )
            }
        })
    }

    fn reduce_scatter(&self, full: View<'_>, shard: ViewMut<'_>) -> Result<Fence> {
        const OP: &str = "reduce_scatter";
        same_dtype(OP, full.dtype(), shard.dtype())?;
        Self::summable(OP, full.dtype())?;
        world_times(OP, "input", (full.len(), shard.len(), self.world))?;
        self.limit(shard.len())?;
        let (send, recv) = (full.raw(), shard.raw());
        if let Operands::Host = Self::operands(OP, &[("input", send), ("shard", recv)])? {
            return self.host.reduce_scatter(full, shard);
        }
        self.enqueue(OP, bytes_of(&send), |comm, stream| {
            // SAFETY: as in all_gather.
            unsafe {
                sys::ncclReduceScatter(
                    address(&send),
                    address(&recv),
                    recv.len(),
                    nccl_dtype(send.dtype),
                    sys::ncclRedOp_t::ncclSum,
                    comm,
                    stream,
                )
            }
        })
    }

    fn all_reduce(&self, values: ViewMut<'_>) -> Result<Fence> {
        const OP: &str = "all_reduce";
        Self::summable(OP, values.dtype())?;
        self.limit(values.len())?;
        let raw = values.raw();
        if let Operands::Host = Self::operands(OP, &[("values", raw)])? {
            return self.host.all_reduce(values);
        }
        self.enqueue(OP, bytes_of(&raw), |comm, stream| {
            // SAFETY: as in all_gather (in place, as NCCL allows).
            unsafe {
                sys::ncclAllReduce(
                    address(&raw),
                    address(&raw),
                    raw.len(),
                    nccl_dtype(raw.dtype),
                    sys::ncclRedOp_t::ncclSum,
                    comm,
                    stream,
                )
            }
        })
    }

    fn all_reduce_scalars(&self, values: &mut [f64]) -> Result<()> {
        drop(self.shared.live("all_reduce_scalars")?);
        self.host.all_reduce_scalars(values)
    }

    fn broadcast(&self, root: usize, values: ViewMut<'_>) -> Result<Fence> {
        const OP: &str = "broadcast";
        crate::in_group(OP, root, self.world)?;
        self.limit(values.len())?;
        let raw = values.raw();
        if let Operands::Host = Self::operands(OP, &[("values", raw)])? {
            return self.host.broadcast(root, values);
        }
        self.enqueue(OP, bytes_of(&raw), |comm, stream| {
            // SAFETY: as in all_gather (in place, as NCCL allows).
            unsafe {
                sys::ncclBroadcast(
                    address(&raw),
                    address(&raw),
                    raw.len(),
                    nccl_dtype(raw.dtype),
                    root as c_int,
                    comm,
                    stream,
                )
            }
        })
    }

    fn send(&self, peer: usize, values: View<'_>) -> Result<Fence> {
        const OP: &str = "send";
        self.other(OP, peer)?;
        self.limit(values.len())?;
        match Self::operands(OP, &[("values", values.raw())])? {
            Operands::Host => self.host.send(peer, values),
            // A send and its receive must be in one NCCL group to progress
            // together (a pipeline's exchange would deadlock otherwise).
            Operands::Device => Err(CommError::Unsupported {
                op: OP,
                why: "point-to-point transfers of device memory over NCCL are not built yet (pipeline stages on GPUs): pass host buffers".into(),
            }),
        }
    }

    fn recv(&self, peer: usize, values: ViewMut<'_>) -> Result<Fence> {
        const OP: &str = "recv";
        self.other(OP, peer)?;
        self.limit(values.len())?;
        match Self::operands(OP, &[("values", values.raw())])? {
            Operands::Host => self.host.recv(peer, values),
            // A send and its receive must be in one NCCL group to progress
            // together (a pipeline's exchange would deadlock otherwise).
            Operands::Device => Err(CommError::Unsupported {
                op: OP,
                why: "point-to-point transfers of device memory over NCCL are not built yet (pipeline stages on GPUs): pass host buffers".into(),
            }),
        }
    }

    fn split(&self, members: &[usize]) -> Result<Box<dyn Collective>> {
        const OP: &str = "ncclCommSplit";
        let index = crate::member_index(members, self.rank, self.world)?;
        let host = self.host.split(members)?;
        let mut raw: sys::ncclComm_t = std::ptr::null_mut();
        {
            let mut comm = self.shared.live(OP)?;
            self.context.bind()?;
            let mut config = config();
            // The part's first rank names it: every part of one partition
            // has its own.
            // Every rank of the parent splits at once.
            // SAFETY: a live communicator; `raw` and `config` outlive the call.
            let result = unsafe {
                sys::ncclCommSplit(
                    comm.raw,
                    members[0] as c_int,
                    index as c_int,
                    &mut raw,
                    &mut config,
                )
            };
            if let Err(err) = check(OP, result, Some(comm.raw)) {
                comm.abort();
                return Err(err);
            }
            let waited = self.shared.timeout.max(INIT_MIN);
            comm.settle(OP, 0, waited, &self.shared.cancel)?;
        }
        Ok(Box::new(Self::member(
            raw,
            host,
            self.context.clone(),
            self.elems_max,
            self.shared.timeout,
            self.shared.cancel.clone(),
            OP,
        )?))
    }
}

impl Nccl {
    /// `Peer` unless `peer` is another rank of the group.
    fn other(&self, op: &'static str, peer: usize) -> Result<()> {
        crate::other_rank(op, peer, self.rank, self.world)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_config_is_nccls_initializer_with_blocking_off() {
        let config = config();
        assert_eq!(config.size, std::mem::size_of::<sys::ncclConfig_t>());
        assert_eq!((config.magic, config.version), (0xcafe_beef, 23_000));
        assert_eq!(config.blocking, 0);
        for undefined in [config.cgaClusterSize, config.splitShare, config.maxP2pPeers] {
            assert_eq!(undefined, i32::MIN);
        }
        assert!(config.netName.is_null() && config.commName.is_null());
    }

    #[test]
    fn versions_read_both_encodings() {
        assert_eq!(version_parts(23_005), (2, 30, 5));
        assert_eq!(version_parts(22_703), (2, 27, 3));
        assert_eq!(version_parts(2804), (2, 8, 4));
    }

    #[test]
    fn every_dtype_has_its_nccl_type() {
        use sys::ncclDataType_t::*;
        assert_eq!(nccl_dtype(Dtype::Bf16), ncclBfloat16);
        assert_eq!(nccl_dtype(Dtype::F32), ncclFloat32);
        assert_eq!(nccl_dtype(Dtype::F16), ncclFloat16);
        assert_eq!(nccl_dtype(Dtype::U32), ncclUint32);
    }

    #[test]
    fn a_missing_library_is_named_before_any_call() {
        match nccl_version() {
            Ok(version) => println!("NCCL {version:?} is present here"),
            Err(CommError::Device(err)) => {
                assert!(err.to_string().contains("nccl"), "{err}");
                println!("skipped the version: {err}");
            }
            Err(other) => panic!("unexpected {other}"),
        }
    }

    #[test]
    fn host_operands_go_to_the_host_group_and_mixed_ones_are_refused() {
        let host = [0.0f32; 4];
        let raw = View::host_slice(&host).raw();
        assert!(matches!(
            Nccl::operands("all_gather", &[("shard", raw), ("output", raw)]),
            Ok(Operands::Host)
        ));
        let device = Raw {
            kind: DeviceKind::Cuda,
            address: 0x1000,
            ..raw
        };
        let refused = Nccl::operands("all_gather", &[("shard", device), ("output", raw)]);
        assert!(
            matches!(refused, Err(CommError::Unreachable { what: "output", .. })),
            "{:?}",
            refused.err()
        );
    }
}
