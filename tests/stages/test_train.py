"""The train stage as the pipeline calls it: outputs and spec, input checks, and resuming after a
real SIGKILL of the training process."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).parents[1] / "training"))
from targets_fixture import DOC, make_targets  # noqa: E402

from nectar.modules.io import load_module, read_spec  # noqa: E402
from nectar.schemas.artifacts import TrainLogRow  # noqa: E402
from nectar.schemas.config import ModuleConfig, TrainConfig  # noqa: E402
from nectar.stages.train import TRAIN_OUTPUTS, train  # noqa: E402
from nectar.training.fit import TrainInputError  # noqa: E402
from nectar.tables import read_table  # noqa: E402

CFG = TrainConfig(samples=96, batch_size=16, eval_every=3, checkpoint_every=3, peak_lr=3e-3,
                  module=ModuleConfig(rho=0.25, depths=(0, 2, 2)))


@pytest.fixture(scope="module")
def targets(tiny_llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("stage-targets")
    layout, kv, sha = make_targets(tiny_llama, DOC, out)
    return str(out), layout, kv, sha


def test_stage_writes_module_spec_and_log(tiny_llama, targets, tmp_path):
    url, layout, kv, sha = targets
    counts = train(url, CFG, tiny_llama, None, str(tmp_path))
    assert all((tmp_path / name).exists() for name in TRAIN_OUTPUTS)
    spec = read_spec(str(tmp_path))
    assert spec.doc_sha256 == sha and spec.n_context == layout.n and spec.base_model_hash == tiny_llama.weights_hash
    assert spec.kv_cache_bytes == 2 * layout.n * 16 * 2 * 2 * 4  # 2·n·d·L·Hkv float32 entries
    assert spec.n_params == 2 * sum(spec.per_layer_params)  # two KV heads per layer
    assert counts["kv_over_module"] == pytest.approx(spec.kv_cache_bytes / spec.module_bytes, rel=1e-2)
    module, _ = load_module(str(tmp_path), tiny_llama, sha)
    assert module.n_params() == spec.n_params
    rows = read_table(str(tmp_path / "train_log.parquet"), TrainLogRow)
    assert {r.split for r in rows} == {"train", "heldout"} and rows[-1].step == counts["steps"] == 6


def test_quadrature_needs_the_document_kv(tiny_llama, targets, tmp_path):
    cfg = CFG.model_copy(update={"module": ModuleConfig(arch="quadrature", rho=0.25)})
    with pytest.raises(TrainInputError, match="doc_kv"):
        train(targets[0], cfg, tiny_llama, None, str(tmp_path))
    counts = train(targets[0], cfg.model_copy(update={"samples": 32}), tiny_llama, targets[2], str(tmp_path))
    assert counts["steps"] == 2


def test_targets_of_another_model_are_refused(tiny_qwen3, targets, tmp_path):
    with pytest.raises(TrainInputError, match="weights hash"):
        train(targets[0], CFG, tiny_qwen3, None, str(tmp_path))


_CHILD = """
import sys, time, torch
torch.set_num_threads(2)  # as the parent (tests/conftest.py): same kernels, same bits
from nectar.base_model import load_base_model
from nectar.schemas import ModelConfig
from nectar.schemas.config import TrainConfig
from nectar.stages.train import train
cfg = TrainConfig.model_validate_json(sys.argv[3])
base = load_base_model(ModelConfig(name="tiny:llama"))
print("started", flush=True)
train(sys.argv[1], cfg, base, None, sys.argv[2], progress=lambda done, total: time.sleep(0.15))
"""


@pytest.mark.slow
def test_resume_after_sigkill_reaches_the_uninterrupted_result(tiny_llama, targets, tmp_path):
    cfg = CFG.model_copy(update={"samples": 640, "eval_every": 5, "checkpoint_every": 5})  # 40 steps
    killed = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, targets[0], str(killed), cfg.model_dump_json()],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ckpt = killed / "checkpoints" / "last.pt"
    deadline = time.time() + 240
    while time.time() < deadline:  # wait for a mid-run checkpoint, then kill without warning
        if ckpt.exists() and torch.load(ckpt, weights_only=False)["state"]["step"] >= 15:
            break
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (killed / "module.safetensors").exists()
    counts = train(targets[0], cfg, tiny_llama, None, str(killed))
    assert 15 <= counts["resumed_from_step"] < 40
    train(targets[0], cfg, tiny_llama, None, str(tmp_path / "straight"))
    a, b = load_file(str(killed / "module.safetensors")), load_file(str(tmp_path / "straight" / "module.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    ra = read_table(str(killed / "train_log.parquet"), TrainLogRow)
    rb = read_table(str(tmp_path / "straight" / "train_log.parquet"), TrainLogRow)
    assert ra == rb
    assert counts["train_loss"] == [r for r in rb if r.split == "train"][-1].loss
