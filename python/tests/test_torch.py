"""strata.optim against torch's own optimizers (and DeepSpeedCPUAdam when it
imports), state dicts both ways, the fused step, and dlpack errors."""

import copy
import os

import pytest

torch = pytest.importorskip("torch", reason="torch is not importable here")

from strata._strata import Kernels  # noqa: E402
from strata.optim import CPUAdagrad, CPUAdam, CPULion  # noqa: E402

STEPS = 100


def model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(67, 129), torch.nn.GELU(), torch.nn.LayerNorm(129), torch.nn.Linear(129, 3)
    )


def train(net, optimizer, steps=STEPS, seed=1, skip=0):
    """``steps`` steps on the batches of ``seed``, the first ``skip`` of
    them passed over (a resumed run's)."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(skip):
        torch.randn(16, 67, generator=gen), torch.randint(0, 3, (16,), generator=gen)
    for _ in range(steps):
        x = torch.randn(16, 67, generator=gen)
        y = torch.randint(0, 3, (16,), generator=gen)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        optimizer.step()
    return [p.detach().clone() for p in net.parameters()]


def assert_close(a, b, rtol=1e-5, atol=1e-6):
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=rtol, atol=atol)


@pytest.mark.parametrize("impl", ["foreach", "fused", "single"])
def test_cpuadam_matches_torch_adamw_for_100_steps(impl):
    """torch.optim.AdamW with foreach=True, fused=True (its CPU fused kernel)
    and the single-tensor loop (foreach=False): within rtol 1e-5, atol 1e-6."""
    kwargs = {"foreach": dict(foreach=True), "fused": dict(fused=True), "single": dict(foreach=False)}[impl]
    a, b = model(), model()
    ours = train(a, CPUAdam(a.parameters(), lr=1e-3, weight_decay=0.01))
    theirs = train(b, torch.optim.AdamW(b.parameters(), lr=1e-3, weight_decay=0.01, **kwargs))
    assert_close(ours, theirs)


def test_adam_mode_matches_torch_adam():
    a, b = model(), model()
    ours = train(a, CPUAdam(a.parameters(), lr=1e-3, weight_decay=0.01, adamw_mode=False))
    theirs = train(b, torch.optim.Adam(b.parameters(), lr=1e-3, weight_decay=0.01, foreach=False))
    assert_close(ours, theirs)


def test_cpuadam_matches_deepspeed_cpuadam():
    deepspeed_adam = pytest.importorskip("deepspeed.ops.adam", reason="deepspeed is not importable")
    try:
        a, b = model(), model()
        theirs_opt = deepspeed_adam.DeepSpeedCPUAdam(b.parameters(), lr=1e-3, weight_decay=0.01)
    except Exception as err:  # its op is JIT-built and may fail to build here
        pytest.skip(f"DeepSpeedCPUAdam did not load: {err}")
    ours = train(a, CPUAdam(a.parameters(), lr=1e-3, weight_decay=0.01))
    theirs = train(b, theirs_opt)
    assert_close(ours, theirs)


def test_empty_shared_and_odd_tensors():
    """Empty parameters (torch gives them a null data pointer) step like any
    other; two parameters may share one gradient (read only); sparse and
    memory-less tensors are refused by name."""
    empty = torch.nn.Parameter(torch.empty(0))
    a, b = torch.nn.Parameter(torch.ones(64)), torch.nn.Parameter(torch.ones(64))
    shared = torch.full((64,), 0.5)
    empty.grad, a.grad, b.grad = torch.empty(0), shared, shared
    opt = CPUAdam([empty, a, b], lr=1e-2)
    opt.step()
    assert torch.equal(a, b) and (a < 1).all() and empty.numel() == 0
    assert float(opt.state_dict()["state"][0]["step"]) == 1.0
    k = Kernels(threads=1)
    kw = dict(step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, adamw_mode=True,
              bias_correction=True)
    z = torch.zeros(64)
    with pytest.raises(ValueError, match="grads: the tensor's layout is torch.sparse_coo, strata takes dense"):
        k.adam(z.clone(), z.to_sparse(), z.clone(), z.clone(), **kw)
    with pytest.raises(ValueError, match="exp_avg and exp_avg_sq share memory"):
        k.adam(z.clone(), z.clone(), z, z, **kw)


def test_a_refused_step_changes_nothing():
    """A fused step whose copies are refused (checked before any tensor is
    touched) leaves parameters, states and steps as they were; the next
    good step is the first."""
    torch.manual_seed(3)
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    opt = CPUAdam(net.parameters(), lr=1e-2)
    net(torch.randn(2, 8)).sum().backward()
    opt.step()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    states = copy.deepcopy(opt.state_dict())
    copies = [torch.empty(p.numel(), dtype=torch.bfloat16) for p in net.parameters()]
    copies[-1] = torch.empty(copies[-1].numel() + 1, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"param_copy\[3\]: 5 elements, but the parameter has 4"):
        opt.step_fused(copies)
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())
    after = opt.state_dict()
    for key, state in states["state"].items():
        assert float(after["state"][key]["step"]) == float(state["step"]) == 1.0
        assert torch.equal(after["state"][key]["exp_avg"], state["exp_avg"])
    with pytest.raises(ValueError, match="grads has 1 entries for 4 parameters"):
        opt.step_fused(copies, grads=[None])
    assert float(opt.state_dict()["state"][0]["step"]) == 1.0
    fresh = CPUAdam(net.parameters(), lr=1e-2)
    with pytest.raises(ValueError, match=r"param_copy\[3\]"):
        fresh.step_fused(copies)
    assert not any(fresh.state.values()), "a refused first step leaves no state behind"


def test_state_dicts_move_between_cpuadam_and_torch_adamw():
    a, b = model(), model()
    opt_a = CPUAdam(a.parameters(), lr=1e-3, weight_decay=0.01)
    train(a, opt_a, steps=10)
    state = opt_a.state_dict()
    first = state["state"][0]
    assert torch.is_tensor(first["step"]) and first["step"].dtype == torch.float32
    assert float(first["step"]) == 10.0 and set(first) == {"step", "exp_avg", "exp_avg_sq"}
    # ours -> torch: both continue identically
    b.load_state_dict(a.state_dict())
    opt_b = torch.optim.AdamW(b.parameters(), lr=1e-3, weight_decay=0.01, foreach=False)
    opt_b.load_state_dict(copy.deepcopy(state))
    assert_close(train(a, opt_a, steps=10, seed=5), train(b, opt_b, steps=10, seed=5))
    # torch -> ours
    c = model()
    c.load_state_dict(b.state_dict())
    opt_c = CPUAdam(c.parameters(), lr=1e-3, weight_decay=0.01)
    opt_c.load_state_dict(copy.deepcopy(opt_b.state_dict()))
    assert_close(train(c, opt_c, steps=10, seed=6), train(b, opt_b, steps=10, seed=6))
    # DeepSpeed keeps an int step
    d = model()
    d.load_state_dict(c.state_dict())
    ds_style = copy.deepcopy(opt_c.state_dict())
    for s in ds_style["state"].values():
        s["step"] = int(s["step"].item())
    opt_d = CPUAdam(d.parameters(), lr=1e-3, weight_decay=0.01)
    opt_d.load_state_dict(ds_style)
    assert_close(train(d, opt_d, steps=3, seed=7), train(c, opt_c, steps=3, seed=7))


def test_bf16_moments_train_as_fp32_states_do_and_resume_bit_for_bit():
    """state_dtype="bf16-moments": bf16 exp_avg/exp_avg_sq rounded
    stochastically; training lands near fp32 states (another path: not the
    same bits); the same bits on any thread count and whichever parameters
    sat a step out; a state dict round trip (torch's loader would cast the
    moments to float32) continues bit for bit, with bf16 moments."""
    a, b = model(), model()
    ours = CPUAdam(a.parameters(), lr=1e-3, weight_decay=0.01, state_dtype="bf16-moments")
    bf16_params = train(a, ours, steps=50)
    fp32_params = train(b, CPUAdam(b.parameters(), lr=1e-3, weight_decay=0.01), steps=50)
    state = ours.state[next(a.parameters())]
    assert state["exp_avg"].dtype == torch.bfloat16 and state["exp_avg_sq"].dtype == torch.bfloat16
    # 50 steps of at most lr each: the states' rounding moves little of it.
    assert_close(bf16_params, fp32_params, rtol=0, atol=2e-3)
    assert any(not torch.equal(x, y) for x, y in zip(bf16_params, fp32_params))

    def run(threads, steps):
        net = model()
        optimizer = CPUAdam(net.parameters(), lr=1e-3, weight_decay=0.01, state_dtype="bf16-moments",
                            rounding_seed=3, threads=threads)
        train(net, optimizer, steps=steps)
        return net, optimizer

    one, _ = run(1, 8)
    two, _ = run(2, 8)
    assert all(torch.equal(x, y) for x, y in zip(one.parameters(), two.parameters()))
    # A parameter that sits a step out (it then runs a step behind, in a
    # call of its own) moves no other parameter's bits: each element's
    # key is its index among all the parameters, not its place in a call.
    def synthetic(skip):
        gen = torch.Generator().manual_seed(4)
        ps = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in (1000, 77, 5000)]
        opt = CPUAdam(ps, lr=1e-2, state_dtype="bf16-moments")
        for step in range(6):
            for p in ps:
                p.grad = torch.randn(p.numel(), generator=gen)
            if skip and step == 2:
                ps[1].grad = None
            opt.step()
        return ps

    kept, skipped = synthetic(False), synthetic(True)
    assert torch.equal(kept[0], skipped[0]) and torch.equal(kept[2], skipped[2])
    assert not torch.equal(kept[1], skipped[1])
    # Resume: 8 steps, a state dict, a fresh optimizer, 8 more = 16 at once.
    whole, _ = run(2, 16)
    head, opt_head = run(2, 8)
    saved = copy.deepcopy(opt_head.state_dict())
    assert saved["state"][0]["exp_avg"].dtype == torch.bfloat16
    resumed = CPUAdam(head.parameters(), lr=1e-3, weight_decay=0.01, state_dtype="bf16-moments", rounding_seed=3)
    resumed.load_state_dict(saved)
    assert resumed.state[next(head.parameters())]["exp_avg_sq"].dtype == torch.bfloat16
    train(head, resumed, steps=8, skip=8)
    assert all(torch.equal(x, y) for x, y in zip(head.parameters(), whole.parameters()))
    # fp32 moments (torch AdamW's) load into bf16 ones rounded to nearest;
    # bf16 ones into an fp32-state CPUAdam exactly.
    d = model()
    torch_opt = torch.optim.AdamW(d.parameters(), lr=1e-3, weight_decay=0.01)
    train(d, torch_opt, steps=3)
    narrowed = CPUAdam(d.parameters(), lr=1e-3, state_dtype="bf16-moments")
    narrowed.load_state_dict(copy.deepcopy(torch_opt.state_dict()))
    for p in d.parameters():
        got, want = narrowed.state[p]["exp_avg"], torch_opt.state[p]["exp_avg"]
        assert got.dtype == torch.bfloat16 and torch.equal(got, want.to(torch.bfloat16))
    widened = CPUAdam(d.parameters(), lr=1e-3)
    widened.load_state_dict(copy.deepcopy(narrowed.state_dict()))
    for p in d.parameters():
        got = widened.state[p]["exp_avg"]
        assert got.dtype == torch.float32 and torch.equal(got, narrowed.state[p]["exp_avg"].float())


def test_a_copied_or_pickled_optimizer_keeps_its_settings():
    """torch's Optimizer.__getstate__ keeps defaults, state and param_groups
    only: CPUAdam's own settings (adamw_mode, state_dtype, rounding_seed)
    travel too, and the copy steps as the original does."""
    a = model()
    original = CPUAdam(a.parameters(), lr=1e-3, adamw_mode=False, state_dtype="bf16-moments", rounding_seed=9)
    train(a, original, steps=2)
    b, duplicate = copy.deepcopy((a, original))  # one memo: the copy steps b's parameters
    assert (duplicate.adam_w_mode, duplicate.state_dtype, duplicate.rounding_seed) == (False, "bf16-moments", 9)
    assert all(torch.equal(x, y) for x, y in zip(train(a, original, steps=3, seed=2),
                                                 train(b, duplicate, steps=3, seed=2)))


def test_bad_state_dtypes_and_rounding_seeds_are_named():
    params = model().parameters()
    with pytest.raises(ValueError, match="state_dtype='bf16': use one of 'fp32', 'bf16-moments'"):
        CPUAdam(params, state_dtype="bf16")
    with pytest.raises(ValueError, match="rounding_seed=-1: use an int from 0 to 2\\*\\*64 - 1"):
        CPUAdam(params, state_dtype="bf16-moments", rounding_seed=-1)


def huge_page_advised(tensor):
    """Whether the mapping holding ``tensor`` was advised onto transparent
    huge pages (the ``hg`` flag in /proc/self/smaps)."""
    address = tensor.data_ptr()
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split(" ", 1)[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and line.startswith("VmFlags:"):
                return "hg" in line.split()[1:]
    return False


def test_large_states_live_on_huge_pages_and_step_as_torch():
    """States of 2 MiB or more are strata's own huge-page mappings, made at
    the first step and again when a state dict is loaded; the updates still
    match torch's (AdamW and Adagrad with a nonzero initial accumulator)."""
    if not os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"):
        pytest.skip("this kernel has no transparent huge pages")

    def params(seed):
        gen = torch.Generator().manual_seed(seed)
        return [torch.nn.Parameter(torch.randn(3, 200_003, generator=gen)),
                torch.nn.Parameter(torch.randn(100, generator=gen))]

    def run(ps, opt, steps, seed):
        gen = torch.Generator().manual_seed(seed)
        for _ in range(steps):
            for p in ps:
                p.grad = torch.randn(p.shape, generator=gen) * 1e-2
            opt.step()

    ours, theirs = params(0), params(0)
    opt = CPUAdam(ours, lr=1e-3, weight_decay=0.01)
    ref = torch.optim.AdamW(theirs, lr=1e-3, weight_decay=0.01, foreach=False)
    run(ours, opt, 5, 1)
    run(theirs, ref, 5, 1)
    assert_close(ours, theirs)
    big, small = opt.state[ours[0]], opt.state[ours[1]]
    assert huge_page_advised(big["exp_avg"]) and huge_page_advised(big["exp_avg_sq"])
    assert big["exp_avg"].shape == ours[0].shape and big["exp_avg"].is_contiguous()
    assert not huge_page_advised(small["exp_avg"])
    # A loaded state dict (torch's loader makes fresh tensors) is moved back.
    again = [p.detach().clone().requires_grad_() for p in ours]
    loaded = CPUAdam(again, lr=1e-3, weight_decay=0.01)
    source = copy.deepcopy(opt.state_dict())
    loaded.load_state_dict(source)
    moved = loaded.state[again[0]]["exp_avg_sq"]
    assert huge_page_advised(moved)
    # The caller's tensor was re-pointed, not copied beside: one copy lives.
    assert source["state"][0]["exp_avg_sq"].data_ptr() == moved.data_ptr()
    # States already on strata's pages stay where they are.
    before = opt.state[ours[0]]["exp_avg"].data_ptr()
    opt.load_state_dict(opt.state_dict())
    assert opt.state[ours[0]]["exp_avg"].data_ptr() == before
    run(again, loaded, 3, 2)
    run(ours, opt, 3, 2)
    assert_close(again, ours, rtol=0, atol=0)

    ours, theirs = params(3), params(3)
    opt = CPUAdagrad(ours, lr=1e-2, initial_accumulator_value=0.1)
    run(ours, opt, 4, 4)
    run(theirs, torch.optim.Adagrad(theirs, lr=1e-2, initial_accumulator_value=0.1, foreach=False), 4, 4)
    assert_close(ours, theirs)
    assert huge_page_advised(opt.state[ours[0]]["sum"])


def test_amsgrad_is_refused_as_in_deepspeed():
    with pytest.raises(RuntimeError, match="does not support the AMSGrad variant"):
        CPUAdam(model().parameters(), amsgrad=True)
    opt = CPUAdam(model().parameters())
    with pytest.raises(RuntimeError, match="AMSGrad"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))], "amsgrad": True})


def test_step_fused_takes_bf16_gradients_and_writes_bf16_copies():
    a, b = model(), model()
    opt_a = CPUAdam(a.parameters(), lr=1e-3)
    opt_b = CPUAdam(b.parameters(), lr=1e-3)
    x = torch.randn(8, 67)
    for net in (a, b):
        net(x).square().mean().backward()
    grads = [p.grad.to(torch.bfloat16) for p in a.parameters()]
    copies = [torch.empty_like(p, dtype=torch.bfloat16) for p in a.parameters()]
    opt_a.step_fused(copies, grads=grads, grad_scale=0.5)
    for p, g in zip(b.parameters(), grads):
        p.grad = g.float() * 0.5
    opt_b.step()
    for p, q, c in zip(a.parameters(), b.parameters(), copies):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
        assert torch.equal(c, p.detach().to(torch.bfloat16))


def test_adagrad_matches_torch_and_lion_matches_its_formula():
    a, b = model(), model()
    assert_close(train(a, CPUAdagrad(a.parameters(), lr=1e-2, weight_decay=0.01)),
                 train(b, torch.optim.Adagrad(b.parameters(), lr=1e-2, weight_decay=0.01, foreach=False)))
    c = model()
    ref = model()
    opt = CPULion(c.parameters(), lr=1e-4, betas=(0.9, 0.99), weight_decay=0.1)
    moms = [torch.zeros_like(p, dtype=torch.float64) for p in ref.parameters()]
    gen = torch.Generator().manual_seed(3)
    for _ in range(20):
        grads = [torch.randn(p.shape, generator=gen) for p in c.parameters()]
        for p, g in zip(c.parameters(), grads):
            p.grad = g
        opt.step()
        with torch.no_grad():
            for p, g, m in zip(ref.parameters(), grads, moms):
                g = g.double()
                update = torch.sign(0.9 * m + 0.1 * g)
                p.copy_(p.double() * (1 - 1e-4 * 0.1) - 1e-4 * update)
                m.mul_(0.99).add_(0.01 * g)
    assert_close(list(c.parameters()), list(ref.parameters()))


def test_tensor_errors_say_what_to_do():
    k = Kernels(threads=1)
    p = torch.nn.Parameter(torch.zeros(64))
    z = torch.zeros(64)
    kw = dict(step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, adamw_mode=True,
              bias_correction=True)
    with pytest.raises(ValueError, match=r"params: the tensor requires grad and autograd is on \(call under "
                       r"torch.no_grad\(\), or pass tensor.detach\(\)"):
        k.adam(p, z, z.clone(), z.clone(), **kw)
    with torch.no_grad():
        k.adam(p, z + 1, z.clone(), z.clone(), **kw)  # as torch's in-place updates: allowed here
    assert (p.detach() < 0).all()
    with pytest.raises(ValueError, match="exp_avg: the tensor is on meta, strata steps CPU tensors"):
        k.adam(z.clone(), z.clone(), torch.zeros(64, device="meta"), z.clone(), **kw)
    with pytest.raises(ValueError, match=r"grads: the tensor is a lazy view \(is_neg\): pass tensor.resolve_neg\(\)"):
        k.adam(z.clone(), torch.zeros(64, dtype=torch.complex64).conj().imag, z.clone(), z.clone(), **kw)
    with pytest.raises(TypeError, match="exp_avg_sq: dtype float64 is not supported here"):
        k.adam(z.clone(), z.clone(), z.clone(), z.double(), **kw)
    with pytest.raises(ValueError, match="grads: the tensor is not contiguous"):
        k.adam(z.clone(), torch.zeros(8, 8).t(), z.clone(), z.clone(), **kw)
    with pytest.raises(TypeError, match="params: dtype bfloat16 is not supported here: use float32"):
        k.adam(z.bfloat16(), z.clone(), z.clone(), z.clone(), **kw)
    with pytest.raises(TypeError, match="float32 parameters"):
        net = torch.nn.Linear(4, 4).to(torch.bfloat16)
        net(torch.zeros(1, 4, dtype=torch.bfloat16)).sum().backward()
        CPUAdam(net.parameters()).step()


def test_async_io_moves_bf16_torch_tensors(tmp_path):
    from strata.io import AsyncIO

    h = AsyncIO(threads=2)
    t = torch.randn(1 << 20).to(torch.bfloat16)
    h.async_pwrite(t, str(tmp_path / "t.bin"))
    assert h.wait() == 1
    locked = h.new_cpu_locked_tensor(t.numel(), t)
    assert locked.dtype == torch.bfloat16 and locked.data_ptr() % 4096 == 0
    h.sync_pread(locked, str(tmp_path / "t.bin"))
    assert torch.equal(locked, t)
    h.free_cpu_locked_tensor(locked)
