"""One call path for a transformers model's KV-cache argument across the versions this project meets.

transformers renamed the forward argument ``past_key_values`` to ``cache`` (5.2x: the old name still
works with a deprecation warning; removed in 5.40). This project resolves a recent 5.x, the kvpress
venv pins 5.2 (``past_key_values`` only). ``cache_kwargs(module, cache)`` names the argument the
module's own ``forward`` declares, so the same call works on either side of the rename.

Dependency-free on purpose: the kvpress worker (nectar/kvpress/worker.py) loads this file by path.
"""
from __future__ import annotations

import functools
import inspect


@functools.lru_cache(maxsize=None)
def _cache_arg(forward_owner: type) -> str:
    params = inspect.signature(forward_owner.forward).parameters  # follows a deprecation wrapper's __wrapped__
    return "cache" if "cache" in params else "past_key_values"


def cache_kwargs(module, cache) -> dict:
    """``{"cache": cache}`` or ``{"past_key_values": cache}``: what ``module.forward`` accepts."""
    return {_cache_arg(type(module)): cache}
