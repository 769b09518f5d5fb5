import pytest


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
