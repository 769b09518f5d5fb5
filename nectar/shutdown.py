"""How a command stops when asked: SIGINT / SIGTERM handling, the registry of cleanups and child
processes, and the deadline after which the process exits whatever it is doing.

* The first SIGINT (Ctrl-C, to the process or its whole group) or SIGTERM raises ``Interrupted`` in
  the main thread: the stage unwinds through its ``finally`` blocks (its partial work is already on
  disk, written atomically), the run-directory lock is released, the command prints one line and
  exits 130 (SIGINT) or 143 (SIGTERM).
* If the process has not exited ``grace_s`` seconds later (a C call that does not return to the
  interpreter, an orchestrator that no longer answers), it exits anyway: the cleanups run, the
  ``forced_exit`` line is printed, ``os._exit``.
* A second SIGINT exits at once (the cleanups run, child processes are killed, not waited for).

A thread watches the signals through ``signal.set_wakeup_fd``, so the deadline and the second
Ctrl-C work even while the main thread is stuck inside a long C call that delays Python handlers.

Anything a command starts that must not outlive it — a temporary server, a local model server, a
worker process — registers here (``register_process`` / ``register``); the cleanups run in reverse
order on a normal exit (atexit), on a forced exit and on a second Ctrl-C. Child processes should be
started in their own session (``start_new_session=True``: a terminal's Ctrl-C must not kill them
before the command has used them to record its state) with ``die_with_parent`` as ``preexec_fn``
(Linux: they get SIGTERM if the command is SIGKILLed).

Only the standard library: any layer may register here.
"""
from __future__ import annotations

import _thread
import atexit
import ctypes
import os
import signal
import subprocess
import sys
import threading
from contextlib import contextmanager
from typing import Callable, Iterator

GRACE_S = 10.0  # after the first signal, the longest the process keeps running
PROCESS_GRACE_S = 5.0  # SIGTERM → SIGKILL for a registered child process
HANDLED = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """The command was asked to stop (a signal, or ``request_stop``); ``exit_code`` 128 + signal."""

    def __init__(self, signum: int = signal.SIGINT, reason: str | None = None, exit_code: int | None = None):
        self.signum, self.reason = signum, reason
        self.exit_code = 128 + signum if exit_code is None else exit_code
        super().__init__(reason or signal_name(signum))


def signal_name(signum: int) -> str:
    return {signal.SIGINT: "SIGINT (Ctrl-C)"}.get(signum) or signal.Signals(signum).name


class _State:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.cleanups: list[tuple[int, str, Callable[[bool], None]]] = []  # (id, name, fn(fast))
        self.next_id = 0
        self.first: Interrupted | None = None  # what asked the process to stop, first
        self.stage_at_stop: str | None = None
        self.activity: str | None = None  # the stage running now (``doing``)
        self.deadline: threading.Timer | None = None
        self.grace_s = GRACE_S
        self.forced_line: Callable[[Interrupted, str | None], str] | None = None
        self.cleaned = False
        self.raised = False  # the main thread's handler has raised: the stop is unwinding
        self.exiting = False  # exit_now is running: the line is printed
        self.synthetic_int = 0  # SIGINTs that request_stop sent to the main thread (not the user's)


_S = _State()


# ----- the registry ------------------------------------------------------------------------------------

class Registration:
    def __init__(self, ident: int):
        self.ident = ident

    def remove(self) -> None:
        with _S.lock:
            _S.cleanups = [c for c in _S.cleanups if c[0] != self.ident]


def register(cleanup: Callable[[bool], None], name: str) -> Registration:
    """Run ``cleanup(fast)`` when the process exits (normally, forced, or on a second Ctrl-C; ``fast``:
    don't wait for anything). Later registrations run first. ``remove()`` when done with it."""
    with _S.lock:
        if not _S.cleanups and not _S.next_id:
            atexit.register(run_cleanups)
        _S.next_id += 1
        _S.cleanups.append((_S.next_id, name, cleanup))
        return Registration(_S.next_id)


def register_process(proc: subprocess.Popen, name: str, grace_s: float = PROCESS_GRACE_S) -> Registration:
    """Stop ``proc`` (and its process group, when it leads one) when the process exits."""
    return register(lambda fast: stop_process(proc, 0.0 if fast else grace_s), name)


def stop_process(proc: subprocess.Popen, grace_s: float = PROCESS_GRACE_S) -> None:
    """SIGTERM ``proc`` (its group when it leads its own), wait up to ``grace_s``, then SIGKILL."""
    if proc.poll() is not None:
        _kill_group(proc, signal.SIGKILL)  # it is gone; what it started in its group goes too
        return
    _kill_group(proc, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    _kill_group(proc, signal.SIGKILL)
    try:
        proc.wait(timeout=2.0)
    except subprocess.TimeoutExpired:
        pass


def group_alive(pgid: int) -> bool:
    """Whether any process of group ``pgid`` is still alive (signal 0 probes without killing)."""
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def _kill_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        if os.getpgid(proc.pid) == proc.pid:  # it leads its own group (start_new_session)
            os.killpg(proc.pid, sig)
            return
    except (ProcessLookupError, PermissionError):
        pass
    try:
        if proc.poll() is None:
            proc.send_signal(sig)
    except ProcessLookupError:
        pass


def run_cleanups(fast: bool = False) -> None:
    """Run every registered cleanup once, newest first; a failing one doesn't stop the others."""
    with _S.lock:
        if _S.cleaned:
            return
        _S.cleaned = True
        todo = list(reversed(_S.cleanups))
        _S.cleanups.clear()
    for _, _name, fn in todo:
        try:
            fn(fast)
        except Exception:  # noqa: BLE001 - exiting: one broken cleanup must not keep a child alive
            pass


def die_with_parent() -> None:
    """``preexec_fn`` for a child that must not outlive this process even if it is SIGKILLed (Linux:
    prctl(PR_SET_PDEATHSIG, SIGTERM); elsewhere nothing)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


# ----- what is running -----------------------------------------------------------------------------------

@contextmanager
def doing(stage: str) -> Iterator[None]:
    """Name the stage running now, for the line printed when the process is stopped during it."""
    before, _S.activity = _S.activity, stage
    try:
        yield
    finally:
        _S.activity = before


def stopped_by() -> tuple[Interrupted | None, str | None]:
    """What asked the process to stop (None: nothing) and the stage that was running then."""
    return _S.first, _S.stage_at_stop


# ----- signals -------------------------------------------------------------------------------------------

def _record(stop: Interrupted, grace_s: float | None = None) -> bool:
    """Remember the first request to stop; True if this is it."""
    with _S.lock:
        if _S.first is not None:
            return False
        _S.first, _S.stage_at_stop = stop, _S.activity
        _arm_deadline(_S.grace_s if grace_s is None else grace_s)
        return True


def _handler(signum: int, frame) -> None:
    if _S.raised:
        return  # already unwinding (a second Ctrl-C is the watcher's, Prefect re-sending SIGTERM is ours)
    _record(Interrupted(signum))
    _S.raised = True
    raise _S.first if isinstance(_S.first, _Requested) else Interrupted(signum)


class _Requested(Interrupted):
    """A stop asked for by the process itself (``request_stop``), delivered as a SIGINT to the main thread."""


def request_stop(reason: str, exit_code: int = 1, grace_s: float = 2.0) -> None:
    """Stop the main thread as a signal would, from any thread (e.g. the orchestrator went away);
    exit after ``grace_s`` at the latest (short: what the main thread would wait for is gone)."""
    if _record(_Requested(signal.SIGINT, reason, exit_code), grace_s):
        with _S.lock:
            _S.synthetic_int += 1  # the watcher sees this SIGINT too: not the user's second Ctrl-C
        _thread.interrupt_main(signal.SIGINT)


def _arm_deadline(grace_s: float) -> None:
    if _S.deadline is None:
        _S.deadline = threading.Timer(grace_s, _force_exit, args=(False,))
        _S.deadline.daemon = True
        _S.deadline.start()


def _force_exit(second: bool) -> None:
    stop = _S.first or Interrupted(signal.SIGINT)
    line = None
    if _S.forced_line is not None:
        try:
            line = _S.forced_line(stop, _S.stage_at_stop)
        except Exception:  # noqa: BLE001
            line = None
    if _S.exiting and not second:
        line = None  # the command printed its line and is running the cleanups: only cut them short
    if second:
        line = f"interrupted again: exiting now{'; ' + line if line else ''}"
    elif line and not isinstance(stop, _Requested):
        line += f" (forced after {_S.grace_s:.0f} s)"
    if line:
        try:
            os.write(2, f"\n{line}\n".encode())
        except OSError:
            pass
    run_cleanups(fast=True)
    os._exit(stop.exit_code)


def _watch(read_fd: int) -> None:
    """Runs in a thread: sees every signal as it arrives, even while the main thread is stuck in C."""
    seen_int = 0
    while True:
        try:
            data = os.read(read_fd, 64)
        except InterruptedError:
            continue
        except OSError:
            return
        if not data:
            return
        for signum in data:
            if signum not in HANDLED:
                continue
            if signum == signal.SIGINT:
                with _S.lock:
                    synthetic = _S.synthetic_int > 0
                    _S.synthetic_int -= synthetic
                if synthetic:
                    continue
                seen_int += 1
            if _S.first is None:
                _record(Interrupted(signum))
            elif signum == signal.SIGINT and (seen_int >= 2 or _S.first.signum != signal.SIGINT
                                              or isinstance(_S.first, _Requested)):
                _force_exit(True)  # a second request from the user: don't wait for anything


@contextmanager
def handling_signals(forced_line: Callable[[Interrupted, str | None], str] | None = None,
                     grace_s: float = GRACE_S) -> Iterator[None]:
    """Install the handlers for the block (main thread only; elsewhere a no-op). ``forced_line``
    gives the one line printed when the process is forced to exit (the stop, the stage)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _S.forced_line, _S.grace_s = forced_line, grace_s
    # A SIGINT ignored at start (a job started with `&` by a non-interactive shell) is handled too:
    # `kill -INT` sent on purpose must stop the run.
    previous = {s: signal.signal(s, _handler) for s in HANDLED}
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    old_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    watcher = threading.Thread(target=_watch, args=(read_fd,), name="nectar-signals", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        # Stopping: keep the handlers and the watcher (a second Ctrl-C during the exit still exits at once).
        if _S.first is None:
            signal.set_wakeup_fd(old_fd)
            for s, h in previous.items():
                signal.signal(s, h if h is not None else signal.SIG_DFL)
            os.close(write_fd)  # the watcher reads EOF and ends
            watcher.join(timeout=1.0)
            os.close(read_fd)


def exit_now(code: int) -> None:
    """End a stopped process: run the cleanups, flush, ``os._exit`` — skipping the interpreter's
    finalization, which can wait for seconds on native threads a stage left mid-work. The deadline
    still holds: cleanups that take too long are cut short."""
    _S.exiting = True
    run_cleanups()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


__all__ = ["GRACE_S", "Interrupted", "Registration", "die_with_parent", "doing", "exit_now",
           "handling_signals", "register", "register_process", "request_stop", "run_cleanups",
           "signal_name", "stop_process", "stopped_by"]
