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


def test_streamed_safetensors_are_byte_identical_to_the_library_file():
    """write_stable_safetensors (one tensor at a time, for multi-GB document KVs) must give the
    very bytes the in-memory path gave: the document KV's digest feeds cache keys."""
    import io

    from nectar.integrity import write_stable_safetensors

    g = torch.Generator().manual_seed(0)
    cases = [
        ({f"{kv}.{i}": torch.randn(2, 5, 4, generator=g).to(torch.bfloat16) for kv in "kv" for i in range(12)},
         {"n": "5", "model_hash": "abc", "doc": "d" * 64}),
        ({"w": torch.randn(3, 7, generator=g), "b": torch.randn(7, generator=g).half(),
          "ids": torch.arange(5, dtype=torch.int64), "e": torch.zeros(0, 3)}, {}),
        ({"x": torch.randn(1, 3, generator=g)}, {"only": "one"}),  # a header that needs padding
    ]
    for tensors, meta in cases:
        f = io.BytesIO()
        write_stable_safetensors(f, tensors, meta)
        want = stable_safetensors(save(tensors, metadata=meta or None))
        assert f.getvalue() == want
        back = load(f.getvalue())
        assert all(torch.equal(back[k], v) for k, v in tensors.items())


def test_save_doc_kv_streams_the_same_file_and_loads_back(tmp_path):
    from nectar.attention.doc_kv import DocKV, read_doc_kv_meta, save_doc_kv

    keys = [torch.randn(3, 10, 8) for _ in range(11)]
    values = [torch.randn(3, 10, 8) for _ in range(11)]
    url = str(tmp_path / "doc_kv.safetensors")
    save_doc_kv(DocKV(keys, values), url, {"n": 10, "model": "m"})
    raw = (tmp_path / "doc_kv.safetensors").read_bytes()
    tensors = {f"k.{i}": k for i, k in enumerate(keys)} | {f"v.{i}": v for i, v in enumerate(values)}
    assert raw == stable_safetensors(save(tensors, metadata={"n": "10", "model": "m"}))
    assert read_doc_kv_meta(url) == {"model": "m", "n": "10"}
