"""Drop-in CPU optimizers for PyTorch trainers, on strata's SIMD kernels.

``CPUAdam`` takes ``DeepSpeedCPUAdam``'s arguments and follows its semantics
(AdamW by default; ``adamw_mode=False`` for Adam's L2 decay; ``amsgrad`` is
refused, as there), so switching is one import. One difference: moments
that have decayed below float32's smallest normal are read as zero (v only
where eps >= 1e-12), where DeepSpeed keeps multiplying them at a microcode
assist each (about ten times slower on parameters whose gradient stays
zero):

    from strata.optim import CPUAdam as DeepSpeedCPUAdam

Parameters, gradients and states are CPU tensors stepped in place, with no
copies and the GIL released; the fp32 parameter update is bit-for-bit the
same on any number of threads. ``state_dict()`` follows
``torch.optim.AdamW``'s layout (``step`` a float32 tensor; DeepSpeed's int
steps load too), so checkpoints move between the two; the live
``state[p]["step"]`` is an int, as in DeepSpeed.

``state_dtype="bf16-moments"`` keeps ``exp_avg`` and ``exp_avg_sq`` in
bfloat16 (20 bytes of memory traffic per parameter and step instead of 28,
and half the host memory for the moments), each write rounded
stochastically with random bits from a hash of (``rounding_seed``, step,
the element's index among all the optimizer's parameters): rounding to
nearest would freeze v, whose change per step with beta2 = 0.999 is below
half a bf16 ulp. The bits do not depend on the thread count or on which
parameters have gradients, so a run resumed from ``state_dict()`` with the
same ``rounding_seed`` continues bit for bit.

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

States of 2 MiB or more are allocated on transparent huge pages (where the
kernel has them, even when THP is ``madvise``-only), loaded ones included:
a step streams four arrays at once, and on 4 KiB pages each crosses a page
every 1024 parameters. For the parameters and gradients torch allocates,
``THP_MEM_ALLOC_ENABLE=1`` in the environment asks torch's allocator for
the same; with every stream on huge pages strata's step ran 1.33x
DeepSpeed's in one run on the 2-core development machine (docs/python.md).
"""

import os
import weakref

import torch

from ._strata import Kernels, LockedBuffer

__all__ = ["CPUAdam", "CPUAdagrad", "CPULion"]


class _StrataOptimizer(torch.optim.Optimizer):
    """Shared plumbing: the kernels (built lazily, rebuilt after fork),
    parameter checks, batching into one kernel call per param group and
    step, and ``state_dict()`` in torch's layout."""

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

    # The states kept in bfloat16, when the optimizer keeps some so.
    _BF16_STATES = ()

    def load_state_dict(self, state_dict):
        """torch's loader, with each state in the dtype this optimizer keeps
        it in and each large one on strata's huge pages, one at a time.

        torch's loader casts every state to its parameter's dtype, all at
        once: bf16 moments would come back as float32 (twice their size,
        for the whole model). So the states whose dtype is not the one kept
        here, and every bf16 one, are taken out of what torch loads and
        converted here: bf16 into bf16 exactly, bf16 into float32 exactly,
        float32 into bf16 rounded to nearest, once. The rest torch loads as
        they are (it keeps the caller's tensors where dtype and device
        match). A state already in the kept dtype that moves onto huge
        pages is re-pointed in place (``set_``): the caller's state dict
        sees the same values and the old memory is freed as soon as nothing
        else holds it, so such a load costs at most one state's size extra.
        A converted state is a new tensor beside the caller's."""
        saved = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        by_id = dict(zip(saved, params))
        taken, states = [], {}
        for pid, entry in state_dict["state"].items():
            p = by_id.get(pid)
            kept = {}
            for key, value in entry.items():
                if p is not None and self._state_tensor(p, key, value):
                    dtype = self._state_dtype(key)
                    if value.dtype is not dtype or dtype is torch.bfloat16:
                        taken.append((p, key, value, dtype))
                        continue
                kept[key] = value
            states[pid] = kept
        super().load_state_dict({**state_dict, "state": states})
        with torch.no_grad():
            for p, key, value, dtype in taken:
                moved = _state_like(p, dtype=dtype).copy_(value)
                if value.dtype is dtype:
                    value.set_(moved)
                    moved = value
                self.state[p][key] = moved
            for p, state in self.state.items():
                for key, value in state.items():
                    if (
                        self._state_tensor(p, key, value)
                        and _on_huge_pages(value)
                        and _HOMES.get(value.data_ptr()) is None
                    ):
                        value.set_(_state_like(p, dtype=value.dtype).copy_(value))

    @staticmethod
    def _state_tensor(p, key, value):
        """Whether ``value`` (at ``key``) is a per-element state of ``p``."""
        return (
            key != "step"
            and torch.is_tensor(value)
            and value.is_floating_point()
            and value.shape == p.shape
        )

    def _state_dtype(self, key):
        """The dtype this optimizer keeps state ``key`` in."""
        return torch.bfloat16 if key in self._BF16_STATES else torch.float32

    def __setstate__(self, state):
        super().__setstate__(state)
        for group in self.param_groups:
            for key, value in self.defaults.items():
                group.setdefault(key, value)

    def __getstate__(self):
        """torch's three entries and this optimizer's own settings (torch
        keeps only defaults, state and param_groups: a copy or an unpickled
        optimizer lost adamw_mode, state_dtype and rounding_seed); not the
        kernels, which are rebuilt on first use."""
        state = {**self.__dict__, **super().__getstate__()}
        for key in ("_kernels", "_kernels_pid"):
            state.pop(key, None)
        return state

    @property
    def kernels(self):
        """strata's kernels for this process (rebuilt in a forked child)."""
        kernels = getattr(self, "_kernels", None)
        if kernels is None or self._kernels_pid != os.getpid():
            kernels = Kernels(getattr(self, "_threads", None), getattr(self, "_pin_threads", False))
            self._kernels, self._kernels_pid = kernels, os.getpid()
        return kernels

    def _batches(self, grads, init):
        """The parameters with gradients (``p.grad``, or ``grads[i]`` in
        param_groups order), their steps advanced and their states created
        on first use from ``init(group, p)``, batched for one kernel call
        each: per param group and step number (a parameter added later, or
        skipped while it had no gradient, is at another step), in order.
        Each batch is (group, step, indices, params, grads, states).

        The live ``step`` is a Python int (as DeepSpeed keeps it): adding to
        a tensor per parameter per step cost more than the rest of the
        step's Python. ``state_dict()`` writes it as torch's float32 tensor,
        and a tensor step loaded from torch is read back as an int. This
        loop runs once per parameter per step, so it is kept lean."""
        if grads is not None:
            count = sum(len(g["params"]) for g in self.param_groups)
            if len(grads) != count:
                raise ValueError(f"grads has {len(grads)} entries for {count} parameters")
        batches = {}
        try:
            self._gather(grads, init, batches)
        except BaseException:
            _rewind(batches.values())
            raise
        return list(batches.values())

    def _gather(self, grads, init, batches):
        """_batches' loop: fills ``batches`` (kept by the caller, which puts
        the steps back if this raises half way)."""
        states = self.state
        index = -1
        for group in self.param_groups:
            for p in group["params"]:
                index += 1
                grad = p.grad if grads is None else grads[index]
                if grad is None:
                    continue
                if not p.is_cpu:
                    raise RuntimeError(
                        f"{type(self).__name__} param is on {p.device} and must be on the CPU: "
                        "offload the optimizer (DeepSpeed: zero_optimization.offload_optimizer.device = 'cpu')"
                    )
                if p.dtype is not torch.float32:
                    raise TypeError(
                        f"{type(self).__name__} steps float32 parameters, got {p.dtype}: keep fp32 "
                        "master weights on the CPU and pass their 16-bit copies to step_fused"
                    )
                state = states[p]
                if not state:
                    created = init(group, p)
                    state["step"] = 0
                    state.update(created)
                step = state["step"]
                if type(step) is not int:
                    step = int(step.item() if torch.is_tensor(step) else step)
                step += 1
                key = (id(group), step)
                batch = batches.get(key)
                if batch is None:
                    batch = batches[key] = (group, step, [], [], [], [])
                batch[2].append(index)
                # Under step's no_grad the kernels take parameters that
                # require grad as they are (a detach per tensor costs more).
                batch[3].append(p)
                batch[4].append(grad)
                # Advanced and recorded together: _rewind puts back exactly these.
                state["step"] = step
                batch[5].append(state)

    def _run(self, grads, init, call):
        """Calls ``call(group, step, indices, params, grads, states)`` for
        each of :meth:`_batches`. A kernel checks every tensor before it
        touches any, so when a call raises, the steps of that batch and of
        those not yet run are put back: a failed step leaves the optimizer
        as it found it, but for the batches it finished."""
        batches = self._batches(grads, init)
        for done, batch in enumerate(batches):
            try:
                call(*batch)
            except BaseException:
                _rewind(batches[done:])
                raise

    def state_dict(self):
        """torch.optim.AdamW's layout: each ``step`` a float32 tensor (the
        live states are not changed)."""
        packed = super().state_dict()
        packed["state"] = {
            key: {**value, "step": torch.tensor(float(value["step"]), dtype=torch.float32)}
            if "step" in value and not torch.is_tensor(value["step"])
            else value
            for key, value in packed["state"].items()
        }
        return packed

    def _first_indices(self):
        """Each parameter's first element's index among all the
        parameters, in param_groups order."""
        firsts, at = [], 0
        for group in self.param_groups:
            for p in group["params"]:
                firsts.append(at)
                at += p.numel()
        return firsts

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


def _rewind(batches):
    """Puts back the steps _batches advanced; a state back at step 0 (made
    for this step) is dropped, as if it had never been created."""
    for batch in batches:
        for state in batch[5]:
            state["step"] -= 1
            if state["step"] == 0:
                state.clear()


_HUGE_PAGE_BYTES = 2 << 20

# CPUAdam's state dtypes (the training engine's names): float32 moments, or
# bfloat16 ones rounded stochastically.
_STATE_DTYPES = ("fp32", "bf16-moments")

# The live huge-page buffers behind states, by address: an entry goes when
# its buffer is freed, so a live address is strata's and no one else's.
_HOMES = weakref.WeakValueDictionary()


def _on_huge_pages(state):
    """Whether a state of this size gets strata's memory."""
    return state.numel() * state.element_size() >= _HUGE_PAGE_BYTES


def _state_like(p, fill=0.0, dtype=torch.float32):
    """A state of ``dtype`` (float32 or bfloat16) shaped like ``p``, filled
    with ``fill``: from 2 MiB up on memory of strata's own, advised onto
    huge pages before its first touch (the tensor holds the buffer)."""
    numel = p.numel()
    size = numel * dtype.itemsize
    if size < _HUGE_PAGE_BYTES:
        return torch.full_like(p, fill, dtype=dtype, memory_format=torch.contiguous_format)
    buffer = LockedBuffer(size, lock=False)
    state = torch.frombuffer(buffer, dtype=dtype, count=numel)
    _HOMES[state.data_ptr()] = buffer
    if fill != 0.0:
        state.fill_(fill)
    return state.view(p.shape)


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
        state_dtype="fp32",
        rounding_seed=0,
    ):
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            bias_correction=bias_correction,
            amsgrad=amsgrad,
        )
        if state_dtype not in _STATE_DTYPES:
            raise ValueError(
                f"state_dtype={state_dtype!r}: use one of {', '.join(map(repr, _STATE_DTYPES))} "
                "(bf16 master weights are the training engine's: CPUAdam steps float32 parameters)"
            )
        if type(rounding_seed) is not int or not 0 <= rounding_seed < 1 << 64:
            raise ValueError(f"rounding_seed={rounding_seed!r}: use an int from 0 to 2**64 - 1")
        super().__init__(model_params, defaults, threads, pin_threads)
        self.adam_w_mode = adamw_mode
        # fp32 parameters keep fp32 states unless state_dtype says otherwise
        # (DeepSpeed keeps them fp32 either way).
        self.fp32_optimizer_states = fp32_optimizer_states
        self.state_dtype = state_dtype
        self.rounding_seed = rounding_seed
        self._BF16_STATES = ("exp_avg", "exp_avg_sq") if state_dtype == "bf16-moments" else ()

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
        dtype = torch.bfloat16 if self._BF16_STATES else torch.float32
        # bf16 moments' random bits are keyed by each element's index among
        # all the parameters: the same whichever have gradients this step.
        firsts = self._first_indices() if self._BF16_STATES else None

        def init(group, p):
            return {"exp_avg": _state_like(p, dtype=dtype), "exp_avg_sq": _state_like(p, dtype=dtype)}

        def adam(group, step, indices, params, grads, states):
            beta1, beta2 = group["betas"]
            kernels.adam(
                params,
                grads,
                [s["exp_avg"] for s in states],
                [s["exp_avg_sq"] for s in states],
                step=step,
                lr=group["lr"],
                beta1=beta1,
                beta2=beta2,
                eps=group["eps"],
                weight_decay=group["weight_decay"],
                adamw_mode=self.adam_w_mode,
                bias_correction=group["bias_correction"],
                grad_scale=grad_scale,
                param_copy=None if copies is None else [copies[i] for i in indices],
                rounding_seed=self.rounding_seed,
                first=None if firsts is None else [firsts[i] for i in indices],
            )

        self._run(grads, init, adam)


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

        def init(group, p):
            initial = group["initial_accumulator_value"]
            return {"sum": _state_like(p, initial)}

        def adagrad(group, step, indices, params, grads, states):
            kernels.adagrad(
                params,
                grads,
                [s["sum"] for s in states],
                step=step,
                lr=group["lr"],
                eps=group["eps"],
                weight_decay=group["weight_decay"],
                lr_decay=group["lr_decay"],
            )

        self._run(None, init, adagrad)
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
        def lion(group, step, indices, params, grads, states):
            beta1, beta2 = group["betas"]
            kernels.lion(
                params,
                grads,
                [s["exp_avg"] for s in states],
                step=step,
                lr=group["lr"],
                beta1=beta1,
                beta2=beta2,
                weight_decay=group["weight_decay"],
            )

        self._run(None, lambda group, p: {"exp_avg": _state_like(p)}, lion)
        return loss
