"""Local backend generation throughput: batched (batch 8) vs one request at a time.

Embedded SmolLM2-135M, 8 short prompts, greedy, a fixed number of new tokens per request (an
unreachable stop token is not forced: requests that stop early simply generate fewer tokens, and
throughput counts the tokens actually generated). Both runs produce the same text, token for
token (checked). Baseline: the same backend with batch_size=1. Target on the 2-core machine: ≥3×.

    .venv/bin/python benchmarks/bench_local_batching.py [--threads 2] [--new-tokens 64] [--repeats 2]
"""
from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # shared cores: don't spin-wait (set before torch loads)

import torch  # noqa: E402

from nectar.llm import ChatRequest  # noqa: E402
from nectar.llm.local import LocalBackend  # noqa: E402
from nectar.base_model import load_base_model  # noqa: E402
from nectar.schemas.config import ModelConfig  # noqa: E402

PROMPTS = [
    "Write a short paragraph about lighthouses.", "Explain what a Python dictionary is.",
    "Describe the water cycle in a few sentences.", "Give three tips for learning a new language.",
    "What is photosynthesis? Explain briefly.", "Describe a typical morning in a small village.",
    "Explain why the sky is blue.", "Summarize the plot of a detective story you invent.",
]


def run(backend: LocalBackend, reqs: list[ChatRequest]) -> tuple[float, int, list[str]]:
    t0 = time.perf_counter()
    out = backend.chat_many(reqs)
    seconds = time.perf_counter() - t0
    return seconds, sum(r.completion_tokens for r in out), [r.text for r in out]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2, help="best of N runs each (noise on shared machines)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    base = load_base_model(ModelConfig())
    reqs = [ChatRequest(messages=({"role": "user", "content": p},), max_new_tokens=args.new_tokens) for p in PROMPTS]
    batched, single = LocalBackend(base, batch_size=args.batch_size), LocalBackend(base, batch_size=1)
    run(batched, reqs[:2])  # warm-up: first-call allocations and kernel selection
    best_b = min((run(batched, reqs) for _ in range(args.repeats)), key=lambda r: r[0])
    best_s = min((run(single, reqs) for _ in range(args.repeats)), key=lambda r: r[0])
    tps_b, tps_s = best_b[1] / best_b[0], best_s[1] / best_s[0]
    print(f"model {base.name} · threads {args.threads} · {len(reqs)} prompts · {args.new_tokens} new tokens "
          f"greedy · best of {args.repeats} · load avg {os.getloadavg()[0]:.1f}")
    print(f"{'mode':24s} {'tokens':>7s} {'seconds':>8s} {'tok/s':>8s}")
    print(f"{'one at a time (baseline)':24s} {best_s[1]:7d} {best_s[0]:8.2f} {tps_s:8.1f}")
    print(f"{f'batched (batch {args.batch_size})':24s} {best_b[1]:7d} {best_b[0]:8.2f} {tps_b:8.1f}")
    print(f"speed-up batched / one-at-a-time: {tps_b / tps_s:.2f}x (target >= 3x)")
    print(f"identical outputs: {best_b[2] == best_s[2]}")


if __name__ == "__main__":
    main()
