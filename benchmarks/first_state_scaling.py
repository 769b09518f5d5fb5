"""The first state's seconds against the document length (issue 39): where the time goes and how it
grows with n, against its FLOP bound.

For each document length it runs ``nectar.stages.first.first_state`` (the first stage's work: prefill,
reconstruction scoring, allocation, the closed-form β and value fits) on the cpu preset's model and
prints the seconds of each part, the NNLS share of the β fit, the kept keys per (layer, KV head), and
the reconstruction forward's FLOPs over the measured single-core-pair matmul rate.

Every ``*_s`` is wall seconds except the ``*_thread_s`` ones: the fit runs one head per core at a time
(``run_per_head``), so the NNLS calls' seconds summed over heads (``nnls_thread_s``) are thread-seconds,
up to the thread count × ``nnls_wall_s`` (the wall seconds during which some head's NNLS ran).

    python benchmarks/first_state_scaling.py --lengths 1500,3700         # ~3 min on 2 idle cores
    python benchmarks/first_state_scaling.py --lengths 1500,3700,8000,12000 --json out.json
    python benchmarks/first_state_scaling.py --lengths 1500 --kvpress   # + kvpress KVzip+int4's press_s
    python benchmarks/first_state_scaling.py --lengths 12000 --set first.select.fit_keys=null   # no cap

Documents: CPython's language reference (pydoc topics, concatenated) cut to whole lines at the
length; n > 8,000 runs with YaRN x2 (SmolLM2's window is 8,192). ``uptime`` is printed beside every
row: on a shared machine compare rows taken in the same minutes only.
"""
from __future__ import annotations

import argparse
import itertools
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


def matmul_rate(seconds: float = 1.0, dtype: str = "float32") -> float:
    """FLOP/s of a [1024, 64] × [64, 4096] matmul (the scoring's shape; float64: the fit's Gram
    matrices' precision) on this machine now."""
    import torch

    a, b = torch.randn(1024, 64, dtype=getattr(torch, dtype)), torch.randn(64, 4096, dtype=getattr(torch, dtype))
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        done += 1
    return done * 2 * 1024 * 64 * 4096 / (time.perf_counter() - start)


def scipy_nnls_seconds(G, rhs) -> tuple[float, float]:
    """The old solver on the same problem: scipy's Lawson–Hanson NNLS on ‖Lᵀw − L⁻¹rhs‖² (what
    fit_log_mass ran before block pivoting); its seconds and the largest gap to ``nnls_gram``'s w."""
    import torch
    from scipy.optimize import nnls

    from nectar.states.matching_fit import nnls_gram

    start = time.perf_counter()
    L = torch.linalg.cholesky(G)
    b = torch.linalg.solve_triangular(L, rhs.unsqueeze(1), upper=False).squeeze(1)
    w, _ = nnls(L.T.cpu().numpy(), b.cpu().numpy(), maxiter=50 * G.shape[0])
    seconds = time.perf_counter() - start
    return seconds, float((torch.from_numpy(w) - nnls_gram(G, rhs)).abs().max())


def covered_seconds(intervals: list[tuple[float, float]]) -> float:
    """Wall seconds covered by the union of ``(start, end)`` intervals: the time during which at least
    one of them was running (two heads' NNLS overlapping on two cores count once)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def run_one(n_tokens: int, nnls_log: list, scipy_every: int = 0, overrides: tuple[str, ...] = ()) -> dict:
    import torch

    from nectar.base_model import load_base_model
    from nectar.states import matching_fit
    from nectar.schemas.presets import load_config
    from nectar.stages.first import first_state

    yarn = ["model.yarn_factor=2"] if n_tokens > 7600 else []
    cfg = load_config("cpu", overrides=[*yarn, *overrides])
    base = load_base_model(cfg.model)
    text = document_of(base.tokenizer, n_tokens)
    name = "nnls_gram" if hasattr(matching_fit, "nnls_gram") else "nnls"  # the solver fit_log_mass calls
    real_nnls = getattr(matching_fit, name)

    old = []
    calls = itertools.count()  # atomic under the GIL: the heads' fits call the solver from worker threads

    def timed_nnls(A, b, **kw):  # profiling only: the real solver, timed and sized
        start = time.perf_counter()
        out = real_nnls(A, b, **kw)
        end = time.perf_counter()
        nnls_log.append((A.shape[0], start, end))
        if scipy_every and name == "nnls_gram" and next(calls) % scipy_every == 0:
            # the old solver on the same problem, after the new one's timer: (p, its s, gap, the new one's s)
            old.append((A.shape[0], *scipy_nnls_seconds(A, b), end - start))
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
    # The heads are fitted one per core at a time (states/reconstruction.py run_per_head), so the solver's
    # calls overlap: their summed seconds are thread-seconds (up to torch_threads × the wall time they
    # took), nnls_wall_s the wall seconds during which at least one head's NNLS ran. fit_s (and its shares
    # fit_mass_s, fit_values_s), total_s and every *_s of the stage counts are wall seconds.
    sizes = [p for p, _, _ in nnls_log]
    counts["nnls_thread_s"] = round(sum(b - a for _, a, b in nnls_log), 2)
    counts["nnls_wall_s"] = round(covered_seconds([(a, b) for _, a, b in nnls_log]), 2)
    counts["nnls_p_max"] = max(sizes, default=0)
    counts["nnls_p_mean"] = round(sum(sizes) / max(len(sizes), 1), 1)
    workers = max(1, min(torch.get_num_threads(), len(sizes)))
    if old:  # every scipy_every-th head through both solvers (per-call thread-seconds, like for like)
        scipy_s = sum(s for _, s, _, _ in old)
        counts["scipy_sample_heads"] = len(old)
        counts["scipy_sample_thread_s"] = round(scipy_s, 2)
        counts["new_sample_thread_s"] = round(sum(s for *_, s in old), 2)
        counts["scipy_estimated_total_thread_s"] = round(scipy_s * scipy_every, 1)
        counts["solution_max_gap"] = max(g for _, _, g, _ in old)
        # the old solver ran inside the β fit's timer, on one worker while the others went on fitting:
        # it lengthened the wall figures by about its thread-seconds / workers (an estimate) — taken out
        for key in ("fit_s", "fit_mass_s", "total_s"):
            counts[key] = round(counts[key] - scipy_s / workers, 2)
    # reconstruction scoring FLOPs, counted on this document's spans: the model's forward over the T
    # reconstruction tokens (instructions and responses) — its linear layers 2 · (layer parameters) · T and
    # the attention to the n document keys, L · Hq · 2 · T · n · d · 2 (logits, outputs) — plus the
    # recorder's scores, L · Hq · 2 · (d + 1) per (response row, scored key) pair: every key for every
    # batch, or only those within the score window of the batch's spans (select.score_window)
    n, L, hq, d = counts["n_context"], base.num_layers, base.num_q_heads, base.head_dim
    T, scored = recon_work(base, text, cfg)
    layer_params = sum(p.numel() for p in base.model.get_decoder().layers.parameters())
    counts.update(recon_tokens=T, recon_scored_share=round(scored / max(T * n, 1), 3))
    counts["recon_gflop"] = round((2 * L * hq * T * n * d * 2 + L * hq * 2 * (d + 1) * scored
                                   + 2 * layer_params * T) / 1e9, 1)
    # the fit's FLOPs, N = 2048 · g fit queries. In float32: the masses over EVERY key a head keeps (p,
    # kept_keys summed over heads: the logits 2Npd and the rows' sums with the values 2Npd — the cap
    # does not shrink them), then per head the c keys solved jointly (the β fit's Gram size: with a cap,
    # fit_keys) — their columns or the compacted attention's products 2Ncd and the two Gram matrices by
    # syrk (matching_fit.gram: N·c² each, half a general product); in float64: the Cholesky
    # factorizations, one per fit (c³/3 each). Before 2026-11-28 the masses were priced at c, not p.
    N, d = 2048 * (hq // base.num_kv_heads), base.head_dim
    counts["fit_gflop32"] = round((4 * N * d * counts["kept_keys"] + sum(2 * N * c * d + 2 * N * c * c for c in sizes))
                                  / 1e9, 1)
    counts["fit_gflop64"] = round(sum(2 * c ** 3 / 3 for c in sizes) / 1e9, 1)
    counts["torch_threads"] = torch.get_num_threads()
    return counts


def recon_work(base, text: str, cfg) -> tuple[int, int]:
    """(T, S): the reconstruction's query tokens, and the (response row, scored key) pairs the recorder
    computes — each batch's response rows times the keys it scores (all n, or its window's)."""
    from nectar.layout import build_layout
    from nectar.queries.recon import make_recon
    from nectar.states import reconstruction as R

    layout = build_layout(base.tokenizer, text)
    spans = [(s.instruction, s.response) for s in make_recon(text, cfg.targets.recon, cfg.targets.probes)]
    pairs = [layout.pair(i, r) for i, r in spans]
    window = cfg.first.select.score_window
    spans_keys = None if window is None else R.response_tokens(layout, [r for _, r in spans])
    T = scored = 0
    for index, ranges in R.scored_batches(pairs, spans_keys, window, layout.n):
        rows = sum(len(pairs[i].ids) - pairs[i].response_start for i in index)
        T += sum(len(pairs[i].ids) for i in index)
        scored += rows * (layout.n if ranges is None else sum(hi - lo for lo, hi in ranges))
    return T, scored


def kvpress_seconds(n_tokens: int, rho: float = 0.05) -> float | None:
    """kvpress's KVzip press (int4, keeping ρ of the document KV's bytes) on the same document: its
    ``press_s`` (document → compressed, quantized cache) in its own venv, scored on one short pair."""
    import tempfile

    from nectar.attention.doc_kv import prefill_document
    from nectar.base_model import load_base_model
    from nectar.evaluation.teacher import EvalPair
    from nectar.kvpress import PressJob, score_presses
    from nectar.layout import build_layout
    from nectar.schemas.presets import load_config

    cfg = load_config("cpu", overrides=["model.yarn_factor=2"] if n_tokens > 7600 else [])
    base = load_base_model(cfg.model)
    text = document_of(base.tokenizer, n_tokens)
    layout = build_layout(base.tokenizer, text)
    doc_kv = prefill_document(base, layout.context_ids)
    q = layout.pair("Repeat the first sentence.", text.split(".")[0])
    pair = EvalPair("p0", "continue", ("probes",), tuple(q.ids), q.response_start)
    job = PressJob("kvpress:kvzip:int4", "kvzip", rho, 4)
    with tempfile.TemporaryDirectory() as work:
        result = score_presses(base, cfg.model, list(layout.context_ids), doc_kv, [pair], [job], work, log=lambda m: None)
    r = result.results.get(job.key)
    return None if r is None else round(r.press_s, 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="1500,3700")
    ap.add_argument("--json", default=None)
    ap.add_argument("--kvpress", action="store_true", help="also time kvpress's KVzip+int4 press at each n")
    ap.add_argument("--scipy-every", type=int, default=6, help="time the old scipy NNLS on every k-th head")
    ap.add_argument("--scipy-at", type=lambda t: [int(x) for x in t.split(",") if x], default=[],
                    help="lengths at which to time the old solver too (e.g. 1500,3700)")
    ap.add_argument("--set", action="append", default=[],
                    help="a config override KEY=VALUE of the first state (e.g. first.select.fit_keys=2048)")
    args = ap.parse_args()
    rows = []
    for n in [int(x) for x in args.lengths.split(",")]:
        rate, rate64 = matmul_rate(), matmul_rate(dtype="float64")
        load = os.getloadavg()
        row = run_one(n, [], args.scipy_every if n in args.scipy_at else 0, tuple(args.set))
        row["overrides"] = args.set
        row.update(load_before=[round(x, 2) for x in load], load_after=[round(x, 2) for x in os.getloadavg()],
                   matmul_gflops=round(rate / 1e9, 1))
        row["recon_bound_s"] = round(row["recon_gflop"] / row["matmul_gflops"], 2)
        row["recon_over_bound"] = round(row["recon_s"] / max(row["recon_bound_s"], 1e-9), 2)
        row["matmul64_gflops"] = round(rate64 / 1e9, 1)
        row["fit_bound_s"] = round(row["fit_gflop32"] / row["matmul_gflops"] + row["fit_gflop64"] / row["matmul64_gflops"], 2)
        fit_s = row["fit_mass_s"] + row["fit_values_s"]
        row["fit_over_bound"] = round(fit_s / max(row["fit_bound_s"], 1e-9), 2)
        if args.kvpress:
            row["kvpress_kvzip_int4_s"] = kvpress_seconds(n)
            row["load_after_kvpress"] = [round(x, 2) for x in os.getloadavg()]
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
