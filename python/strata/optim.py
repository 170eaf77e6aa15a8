"""Drop-in CPU optimizers for PyTorch trainers, on strata's SIMD kernels.

``CPUAdam`` takes ``DeepSpeedCPUAdam``'s arguments and follows its semantics
(AdamW by default; ``adamw_mode=False`` for Adam's L2 decay; ``amsgrad`` is
refused, as there), so switching is one import:

    from strata.optim import CPUAdam as DeepSpeedCPUAdam

Parameters, gradients and states are CPU tensors stepped in place, with no
copies and the GIL released; the fp32 parameter update is bit-for-bit the
same on any number of threads. ``state_dict()`` follows
``torch.optim.AdamW``'s layout (``step`` a float32 tensor; DeepSpeed's int
steps load too), so checkpoints move between the two.

``step_fused(param_copies)`` is ZeRO-Offload's step in one pass over
memory: gradients in fp32, bf16 or fp16, the update, and the updated
parameters written as bf16/fp16 into ``param_copies`` (e.g. pinned buffers
bound for the GPU).

Threads: ``threads=None`` uses one per physical core; threads are not
pinned unless ``pin_threads=True`` (pinning collides with torch's OpenMP
threads and DataLoader workers). After ``fork`` a child builds its own
threads on its first step.

Raw writes bypass autograd's version counter: steps run under
``torch.no_grad()``, like every optimizer's.
"""

import os

import torch

from ._strata import Kernels

__all__ = ["CPUAdam", "CPUAdagrad", "CPULion"]


class _StrataOptimizer(torch.optim.Optimizer):
    """Shared plumbing: the kernels (built lazily, rebuilt after fork),
    parameter checks, and steps kept as float32 tensors like torch's."""

    def __init__(self, params, defaults, threads, pin_threads):
        if defaults.get("amsgrad"):
            raise RuntimeError(f"{type(self).__name__} does not support the AMSGrad variant.")
        super().__init__(params, defaults)
        self._threads = threads
        self._pin_threads = pin_threads
        self._kernels = None
        self._kernels_pid = None

    def add_param_group(self, param_group):
        if param_group.get("amsgrad", self.defaults.get("amsgrad", False)):
            raise RuntimeError(f"{type(self).__name__} does not support the AMSGrad variant.")
        super().add_param_group(param_group)

    def __setstate__(self, state):
        super().__setstate__(state)
        for group in self.param_groups:
            for key, value in self.defaults.items():
                group.setdefault(key, value)

    def __getstate__(self):
        state = super().__getstate__()
        state.pop("_kernels", None)
        return state

    @property
    def kernels(self):
        """strata's kernels for this process (rebuilt in a forked child)."""
        kernels = getattr(self, "_kernels", None)
        if kernels is None or self._kernels_pid != os.getpid():
            kernels = Kernels(getattr(self, "_threads", None), getattr(self, "_pin_threads", False))
            self._kernels, self._kernels_pid = kernels, os.getpid()
        return kernels

    def _params_with_grads(self, grads):
        """(group, param, grad) for every parameter with a gradient, in order."""
        index = 0
        for group in self.param_groups:
            for p in group["params"]:
                grad = p.grad if grads is None else grads[index]
                index += 1
                if grad is None:
                    continue
                if p.device.type != "cpu":
                    raise RuntimeError(
                        f"{type(self).__name__} param is on {p.device} and must be on the CPU: "
                        "offload the optimizer (DeepSpeed: zero_optimization.offload_optimizer.device = 'cpu')"
                    )
                if p.dtype != torch.float32:
                    raise TypeError(
                        f"{type(self).__name__} steps float32 parameters, got {p.dtype}: keep fp32 "
                        "master weights on the CPU and pass their 16-bit copies to step_fused"
                    )
                yield group, p, grad.detach()
        if grads is not None and index != len(grads):
            raise ValueError(f"grads has {len(grads)} entries for {index} parameters")

    def _advance(self, p, init):
        """The state of ``p`` (created on first use: a float32 ``step`` and
        ``init(p)``'s tensors) and the number of the step about to run."""
        state = self.state[p]
        if len(state) == 0:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state.update(init(p))
        return state, self._next_step(state)

    def _next_step(self, state):
        """Advances the state's step (a float32 tensor, as torch keeps it;
        an int from DeepSpeed is converted) and returns it as an int."""
        step = state["step"]
        if not torch.is_tensor(step):
            step = torch.tensor(float(step), dtype=torch.float32)
            state["step"] = step
        step += 1
        return int(step.item())

    def _copies(self, param_copies):
        if param_copies is None:
            return None
        count = sum(len(g["params"]) for g in self.param_groups)
        if len(param_copies) != count:
            raise ValueError(f"param_copies has {len(param_copies)} entries for {count} parameters")
        return list(param_copies)


def _closure(closure):
    """The loss from ``closure`` (re-evaluated with gradients), or None."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def _zeros(p, dtype=torch.float32):
    return torch.zeros_like(p, dtype=dtype, memory_format=torch.contiguous_format)


class CPUAdam(_StrataOptimizer):
    """Adam/AdamW on the CPU: DeepSpeedCPUAdam's signature and semantics."""

    def __init__(
        self,
        model_params,
        lr=1e-3,
        bias_correction=True,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0,
        amsgrad=False,
        adamw_mode=True,
        fp32_optimizer_states=True,
        *,
        threads=None,
        pin_threads=False,
    ):
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            bias_correction=bias_correction,
            amsgrad=amsgrad,
        )
        super().__init__(model_params, defaults, threads, pin_threads)
        self.adam_w_mode = adamw_mode
        # fp32 parameters keep fp32 states either way (as in DeepSpeed).
        self.fp32_optimizer_states = fp32_optimizer_states

    @torch.no_grad()
    def step(self, closure=None):
        """One step over every parameter with a gradient."""
        loss = _closure(closure)
        self._step(None, None, 1.0)
        return loss

    @torch.no_grad()
    def step_fused(self, param_copies, grads=None, grad_scale=1.0):
        """ZeRO-Offload's fused step: gradients (``grads``, one per
        parameter in param_groups order, fp32/bf16/fp16; default each
        ``p.grad``) times ``grad_scale`` (1/loss scale x clip coefficient),
        the update, and each updated parameter written into
        ``param_copies[i]`` (bf16 or fp16, same number of elements; None to
        skip one) in the same pass."""
        self._step(self._copies(param_copies), grads, grad_scale)

    def _step(self, copies, grads, grad_scale):
        kernels = self.kernels
        flat = [p for g in self.param_groups for p in g["params"]]
        index = {id(p): i for i, p in enumerate(flat)} if copies is not None else None
        for group, p, grad in self._params_with_grads(grads):
            state, step = self._advance(p, lambda p: {"exp_avg": _zeros(p), "exp_avg_sq": _zeros(p)})
            beta1, beta2 = group["betas"]
            kernels.adam(
                p.detach(),
                grad,
                state["exp_avg"],
                state["exp_avg_sq"],
                step=step,
                lr=group["lr"],
                beta1=beta1,
                beta2=beta2,
                eps=group["eps"],
                weight_decay=group["weight_decay"],
                adamw_mode=self.adam_w_mode,
                bias_correction=group["bias_correction"],
                grad_scale=grad_scale,
                param_copy=None if copies is None else copies[index[id(p)]],
            )


class CPUAdagrad(_StrataOptimizer):
    """Adagrad on the CPU: DeepSpeedCPUAdagrad's signature, PyTorch's rule
    (state ``sum``, as torch.optim.Adagrad keeps it)."""

    def __init__(
        self,
        model_params,
        lr=1e-2,
        eps=1e-10,
        weight_decay=0,
        amsgrad=False,
        fp32_optimizer_states=True,
        *,
        lr_decay=0.0,
        initial_accumulator_value=0.0,
        threads=None,
        pin_threads=False,
    ):
        defaults = dict(
            lr=lr,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            lr_decay=lr_decay,
            initial_accumulator_value=initial_accumulator_value,
        )
        super().__init__(model_params, defaults, threads, pin_threads)
        self.fp32_optimizer_states = fp32_optimizer_states

    @torch.no_grad()
    def step(self, closure=None):
        """One step over every parameter with a gradient."""
        loss = _closure(closure)
        kernels = self.kernels
        for group, p, grad in self._params_with_grads(None):
            initial = group["initial_accumulator_value"]
            state, step = self._advance(
                p, lambda p: {"sum": torch.full_like(p, initial, memory_format=torch.contiguous_format)}
            )
            kernels.adagrad(
                p.detach(),
                grad,
                state["sum"],
                step=step,
                lr=group["lr"],
                eps=group["eps"],
                weight_decay=group["weight_decay"],
                lr_decay=group["lr_decay"],
            )
        return loss


class CPULion(_StrataOptimizer):
    """Lion on the CPU: DeepSpeedCPULion's signature (state ``exp_avg``)."""

    def __init__(
        self,
        model_params,
        lr=1e-3,
        betas=(0.9, 0.999),
        weight_decay=0,
        fp32_optimizer_states=True,
        *,
        threads=None,
        pin_threads=False,
    ):
        defaults = dict(lr=lr, betas=betas, weight_decay=weight_decay)
        super().__init__(model_params, defaults, threads, pin_threads)
        self.fp32_optimizer_states = fp32_optimizer_states

    @torch.no_grad()
    def step(self, closure=None):
        """One step over every parameter with a gradient."""
        loss = _closure(closure)
        kernels = self.kernels
        for group, p, grad in self._params_with_grads(None):
            state, step = self._advance(p, lambda p: {"exp_avg": _zeros(p)})
            beta1, beta2 = group["betas"]
            kernels.lion(
                p.detach(),
                grad,
                state["exp_avg"],
                step=step,
                lr=group["lr"],
                beta1=beta1,
                beta2=beta2,
                weight_decay=group["weight_decay"],
            )
        return loss
