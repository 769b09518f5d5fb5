"""Warm vLLM's compile cache at setup, so a run's server start reuses it instead of compiling mid-run.

A compiled vLLM CPU server traces and compiles the model on its first start (minutes on a loaded
2-core machine) and can compile again when a step brings a shape the start did not cover (a decode
batch of one, a long prefill). Done in the middle of a run, that compile is what killed the engine
of a busy machine's first run (vLLM's 300 s execute timeout). ``warm_up`` does it at setup instead,
visibly: it starts the server the run will start (same spec, so the same cache entries), drives a
long prefill and every decode batch size from the run's concurrency down to 1 through it, and stops
it. A stamp (``~/.cache/nectar/vllm-warm.json``) records which spec was warmed and what it cost; the
compile lines of the server's log say whether a start compiled or loaded from the cache.
"""
from __future__ import annotations

import concurrent.futures
import json
import re
import time
import urllib.request
from dataclasses import asdict
from pathlib import Path
from typing import Callable

from .vllm_server import ServerSpec, VLLMServer, venv_dir

# What vLLM 0.32 logs when it compiles a graph, and when it loads one from torch.compile's cache.
COMPILED = re.compile(r"Compiling a graph for .* takes ([\d.]+) s")
LOADED = re.compile(r"Directly load the compiled graph|load the compiled graph\(s\) for .* from the cache")
_FILLER = ("The committee met on the third day to review the harbour accounts, the lamp oil ledgers and "
           "the keepers' rotas, and it recorded every decision in the minute book. ")


def stamp_path() -> Path:
    return venv_dir().parent / "vllm-warm.json"


def _spec_key(spec: ServerSpec) -> dict:
    return {k: v for k, v in asdict(spec).items() if k not in ("port", "host")}


def warmed(spec: ServerSpec) -> dict | None:
    """The stamp of an earlier warm-up of this spec, or None (never warmed, or for another spec)."""
    try:
        stamp = json.loads(stamp_path().read_text())
    except (OSError, ValueError):
        return None
    return stamp if stamp.get("spec") == _spec_key(spec) else None


def compile_events(log_text: str) -> dict:
    """How many graphs a start compiled (and their seconds) and how many it loaded from the cache."""
    compiled = [float(m.group(1)) for m in COMPILED.finditer(log_text)]
    return {"compiled_graphs": len(compiled), "compile_s": round(sum(compiled), 1),
            "loaded_from_cache": len(LOADED.findall(log_text))}


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
        events = compile_events(server._own_log())
    result = {"spec": _spec_key(spec), "mode": mode, "start_s": server.startup_s, "warm_s": round(warm_s, 1),
              "total_s": round(time.monotonic() - began, 1), **events,
              "at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "log": str(log_path)}
    stamp_path().write_text(json.dumps(result, indent=1))
    echo(f"vllm warm-up: done in {result['total_s']:.0f} s (start {result['start_s']:.0f} s, batches "
         f"{result['warm_s']:.0f} s; {events['compiled_graphs']} graph(s) compiled in {events['compile_s']:.0f} s, "
         f"{events['loaded_from_cache']} loaded from the cache)")
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
