"""The Python benches and the example in their tiny modes (the numbers are
not asserted: bars are read off real runs)."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch", reason="torch is not importable here")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(*args, cwd, json_only=False):
    """The script's JSON report; with ``json_only``, stdout must be nothing else."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    if json_only:
        return json.loads(out.stdout)
    return json.loads(out.stdout[out.stdout.index("{"):])


def test_python_vs_deepspeed_tiny(tmp_path):
    report = run(os.path.join(ROOT, "benches", "python_vs_deepspeed.py"), "--tiny", "--json",
                 "--dir", str(tmp_path / "io"), cwd=tmp_path, json_only=True)
    adam = report["adam"]
    assert adam["gparams_per_s"]["strata"] > 0 and "strata/torch_fused" in adam["ratios"]
    assert adam["gparams_per_s"]["strata_torch"] > 0 and "strata_torch/torch_fused" in adam["ratios"]
    for name, diff in adam["max_abs_diff_from_strata"].items():
        assert diff < 1e-4, f"{name} disagrees with strata after the same steps: {diff}"
    io = report["io"]
    assert io["gb_per_s"]["strata/locked/read"] > 0 and io["gb_per_s"]["strata/user/write"] > 0
    assert not os.listdir(tmp_path / "io"), "the bench removes its files"


def test_the_example_trains_and_matches_deepspeed_when_it_loads(tmp_path):
    example = os.path.join(ROOT, "examples", "python", "gpt2_cpu_adam.py")
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # noqa: F401
        have_deepspeed = True
    except Exception:
        have_deepspeed = False
    if have_deepspeed:
        result = run(example, "--compare", "--steps", "10", "--json", cwd=tmp_path)
        assert result["within_1e-5"], result
    else:
        result = run(example, "--optimizer", "strata", "--steps", "10", "--json", cwd=tmp_path)
        assert result["losses"][-1] < result["losses"][0]


def test_torch_offload_tiny(tmp_path):
    report = run(os.path.join(ROOT, "benches", "torch_offload.py"), "--tiny", "--json", cwd=tmp_path, json_only=True)
    assert report["step"]["gparams_per_s"]["strata_torch"] > 0
    assert set(report["overlap"]["rows"]) == {"unclipped", "clipped"}
    shards = run(os.path.join(ROOT, "benches", "torch_offload.py"), "--tiny", "--fsdp2", "--json", cwd=tmp_path,
                 json_only=True)
    assert shards["step"]["fsdp2"] and shards["step"]["gparams_per_s"]["strata_torch"] > 0


def test_torch_offload_capacity_tiny(tmp_path):
    pytest.importorskip("transformers", reason="transformers is not importable here")
    report = run(os.path.join(ROOT, "benches", "torch_offload_capacity.py"), "--tiny", "--json",
                 cwd=tmp_path, json_only=True)
    assert len(report["steps"]) == 3 and all(s["loss"] > 0 for s in report["steps"])
    assert report["ranks"] == 2 and len(report["vm_hwm_gib_per_rank"]) == 2
    assert report["states_on_disk_gib"] > 0 and report["checkpoint_on_disk_gib"] > 0
    assert not [n for n in os.listdir(tmp_path) if n.startswith("capacity-")], "the bench removes its files"


def test_the_llama_nvme_example_learns(tmp_path):
    pytest.importorskip("transformers", reason="transformers is not importable here")
    (tmp_path / "nvme").mkdir()
    example = os.path.join(ROOT, "examples", "python", "llama_nvme_finetune.py")
    result = run(example, "--nvme", str(tmp_path / "nvme"), "--steps", "8", "--json", cwd=tmp_path, json_only=True)
    assert result["losses"][-1] < 0.8 * result["losses"][0], result
    assert "states on NVMe" in result["plan"]


@pytest.mark.parametrize("tp", [1, 2])
def test_the_fsdp2_example_learns_on_two_ranks(tmp_path, tp):
    """torchrun at 2 ranks, gloo: FSDP2 alone, and FSDP2 + TP (a 1 x 2 mesh)."""
    pytest.importorskip("torch.distributed.fsdp", reason="this torch has no FSDP2")
    example = os.path.join(ROOT, "examples", "python", "fsdp2_strata.py")
    result = run("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", example,
                 "--tp", str(tp), "--states", "nvme", "--nvme", str(tmp_path), "--steps", "6", "--json",
                 cwd=tmp_path)
    assert result["tp"] == tp and result["losses"][-1] < 0.5 * result["losses"][0], result
