//! `strata._strata.OffloadStates`: the fp32 master weights and Adam moments
//! of a list of torch parameters, kept by strata (in one page-locked host
//! arena, or on NVMe in a [`SwapStore`]: io_uring, checksummed, its swap
//! files locked to this process), and a worker thread that updates them in
//! the background. `strata/torch.py` drives it.
//!
//! A parameter (or a piece of one: `strata/torch.py` keeps a parameter of
//! more than 16M elements as several) is a *slot*: `submit` queues one AdamW step of a slot (its
//! gradient and the tensor that receives the updated weights in the
//! compute dtype) and returns at once; `wait(slot)` blocks, with the GIL
//! released, until that slot's queued steps are computed; `wait_all` also
//! until every state write has reached the store. On NVMe the worker reads
//! the states of the queued steps ahead (as many as there are staging
//! buffers) and writes them behind, so the drive works while the CPU
//! computes.
//!
//! A failed step (a read whose checksum does not match, a full disk) is
//! sticky: that slot's states are left as they were, every later call
//! raises the error, and nothing is updated silently wrong.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::mpsc::{Receiver, Sender, TryRecvError, channel};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

use pyo3::exceptions::{PyOSError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use strata_optim::{
    AdamCoefficients, AdamConfig, LowPrecisionMut, Moments, Pool, PoolConfig, Rounding, Values,
    bf16, f16,
};
use strata_storage::{
    AlignedBuf, ByteSize, DirLock, Extent, Holder, LockWait, PAGE_BYTES, StorageConfig, SwapStore,
    Ticket,
};

use crate::tensor::{Dtype, Tensor};

/// Alignment of each state region in a slot (a cache line; AVX-512's width).
const REGION_ALIGN: usize = 64;
/// Most parameters one optimizer manages.
pub(crate) const SLOTS_MAX: usize = 1 << 20;
/// Most elements of one parameter (2^40: a slot's bytes stay far inside
/// 64 bits).
const ELEMS_MAX: usize = 1 << 40;
/// What each slot's extent is rounded to when sizing the store (a drive's
/// largest common logical block).
const NVME_ALIGN: usize = 4096;
/// Most staging buffers for NVMe states.
const STAGING_MAX: usize = 64;

fn round_up(bytes: usize, align: usize) -> usize {
    bytes.div_ceil(align) * align
}

/// Where a slot's three regions lie within its bytes.
#[derive(Clone, Copy, Debug)]
struct Layout {
    elems: usize,
    moment_bytes: usize,
    /// The master weights are the parameter's own fp32 memory (a CPU
    /// parameter computed in fp32): the slot holds the moments only, and a
    /// step updates the parameter in place.
    in_place: bool,
}

impl Layout {
    fn master_len(self) -> usize {
        match self.in_place {
            true => 0,
            false => round_up(self.elems * 4, REGION_ALIGN),
        }
    }
    fn moment_len(self) -> usize {
        round_up(self.elems * self.moment_bytes, REGION_ALIGN)
    }
    fn bytes(self) -> usize {
        self.master_len() + 2 * self.moment_len()
    }

    /// The master weights (none when in place) and moments within a
    /// slot's `bytes`.
    fn split(self, bytes: &mut [u8]) -> (Option<&mut [f32]>, Moments<'_>) {
        let (master, rest) = bytes.split_at_mut(self.master_len());
        let (m, v) = rest.split_at_mut(self.moment_len());
        let master = (!self.in_place)
            .then(|| &mut bytemuck::cast_slice_mut::<u8, f32>(master)[..self.elems]);
        let (m, v) = (
            &mut m[..self.elems * self.moment_bytes],
            &mut v[..self.elems * self.moment_bytes],
        );
        let moments = match self.moment_bytes {
            4 => Moments::F32 {
                m: bytemuck::cast_slice_mut(m),
                v: bytemuck::cast_slice_mut(v),
            },
            _ => Moments::Bf16 {
                m: bytemuck::cast_slice_mut(m),
                v: bytemuck::cast_slice_mut(v),
            },
        };
        (master, moments)
    }
}

/// The states' home.
enum Tier {
    Host {
        arena: AlignedBuf,
        offsets: Vec<usize>,
    },
    Nvme {
        store: SwapStore,
        extents: Vec<Extent>,
        /// Free staging buffers (each holds the largest slot).
        free: Vec<AlignedBuf>,
    },
}

/// One queued step.
struct Job {
    slot: usize,
    grad: Tensor,
    out: Option<Tensor>,
    coefficients: AdamCoefficients,
    rounding: Rounding,
}

#[derive(Default)]
struct Progress {
    /// Steps queued, per slot.
    queued: Vec<u64>,
    /// Steps computed (their weights written out), per slot.
    computed: Vec<u64>,
    /// State writes started and not yet finished.
    writes_in_flight: usize,
    /// The first failure, sticky.
    error: Option<String>,
    /// Steps queued and not yet computed, all slots.
    pending: usize,
}

struct Shared {
    progress: Mutex<Progress>,
    changed: Condvar,
    tier: Mutex<Tier>,
    layouts: Vec<Layout>,
}

impl Shared {
    fn progress(&self) -> MutexGuard<'_, Progress> {
        self.progress.lock().unwrap_or_else(|p| p.into_inner())
    }
    fn tier(&self) -> MutexGuard<'_, Tier> {
        self.tier.lock().unwrap_or_else(|p| p.into_inner())
    }
    fn computed(&self, slot: usize, error: Option<String>) {
        let mut progress = self.progress();
        progress.computed[slot] += 1;
        progress.pending -= 1;
        if progress.error.is_none() {
            progress.error = error;
        }
        drop(progress);
        self.changed.notify_all();
    }
    fn write_settled(&self, error: Option<String>) {
        let mut progress = self.progress();
        progress.writes_in_flight -= 1;
        if progress.error.is_none() {
            progress.error = error;
        }
        drop(progress);
        self.changed.notify_all();
    }
}

/// Master weights and moments of a list of parameters, updated by a worker.
#[pyclass(module = "strata._strata", frozen)]
pub(crate) struct OffloadStates {
    shared: Arc<Shared>,
    jobs: Mutex<Option<Sender<Job>>>,
    worker: Mutex<Option<JoinHandle<()>>>,
    /// Each slot's first element among all slots (stochastic rounding keys).
    firsts: Vec<u64>,
    tier_name: &'static str,
    host_bytes: usize,
    staging_bytes: usize,
    nvme_bytes: u64,
    threads: usize,
    /// Each NVMe directory's run lock (`.strata-lock`), held for life and
    /// released after the store has closed its files.
    _locks: Vec<DirLock>,
}

fn storage_error(what: &str, err: strata_storage::StorageError) -> PyErr {
    PyOSError::new_err(format!("{what}: {err}"))
}

fn failed(error: &str) -> PyErr {
    PyRuntimeError::new_err(format!(
        "an earlier optimizer step failed, so the states are no longer updated: {error}"
    ))
}

#[pymethods]
impl OffloadStates {
    /// `elems`: each parameter's element count. `tier`: "cpu" (one
    /// page-locked arena) or "nvme" (`nvme_dirs`, `nvme_capacity` bytes
    /// preallocated; `staging` page-locked buffers for reading ahead and
    /// writing behind). `moments`: "fp32" or "bf16". `threads`: the update's
    /// threads (None: one per physical core). `in_place`: per slot, whether
    /// the master weights are the parameter's own fp32 memory (then every
    /// step's `out` is that memory).
    #[new]
    #[pyo3(signature = (elems, *, tier, moments="fp32", nvme_dirs=None, nvme_capacity=None,
        staging=4, threads=None, engine="auto", lock_wait_s=10.0, in_place=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        elems: Vec<usize>,
        tier: &str,
        moments: &str,
        nvme_dirs: Option<Vec<PathBuf>>,
        nvme_capacity: Option<u64>,
        staging: usize,
        threads: Option<usize>,
        engine: &str,
        lock_wait_s: f64,
        in_place: Option<Vec<bool>>,
    ) -> PyResult<Self> {
        if elems.len() > SLOTS_MAX {
            return Err(PyValueError::new_err(format!(
                "{} parameters: strata.torch manages at most {SLOTS_MAX} in one optimizer",
                elems.len()
            )));
        }
        let moment_bytes = match moments {
            "fp32" => 4,
            "bf16" => 2,
            other => {
                return Err(PyValueError::new_err(format!(
                    "moments = {other:?}: use \"fp32\" or \"bf16\""
                )));
            }
        };
        if threads.is_some_and(|t| t == 0 || t > strata_optim::THREADS_MAX) {
            return Err(PyValueError::new_err(format!(
                "threads = {}: use 1 to {} (or None for one per core)",
                threads.unwrap_or(0),
                strata_optim::THREADS_MAX
            )));
        }
        if let Some((i, &n)) = elems.iter().enumerate().find(|&(_, &n)| n > ELEMS_MAX) {
            return Err(PyValueError::new_err(format!(
                "parameter {i} has {n} elements: strata.torch takes at most {ELEMS_MAX} in one tensor"
            )));
        }
        let in_place = in_place.unwrap_or_else(|| vec![false; elems.len()]);
        if in_place.len() != elems.len() {
            return Err(PyValueError::new_err(format!(
                "in_place has {} entries for {} parameters",
                in_place.len(),
                elems.len()
            )));
        }
        let layouts: Vec<Layout> = elems
            .iter()
            .zip(&in_place)
            .map(|(&elems, &in_place)| Layout {
                elems,
                moment_bytes,
                in_place,
            })
            .collect();
        let mut firsts = Vec::with_capacity(elems.len());
        let mut total = 0u64;
        for &n in &elems {
            firsts.push(total);
            total = total.checked_add(n as u64).ok_or_else(|| {
                PyValueError::new_err("the parameters' element counts overflow 64 bits")
            })?;
        }
        let bytes: Vec<usize> = layouts.iter().map(|l| l.bytes()).collect();
        let largest = bytes.iter().copied().max().unwrap_or(0);
        let mut locks = Vec::new();
        let (tier, host_bytes, staging_bytes, nvme_bytes, tier_name) = match tier {
            "cpu" => {
                let mut offsets = Vec::with_capacity(bytes.len());
                let mut at = 0usize;
                for &b in &bytes {
                    offsets.push(at);
                    at = at.checked_add(b).ok_or_else(|| {
                        PyValueError::new_err("the states' size overflows the address space")
                    })?;
                }
                let arena = py
                    .detach(|| AlignedBuf::new_locked(round_up(at.max(1), PAGE_BYTES), PAGE_BYTES))
                    .map_err(|err| storage_error("allocate the host states", err))?;
                (Tier::Host { arena, offsets }, at, 0, 0, "cpu")
            }
            "nvme" => {
                let dirs = nvme_dirs.filter(|d| !d.is_empty()).ok_or_else(|| {
                    PyValueError::new_err(
                        "states=\"nvme\" needs nvme_path: a directory on the drive that holds the states",
                    )
                })?;
                if !(0.0..=3600.0).contains(&lock_wait_s) {
                    return Err(PyValueError::new_err(format!(
                        "lock_wait_s = {lock_wait_s}: use 0 to 3600 seconds"
                    )));
                }
                let holder = Holder::this_run();
                for dir in &dirs {
                    if dir.exists() && !dir.is_dir() {
                        return Err(PyOSError::new_err(format!(
                            "nvme_path {}: it is a file, not a directory: give the directory \
                             on the drive that holds the states",
                            dir.display()
                        )));
                    }
                    if !dir.is_dir() {
                        return Err(PyOSError::new_err(format!(
                            "nvme_path {}: it does not exist, and strata does not create the \
                             directory it is given: create it on the drive that holds the \
                             states (mkdir -p {0}), or fix the path",
                            dir.display()
                        )));
                    }
                    let wait = LockWait {
                        wait: std::time::Duration::from_secs_f64(lock_wait_s),
                        setting: "lock_wait_s",
                    };
                    let lock = strata_storage::lock_dir(dir, "nvme_path", &holder, wait)
                        .map_err(|err| PyOSError::new_err(err.to_string()))?;
                    locks.push(lock);
                }
                if !(1..=STAGING_MAX).contains(&staging) {
                    return Err(PyValueError::new_err(format!(
                        "staging = {staging}: use 1 to {STAGING_MAX} buffers"
                    )));
                }
                let config = StorageConfig {
                    dirs: dirs.clone(),
                    capacity: ByteSize(0),
                    engine: engine.parse().map_err(PyValueError::new_err)?,
                    ..StorageConfig::default()
                };
                let needed: u64 = bytes
                    .iter()
                    .map(|&b| round_up(b.max(1), NVME_ALIGN) as u64)
                    .sum::<u64>()
                    .max(config.block_size.0);
                let capacity = nvme_capacity.unwrap_or(needed);
                if capacity < needed {
                    return Err(PyValueError::new_err(format!(
                        "nvme_capacity = {capacity} bytes, but the states need {needed}: raise it \
                         or leave it unset"
                    )));
                }
                let config = StorageConfig {
                    capacity: ByteSize(capacity),
                    ..config
                };
                let store = py
                    .detach(|| SwapStore::open(&config))
                    .map_err(|err| storage_error("open the NVMe state store", err))?;
                let extents = bytes
                    .iter()
                    .map(|&b| store.allocate(b.max(1) as u64))
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|err| storage_error("place the states on NVMe", err))?;
                let align = store.align_bytes() as usize;
                let each = round_up(largest.max(1), align);
                let free = py
                    .detach(|| {
                        (0..staging)
                            .map(|_| AlignedBuf::new_locked(each, align))
                            .collect::<Result<Vec<_>, _>>()
                    })
                    .map_err(|err| storage_error("allocate the staging buffers", err))?;
                let tier = Tier::Nvme {
                    store,
                    extents,
                    free,
                };
                (tier, 0, each * staging, capacity, "nvme")
            }
            other => {
                return Err(PyValueError::new_err(format!(
                    "states = {other:?}: use \"cpu\" (pinned host memory) or \"nvme\""
                )));
            }
        };
        let pool = Pool::new(PoolConfig {
            threads,
            ..PoolConfig::default()
        })
        .map_err(|err| PyValueError::new_err(err.to_string()))?;
        let threads = pool.threads();
        let n = elems.len();
        let shared = Arc::new(Shared {
            progress: Mutex::new(Progress {
                queued: vec![0; n],
                computed: vec![0; n],
                ..Progress::default()
            }),
            changed: Condvar::new(),
            tier: Mutex::new(tier),
            layouts,
        });
        let (sender, receiver) = channel();
        let worker = {
            let shared = shared.clone();
            std::thread::Builder::new()
                .name("strata-offload".into())
                .spawn(move || work(&shared, &pool, &receiver))
                .map_err(|err| PyOSError::new_err(format!("start the update thread: {err}")))?
        };
        Ok(OffloadStates {
            shared,
            jobs: Mutex::new(Some(sender)),
            worker: Mutex::new(Some(worker)),
            firsts,
            tier_name,
            host_bytes,
            staging_bytes,
            nvme_bytes,
            threads,
            _locks: locks,
        })
    }

    /// "cpu" or "nvme".
    #[getter]
    fn tier(&self) -> &'static str {
        self.tier_name
    }

    /// Bytes of page-locked host memory for the states (the arena).
    #[getter]
    fn host_bytes(&self) -> usize {
        self.host_bytes
    }

    /// Whether the host arena is page-locked (false when the memlock limit
    /// refused it; NVMe states keep no arena).
    #[getter]
    fn host_locked(&self) -> bool {
        match &*self.shared.tier() {
            Tier::Host { arena, .. } => arena.is_locked(),
            Tier::Nvme { free, .. } => free.iter().all(AlignedBuf::is_locked),
        }
    }

    /// Bytes of page-locked staging buffers (NVMe states).
    #[getter]
    fn staging_bytes(&self) -> usize {
        self.staging_bytes
    }

    /// Bytes preallocated on NVMe.
    #[getter]
    fn nvme_bytes(&self) -> u64 {
        self.nvme_bytes
    }

    /// The update's threads.
    #[getter]
    fn threads(&self) -> usize {
        self.threads
    }

    /// Slot `slot`'s states from `master` (fp32, bf16 or fp16: the
    /// parameter's values; ignored for a slot in place, whose parameter
    /// holds them) and, when given, `exp_avg` and `exp_avg_sq` (fp32 or
    /// bf16; zero when not given). Waits for every queued step.
    #[pyo3(signature = (slot, master, exp_avg=None, exp_avg_sq=None))]
    fn load(
        &self,
        py: Python<'_>,
        slot: usize,
        master: &Bound<'_, PyAny>,
        exp_avg: Option<&Bound<'_, PyAny>>,
        exp_avg_sq: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let layout = self.layout(slot)?;
        let master = Tensor::from_py(master, "master")?;
        master.expect(&[Dtype::F32, Dtype::Bf16, Dtype::F16], layout.elems)?;
        let moments = [exp_avg, exp_avg_sq]
            .into_iter()
            .zip(["exp_avg", "exp_avg_sq"])
            .map(|(obj, name)| {
                obj.map(|obj| {
                    let t = Tensor::from_py(obj, name)?;
                    t.expect(&[Dtype::F32, Dtype::Bf16], layout.elems)?;
                    Ok(t)
                })
                .transpose()
            })
            .collect::<PyResult<Vec<_>>>()?;
        self.wait_all(py)?;
        py.detach(|| {
            self.with_slot(slot, Access::Overwrite, |bytes| {
                let (dst, dst_moments) = layout.split(bytes);
                if let Some(dst) = dst {
                    // SAFETY: dtypes and lengths checked above; the tensors are held (and only read) until this returns.
                    unsafe { widen(&master, dst) };
                }
                let (m, v) = match dst_moments {
                    Moments::F32 { m, v } => (Wide::F32(m), Wide::F32(v)),
                    Moments::Bf16 { m, v } => (Wide::Bf16(m), Wide::Bf16(v)),
                };
                for (dst, src) in [m, v].into_iter().zip(&moments) {
                    // SAFETY: as above.
                    unsafe { set_moment(dst, src.as_ref()) };
                }
            })
        })
        .map_err(|err| storage_error("write the states", err))
    }

    /// Elements `offset..offset + out.numel()` of slot `slot`'s `state`
    /// ("master", "exp_avg" or "exp_avg_sq") into `out`: fp32, or bf16
    /// for moments kept in bf16. What a checkpoint reads one tensor (or one
    /// chunk of it) at a time. Waits for every queued step and write.
    #[pyo3(signature = (slot, state, out, offset=0))]
    fn read_range(
        &self,
        py: Python<'_>,
        slot: usize,
        state: &str,
        out: &Bound<'_, PyAny>,
        offset: usize,
    ) -> PyResult<()> {
        let (layout, region, out, range) = self.window(slot, state, out, offset)?;
        out.expect(region.dtypes(layout), out.elems)?;
        out.check_writable()?;
        self.wait_all(py)?;
        py.detach(|| {
            self.with_slot(slot, Access::Read, |bytes| {
                // SAFETY: dtype, length and writability checked above; `out` is held until this returns and nothing else writes it (the caller made it).
                unsafe { region.copy_out(layout, bytes, range, &out) }
            })
        })
        .map_err(|err| storage_error("read the states", err))
    }

    /// Writes `src` (fp32 or bf16) into elements `offset..offset +
    /// src.numel()` of slot `slot`'s `state`, the rest of the slot kept (a
    /// moment kept in bf16 takes the nearest bf16). What a checkpoint's load
    /// writes one tensor (or one chunk of it) at a time. Waits for every
    /// queued step and write.
    #[pyo3(signature = (slot, state, src, offset=0))]
    fn write_range(
        &self,
        py: Python<'_>,
        slot: usize,
        state: &str,
        src: &Bound<'_, PyAny>,
        offset: usize,
    ) -> PyResult<()> {
        let (layout, region, src, range) = self.window(slot, state, src, offset)?;
        src.expect(&[Dtype::F32, Dtype::Bf16], src.elems)?;
        self.wait_all(py)?;
        py.detach(|| {
            self.with_slot(slot, Access::Update, |bytes| {
                // SAFETY: dtype and length checked above; `src` is held (and only read) until this returns.
                unsafe { region.copy_in(layout, bytes, range, &src) }
            })
        })
        .map_err(|err| storage_error("write the states", err))
    }

    /// Queues one AdamW step of `slot` (`step` counted from 1) with
    /// gradient `grad` (fp32, bf16 or fp16) times `grad_scale`; the updated
    /// weights go into `out` (bf16, fp16 or fp32) when given. Returns at
    /// once: neither tensor may be touched until `wait(slot)` returns.
    #[pyo3(signature = (slot, grad, out, *, step, lr, beta1, beta2, eps, weight_decay,
        grad_scale=1.0, rounding_seed=0))]
    #[allow(clippy::too_many_arguments)]
    fn submit(
        &self,
        slot: usize,
        grad: &Bound<'_, PyAny>,
        out: Option<&Bound<'_, PyAny>>,
        step: u64,
        lr: f64,
        beta1: f64,
        beta2: f64,
        eps: f64,
        weight_decay: f64,
        grad_scale: f32,
        rounding_seed: u64,
    ) -> PyResult<()> {
        let layout = self.layout(slot)?;
        let grad = Tensor::from_py(grad, "grad")?;
        grad.expect(&[Dtype::F32, Dtype::Bf16, Dtype::F16], layout.elems)?;
        let out = out
            .map(|obj| {
                let t = Tensor::from_py(obj, "out")?;
                t.expect(&[Dtype::Bf16, Dtype::F16, Dtype::F32], layout.elems)?;
                t.check_writable()?;
                Ok::<_, PyErr>(t)
            })
            .transpose()?;
        if layout.in_place && out.as_ref().is_none_or(|out| out.dtype != Dtype::F32) {
            return Err(PyValueError::new_err(format!(
                "slot {slot} is in place: its out must be the parameter's fp32 memory"
            )));
        }
        if let Some(out) = &out {
            let (g, o) = (grad.ptr() as usize, out.ptr() as usize);
            if g < o + out.len_bytes() && o < g + grad.len_bytes() {
                return Err(PyValueError::new_err(
                    "grad and out share memory: the step would read what it writes",
                ));
            }
        }
        let config = AdamConfig {
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
            decoupled_weight_decay: true,
            maximize: false,
            bias_correction: true,
        };
        let coefficients = config
            .coefficients(step, grad_scale)
            .map_err(|err| PyValueError::new_err(err.to_string()))?;
        let rounding = Rounding::Stochastic {
            seed: rounding_seed,
            step,
            first: self.firsts[slot],
        };
        let mut progress = self.shared.progress();
        if let Some(error) = &progress.error {
            return Err(failed(error));
        }
        let jobs = self.jobs.lock().unwrap_or_else(|p| p.into_inner());
        let sent = jobs.as_ref().is_some_and(|jobs| {
            jobs.send(Job {
                slot,
                grad,
                out,
                coefficients,
                rounding,
            })
            .is_ok()
        });
        if !sent {
            return Err(PyRuntimeError::new_err(
                "the optimizer's update thread has stopped (closed)",
            ));
        }
        progress.queued[slot] += 1;
        progress.pending += 1;
        Ok(())
    }

    /// Blocks until every queued step of `slot` is computed.
    fn wait(&self, py: Python<'_>, slot: usize) -> PyResult<()> {
        self.layout(slot)?;
        self.wait_until(py, |p| p.computed[slot] == p.queued[slot])
    }

    /// Whether `slot` has a queued step not yet computed.
    fn busy(&self, slot: usize) -> PyResult<bool> {
        self.layout(slot)?;
        let progress = self.shared.progress();
        Ok(progress.computed[slot] != progress.queued[slot])
    }

    /// Blocks until every queued step is computed and every state write
    /// has reached the store.
    fn wait_all(&self, py: Python<'_>) -> PyResult<()> {
        self.wait_until(py, |p| p.pending == 0 && p.writes_in_flight == 0)
    }

    /// Finishes the queued steps and stops the worker.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let result = self.wait_all(py);
        self.jobs.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(worker) = self.worker.lock().unwrap_or_else(|p| p.into_inner()).take() {
            py.detach(|| worker.join())
                .map_err(|_| PyRuntimeError::new_err("the optimizer's update thread panicked"))?;
        }
        result
    }
}

impl OffloadStates {
    /// What `read_range` and `write_range` address: the slot's layout, the
    /// state, the tensor, and its elements within the state.
    fn window(
        &self,
        slot: usize,
        state: &str,
        obj: &Bound<'_, PyAny>,
        offset: usize,
    ) -> PyResult<(Layout, Region, Tensor, std::ops::Range<usize>)> {
        let layout = self.layout(slot)?;
        let region = Region::parse(state, layout)?;
        let tensor = Tensor::from_py(obj, state)?;
        let range = checked_range(offset, tensor.elems, layout.elems, state)?;
        Ok((layout, region, tensor, range))
    }

    fn layout(&self, slot: usize) -> PyResult<Layout> {
        self.shared.layouts.get(slot).copied().ok_or_else(|| {
            PyValueError::new_err(format!(
                "slot {slot}: this optimizer has {} parameters",
                self.shared.layouts.len()
            ))
        })
    }

    fn wait_until(&self, py: Python<'_>, done: impl Fn(&Progress) -> bool + Sync) -> PyResult<()> {
        let error = py.detach(|| {
            let mut progress = self.shared.progress();
            while !done(&progress) && progress.error.is_none() {
                progress = self
                    .shared
                    .changed
                    .wait(progress)
                    .unwrap_or_else(|p| p.into_inner());
            }
            progress.error.clone()
        });
        match error {
            Some(error) => Err(failed(&error)),
            None => Ok(()),
        }
    }

    /// Runs `f` on slot `slot`'s bytes: read from the store (`Read`), or
    /// every region overwritten by `f` and written back (`Overwrite`). Call
    /// with no step in flight.
    fn with_slot(
        &self,
        slot: usize,
        access: Access,
        f: impl FnOnce(&mut [u8]),
    ) -> Result<(), strata_storage::StorageError> {
        let len = self.shared.layouts[slot].bytes();
        let mut tier = self.shared.tier();
        match &mut *tier {
            Tier::Host { arena, offsets } => {
                f(&mut arena[offsets[slot]..offsets[slot] + len]);
                Ok(())
            }
            Tier::Nvme {
                store,
                extents,
                free,
            } => {
                let mut buf = free
                    .pop()
                    .expect("no step in flight: every staging buffer is free");
                let result = match access {
                    Access::Read => store
                        .read(&extents[slot], &mut buf)
                        .map(|()| f(&mut buf[..len])),
                    Access::Overwrite => {
                        f(&mut buf[..len]);
                        store.write(&extents[slot], &buf)
                    }
                    Access::Update => store.read(&extents[slot], &mut buf).and_then(|()| {
                        f(&mut buf[..len]);
                        store.write(&extents[slot], &buf)
                    }),
                };
                free.push(buf);
                result
            }
        }
    }
}

impl Drop for OffloadStates {
    fn drop(&mut self) {
        self.jobs
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(worker) = self
            .worker
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        {
            let _ = worker.join();
        }
    }
}

/// How [`OffloadStates::with_slot`] uses a slot.
#[derive(Clone, Copy)]
enum Access {
    Read,
    Overwrite,
    /// Read, changed in part by `f`, written back.
    Update,
}

/// A slot's moment, fp32 or bf16.
enum Wide<'a> {
    F32(&'a mut [f32]),
    Bf16(&'a mut [bf16]),
}

/// `offset..offset + len` within a state of `elems` elements, or an error
/// naming the numbers.
fn checked_range(
    offset: usize,
    len: usize,
    elems: usize,
    state: &str,
) -> PyResult<std::ops::Range<usize>> {
    match offset.checked_add(len) {
        Some(end) if end <= elems => Ok(offset..end),
        _ => Err(PyValueError::new_err(format!(
            "{state}: elements {offset}..{offset}+{len} lie outside the parameter's {elems}"
        ))),
    }
}

/// One of a slot's three states.
#[derive(Clone, Copy)]
enum Region {
    Master,
    ExpAvg,
    ExpAvgSq,
}

impl Region {
    fn parse(state: &str, layout: Layout) -> PyResult<Region> {
        let region = match state {
            "master" => Region::Master,
            "exp_avg" => Region::ExpAvg,
            "exp_avg_sq" => Region::ExpAvgSq,
            _ => {
                return Err(PyValueError::new_err(format!(
                    "state {state:?}: use \"master\", \"exp_avg\" or \"exp_avg_sq\""
                )));
            }
        };
        if matches!(region, Region::Master) && layout.in_place {
            return Err(PyValueError::new_err(
                "master: this parameter is its own master (fp32 on the CPU, updated in place): \
                 read the parameter",
            ));
        }
        Ok(region)
    }

    /// What a copy of this state may hold: fp32, or its own bf16.
    fn dtypes(self, layout: Layout) -> &'static [Dtype] {
        match (self, layout.moment_bytes) {
            (Region::Master, _) | (_, 4) => &[Dtype::F32],
            _ => &[Dtype::F32, Dtype::Bf16],
        }
    }

    fn wide(self, layout: Layout, bytes: &mut [u8]) -> Wide<'_> {
        let (master, moments) = layout.split(bytes);
        match (self, moments) {
            (Region::Master, _) => Wide::F32(master.expect("checked by parse: not in place")),
            (Region::ExpAvg, Moments::F32 { m, .. }) => Wide::F32(m),
            (Region::ExpAvgSq, Moments::F32 { v, .. }) => Wide::F32(v),
            (Region::ExpAvg, Moments::Bf16 { m, .. }) => Wide::Bf16(m),
            (Region::ExpAvgSq, Moments::Bf16 { v, .. }) => Wide::Bf16(v),
        }
    }

    /// # Safety
    /// `out`'s dtype is one of [`Region::dtypes`], it holds `range.len()`
    /// elements, and nothing else accesses it meanwhile.
    unsafe fn copy_out(
        self,
        layout: Layout,
        bytes: &mut [u8],
        range: std::ops::Range<usize>,
        out: &Tensor,
    ) {
        // SAFETY: the caller's contract.
        unsafe {
            match (self.wide(layout, bytes), out.dtype) {
                (Wide::F32(s), _) => out.slice_mut::<f32>().copy_from_slice(&s[range]),
                (Wide::Bf16(s), Dtype::Bf16) => out.slice_mut::<bf16>().copy_from_slice(&s[range]),
                (Wide::Bf16(s), _) => {
                    for (d, s) in out.slice_mut::<f32>().iter_mut().zip(&s[range]) {
                        *d = s.to_f32();
                    }
                }
            }
        }
    }

    /// # Safety
    /// `src` is fp32 or bf16 of `range.len()` elements and nothing writes
    /// it meanwhile.
    unsafe fn copy_in(
        self,
        layout: Layout,
        bytes: &mut [u8],
        range: std::ops::Range<usize>,
        src: &Tensor,
    ) {
        // SAFETY: the caller's contract.
        unsafe {
            match (self.wide(layout, bytes), src.dtype) {
                (Wide::F32(d), Dtype::F32) => d[range].copy_from_slice(src.slice::<f32>()),
                (Wide::F32(d), _) => {
                    for (d, s) in d[range].iter_mut().zip(src.slice::<bf16>()) {
                        *d = s.to_f32();
                    }
                }
                (Wide::Bf16(d), Dtype::Bf16) => d[range].copy_from_slice(src.slice::<bf16>()),
                (Wide::Bf16(d), _) => {
                    for (d, s) in d[range].iter_mut().zip(src.slice::<f32>()) {
                        *d = bf16::from_f32(*s);
                    }
                }
            }
        }
    }
}

/// Widens `src` (fp32, bf16 or fp16) into `dst`.
///
/// # Safety
/// `src`'s dtype and length were checked, and nothing writes it meanwhile.
unsafe fn widen(src: &Tensor, dst: &mut [f32]) {
    // SAFETY: the caller's contract.
    unsafe {
        match src.dtype {
            Dtype::F32 => dst.copy_from_slice(src.slice::<f32>()),
            Dtype::Bf16 => {
                for (d, s) in dst.iter_mut().zip(src.slice::<bf16>()) {
                    *d = s.to_f32();
                }
            }
            _ => {
                for (d, s) in dst.iter_mut().zip(src.slice::<f16>()) {
                    *d = s.to_f32();
                }
            }
        }
    }
}

/// Sets a moment from `src` (fp32 or bf16), or to zero.
///
/// # Safety
/// As [`widen`].
unsafe fn set_moment(dst: Wide<'_>, src: Option<&Tensor>) {
    // SAFETY: the caller's contract.
    unsafe {
        match (dst, src) {
            (Wide::F32(d), None) => d.fill(0.0),
            (Wide::Bf16(d), None) => d.fill(bf16::ZERO),
            (Wide::F32(d), Some(s)) => widen(s, d),
            (Wide::Bf16(d), Some(s)) if s.dtype == Dtype::Bf16 => {
                d.copy_from_slice(s.slice::<bf16>())
            }
            (Wide::Bf16(d), Some(s)) => {
                for (d, s) in d.iter_mut().zip(s.slice::<f32>()) {
                    *d = bf16::from_f32(*s);
                }
            }
        }
    }
}

/// One step of `job` over its slot's bytes.
fn step(pool: &Pool, layout: Layout, bytes: &mut [u8], job: &Job) {
    let (master, moments) = layout.split(bytes);
    // SAFETY: `submit` checked the dtypes, lengths and writability and that grad and out do not overlap; the job holds both tensors, and the caller of `submit` leaves them alone until `wait` says the step is computed.
    let (grad, out) = unsafe {
        let grad = match job.grad.dtype {
            Dtype::F32 => Values::F32(job.grad.slice::<f32>()),
            Dtype::Bf16 => Values::Bf16(job.grad.slice::<bf16>()),
            _ => Values::F16(job.grad.slice::<f16>()),
        };
        let out = job.out.as_ref().map(|out| match out.dtype {
            Dtype::Bf16 => Ok(LowPrecisionMut::Bf16(out.slice_mut::<bf16>())),
            Dtype::F16 => Ok(LowPrecisionMut::F16(out.slice_mut::<f16>())),
            _ => Err(out.slice_mut::<f32>()),
        });
        (grad, out)
    };
    let (copy, wide) = match out {
        Some(Ok(copy)) => (Some(copy), None),
        Some(Err(wide)) => (None, Some(wide)),
        None => (None, None),
    };
    match (master, wide) {
        // In place: the parameter's memory is the master (`submit` checked it is fp32).
        (None, Some(param)) => {
            let shard = (param, grad, moments, None, job.rounding);
            pool.adam_step_many(&job.coefficients, vec![shard]);
        }
        (Some(master), wide) => {
            let shard = (&mut *master, grad, moments, copy, job.rounding);
            pool.adam_step_many(&job.coefficients, vec![shard]);
            if let Some(wide) = wide {
                wide.copy_from_slice(master);
            }
        }
        (None, None) => unreachable!("submit refuses a step in place without its parameter"),
    }
}

/// The worker: runs queued steps in order until the sender is dropped.
fn work(shared: &Shared, pool: &Pool, jobs: &Receiver<Job>) {
    if matches!(&*shared.tier(), Tier::Nvme { .. }) {
        return work_nvme(shared, pool, jobs);
    }
    while let Ok(job) = jobs.recv() {
        let (slot, layout) = (job.slot, shared.layouts[job.slot]);
        {
            let mut tier = shared.tier();
            let Tier::Host { arena, offsets } = &mut *tier else {
                unreachable!("the tier never changes")
            };
            let at = offsets[slot];
            step(pool, layout, &mut arena[at..at + layout.bytes()], &job);
        }
        drop(job);
        shared.computed(slot, None);
    }
}

/// NVMe: reads ahead the states of as many queued steps as there are free
/// staging buffers, computes in order, and writes behind.
fn work_nvme(shared: &Shared, pool: &Pool, jobs: &Receiver<Job>) {
    let mut reads: VecDeque<(Job, Ticket<AlignedBuf>)> = VecDeque::new();
    let mut writes: VecDeque<Ticket<AlignedBuf>> = VecDeque::new();
    let mut open = true;
    loop {
        while open && has_free(shared) {
            let next = if reads.is_empty() && writes.is_empty() {
                jobs.recv().ok()
            } else {
                match jobs.try_recv() {
                    Ok(job) => Some(job),
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => None,
                }
            };
            let Some(job) = next else {
                open = false;
                break;
            };
            let mut tier = shared.tier();
            let Tier::Nvme {
                store,
                extents,
                free,
            } = &mut *tier
            else {
                unreachable!("the tier never changes")
            };
            let buf = free.pop().expect("has_free said so");
            let ticket = store.read_start(&extents[job.slot], buf);
            reads.push_back((job, ticket));
        }
        while writes.front().is_some_and(Ticket::is_done) {
            settle(shared, writes.pop_front().expect("front checked"));
        }
        if let Some((job, ticket)) = reads.pop_front() {
            let (mut buf, read) = ticket.wait();
            let (slot, layout) = (job.slot, shared.layouts[job.slot]);
            if let Err(err) = read {
                drop(job);
                give_back(shared, buf);
                let error = format!("reading parameter {slot}'s states from NVMe: {err}");
                shared.computed(slot, Some(error));
                continue;
            }
            step(pool, layout, &mut buf[..layout.bytes()], &job);
            drop(job);
            {
                let tier = shared.tier();
                let Tier::Nvme { store, extents, .. } = &*tier else {
                    unreachable!("the tier never changes")
                };
                writes.push_back(store.write_start(&extents[slot], buf));
            }
            shared.progress().writes_in_flight += 1;
            shared.computed(slot, None);
        } else if let Some(ticket) = writes.pop_front() {
            settle(shared, ticket);
        } else if !open {
            return;
        }
    }
}

fn has_free(shared: &Shared) -> bool {
    matches!(&*shared.tier(), Tier::Nvme { free, .. } if !free.is_empty())
}

fn give_back(shared: &Shared, buf: AlignedBuf) {
    if let Tier::Nvme { free, .. } = &mut *shared.tier() {
        free.push(buf);
    }
}

fn settle(shared: &Shared, ticket: Ticket<AlignedBuf>) {
    let (buf, result) = ticket.wait();
    give_back(shared, buf);
    shared.write_settled(
        result
            .err()
            .map(|err| format!("writing states to NVMe: {err}")),
    );
}
