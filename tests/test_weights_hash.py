"""weights_hash covers ALL weights: every tensor of an in-process model, every byte of a model
folder (cached per folder, re-read when a file changes)."""
from __future__ import annotations

import copy
import json
import os

import torch

from nectar.base_model import WEIGHTS_HASH_CACHE, _weights_fingerprint, folder_digest


def test_every_tensor_element_counts(tiny_llama):
    model = copy.deepcopy(tiny_llama.model)
    before = _weights_fingerprint(model)
    assert before == tiny_llama.weights_hash
    # the old fingerprint read every 16th tensor's first 4096 values: change one it never saw
    name, last = list(model.named_parameters())[-2]
    with torch.no_grad():
        last.view(-1)[-1] += 1e-3
    assert _weights_fingerprint(model) != before, name


def test_model_folder_is_hashed_whole_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("NECTAR_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text('{"hidden_size": 64}')
    weights = folder / "model.safetensors"
    weights.write_bytes(os.urandom(3 << 20))
    first = folder_digest(folder)
    assert folder_digest(folder) == first

    cache = tmp_path / "cache" / WEIGHTS_HASH_CACHE
    entries = json.loads(cache.read_text())
    entries[str(folder.resolve())]["digest"] = "from-the-cache"
    cache.write_text(json.dumps(entries))
    assert folder_digest(folder) == "from-the-cache"  # unchanged files: not read again

    st = weights.stat()
    with open(weights, "r+b") as f:  # one byte deep inside the weights, same size, old mtime restored
        f.seek(2 << 20)
        byte = f.read(1)
        f.seek(2 << 20)
        f.write(bytes([byte[0] ^ 1]))
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert folder_digest(folder) not in (first, "from-the-cache")
