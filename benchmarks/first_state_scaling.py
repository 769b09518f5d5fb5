"""The first state's seconds against the document length (issue 39): where the time goes and how it
grows with n, against its FLOP bound.

For each document length it runs ``nectar.stages.first.first_state`` (the first stage's work: prefill,
reconstruction scoring, allocation, the closed-form β and value fits) on the cpu preset's model and
prints the seconds of each part, the NNLS share of the β fit, the kept keys per (layer, KV head), and
the reconstruction forward's FLOPs over the measured single-core-pair matmul rate.

    python benchmarks/first_state_scaling.py --lengths 1500,3700         # ~3 min on 2 idle cores
    python benchmarks/first_state_scaling.py --lengths 1500,3700,8000,12000 --json out.json

Documents: CPython's language reference (pydoc topics, concatenated) cut to whole lines at the
length; n > 8,000 runs with YaRN x2 (SmolLM2's window is 8,192). ``uptime`` is printed beside every
row: on a shared machine compare rows taken in the same minutes only.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


def document_of(tokenizer, n_tokens: int) -> str:
    """Whole lines of the pydoc topics (naming first: the default document), up to ~``n_tokens``."""
    from pydoc_data.topics import topics

    lines, total = [], 0
    for name in ["naming", "compound", "types", "exprlists", "specialnames", "import"] + sorted(topics):
        for line in topics[name].splitlines(keepends=True):
            cost = len(tokenizer.encode(line, add_special_tokens=False))
            if total + cost > n_tokens:
                return "".join(lines)
            lines.append(line)
            total += cost
    return "".join(lines)


def matmul_rate(seconds: float = 1.0) -> float:
    """FLOP/s of a float32 [1024, 64] × [64, 4096] matmul (the scoring's shape) on this machine now."""
    import torch

    a, b = torch.randn(1024, 64), torch.randn(64, 4096)
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        done += 1
    return done * 2 * 1024 * 64 * 4096 / (time.perf_counter() - start)


def run_one(n_tokens: int, nnls_log: list) -> dict:
    import torch

    from nectar.base_model import load_base_model
    from nectar.baselines import matching_fit
    from nectar.schemas.presets import load_config
    from nectar.stages.first import first_state

    overrides = ["model.yarn_factor=2"] if n_tokens > 7600 else []
    cfg = load_config("cpu", overrides=overrides)
    base = load_base_model(cfg.model)
    text = document_of(base.tokenizer, n_tokens)
    name = "nnls_gram" if hasattr(matching_fit, "nnls_gram") else "nnls"  # the solver fit_log_mass calls
    real_nnls = getattr(matching_fit, name)

    def timed_nnls(A, b, **kw):  # profiling only: the real solver, timed and sized
        start = time.perf_counter()
        out = real_nnls(A, b, **kw)
        nnls_log.append((A.shape[0], time.perf_counter() - start))
        return out

    setattr(matching_fit, name, timed_nnls)
    try:
        with tempfile.TemporaryDirectory() as out:
            start = time.perf_counter()
            counts = first_state(base, text, cfg.first, cfg.train.module, cfg.targets.recon, cfg.targets.probes,
                                 "0" * 64, out)
            counts["total_s"] = round(time.perf_counter() - start, 2)
    finally:
        setattr(matching_fit, name, real_nnls)
    sizes = [p for p, _ in nnls_log]
    counts["nnls_s"] = round(sum(s for _, s in nnls_log), 2)
    counts["nnls_p_max"] = max(sizes, default=0)
    counts["nnls_p_mean"] = round(sum(sizes) / max(len(sizes), 1), 1)
    # reconstruction scoring FLOPs: the model's forward over ~n response tokens (+ cues) against the
    # document, dominated by attention to n keys: L · Hq · (2 · T · n · d) · 2 (logits, outputs) + the
    # recorder's whole-softmax probabilities (the same logits again) + the linear layers 2 · params · T
    n, L, hq, d = counts["n_context"], base.num_layers, base.num_q_heads, base.head_dim
    T = n * 1.15  # response tokens ≈ the document, plus the cue instructions
    attn = 3 * 2 * L * hq * T * n * d
    linear = 2 * 1.35e8 * T
    counts["recon_gflop"] = round((attn + linear) / 1e9, 1)
    counts["torch_threads"] = torch.get_num_threads()
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="1500,3700")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    for n in [int(x) for x in args.lengths.split(",")]:
        rate = matmul_rate()
        load = os.getloadavg()
        row = run_one(n, [])
        row.update(load_before=[round(x, 2) for x in load], load_after=[round(x, 2) for x in os.getloadavg()],
                   matmul_gflops=round(rate / 1e9, 1))
        row["recon_bound_s"] = round(row["recon_gflop"] / row["matmul_gflops"], 2)
        row["recon_over_bound"] = round(row["recon_s"] / max(row["recon_bound_s"], 1e-9), 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
