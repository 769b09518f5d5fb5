"""kvpress (NVIDIA's KV-cache compression library) as a baseline family of ``nectar compare``.

env.py     the kvpress venv, made on first use with pinned versions (~/.cache/nectar/kvpress-venv)
worker.py  run by that venv's python: prefill under a press, teacher-force every pair (standalone)
bridge.py  this side: the run's exact token ids and our full model's log-probs in, per-pair sums out
"""
from .bridge import (GUARD_TOLERANCE, BridgeResult, KvpressError, PressJob, PressResult,  # noqa: F401
                     compression_ratio, score_presses)
from .env import KvpressEnvError, ensure_env, read_env  # noqa: F401
from .worker import PRESSES, UNAVAILABLE  # noqa: F401
