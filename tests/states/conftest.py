"""Shared by the state-method tests: real targets of the tiny model on the training tests' document."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "training"))
from targets_fixture import DOC, make_targets  # noqa: E402

from nectar.queries.recon import make_recon  # noqa: E402
from nectar.schemas.config import ProbesConfig, ReconConfig  # noqa: E402


@pytest.fixture(scope="module")
def tiny_targets(tiny_llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("targets")
    layout, kv, _ = make_targets(tiny_llama, DOC, out)
    return tiny_llama, layout, kv, str(out)


@pytest.fixture(scope="module")
def tiny(tiny_targets):
    """The tiny model, the document's layout and KV, and its whole-document reconstruction spans (span_words 12,
    nothing withheld): what the reconstruction-fitted methods read."""
    base, layout, kv, _ = tiny_targets
    spans = tuple((s.instruction, s.response) for s in make_recon(DOC, ReconConfig(span_words=12, withheld_fraction=0.0),
                                                                 ProbesConfig(block_units=1)))
    return base, layout, kv, spans
