"""The serving engines ``nectar serve --engine NAME`` chooses from, by name (docs/architecture.md
§adding-a-serving-engine).

interface.py    what an engine is: ``ServingEngine`` (name, help, ``serve(run_dirs, opts, log)``),
                ``ServeOptions`` (the command's options), ``EngineError`` (one line, exit 1)
torch.py        this project's decode engine (the default)
vllm.py         vLLM with each document's plain-KV state (the server itself is ``nectar.vllm``)
vllm_export.py  a run's state exported for vLLM (reads the run directory, so it lives here)

``nectar serve`` imports this package when it runs (not for ``--help``).
"""
from __future__ import annotations

from .interface import EngineError, EngineUsageError, ServeOptions, ServingEngine
from .torch import TorchEngine
from .vllm import VLLMEngine

__all__ = ["ENGINES", "EngineError", "EngineUsageError", "ServeOptions", "ServingEngine", "engine", "unknown_engine"]

# One line per engine: the name --engine takes → the engine.
ENGINES: dict[str, ServingEngine] = {
    "torch": TorchEngine(),
    "vllm": VLLMEngine(),
}


def unknown_engine(name: str) -> str:
    """The one-line error for an engine name not in ``ENGINES``."""
    names = list(ENGINES)
    choices = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
    return f"--engine {name!r}: choose {choices}"


def engine(name: str) -> ServingEngine:
    """The engine registered under ``name``; KeyError (with the one-line message) when there is none."""
    try:
        return ENGINES[name]
    except KeyError:
        raise KeyError(unknown_engine(name)) from None
