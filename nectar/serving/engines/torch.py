"""``nectar serve --engine torch`` (the default): this project's decode engine, every module type.

Checks the keys and the exposure, binds the port (a port in use fails in a second, not after the
model loads), opens the runs and serves them (``nectar.serving.runner``) until SIGTERM/SIGINT, then
exits at once (the interpreter's own finalization took ~9 s more on a busy machine: torch's native
threads, which a container stop or a second Ctrl-C would cut short).
"""
from __future__ import annotations

from .interface import EngineError, EngineUsageError, Log, ServeOptions


class TorchEngine:
    name = "torch"
    help = "this project's decode engine (every module type)"

    def serve(self, run_dirs: list[str], opts: ServeOptions, log: Log) -> None:
        from pydantic import ValidationError

        from ... import shutdown
        from ...modules.io import ModuleMismatch
        from ...tables import ArtifactError
        from ..limits import ServeLimits
        from ..loader import open_served_runs
        from ..registry import ServedRunsError
        from ..runner import PortInUse, Unauthenticated, api_keys, bind, check_exposure, serve

        try:
            limits = ServeLimits(max_batch=opts.max_batch, max_queue=opts.max_queue, max_tokens=opts.max_tokens,
                                 max_prompt_tokens=opts.max_prompt_tokens, max_body_bytes=opts.max_body_bytes,
                                 max_stop=opts.max_stop, batch_wait_ms=opts.batch_wait_ms,
                                 shutdown_timeout_s=opts.shutdown_timeout, max_module_bytes=opts.max_module_bytes,
                                 keep_dequantized=opts.keep_dequantized)
        except ValidationError as exc:
            err = exc.errors()[0]
            flag = {"shutdown_timeout_s": "shutdown_timeout"}.get(str(err["loc"][0]), str(err["loc"][0]))
            raise EngineUsageError(f"--{flag.replace('_', '-')}: {err['msg']}") from None
        try:
            keys = api_keys(list(opts.api_key))
            check_exposure(opts.host, keys, opts.allow_unauthenticated)  # before anything loads
            sock = bind(opts.host, opts.port)  # a port in use fails in a second, not after the model loads
            with sock:
                serve(open_served_runs(run_dirs), sock, limits, list(opts.served_name) or None, keys)
        except (FileNotFoundError, ModuleMismatch, ArtifactError, PortInUse, Unauthenticated, ServedRunsError) as exc:
            raise EngineError(str(exc)) from exc
        # Drained (SIGTERM or Ctrl-C): exit now (module docstring).
        shutdown.exit_now(0)
