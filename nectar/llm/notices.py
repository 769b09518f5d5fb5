"""One-line notices about the LLM servers (started, died, restarted, replaced by the local loop).

They go to stderr: a stage runs inside a Prefect flow with ``log_prints``, which turns a plain
``print`` into a flow-run log record that `nectar run` keeps off the terminal; a server that died
and was restarted is something the person at the terminal must see. The stage manifest keeps the
same facts (``counts.llm.restarts``, ``counts.llm.fallback``).
"""
from __future__ import annotations

import sys


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
