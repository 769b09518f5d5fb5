"""nectar/integrity.py: digests of output files, and safetensors bytes that are the same for the
same content in every process (the library orders its metadata map at random per process)."""
from __future__ import annotations

import hashlib
import subprocess
import sys

import torch
from safetensors.torch import load, save

from nectar.integrity import stable_safetensors

SAVE = """
import sys, numpy as np
from safetensors.numpy import save
from nectar.integrity import stable_safetensors
blob = save({"k.0": np.arange(6, dtype=np.float32).reshape(2, 3)},
            metadata={"model_hash": "abc", "doc_sha256": "d" * 64, "n": "7"})
sys.stdout.buffer.write(stable_safetensors(blob) if sys.argv[1] == "stable" else blob)
"""


def _blob(mode: str) -> bytes:
    return subprocess.run([sys.executable, "-c", SAVE, mode], capture_output=True, check=True).stdout


def test_same_tensors_and_metadata_give_the_same_bytes_in_every_process():
    stable = {hashlib.sha256(_blob("stable")).hexdigest() for _ in range(3)}
    assert len(stable) == 1
    back = load(_blob("stable"))
    assert torch.equal(back["k.0"], torch.arange(6.).reshape(2, 3))


def test_metadata_survives_and_is_sorted():
    blob = stable_safetensors(save({"x": torch.ones(3)}, metadata={"b": "2", "a": "1", "c": "3"}))
    n = int.from_bytes(blob[:8], "little")
    assert blob[8:8 + n].index(b'"a"') < blob[8:8 + n].index(b'"b"') < blob[8:8 + n].index(b'"c"')
    assert torch.equal(load(blob)["x"], torch.ones(3))
    plain = save({"x": torch.ones(3)})
    assert stable_safetensors(plain) == plain  # no metadata: untouched
