"""FAILURE INJECTION: run the tiny pipeline on a run directory and SIGKILL this process inside STAGE.

    python kill_injector.py RUN_DIR STAGE

The kill lands at a fixed point of the stage's own work, after some of it is on disk, so the
resume has partial files to pick up: in the middle of an atomic write (its temp file written, the
rename not done), before the second shard of the targets group, before the second training
checkpoint. Nothing is cleaned up: no finally block, no atexit, the run-directory lock stays.
"""
from __future__ import annotations

import os
import signal
import sys

from fsspec.implementations.local import LocalFileSystem


def _kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _on_call(owner, name: str, nth: int, when=lambda *a, **k: True) -> None:
    """Replace ``owner.name`` so its ``nth`` matching call kills the process before it runs."""
    real = getattr(owner, name)
    calls = {"n": 0}

    def wrapper(*args, **kwargs):
        if when(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == nth:
                _kill()
        return real(*args, **kwargs)

    setattr(owner, name, wrapper)


def _renaming_into(fragment: str):
    return lambda fs, src, dst, *a, **k: fragment in str(dst) and str(src).endswith(".tmp")


# stage -> (what to wrap, which call): each leaves real partial state behind
POINTS = {
    "chunk": lambda: _on_call(LocalFileSystem, "mv", 1, _renaming_into("/chunk/chunks.parquet")),
    "synthesize": lambda: _on_call(LocalFileSystem, "mv", 3, _renaming_into("/synthesize/partial/")),
    "verify": lambda: _on_call(LocalFileSystem, "mv", 2, _renaming_into("/verify/partial/")),
    "targets": lambda: _on_call(__import__("nectar.stages.targets", fromlist=["_ShardWriter"])._ShardWriter,
                                "_write", 2),
    "train": lambda: _on_call(__import__("nectar.training.loop", fromlist=["loop"]), "save_checkpoint", 2),
    "evaluate": lambda: _on_call(LocalFileSystem, "mv", 2, _renaming_into("/evaluate/")),
}


def main() -> None:
    run_dir, stage = sys.argv[1], sys.argv[2]
    sys.path.insert(0, os.path.dirname(__file__))
    from matrix_helpers import run_pipeline

    POINTS[stage]()
    out = run_pipeline(run_dir)
    print(f"NOT KILLED: {out.statuses} {out.user_line}", flush=True)
    sys.exit(5)


if __name__ == "__main__":
    main()
