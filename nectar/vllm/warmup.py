"""Warm vLLM's compile cache at setup, so a run's server start reuses it instead of compiling mid-run.

A compiled vLLM CPU server traces and compiles the model on its first start (minutes on a loaded
2-core machine) and can compile again when a step brings a shape the start did not cover (a decode
batch of one, a long prefill). Done in the middle of a run, that compile is what killed the engine
of a busy machine's first run (vLLM's 300 s execute timeout). ``warm_up`` does it at setup instead,
visibly: it starts the server the run will start (same spec, so the same cache entries), drives a
long prefill and every decode batch size from the run's concurrency down to 1 through it, and stops
it. A stamp in the compile cache records which spec was warmed and what it cost. A
start's ``compile_info`` says whether it compiled: the files it added to the compile cache
(``~/.cache/nectar/vllm-compile-cache``; 0 when everything loaded from it) and vLLM's own
"init engine … took" seconds.
"""
from __future__ import annotations

import concurrent.futures
import json
import time
import urllib.request
from dataclasses import asdict, fields
from pathlib import Path
from typing import Callable

from .server import WARM_STAMP, ServerSpec, VLLMServer, cache_entries, compile_cache_dir

_FILLER = ("The committee met on the third day to review the harbour accounts, the lamp oil ledgers and "
           "the keepers' rotas, and it recorded every decision in the minute book. ")


def stamp_path() -> Path:
    """Beside the cache it describes: deleting the cache deletes the claim that it is warm."""
    return compile_cache_dir() / WARM_STAMP


# ServerSpec's fields after execute_timeout_s came when the state server's spec joined it: left out of the
# key at their defaults, so a stamp written before still names the same server (and a key never
# goes into a stamp).
_LATER_FIELDS = ("whole_prefills", "max_num_batched_tokens", "access_log", "max_logprobs", "extra_args", "env",
                 "pythonpath", "cpu_bind")


def _spec_key(spec: ServerSpec) -> dict:
    defaults = {f.name: f.default for f in fields(ServerSpec) if f.name in _LATER_FIELDS}
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(spec).items()
            if k not in ("port", "host", "api_key", "port_hint") and not (k in defaults and v == defaults[k])}


def warmed(spec: ServerSpec) -> dict | None:
    """The stamp of an earlier warm-up of this spec whose cache is still there, or None (never warmed,
    warmed for another spec, or the compile cache was deleted since: warm again)."""
    try:
        stamp = json.loads(stamp_path().read_text())
    except (OSError, ValueError):
        return None
    if stamp.get("spec") != _spec_key(spec) or cache_entries(compile_cache_dir()) < stamp.get("cache_entries", 1):
        return None
    return stamp


def warm_up(spec: ServerSpec, log_path: Path, concurrency: int, prompt_tokens: int = 2400,
            echo: Callable[[str], None] = print) -> dict:
    """Start ``spec``'s server, run a long prefill and decode batches ``concurrency`` … 1, stop it.

    Returns and stamps {"spec", "start_s", "warm_s", "compiled_graphs", "compile_s", ...}."""
    mode = "compiled" if spec.compile else "eager"
    echo(f"vllm warm-up: starting the run's server ({mode}; log {log_path}) ...")
    server = VLLMServer(spec, log_path)
    began = time.monotonic()
    with server:
        echo(f"vllm warm-up: server up in {server.startup_s:.0f} s; a {prompt_tokens}-token prefill, then "
             f"decode batches of {concurrency} down to 1 ...")
        drive = time.monotonic()
        _ask(server, [_FILLER * max(1, prompt_tokens // 40)], max_tokens=[4])
        # Request k stops after 2k tokens: the batch shrinks by one every two steps, concurrency → 1.
        _ask(server, [f"Count to {k + 2}: " for k in range(concurrency)],
             max_tokens=[2 * (k + 1) for k in range(concurrency)], progress=echo)
        warm_s = time.monotonic() - drive
        start_info = dict(server.compile_info)
    result = {"spec": _spec_key(spec), "mode": mode, "start_s": server.startup_s, "warm_s": round(warm_s, 1),
              "total_s": round(time.monotonic() - began, 1), "start": start_info,
              "cache_entries": cache_entries(compile_cache_dir()), "cache": str(compile_cache_dir()),
              "at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "log": str(log_path)}
    stamp_path().parent.mkdir(parents=True, exist_ok=True)
    stamp_path().write_text(json.dumps(result, indent=1))
    echo(f"vllm warm-up: done in {result['total_s']:.0f} s (start {result['start_s']:.0f} s, of which vLLM's "
         f"engine init {start_info.get('init_engine_s')} s; batches {result['warm_s']:.0f} s; compile cache "
         f"{result['cache_entries']} files in {result['cache']})")
    return result


def _ask(server: VLLMServer, prompts: list[str], max_tokens: list[int],
         progress: Callable[[str], None] | None = None) -> None:
    """Send every prompt at once (so they share decode steps); each generates exactly its max_tokens."""

    def one(i: int) -> None:
        body = {"model": server.spec.served_name, "prompt": prompts[i], "max_tokens": max_tokens[i],
                "min_tokens": max_tokens[i], "ignore_eos": True, "temperature": 0.0}
        req = urllib.request.Request(f"{server.url}/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=server.spec.execute_timeout_s) as r:
            r.read()

    done = 0
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        for fut in concurrent.futures.as_completed([pool.submit(one, i) for i in range(len(prompts))]):
            fut.result()
            done += 1
            if progress is not None and len(prompts) > 1 and done % max(1, len(prompts) // 4) == 0:
                progress(f"vllm warm-up: {done}/{len(prompts)} decode requests finished")
