//! [`Runtime`]: the tensor registry and the residency manager. It executes
//! the moves it is told to make (deciding them is the scheduler's job) and
//! spills to the next tier on its own only when a budget is hit.
//!
//! Every copy of a tensor lives in one tier's memory: a range of the device
//! arena, a list of pinned host buffers following the tensor's canonical
//! chunk plan, or one NVMe extent per chunk. A tensor may hold valid copies in
//! several tiers at once: moving up keeps the lower copies (so dropping the
//! upper one later costs nothing), moving down releases the upper ones, and
//! writing through a guard releases every other copy.

use std::collections::{HashMap, VecDeque};
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use strata_device::{Cancel, Fence};
use strata_storage::{Extent, ExtentAllocator, SwapStore, round_up};

use crate::config::RuntimeConfig;
use crate::device::{self, CopyPiece, Device, Direction};
use crate::error::{Result, RuntimeError};
use crate::guard::{Guard, View};
use crate::host_pool::{Chunk, FreeLists, HostPool, Shortfall, Slot, Spread, commit_spread};
use crate::state::{
    Access, Copy, Entry, MemoryFaults, Place, Shared, State, check_size, in_use_error,
    moving_error, not_resident, released_by,
};
use crate::stats::{EventKind, Stats, Trace, TraceEvent, caller_lane, is_mover_lane};
use crate::tier::{Link, TensorId, TensorKind, TensorMeta, Tier};

/// Alignment of device allocations (covers every vector load and cudaMalloc's
/// guarantee).
pub const DEVICE_ALIGN_BYTES: u64 = 256;

struct Job {
    tensor: TensorId,
    target: Tier,
    /// Copies from this tier down to the target are released once the
    /// target holds the data (those above it stay).
    release_from: Tier,
    done: Arc<MoveDone>,
}

#[derive(Default)]
struct MoveDone {
    outcome: Mutex<Option<Result<()>>>,
    ready: Condvar,
}

/// A job dropped before its outcome was set (its mover panicked, or the
/// runtime stopped with it queued) completes as [`RuntimeError::Stopped`]:
/// nobody waits forever for a mover that is gone.
impl Drop for Job {
    fn drop(&mut self) {
        let mut outcome = match self.done.outcome.lock() {
            Ok(outcome) => outcome,
            Err(poisoned) => poisoned.into_inner(),
        };
        if outcome.is_none() {
            *outcome = Some(Err(RuntimeError::Stopped));
            self.done.ready.notify_all();
        }
    }
}

/// The completion of a move: `wait()` for it. Dropping it does not cancel
/// the move; a failure nobody waits for is logged.
#[must_use = "a move's completion says whether it succeeded"]
pub struct Completion {
    done: Arc<MoveDone>,
    shared: Arc<Shared>,
    tensor: TensorId,
    bytes: u64,
}

impl Completion {
    /// Blocks until the move has finished; the time blocked counts as wait
    /// time in the accounting and the trace.
    pub fn wait(self) -> Result<()> {
        let started = Instant::now();
        let mut outcome = self.done.outcome.lock().expect("move lock");
        let mut waited = false;
        while outcome.is_none() {
            waited = true;
            if let Err(err) = self.shared.check_cancelled() {
                // The move goes on; its outcome is nobody's now.
                drop(outcome);
                self.shared
                    .record_wait(self.tensor, self.bytes, started, caller_lane());
                return Err(err);
            }
            outcome = Cancel::sleep(&self.done.ready, outcome);
        }
        let result = outcome.take().expect("checked");
        drop(outcome);
        if waited {
            self.shared
                .record_wait(self.tensor, self.bytes, started, caller_lane());
        }
        result
    }

    /// Whether the move has finished.
    pub fn is_done(&self) -> bool {
        self.done.outcome.lock().expect("move lock").is_some()
    }

    fn ready(shared: &Arc<Shared>, tensor: TensorId, result: Result<()>) -> Self {
        let done = Arc::new(MoveDone::default());
        *done.outcome.lock().expect("move lock") = Some(result);
        Self {
            done,
            shared: shared.clone(),
            tensor,
            bytes: 0,
        }
    }
}

/// Staging bytes a streamed NVMe fill or read keeps in flight
/// ([`Runtime::register_on_nvme`], [`Runtime::read_from_nvme`]).
const STREAM_BYTES: usize = 16 << 20;

/// The most chunks a streamed fill or read keeps in flight.
const STREAM_DEPTH_MAX: usize = 64;

/// Fills bytes of a tensor being registered, at an offset
/// ([`Runtime::register_on_nvme`]).
pub type Fill<'a, E> = dyn FnMut(u64, &mut [u8]) -> std::result::Result<(), E> + 'a;

/// Takes bytes of a tensor being read, at an offset
/// ([`Runtime::read_from_nvme`]).
pub type Visit<'a, E> = dyn FnMut(u64, &[u8]) -> std::result::Result<(), E> + 'a;

/// The residency manager: a registry of tensors, their copies in each tier,
/// and the threads that move them.
///
/// ```no_run
/// use strata_runtime::{Runtime, RuntimeConfig, TensorMeta, TensorKind, Dtype, Tier, Access};
/// let runtime = Runtime::new(&RuntimeConfig::default())?;
/// let meta = TensorMeta::new("layer0.weight", TensorKind::Param, Dtype::Bf16, &[4096, 4096]);
/// let id = runtime.register(meta, Tier::Host)?;
/// runtime.move_to(id, Tier::Device)?.wait()?;     // prefetch: the host copy stays
/// let guard = runtime.acquire(id, Tier::Device, Access::Read)?; // cannot be evicted now
/// drop(guard);
/// runtime.move_to(id, Tier::Nvme)?.wait()?;       // evict: device and host copies released
/// # Ok::<(), strata_runtime::RuntimeError>(())
/// ```
pub struct Runtime {
    shared: Arc<Shared>,
    /// Moves that read from NVMe, for `runtime.read_movers` threads: one
    /// serves them in the order they were asked for, so the first needed
    /// lands first instead of sharing the drive with the ones after it.
    reads: Option<SyncSender<Job>>,
    /// Moves that write to NVMe, for the other `runtime.movers` threads.
    writes: Option<SyncSender<Job>>,
    /// Moves between host and device only, for a thread of their own, so
    /// that a short device copy never queues behind NVMe transfers.
    device_jobs: Option<SyncSender<Job>>,
    movers: Vec<JoinHandle<()>>,
}

/// The NVMe store `config` names, if any, with `faults` injected when given.
fn open_store(
    config: &RuntimeConfig,
    faults: Option<(strata_storage::FaultRates, u64)>,
) -> Result<Option<SwapStore>> {
    Ok(match (&config.nvme, faults) {
        (Some(nvme), None) => Some(SwapStore::open(nvme)?),
        (Some(nvme), Some((rates, seed))) => Some(SwapStore::open_faulty(nvme, rates, seed)?),
        (None, _) => None,
    })
}

impl Runtime {
    /// Opens the device, allocates the pinned pool, opens the NVMe store and
    /// starts the movers.
    pub fn new(config: &RuntimeConfig) -> Result<Self> {
        Self::open_with(config, None, None, None)
    }

    /// Like [`Runtime::new`] with the NVMe store's completions rewritten by
    /// a seeded fault injector ([`SwapStore::open_faulty`]): for
    /// simulations that drive a whole program through storage faults.
    pub fn with_faults(
        config: &RuntimeConfig,
        rates: strata_storage::FaultRates,
        seed: u64,
    ) -> Result<Self> {
        Self::open_with(config, None, Some((rates, seed)), None)
    }

    /// Injects seeded out-of-memory faults into every later placement in the
    /// device and host tiers (simulations; see [`MemoryFaults`]).
    pub fn inject_memory_faults(&self, faults: MemoryFaults) {
        self.shared.lock().memory_faults = Some(faults);
    }

    /// Like [`Runtime::new`] on the device of `config` (or, given one,
    /// [`Runtime::on_device`]), with the NVMe store's faults of
    /// [`Runtime::with_faults`] if given, and the pinned pool's pages
    /// committed by `spread`'s threads (see [`commit_spread`]): the
    /// optimizer's, which will update the pool; without it, by the
    /// calling thread.
    pub fn open_with(
        config: &RuntimeConfig,
        device: Option<Box<dyn Device>>,
        faults: Option<(strata_storage::FaultRates, u64)>,
        spread: Option<&dyn Spread>,
    ) -> Result<Self> {
        config.validate()?;
        let device = match device {
            Some(device) => {
                // The caller's device already holds its arena: count the pool only.
                check_host_memory(config, false)?;
                device
            }
            None => {
                let arena_on_host = match config.device.kind {
                    crate::config::DeviceChoice::Cpu => true,
                    crate::config::DeviceChoice::Cuda => false,
                    crate::config::DeviceChoice::Auto => device::cuda_available().is_err(),
                };
                // Before the device's arena is touched.
                check_host_memory(config, arena_on_host)?;
                device::open(&config.device)?
            }
        };
        Self::assemble(config, device, open_store(config, faults)?, spread)
    }

    /// Like [`Runtime::new`] (or [`Runtime::with_faults`], given `faults`)
    /// on a device the caller opened: a CUDA device on a context the
    /// caller's compute backend shares (`CudaDevice::on_context`).
    pub fn on_device(
        config: &RuntimeConfig,
        device: Box<dyn Device>,
        faults: Option<(strata_storage::FaultRates, u64)>,
    ) -> Result<Self> {
        Self::open_with(config, Some(device), faults, None)
    }

    /// Like [`Runtime::new`] with a device and store built by the caller
    /// (a store with fault injection, in tests and simulations).
    pub fn with_parts(
        config: &RuntimeConfig,
        device: Box<dyn Device>,
        store: Option<SwapStore>,
    ) -> Result<Self> {
        config.validate()?;
        // The caller's device already holds its arena: count the pool only.
        check_host_memory(config, false)?;
        Self::assemble(config, device, store, None)
    }

    /// Allocates the pool and starts the movers, on a validated config.
    fn assemble(
        config: &RuntimeConfig,
        device: Box<dyn Device>,
        store: Option<SwapStore>,
        spread: Option<&dyn Spread>,
    ) -> Result<Self> {
        let classes = config.host.resolved_classes();
        if let Some(store) = &store {
            let align = store.align_bytes();
            if let Some(class) = classes
                .iter()
                .find(|c| !c.buffer_size.0.is_multiple_of(align))
            {
                return Err(RuntimeError::Config {
                    key: "host.classes.buffer_size",
                    value: class.buffer_size.to_string(),
                    fix: format!("use a multiple of the NVMe direct-I/O alignment ({align} bytes)"),
                });
            }
        }
        // The commit's own time, apart from the rest (mapping, locking or
        // the driver's registration).
        let commit_s = std::cell::Cell::new(0.0f64);
        let commit = |bytes: &mut [u8]| {
            let started = std::time::Instant::now();
            let done = commit_spread(bytes, spread);
            commit_s.set(commit_s.get() + started.elapsed().as_secs_f64());
            done
        };
        let started = std::time::Instant::now();
        let pool = HostPool::new(&classes, &mut |bytes| device.alloc_host(bytes, &commit))?;
        let total_s = started.elapsed().as_secs_f64();
        tracing::debug!(
            bytes = pool.capacity_bytes(),
            threads = spread.map_or(1, |s| s.threads()),
            locked = pool.is_locked(),
            ms = total_s * 1e3,
            commit_ms = commit_s.get() * 1e3,
            other_ms = (total_s - commit_s.get()) * 1e3,
            "pinned host pool committed"
        );
        if config.host.require_locked && !pool.is_locked() {
            return Err(RuntimeError::MemlockLimit {
                needed_bytes: pool.capacity_bytes(),
                limit_bytes: memlock_limit_bytes(),
            });
        }
        let (pool, device): (Arc<HostPool>, Arc<dyn Device>) = (Arc::new(pool), Arc::from(device));
        let mut stats = Stats::default();
        stats.tiers[Tier::Device.index()].budget_bytes = device.capacity_bytes();
        stats.tiers[Tier::Host.index()].budget_bytes = pool.capacity_bytes();
        stats.tiers[Tier::Nvme.index()].budget_bytes =
            store.as_ref().map_or(0, |s| s.capacity_bytes());
        let state = State {
            tensors: HashMap::with_capacity(config.runtime.tensors_max.min(1 << 16)),
            next_id: 0,
            tensors_max: config.runtime.tensors_max,
            retired: VecDeque::with_capacity(config.runtime.trace_events_max),
            free_lists: FreeLists::new(&pool),
            device_space: ExtentAllocator::new(device.capacity_bytes(), DEVICE_ALIGN_BYTES),
            stats,
            releasing: [0; 3],
            clock: 0,
            fenced: VecDeque::with_capacity(config.runtime.tensors_max.min(1 << 16)),
            landings: 0,
            memory_faults: None,
            poison: config
                .runtime
                .poison_released
                .then(|| crate::state::Poison {
                    pool: pool.clone(),
                    device: device.clone(),
                }),
        };
        tracing::info!(
            "runtime: {}; pinned pool {} bytes in {} class(es) ({}); nvme {}",
            device.describe(),
            pool.capacity_bytes(),
            pool.classes(),
            if pool.is_locked() {
                "page-locked"
            } else {
                "NOT page-locked"
            },
            store.as_ref().map_or("none".to_string(), |s| format!(
                "{} bytes",
                s.capacity_bytes()
            )),
        );
        if config.runtime.poison_released {
            tracing::warn!(
                "runtime.poison_released: released memory is filled with NaN (a debug mode; it costs a fill per release)"
            );
        }
        let shared = Arc::new(Shared {
            state: Mutex::new(state),
            changed: Condvar::new(),
            pool,
            device,
            store,
            trace: Mutex::new(Trace::new(config.runtime.trace_events_max)),
            started: Instant::now(),
            room_wait: Duration::from_millis(config.runtime.room_wait_ms),
            cancel: strata_device::Cancel::new(),
            staging: Mutex::new(Vec::new()),
        });
        let queue = || {
            let (sender, receiver) = sync_channel::<Job>(config.runtime.moves_queued_max);
            (sender, Arc::new(Mutex::new(receiver)))
        };
        let (reads, read_receiver) = queue();
        let (writes, write_receiver) = queue();
        let (device_jobs, device_receiver) = queue();
        let (movers_nvme, readers) = (config.runtime.movers, config.runtime.read_movers);
        let mut movers = Vec::with_capacity(movers_nvme + 1);
        // Lanes 0..read_movers serve NVMe reads, then up to `movers` NVMe
        // writes; lane `movers` device moves.
        for lane in 0..=movers_nvme {
            let receiver = if lane == movers_nvme {
                device_receiver.clone()
            } else if lane < readers {
                read_receiver.clone()
            } else {
                write_receiver.clone()
            };
            let shared = shared.clone();
            let mover = std::thread::Builder::new()
                .name(format!("strata-mover-{lane}"))
                .spawn(move || mover_loop(&shared, &receiver, lane as u32))
                .map_err(|err| RuntimeError::Config {
                    key: "runtime.movers",
                    value: config.runtime.movers.to_string(),
                    fix: format!("could not start a mover thread ({err}): use fewer"),
                })?;
            movers.push(mover);
        }
        Ok(Self {
            shared,
            reads: Some(reads),
            writes: Some(writes),
            device_jobs: Some(device_jobs),
            movers,
        })
    }

    /// The device at the top tier.
    pub fn device(&self) -> &dyn Device {
        self.shared.device.as_ref()
    }

    /// The NVMe store, if configured.
    pub fn store(&self) -> Option<&SwapStore> {
        self.shared.store.as_ref()
    }

    /// Registers a tensor with a zeroed copy in `tier`, spilling other
    /// tensors if the tier is full. On NVMe the store zeroes its extents
    /// without writing them where the file system can
    /// ([`SwapStore::zero`]).
    pub fn register(&self, meta: TensorMeta, tier: Tier) -> Result<TensorId> {
        self.register_in(meta, tier, |shared: &Shared, id| match tier {
            Tier::Nvme => shared.fill_nvme(id, 0, &mut |_, _| Ok(())),
            _ => shared.zero(id, tier),
        })
    }

    /// [`Runtime::register`] for a tensor the caller writes whole before
    /// anything reads it (a saved activation, a gradient shard, the state
    /// set an update writes first): its copy holds whatever its memory
    /// held (NaN with `runtime.poison_released`), and no fill is spent on
    /// it. On NVMe its extents are not written: a read before the first
    /// write fails (`ExtentNotWritten`) instead of returning stale bytes.
    pub fn register_unfilled(&self, meta: TensorMeta, tier: Tier) -> Result<TensorId> {
        self.register_in(meta, tier, |_: &Shared, _| Ok(()))
    }

    /// Reads a tensor's NVMe copy a chunk at a time through two staging
    /// buffers (reading the next while `read(offset, bytes)` takes one),
    /// so that it never needs room on the host: a checkpoint of states
    /// larger than the host budget. Every chunk is checked against its
    /// checksums as any NVMe read is. The copy must be valid (after
    /// `return_home`, a tensor whose home is NVMe); while it is read the
    /// tensor cannot be written or freed.
    pub fn read_from_nvme<E: From<RuntimeError>>(
        &self,
        id: TensorId,
        read: &mut Visit<'_, E>,
    ) -> std::result::Result<(), E> {
        let (chunks, extents) = {
            let mut state = self.shared.lock();
            loop {
                let entry = state.entry(id)?;
                if entry.is_moving() {
                    self.shared.check_cancelled()?;
                    state = Cancel::sleep(&self.shared.changed, state);
                    continue;
                }
                if !entry.valid(Tier::Nvme) {
                    return Err(not_resident(id, entry, Tier::Nvme).into());
                }
                if entry.has_writer() {
                    return Err(in_use_error(id, entry).into());
                }
                break;
            }
            let now = state.tick();
            let entry = state.entry_mut(id)?;
            entry.begin_use(Tier::Nvme, Access::Read, now);
            let extents = entry.nvme_extents().expect("a valid nvme copy is on nvme");
            (entry.chunks.clone(), extents)
        };
        let result = self.shared.stream_nvme(id, &chunks, &extents, read);
        let mut state = self.shared.lock();
        if let Ok(entry) = state.entry_mut(id) {
            entry.end_use(Tier::Nvme, Access::Read);
        }
        drop(state);
        self.shared.changed.notify_all();
        result
    }

    /// Registers a tensor straight on NVMe with the bytes `fill(offset,
    /// bytes)` writes, a chunk at a time through staging buffers of the
    /// largest chunk's size (filling one while up to 16 MiB of others are
    /// written), so that the tensor is never whole in host memory and the host
    /// budget is not touched. Chunks wholly at or past `zeros_from` are
    /// zeroed by the store without writing their bytes; `fill` is asked
    /// only for bytes before it.
    pub fn register_on_nvme<E: From<RuntimeError>>(
        &self,
        meta: TensorMeta,
        zeros_from: u64,
        fill: &mut Fill<'_, E>,
    ) -> std::result::Result<TensorId, E> {
        self.register_in(meta, Tier::Nvme, |shared: &Shared, id| {
            shared.fill_nvme(id, zeros_from, fill)
        })
    }

    fn register_in<E: From<RuntimeError>>(
        &self,
        meta: TensorMeta,
        tier: Tier,
        fill: impl FnOnce(&Shared, TensorId) -> std::result::Result<(), E>,
    ) -> std::result::Result<TensorId, E> {
        let len_bytes = meta.len_bytes();
        if len_bytes == 0 {
            return Err(RuntimeError::Config {
                key: "shape",
                value: format!("{:?}", meta.shape),
                fix: format!("tensor {} has no elements; give it at least one", meta.name),
            }
            .into());
        }
        if tier == Tier::Nvme && self.shared.store.is_none() {
            return Err(RuntimeError::Config {
                key: "tier",
                value: "nvme".into(),
                fix: format!(
                    "tensor {} was registered on NVMe but no swap directory is configured: set [nvme] dirs",
                    meta.name
                ),
            }
            .into());
        }
        let mut chunks = Vec::new();
        self.shared.pool.plan(len_bytes, &mut chunks);
        let id = {
            let mut state = self.shared.lock();
            if state.tensors.len() >= state.tensors_max {
                return Err(RuntimeError::Limit {
                    what: "runtime.tensors_max",
                    max: state.tensors_max as u64,
                }
                .into());
            }
            let id = TensorId(state.next_id);
            state.next_id += 1;
            let entry = Entry {
                meta,
                len_bytes,
                chunks: chunks.into(),
                copies: [None, None, None],
                moving: Some(tier),
                kept_above: Tier::Device,
                readers: [0; 3],
                writer: false,
                last_use: 0,
                next_use: u64::MAX,
                placements: 0,
            };
            state.tensors.insert(id, entry);
            id
        };
        let placed = match self.shared.allocate(id, tier, caller_lane()) {
            Ok(()) => fill(&self.shared, id),
            Err(err) => Err(err.into()),
        };
        let mut state = self.shared.lock();
        match placed {
            Ok(()) => {
                let entry = state.entry_mut(id)?;
                entry.copies[tier.index()]
                    .as_mut()
                    .expect("allocated")
                    .valid = true;
                entry.moving = None;
                drop(state);
                self.shared.changed.notify_all();
                Ok(id)
            }
            Err(err) => {
                let entry = state.tensors.remove(&id).expect("registered above");
                state.release_all(entry);
                drop(state);
                self.shared.changed.notify_all();
                Err(err)
            }
        }
    }

    /// Frees a tensor and every copy of it.
    pub fn free(&self, id: TensorId) -> Result<()> {
        let mut state = self.shared.lock();
        let entry = state.entry(id)?;
        if let Some(target) = entry.moving {
            return Err(moving_error(id, entry, target));
        }
        if entry.in_use() {
            return Err(in_use_error(id, entry));
        }
        let mut entry = state.tensors.remove(&id).expect("checked");
        let name = std::mem::take(&mut entry.meta.name);
        if state.retired.capacity() > 0 {
            if state.retired.len() == state.retired.capacity() {
                state.retired.pop_front();
            }
            state.retired.push_back((id, name));
        }
        state.release_all(entry);
        drop(state);
        self.shared.changed.notify_all();
        Ok(())
    }

    /// Starts making `target` the tensor's top copy and returns at once.
    /// Moving up (toward the device) keeps the lower copies; moving down
    /// releases the copies above `target` once the data is safe there. A move
    /// through two tiers stages in pinned host buffers.
    pub fn move_to(&self, id: TensorId, target: Tier) -> Result<Completion> {
        self.start_move(id, target, Tier::Device)
    }

    /// Makes a copy in `target` and keeps every other one (a write-back
    /// to NVMe that leaves the host and device copies in place). Returns at
    /// once, like [`Runtime::move_to`].
    pub fn copy_to(&self, id: TensorId, target: Tier) -> Result<Completion> {
        self.start_move(id, target, target)
    }

    /// Writes the copy in `from` down to `to`, the tier below, and releases
    /// it, keeping any copy above `from` (evicting a host copy to NVMe
    /// leaves the device's alone). Returns at once, like
    /// [`Runtime::move_to`].
    pub fn evict(&self, id: TensorId, from: Tier, to: Tier) -> Result<Completion> {
        assert_eq!(from.below(), Some(to), "evictions go one tier down");
        self.start_move(id, to, from)
    }

    fn start_move(&self, id: TensorId, target: Tier, release_from: Tier) -> Result<Completion> {
        self.shared.check_cancelled()?;
        let releasing = released_by(release_from, target);
        let (bytes, queue) = {
            let mut state = self.shared.lock();
            let entry = state.entry(id)?;
            if let Some(moving_to) = entry.moving {
                return Err(moving_error(id, entry, moving_to));
            }
            if entry.writer || releasing.iter().any(|t| entry.readers[t.index()] > 0) {
                return Err(in_use_error(id, entry));
            }
            if target == Tier::Nvme && self.shared.store.is_none() {
                return Err(RuntimeError::NoSpillTier {
                    tier: Tier::Host,
                    needed_bytes: entry.len_bytes,
                    available_bytes: 0,
                });
            }
            if entry.valid(target) {
                state.release_between(id, release_from, target);
                drop(state);
                self.shared.changed.notify_all();
                return Ok(Completion::ready(&self.shared, id, Ok(())));
            }
            let len_bytes = entry.len_bytes;
            let queue = if target == Tier::Nvme {
                &self.writes
            } else if entry.valid(Tier::Device) || entry.valid(Tier::Host) {
                &self.device_jobs
            } else {
                &self.reads
            };
            let entry = state.entry_mut(id)?;
            entry.moving = Some(target);
            entry.kept_above = release_from.min(target);
            (len_bytes, queue)
        };
        let done = Arc::new(MoveDone::default());
        let job = Job {
            tensor: id,
            target,
            release_from,
            done: done.clone(),
        };
        let sent = queue
            .as_ref()
            .expect("jobs open while the runtime lives")
            .send(job);
        if sent.is_err() {
            self.shared.finish_move(id);
            return Err(RuntimeError::Stopped);
        }
        Ok(Completion {
            done,
            shared: self.shared.clone(),
            tensor: id,
            bytes,
        })
    }

    /// Drops the copy in `tier` when another tier holds a valid one (free:
    /// nothing is written); the only copy is an error.
    pub fn release(&self, id: TensorId, tier: Tier) -> Result<()> {
        if self.release_duplicate(id, tier)? {
            return Ok(());
        }
        let name = self.shared.lock().entry(id)?.meta.name.clone();
        Err(RuntimeError::Config {
            key: "release",
            value: format!("{name} in {tier}"),
            fix: "that is the tensor's only copy: move it to another tier instead".into(),
        })
    }

    /// [`Runtime::release`] in one look: drops the copy in `tier` and
    /// returns true when another tier holds a valid one, or keeps it and
    /// returns false when it is the only copy. Checking the residency first
    /// and releasing after is a race: a mover may spill the other copy in
    /// between.
    pub fn release_duplicate(&self, id: TensorId, tier: Tier) -> Result<bool> {
        let mut state = self.shared.lock();
        let entry = state.entry(id)?;
        if let Some(target) = entry.moving {
            return Err(moving_error(id, entry, target));
        }
        if !entry.valid(tier) {
            return Err(not_resident(id, entry, tier));
        }
        if !Tier::ALL.iter().any(|&t| t != tier && entry.valid(t)) {
            return Ok(false);
        }
        if entry.readers[tier.index()] > 0 || entry.writer {
            return Err(in_use_error(id, entry));
        }
        state.drop_copy(id, tier);
        drop(state);
        self.shared.changed.notify_all();
        Ok(true)
    }

    /// Takes a guard on the tensor's copy in `tier`, waiting for a move in
    /// flight to land first. While any guard is held the copy cannot be
    /// evicted; a write guard is exclusive and, when dropped, releases every
    /// other (now stale) copy.
    pub fn acquire(&self, id: TensorId, tier: Tier, access: Access) -> Result<Guard> {
        Guard::acquire(&self.shared, id, tier, access)
    }

    /// Replaces the tensor's bytes with `data` (exactly its size) in `tier`
    /// without reading the old ones: a tier without a copy gets fresh space
    /// (spilling others as a move would), and every other copy, now stale,
    /// is released. For tensors written whole (optimizer outputs,
    /// gradients); a fetch before the write would move bytes for nothing.
    pub fn overwrite(&self, id: TensorId, tier: Tier, data: &[u8]) -> Result<()> {
        // Refused before any room is made for it.
        check_size(id, self.shared.lock().entry(id)?, data.len())?;
        self.overwrite_with(id, tier, |guard| guard.write_from(data))
    }

    /// [`Runtime::overwrite`] with the bytes written by `write` through a
    /// write guard on the copy in `tier`, which must write every byte (a
    /// fresh copy holds whatever its buffers held before). Nothing of the
    /// old bytes is read. When `write` fails the copy is dropped if another
    /// tier holds one (the old bytes stay there); a tier's only copy is
    /// left as `write` left it.
    pub fn overwrite_with<R, E: From<RuntimeError>>(
        &self,
        id: TensorId,
        tier: Tier,
        write: impl FnOnce(&mut Guard) -> Result<R, E>,
    ) -> Result<R, E> {
        if tier == Tier::Nvme {
            return Err(RuntimeError::Config {
                key: "tier",
                value: "nvme".into(),
                fix: "overwrite a device or host copy, then move it to nvme".into(),
            }
            .into());
        }
        // On a GPU too: a fresh device copy is written through its guard
        // (device views, or one synchronous copy from host bytes).
        loop {
            match self.acquire(id, tier, Access::Write) {
                Ok(mut guard) => return guard.finish_write(write),
                Err(RuntimeError::NotResident { .. }) => {}
                Err(err) => return Err(err.into()),
            }
            {
                let mut state = self.shared.lock();
                let entry = state.entry(id)?;
                if entry.is_moving() || entry.valid(tier) {
                    // Landed or moving meanwhile: the guard path again.
                    continue;
                }
                if entry.in_use() {
                    return Err(in_use_error(id, entry).into());
                }
                state.entry_mut(id)?.moving = Some(tier);
            }
            let placed = self.shared.allocate(id, tier, caller_lane());
            let mut state = self.shared.lock();
            let mut guard = None;
            if placed.is_ok() {
                // Valid and taken by the writer in one critical section:
                // nobody sees the fresh copy before it is written.
                let now = state.tick();
                let entry = state.entry_mut(id)?;
                entry.copies[tier.index()]
                    .as_mut()
                    .expect("allocated")
                    .valid = true;
                entry.begin_use(tier, Access::Write, now);
                guard = Some(Guard::taken(&self.shared, id, entry, tier, Access::Write));
            }
            state.entry_mut(id)?.moving = None;
            drop(state);
            self.shared.changed.notify_all();
            placed.map_err(E::from)?;
            return guard.expect("taken when placed").finish_write(write);
        }
    }

    /// Tells the spill policy when the tensor is next needed (a position in
    /// the step; larger is later). Spills evict the tensor needed last
    /// (Belady), then the least recently used.
    pub fn set_next_use(&self, id: TensorId, position: u64) -> Result<()> {
        self.shared.lock().entry_mut(id)?.next_use = position;
        Ok(())
    }

    /// Tiers holding a valid copy, fastest first.
    pub fn residency(&self, id: TensorId) -> Result<Vec<Tier>> {
        let state = self.shared.lock();
        let entry = state.entry(id)?;
        Ok(Tier::ALL.into_iter().filter(|&t| entry.valid(t)).collect())
    }

    /// The tensor's description.
    pub fn meta(&self, id: TensorId) -> Result<TensorMeta> {
        Ok(self.shared.lock().entry(id)?.meta.clone())
    }

    /// The runtime's cancellation token: cancelling it makes every wait
    /// on another party (a [`Completion`], an acquire of a tensor that is
    /// moving, a mover waiting for room) end within
    /// [`Cancel::POLL`] with [`RuntimeError::Cancelled`], and every later
    /// one at once. Work already running (a copy, an I/O request) ends on
    /// its own; dropping the runtime after a cancellation is bounded by it.
    pub fn cancel_token(&self) -> Cancel {
        self.shared.cancel.clone()
    }

    /// A snapshot of the accounting.
    pub fn stats(&self) -> Stats {
        let state = self.shared.lock();
        let mut stats = state.stats.clone();
        stats.tensors = state.tensors.len();
        stats
    }

    /// Bytes a tensor of `len_bytes` takes in each tier, as the accounting
    /// counts them: device memory rounded to its alignment, whole host
    /// buffers, whole aligned NVMe extents (one per chunk).
    pub fn footprint_bytes(&self, len_bytes: u64) -> [u64; 3] {
        let mut chunks = Vec::new();
        self.shared.pool.plan(len_bytes, &mut chunks);
        let host = chunks
            .iter()
            .map(|c| self.shared.pool.buffer_bytes(c.class))
            .sum();
        let nvme = self.shared.store.as_ref().map_or(0, |store| {
            let align = store.align_bytes();
            chunks.iter().map(|c| round_up(c.len_bytes, align)).sum()
        });
        [round_up(len_bytes, DEVICE_ALIGN_BYTES), host, nvme]
    }

    /// Free bytes per tier now (device: the arena allocator's view; host:
    /// free buffers; nvme: the store's free bytes).
    pub fn free_bytes(&self, tier: Tier) -> u64 {
        let mut state = self.shared.lock();
        state.reclaim_fenced();
        match tier {
            Tier::Device => state.device_space.free_bytes(),
            Tier::Host => state.free_lists.free_bytes(),
            Tier::Nvme => self.shared.store.as_ref().map_or(0, |s| s.free_bytes()),
        }
    }

    /// Records a span of compute that began at `started` and ends now, on
    /// this thread's trace lane (see [`crate::stats::set_caller_lane`]).
    pub fn record_compute(
        &self,
        what: &'static str,
        group: u32,
        micro_batch: Option<u32>,
        started: Instant,
    ) {
        self.record_work(what, group, micro_batch, 0, started)
    }

    /// [`Runtime::record_compute`] for an optimizer step over `params`
    /// parameters: the trace shows their count and rate.
    pub fn record_update(&self, what: &'static str, group: u32, params: u64, started: Instant) {
        self.record_work(what, group, None, params, started)
    }

    /// Records a collective of `bytes` on this rank for `group` that
    /// began at `started` and ends now, on the collectives' lane.
    pub fn record_collective(&self, what: &'static str, group: u32, bytes: u64, started: Instant) {
        let event = TraceEvent {
            kind: EventKind::Collective { what, group },
            tensor: None,
            bytes,
            start_ns: (started - self.shared.started).as_nanos() as u64,
            duration_ns: started.elapsed().as_nanos() as u64,
            lane: crate::stats::COLLECTIVE_LANE,
        };
        self.shared.trace.lock().expect("trace lock").push(event);
    }

    fn record_work(
        &self,
        what: &'static str,
        group: u32,
        micro_batch: Option<u32>,
        params: u64,
        started: Instant,
    ) {
        let event = TraceEvent {
            kind: EventKind::Compute {
                what,
                group,
                micro_batch,
                params,
            },
            tensor: None,
            bytes: 0,
            start_ns: (started - self.shared.started).as_nanos() as u64,
            duration_ns: started.elapsed().as_nanos() as u64,
            lane: caller_lane(),
        };
        self.shared.trace.lock().expect("trace lock").push(event);
    }

    /// Writes the Chrome/Perfetto trace of every transfer, spill, wait and
    /// span of compute so far.
    pub fn write_trace(&self, out: &mut dyn std::io::Write) -> std::io::Result<()> {
        let names: HashMap<TensorId, String> = {
            let mut state = self.shared.lock();
            // Copies still landing add their spans when they land.
            while state.landings > 0 {
                state = self.shared.changed.wait(state).expect("runtime state lock");
            }
            let live = state
                .tensors
                .iter()
                .map(|(id, e)| (*id, e.meta.name.clone()));
            let freed = state.retired.iter().map(|(id, name)| (*id, name.clone()));
            freed.chain(live).collect()
        };
        let trace = self.shared.trace.lock().expect("trace lock");
        trace.write_chrome(out, &|id| names.get(&id).cloned())
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        // Movers finish the queued moves, then stop.
        self.reads = None;
        self.writes = None;
        self.device_jobs = None;
        for mover in self.movers.drain(..) {
            let _ = mover.join();
        }
    }
}

fn mover_loop(shared: &Arc<Shared>, receiver: &Mutex<Receiver<Job>>, lane: u32) {
    loop {
        let job = receiver.lock().expect("job queue lock").recv();
        let Ok(job) = job else { return };
        // Once cancelled, queued moves are dropped unstarted (every copy
        // stays as it was), so a runtime being aborted drains at once.
        let result = match shared.check_cancelled() {
            Ok(()) => shared.execute_move(job.tensor, job.target, job.release_from, lane),
            Err(err) => Err(err),
        };
        shared.finish_move(job.tensor);
        let (result, landing) = match result {
            Ok(landing) => (Ok(()), landing),
            Err(err) => {
                tracing::debug!("move of {} to {} failed: {err}", job.tensor, job.target);
                (Err(err), None)
            }
        };
        *job.done.outcome.lock().expect("move lock") = Some(result);
        job.done.ready.notify_all();
        // The copy was handed out when its copy was enqueued; this thread
        // waits for it to land only to account for it (and to keep one
        // device copy in flight per mover, as the copy stream would).
        if let Some(landing) = landing {
            shared.finish_landing(landing);
        }
    }
}

fn memlock_limit_bytes() -> u64 {
    strata_storage::sys::memlock_limit_bytes().unwrap_or(u64::MAX)
}

/// Refuses a pool (plus a CPU device's arena) larger than the memory the
/// process may take (MemAvailable, a cgroup limit, `ulimit -v`), before
/// touching any of it.
fn check_host_memory(config: &RuntimeConfig, arena_on_host: bool) -> Result<()> {
    let Some(available_bytes) = strata_storage::sys::mem_available_bytes() else {
        return Ok(());
    };
    let budget_bytes = config.host.pool_bytes();
    let arena_bytes = if arena_on_host {
        config.device.budget.0
    } else {
        0
    };
    if budget_bytes + arena_bytes > available_bytes {
        return Err(RuntimeError::HostMemory {
            budget_bytes,
            arena_bytes,
            available_bytes,
        });
    }
    Ok(())
}

/// The movers' side of [`Shared`]: carrying out moves, placing copies and
/// spilling. Its state, locking and wait accounting are in `state.rs`.
impl Shared {
    fn finish_move(&self, id: TensorId) {
        if let Some(entry) = self.lock().tensors.get_mut(&id) {
            entry.moving = None;
            entry.kept_above = Tier::Device;
        }
        self.changed.notify_all();
    }

    /// Carries out a move whose `moving` mark is set: hop by hop toward
    /// `target`, then releases the copies above it. On failure every copy
    /// that was valid before still is. A move that ends with a copy to the
    /// device returns once that copy is enqueued: the device copy is valid
    /// behind the copy's fence (its `last_use`), and the [`Landing`] says
    /// when it has landed.
    fn execute_move(
        &self,
        id: TensorId,
        target: Tier,
        release_from: Tier,
        lane: u32,
    ) -> Result<Option<Landing>> {
        let releasing: Vec<Tier> = {
            let mut state = self.lock();
            let entry = state.entry(id)?;
            let tiers: Vec<Tier> = released_by(release_from, target)
                .iter()
                .copied()
                .filter(|&t| entry.copies[t.index()].is_some())
                .collect();
            for tier in &tiers {
                state.releasing[tier.index()] += 1;
            }
            tiers
        };
        let result = self.execute_hops(id, target, lane);
        let mut state = self.lock();
        for tier in &releasing {
            state.releasing[tier.index()] -= 1;
        }
        if result.is_ok() {
            state.release_between(id, release_from, target);
        }
        drop(state);
        self.changed.notify_all();
        result.map_err(|err| {
            // A cancellation is not the move's failure: it stays itself.
            if matches!(err, RuntimeError::Cancelled) {
                return err;
            }
            let state = self.lock();
            let name = state
                .tensors
                .get(&id)
                .map_or_else(String::new, |e| e.meta.name.clone());
            let source_tier = state
                .tensors
                .get(&id)
                .and_then(|e| Tier::ALL.into_iter().find(|&t| e.valid(t)))
                .unwrap_or(target);
            RuntimeError::Move {
                tensor: id,
                name,
                source_tier,
                target_tier: target,
                cause: Box::new(err),
            }
        })
    }

    fn execute_hops(&self, id: TensorId, target: Tier, lane: u32) -> Result<Option<Landing>> {
        let mut landing = None;
        loop {
            let (source, next) = {
                let state = self.lock();
                let entry = state.entry(id)?;
                if entry.valid(target) {
                    return Ok(landing);
                }
                // The nearest valid copy above the target, else below it.
                let above = Tier::ALL[..target.index()]
                    .iter()
                    .rev()
                    .find(|&&t| entry.valid(t));
                let below = Tier::ALL[target.index() + 1..]
                    .iter()
                    .find(|&&t| entry.valid(t));
                let source = *above.or(below).expect("a tensor always has a valid copy");
                let next = if source < target {
                    source.below()
                } else {
                    source.above()
                };
                (source, next.expect("a neighbour toward the target"))
            };
            if self.lock().entry(id)?.copies[next.index()].is_none() {
                self.allocate(id, next, lane)?;
            }
            let fence = match self.transfer(id, source, next, lane) {
                Ok(pending) => pending.map(|pending| {
                    let fence = pending.fence.clone();
                    landing = Some(pending);
                    fence
                }),
                Err(err) => {
                    let mut state = self.lock();
                    state.drop_copy(id, next);
                    return Err(err);
                }
            };
            let mut state = self.lock();
            let entry = state.entry_mut(id)?;
            if let Some(fence) = fence {
                // Readers of the new copy and reusers of the source's
                // buffers order after the copy.
                let source = entry.copies[source.index()].as_mut().expect("source copy");
                source.last_use = Some(fence.clone());
                entry.copies[next.index()]
                    .as_mut()
                    .expect("filled above")
                    .last_use = Some(fence);
            }
            entry.copies[next.index()]
                .as_mut()
                .expect("filled above")
                .valid = true;
        }
    }

    /// Waits for an enqueued copy to the device to land and accounts for
    /// it. A copy that fails is logged: the fence its readers were given
    /// reports the same error to them.
    fn finish_landing(&self, landing: Landing) {
        match self.device.wait(landing.fence) {
            Ok(()) => self.account_time(
                Link::HostToDevice,
                landing.tensor,
                landing.bytes,
                landing.started,
                landing.lane,
            ),
            Err(err) => tracing::error!(
                "the copy of tensor {} to the device failed after it was enqueued: {err}",
                landing.tensor
            ),
        }
        self.lock().landings -= 1;
        self.changed.notify_all();
    }

    /// Counts a transfer's bytes (when it is issued, so a completed move's
    /// bytes are in the stats at once).
    fn account_bytes(&self, link: Link, bytes: u64) {
        let mut state = self.lock();
        let stats = &mut state.stats.links[link.index()];
        stats.bytes += bytes;
        stats.transfers += 1;
    }

    /// Counts a transfer's time (when it has finished) and traces it.
    fn account_time(&self, link: Link, id: TensorId, bytes: u64, started: Instant, lane: u32) {
        let duration_ns = started.elapsed().as_nanos() as u64;
        self.lock().stats.links[link.index()].busy_ns += duration_ns;
        self.trace.lock().expect("trace lock").push(TraceEvent {
            kind: EventKind::Transfer(link),
            tensor: Some(id),
            bytes,
            start_ns: (started - self.started).as_nanos() as u64,
            duration_ns,
            lane,
        });
    }

    /// Places a not-yet-valid copy of `id` in `tier`, spilling other tensors
    /// (writing them down a tier when no other tier holds their data) until
    /// it fits, waiting for moves that will free room, and failing with the
    /// numbers when nothing can.
    fn allocate(&self, id: TensorId, tier: Tier, lane: u32) -> Result<()> {
        let mut waiting_since: Option<Instant> = None;
        loop {
            let mut state = self.lock();
            state.reclaim_fenced();
            let mut refused = false;
            let shortfall = match self.try_place(&mut state, id, tier) {
                Ok(()) => return Ok(()),
                Err(Unplaced::Full(shortfall)) => shortfall,
                Err(Unplaced::Refused) => {
                    refused = true;
                    None
                }
                Err(Unplaced::Failed(err)) => return Err(err),
            };
            // No spill starts once cancelled (a cancelled runtime drains).
            self.check_cancelled()?;
            // Room released but still in use by enqueued work comes back
            // when that work is done: cheaper than a spill.
            if let Some((place, fence)) = state.take_fenced(tier) {
                drop(state);
                let waited = fence.wait();
                self.lock().release_place(tier, place);
                waited?;
                continue;
            }
            let can_write_down = match tier {
                Tier::Device => true,
                Tier::Host => self.store.is_some(),
                Tier::Nvme => false,
            };
            if let Some((victim, free)) = state.pick_victim(tier, id, shortfall, can_write_down) {
                if free {
                    state.drop_copy(victim, tier);
                    state.stats.spills_dropped += 1;
                    continue;
                }
                let below = tier.below().expect("write-downs only from device and host");
                state.entry_mut(victim)?.moving = Some(below);
                let bytes = state.entry(victim)?.len_bytes;
                drop(state);
                let started = Instant::now();
                // The spilled tier's copy goes; one above it stays.
                let result = self.execute_move(victim, below, tier, lane);
                self.finish_move(victim);
                assert!(
                    matches!(result, Ok(None) | Err(_)),
                    "a write-down enqueues no copy to the device"
                );
                result?;
                self.lock().stats.spills_written += 1;
                self.trace.lock().expect("trace lock").push(TraceEvent {
                    kind: EventKind::Spill(tier),
                    tensor: Some(victim),
                    bytes,
                    start_ns: (started - self.started).as_nanos() as u64,
                    duration_ns: started.elapsed().as_nanos() as u64,
                    lane,
                });
                continue;
            }
            if state.releasing[tier.index()] > 0 {
                self.check_cancelled()?;
                drop(Cancel::sleep(&self.changed, state));
                continue;
            }
            // A mover holds no guard, so the copies in use or moving on this
            // tier will be let go: their space (or the gap next to them, in
            // a fragmented device arena) is what is missing. It waits for
            // them, boundedly, so that a caller who holds the guard and
            // waits for this move gets the error instead of a deadlock.
            let since = *waiting_since.get_or_insert_with(Instant::now);
            let left = self.room_wait.saturating_sub(since.elapsed());
            if is_mover_lane(lane) && !left.is_zero() && state.unevictable_bytes(tier) > 0 {
                self.check_cancelled()?;
                drop(Cancel::sleep(&self.changed, state));
                continue;
            }
            if refused {
                return Err(RuntimeError::OutOfMemory {
                    tier,
                    needed_bytes: state.tensors[&id].len_bytes,
                });
            }
            return Err(self.out_of_budget(&state, id, tier, shortfall));
        }
    }

    fn out_of_budget(
        &self,
        state: &State,
        id: TensorId,
        tier: Tier,
        shortfall: Option<Shortfall>,
    ) -> RuntimeError {
        let needed_bytes = state.tensors[&id].len_bytes;
        let stats = &state.stats.tiers[tier.index()];
        let (available_bytes, largest_free_bytes) = match tier {
            Tier::Device => (
                state.device_space.free_bytes(),
                state.device_space.largest_free_bytes(),
            ),
            Tier::Host => {
                let largest =
                    shortfall.map_or(0, |s| u64::from(s.free) * self.pool.buffer_bytes(s.class));
                (state.free_lists.free_bytes(), largest)
            }
            Tier::Nvme => {
                let free = self.store.as_ref().map_or(0, |s| s.free_bytes());
                (free, free)
            }
        };
        if tier == Tier::Host && self.store.is_none() {
            return RuntimeError::NoSpillTier {
                tier,
                needed_bytes,
                available_bytes,
            };
        }
        RuntimeError::OutOfBudget {
            tier,
            needed_bytes,
            available_bytes,
            largest_free_bytes,
            budget_bytes: stats.budget_bytes,
            unevictable_bytes: state.unevictable_bytes(tier),
        }
    }

    /// One attempt to place the copy.
    fn try_place(&self, state: &mut State, id: TensorId, tier: Tier) -> Result<(), Unplaced> {
        if state.refuses_placement(id, tier) {
            return Err(Unplaced::Refused);
        }
        let entry = state.tensors.get(&id).expect("live tensor");
        let (len_bytes, chunks) = (entry.len_bytes, entry.chunks.clone());
        let activation = entry.meta.kind == TensorKind::Activation;
        let (place, bytes) = match tier {
            Tier::Device => {
                // Activations stack down from the top of the arena (made in
                // forward, freed in backward in reverse), everything else
                // best-fits from the bottom: neither cuts up the other's
                // holes.
                let len = round_up(len_bytes, DEVICE_ALIGN_BYTES);
                let space = &mut state.device_space;
                let (offset, bytes) = if activation {
                    space.allocate_from_top(len)
                } else {
                    space.allocate(len)
                }
                .map_err(|_| Unplaced::Full(None))?;
                (Place::Device { offset, bytes }, bytes)
            }
            Tier::Host => {
                let mut slots = Vec::with_capacity(chunks.len());
                state
                    .free_lists
                    .take(&chunks, &mut slots)
                    .map_err(|short| Unplaced::Full(Some(short)))?;
                let bytes = state.free_lists.bytes_of(&slots);
                (Place::Host(slots.into()), bytes)
            }
            Tier::Nvme => {
                let store = self.store.as_ref().ok_or(Unplaced::Full(None))?;
                let align = store.align_bytes();
                let mut extents = Vec::with_capacity(chunks.len());
                for chunk in chunks.iter() {
                    // Out of space is a full tier (spill, or say so with the
                    // numbers); anything else (extents_max) is its own error.
                    extents.push(store.allocate(round_up(chunk.len_bytes, align)).map_err(
                        |err| match err {
                            strata_storage::StorageError::OutOfSpace { .. } => Unplaced::Full(None),
                            other => Unplaced::Failed(other.into()),
                        },
                    )?);
                }
                let bytes = extents.iter().map(|e| e.len_bytes()).sum();
                (Place::Nvme(extents.into()), bytes)
            }
        };
        state.account(tier, bytes, 0);
        let entry = state.tensors.get_mut(&id).expect("live tensor");
        entry.copies[tier.index()] = Some(Copy {
            place,
            valid: false,
            last_use: None,
        });
        Ok(())
    }

    /// Fills a freshly registered copy with zeros.
    fn zero(&self, id: TensorId, tier: Tier) -> Result<()> {
        let (view, len_bytes) = {
            let state = self.lock();
            let entry = state.entry(id)?;
            (View::of(entry, tier), entry.len_bytes)
        };
        view.fill_zero(self, len_bytes)
    }

    /// A staging buffer of at least `len` bytes: a kept one, or a new one.
    fn staging_buffer(&self, len: usize, align: usize) -> Result<strata_storage::AlignedBuf> {
        let mut kept = self.staging.lock().expect("staging lock");
        if let Some(at) = kept.iter().position(|b| b.len() >= len) {
            return Ok(kept.swap_remove(at));
        }
        drop(kept);
        Ok(strata_storage::AlignedBuf::new(len, align)?)
    }

    /// Keeps staging buffers for the next streamed fill or read, up to
    /// twice [`STREAM_BYTES`] in all (the largest first).
    fn keep_staging(&self, buffers: Vec<strata_storage::AlignedBuf>) {
        let mut kept = self.staging.lock().expect("staging lock");
        kept.extend(buffers);
        kept.sort_by_key(|b| std::cmp::Reverse(b.len()));
        let mut total = 0;
        kept.retain(|b| {
            total += b.len();
            total <= 2 * STREAM_BYTES
        });
    }

    /// Reads tensor `id`'s `extents` in order into staging buffers, handing
    /// each chunk's bytes to `read` while the next ones are read (up to
    /// [`STREAM_BYTES`] in flight).
    fn stream_nvme<E: From<RuntimeError>>(
        &self,
        id: TensorId,
        chunks: &[Chunk],
        extents: &[Extent],
        read: &mut Visit<'_, E>,
    ) -> std::result::Result<(), E> {
        let store = self
            .store
            .as_ref()
            .expect("nvme copies exist only with a store");
        let started = Instant::now();
        let staging = extents.iter().map(|e| e.len_bytes()).max().unwrap_or(0);
        let mut in_flight = InFlight::new(self, staging);
        let mut bytes = 0;
        let mut next = 0;
        let result = chunks.iter().zip(extents).try_for_each(|(chunk, extent)| {
            // Keep reads going ahead of the chunk handed over.
            while next < extents.len() && !in_flight.full() {
                let buf = in_flight.buffer()?;
                in_flight.push(store.read_start(&extents[next], buf));
                next += 1;
            }
            let buf = in_flight.pop_front()?.expect("a read per chunk");
            let done = read(chunk.offset, &buf[..chunk.len_bytes as usize]);
            in_flight.spare(buf);
            bytes += extent.len_bytes();
            done
        });
        in_flight.end(result, Link::NvmeToHost, id, bytes, started)
    }

    /// Fills tensor `id`'s freshly allocated NVMe copy: bytes from `fill`
    /// below `zeros_from`, through staging buffers (filling one while the
    /// others are written, up to [`STREAM_BYTES`] in flight), and zeros
    /// past it by the store's [`SwapStore::zero_all`].
    fn fill_nvme<E: From<RuntimeError>>(
        &self,
        id: TensorId,
        zeros_from: u64,
        fill: &mut Fill<'_, E>,
    ) -> std::result::Result<(), E> {
        let store = self.store.as_ref().expect("checked at registration");
        let (chunks, extents) = {
            let state = self.lock();
            let entry = state.entry(id)?;
            let extents = entry.nvme_extents().expect("allocated on nvme above");
            (entry.chunks.clone(), extents)
        };
        let started = Instant::now();
        // The filled chunks come first: those at or past zeros_from are
        // zeroed together while the last writes land.
        let filled = chunks.iter().take_while(|c| c.offset < zeros_from).count();
        let staging = extents[..filled].iter().map(|e| e.len_bytes()).max();
        let mut in_flight = InFlight::new(self, staging.unwrap_or(0));
        let mut written = 0;
        let result = chunks[..filled]
            .iter()
            .zip(&extents[..filled])
            .try_for_each(|(chunk, extent)| {
                if in_flight.full() {
                    let landed = in_flight.pop_front()?.expect("full");
                    in_flight.spare(landed);
                }
                let mut buf = in_flight.buffer()?;
                let len = extent.len_bytes() as usize;
                let upto = (zeros_from - chunk.offset).min(chunk.len_bytes) as usize;
                let result = fill(chunk.offset, &mut buf[..upto]);
                buf[upto..len].fill(0);
                if result.is_err() {
                    in_flight.spare(buf);
                    return result;
                }
                in_flight.push(store.write_start(extent, buf));
                written += len as u64;
                Ok(())
            })
            .and_then(|()| {
                store
                    .zero_all(&extents[filled..])
                    .map_err(|err| RuntimeError::from(err).into())
            });
        in_flight.end(result, Link::HostToNvme, id, written, started)
    }

    /// Copies the data from the valid copy in `source` to the allocated,
    /// not yet valid copy in `target` (neighbouring tiers). A copy to the
    /// device is enqueued, not waited for: it comes back as a [`Landing`].
    fn transfer(
        &self,
        id: TensorId,
        source: Tier,
        target: Tier,
        lane: u32,
    ) -> Result<Option<Landing>> {
        let link = Link::between(source, target);
        let (chunks, len_bytes, host, other, last_use) = {
            let mut state = self.lock();
            // Work enqueued on the source copy finishes before it is read.
            let last_use = state.entry_mut(id)?.copies[source.index()]
                .as_mut()
                .and_then(|copy| copy.last_use.take());
            let entry = state.entry(id)?;
            let host = match &entry.copies[Tier::Host.index()] {
                Some(Copy {
                    place: Place::Host(slots),
                    ..
                }) => slots.clone(),
                _ => unreachable!("every hop has the host on one side"),
            };
            let other = if source == Tier::Host { target } else { source };
            let other = match &entry.copies[other.index()] {
                Some(Copy {
                    place: Place::Device { offset, .. },
                    ..
                }) => Other::Device(*offset),
                Some(Copy {
                    place: Place::Nvme(extents),
                    ..
                }) => Other::Nvme(extents.clone()),
                _ => unreachable!("the far side of a hop is device or nvme"),
            };
            (entry.chunks.clone(), entry.len_bytes, host, other, last_use)
        };
        if let Some(fence) = last_use {
            self.device.wait(fence)?;
        }
        let started = Instant::now();
        match other {
            Other::Device(offset) => {
                let fence = self.copy_device(link, &chunks, &host, offset)?;
                self.account_bytes(link, len_bytes);
                if link == Link::HostToDevice {
                    self.lock().landings += 1;
                    return Ok(Some(Landing {
                        fence,
                        tensor: id,
                        bytes: len_bytes,
                        started,
                        lane,
                    }));
                }
                self.device.wait(fence)?;
            }
            Other::Nvme(extents) => {
                self.copy_nvme(link, &host, &extents)?;
                self.account_bytes(link, len_bytes);
            }
        }
        self.account_time(link, id, len_bytes, started, lane);
        Ok(None)
    }

    /// Enqueues the copy between the host buffers and the device range; its
    /// fence.
    fn copy_device(
        &self,
        link: Link,
        chunks: &[Chunk],
        host: &[Slot],
        offset: u64,
    ) -> Result<Fence> {
        let direction = match link {
            Link::HostToDevice => Direction::ToDevice,
            Link::DeviceToHost => Direction::ToHost,
            _ => unreachable!("device hops only"),
        };
        let pieces: Vec<CopyPiece> = chunks
            .iter()
            .zip(host)
            .map(|(chunk, slot)| CopyPiece {
                host: self.pool.ptr(*slot),
                device_offset: offset + chunk.offset,
                len_bytes: chunk.len_bytes as usize,
            })
            .collect();
        // The tensor is marked moving, so no guard, spill or free touches its
        // copies until the copy is waited on (device to host) or both copies
        // carry its fence as their last use (host to device), before the
        // mark clears.
        // SAFETY: the host buffers and device range are this tensor's copies.
        Ok(unsafe { self.device.copy(direction, pieces)? })
    }

    fn copy_nvme(&self, link: Link, host: &[Slot], extents: &Arc<[Extent]>) -> Result<()> {
        let store = self
            .store
            .as_ref()
            .expect("nvme copies exist only with a store");
        let mut tickets = Vec::with_capacity(extents.len());
        for (slot, extent) in host.iter().zip(extents.iter()) {
            let ptr = self.pool.ptr(*slot);
            let len = self.pool.buffer_bytes(slot.class) as usize;
            // No one else touches the host copy while the tensor is marked
            // moving, and every ticket is waited on below before the mark clears.
            // SAFETY: the buffer belongs to this tensor's host copy.
            let ticket = unsafe {
                match link {
                    Link::HostToNvme => store.write_start_raw(extent, ptr, len, ()),
                    Link::NvmeToHost => store.read_start_raw(extent, ptr, len, ()),
                    _ => unreachable!("nvme hops only"),
                }
            };
            tickets.push(ticket);
        }
        let mut first_error = None;
        for ticket in tickets {
            if let ((), Err(err)) = ticket.wait() {
                first_error.get_or_insert(err);
            }
        }
        match first_error {
            Some(err) => Err(err.into()),
            None => Ok(()),
        }
    }
}

/// The transfers of a streamed NVMe fill or read ([`Shared::fill_nvme`],
/// [`Shared::stream_nvme`]): up to [`STREAM_BYTES`] of staging buffers in
/// flight (at least two: one is filled or read while the other moves),
/// taken from and given back to the runtime's kept ones.
struct InFlight<'a> {
    shared: &'a Shared,
    staging: usize,
    align: usize,
    depth: usize,
    tickets: VecDeque<strata_storage::Ticket<strata_storage::AlignedBuf>>,
    spare: Vec<strata_storage::AlignedBuf>,
}

impl<'a> InFlight<'a> {
    fn new(shared: &'a Shared, staging: u64) -> Self {
        let store = shared.store.as_ref().expect("streams need a store");
        let staging = staging as usize;
        let depth = (STREAM_BYTES / staging.max(1)).clamp(2, STREAM_DEPTH_MAX);
        InFlight {
            shared,
            staging,
            align: store.align_bytes() as usize,
            depth,
            tickets: VecDeque::with_capacity(depth),
            spare: Vec::new(),
        }
    }

    fn full(&self) -> bool {
        self.tickets.len() == self.depth
    }

    /// A staging buffer: a spare one, else a kept or new one.
    fn buffer(&mut self) -> Result<strata_storage::AlignedBuf> {
        match self.spare.pop() {
            Some(buf) => Ok(buf),
            None => self.shared.staging_buffer(self.staging, self.align),
        }
    }

    fn push(&mut self, ticket: strata_storage::Ticket<strata_storage::AlignedBuf>) {
        self.tickets.push_back(ticket);
    }

    fn spare(&mut self, buf: strata_storage::AlignedBuf) {
        self.spare.push(buf);
    }

    /// Waits for the oldest transfer: its buffer, or its error (the buffer
    /// spare again). None when nothing is in flight.
    fn pop_front(&mut self) -> Result<Option<strata_storage::AlignedBuf>> {
        let Some(ticket) = self.tickets.pop_front() else {
            return Ok(None);
        };
        let (buf, result) = ticket.wait();
        match result {
            Ok(()) => Ok(Some(buf)),
            Err(err) => {
                self.spare.push(buf);
                Err(err.into())
            }
        }
    }

    /// Ends a stream whose own work came to `result`: every transfer still
    /// in flight lands (failed or not) before it returns; then the
    /// stream's error, else theirs, else its `bytes` over `link` since
    /// `started` accounted as any move's.
    fn end<E: From<RuntimeError>>(
        self,
        result: std::result::Result<(), E>,
        link: Link,
        id: TensorId,
        bytes: u64,
        started: Instant,
    ) -> std::result::Result<(), E> {
        let shared = self.shared;
        let landed = self.finish();
        result?;
        landed?;
        shared.account_bytes(link, bytes);
        shared.account_time(link, id, bytes, started, caller_lane());
        Ok(())
    }

    /// Waits for every transfer still in flight and keeps the buffers for
    /// the next stream; the first error among them.
    fn finish(mut self) -> Result<()> {
        let mut first = Ok(());
        while !self.tickets.is_empty() {
            match self.pop_front() {
                Ok(buf) => self.spare.extend(buf),
                Err(err) => first = first.and(Err(err)),
            }
        }
        self.shared.keep_staging(std::mem::take(&mut self.spare));
        first
    }
}

/// Why a copy could not be placed.
enum Unplaced {
    /// The tier is full (for the host: the class that ran short).
    Full(Option<Shortfall>),
    /// An injected out-of-memory fault refused the placement.
    Refused,
    /// Something other than room went wrong.
    Failed(RuntimeError),
}

enum Other {
    Device(u64),
    Nvme(Arc<[Extent]>),
}

/// A copy to the device that is enqueued and not yet known to have landed.
struct Landing {
    fence: Fence,
    tensor: TensorId,
    bytes: u64,
    started: Instant,
    lane: u32,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_job_dropped_unfinished_fails_its_waiter_and_a_finished_one_keeps_its_outcome() {
        let (lost, finished) = (Arc::new(MoveDone::default()), Arc::new(MoveDone::default()));
        let job = |done: &Arc<MoveDone>| Job {
            tensor: TensorId(7),
            target: Tier::Host,
            release_from: Tier::Nvme,
            done: done.clone(),
        };
        // As when its mover panics or the queue is dropped with it inside.
        drop(job(&lost));
        assert!(matches!(
            lost.outcome.lock().unwrap().take(),
            Some(Err(RuntimeError::Stopped))
        ));
        let done = job(&finished);
        *done.done.outcome.lock().unwrap() = Some(Ok(()));
        drop(done);
        assert!(matches!(
            finished.outcome.lock().unwrap().take(),
            Some(Ok(()))
        ));
    }
}
