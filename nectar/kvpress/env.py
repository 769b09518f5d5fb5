"""The kvpress environment: a venv of its own, made on first use with pinned versions.

kvpress 0.5.5 needs ``transformers<5.3`` while this project runs a newer one, so it cannot share the
project's venv. ``ensure_env()`` builds ``$NECTAR_CACHE/kvpress-venv`` (default ~/.cache/nectar) once:

    python -m venv DIR
    DIR/bin/pip install torch==2.13.0                          # the CPU build pip finds first
    DIR/bin/pip install "transformers<5.3" kvpress==0.5.5

and writes ``DIR/nectar-env.json`` (the pins, build seconds, size) last, so a half-built venv is
rebuilt rather than used. A build that fails raises ``KvpressEnvError`` with one line naming the
failing step and the fix; ``nectar compare`` then goes on without the kvpress rows and says so.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ..base_model import cache_dir

TORCH_PIN = "torch==2.13.0"
KVPRESS_PINS = ("transformers<5.3", "kvpress==0.5.5")
MARKER = "nectar-env.json"
BUILD_TIMEOUT_S = 1800


class KvpressEnvError(RuntimeError):
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


def _dir_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and not p.is_symlink())


def _fix(root: Path) -> str:
    return (f"fix: make PyPI reachable (or a wheel mirror in pip's config) and retry, or build it by hand: "
            f"python -m venv {root} && {root}/bin/pip install {TORCH_PIN} && "
            f"{root}/bin/pip install 'transformers<5.3' kvpress==0.5.5")


def _step(cmd: list[str], what: str, root: Path) -> None:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise KvpressEnvError(f"kvpress venv: {what} failed ({type(exc).__name__}); {_fix(root)}") from None
    if proc.returncode != 0:
        last = next((ln for ln in reversed(proc.stderr.strip().splitlines()) if ln.strip()), "no output")
        raise KvpressEnvError(f"kvpress venv: {what} failed ({last.strip()[:300]}); {_fix(root)}")


def read_env(root: Path | None = None) -> KvpressEnv | None:
    """The built venv, or None when it is missing, half-built or built with other pins."""
    root = root or env_dir()
    try:
        facts = json.loads((root / MARKER).read_text())
    except (OSError, ValueError):
        return None
    python = root / "bin" / "python"
    if facts.get("pins") != _pins() or not python.exists():
        return None
    return KvpressEnv(root, python, facts)


def ensure_env(root: Path | None = None, log=print) -> KvpressEnv:
    """The kvpress venv, built on first use (~1–3 min, ~1.4 GB); raises KvpressEnvError."""
    root = root or env_dir()
    env = read_env(root)
    if env is not None:
        return env
    log(f"building the kvpress environment in {root} ({', '.join(_pins())}); once, 1–3 minutes")
    if root.exists():
        shutil.rmtree(root)  # a half-built or outdated venv
    root.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    pip = [str(root / "bin" / "python"), "-m", "pip", "install", "--quiet"]
    _step([sys.executable, "-m", "venv", str(root)], "python -m venv", root)
    _step([*pip, TORCH_PIN], f"pip install {TORCH_PIN}", root)
    _step([*pip, *KVPRESS_PINS], "pip install " + " ".join(KVPRESS_PINS), root)
    facts = {"pins": _pins(), "build_s": round(time.perf_counter() - t0, 1), "bytes": _dir_bytes(root),
             "python": sys.version.split()[0]}
    (root / MARKER).write_text(json.dumps(facts, indent=1))
    log(f"kvpress environment ready in {facts['build_s']:.0f} s ({facts['bytes'] / 1e9:.2f} GB)")
    return KvpressEnv(root, root / "bin" / "python", facts)
