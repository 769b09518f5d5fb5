from __future__ import annotations

import pytest
import torch

from nectar.models import load_base_model
from nectar.schemas.config import ModelConfig


@pytest.fixture(scope="module", autouse=True)
def _threads(request):
    """One thread for the tiny model (its ops are too small to split, and spin-waiting OpenMP
    threads on a shared 2-core machine make them ~10x slower); two for the embedded model.
    Restored afterwards: other test packages rely on the session's setting."""
    before = torch.get_num_threads()
    torch.set_num_threads(2 if request.node.get_closest_marker("slow") else 1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny():
    return load_base_model(ModelConfig(name="tiny:llama"))
