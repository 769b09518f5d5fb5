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
