"""Data-parallel training with torchrun: two CPU processes on gloo end with identical parameters,
equal (to float reduction order) to a single-process run with the same global batch."""
import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from nectar.schemas.config import ModuleConfig, TrainConfig
from nectar.stages.train import train

CFG = TrainConfig(samples=96, batch_size=8, eval_every=6, checkpoint_every=6, peak_lr=3e-3,
                  module=ModuleConfig(rho=0.25, depths=(0, 2, 2)))


@pytest.mark.slow
def test_torchrun_two_cpu_processes_keep_identical_replicas(tiny_llama, tiny_targets, tmp_path):
    targets = tiny_targets[0]
    cfg_file = tmp_path / "train.json"
    cfg_file.write_text(CFG.model_dump_json())
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "nectar.training.launch", "--targets", targets, "--out", str(tmp_path / "ddp"),
           "--model", "tiny:llama", "--train-config", str(cfg_file), "--threads", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [line for line in proc.stdout.splitlines() if line.startswith('{"ranks"')]
    ranks = json.loads(line)["ranks"]
    assert sorted(r["rank"] for r in ranks) == [0, 1] and all(r["world_size"] == 2 for r in ranks)
    assert len({r["replica_checksum"] for r in ranks} | {r["file_checksum"] for r in ranks}) == 1
    assert all(r["steps"] == 12 and r["skipped_nonfinite"] == 0 for r in ranks)

    train(targets, CFG, tiny_llama, None, str(tmp_path / "single"))
    a, b = load_file(str(tmp_path / "single" / "module.safetensors")), load_file(str(tmp_path / "ddp" / "module.safetensors"))
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-5
    # training moved the (zero-initialised) output layers, so the agreement is not vacuous
    assert any(not torch.equal(a[k], torch.zeros_like(a[k])) for k in a if "Wout" in k)


COLLECTIVES = """
import json, os, sys
import torch, torch.distributed as dist
from nectar.training.distributed import all_ranks_agree, all_reduce_sum, dist_info, init_from_env, reduce_device
info = init_from_env()
if torch.cuda.is_available() and os.environ.get("NECTAR_TEST_BACKEND") == "nccl":
    assert dist.get_backend() == "nccl"
total = all_reduce_sum([1.0, float(info.rank)], info)
agree = all_ranks_agree(info.rank == 0, info)
print(json.dumps({"rank": info.rank, "device": str(reduce_device(info)), "total": total, "agree": agree}), flush=True)
dist.destroy_process_group()
"""


def _torchrun(nproc: int, env_extra: dict | None = None, timeout: int = 120):
    import os

    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env_extra or {})}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "--no-python", sys.executable, "-c", COLLECTIVES]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def _ranks(proc) -> list[dict]:
    """Each rank's JSON object. The ranks share one stdout pipe, so their writes can interleave on a
    line (``{rank 1}{rank 0}\n\n``): objects are decoded where they start, not line by line."""
    decoder, out, text = json.JSONDecoder(), [], proc.stdout
    start = text.find('{"rank"')
    while start != -1:
        obj, end = decoder.raw_decode(text, start)
        out.append(obj)
        start = text.find('{"rank"', end)
    return sorted(out, key=lambda r: r["rank"])


def test_collectives_on_two_gloo_processes_reduce_cpu_tensors():
    proc = _torchrun(2, {"CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = _ranks(proc)
    assert [r["device"] for r in ranks] == ["cpu", "cpu"]  # gloo: CPU tensors
    assert all(r["total"] == [2.0, 1.0] for r in ranks)
    assert all(r["agree"] is False for r in ranks)  # rank 1's flag is false


@pytest.mark.gpu
def test_collectives_under_nccl_reduce_cuda_tensors():
    """GPU figures owed: not run here (no GPU). Two ranks need two GPUs (NCCL refuses two ranks on one)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    nproc = min(2, torch.cuda.device_count())
    proc = _torchrun(nproc, {"NECTAR_TEST_BACKEND": "nccl"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = _ranks(proc)
    assert len(ranks) == nproc
    if nproc == 2:
        assert [r["device"] for r in ranks] == ["cuda:0", "cuda:1"]
        assert all(r["total"] == [2.0, 1.0] for r in ranks)
