import os

# On a shared 2-core machine torch's default spin-waiting threads slow everything down ~10x.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(2)

from sample_document import DOC  # noqa: E402


@pytest.fixture(scope="session")
def tiny_llama():
    from nectar.base_model import load_base_model
    from nectar.schemas import ModelConfig

    return load_base_model(ModelConfig(name="tiny:llama", device="cpu"))


@pytest.fixture(scope="session")
def tiny_qwen2():
    from nectar.base_model import load_base_model
    from nectar.schemas import ModelConfig

    return load_base_model(ModelConfig(name="tiny:qwen2", device="cpu"))


@pytest.fixture(scope="session")
def tiny_qwen3():
    from nectar.base_model import load_base_model
    from nectar.schemas import ModelConfig

    return load_base_model(ModelConfig(name="tiny:qwen3", device="cpu"))


# RoPE-scaled tiny models for the oracle and capture checks: the shorthand model.yarn_factor, and the
# paper preset's setting for Qwen3 (YaRN x4 over a 32,768-token pretraining window, paper §4.1).


@pytest.fixture(scope="session")
def tiny_llama_yarn():
    from nectar.base_model import load_base_model
    from nectar.schemas import ModelConfig

    return load_base_model(ModelConfig(name="tiny:llama", device="cpu", yarn_factor=2.0))


@pytest.fixture(scope="session")
def tiny_qwen3_yarn():
    from nectar.base_model import load_base_model
    from nectar.schemas import ModelConfig

    from nectar.schemas.presets import load_config

    paper = load_config("paper").model.rope_scaling
    return load_base_model(ModelConfig(name="tiny:qwen3", device="cpu", rope_scaling=paper))


@pytest.fixture(scope="session")
def smollm2():
    from nectar.base_model import load_base_model
    from nectar.schemas import ModelConfig

    return load_base_model(ModelConfig(name="embedded:smollm2-135m", device="cpu"))


@pytest.fixture
def document() -> str:
    return DOC


@pytest.fixture(scope="session")
def kvpress_env():
    """kvpress's venv, built on first use (~1–3 min on a fresh machine); the tests that need it skip,
    printing why, when it cannot be built (e.g. no PyPI)."""
    from nectar.kvpress import KvpressEnvError, ensure_env

    try:
        return ensure_env()
    except KvpressEnvError as exc:
        print(f"kvpress environment unavailable: {exc}")
        pytest.skip(f"kvpress environment unavailable: {exc}")
