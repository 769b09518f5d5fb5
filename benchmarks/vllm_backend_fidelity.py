"""The run's state as vLLM serves it, against the same state in the torch engine and the full document.

For each served state — ``trained`` (the run's own module, β and ragged budgets, through NECTAR's attention
backend plugin) and, as the named fallback, ``attention_matching_kv@int4`` (the β-free refit vLLM's own
attention can serve) — one vLLM server (float32, eager, prefix caching) is started, measured and stopped:

  greedy   the first --new-tokens greedy tokens of --prompts probe instructions, vLLM vs the torch engine with
           the same state file: share identical, per-token KL(torch ‖ vLLM) (top-k coarse)
  probes   teacher-forced KL to the full-context model on every held-out probe, through vLLM's
           prompt_logprobs and through the torch engine, over the same top-k buckets (vLLM returns only its
           top k), with the torch engine's full-vocabulary figure beside it; KL recovered = 1 − KL / KL(none)

    python benchmarks/vllm_backend_fidelity.py runs/final --out docs/figures/vllm_backend_fidelity.json
"""
from __future__ import annotations

import argparse
import json
import os
import time

from nectar.evaluation.selection import select_pairs
from nectar.evaluation.vllm_equivalence import equivalence_ids, probe_fidelity
from nectar.orchestration.context import load_base, load_run_doc_kv, open_run
from nectar.schemas.artifacts import TargetsPairRow
from nectar.serving.engines.vllm import VLLMOptions, measured_server
from nectar.tables import read_table
from nectar.targets.store import open_targets, targets_zarr_url
from nectar.vllm.serve import placeholder_token
from nectar.shutdown import handling_signals


def probe_pairs(ctx, cfg):
    targets = ctx.stage_run("targets").url("targets")
    g, _ = open_targets(targets_zarr_url(targets))
    rows = read_table(f"{targets}/pairs.parquet", TargetsPairRow)
    sel = select_pairs(rows, g["token_ids"][:], cfg, ["probes"])
    return [p for p in sel.pairs if "probes" in p.splits]


def measure(run_dir: str, source: str, args, base, doc_kv, pairs, log) -> dict:
    opts = VLLMOptions(port=0, dtype="float32", enforce_eager=True, source=source, max_logprobs=args.top_k,
                       max_model_len=args.max_model_len, startup_timeout_s=1800)
    load0 = os.getloadavg()[0]
    with measured_server(run_dir, opts, log) as (server, spec, doc):
        row = {"source": source, "m": doc.m, "bias": doc.bias, "start_s": server.startup_s}
        pid, _ = placeholder_token(base.tokenizer)
        prompts = [list(p.ids[:p.response_start]) for p in pairs[:args.prompts]]
        t0 = time.perf_counter()
        eq = equivalence_ids(base, doc.state_path, server.root_url, spec.served_name, prompts, pid, doc.doc_id,
                             args.new_tokens, args.top_k)
        row["greedy"] = {"line": eq.line(), "identical": eq.identical.value, "identical_count":
                         sum(d is None for d in eq.first_divergence), "prompts": eq.prompts,
                         "kl": [eq.kl.value, eq.kl.low, eq.kl.high], "first_divergence": eq.first_divergence,
                         "s": round(time.perf_counter() - t0, 1)}
        log(f"  greedy: {eq.line()}")
        t0 = time.perf_counter()
        fid = probe_fidelity(base, doc_kv, doc.state_path, server.root_url, spec.served_name, pairs, pid, doc.doc_id,
                             args.top_k)
        row["probes"] = {**fid.as_dict(), "s": round(time.perf_counter() - t0, 1)}
        log(f"  probes: {fid.line()}")
    row["loadavg_1m"] = [round(load0, 2), round(os.getloadavg()[0], 2)]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run_dir")
    ap.add_argument("--states", default="trained,attention_matching_kv@int4")
    ap.add_argument("--prompts", type=int, default=30)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=100)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--out", default=None, help="JSON results file")
    args = ap.parse_args()
    ctx = open_run(args.run_dir)
    base = load_base(ctx.config)
    doc_kv = load_run_doc_kv(ctx)
    pairs = probe_pairs(ctx, ctx.config.evaluate)
    results = {"run": args.run_dir, "n": doc_kv.n, "probes": len(pairs), "prompts": args.prompts,
               "new_tokens": args.new_tokens, "top_k": args.top_k, "cpus": os.cpu_count(), "rows": []}
    for source in args.states.split(","):
        print(f"{source}:", flush=True)
        results["rows"].append(measure(args.run_dir, source, args, base, doc_kv, pairs,
                                       lambda s: print(s, flush=True)))
    print(json.dumps(results, indent=1))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    with handling_signals():  # SIGTERM/Ctrl-C raise, so each measured_server block stops its server
        main()
