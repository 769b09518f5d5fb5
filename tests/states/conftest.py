"""Shared by the state-method tests: real targets of the tiny model on the training tests' document."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "training"))
from targets_fixture import DOC, make_targets  # noqa: E402


@pytest.fixture(scope="module")
def tiny_targets(tiny_llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("targets")
    layout, kv, _ = make_targets(tiny_llama, DOC, out)
    return tiny_llama, layout, kv, str(out)
