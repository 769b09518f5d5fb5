"""vLLM on CPU, compiled against eager (issue 36): the start and the decode rate the choice buys.

The `cpu` preset's self-study server (``nectar.llm.server_spec``) is started once compiled and once with
``enforce_eager``, one after the other on the same machine, and each is sent the same synthesize-like
work: 16 requests × 6 samples, the JSON schema of the consistency prompt, 128 new tokens at most, fixed
seeds. Printed per mode: the start's seconds, the files the start added to the torch.compile cache
(0: it compiled nothing, the cache was warm), the work's seconds, completion tokens and tokens/s, and the
load average before and after. Run it after ``nectar llm setup`` (the venv, and the warm-up that
fills the compile cache); with an empty cache the compiled start includes the compile.

    python benchmarks/bench_vllm_compile.py                      # both modes, ~5 min on 2 idle cores
    python benchmarks/bench_vllm_compile.py --modes eager --json out.json

The figure docs/benchmarks.md reports ("The first run on a new, busy machine") came from this work at
a load average of 10.6–13.4: compiled 126.4 s start, 196.1 tok/s; eager 71.2 s, 147.7 tok/s (1.33×).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nectar.llm import make_request, server_spec  # noqa: E402
from nectar.llm.vllm_backend import VLLMBackend  # noqa: E402
from nectar.prompts import CONSISTENCY_SCHEMA  # noqa: E402
from nectar.schemas.presets import load_config  # noqa: E402
from nectar.vllm.server import VLLMServer  # noqa: E402

REQUESTS, SAMPLES, NEW_TOKENS = 16, 6, 128


def run_mode(compiled: bool, log_dir: Path) -> dict:
    cfg = load_config("cpu")
    llm = cfg.synthesize.llm
    spec = dataclasses.replace(server_spec(llm, cfg.model), compile=compiled)
    server = VLLMServer(spec, log_dir / f"vllm-{'compiled' if compiled else 'eager'}.log")
    load_before = os.getloadavg()
    server.start()
    try:
        backend = VLLMBackend.managed(server, max_concurrency=32, timeout_s=1800)
        requests = [make_request(llm, f"Write five question/answer pairs about topic {i} as JSON.",
                                 json_schema=CONSISTENCY_SCHEMA, seed=i, n=SAMPLES, max_new_tokens=NEW_TOKENS)
                    for i in range(REQUESTS)]
        t0 = time.monotonic()
        replies = backend.chat_many(requests)
        work_s = time.monotonic() - t0
    finally:
        server.stop()
    tokens = sum(r.completion_tokens or 0 for r in replies)
    return {"mode": "compiled" if compiled else "eager", "start_s": server.startup_s,
            "compile_cache_entries_added": server.compile_info.get("cache_entries_added"),
            "work_s": round(work_s, 1), "completion_tokens": tokens, "tok_s": round(tokens / work_s, 1),
            "load_before": load_before, "load_after": os.getloadavg()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default="compiled,eager", help="compiled, eager or both (in that order)")
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or set(modes) - {"compiled", "eager"}:
        sys.exit(f"error: --modes {args.modes!r}: give compiled, eager or compiled,eager")
    rows = []
    with tempfile.TemporaryDirectory() as logs:
        for mode in modes:
            rows.append(run_mode(mode == "compiled", Path(logs)))
            print(json.dumps(rows[-1]), flush=True)
    if len(rows) == 2:
        print(f"compiled / eager decode rate: {rows[0]['tok_s'] / rows[1]['tok_s']:.2f}x; "
              f"start {rows[0]['start_s']} s vs {rows[1]['start_s']} s")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
