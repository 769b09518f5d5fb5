"""What a user reads when a command fails: one line and an exit code, the traceback only on ``--debug``.

    2  bad input: the document, the configuration, a preset or override, a model path, a run
       directory of another document, an artifact that is missing, unreadable or changed
    1  a stage failed while running (an unreachable server, a diverged training, a bug)
    3  the run directory is being written by another process (``--no-wait``)
  130  interrupted (Ctrl-C)

Every message names what is wrong, where, the limit when there is one, and the fix; stage failures
are recorded in the run directory (``<stage>/error.json``) and a re-run resumes.
"""
from __future__ import annotations

import sys
import traceback
from contextlib import contextmanager
from typing import Callable, Iterator

import typer

from ..orchestration.executor import StageError
from ..orchestration.lock import RunLocked

BAD_INPUT, STAGE_FAILED, LOCKED, INTERRUPTED = 2, 1, 3, 130


def _bad_input_types() -> tuple[type[BaseException], ...]:
    from ..documents import DocumentError
    from ..layout import ContextTooLongError
    from ..base_model import ModelLoadError
    from ..modules.io import ModuleMismatch
    from ..orchestration.context import StageInputError
    from ..schemas.presets import ConfigError
    from ..tables import ArtifactError

    return (DocumentError, ContextTooLongError, ConfigError, ArtifactError, StageInputError, ModelLoadError,
            ModuleMismatch, FileNotFoundError, IsADirectoryError, NotADirectoryError)


def classify(exc: BaseException) -> tuple[str, int]:
    """The one line and exit code for ``exc``."""
    stage = exc.stage if isinstance(exc, StageError) else None
    exc = exc.cause if isinstance(exc, StageError) else exc
    where = f"{stage}: " if stage else ""
    text = " ".join(str(exc).split("\n")).strip() or type(exc).__name__
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted; run the same command again to resume", INTERRUPTED
    if isinstance(exc, RunLocked):
        return text, LOCKED
    if isinstance(exc, _bad_input_types()):
        return f"{where}{text}", BAD_INPUT
    if stage:
        return (f"{stage} failed: {type(exc).__name__}: {text} — fix the cause and run the same command "
                "again (completed stages are cached)"), STAGE_FAILED
    return f"{type(exc).__name__}: {text}", STAGE_FAILED


@contextmanager
def reported(debug: bool, echo: Callable[[str], None] | None = None) -> Iterator[None]:
    """Turn any exception raised in the block into one line on stderr and ``typer.Exit(code)``;
    with ``debug`` the traceback comes first."""
    try:
        yield
    except (typer.Exit, typer.Abort):
        raise
    except BaseException as exc:  # noqa: BLE001 - this is the top of the command
        line, code = classify(exc)
        if debug:
            traceback.print_exception(exc, file=sys.stderr)
        elif code == STAGE_FAILED and not isinstance(exc, StageError):
            line += " (--debug shows the traceback)"  # not a stage's: nothing recorded in the run
        (echo or (lambda m: print(m, file=sys.stderr)))(f"error: {line}")
        raise typer.Exit(code) from None
