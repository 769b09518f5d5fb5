"""vLLM + a run's exported state vs the torch engine with the same state, on the run's held-out probes.

Start the server first (`nectar serve RUN_DIR --engine vllm --dtype float32 --port P`), then:

    python benchmarks/check_vllm_equivalence.py RUN_DIR http://127.0.0.1:P --prompts 30

Prints the share of prompts whose first 32 greedy tokens are identical and the per-token
KL(torch ‖ vLLM), each with its 95 % bootstrap interval (``nectar.evaluation.vllm_equivalence``).
"""
from __future__ import annotations

import argparse
import json
import time

import pyarrow.parquet as pq

from nectar.layout import build_layout
from nectar.orchestration.context import load_base, open_run
from nectar.evaluation.vllm_equivalence import equivalence
from nectar.vllm.format import STATE_FILE
from nectar.vllm.serve import placeholder_token


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run_dir")
    ap.add_argument("url")
    ap.add_argument("--model", default=None, help="served model name (default: the first /v1/models id)")
    ap.add_argument("--prompts", type=int, default=30)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=20,
                    help="vLLM log-probabilities per token for the KL; at most the server's max_logprobs "
                         "(20 under `nectar serve --engine vllm`; vLLM answers 400 beyond)")
    args = ap.parse_args()
    ctx = open_run(args.run_dir)
    base = load_base(ctx.config)
    layout = build_layout(base.tokenizer, ctx.text)
    pid, _ = placeholder_token(base.tokenizer)
    probes = pq.read_table(ctx.stage_run("targets").url("targets", "probes.parquet")).to_pylist()
    rows = [r for r in probes if r["split"] == "probes"][:args.prompts]
    model = args.model
    if model is None:
        import urllib.request
        with urllib.request.urlopen(args.url.rstrip("/") + "/v1/models") as r:
            model = json.loads(r.read())["data"][0]["id"]
    t0 = time.perf_counter()
    eq = equivalence(base, layout, f"{ctx.run.root}/vllm/{STATE_FILE}", args.url, model,
                     [r["instruction"] for r in rows], pid, ctx.info.doc_id, args.new_tokens, args.top_k)
    print(eq.line(), f"({time.perf_counter() - t0:.0f} s)")
    print("first divergence per prompt:", eq.first_divergence)


if __name__ == "__main__":
    main()
