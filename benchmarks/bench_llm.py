"""LLM backends on one machine, in one run (issue 21): the local transformers loop vs a managed vLLM server.

1. Throughput: tokens/s of completions at 1, 8 and 32 concurrent requests (each level sends that
   many requests at once: --new-tokens cap, sampled at temperature 0.7 with fixed seeds, tokens
   counted from each reply). Local: LocalBackend with batch_size = concurrency. vLLM: the managed
   server with max_concurrency = concurrency. vLLM's start (setup excluded; compile cache warm or
   cold as found) is reported beside it.
2. Stages (--stages): seconds of synthesize and verify on the default document (pydoc:naming),
   cpu preset, with each backend: vllm (the preset: a managed server, six samples per prompt, floor
   120; server start included in synthesize) and local (+ infra/cpu-local.yaml: the in-process loop,
   one sample per prompt, floor 24). Pairs, verified train pairs and the verifier's keep rate beside
   the seconds. For a same-minute comparison start one process per backend at once (equal nice).

    python benchmarks/bench_llm.py                          # throughput only (~5 min on 2 cores)
    python benchmarks/bench_llm.py --stages --out bench_llm.json
    python benchmarks/bench_llm.py --stages --backends vllm --no-throughput --tag vllm &   # both at once
    python benchmarks/bench_llm.py --stages --backends local --no-throughput --tag local &
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nectar.llm import make_backend, make_request  # noqa: E402
from nectar.vllm.pool import active_pool, server_scope  # noqa: E402
from nectar.schemas.config import LLMConfig, ModelConfig  # noqa: E402

PARAGRAPH = ("The lighthouse at Kerrow Point was built in 1871 by the engineer Ilse Brandt. Its lamp burned "
             "paraffin until 1952, when it was electrified. The keeper's cottage now holds a small museum.")
QUESTIONS = ["Who built the lighthouse?", "When was it electrified?", "What does the cottage hold?",
             "Summarize the paragraph.", "What fuel did the lamp burn?", "Where is the lighthouse?",
             "Write a short poem about the lighthouse.", "List three facts from the paragraph."]


def _requests(cfg: LLMConfig, n: int) -> list:
    return [make_request(cfg, f"{PARAGRAPH}\n\n{QUESTIONS[i % len(QUESTIONS)]} (#{i})", seed=i) for i in range(n)]


def throughput(backend_name: str, levels: list[int], new_tokens: int, log_dir: str, compile_: bool = False) -> list[dict]:
    rows = []
    base = ModelConfig(name="embedded:smollm2-135m")
    with server_scope(log_dir):
        started = time.perf_counter()
        for c in levels:
            cfg = LLMConfig(backend=backend_name, temperature=0.7, max_new_tokens=new_tokens, batch_size=c,
                            max_concurrency=c, kv_cache_gib=1.0, server_compile=compile_)
            backend = make_backend(cfg, base)
            if not rows:
                start_s = time.perf_counter() - started
                backend.chat_many(_requests(cfg, 1))  # warm-up (first call's allocations, compile)
            t0 = time.perf_counter()
            results = backend.chat_many(_requests(cfg, c))
            wall = time.perf_counter() - t0
            tokens = sum(r.completion_tokens or 0 for r in results)
            rows.append({"backend": backend_name, "concurrency": c, "requests": c, "tokens": tokens,
                         "seconds": round(wall, 2), "tokens_per_s": round(tokens / wall, 1),
                         "backend_start_s": round(start_s, 1), "errors": sum(not r.ok for r in results),
                         "server_compile": compile_ if backend_name != "local" else None, "load": os.getloadavg()})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def _cpu_seconds() -> float:
    """CPU seconds of this process plus every live managed vLLM server's process group (its API
    server, engine core and worker: utime + stime + their reaped children's, from /proc)."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    groups = {srv.proc.pid for srv in active_pool().servers.values() if srv.proc is not None}
    total, tick = me.ru_utime + me.ru_stime, os.sysconf("SC_CLK_TCK")
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # ended meanwhile
        if int(fields[2]) in groups:  # pgrp (the server runs in a session of its own)
            total += sum(int(x) for x in fields[11:15]) / tick  # utime stime cutime cstime
    return total


def stages(backend_name: str, run_root: str, local_config: str, extra: list[str], tag: str) -> dict:
    """chunk → synthesize → verify on pydoc:naming with the cpu preset (local: + local_config) and this backend."""
    from nectar import orchestration
    from nectar.schemas import load_config
    from nectar.schemas.artifacts import DatasetRow
    from nectar.tables import read_table

    keys = ("synthesize.llm", "verify.answer_llm", "verify.judge")
    overrides = [f"{k}.backend={backend_name}" for k in keys]
    # local: the loop's own scale (one sample per prompt, a floor of 24 kept pairs)
    config_file = local_config if backend_name == "local" else None
    cfg = load_config("cpu", config_file=config_file, overrides=overrides + list(extra))
    ctx = orchestration.prepare_run("pydoc:naming", cfg, run_dir=f"{run_root}/{tag or backend_name}")
    cpu0 = _cpu_seconds()
    out = {"backend": backend_name, "config": config_file,
           "overrides": list(extra), "load_before": os.getloadavg()}
    with orchestration.llm_scope(ctx):
        orchestration.run_chunk(ctx)
        for stage, runner in (("synthesize", orchestration.run_synthesize), ("verify", orchestration.run_verify)):
            t0 = time.perf_counter()
            outcome = runner(ctx, True)
            out[f"{stage}_s"] = round(time.perf_counter() - t0, 1)
            out[f"{stage}_counts"] = {k: v for k, v in outcome.manifest.counts.items() if k != "llm"}
            out[f"load_after_{stage}"] = os.getloadavg()
            print(json.dumps({stage: out[f"{stage}_s"], "backend": backend_name,
                              "load": os.getloadavg()}), flush=True)
        # CPU seconds of this process and the server (read before the scope stops it): the work
        # done, less sensitive to a shared machine's load than wall time
        out["cpu_s"] = round(_cpu_seconds() - cpu0, 1)
    rows = read_table(ctx.run.url("verify", "dataset.parquet"), DatasetRow)
    judged = [r for r in rows if r.verdict not in ("synthesis_parse_error",)]
    verified = [r for r in rows if r.kept and not r.kept_by_floor]
    out.update(pairs=len(judged), verified=len(verified),
               verified_train=sum(r.split == "train" for r in verified),
               train=sum(r.split == "train" for r in rows),
               keep_rate=round(len(verified) / max(1, len(judged)), 3), run_dir=ctx.run.root)
    print(json.dumps({k: v for k, v in out.items() if not k.endswith("_counts")}), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--levels", default="1,8,32")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--backends", default="local,vllm")
    ap.add_argument("--stages", action="store_true", help="also time synthesize + verify on pydoc:naming")
    ap.add_argument("--no-throughput", action="store_true")
    ap.add_argument("--local-config", default=str(Path(__file__).resolve().parents[1] / "infra" / "cpu-local.yaml"),
                    help="the config file the local stage run adds to the cpu preset (the loop's data scale)")
    ap.add_argument("--set", action="append", default=[], help="extra key=value for the vLLM stage run")
    ap.add_argument("--server-compile", action="store_true", help="throughput: vLLM with torch.compile (default eager)")
    ap.add_argument("--tag", default="", help="the stage run's directory name under --run-root")
    ap.add_argument("--run-root", default=None, help="where the stage runs go (default: a temp dir)")
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    backends = args.backends.split(",")
    root = args.run_root or tempfile.mkdtemp(prefix="bench_llm-")
    result: dict = {"throughput": [], "stages": []}
    if not args.no_throughput:
        for b in backends:
            result["throughput"] += throughput(b, levels, args.new_tokens, f"{root}/logs", args.server_compile)
    if args.stages:
        for b in backends:
            result["stages"].append(stages(b, root, args.local_config, args.set if b != "local" else [], args.tag))
    print("\nbackend  concurrency  tokens  seconds  tokens/s")
    for r in result["throughput"]:
        print(f"{r['backend']:<8} {r['concurrency']:>11}  {r['tokens']:>6}  {r['seconds']:>7}  {r['tokens_per_s']:>8}")
    by = {(r["backend"], r["concurrency"]): r["tokens_per_s"] for r in result["throughput"]}
    for c in levels:
        if ("local", c) in by and ("vllm", c) in by:
            print(f"vllm / local at {c}: {by[('vllm', c)] / by[('local', c)]:.2f}x")
    for s in result["stages"]:
        print(f"{s['backend']}: synthesize {s['synthesize_s']} s, verify {s['verify_s']} s, pairs {s['pairs']}, "
              f"verified {s['verified']} (train {s['verified_train']}), keep rate {s['keep_rate']}, "
              f"kept {s['verify_counts'].get('kept')} ({s['verify_counts'].get('kept_by_floor')} by the floor), "
              f"train {s['train']}, CPU {s['cpu_s']} s")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
