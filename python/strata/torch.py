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
too. The entries are strata's states themselves, read when an op needs
them: torch.distributed.checkpoint writes them one tensor at a time and
its load writes into them chunk by chunk, so states on NVMe are never all
in RAM. Like torch's they are live; an entry taken before a later step is
refused when read or loaded (``copy.deepcopy`` keeps a snapshot), and an
in-place op other than ``copy_`` on one is refused rather than lost.

A ``torch.compile``d module (``torch.compile(module)`` or
``module.compile()``) trains as the eager one: the hook runs outside the
graph, a graph break before each module. The update uses no autograd hook,
so compiled autograd changes nothing. Parameters replaced in the param
groups before the first step (accelerate's ``prepare`` under FSDP2 swaps
each for its sharded DTensor) are followed: the optimizer places the new
ones at the next step; after a step or a load that is refused by name.

DTensor parameters (FSDP2's ``fully_shard``, DTensor tensor parallelism)
are managed by their local shards: each rank keeps the states of what it
owns, and collectives stay torch.distributed's (``clip_grad_norm_`` over
DTensor gradients included). FSDP2's pre-forward hook all-gathers a whole
group, so an FSDP2 module waits for the updates of every parameter of its
group and of the groups it prefetches (``set_modules_to_forward_prefetch``);
code that unshards a module itself (``module.unshard()``) calls
``synchronize()`` first. Their dtype is FSDP2's: convert the model to the compute dtype
before ``fully_shard`` (the fp32 masters are then that dtype's values,
widened), or pass ``compute_dtype`` equal to it. A Partial placement, a
sparse, complex or integer parameter and a group spread over several
devices are refused by name.
"""

import functools
import os
import sys
import weakref

import torch

from ._strata import OffloadStates

__all__ = ["AdamW"]

# The optimizers whose parameters the forward pre-hook settles.
_LIVE = weakref.WeakSet()
_HOOK = []


# Under torch.compile the hook runs eagerly, outside the graph (a graph
# break before each module's forward): it waits on strata's threads, which
# no graph can hold.
@torch.compiler.disable
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
        self._placement = dict(
            states=states, nvme_path=nvme_path, nvme_capacity=nvme_capacity, moments=moments, threads=threads,
            staging=staging, host_budget=host_budget, lock_wait_s=lock_wait_s, verbose=verbose,
        )
        self._place(**self._placement)

    # -- construction -------------------------------------------------------------

    def _place(self, *, states, nvme_path, nvme_capacity, moments, threads, staging, host_budget, lock_wait_s, verbose):
        """Checks the param_groups' parameters and moves their values into
        strata (a new store, and a new lock on ``nvme_path``)."""
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
                if _is_dtensor(p) and p.dtype != self._compute_dtype:
                    raise TypeError(
                        f"{_param_name(group, gi, i)} {tuple(p.shape)} is a {p.dtype} DTensor and "
                        f"compute_dtype is {self._compute_dtype}: strata cannot change the dtype of FSDP2's shards; "
                        f"convert the model (model.to({self._compute_dtype})) before fully_shard, or pass "
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
            n * (self._compute_dtype.itemsize + 4) for t, n in zip(self._locals, elems) if t.device.type != "cpu"
        )
        # A CPU parameter computed in fp32 is its own master: updated in place.
        in_place = [
            t.device.type == "cpu" and t.dtype == torch.float32 and self._compute_dtype == torch.float32
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
        self._states = _Pieces(
            elems,
            in_place,
            lambda pieces, piece_in_place: OffloadStates(
                pieces,
                tier=states,
                moments=_MOMENTS[moments],
                nvme_dirs=dirs,
                nvme_capacity=nvme_capacity,
                staging=staging,
                threads=threads,
                lock_wait_s=lock_wait_s,
                in_place=piece_in_place,
            ),
        )
        self._in_place = in_place
        self._changes = [0] * len(self._params)
        self._moments = _MOMENTS[moments]
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
        self._finalizer = weakref.finalize(self, _close_quietly, self._states)
        if verbose:
            print(self.plan(), file=sys.stderr)

    def _follow_swapped_params(self):
        """Places the param_groups' parameters anew when something replaced
        them after construction (accelerate's ``prepare`` under FSDP2 swaps
        each for its sharded DTensor): before any step or load the states
        are the parameters' values and zero moments, so the new ones are
        taken as they are. After one, swapping is refused by name."""
        current = [p for g in self.param_groups for p in g["params"]]
        if len(current) == len(self._params) and all(a is b for a, b in zip(current, self._params)):
            return
        if any(self._changes) or self.state:
            raise RuntimeError(
                "strata.torch.AdamW: the param_groups' parameters were replaced after the optimizer stepped "
                "or loaded states, whose values would not follow them: replace them before the first step "
                "(accelerate's prepare does), or build the optimizer over the new parameters"
            )
        self._states.wait_all()
        _LIVE.discard(self)
        # The old store goes first (its files closed, the nvme_path's lock
        # released): the finalizer closes it and drops the last reference.
        self._finalizer()
        self._states = None
        self._place(**self._placement)

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
        self._follow_swapped_params()
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
            self._changes[slot] += 1
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
        # Cached per module, anew when its forward prefetching changes.
        prefetch = tuple(map(id, _forward_prefetched(module)))
        cached = self._module_slots.get(module)
        if cached is None or cached[0] != prefetch:
            cached = (prefetch, [self._slot[p] for p in _owned(module) if p in self._slot])
            self._module_slots[module] = cached
        slots = cached[1]
        for slot in slots:
            if not self._seen[slot]:
                self._seen[slot] = 1
                self._heard.append(slot)
            if self._dirty[slot]:
                self._settle(slot)

    def synchronize(self):
        """Waits for every queued update and puts each into its parameter."""
        self._follow_swapped_params()
        self._settle_all()

    def _settle_all(self):
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
        The states are strata's own, read when used (see ``_Stored``): a
        checkpoint writes them one at a time, and torch.distributed.checkpoint's
        load writes into them in place, so neither holds every state in RAM.
        Like torch's, the entries are live: a later step changes them. A
        DTensor parameter's states are DTensors of its mesh and placements
        over this rank's shard, so that torch.distributed.checkpoint
        (``get_optimizer_state_dict``, ``dcp.save``) saves them sharded and
        loads them at another world size. Moments kept in bf16 are bf16."""
        self.synchronize()
        packed = super().state_dict()
        moment_dtype = torch.float32 if self._moments == "fp32" else torch.bfloat16
        for slot, p in enumerate(self._params):
            entry = packed["state"].get(slot)
            if entry is None:
                continue
            # torch's packing shares each entry with the live state: copy it.
            entry = packed["state"][slot] = dict(entry)
            shape = self._locals[slot].shape
            if self._in_place[slot]:
                master = self._locals[slot].detach().clone()
            else:
                master = _Stored(self._states, slot, "master", torch.float32, shape, self._changes)
            entry.update(
                step=torch.tensor(float(entry["step"]), dtype=torch.float32),
                exp_avg=_like(p, _Stored(self._states, slot, "exp_avg", moment_dtype, shape, self._changes)),
                exp_avg_sq=_like(
                    p, _Stored(self._states, slot, "exp_avg_sq", moment_dtype, shape, self._changes)
                ),
                master=_like(p, master),
            )
        return packed

    def load_state_dict(self, state_dict):
        """A state dict of this optimizer or of ``torch.optim.AdamW``, one
        parameter at a time. This optimizer's own entries (a state dict it
        returned, loaded in place by torch.distributed.checkpoint) are not
        copied: the parameters take their masters' values."""
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
        names = ("master", "exp_avg", "exp_avg_sq")
        with torch.no_grad():
            for slot, (key, p) in enumerate(zip(saved, self._params)):
                entry = state_dict["state"].get(key)
                local = self._locals[slot]
                if entry is None:
                    self._states.load(slot, local.detach().to("cpu", torch.float32).reshape(-1))
                    self._changes[slot] += 1
                    continue
                tensors = [entry.get("master", local.detach()), entry["exp_avg"], entry["exp_avg_sq"]]
                tensors = [_local(t) for t in tensors]
                for name, t in zip(names, tensors):
                    if tuple(t.shape) != tuple(local.shape):
                        raise ValueError(
                            f"parameter {slot}: {name} has shape {tuple(t.shape)}, "
                            f"the parameter here {tuple(local.shape)}"
                        )
                own = [_own(t, self._states, slot, name, local.numel()) for name, t in zip(names, tensors)]
                if all(own[1:]) and (own[0] or self._in_place[slot]):
                    for t in tensors:
                        if isinstance(t, _Stored):
                            t._check_current()
                    master = tensors[0]._values() if own[0] else tensors[0]
                    local.copy_(master.to(local.device, self._compute_dtype).view_as(local))
                else:
                    flat = [t.to("cpu", torch.float32).contiguous().reshape(-1) for t in tensors]
                    self._states.load(slot, *flat)
                    self._changes[slot] += 1
                    local.copy_(flat[0].to(local.device, self._compute_dtype).view_as(local))
                    del flat
                step = entry["step"]
                self.state[p]["step"] = int(step.item() if torch.is_tensor(step) else step)

    def close(self):
        """Finishes the queued updates and stops the update thread."""
        self._settle_all()
        _LIVE.discard(self)
        self._states.close()


# Most elements of one strata slot: a larger parameter (an embedding's
# shard) is kept as several, so a staging buffer for NVMe states holds
# this many elements' states (128 MiB with bf16 moments, 192 MiB with fp32)
# whatever the model's largest tensor, and its update pipelines with the
# drive piece by piece.
PIECE_ELEMS = 1 << 24


class _Pieces:
    """``OffloadStates`` by parameter: each parameter's flat states as
    slots of at most ``PIECE_ELEMS`` elements (``pieces[slot]``: the
    strata slot, first and last element of each). The same calls as
    ``OffloadStates`` with a parameter's index, over whole parameters or
    element ranges of them."""

    def __init__(self, elems, in_place, make):
        self.pieces, sizes, flags = [], [], []
        for n, flag in zip(elems, in_place):
            ranges = []
            for start in range(0, max(n, 1), PIECE_ELEMS):
                stop = min(n, start + PIECE_ELEMS)
                ranges.append((len(sizes), start, stop))
                sizes.append(stop - start)
                flags.append(flag)
            self.pieces.append(ranges)
        self.inner = make(sizes, flags)

    def __getattr__(self, name):
        # tier, host_bytes, staging_bytes, nvme_bytes, threads, host_locked,
        # wait_all, close.
        return getattr(self.inner, name)

    def load(self, slot, master, exp_avg=None, exp_avg_sq=None):
        for k, a, b in self.pieces[slot]:
            self.inner.load(
                k,
                master[a:b],
                None if exp_avg is None else exp_avg[a:b],
                None if exp_avg_sq is None else exp_avg_sq[a:b],
            )

    def _spans(self, slot, offset, count):
        """(strata slot, offset in it, first and last element of the
        range) for each piece the range ``offset..offset + count`` meets."""
        end = offset + count
        for k, a, b in self.pieces[slot]:
            lo, hi = max(a, offset), min(b, end)
            if lo < hi:
                yield k, lo - a, lo - offset, hi - offset

    def read_range(self, slot, state, out, offset=0):
        for k, at, lo, hi in self._spans(slot, offset, out.numel()):
            self.inner.read_range(k, state, out[lo:hi], at)

    def write_range(self, slot, state, src, offset=0):
        for k, at, lo, hi in self._spans(slot, offset, src.numel()):
            self.inner.write_range(k, state, src[lo:hi], at)

    def submit(self, slot, grad, out, **kw):
        for k, a, b in self.pieces[slot]:
            self.inner.submit(k, grad[a:b], None if out is None else out[a:b], **kw)

    def wait(self, slot):
        for k, _, _ in self.pieces[slot]:
            self.inner.wait(k)

    def busy(self, slot):
        return any(self.inner.busy(k) for k, _, _ in self.pieces[slot])


_aten = torch.ops.aten
# Ops that give a new name to the same values: a stored state answers them
# without reading.
_ALIASES = {_aten.detach.default, _aten.alias.default, _aten.lift_fresh.default}
_VIEWS = {_aten.view.default, _aten._unsafe_view.default, _aten.reshape.default}


class _Stored(torch.Tensor):
    """One state of one parameter as strata keeps it (``master``,
    ``exp_avg`` or ``exp_avg_sq``, in its pinned memory or on NVMe), or a
    strided window of it: the entry ``state_dict()`` returns. Nothing is
    read until an op needs the values, and then only this window, so that
    torch.distributed.checkpoint, which writes one tensor at a time, never
    holds the optimizer's states in RAM at once. ``copy_`` into it (what a
    checkpoint load does, chunk by chunk) writes through to strata; any
    other in-place op is refused rather than lost. ``torch.save`` and
    ``copy.deepcopy`` take its values."""

    @staticmethod
    def __new__(cls, states, slot, state, dtype, size, changes, stride=None, offset=0):
        stride = tuple(stride) if stride is not None else _contiguous_stride(size)
        t = torch.Tensor._make_wrapper_subclass(cls, size, strides=stride, dtype=dtype, device="cpu")
        t._where = (states, slot, state)
        t._offset = offset
        # The optimizer's count of changes to each slot, and this slot's
        # when the entry was made: an entry the states have moved past is
        # refused rather than read or loaded as if it were current.
        t._changes = changes
        t._taken_at = changes[slot]
        return t

    def __init__(self, *args, **kwargs):
        pass

    __torch_function__ = torch._C._disabled_torch_function_impl

    def _window(self, size, stride, offset):
        states, slot, state = self._where
        t = _Stored(states, slot, state, self.dtype, size, self._changes, stride, offset)
        t._taken_at = self._taken_at
        return t

    def _check_current(self):
        states, slot, state = self._where
        if self._changes[slot] != self._taken_at:
            raise RuntimeError(
                f"this {state} of parameter {slot} is from a state_dict() taken before the optimizer "
                f"changed that parameter's states ({self._changes[slot] - self._taken_at} update(s) or "
                "loads since): strata's entries are live, like torch's; save a state dict before the "
                "next step, or keep a copy (copy.deepcopy(opt.state_dict())) to load later"
            )

    def _span(self):
        """The elements of the state that the window covers: offset, count."""
        if self.numel() == 0:
            return self._offset, 0
        return self._offset, 1 + sum((n - 1) * s for n, s in zip(self.shape, self.stride()))

    def _values(self):
        """A plain tensor with the window's values, read from strata."""
        self._check_current()
        states, slot, state = self._where
        start, count = self._span()
        flat = torch.empty(count, dtype=self.dtype)
        if count:
            states.read_range(slot, state, flat, start)
        return flat.as_strided(self.shape, self.stride())

    def _store(self, src):
        """Writes ``src`` (broadcast to the window) through to strata."""
        self._check_current()
        states, slot, state = self._where
        src = src.to(self.dtype).expand(self.shape)
        start, count = self._span()
        if count == 0:
            return
        if self.is_contiguous():
            states.write_range(slot, state, src.contiguous().view(-1), start)
            return
        flat = torch.empty(count, dtype=self.dtype)
        states.read_range(slot, state, flat, start)
        flat.as_strided(self.shape, self.stride()).copy_(src)
        states.write_range(slot, state, flat, start)

    def untyped_storage(self):
        # torch.distributed.checkpoint's writer clones a tensor whose storage
        # is larger than it, and keeps every tensor it wrote in a dict until
        # the file is closed (torch 2.15, filesystem.py): a clone would keep
        # every state in RAM. Told the sizes match, it torch.saves the entry
        # itself, which __reduce_ex__ reads one window at a time.
        return _Unbacked(self.numel() * self.element_size())

    def _own_values(self):
        """The values as a tensor of its own storage: read once, copied only
        for a strided window."""
        values = self._values()
        return values if values.is_contiguous() else values.clone()

    def __reduce_ex__(self, protocol):
        return self._own_values().__reduce_ex__(protocol)

    def __deepcopy__(self, memo):
        return self._own_values()

    def __repr__(self):
        states, slot, state = self._where
        return f"strata state {state!r} of parameter {slot} {tuple(self.shape)}: {self._values()!r}"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self = args[0] if args and isinstance(args[0], _Stored) else None
        if self is not None:
            if func in _ALIASES:
                return self._window(self.shape, self.stride(), self._offset)
            if func in _VIEWS and self.is_contiguous():
                size = torch.empty(self.shape, device="meta").view(args[1]).shape
                return self._window(size, None, self._offset)
            if func is _aten.slice.Tensor:
                names, defaults = ("dim", "start", "end", "step"), (0, None, None, 1)
                dim, start, end, step = (
                    args[i + 1] if i + 1 < len(args) else kwargs.get(n, d)
                    for i, (n, d) in enumerate(zip(names, defaults))
                )
                dim %= self.dim()
                start, end, _ = slice(start, end, step).indices(self.shape[dim])
                size, stride = list(self.shape), list(self.stride())
                size[dim] = max(0, -(-(end - start) // step))
                offset = self._offset + start * stride[dim]
                stride[dim] *= step
                return self._window(size, stride, offset)
            if func is _aten.copy_.default:
                src = args[1]
                self._store(src._values() if isinstance(src, _Stored) else src)
                return self
            if func is _aten.is_pinned.default:
                return False
        for i, arg in enumerate(func._schema.arguments):
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            if isinstance(value, _Stored) and arg.alias_info is not None and arg.alias_info.is_write:
                raise RuntimeError(
                    f"{func}: a strata optimizer state is written only by copy_ (what "
                    "torch.distributed.checkpoint's load does); give new values to load_state_dict"
                )

        def plain(t):
            return t._values() if isinstance(t, _Stored) else t

        return func(*[plain(a) for a in args], **{k: plain(v) for k, v in kwargs.items()})


class _Unbacked:
    """What a ``_Stored`` answers for its storage: its size, no memory."""

    def __init__(self, nbytes):
        self._nbytes = nbytes

    def size(self):
        return self._nbytes

    def nbytes(self):
        return self._nbytes

    def data_ptr(self):
        raise RuntimeError("a strata optimizer state has no storage here: read it (t.clone()) first")


def _contiguous_stride(size):
    stride, step = [], 1
    for n in reversed(tuple(size)):
        stride.append(step)
        step *= max(n, 1)
    return tuple(reversed(stride))


def _own(t, states, slot, state, numel):
    """Whether ``t`` is the whole of this optimizer's own state (so that
    loading it writes nothing)."""
    return (
        isinstance(t, _Stored)
        and t._where == (states, slot, state)
        and t._offset == 0
        and t.is_contiguous()
        and t.numel() == numel
    )


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


@functools.cache
def _fsdp_module_type():
    try:
        from torch.distributed.fsdp import FSDPModule

        return FSDPModule
    except ImportError:
        return None


def _owned(module):
    """The parameters whose update must land before ``module``'s forward:
    its own, and for an FSDP2 module (whose pre-forward hook all-gathers
    its whole group) those of its submodules up to the next FSDP2 module,
    and the groups it prefetches."""
    fsdp = _fsdp_module_type()
    if fsdp is None or not isinstance(module, fsdp):
        return [p for p in module._parameters.values() if p is not None]
    owned = _owned_group(module, fsdp)
    for other in _forward_prefetched(module):
        if other is not module:
            owned += _owned_group(other, fsdp)
    return owned


def _forward_prefetched(module):
    """The modules whose groups an FSDP2 module all-gathers in its own
    pre-forward hook (``set_modules_to_forward_prefetch``); none for any
    other module. FSDP2 keeps them in private state (torch 2.15); where it
    is not there, none."""
    fsdp = _fsdp_module_type()
    if fsdp is None or not isinstance(module, fsdp):
        return []
    state = module._get_fsdp_state()
    return [m for target in getattr(state, "_states_to_forward_prefetch", None) or () for m in target._modules]


def _owned_group(module, fsdp):
    """An FSDP2 module's group's parameters (to the next FSDP2 module)."""
    owned = [p for p in module._parameters.values() if p is not None]
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
