"""One-line notices about the vLLM servers (started, died, restarted, replaced by the local loop).

They are written to stderr directly: a stage runs inside a Prefect flow with ``log_prints``, whose
patched ``print`` turns every print, to stdout or stderr, into a flow-run log record that `nectar run`
keeps off the terminal; a server that died and was restarted is something the person at the terminal
must see. The stage manifest keeps the
same facts (``counts.llm.restarts``, ``counts.llm.fallback``).
"""
from __future__ import annotations

import sys


def say(message: str) -> None:
    sys.stderr.write(message + "\n")
    sys.stderr.flush()
