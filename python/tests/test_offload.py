"""strata.torch.AdamW under a plain PyTorch loop: against torch.optim.AdamW
with clipping, gradient accumulation, two param groups and a scheduler
(states in host memory and on NVMe), no fp32 copy left beside strata's,
checkpoints both ways, GradScaler's skipped steps, a corrupt NVMe state,
the refusals; and on gloo ranks under torchrun: FSDP2, distributed
checkpoints, tensor parallelism, pipeline stages, HF Trainer."""

import copy
import gc
import glob
import os

import pytest

torch = pytest.importorskip("torch", reason="torch is not importable here")

import strata.torch as st  # noqa: E402

STEPS = 30
ACCUMULATE = 4


def model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(33, 65), torch.nn.GELU(), torch.nn.LayerNorm(65), torch.nn.Linear(65, 5)
    )


def groups(net, weight_decay=0.1):
    """Decay on matrices, none on biases and norms (HF Trainer's split)."""
    decay = [p for p in net.parameters() if p.dim() >= 2]
    rest = [p for p in net.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def batches(seed, steps, skip=0):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range((skip + steps) * ACCUMULATE):
        out.append((torch.randn(8, 33, generator=gen), torch.randint(0, 5, (8,), generator=gen)))
    return out[skip * ACCUMULATE :]


def train(net, opt, steps=STEPS, skip=0, clip=0.05, dtype=torch.float32):
    """``steps`` optimizer steps of ``ACCUMULATE`` micro-batches each,
    clipping every step, a linear LR decay; the losses."""
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - (s + skip) / 100)
    losses = []
    data = batches(1, steps, skip)
    for s in range(steps):
        total = 0.0
        for x, y in data[s * ACCUMULATE : (s + 1) * ACCUMULATE]:
            loss = torch.nn.functional.cross_entropy(net(x.to(dtype)).float(), y) / ACCUMULATE
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(total)
    return losses


def strata_adamw(net, tmp_path, states, **kw):
    kw.setdefault("compute_dtype", torch.float32)
    (tmp_path / "nvme").mkdir(parents=True, exist_ok=True)
    return st.AdamW(groups(net), lr=3e-3, states=states, nvme_path=tmp_path / "nvme", verbose=False, **kw)


@pytest.mark.parametrize("states", ["cpu", "nvme"])
@pytest.mark.parametrize("piece", [None, 300])
def test_matches_torch_adamw_with_clipping_accumulation_and_groups(tmp_path, monkeypatch, states, piece):
    if piece:
        # Parameters kept as several strata slots each (odd splits).
        monkeypatch.setattr(st, "PIECE_ELEMS", piece)
    reference = model()
    want = train(reference, torch.optim.AdamW(groups(reference), lr=3e-3))
    net = model()
    opt = strata_adamw(net, tmp_path, states)
    got = train(net, opt)
    assert max(abs(a - b) for a, b in zip(want, got)) < 1e-5, (want, got)
    # Clipping was active: unclipped training goes elsewhere.
    free = model()
    unclipped = train(free, torch.optim.AdamW(groups(free), lr=3e-3), clip=1e9)
    assert max(abs(a - b) for a, b in zip(want, unclipped)) > 1e-3
    opt.synchronize()
    for p, q in zip(net.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_parameters_hold_the_compute_dtype_only(tmp_path):
    net = model()
    sizes = {p.numel() for p in net.parameters()}
    opt = strata_adamw(net, tmp_path, "cpu", compute_dtype=torch.bfloat16)
    gc.collect()
    assert all(p.dtype is torch.bfloat16 for p in net.parameters())
    fp32 = [
        t
        for t in gc.get_objects()
        if torch.is_tensor(t) and t.dtype is torch.float32 and t.numel() in sizes
    ]
    assert fp32 == [], [tuple(t.shape) for t in fp32]
    # It learns in bf16: one batch, memorized.
    x, y = batches(1, 1)[0]
    losses = []
    for _ in range(20):
        loss = torch.nn.functional.cross_entropy(net(x.bfloat16()).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses


@pytest.mark.parametrize("saved,loaded", [("cpu", "cpu"), ("nvme", "nvme"), ("cpu", "nvme")])
def test_resume_from_state_dict_repeats_the_losses(tmp_path, saved, loaded):
    whole = model()
    want = train(whole, strata_adamw(whole, tmp_path / "a", saved, moments="bf16"), steps=12)
    first = model()
    opt = strata_adamw(first, tmp_path / "b", saved, moments="bf16")
    train(first, opt, steps=6)
    # The entries are live (as torch's): a copy keeps them past more steps.
    packed = copy.deepcopy(opt.state_dict())
    assert set(packed["state"][0]) == {"step", "exp_avg", "exp_avg_sq", "master"}
    assert packed["state"][0]["step"].item() == 6.0
    model_state = {k: v.clone() for k, v in first.state_dict().items()}
    # Taking the state dict leaves the live states alone.
    assert train(first, opt, steps=6, skip=6) == want[6:]
    opt.close()
    again = model(seed=5)
    again.load_state_dict(model_state)
    resumed = strata_adamw(again, tmp_path / "c", loaded, moments="bf16")
    resumed.load_state_dict(packed)
    got = train(again, resumed, steps=6, skip=6)
    assert got == want[6:]


@pytest.mark.parametrize("states", ["cpu", "nvme"])
@pytest.mark.parametrize("compute,piece", [(torch.float32, None), (torch.bfloat16, None), (torch.bfloat16, 300)])
def test_state_dict_entries_are_read_when_used_and_written_through(tmp_path, monkeypatch, states, compute, piece):
    import io

    if piece:
        monkeypatch.setattr(st, "PIECE_ELEMS", piece)
    net = model()
    opt = strata_adamw(net, tmp_path, states, compute_dtype=compute)
    if piece:
        assert len(opt._states.pieces[0]) == 8
    train(net, opt, steps=2, dtype=compute)
    live = opt.state_dict()
    snapshot = copy.deepcopy(live)
    entry = live["state"][0]
    assert type(snapshot["state"][0]["exp_avg"]) is torch.Tensor
    assert torch.equal(entry["exp_avg"] * 1, snapshot["state"][0]["exp_avg"])
    saved = io.BytesIO()
    torch.save(live, saved)
    saved.seek(0)
    loaded = torch.load(saved, weights_only=True)
    for key in ("master", "exp_avg", "exp_avg_sq"):
        assert torch.equal(loaded["state"][0][key], snapshot["state"][0][key])
    # An in-place op other than copy_ would change a temporary: refused.
    with pytest.raises(RuntimeError, match="written only by copy_"):
        entry["exp_avg"].add_(1.0)
    # copy_ writes through, a window of rows, a column window, the whole.
    rows, cols = entry["exp_avg"].shape
    entry["exp_avg"][1:3].copy_(torch.full((2, cols), 0.5))
    entry["exp_avg_sq"][:, 2:4].copy_(torch.full((rows, 2), 0.25))
    entry["master"].copy_(torch.zeros(rows, cols))
    opt.load_state_dict(live)
    again = opt.state_dict()["state"][0]
    want_m = snapshot["state"][0]["exp_avg"].clone()
    want_m[1:3] = 0.5
    want_v = snapshot["state"][0]["exp_avg_sq"].clone()
    want_v[:, 2:4] = 0.25
    assert torch.equal(again["exp_avg"] * 1, want_m)
    assert torch.equal(again["exp_avg_sq"] * 1, want_v)
    # The parameter took the master's values: zeros.
    assert torch.count_nonzero(net[0].weight) == 0
    # An entry taken before a step is refused, not read as if current.
    train(net, opt, steps=1, skip=2, dtype=compute)
    with pytest.raises(RuntimeError, match="taken before the optimizer changed"):
        entry["exp_avg"].sum()
    with pytest.raises(RuntimeError, match="taken before the optimizer changed"):
        opt.load_state_dict(live)
    opt.close()


def test_distributed_checkpoint_in_one_process_streams_nvme_states(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    net = model()
    opt = strata_adamw(net, tmp_path / "a", "nvme")
    train(net, opt, steps=3)
    state = get_optimizer_state_dict(net, opt)
    want = copy.deepcopy(state)
    dcp.save({"optim": state}, checkpoint_id=tmp_path / "ckpt")
    opt.close()
    other = model(seed=3)
    other.load_state_dict(net.state_dict())
    fresh = strata_adamw(other, tmp_path / "b", "nvme")
    state = get_optimizer_state_dict(other, fresh)
    dcp.load({"optim": state}, checkpoint_id=tmp_path / "ckpt")
    set_optimizer_state_dict(other, fresh, state)
    got = copy.deepcopy(get_optimizer_state_dict(other, fresh))
    assert sorted(got["state"]) == sorted(want["state"]) == sorted(n for n, _ in net.named_parameters())
    for name, entry in want["state"].items():
        for key in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(got["state"][name][key], entry[key]), (name, key)
    # The parameters took the masters' values.
    for name, p in other.named_parameters():
        assert torch.equal(p.detach(), want["state"][name]["master"]), name
    fresh.close()


@pytest.mark.parametrize("mode", ["torch.compile", "module.compile"])
def test_a_compiled_module_trains_as_the_eager_one(tmp_path, mode):
    # The forward pre-hook runs outside the graph (a graph break), so each
    # deferred update still lands before the compiled forward reads it.
    eager = model()
    want = train(eager, strata_adamw(eager, tmp_path / "eager", "cpu"), steps=6)
    net = model()
    opt = strata_adamw(net, tmp_path / "compiled", "cpu")
    if mode == "torch.compile":
        run = torch.compile(net, backend="aot_eager")
    else:
        net.compile(backend="aot_eager")
        run = net
    got = train(run, opt, steps=6)
    assert got == want
    opt.close()


def test_parameters_swapped_before_the_first_step_are_followed_after_refused(tmp_path):
    reference = model()
    want = train(reference, torch.optim.AdamW(groups(reference), lr=3e-3), steps=4)
    # Built over one copy of the parameters, then given another (what
    # accelerate's prepare does under FSDP2): the new ones are trained.
    first, net = model(), model()
    opt = strata_adamw(first, tmp_path / "a", "nvme")
    for group, new in zip(opt.param_groups, groups(net)):
        group["params"] = new["params"]
    got = train(net, opt, steps=4)
    assert max(abs(a - b) for a, b in zip(want, got)) < 1e-5
    for group in opt.param_groups:
        group["params"] = [torch.nn.Parameter(p.detach().clone()) for p in group["params"]]
    with pytest.raises(RuntimeError, match="replaced after the optimizer stepped"):
        opt.step()
    opt.close()


def test_loads_a_torch_adamw_state_dict(tmp_path):
    reference = model()
    ref_opt = torch.optim.AdamW(groups(reference), lr=3e-3)
    train(reference, ref_opt, steps=4)
    packed = copy.deepcopy(ref_opt.state_dict())
    net = model()
    net.load_state_dict(reference.state_dict())
    want = train(reference, ref_opt, steps=4, skip=4)
    opt = strata_adamw(net, tmp_path, "cpu")
    opt.load_state_dict(packed)
    got = train(net, opt, steps=4, skip=4)
    assert max(abs(a - b) for a, b in zip(want, got)) < 1e-5


def test_grad_scaler_overflow_skips_the_step(tmp_path):
    net = model()
    opt = strata_adamw(net, tmp_path, "cpu")
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    x, y = batches(1, 1)[0]
    scaler.scale(torch.nn.functional.cross_entropy(net(x), y)).backward()
    before = [p.detach().clone() for p in net.parameters()]
    next(net.parameters()).grad[0, 0] = float("inf")
    scaler.step(opt)
    scaler.update()
    opt.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters()))
    assert scaler.get_scale() == 512.0
    # Without the overflow the scaled step equals the unscaled one.
    opt.zero_grad()
    reference = model()
    ref_opt = torch.optim.AdamW(groups(reference), lr=3e-3)
    torch.nn.functional.cross_entropy(reference(x), y).backward()
    ref_opt.step()
    scaler.scale(torch.nn.functional.cross_entropy(net(x), y)).backward()
    scaler.step(opt)
    opt.synchronize()
    for p, q in zip(net.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)


def test_grad_scaler_unscale_then_clip_is_the_clipped_step(tmp_path):
    """The usual fp16 loop: scaler.unscale_, clip_grad_norm_, scaler.step,
    against torch AdamW on the unscaled, clipped gradients."""
    net, reference = model(), model()
    opt = strata_adamw(net, tmp_path, "cpu")
    ref_opt = torch.optim.AdamW(groups(reference), lr=3e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    for x, y in batches(1, 3)[:3]:
        scaler.scale(torch.nn.functional.cross_entropy(net(x), y)).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(net.parameters(), 0.05)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(reference(x), y).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
        ref_opt.step()
        ref_opt.zero_grad()
    opt.synchronize()
    for p, q in zip(net.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_updates_are_queued_in_the_order_the_forward_uses_them(tmp_path):
    """Decay and no-decay groups put every bias after every matrix; after
    one forward the updates follow the modules instead."""
    net = model()
    opt = strata_adamw(net, tmp_path, "cpu")
    slots = [opt._slot[p] for p in net.parameters()]  # the forward's order: each module's weight, bias
    assert opt._order == sorted(slots) and opt._order != slots
    train(net, opt, steps=2)
    assert opt._order == slots, (opt._order, slots)


def test_zero_grad_in_place_waits_for_the_update(tmp_path):
    reference = model()
    want = train(reference, torch.optim.AdamW(groups(reference), lr=3e-3), steps=3)
    net = model()
    opt = strata_adamw(net, tmp_path, "nvme")
    opt.zero_grad = lambda set_to_none=True, zero=opt.zero_grad: zero(set_to_none=False)
    got = train(net, opt, steps=3)
    assert max(abs(a - b) for a, b in zip(want, got)) < 1e-5


def test_a_corrupt_nvme_state_is_an_error_that_sticks(tmp_path):
    net = model()
    opt = strata_adamw(net, tmp_path, "nvme")
    train(net, opt, steps=1)
    opt.synchronize()
    files = glob.glob(str(tmp_path / "nvme" / "strata-swap" / "*"))
    assert files
    for name in files:
        with open(name, "r+b") as f:
            f.write(b"\x55" * 4096)
            f.flush()
            os.fsync(f.fileno())
    with pytest.raises(RuntimeError, match="checksum"):
        train(net, opt, steps=2)
        opt.synchronize()
    with pytest.raises(RuntimeError, match="an earlier optimizer step failed"):
        opt.step()
        opt.synchronize()


def test_refusals_name_the_problem(tmp_path):
    net = model()
    with pytest.raises(ValueError, match='states = "gpu"|states = \'gpu\''):
        st.AdamW(net.parameters(), states="gpu", verbose=False)
    with pytest.raises(ValueError, match="nvme_path"):
        st.AdamW(net.parameters(), states="nvme", verbose=False)
    with pytest.raises(OSError, match="missing"):
        st.AdamW(net.parameters(), states="nvme", nvme_path=tmp_path / "missing", verbose=False)
    (tmp_path / "a-file").write_text("")
    with pytest.raises(OSError, match="a-file: it is a file, not a directory"):
        st.AdamW(net.parameters(), states="nvme", nvme_path=tmp_path / "a-file", verbose=False)
    # A drive without room for the states: refused before anything is written.
    (tmp_path / "small").mkdir()
    with pytest.raises(OSError, match=r"small has \d+ bytes free but 1125899906842624 are needed: free space"):
        st.AdamW(net.parameters(), states="nvme", nvme_path=tmp_path / "small", nvme_capacity=1 << 50, verbose=False)
    assert sum(os.path.getsize(f) for f in glob.glob(str(tmp_path / "small" / "**"), recursive=True)
               if os.path.isfile(f)) == 0
    # A directory that cannot be written (sysfs refuses even root).
    if os.path.isdir("/sys/kernel"):
        with pytest.raises(OSError, match="cannot open .strata-lock in it: .*make the directory writable"):
            st.AdamW(net.parameters(), states="nvme", nvme_path="/sys/kernel", verbose=False)
    with pytest.raises(MemoryError, match="host_budget is 0.0 MiB"):
        st.AdamW(net.parameters(), host_budget=1000, verbose=False)
    sparse = torch.nn.Parameter(torch.sparse_coo_tensor([[0]], [1.0], (4,)))
    with pytest.raises(TypeError, match="layout"):
        st.AdamW([sparse], verbose=False)
    with pytest.raises(TypeError, match="complex"):
        st.AdamW([torch.nn.Parameter(torch.zeros(3, dtype=torch.complex64))], verbose=False)
    with pytest.raises(TypeError, match="meta device"):
        st.AdamW([torch.nn.Parameter(torch.zeros(3, device="meta"))], verbose=False)
    with pytest.raises(ValueError, match="more than one"):
        p = torch.nn.Parameter(torch.zeros(3))
        st.AdamW([{"params": [p]}, {"params": [p]}], verbose=False)
    (tmp_path / "taken").mkdir()
    holder = st.AdamW(model().parameters(), states="nvme", nvme_path=tmp_path / "taken", verbose=False)
    with pytest.raises(OSError, match=r"nvme_path .*taken: run \w+ \(pid \d+ .* is using it"):
        st.AdamW(net.parameters(), states="nvme", nvme_path=tmp_path / "taken", verbose=False)
    holder.close()
    # A refused optimizer changed nothing.
    assert all(p.dtype is torch.float32 for p in net.parameters())


def test_plan_names_the_tiers(tmp_path):
    net = model()
    opt = strata_adamw(net, tmp_path, "nvme")
    plan = opt.plan()
    assert "states on NVMe" in plan and "staging" in plan and "float32 on cpu" in plan, plan
    from strata._strata import OffloadStates

    with pytest.raises(ValueError, match="at most 1099511627776 in one tensor"):
        OffloadStates([1 << 62], tier="cpu")


def torchrun(tmp_path, ranks, script, *args):
    """Runs ``script`` under torchrun (``--standalone``) on ``ranks`` CPU
    ranks (skips where torch lacks FSDP2 or gloo); rank 0's JSON and the
    whole stderr."""
    import json
    import subprocess
    import sys

    pytest.importorskip("torch.distributed.fsdp", reason="this torch has no FSDP2")
    if not torch.distributed.is_gloo_available():
        pytest.skip("this torch has no gloo backend")
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dist", script)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
         script, *map(str, args)],
        capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


def test_distributed_checkpoint_resumes_bit_for_bit_and_loads_at_one_rank(tmp_path):
    """FSDP2 + strata, torch.distributed.checkpoint: saved at 2 ranks and
    resumed there with the same losses to the bit; loaded at 1 rank (states
    on NVMe there) with the same full optimizer state."""
    after, _ = torchrun(tmp_path, 2, "fsdp2_dcp.py", "save", tmp_path, "cpu")
    resumed, _ = torchrun(tmp_path, 2, "fsdp2_dcp.py", "resume", tmp_path, "nvme")
    assert resumed["result"] == after["result"], (after, resumed)
    same, _ = torchrun(tmp_path, 1, "fsdp2_dcp.py", "check", tmp_path, "nvme")
    assert same["result"] is True


def test_fsdp2_on_two_ranks_matches_torch_adamw(tmp_path):
    """torchrun, gloo, CPU: FSDP2 + strata (states in host memory and on
    NVMe) against FSDP2 + torch AdamW, 30 steps of 4 micro-batches with
    clipping every step."""
    runs, stderr = torchrun(tmp_path, 2, "fsdp2_train.py", tmp_path)
    for name in ("strata_cpu", "strata_nvme", "strata_prefetch", "strata_swapped"):
        worst = max(abs(a - b) for a, b in zip(runs["torch"], runs[name]))
        assert worst < 1e-5, (name, worst, runs)
    assert "6 DTensor shards" in stderr, stderr[-2000:]


def test_hf_trainer_with_optimizers_matches_torch_adamw(tmp_path):
    """HF Trainer, one process on the CPU, a tiny Llama built from a config:
    ``optimizers=(strata.torch.AdamW, None)`` against Trainer's own torch
    AdamW, 10 steps with its clipping (max_grad_norm) and its linear
    schedule: every logged loss within 1e-5."""
    transformers = pytest.importorskip("transformers", reason="transformers is not importable here")
    config = transformers.LlamaConfig(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )
    gen = torch.Generator().manual_seed(3)
    rows = [{"input_ids": torch.randint(0, 97, (16,), generator=gen)} for _ in range(40)]
    for row in rows:
        row["labels"] = row["input_ids"].clone()

    def losses(make_optimizer, name):
        torch.manual_seed(0)
        net = transformers.LlamaForCausalLM(config)
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / name), max_steps=10, per_device_train_batch_size=4,
            learning_rate=2e-3, weight_decay=0.1, max_grad_norm=0.5, logging_steps=1,
            report_to=[], use_cpu=True, save_strategy="no", seed=0, dataloader_num_workers=0,
            disable_tqdm=True,
        )
        optimizers = (make_optimizer(net), None) if make_optimizer else (None, None)
        trainer = transformers.Trainer(model=net, args=args, train_dataset=rows, optimizers=optimizers)
        trainer.train()
        return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]

    want = losses(None, "torch")

    def strata_optimizer(net):
        decay = [p for n, p in net.named_parameters() if p.dim() >= 2]
        rest = [p for n, p in net.named_parameters() if p.dim() < 2]
        return st.AdamW(
            [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
            lr=2e-3, compute_dtype=torch.float32, verbose=False,
        )

    got = losses(strata_optimizer, "strata")
    assert len(got) == len(want) == 10, (want, got)
    assert max(abs(a - b) for a, b in zip(want, got)) < 1e-5, (want, got)


def test_tensor_parallel_two_ranks_match_one_process(tmp_path):
    """DTensor TP = 2 (column-wise then row-wise Linear), states on NVMe,
    clipping every step, against the same model and loop in one process
    with torch AdamW: losses within 1e-5 over 20 steps."""
    pytest.importorskip("torch.distributed.tensor.parallel", reason="this torch has no DTensor TP")
    runs, _ = torchrun(tmp_path, 2, "tp2_train.py")
    worst = max(abs(a - b) for a, b in zip(runs["tp"], runs["one_process"]))
    assert worst < 1e-5, (worst, runs)


def test_pipeline_stages_match_one_process(tmp_path):
    """torch.distributed.pipelining, two stages at 2 ranks (GPipe, 4
    micro-batches), each stage's parameters under its own strata
    optimizer, against the whole model in one process with torch AdamW:
    losses within 1e-5 over 15 steps."""
    pytest.importorskip("torch.distributed.pipelining", reason="this torch has no pipelining")
    runs, _ = torchrun(tmp_path, 2, "pp2_train.py")
    worst = max(abs(a - b) for a, b in zip(runs["pipeline"], runs["one_process"]))
    assert worst < 1e-5, (worst, runs)


def test_fsdp2_bf16_shards_keep_no_fp32_copy(tmp_path):
    """A model converted to bf16 before fully_shard (gradients reduced in
    fp32): after construction no fp32 tensor of a local shard's size
    exists on rank 0, and the model learns."""
    result, _ = torchrun(tmp_path, 2, "fsdp2_bf16.py")
    assert result["param_dtypes"] == ["torch.bfloat16"] and result["fp32_copies"] == 0, result
    assert result["losses"][-1] < 0.8 * result["losses"][0], result
