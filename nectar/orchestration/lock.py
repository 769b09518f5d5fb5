"""One writer per run directory: ``run.lock`` names the process that holds it.

A run (the CLI, a Prefect flow run, a stage re-run) holds the lock while it writes the run
directory; a second one waits — saying who holds it — or, asked not to wait, fails at once with
``RunLocked`` naming the holder. The lock file holds the holder's host, pid, start time, command
and a heartbeat that the holder refreshes every ``HEARTBEAT_S`` seconds:

* a lock whose process is gone (same host: the pid no longer exists, or belongs to a process that
  started later) is stale and taken over, with one line saying so;
* a lock from another host is stale when its heartbeat is older than ``STALE_AFTER_S``.

Creation is exclusive (``open(mode="xb")``: O_EXCL on local disk, conditional writes on the object
stores whose fsspec driver supports them). For a filesystem without exclusive creation the lock is
written when absent and read back after a short pause: two writers racing within that pause are
not excluded — use local disk or an object store with conditional writes for concurrent schedulers.

The lock is re-entrant within a process (the CLI holds it around the Prefect flow, which takes it
again for each stage).
"""
from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from typing import Callable, Iterator

import fsspec

from .. import shutdown
from ..storage import canonical

LOCK_FILE = "run.lock"
# Environment overrides: a cluster that wants a dead host's run retried sooner (a corpus's crash
# retry waits for this), and the multi-host test; keep STALE well above HEARTBEAT.
HEARTBEAT_S = float(os.environ.get("NECTAR_LOCK_HEARTBEAT_S", "30"))
STALE_AFTER_S = float(os.environ.get("NECTAR_LOCK_STALE_S", "300"))  # another host's lock without a heartbeat
POLL_S = 2.0

Notify = Callable[[str], None]


class RunLocked(RuntimeError):
    """The run directory is being written by another process (``--no-wait``)."""

    def __init__(self, root: str, holder: "Holder"):
        super().__init__(f"{root} is being written by {holder.describe()}; wait for it to finish, "
                         f"or stop it (kill {holder.pid} on {holder.host}) if it hangs")
        self.root, self.holder = root, holder


@dataclass(frozen=True)
class Holder:
    host: str
    pid: int
    started_at: str
    command: str
    token: str
    heartbeat_at: str = ""
    proc_start: float | None = None  # the process's own start time (same-host pid-reuse check)

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host} since {self.started_at} (`{self.command}`)"


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _process_start(pid: int) -> float | None:
    try:
        import psutil

        return psutil.Process(pid).create_time()
    except Exception:
        return None


def _me() -> Holder:
    return Holder(host=socket.gethostname(), pid=os.getpid(), started_at=_now(),
                  command=" ".join(os.path.basename(a) if i == 0 else a for i, a in enumerate(sys.argv))[:200],
                  token=uuid.uuid4().hex, heartbeat_at=_now(), proc_start=_process_start(os.getpid()))


def stale_reason(holder: Holder, now: float | None = None) -> str | None:
    """Why ``holder`` no longer holds the lock (its process is gone), or None while it is alive."""
    if holder.host == socket.gethostname():
        try:
            os.kill(holder.pid, 0)
        except ProcessLookupError:
            return "that process is gone"
        except PermissionError:
            pass  # alive, another user's
        started = _process_start(holder.pid)
        if holder.proc_start is not None and started is not None and abs(started - holder.proc_start) > 1.0:
            return "that process is gone (its pid now belongs to another process)"
        return None
    beat = datetime.fromisoformat(holder.heartbeat_at or holder.started_at).timestamp()
    age = (now or time.time()) - beat
    return f"no heartbeat for {age:.0f} s (limit {STALE_AFTER_S:.0f} s)" if age > STALE_AFTER_S else None


def read_holder(root: str) -> Holder | None:
    """Who holds ``root``'s lock, if anyone (None: unlocked)."""
    fs, path = fsspec.core.url_to_fs(f"{root.rstrip('/')}/{LOCK_FILE}")
    try:
        data = json.loads(fs.cat_file(path))
        return Holder(**data)
    except FileNotFoundError:
        return None
    except (ValueError, TypeError):  # half-written or foreign: nobody we can name
        return Holder(host="?", pid=-1, started_at="1970-01-01T00:00:00+00:00", command="?", token="?")


def _create(fs, path: str, holder: Holder) -> bool:
    data = json.dumps(asdict(holder)).encode()
    try:
        with fs.open(path, "xb") as f:
            f.write(data)
        return True
    except FileExistsError:
        return False
    except (ValueError, NotImplementedError, TypeError):  # no exclusive mode on this filesystem
        if fs.exists(path):
            return False
        fs.pipe_file(path, data)
        time.sleep(0.5)
        return read_holder_at(fs, path) == holder


def read_holder_at(fs, path: str) -> Holder | None:
    try:
        return Holder(**json.loads(fs.cat_file(path)))
    except (FileNotFoundError, ValueError, TypeError):
        return None


class _Held:
    def __init__(self, root: str, fs, path: str, holder: Holder):
        self.root, self.fs, self.path, self.holder = root, fs, path, holder
        self.count = 1
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._beat, name="nectar-run-lock", daemon=True)
        self.thread.start()

    def _beat(self) -> None:
        from ..storage import atomic_write

        while not self.stop.wait(HEARTBEAT_S):
            current = read_holder_at(self.fs, self.path)
            if current is None or current.token != self.holder.token:
                return  # taken over (we were presumed dead): never overwrite the new holder
            self.holder = Holder(**{**asdict(self.holder), "heartbeat_at": _now()})
            try:
                atomic_write(self.fs.unstrip_protocol(self.path), json.dumps(asdict(self.holder)))
            except OSError:
                pass

    def release(self, wait: bool = True) -> None:
        self.stop.set()
        if wait:
            self.thread.join(timeout=5)
        current = read_holder_at(self.fs, self.path)
        if current is not None and current.token == self.holder.token:
            self.fs.rm(self.path)


_HELD: dict[str, _Held] = {}
_HELD_LOCK = threading.Lock()


@contextmanager
def run_lock(root: str, wait: bool = True, notify: Notify | None = None, poll_s: float = POLL_S,
             timeout_s: float | None = None) -> Iterator[Holder]:
    """Hold ``root``'s lock for the block. ``wait=False`` raises RunLocked at once if it is held;
    otherwise waits (telling ``notify`` once who holds it), up to ``timeout_s`` if given."""
    notify = notify or (lambda m: print(m, file=sys.stderr, flush=True))
    fs, path = fsspec.core.url_to_fs(f"{root.rstrip('/')}/{LOCK_FILE}")
    key = canonical(fs, path)
    with _HELD_LOCK:
        held = _HELD.get(key)
        if held is not None:
            held.count += 1
    if held is not None:  # this process already holds it
        try:
            yield held.holder
        finally:
            with _HELD_LOCK:
                held.count -= 1
        return
    fs.makedirs(fs._parent(path), exist_ok=True)
    me, announced, deadline = _me(), False, None if timeout_s is None else time.monotonic() + timeout_s
    while not _create(fs, path, me):
        current = read_holder(root)
        if current is not None and current.pid < 0:  # being written right now, or garbage
            time.sleep(1.0)
            current = read_holder(root)
        if current is None:
            continue  # released between our two looks
        reason = stale_reason(current) if current.pid >= 0 else "the lock file is unreadable"
        if reason:
            notify(f"taking over the lock on {root} from {current.describe()}: {reason}")
            if read_holder(root) == current:
                fs.rm(path)
            continue
        if not wait or (deadline is not None and time.monotonic() > deadline):
            raise RunLocked(root, current)
        if not announced:
            notify(f"{root} is being written by {current.describe()}; waiting for it to finish "
                   "(--no-wait exits instead)")
            announced = True
        time.sleep(poll_s)
    held = _Held(root, fs, path, me)
    with _HELD_LOCK:
        _HELD[key] = held
    # A process forced to exit (a stop that did not unwind in time) still releases the lock.
    on_exit = shutdown.register(lambda fast: held.release(wait=not fast), f"run lock {root}")
    try:
        yield me
    finally:
        with _HELD_LOCK:
            held.count -= 1
            done = held.count == 0
            if done:
                del _HELD[key]
        if done:
            held.release()
            on_exit.remove()
