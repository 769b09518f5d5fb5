"""What a serving engine is to ``nectar serve``: a name, a line of help, and ``serve(run_dirs, opts, log)``.

``nectar serve RUN_DIR… --engine NAME`` builds one ``ServeOptions`` from its command-line options
(every engine sees all of them and uses its own), looks ``NAME`` up in ``ENGINES``
(``nectar/serving/engines/__init__.py``) and calls its ``serve``, which runs until the server is
stopped (SIGTERM/SIGINT). An engine reports what the user must fix by raising ``EngineError`` (one
line; exit 1) or ``EngineUsageError`` (a bad option; exit 2); ``log`` prints a line for the user.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, runtime_checkable


class EngineError(RuntimeError):
    """One line for the user; ``nectar serve`` prints it and exits with ``exit_code``."""

    exit_code = 1


class EngineUsageError(EngineError):
    """An option the engine cannot take (exit 2, as for any bad option)."""

    exit_code = 2


@dataclass(frozen=True)
class ServeOptions:
    """``nectar serve``'s options, as given (``nectar serve --help`` says what each means)."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: tuple[str, ...] = ()  # as given (--api-key); NECTAR_API_KEY is read by runner.api_keys
    allow_unauthenticated: bool = False
    max_batch: int = 8
    max_queue: int = 64
    max_tokens: int = 512
    max_prompt_tokens: int = 4096
    max_body_bytes: int = 1_000_000
    max_stop: int = 4
    max_module_bytes: int = 2_000_000_000
    keep_dequantized: bool = True
    batch_wait_ms: float = 5.0
    shutdown_timeout: float = 120.0
    served_name: tuple[str, ...] = ()
    # --engine vllm
    dtype: str = "bfloat16"
    max_model_len: int = 4096
    kv_cache_gib: int = 2
    enforce_eager: bool = False
    state: str | None = None


Log = Callable[[str], None]


@runtime_checkable
class ServingEngine(Protocol):
    name: str  # what --engine takes
    help: str  # one line for `nectar serve --help`

    def serve(self, run_dirs: list[str], opts: ServeOptions, log: Log) -> None:
        """Serve the runs until stopped; raise EngineError (one line) for what the user must fix."""
        ...
