"""Session fixture: a real targets group of tiny:llama (see targets_fixture.py)."""
import pytest

from targets_fixture import DOC, make_targets


@pytest.fixture(scope="session")
def tiny_targets(tiny_llama, tmp_path_factory):
    """(targets dir, layout, doc_kv, doc sha) for tiny:llama."""
    out = tmp_path_factory.mktemp("targets")
    layout, kv, sha = make_targets(tiny_llama, DOC, out)
    return str(out), layout, kv, sha
