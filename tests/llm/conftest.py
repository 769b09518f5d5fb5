from __future__ import annotations

import pytest
import torch

from nectar.base_model import load_base_model
from nectar.schemas.config import ModelConfig


@pytest.fixture(scope="module", autouse=True)
def _threads():
    """One thread: the tiny model's ops are too small to split, and when several test processes
    share the 2 cores, spin-waiting OpenMP threads (torch's default OMP_WAIT_POLICY) make even the
    embedded model 10-20x slower than one thread. Restored afterwards: other test packages rely on
    the session's setting."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny():
    return load_base_model(ModelConfig(name="tiny:llama"))
