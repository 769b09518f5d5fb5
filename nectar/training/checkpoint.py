"""Atomic training checkpoints: everything a run needs to continue bit-for-bit.

One file, ``checkpoints/last.pt``, replaced atomically (temp file + rename), so a kill mid-write
leaves the previous checkpoint intact. It holds the module, optimizer and scheduler states, the
RNG states, the step (the data order is a pure function of seed and step), the log rows so far
and a fingerprint of what was being trained: a checkpoint of another configuration is not resumed.
"""
from __future__ import annotations

import io
import random
from typing import Any

import fsspec
import numpy as np
import torch

from ..storage import atomic_write

CHECKPOINT = "last.pt"


def rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])


def save_checkpoint(dir_url: str, state: dict[str, Any]) -> str:
    buf = io.BytesIO()
    torch.save(state, buf)
    url = f"{dir_url.rstrip('/')}/{CHECKPOINT}"
    atomic_write(url, buf.getvalue())
    return fsspec.core.url_to_fs(url)[1]


def load_checkpoint(dir_url: str, fingerprint: str) -> dict[str, Any] | None:
    """The checkpoint if one exists for this exact training setup, else None."""
    fs, path = fsspec.core.url_to_fs(f"{dir_url.rstrip('/')}/{CHECKPOINT}")
    if not fs.exists(path):
        return None
    with fs.open(path, "rb") as f:
        state = torch.load(io.BytesIO(f.read()), map_location="cpu", weights_only=False)
    if state.get("fingerprint") != fingerprint:
        return None  # another config / targets / model: start over (the stage re-runs from scratch)
    return state
