"""Virtual environments of their own, built once from pinned versions: the one builder.

Some tools cannot share this project's environment (vLLM's CPU build and kvpress each pin a
transformers this project is outside of), so each gets a venv under ``~/.cache/nectar``, built on
first use by ``ensure(spec)``:

    python -m venv --clear ROOT
    ROOT/bin/python <step>          for each step of the spec (pip installs, one pin group each; a check)
    ROOT/<stamp>                    written last: {"pins", "build_s", "bytes", "python"}

The stamp is written last, so a half-built venv is never taken for a built one; ``ready(spec)`` is
"the stamp records the spec's pins and the venv's python exists" (a pin changed: built again). Two
processes asking at once build it once (a file lock beside the venv). Every step's output goes to
the spec's log; a step that fails raises the spec's error class with one line: the venv, the step,
its exit and last output line, the fix, and the log's path.

    VenvSpec(name="vLLM", root=..., stamp=".nectar-vllm-installed", pins=(...), steps=(...), ...)
"""
from __future__ import annotations

import fcntl
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path


class VenvError(RuntimeError):
    """A venv cannot be built (one line: which venv, which step, why, the fix, the log)."""


def pip_install(*args: str) -> tuple[str, ...]:
    """A step: ``pip install -q ARGS`` with the venv's python."""
    return ("-m", "pip", "install", "-q", *args)


@dataclass(frozen=True)
class VenvSpec:
    name: str  # for messages: "vLLM", "kvpress"
    root: Path  # the venv's directory
    stamp: str  # the readiness stamp's file name inside root
    pins: tuple[str, ...]  # what the stamp records; a venv built from other pins is built again
    steps: tuple[tuple[str, ...], ...]  # arguments to the venv's python, run in order
    fix: str  # the one-line fix named in an error
    log: Path  # every step's output, appended
    base_python: str = sys.executable  # the interpreter the venv is made from
    error: type[Exception] = VenvError  # what a failed build raises
    step_timeout_s: float | None = None  # a step running longer fails (None: no limit)

    @property
    def python(self) -> Path:
        return self.root / "bin" / "python"


def read_stamp(spec: VenvSpec) -> dict | None:
    """The stamp of a venv built from the spec's pins whose python is there, or None."""
    try:
        facts = json.loads((spec.root / spec.stamp).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(facts, dict) or facts.get("pins") != list(spec.pins) or not spec.python.exists():
        return None
    return facts


def ready(spec: VenvSpec) -> bool:
    return read_stamp(spec) is not None


def ensure(spec: VenvSpec, echo=None) -> dict:
    """The venv's stamp, building the venv first unless it is ready. Raises ``spec.error``."""
    facts = read_stamp(spec)
    if facts is not None:  # the fast path writes nothing
        return facts
    spec.root.parent.mkdir(parents=True, exist_ok=True)
    spec.log.parent.mkdir(parents=True, exist_ok=True)
    with open(spec.root.parent / f".{spec.root.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        facts = read_stamp(spec)  # another process built it while this one waited
        if facts is not None:
            return facts
        if echo is not None:
            echo(f"building the {spec.name} environment in {spec.root} ({', '.join(spec.pins)}); once")
        started = time.monotonic()
        _run(spec, [spec.base_python, "-m", "venv", "--clear", str(spec.root)])
        for step in spec.steps:
            _run(spec, [str(spec.python), *step])
        facts = {"pins": list(spec.pins), "build_s": round(time.monotonic() - started, 1),
                 "bytes": _dir_bytes(spec.root), "python": sys.version.split()[0]}
        (spec.root / spec.stamp).write_text(json.dumps(facts, indent=1))
        if echo is not None:
            echo(f"{spec.name} environment ready in {facts['build_s']:.0f} s ({facts['bytes'] / 1e9:.2f} GB)")
        return facts


def _run(spec: VenvSpec, cmd: list[str]) -> None:
    shown = " ".join(["python", *cmd[1:]])
    with open(spec.log, "a") as log:
        log.write(f"$ {' '.join(cmd)}\n")
        log.flush()
        offset = log.tell()
        try:
            rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 timeout=spec.step_timeout_s)
            why = f"exit {rc}"
        except subprocess.TimeoutExpired:
            rc, why = -1, f"over {spec.step_timeout_s:g} s"
        except OSError as exc:
            rc, why = -1, type(exc).__name__
    if rc != 0:
        last = _last_line(spec.log, offset)
        raise spec.error(f"{spec.name} venv: `{shown}` failed ({why}{': ' + last if last else ''}); "
                         f"{spec.fix}; log {spec.log}")


def _last_line(path: Path, offset: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            lines = [ln.strip() for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1][:300] if lines else ""


def _dir_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and not p.is_symlink())
