from __future__ import annotations

import pytest
import torch

from nectar.models import load_base_model
from nectar.schemas.config import ModelConfig


@pytest.fixture(scope="session", autouse=True)
def _two_threads():
    torch.set_num_threads(2)  # the CI machine has 2 cores


@pytest.fixture(scope="session")
def tiny():
    return load_base_model(ModelConfig(name="tiny:llama"))
