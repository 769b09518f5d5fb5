"""Report figures as PNG bytes (matplotlib, Agg backend: no display, no external assets).

Each function returns None when there is nothing to plot, so a report never shows an empty axis.
"""
from __future__ import annotations

import io
from typing import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter  # noqa: E402

from ..schemas.artifacts import TrainLogRow  # noqa: E402
from ..schemas.artifacts import BenchmarkRow, PerLayerRow  # noqa: E402

SYSTEM_STYLE = {"module": ("NECTAR module", "tab:green"), "full_cached": ("full KV (prefix-cached)", "tab:blue"),
                "full_cold": ("full KV (cold prefill)", "tab:red")}


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def training_curves(log: Sequence[TrainLogRow]) -> bytes | None:
    if not log:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for split, style in (("train", "-"), ("heldout", "o--")):
        rows = sorted((r for r in log if r.split == split), key=lambda r: r.samples)
        if not rows:
            continue
        x = [r.samples for r in rows]
        axes[0].plot(x, [r.loss for r in rows], style, label=f"{split} loss")
        if any(r.loss_kl for r in rows):
            axes[0].plot(x, [r.loss_kl for r in rows], style, alpha=0.6, label=f"{split} L_KL")
        rte = [(r.samples, r.rte_A) for r in rows if r.rte_A is not None]
        if rte:
            axes[1].plot(*zip(*rte), style, label=f"{split} RTE (A)")
    axes[0].set_yscale("log")
    axes[0].set_xlabel("samples")
    axes[0].set_title("training loss")
    axes[1].set_xlabel("samples")
    axes[1].set_title("relative transport error (App. C)")
    for ax in axes:
        if ax.lines:
            ax.legend(fontsize=8)
    return _png(fig)


def layer_heatmap(rows: Sequence[PerLayerRow], split: str, metric: str = "rte_A") -> bytes | None:
    sel = [r for r in rows if r.split == split]
    if not sel:
        return None
    L = max(r.layer for r in sel) + 1
    H = max(r.q_head for r in sel) + 1
    grid = np.full((L, H), np.nan)
    for r in sel:
        grid[r.layer, r.q_head] = getattr(r, metric)
    fig, ax = plt.subplots(figsize=(min(2 + 0.5 * H, 9), min(1.5 + 0.22 * L, 9)))
    im = ax.imshow(grid, aspect="auto", cmap="viridis", origin="upper")
    ax.set_xlabel("query head")
    ax.set_ylabel("layer")
    ax.set_title(f"{metric} per layer and head ({split})")
    fig.colorbar(im, ax=ax)
    return _png(fig)


def judge_scores(summary: Sequence[dict], split: str) -> bytes | None:
    """Bars of the mean judge score vs ground truth per task, module next to full context."""
    rows = [r for r in summary if r["split"] == split and r["n_paired"] > 0]
    if not rows:
        return None
    tasks = [r["task"] for r in rows]
    x = np.arange(len(tasks))
    fig, ax = plt.subplots(figsize=(1.6 + 1.3 * len(tasks), 3.6))
    for off, key, label, color in ((-0.2, "base", "full context", "tab:blue"),
                                   (0.2, "module", "NECTAR module", "tab:green")):
        means = [r[f"{key}_mean"] for r in rows]
        errs = [0 if np.isnan(r[f"{key}_ci"]) else r[f"{key}_ci"] for r in rows]
        ax.bar(x + off, means, 0.4, yerr=errs, capsize=3, label=label, color=color)
    ax.set_xticks(x, tasks)
    ax.set_ylim(0, 5.5)
    ax.set_ylabel("mean score 1-5 (95% t-CI)")
    ax.set_title(f"judge vs ground truth ({split})")
    ax.legend(fontsize=8)
    return _png(fig)


def benchmark_curves(rows: Sequence[BenchmarkRow]) -> bytes | None:
    if not rows:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for system, (label, color) in SYSTEM_STYLE.items():
        sel = sorted((r for r in rows if r.system == system), key=lambda r: r.n_context)
        if not sel:
            continue
        n = [r.n_context for r in sel]
        axes[0].plot(n, [r.ttft_s * 1000 for r in sel], "o-", color=color, label=label)
        axes[1].plot(n, [r.decode_tok_s for r in sel], "o-", color=color, label=label)
        axes[2].plot(n, [r.peak_memory_bytes / 2**20 for r in sel], "o-", color=color, label=label)
    ns = sorted({r.n_context for r in rows})
    for ax, title in zip(axes, ("time to first token (ms)", "decode tokens/s", "peak memory (MiB)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.minorticks_off()
        ax.set_xlabel("document tokens n")
        ax.set_title(title)
        ax.legend(fontsize=8)
    axes[0].set_yscale("log")
    return _png(fig)


def _human_bytes(v: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if v >= scale:
            return f"{v / scale:g} {unit}"
    return f"{v:g} B"


def frontier(rows: Sequence[dict]) -> bytes | None:
    """The quality/memory frontier: KL recovered (95 % CI) against the bytes standing in for the
    document, one line per system over its budgets ρ, one panel per split. ``rows`` are comparison
    rows (dicts with system, kind, rho, state_bytes, split, recovered_kl and its interval); ``none``
    is the 0 line and ``full`` the star at the KV cache's bytes (recovered 1)."""
    splits = sorted({r["split"] for r in rows}, key=lambda s: ({"test": 0, "challenge": 1}.get(s, 2), s))
    if not splits:
        return None
    fig, axes = plt.subplots(1, len(splits), figsize=(5.2 * len(splits), 4.2), squeeze=False)
    systems = list(dict.fromkeys(r["system"] for r in rows if r["kind"] != "reference"))
    colors = {s: plt.get_cmap("tab10")(i % 10) for i, s in enumerate(systems)}
    for ax, split in zip(axes[0], splits):
        sel = [r for r in rows if r["split"] == split]
        for system in systems:
            pts = sorted((r for r in sel if r["system"] == system and r.get("recovered_kl") is not None
                          and r["state_bytes"] > 0), key=lambda r: r["state_bytes"])
            if not pts:
                continue
            x = [r["state_bytes"] for r in pts]
            y = [100 * r["recovered_kl"] for r in pts]
            lo = [100 * (r["recovered_kl"] - r["recovered_kl_ci_low"]) if r.get("recovered_kl_ci_low") is not None
                  else 0 for r in pts]
            hi = [100 * (r["recovered_kl_ci_high"] - r["recovered_kl"]) if r.get("recovered_kl_ci_high") is not None
                  else 0 for r in pts]
            style = "o-" if pts[0]["kind"] == "trained" else "s--"
            ax.errorbar(x, y, yerr=[lo, hi], fmt=style, capsize=3, color=colors[system], label=system)
        ax.axhline(0, color="gray", lw=1, ls=":", label="none (no document)")
        full = [r for r in sel if r["system"] == "full"]
        if full:
            ax.axhline(100, color="black", lw=1, ls=":")
            ax.plot([full[0]["state_bytes"]], [100], "*", color="black", ms=12, label="full KV cache")
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: _human_bytes(v)))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("bytes standing in for the document")
        ax.set_ylabel("KL recovered, % (95% CI over pairs)")
        n = sel[0].get("n_pairs") if sel else None
        ax.set_title(f"{split} ({n} pairs)" if n else split)
        ax.legend(fontsize=7, loc="lower right")
    return _png(fig)


def delta_by_document(rows: Sequence[dict]) -> bytes | None:
    """Paired Δ recovered KL (points, 95 % CI) of each state against a reference, per document: one panel
    per (split, reference), one marker per (state, budget ρ) beside each document
    (benchmarks/document_panel.py). ``rows``: dicts with document, tuned, split, against (the
    reference's label), state, rho, delta, low, high; a tuned document's label is starred."""
    rows = [r for r in rows if r.get("delta") is not None]
    panels = list(dict.fromkeys((r["split"], r["against"]) for r in rows))
    if not panels:
        return None
    docs = list(dict.fromkeys(r["document"] for r in rows))
    tuned = {r["document"] for r in rows if r.get("tuned")}
    series = sorted({(r["state"], r["rho"]) for r in rows}, key=lambda x: (x[0], x[1]))
    markers = {s: "os^vD"[i % 5] for i, s in enumerate(dict.fromkeys(s for s, _ in series))}
    rhos = sorted({rho for _, rho in series})
    colors = {rho: plt.get_cmap("viridis")(i / max(len(rhos) - 1, 1)) for i, rho in enumerate(rhos)}
    fig, axes = plt.subplots(len(panels), 1, figsize=(max(7.0, 1.1 * len(docs) + 2), 3.2 * len(panels)),
                             squeeze=False)
    width = 0.7 / len(series)
    for ax, (split, against) in zip(axes[:, 0], panels):
        for i, (state, rho) in enumerate(series):
            pts = [(docs.index(r["document"]), r) for r in rows
                   if (r["split"], r["against"], r["state"], r["rho"]) == (split, against, state, rho)]
            if not pts:
                continue
            x = [j - 0.35 + width * (i + 0.5) for j, _ in pts]
            y = [100 * r["delta"] for _, r in pts]
            err = [[100 * (r["delta"] - r["low"]) for _, r in pts], [100 * (r["high"] - r["delta"]) for _, r in pts]]
            label = f"{state}, ρ {100 * rho:g} %" if len(markers) > 1 else f"ρ {100 * rho:g} % of fp32"
            ax.errorbar(x, y, yerr=err, fmt=markers[state], color=colors[rho], capsize=2, ms=4, label=label)
        ax.axhline(0, color="gray", lw=1)
        ax.set_xticks(range(len(docs)))
        ax.set_xticklabels([f"{d}*" if d in tuned else d for d in docs], rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("Δ recovered KL, points")
        ax.set_title(f"{split}: state − {against} (95 % paired CI)", fontsize=9)
    axes[-1, 0].set_xlabel("document (* = used while tuning a setting)")
    # one legend for every panel, beside them: inside, several states' labels covered the points
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def allocation_heatmap(states: dict[str, Sequence[Sequence[int]]]) -> bytes | None:
    """Kept (key, value) pairs per layer × KV head of each state whose heads differ in width
    (``ModulePlan.quad_head_pairs``): where a global budget puts the bytes."""
    if not states:
        return None
    fig, axes = plt.subplots(1, len(states), figsize=(2.2 + 1.6 * len(states), 5.5), squeeze=False)
    top = max(max(max(h) for h in c) for c in states.values())
    for ax, (name, counts) in zip(axes[0], states.items()):
        grid = np.asarray(counts, dtype=float)  # [L, H]
        im = ax.imshow(grid, aspect="auto", cmap="viridis", vmin=0, vmax=top)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("KV head")
        ax.set_xticks(range(grid.shape[1]))
    axes[0][0].set_ylabel("layer")
    fig.colorbar(im, ax=axes[0].tolist(), label="kept pairs")
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def data_curve(points: Sequence[dict], reference: dict | None = None) -> bytes | None:
    """Recovered KL (95 % CI) against the training query tokens, one line per system, one panel per
    split (benchmarks/mlp_data_curve.py). ``points``: dicts with system, split, train_query_tokens,
    recovered_kl and ci [low, high]; ``reference``: {split: {recovered_kl, ci}} drawn flat (the
    run's default state); 0 is no document, 100 the full KV cache."""
    splits = [s for s in ("test", "probes") if any(p["split"] == s for p in points)]
    if not splits:
        return None
    fig, axes = plt.subplots(1, len(splits), figsize=(5.2 * len(splits), 4.2), squeeze=False)
    systems = list(dict.fromkeys(p["system"] for p in points))
    colors = {s: plt.get_cmap("tab10")(i % 10) for i, s in enumerate(systems)}
    for ax, split in zip(axes[0], splits):
        for system in systems:
            pts = sorted((p for p in points if p["split"] == split and p["system"] == system),
                         key=lambda p: p["train_query_tokens"])
            x = [p["train_query_tokens"] for p in pts]
            y = np.array([100 * p["recovered_kl"] for p in pts])
            err = [y - [100 * p["ci"][0] for p in pts], [100 * p["ci"][1] for p in pts] - y]
            ax.errorbar(x, y, yerr=err, fmt="o-", capsize=3, color=colors[system], label=system)
        ref = (reference or {}).get(split)
        if ref:
            ax.axhline(100 * ref["recovered_kl"], color="tab:red", lw=1, ls="--", label="cpu default (int4)")
        ax.axhline(0, color="gray", lw=1, ls=":", label="none (no document)")
        ax.axhline(100, color="black", lw=1, ls=":", label="full KV cache")
        ax.set_xscale("log")
        ax.set_xlabel("training query tokens")
        ax.set_ylabel("KL recovered, % (95% CI over pairs)")
        n = next((p["n_pairs"] for p in points if p["split"] == split), None)
        ax.set_title(f"{split} ({n} pairs)" if n else split)
        ax.legend(fontsize=7, loc="best")  # the curves sit low and high: where they leave room
    return _png(fig)
