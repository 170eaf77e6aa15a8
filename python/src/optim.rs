//! `strata._strata.Kernels`: strata-optim's pool behind three calls (Adam,
//! Adagrad, Lion), each stepping one parameter's tensors, or a whole list
//! of parameters at once, in place with the GIL released. The Python optimizers in `strata/optim.py` drive it.

use std::sync::Mutex;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use strata_optim::{
    AdagradConfig, AdamConfig, AdamShard, LionConfig, LowPrecisionMut, Moments, OptimError, Pool,
    PoolConfig, Rounding, StateShard, Values, bf16, f16,
};

use crate::tensor::{
    Dtype, Tensor, check_disjoint, expect_count, optional_tensor_list, tensor_list,
};

fn optim_error(err: OptimError) -> PyErr {
    PyValueError::new_err(err.to_string())
}

/// The pool and the process that started it: threads do not survive
/// `fork`, so a child builds its own on first use.
struct Owned {
    pid: u32,
    pool: Pool,
}

/// strata's CPU optimizer kernels on a pool of threads.
#[pyclass(module = "strata._strata", frozen)]
pub(crate) struct Kernels {
    config: PoolConfig,
    owned: Mutex<Option<Owned>>,
}

const GRADS: &[Dtype] = &[Dtype::F32, Dtype::Bf16, Dtype::U16, Dtype::F16];
const COPY: &[Dtype] = &[Dtype::Bf16, Dtype::U16, Dtype::F16];

/// # Safety
/// `t` has one of [`GRADS`]'s dtypes and nothing writes it meanwhile.
unsafe fn values(t: &Tensor) -> Values<'_> {
    // SAFETY: the dtype was checked; exclusivity is the caller's.
    unsafe {
        match t.dtype {
            Dtype::F32 => Values::F32(t.slice::<f32>()),
            Dtype::Bf16 | Dtype::U16 => Values::Bf16(t.slice::<bf16>()),
            _ => Values::F16(t.slice::<f16>()),
        }
    }
}

/// # Safety
/// `t` has one of [`COPY`]'s dtypes, is writable and nothing else
/// accesses it meanwhile.
unsafe fn low_precision(t: &Tensor) -> LowPrecisionMut<'_> {
    // SAFETY: as above.
    unsafe {
        match t.dtype {
            Dtype::Bf16 | Dtype::U16 => LowPrecisionMut::Bf16(t.slice_mut::<bf16>()),
            _ => LowPrecisionMut::F16(t.slice_mut::<f16>()),
        }
    }
}

/// One call's tensors, checked: for each parameter its fp32 values, its
/// gradient, its states (`states[k][i]` is state `k` of parameter `i`) and
/// an optional 16-bit copy of the update. Every argument is a tensor or a
/// list with one entry per parameter.
struct Batch {
    params: Vec<Tensor>,
    grads: Vec<Tensor>,
    states: Vec<Vec<Tensor>>,
    copies: Vec<Option<Tensor>>,
}

impl Batch {
    fn new(
        params: &Bound<'_, PyAny>,
        grads: &Bound<'_, PyAny>,
        states: &[(&Bound<'_, PyAny>, &str)],
        copies: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Batch> {
        let params = tensor_list(params, "params")?;
        let n = params.len();
        let grads = tensor_list(grads, "grads")?;
        expect_count(grads.len(), "grads", n)?;
        let states = states
            .iter()
            .map(|&(obj, name)| {
                let list = tensor_list(obj, name)?;
                expect_count(list.len(), name, n)?;
                Ok(list)
            })
            .collect::<PyResult<Vec<_>>>()?;
        let copies = match copies {
            Some(copies) => optional_tensor_list(copies, "param_copy", n)?,
            None => (0..n).map(|_| None).collect(),
        };
        for (i, p) in params.iter().enumerate() {
            p.expect(&[Dtype::F32], p.elems)?;
            p.check_writable()?;
            grads[i].expect(GRADS, p.elems)?;
            for state in &states {
                state[i].check_writable()?;
            }
            if let Some(copy) = &copies[i] {
                copy.expect(COPY, p.elems)?;
                copy.check_writable()?;
            }
        }
        // Only the gradients are read alone (two parameters may share one).
        let all: Vec<(&Tensor, bool)> = (params.iter().map(|t| (t, true)))
            .chain(grads.iter().map(|t| (t, false)))
            .chain(states.iter().flatten().map(|t| (t, true)))
            .chain(copies.iter().flatten().map(|t| (t, true)))
            .collect();
        check_disjoint(&all)?;
        Ok(Batch {
            params,
            grads,
            states,
            copies,
        })
    }

    /// Errors unless state `k` of every parameter has one of `dtypes`.
    fn expect_state(&self, k: usize, dtypes: &[Dtype]) -> PyResult<()> {
        for (state, p) in self.states[k].iter().zip(&self.params) {
            state.expect(dtypes, p.elems)?;
        }
        Ok(())
    }

    /// Parameter `i`'s params, gradients and 16-bit copy as slices.
    ///
    /// # Safety
    /// The checks of [`Batch::new`] hold (they did when it returned) and
    /// nothing else touches the tensors while the slices live.
    #[allow(clippy::mut_from_ref)]
    unsafe fn common(&self, i: usize) -> (&mut [f32], Values<'_>, Option<LowPrecisionMut<'_>>) {
        // SAFETY: dtypes, lengths, writability and disjointness were checked in `new`; exclusivity is the caller's.
        unsafe {
            (
                self.params[i].slice_mut(),
                values(&self.grads[i]),
                self.copies[i].as_ref().map(|c| low_precision(c)),
            )
        }
    }

    /// Every parameter's slices with its one fp32 state (Adagrad, Lion).
    ///
    /// # Safety
    /// As [`Batch::common`], and state 0 is fp32 ([`Batch::expect_state`]).
    unsafe fn with_one_state(&self) -> Vec<StateShard<'_>> {
        (0..self.params.len())
            .map(|i| {
                // SAFETY: the caller's contract.
                let (p, g, copy) = unsafe { self.common(i) };
                // SAFETY: checked fp32 and writable, disjoint from the rest.
                (p, g, unsafe { self.states[0][i].slice_mut() }, copy)
            })
            .collect()
    }
}

/// Each tensor's rounding of its bf16 moments for `adam`: `rounding`
/// "stochastic" keyed by (`seed`, `step`, each element's global index), the
/// first tensor's first element at `first` (an int; the others following
/// on) or each tensor's at its entry of `first` (a list); or "nearest".
fn roundings(
    rounding: &str,
    seed: u64,
    step: u64,
    first: Option<&Bound<'_, PyAny>>,
    lens: &[usize],
) -> PyResult<Vec<Rounding>> {
    match rounding {
        "nearest" => return Ok(vec![Rounding::Nearest; lens.len()]),
        "stochastic" => {}
        other => {
            return Err(PyValueError::new_err(format!(
                "rounding = {other:?}: use \"stochastic\" (the default: bf16 moments rounded \
                 up or down with the odds of their distance, so small updates survive on \
                 average) or \"nearest\" (to nearest even, which freezes v once its change \
                 per step is below half a bf16 ulp, as with beta2 = 0.999)"
            )));
        }
    }
    let bad_first = || {
        PyValueError::new_err(format!(
            "first: give an int from 0 (the global index of the first tensor's first element; \
             the others follow on) or a list of {} such ints, one per tensor",
            lens.len()
        ))
    };
    // One start, the others following on; or each tensor's own (`list`).
    let (start, list) = match first.map(|obj| (obj.extract::<u64>(), obj)) {
        None => (0, None),
        Some((Ok(start), _)) => (start, None),
        Some((Err(_), obj)) => {
            let list = obj.extract::<Vec<u64>>().map_err(|_| bad_first())?;
            if list.len() != lens.len() {
                return Err(bad_first());
            }
            (0, Some(list))
        }
    };
    // In u128: a tensor may end exactly at index 2^64 - 1.
    let mut next = u128::from(start);
    lens.iter()
        .enumerate()
        .map(|(i, &len)| {
            let first = list.as_ref().map_or(next, |list| u128::from(list[i]));
            next = first + len as u128;
            if len > 0 && next - 1 > u128::from(u64::MAX) {
                return Err(PyValueError::new_err(format!(
                    "first = {first} for a tensor of {len} elements: its last element's index \
                     passes 2^64 - 1; number the elements from 0"
                )));
            }
            let first = u64::try_from(first).unwrap_or(u64::MAX);
            Ok(Rounding::Stochastic { seed, step, first })
        })
        .collect()
}

impl Kernels {
    /// Runs `work` on this process's pool with the GIL released.
    fn run<T: Send>(&self, py: Python<'_>, work: impl FnOnce(&Pool) -> T + Send) -> PyResult<T> {
        py.detach(|| {
            let mut owned = self.owned.lock().unwrap_or_else(|p| p.into_inner());
            let pid = std::process::id();
            if owned.as_ref().is_some_and(|o| o.pid != pid) {
                // The parent's threads are gone: dropping their pool would wait for them.
                std::mem::forget(owned.take());
            }
            if owned.is_none() {
                let pool = Pool::new(self.config).map_err(optim_error)?;
                *owned = Some(Owned { pid, pool });
            }
            let pool = &owned.as_ref().expect("pool just built").pool;
            Ok(work(pool))
        })
    }
}

#[pymethods]
impl Kernels {
    /// `threads=None`: one per physical core this process may use. `pin`:
    /// pin each thread to a core (off by default: it collides with torch's
    /// OpenMP threads and DataLoader workers).
    #[new]
    #[pyo3(signature = (threads=None, pin=false))]
    fn new(threads: Option<usize>, pin: bool) -> PyResult<Self> {
        let config = PoolConfig {
            threads,
            pin,
            ..PoolConfig::default()
        };
        if threads.is_some_and(|t| t == 0 || t > strata_optim::THREADS_MAX) {
            return Err(PyValueError::new_err(format!(
                "threads = {}: use 1 to {} (or None for one per core)",
                threads.unwrap_or(0),
                strata_optim::THREADS_MAX
            )));
        }
        Ok(Kernels {
            config,
            owned: Mutex::new(None),
        })
    }

    /// Threads the kernels run on.
    #[getter]
    fn threads(&self, py: Python<'_>) -> PyResult<usize> {
        self.run(py, |pool| pool.threads())
    }

    /// The instruction set chosen (avx512bf16, avx512vaes, avx512, avx2 or
    /// portable).
    #[getter]
    fn isa(&self, py: Python<'_>) -> PyResult<&'static str> {
        self.run(py, |pool| pool.isa().name())
    }

    /// One Adam/AdamW step, in place, of one parameter or of a list of them
    /// (each argument then a list with one entry per parameter; one call
    /// for a whole param group wakes the threads once). `grads`: fp32, bf16
    /// (or uint16 holding bf16) or fp16; moments fp32 or bf16;
    /// `param_copy`: an optional bf16/fp16 tensor that receives the updated
    /// parameters (the fused offload step).
    ///
    /// bf16 moments round stochastically by default, with random bits from
    /// a hash of (`rounding_seed`, `step`, each element's global index):
    /// `first` is the first tensor's first index (the others follow on) or
    /// a list of each tensor's, so that the bits do not depend on how the
    /// tensors are batched or on the thread count. `rounding="nearest"`
    /// rounds to nearest even. fp32 moments round no way at all.
    #[pyo3(signature = (params, grads, exp_avg, exp_avg_sq, *, step, lr, beta1, beta2, eps,
        weight_decay, adamw_mode, bias_correction, grad_scale=1.0, param_copy=None,
        rounding="stochastic", rounding_seed=0, first=None))]
    #[allow(clippy::too_many_arguments)]
    fn adam(
        &self,
        py: Python<'_>,
        params: &Bound<'_, PyAny>,
        grads: &Bound<'_, PyAny>,
        exp_avg: &Bound<'_, PyAny>,
        exp_avg_sq: &Bound<'_, PyAny>,
        step: u64,
        lr: f64,
        beta1: f64,
        beta2: f64,
        eps: f64,
        weight_decay: f64,
        adamw_mode: bool,
        bias_correction: bool,
        grad_scale: f32,
        param_copy: Option<&Bound<'_, PyAny>>,
        rounding: &str,
        rounding_seed: u64,
        first: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let batch = Batch::new(
            params,
            grads,
            &[(exp_avg, "exp_avg"), (exp_avg_sq, "exp_avg_sq")],
            param_copy,
        )?;
        let lens: Vec<usize> = batch.params.iter().map(|p| p.elems).collect();
        let rounding = roundings(rounding, rounding_seed, step, first, &lens)?;
        batch.expect_state(0, &[Dtype::F32, Dtype::Bf16, Dtype::U16])?;
        for (i, m) in batch.states[0].iter().enumerate() {
            let v = &batch.states[1][i];
            match m.dtype {
                Dtype::F32 => v.expect(&[Dtype::F32], m.elems)?,
                _ => v.expect(&[Dtype::Bf16, Dtype::U16], m.elems)?,
            }
        }
        let config = AdamConfig {
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
            decoupled_weight_decay: adamw_mode,
            maximize: false,
            bias_correction,
        };
        let coefficients = config.coefficients(step, grad_scale).map_err(optim_error)?;
        self.run(py, |pool| {
            let shards: Vec<AdamShard<'_>> = (0..batch.params.len())
                .map(|i| {
                    let (m, v) = (&batch.states[0][i], &batch.states[1][i]);
                    // SAFETY: every dtype and length was checked above, the tensors are pairwise disjoint and writable where written, and they stay alive (held by `batch`) until the step returns.
                    unsafe {
                        let (p, g, copy) = batch.common(i);
                        let moments = match m.dtype {
                            Dtype::F32 => Moments::F32 {
                                m: m.slice_mut(),
                                v: v.slice_mut(),
                            },
                            _ => Moments::Bf16 {
                                m: m.slice_mut(),
                                v: v.slice_mut(),
                            },
                        };
                        (p, g, moments, copy, rounding[i])
                    }
                })
                .collect();
            pool.adam_step_many(&coefficients, shards);
        })
    }

    /// One Adagrad step (PyTorch's rule), in place, of one parameter or a
    /// list of them (as `adam`).
    #[pyo3(signature = (params, grads, state_sum, *, step, lr, eps, weight_decay, lr_decay=0.0,
        grad_scale=1.0, param_copy=None))]
    #[allow(clippy::too_many_arguments)]
    fn adagrad(
        &self,
        py: Python<'_>,
        params: &Bound<'_, PyAny>,
        grads: &Bound<'_, PyAny>,
        state_sum: &Bound<'_, PyAny>,
        step: u64,
        lr: f64,
        eps: f64,
        weight_decay: f64,
        lr_decay: f64,
        grad_scale: f32,
        param_copy: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let batch = Batch::new(params, grads, &[(state_sum, "state_sum")], param_copy)?;
        batch.expect_state(0, &[Dtype::F32])?;
        let config = AdagradConfig {
            lr,
            lr_decay,
            weight_decay,
            eps,
            maximize: false,
        };
        let coefficients = config.coefficients(step, grad_scale).map_err(optim_error)?;
        self.run(py, |pool| {
            // SAFETY: checked by `Batch::new` and `expect_state`; the tensors stay alive (held by `batch`) until the step returns.
            let shards = unsafe { batch.with_one_state() };
            pool.adagrad_step_many(&coefficients, shards);
        })
    }

    /// One Lion step, in place, of one parameter or a list of them (as
    /// `adam`).
    #[pyo3(signature = (params, grads, exp_avg, *, step, lr, beta1, beta2, weight_decay,
        grad_scale=1.0, param_copy=None))]
    #[allow(clippy::too_many_arguments)]
    fn lion(
        &self,
        py: Python<'_>,
        params: &Bound<'_, PyAny>,
        grads: &Bound<'_, PyAny>,
        exp_avg: &Bound<'_, PyAny>,
        step: u64,
        lr: f64,
        beta1: f64,
        beta2: f64,
        weight_decay: f64,
        grad_scale: f32,
        param_copy: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let batch = Batch::new(params, grads, &[(exp_avg, "exp_avg")], param_copy)?;
        batch.expect_state(0, &[Dtype::F32])?;
        let config = LionConfig {
            lr,
            beta1,
            beta2,
            weight_decay,
        };
        let coefficients = config.coefficients(step, grad_scale).map_err(optim_error)?;
        self.run(py, |pool| {
            // SAFETY: as in `adagrad`.
            let shards = unsafe { batch.with_one_state() };
            pool.lion_step_many(&coefficients, shards);
        })
    }
}

impl Drop for Kernels {
    fn drop(&mut self) {
        let owned = self.owned.get_mut().unwrap_or_else(|p| p.into_inner());
        if owned.as_ref().is_some_and(|o| o.pid != std::process::id()) {
            std::mem::forget(owned.take());
        }
    }
}
