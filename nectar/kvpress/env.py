"""The kvpress environment: a venv of its own, made on first use with pinned versions.

kvpress 0.5.5 needs ``transformers<5.3`` while this project runs a newer one, so it cannot share the
project's venv. ``ensure_env()`` builds ``$NECTAR_CACHE/kvpress-venv`` (default ~/.cache/nectar) once,
with the project's one venv builder (``nectar.venvs``):

    python -m venv DIR
    DIR/bin/pip install torch==2.13.0                          # the CPU build pip finds first
    DIR/bin/pip install "transformers<5.3" kvpress==0.5.5

and writes ``DIR/nectar-env.json`` (the pins, build seconds, size) last, so a half-built venv is
rebuilt rather than used. A build that fails raises ``KvpressEnvError`` with one line naming the
failing step and the fix (the steps' output is in ``kvpress-setup.log`` beside the venv);
``nectar compare`` then goes on without the kvpress rows and says so.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .. import venvs
from ..base_model import cache_dir

TORCH_PIN = "torch==2.13.0"
KVPRESS_PINS = ("transformers<5.3", "kvpress==0.5.5")
MARKER = "nectar-env.json"
BUILD_TIMEOUT_S = 1800


class KvpressEnvError(venvs.VenvError):
    """The kvpress venv cannot be built or used (one line: the step, the cause, the fix)."""


@dataclass(frozen=True)
class KvpressEnv:
    root: Path
    python: Path
    facts: dict


def env_dir() -> Path:
    return Path(os.environ.get("NECTAR_KVPRESS_VENV", cache_dir() / "kvpress-venv"))


def _pins() -> list[str]:
    return [TORCH_PIN, *KVPRESS_PINS]


def _fix(root: Path) -> str:
    return (f"fix: make PyPI reachable (or a wheel mirror in pip's config) and retry, or build it by hand: "
            f"python -m venv {root} && {root}/bin/pip install {TORCH_PIN} && "
            f"{root}/bin/pip install 'transformers<5.3' kvpress==0.5.5")


def venv_spec(root: Path | None = None) -> venvs.VenvSpec:
    root = root or env_dir()
    return venvs.VenvSpec(name="kvpress", root=root, stamp=MARKER, pins=tuple(_pins()),
                          steps=(venvs.pip_install(TORCH_PIN), venvs.pip_install(*KVPRESS_PINS)),
                          fix=_fix(root), log=root.parent / "kvpress-setup.log", error=KvpressEnvError,
                          step_timeout_s=BUILD_TIMEOUT_S)


def read_env(root: Path | None = None) -> KvpressEnv | None:
    """The built venv, or None when it is missing, half-built or built with other pins."""
    spec = venv_spec(root)
    facts = venvs.read_stamp(spec)
    return None if facts is None else KvpressEnv(spec.root, spec.python, facts)


def ensure_env(root: Path | None = None, log=print) -> KvpressEnv:
    """The kvpress venv, built on first use (~1–3 min, ~1.4 GB); raises KvpressEnvError."""
    spec = venv_spec(root)
    facts = venvs.ensure(spec, echo=log)
    return KvpressEnv(spec.root, spec.python, facts)
