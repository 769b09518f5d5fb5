"""What a comparison writes: comparison.parquet (``ComparisonRow``), comparison.md, info.json, and the
frontier and allocation figures, into ``--out DIR`` or RUN/compare.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ..orchestration.context import RunContext
from ..orchestration.executor import RunDir
from ..schemas.artifacts import ComparisonRow
from ..storage import atomic_write
from ..tables import write_table
from .jobs import Job
from .table import comparison_markdown, differences_markdown, served_markdown
from .obtain import Obtained


@dataclass
class CompareResult:
    rows: list[ComparisonRow]
    files: list[str]
    timings: dict[str, float] = field(default_factory=dict)
    markdown: str = ""


def url_to_fs(url: str):
    import fsspec

    return fsspec.core.url_to_fs(url)


def compare_dir(ctx: RunContext, out: str | None = None) -> str:
    """Where the comparison is written: ``--out DIR``, or RUN/compare."""
    return out.rstrip("/") if out else ctx.run.url("compare")


def allocations(obtained: dict[str, Obtained]) -> dict[str, list[list[int]]]:
    """Kept pairs per (layer, KV head) of every state whose heads differ in width (the heat map)."""
    out = {}
    for key, o in obtained.items():
        plan = getattr(o.provider, "plan", None)
        if plan is not None and plan.quad_head_pairs:
            out[key] = [list(h) for h in plan.quad_head_pairs]
    return out


def comparison_rows(jobs: list[Job], obtained: dict[str, Obtained], quality) -> list[ComparisonRow]:
    rows = []
    for split, by_system in quality.items():
        for job in jobs:
            o = obtained[job.key]
            cols = by_system[job.key].columns()
            rows.append(ComparisonRow(
                system=job.system.name, kind=job.system.kind, regime=job.system.regime, arch=o.arch, rho=job.rho,
                state_bytes=o.state_bytes, split=split, train_seconds=o.seconds, state_seconds=o.state_seconds,
                source=o.source, **ComparisonRow.quality(cols)))
    return rows


def write_outputs(run: RunDir, rows: list[ComparisonRow], facts: dict[str, Any],
                  timings: dict[str, float], notes: dict[str, Any] | None = None,
                  allocation: dict[str, list[list[int]]] | None = None, out: str | None = None) -> CompareResult:
    from ..evaluation.plots import allocation_heatmap, frontier
    if out:
        fs, path = url_to_fs(out)
        fs.makedirs(path, exist_ok=True)
        out = out.rstrip("/")
    else:
        out = run.makedirs("compare")
    data = [r.model_dump(exclude={"schema_version"}) for r in rows]
    png = frontier([r for r in data if not r.get("kl_basis")])  # served rows: KL over other buckets
    files = ["comparison.parquet", "comparison.md", "info.json"]
    if png is not None:
        atomic_write(f"{out}/frontier.png", png)
        files.append("frontier.png")
    md = comparison_markdown(data, facts, "frontier.png" if png is not None else None)
    md += differences_markdown((notes or {}).get("differences", []))
    md += served_markdown((notes or {}).get("served", {}))
    heat = allocation_heatmap(allocation or {})
    if heat is not None:  # where one budget across layers and heads put the bytes
        atomic_write(f"{out}/allocation.png", heat)
        atomic_write(f"{out}/allocation.json", json.dumps(allocation))
        files += ["allocation.png", "allocation.json"]
        md += ("\n\n## Kept pairs per layer × KV head\n\n![allocation](allocation.png)\n\n"
               "(counts in allocation.json; a per-head budget would put the same number in every cell)\n")
    info = write_comparison(out, rows, md, {
        **facts, "systems": list(dict.fromkeys(r.system for r in rows)),
        "rhos": sorted({r.rho for r in rows if r.rho is not None}),
        "splits": {s: next(r.n_pairs for r in rows if r.split == s) for s in dict.fromkeys(r.split for r in rows)}},
        timings, notes or {})
    return CompareResult(rows, files, info["timings_s"], md)


def write_comparison(out: str, rows: list[ComparisonRow], md: str, facts: dict[str, Any], timings: dict[str, float],
                     notes: dict[str, Any]) -> dict[str, Any]:
    """The three files every comparison writes (one run's or several runs' composed): the rows, the
    markdown and info.json (the facts, the stage timings and the notes); returns the info."""
    write_table(f"{out}/comparison.parquet", rows, ComparisonRow)
    atomic_write(f"{out}/comparison.md", md)
    info = {**facts, "timings_s": {k: round(v, 2) for k, v in timings.items()}, **notes}
    atomic_write(f"{out}/info.json", json.dumps(info, indent=1, default=str))
    return info
