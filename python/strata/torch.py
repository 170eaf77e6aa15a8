"""strata beneath a PyTorch training loop: ``AdamW`` with the fp32 master
weights and both moments kept by strata, in page-locked host memory
(``states="cpu"``) or on NVMe (``states="nvme"``: io_uring, checksummed,
the swap files locked to this process), and updated on the CPU by a strata
thread while the loop goes on.

    import strata.torch
    opt = strata.torch.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1,
                             states="nvme", nvme_path="/nvme/run1")
    for batch in loader:
        loss = model(batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()          # returns at once; the update runs behind
        sched.step()
        opt.zero_grad()

After construction every managed parameter holds its compute dtype
(``compute_dtype``, bf16 by default) and nothing else: the fp32 values live
only in strata's memory or on its drive. ``step()`` reads each gradient as
it is then, after whatever the loop did to it (``clip_grad_norm_``,
``GradScaler``'s unscaling, gradient accumulation over micro-batches), so
the update is exactly the clipped one; it queues one update per parameter
and returns. The update of a parameter is *deferred*: it runs while the
loop goes on (the scheduler, ``zero_grad``, the next batch, the forward of
the modules before it) and lands before its module's next forward (a
forward pre-hook on every module waits for the parameters it owns, and
copies them to the GPU for a GPU parameter). Code that reads a parameter
outside its own module's forward before then calls ``synchronize()``. The
updates run in the order the last forward used the parameters (learned
at each step's first forward; param_groups order before any), so the
first modules' parameters are ready first even when decay and no-decay
groups interleave them; on NVMe the states are read ahead in that order.

An overflow under ``torch.amp.GradScaler`` skips the step (the optimizer
takes the scaler's ``found_inf`` and ``grad_scale``, unscaling inside the
update; fp16 gradients work there too). LR schedulers work through
``param_groups`` (``lr`` and ``weight_decay`` are read at each step).
``zero_grad(set_to_none=True)`` (torch's default) does not wait; with
``set_to_none=False`` it waits for the updates that read the gradients.

A CPU parameter computed in fp32 (``compute_dtype=torch.float32``) is its
own master: it is updated in place, and strata keeps its moments only.

``state_dict()`` follows ``torch.optim.AdamW``'s layout, each parameter's
entry with a ``master`` (the fp32 weights) beside ``exp_avg`` and
``exp_avg_sq``; ``load_state_dict`` takes it back, and a state dict of
``torch.optim.AdamW`` (no ``master``: the parameters' own values) loads
too.

DTensor parameters (FSDP2's ``fully_shard``, DTensor tensor parallelism)
are managed by their local shards: each rank keeps the states of what it
owns, and collectives stay torch.distributed's (``clip_grad_norm_`` over
DTensor gradients included). FSDP2's pre-forward hook all-gathers a whole
group, so an FSDP2 module waits for the updates of every parameter of its
group. Their dtype is FSDP2's: convert the model to the compute dtype
before ``fully_shard`` (the fp32 masters are then that dtype's values,
widened), or pass ``compute_dtype`` equal to it. A Partial placement, a
sparse, complex or integer parameter and a group spread over several
devices are refused by name.
"""

import os
import sys
import weakref

import torch

from ._strata import OffloadStates

__all__ = ["AdamW"]

# The optimizers whose parameters the forward pre-hook settles.
_LIVE = weakref.WeakSet()
_HOOK = []


def _settle_before_forward(module, args):
    for opt in list(_LIVE):
        opt._settle_module(module)


def _install_hook():
    if not _HOOK:
        _HOOK.append(torch.nn.modules.module.register_module_forward_pre_hook(_settle_before_forward))


_KINDS = {"cpu", "nvme"}
_MOMENTS = {"fp32": "fp32", "bf16": "bf16", "bf16-moments": "bf16"}


def _mib(nbytes):
    return f"{nbytes / (1 << 20):.1f} MiB"


def _available_host_bytes():
    """MemAvailable, or None where /proc/meminfo does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class AdamW(torch.optim.Optimizer):
    """AdamW with master weights and moments in strata's memory or on NVMe
    (see the module docstring).

    ``states``: "cpu" or "nvme" (then ``nvme_path``, a directory on the
    drive; ``nvme_capacity`` bytes, default what the states need).
    ``moments``: "fp32" or "bf16" (stochastically rounded, as
    ``strata.optim.CPUAdam``'s ``bf16-moments``). ``compute_dtype``: what
    the parameters hold (bf16, fp16, or fp32 for a run that compares
    bit-for-bit with fp32 training). ``threads``: the update's threads
    (None: one per physical core). ``host_budget``: bytes of host memory
    the optimizer may pin (default: what the machine has available).
    ``lock_wait_s``: how long to wait for the lock of an ``nvme_path``
    whose holder has exited (a live holder, this process's other
    optimizers and ``strata train`` included, is refused at once: one run
    per directory). ``verbose``: print the plan to stderr at start.
    """

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=1e-2,
        *,
        states="cpu",
        nvme_path=None,
        nvme_capacity=None,
        compute_dtype=torch.bfloat16,
        moments="fp32",
        threads=None,
        staging=4,
        rounding_seed=0,
        host_budget=None,
        lock_wait_s=10.0,
        verbose=True,
    ):
        if states not in _KINDS:
            raise ValueError(f'states = {states!r}: use "cpu" (pinned host memory) or "nvme"')
        if moments not in _MOMENTS:
            raise ValueError(f'moments = {moments!r}: use "fp32" or "bf16"')
        if compute_dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"compute_dtype = {compute_dtype}: use torch.bfloat16, torch.float16 or torch.float32")
        if not 0.0 <= lr:
            raise ValueError(f"lr = {lr}: use a learning rate of 0 or more")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"betas = {betas}: each must be in [0, 1)")
        if not 0.0 <= eps:
            raise ValueError(f"eps = {eps}: use 0 or more")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self._building = True
        super().__init__(params, defaults)
        self._building = False
        self._compute_dtype = compute_dtype
        self._rounding_seed = int(rounding_seed)
        self._params = [p for g in self.param_groups for p in g["params"]]
        self._slot = {p: i for i, p in enumerate(self._params)}
        if len(self._slot) != len(self._params):
            raise ValueError("a parameter appears more than once in the param groups: give each once")
        for gi, group in enumerate(self.param_groups):
            devices = {p.device for p in group["params"]}
            if len(devices) > 1:
                raise ValueError(
                    f"param_groups[{gi}] spans several devices ({', '.join(sorted(map(str, devices)))}): "
                    "give each device its own group or optimizer"
                )
            for i, p in enumerate(group["params"]):
                _check_param(p, _param_name(group, gi, i))
        for gi, group in enumerate(self.param_groups):
            for i, p in enumerate(group["params"]):
                if _is_dtensor(p) and p.dtype != compute_dtype:
                    raise TypeError(
                        f"{_param_name(group, gi, i)} {tuple(p.shape)} is a {p.dtype} DTensor and "
                        f"compute_dtype is {compute_dtype}: strata cannot change the dtype of FSDP2's shards; "
                        f"convert the model (model.to({compute_dtype})) before fully_shard, or pass "
                        f"compute_dtype={p.dtype}"
                    )
        self._locals = [_local(p) for p in self._params]
        elems = [t.numel() for t in self._locals]
        dirs = None
        if states == "nvme":
            if nvme_path is None:
                raise ValueError('states="nvme" needs nvme_path: a directory on the drive that holds the states')
            dirs = [os.fspath(nvme_path)]
        pinned_extra = sum(
            n * (compute_dtype.itemsize + 4) for t, n in zip(self._locals, elems) if t.device.type != "cpu"
        )
        # A CPU parameter computed in fp32 is its own master: updated in place.
        in_place = [
            t.device.type == "cpu" and t.dtype == torch.float32 and compute_dtype == torch.float32
            for t in self._locals
        ]
        moment_bytes = 2 * (4 if _MOMENTS[moments] == "fp32" else 2)
        state_bytes = sum(n * (moment_bytes + (0 if inplace else 4)) for n, inplace in zip(elems, in_place))
        host_need = (state_bytes if states == "cpu" else 0) + pinned_extra
        budget = host_budget if host_budget is not None else _available_host_bytes()
        if budget is not None and host_need > budget:
            where = "host_budget" if host_budget is not None else "available host memory (MemAvailable)"
            raise MemoryError(
                f"strata.torch.AdamW needs {_mib(host_need)} of host memory "
                f"({_mib(state_bytes if states == 'cpu' else 0)} of states, {_mib(pinned_extra)} of pinned "
                f"transfer buffers) but the {where} is {_mib(budget)}: "
                'use states="nvme", moments="bf16", or a larger budget'
            )
        self._states = OffloadStates(
            elems,
            tier=states,
            moments=_MOMENTS[moments],
            nvme_dirs=dirs,
            nvme_capacity=nvme_capacity,
            staging=staging,
            threads=threads,
            lock_wait_s=lock_wait_s,
            in_place=in_place,
        )
        self._in_place = in_place
        self._dirty = [False] * len(self._params)
        self._module_slots = weakref.WeakKeyDictionary()
        # The order the last forward used the parameters in (learned at each
        # step's first forward): the next updates run in it, so the first
        # modules' parameters are ready first whatever the param groups.
        self._group_of = [gi for gi, g in enumerate(self.param_groups) for _ in g["params"]]
        self._order = list(range(len(self._params)))
        self._seen = bytearray(len(self._params))
        self._heard = []
        self._host_out = [None] * len(self._params)
        self._host_grad = [None] * len(self._params)
        with torch.no_grad():
            for slot, p in enumerate(self._params):
                self._take(slot, p)
            self._locals = [_local(p) for p in self._params]
        _LIVE.add(self)
        _install_hook()
        weakref.finalize(self, _close_quietly, self._states)
        if verbose:
            print(self.plan(), file=sys.stderr)

    # -- construction -------------------------------------------------------------

    def add_param_group(self, param_group):
        if not getattr(self, "_building", False):
            raise RuntimeError(
                "strata.torch.AdamW: parameters are placed at construction; build a new optimizer "
                "with every group instead of add_param_group"
            )
        super().add_param_group(param_group)

    def _take(self, slot, p):
        """Moves ``p``'s fp32 values into strata and leaves ``p`` holding its
        compute dtype only (a DTensor's local shard, which already does)."""
        source = _local(p).detach()
        if source.device.type != "cpu" or not source.is_contiguous():
            source = source.to("cpu", torch.float32).contiguous()
        elif source.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            source = source.float()
        self._states.load(slot, source.reshape(-1))
        del source
        if not _is_dtensor(p) and (p.dtype != self._compute_dtype or not p.is_contiguous()):
            p.data = p.detach().to(self._compute_dtype, memory_format=torch.contiguous_format)
        if _local(p).device.type != "cpu":
            self._host_out[slot] = torch.empty(p.numel(), dtype=self._compute_dtype, pin_memory=True)

    def plan(self):
        """One line: parameters, where the states are, host memory pinned."""
        n = sum(t.numel() for t in self._locals)
        s = self._states
        locked = "page-locked" if s.host_locked else "NOT page-locked (the memlock limit refused; raise ulimit -l)"
        where = (
            f"states in {locked} host memory ({_mib(s.host_bytes)})"
            if s.tier == "cpu"
            else f"states on NVMe ({_mib(s.nvme_bytes)} preallocated), {_mib(s.staging_bytes)} of "
            f"{locked} staging buffers"
        )
        devices = ", ".join(sorted({str(t.device) for t in self._locals})) or "no device"
        shards = sum(map(_is_dtensor, self._params))
        return (
            f"strata.torch.AdamW: {len(self._params)} tensors ({shards} DTensor shards), "
            f"{n / 1e6:.1f}M parameters here; {where}; "
            f"parameters in {str(self._compute_dtype).removeprefix('torch.')} on {devices}; "
            f"updates on {s.threads} thread(s)"
        )

    # -- the step -----------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        found_inf = getattr(self, "found_inf", None)
        if found_inf is not None and float(found_inf) > 0:
            return loss
        scale = getattr(self, "grad_scale", None)
        grad_scale = 1.0 if scale is None else 1.0 / float(scale)
        if self._heard:
            unseen = [slot for slot in range(len(self._params)) if not self._seen[slot]]
            self._order = self._heard + unseen
            self._heard = []
            self._seen = bytearray(len(self._params))
        for slot in self._order:
            p = self._params[slot]
            group = self.param_groups[self._group_of[slot]]
            beta1, beta2 = group["betas"]
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError("strata.torch.AdamW does not take sparse gradients")
            grad = self._grad_for(slot, p)
            state = self.state[p]
            state["step"] = state.get("step", 0) + 1
            local = self._locals[slot]
            out = self._host_out[slot] if local.device.type != "cpu" else local.detach().view(-1)
            self._states.submit(
                slot,
                grad,
                out,
                step=state["step"],
                lr=float(group["lr"]),
                beta1=float(beta1),
                beta2=float(beta2),
                eps=float(group["eps"]),
                weight_decay=float(group["weight_decay"]),
                grad_scale=grad_scale,
                rounding_seed=self._rounding_seed,
            )
            self._dirty[slot] = True
        return loss

    _step_supports_amp_scaling = True

    def _grad_for(self, slot, p):
        """The gradient as the update reads it: the tensor itself on the
        CPU; on a GPU, a page-locked copy (the previous update of this
        parameter, which read the copy, is finished by now)."""
        grad = _local(p.grad)
        if grad.device.type == "cpu":
            return grad.reshape(-1) if grad.is_contiguous() else grad.contiguous().reshape(-1)
        self._states.wait(slot)
        host = self._host_grad[slot]
        if host is None or host.dtype != grad.dtype:
            host = torch.empty(grad.numel(), dtype=grad.dtype, pin_memory=True)
            self._host_grad[slot] = host
        host.copy_(grad.reshape(-1))
        return host

    def _settle(self, slot):
        """Waits for ``slot``'s update and puts it into its parameter."""
        if not self._dirty[slot]:
            return
        self._states.wait(slot)
        local = self._locals[slot]
        if local.device.type != "cpu":
            with torch.no_grad():
                local.view(-1).copy_(self._host_out[slot], non_blocking=True)
        self._dirty[slot] = False

    def _settle_module(self, module):
        slots = self._module_slots.get(module)
        if slots is None:
            slots = [self._slot[p] for p in _owned(module) if p in self._slot]
            self._module_slots[module] = slots
        for slot in slots:
            if not self._seen[slot]:
                self._seen[slot] = 1
                self._heard.append(slot)
            if self._dirty[slot]:
                self._settle(slot)

    def synchronize(self):
        """Waits for every queued update and puts each into its parameter."""
        for slot in range(len(self._params)):
            self._settle(slot)
        self._states.wait_all()

    def zero_grad(self, set_to_none=True):
        if not set_to_none:
            self.synchronize()
        super().zero_grad(set_to_none=set_to_none)

    # -- checkpoints -----------------------------------------------------------------

    def state_dict(self):
        """torch.optim.AdamW's layout, each entry with ``master`` (fp32).
        A DTensor parameter's states are DTensors of its mesh and
        placements over this rank's shard, so that
        torch.distributed.checkpoint (``get_optimizer_state_dict``,
        ``dcp.save``) saves them sharded and loads them at another world
        size."""
        self.synchronize()
        packed = super().state_dict()
        for slot, p in enumerate(self._params):
            entry = packed["state"].get(slot)
            if entry is None:
                continue
            # torch's packing shares each entry with the live state: copy it.
            entry = packed["state"][slot] = dict(entry)
            master, m, v = (torch.empty(self._locals[slot].shape, dtype=torch.float32) for _ in range(3))
            self._states.read(slot, master.view(-1), m.view(-1), v.view(-1))
            if self._in_place[slot]:
                master.copy_(self._locals[slot])
            entry.update(
                step=torch.tensor(float(entry["step"]), dtype=torch.float32),
                exp_avg=_like(p, m),
                exp_avg_sq=_like(p, v),
                master=_like(p, master),
            )
        return packed

    def load_state_dict(self, state_dict):
        """A state dict of this optimizer or of ``torch.optim.AdamW``."""
        self.synchronize()
        saved = [i for g in state_dict["param_groups"] for i in g["params"]]
        if len(saved) != len(self._params):
            raise ValueError(
                f"the state dict has {len(saved)} parameters and this optimizer {len(self._params)}: "
                "load a state dict of the same model and param groups"
            )
        for group, saved_group in zip(self.param_groups, state_dict["param_groups"]):
            if len(group["params"]) != len(saved_group["params"]):
                raise ValueError("the state dict's param groups differ in size from this optimizer's")
            for key, value in saved_group.items():
                if key != "params":
                    group[key] = value
        self.state.clear()
        with torch.no_grad():
            for slot, (key, p) in enumerate(zip(saved, self._params)):
                entry = state_dict["state"].get(key)
                local = self._locals[slot]
                if entry is None:
                    self._states.load(slot, local.detach().to("cpu", torch.float32).reshape(-1))
                    continue
                tensors = [entry.get("master", local.detach()), entry["exp_avg"], entry["exp_avg_sq"]]
                tensors = [_local(t) for t in tensors]
                for name, t in zip(("master", "exp_avg", "exp_avg_sq"), tensors):
                    if tuple(t.shape) != tuple(local.shape):
                        raise ValueError(
                            f"parameter {slot}: {name} has shape {tuple(t.shape)}, "
                            f"the parameter here {tuple(local.shape)}"
                        )
                flat = [t.to("cpu", torch.float32).contiguous().reshape(-1) for t in tensors]
                self._states.load(slot, *flat)
                local.copy_(flat[0].to(local.device, self._compute_dtype).view_as(local))
                step = entry["step"]
                self.state[p]["step"] = int(step.item() if torch.is_tensor(step) else step)

    def close(self):
        """Finishes the queued updates and stops the update thread."""
        self.synchronize()
        _LIVE.discard(self)
        self._states.close()


def _close_quietly(states):
    """Stops the update thread of a collected optimizer; an error was
    raised to the loop already."""
    try:
        states.close()
    except RuntimeError:
        pass


def _param_name(group, gi, i):
    names = group.get("param_names")
    if names is not None and i < len(names):
        return f"parameter {names[i]!r}"
    return f"param_groups[{gi}] parameter {i}"


def _is_dtensor(t):
    return hasattr(t, "_local_tensor") and hasattr(t, "placements")


def _local(t):
    """A DTensor's local shard (the memory it owns here); a tensor itself."""
    return t._local_tensor if _is_dtensor(t) else t


def _like(p, local):
    """``local`` (this rank's shard of a state) as ``p`` is: a DTensor of
    ``p``'s mesh and placements when ``p`` is one."""
    if not _is_dtensor(p):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
    )


def _fsdp_module_type():
    try:
        from torch.distributed.fsdp import FSDPModule

        return FSDPModule
    except ImportError:
        return None


def _owned(module):
    """The parameters whose update must land before ``module``'s forward:
    its own, and for an FSDP2 module (whose pre-forward hook all-gathers
    its whole group) those of its submodules up to the next FSDP2 module."""
    fsdp = _fsdp_module_type()
    owned = [p for p in module._parameters.values() if p is not None]
    if fsdp is None or not isinstance(module, fsdp):
        return owned
    stack = list(module.children())
    while stack:
        child = stack.pop()
        if isinstance(child, fsdp):
            continue
        owned += [p for p in child._parameters.values() if p is not None]
        stack += list(child.children())
    return owned


def _check_param(p, name):
    """Refuses, by name and reason, a parameter strata cannot manage."""
    shape = tuple(p.shape)
    if _is_dtensor(p):
        for placement in p.placements:
            if placement.is_partial():
                raise TypeError(
                    f"{name} {shape} is a DTensor with a Partial placement ({placement}): its local "
                    "values are not the parameter's; redistribute it to Shard or Replicate first"
                )
        p = p._local_tensor
        if not p.is_contiguous():
            raise TypeError(
                f"{name} {shape} is a DTensor whose local shard is not contiguous: strata writes "
                "updates into the shard's memory; shard it along its first dimension"
            )
    if p.layout != torch.strided:
        raise TypeError(f"{name} {shape} has layout {p.layout}: strata manages dense (strided) parameters only")
    if p.is_complex():
        raise TypeError(f"{name} {shape} is complex ({p.dtype}): strata's AdamW is real-valued")
    if not p.is_floating_point():
        raise TypeError(f"{name} {shape} has dtype {p.dtype}: only floating-point parameters are optimized")
    if p.device.type == "meta":
        raise TypeError(f"{name} {shape} is on the meta device: materialize the model first")
    if p.device.type not in ("cpu", "cuda"):
        raise TypeError(f"{name} {shape} is on {p.device}: strata manages CPU and CUDA parameters")
