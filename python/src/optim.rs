//! `strata._strata.Kernels`: strata-optim's pool behind three calls (Adam,
//! Adagrad, Lion), each stepping one parameter's tensors in place with the
//! GIL released. The Python optimizers in `strata/optim.py` drive it.

use std::sync::Mutex;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use strata_optim::{
    AdagradConfig, AdamConfig, LionConfig, LowPrecisionMut, Moments, OptimError, Pool, PoolConfig,
    Values, bf16, f16,
};

use crate::tensor::{Dtype, Tensor, check_disjoint};

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

/// Checks a parameter, its gradient and its optional 16-bit copy.
fn check_common(
    params: &Tensor,
    grads: &Tensor,
    copy: Option<&Tensor>,
    states: &[&Tensor],
) -> PyResult<()> {
    params.expect(&[Dtype::F32], params.elems)?;
    params.check_writable()?;
    grads.expect(GRADS, params.elems)?;
    let mut all = vec![params, grads];
    for state in states {
        state.check_writable()?;
        all.push(state);
    }
    if let Some(copy) = copy {
        copy.expect(COPY, params.elems)?;
        copy.check_writable()?;
        all.push(copy);
    }
    check_disjoint(&all)
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

    /// The instruction set chosen (avx512, avx2, neon or portable).
    #[getter]
    fn isa(&self, py: Python<'_>) -> PyResult<&'static str> {
        self.run(py, |pool| pool.isa().name())
    }

    /// One Adam/AdamW step of one parameter, in place. `grads`: fp32, bf16
    /// (or uint16 holding bf16) or fp16; moments fp32 or bf16;
    /// `param_copy`: an optional bf16/fp16 tensor that receives the updated
    /// parameters (the fused offload step).
    #[pyo3(signature = (params, grads, exp_avg, exp_avg_sq, *, step, lr, beta1, beta2, eps,
        weight_decay, adamw_mode, bias_correction, grad_scale=1.0, param_copy=None))]
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
    ) -> PyResult<()> {
        let params = Tensor::from_py(params, "params")?;
        let grads = Tensor::from_py(grads, "grads")?;
        let m = Tensor::from_py(exp_avg, "exp_avg")?;
        let v = Tensor::from_py(exp_avg_sq, "exp_avg_sq")?;
        let copy = param_copy
            .map(|c| Tensor::from_py(c, "param_copy"))
            .transpose()?;
        check_common(&params, &grads, copy.as_ref(), &[&m, &v])?;
        m.expect(&[Dtype::F32, Dtype::Bf16, Dtype::U16], params.elems)?;
        let bf16_moments = m.dtype != Dtype::F32;
        v.expect(
            if bf16_moments {
                &[Dtype::Bf16, Dtype::U16]
            } else {
                &[Dtype::F32]
            },
            params.elems,
        )?;
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
            // SAFETY: every dtype and length was checked above, the tensors are pairwise disjoint and writable where written, and they stay alive (held here) until the step returns.
            unsafe {
                let moments = if bf16_moments {
                    Moments::Bf16 {
                        m: m.slice_mut(),
                        v: v.slice_mut(),
                    }
                } else {
                    Moments::F32 {
                        m: m.slice_mut(),
                        v: v.slice_mut(),
                    }
                };
                pool.adam_step(
                    &coefficients,
                    params.slice_mut(),
                    values(&grads),
                    moments,
                    copy.as_ref().map(|c| low_precision(c)),
                );
            }
        })
    }

    /// One Adagrad step (PyTorch's rule) of one parameter, in place.
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
        let params = Tensor::from_py(params, "params")?;
        let grads = Tensor::from_py(grads, "grads")?;
        let sum = Tensor::from_py(state_sum, "state_sum")?;
        let copy = param_copy
            .map(|c| Tensor::from_py(c, "param_copy"))
            .transpose()?;
        check_common(&params, &grads, copy.as_ref(), &[&sum])?;
        sum.expect(&[Dtype::F32], params.elems)?;
        let config = AdagradConfig {
            lr,
            lr_decay,
            weight_decay,
            eps,
            maximize: false,
        };
        let coefficients = config.coefficients(step, grad_scale).map_err(optim_error)?;
        self.run(py, |pool| {
            // SAFETY: as in `adam`.
            unsafe {
                pool.adagrad_step(
                    &coefficients,
                    params.slice_mut(),
                    values(&grads),
                    sum.slice_mut(),
                    copy.as_ref().map(|c| low_precision(c)),
                );
            }
        })
    }

    /// One Lion step of one parameter, in place.
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
        let params = Tensor::from_py(params, "params")?;
        let grads = Tensor::from_py(grads, "grads")?;
        let momentum = Tensor::from_py(exp_avg, "exp_avg")?;
        let copy = param_copy
            .map(|c| Tensor::from_py(c, "param_copy"))
            .transpose()?;
        check_common(&params, &grads, copy.as_ref(), &[&momentum])?;
        momentum.expect(&[Dtype::F32], params.elems)?;
        let config = LionConfig {
            lr,
            beta1,
            beta2,
            weight_decay,
        };
        let coefficients = config.coefficients(step, grad_scale).map_err(optim_error)?;
        self.run(py, |pool| {
            // SAFETY: as in `adam`.
            unsafe {
                pool.lion_step(
                    &coefficients,
                    params.slice_mut(),
                    values(&grads),
                    momentum.slice_mut(),
                    copy.as_ref().map(|c| low_precision(c)),
                );
            }
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
