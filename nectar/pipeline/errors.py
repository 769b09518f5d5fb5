"""What a user reads when a command fails: one line and an exit code, the traceback only on ``--debug``.

    2  bad input: the document, the configuration, a preset or override, a model path, a run
       directory of another document, an artifact that is missing, unreadable or changed
    1  a stage failed while running (an unreachable server, a diverged training, a bug)
    3  the run directory is being written by another process (``--no-wait``)
  130  interrupted by SIGINT (Ctrl-C); 143 by SIGTERM (the line names the stage and the command
       that resumes it; a lost Prefect server is 1)

Every message names what is wrong, where, the limit when there is one, and the fix; stage failures
are recorded in the run directory (``<stage>/error.json``) and a re-run resumes.
"""
from __future__ import annotations

import shlex
import sys
import traceback
from contextlib import contextmanager
from typing import Callable, Iterator

import typer

from .. import shutdown
from ..orchestration.executor import StageError
from ..orchestration.lock import RunLocked

BAD_INPUT, STAGE_FAILED, LOCKED, INTERRUPTED = 2, 1, 3, 130


class OrchestratorUnreachable(RuntimeError):
    """PREFECT_API_URL names a server that does not answer (the line says how to fix it)."""


def _bad_input_types() -> tuple[type[BaseException], ...]:
    from ..documents import DocumentError
    from ..layout import ContextTooLongError
    from ..base_model import ModelLoadError
    from ..modules.io import ModuleMismatch
    from ..orchestration.context import StageInputError
    from ..orchestration.corpus import CorpusError
    from ..schemas.presets import ConfigError
    from ..tables import ArtifactError

    return (DocumentError, ContextTooLongError, ConfigError, ArtifactError, StageInputError, ModelLoadError,
            ModuleMismatch, CorpusError, FileNotFoundError, IsADirectoryError, NotADirectoryError)


def interrupted_line(exc: BaseException, resume: str | None = None) -> tuple[str, int]:
    """The line and exit code of a run that was asked to stop: what stopped it, during which stage,
    and the command that resumes it."""
    first, stage = shutdown.stopped_by()
    stop = first or exc
    stage = stage or (exc.stage if isinstance(exc, StageError) else None)
    where = f"during {stage}" if stage else "while no stage was running"
    again = f"resume with: {resume}" if resume else "run the same command again to resume"
    if isinstance(stop, shutdown.Interrupted) and stop.reason:
        return f"error: {stop.reason} {where}; the run stopped (finished work is kept): {again}", stop.exit_code
    signum = stop.signum if isinstance(stop, shutdown.Interrupted) else 2
    code = stop.exit_code if isinstance(stop, shutdown.Interrupted) else INTERRUPTED
    return f"interrupted by {shutdown.signal_name(signum)} {where}; {again}", code


def classify(exc: BaseException, resume: str | None = None) -> tuple[str, int]:
    """The one line and exit code for ``exc`` (``resume``: the command that resumes an interrupted run)."""
    stage = exc.stage if isinstance(exc, StageError) else None
    exc = exc.cause if isinstance(exc, StageError) else exc
    where = f"{stage}: " if stage else ""
    text = " ".join(str(exc).split("\n")).strip() or type(exc).__name__
    if isinstance(exc, KeyboardInterrupt):
        line, code = interrupted_line(exc, resume)
        return line.removeprefix("error: "), code
    if isinstance(exc, RunLocked):
        return text, LOCKED
    if isinstance(exc, OrchestratorUnreachable):
        return text, STAGE_FAILED
    if isinstance(exc, _bad_input_types()):
        return f"{where}{text}", BAD_INPUT
    if stage:
        return (f"{stage} failed: {type(exc).__name__}: {text} — fix the cause and run the same command "
                "again (completed stages are cached)"), STAGE_FAILED
    return f"{type(exc).__name__}: {text}", STAGE_FAILED


def resume_command(argv: list[str], run_root: str | None) -> str:
    """The command that resumes an interrupted one: the same arguments, with the run directory named
    (``--from``/``--force`` dropped: they would redo the finished stages and throw the partial work away)."""
    args, skip = [], False
    for i, a in enumerate(argv):
        if skip:
            skip = False
            continue
        if a in ("--from",):
            skip = True
            continue
        if a.startswith("--from=") or a == "--force":
            continue
        args.append(a)
    if run_root and "--run-dir" not in args and not any(a.startswith("--run-dir=") for a in args) \
            and args and args[0] in ("run", "sweep"):
        args += ["--run-dir", run_root]
    return "nectar " + " ".join(shlex.quote(a) for a in args)


@contextmanager
def reported(debug: bool, echo: Callable[[str], None] | None = None,
             resume: Callable[[], str | None] = lambda: None) -> Iterator[None]:
    """Turn any exception raised in the block into one line on stderr and ``typer.Exit(code)``;
    with ``debug`` the traceback comes first. An interrupted run's line has no ``error:`` prefix
    when a signal stopped it (the user asked for it)."""
    try:
        yield
    except (typer.Exit, typer.Abort):
        raise
    except BaseException as exc:  # noqa: BLE001 - this is the top of the command
        # Once the run was asked to stop, whatever surfaces (Prefect's TerminationSignal, a failed API
        # call) is that stop.
        stopping = isinstance(exc, KeyboardInterrupt) or shutdown.stopped_by()[0] is not None
        line, code = interrupted_line(exc, resume()) if stopping else classify(exc)
        line = line.removeprefix("error: ")
        if debug:
            traceback.print_exception(exc, file=sys.stderr)
        elif code == STAGE_FAILED and not stopping and not isinstance(exc, (StageError, OrchestratorUnreachable)):
            line += " (--debug shows the traceback)"  # not a stage's: nothing recorded in the run
        signalled = stopping and code > 128
        (echo or (lambda m: print(m, file=sys.stderr)))(line if signalled else f"error: {line}")
        raise typer.Exit(code) from None
