"""What dashboards and sweeps read back from a run: sample rows and evaluation tables."""
from __future__ import annotations

import json
from typing import Any

from .executor import RunDir
from ..schemas.artifacts import ChunkRow, DatasetRow, PairRow
from ..storage import atomic_write
from ..tables import ArtifactError, read_table
from .context import RunContext

SAMPLE_TABLES = {"chunk": ("chunks.parquet", ChunkRow), "synthesize": ("pairs.parquet", PairRow),
                 "verify": ("dataset.parquet", DatasetRow)}
SAMPLE_COLUMNS = {"chunk": ("chunk_id", "n_words", "text"),
                  "synthesize": ("pair_id", "task", "instruction", "response", "parse_error"),
                  "verify": ("pair_id", "task", "instruction", "verdict", "confidence", "split", "challenge")}


def stage_samples(ctx: RunContext, stage: str, k: int = 5) -> list[dict[str, Any]]:
    """A few rows of a stage's main table, shortened, for dashboards."""
    if stage not in SAMPLE_TABLES:
        return []
    name, cls = SAMPLE_TABLES[stage]
    try:
        rows = read_table(ctx.run.url(stage, name), cls)[:k]
    except ArtifactError:
        return []
    return [{key: _short(getattr(r, key)) for key in SAMPLE_COLUMNS[stage]} for r in rows]


def _short(value: Any, limit: int = 120) -> Any:
    if isinstance(value, str) and len(value) > limit:
        return value[: limit - 1] + "…"
    return value


def stage_extra_tables(ctx: RunContext, stage: str) -> dict[str, list[dict[str, Any]]]:
    """Further tables a stage publishes (evaluate: headline, metrics, judge), by artifact name."""
    if stage != "evaluate":
        return {}
    tables = read_eval_tables(ctx.run)
    report = ctx.run.url("evaluate", "report.html")
    if tables.get("headline"):
        tables["headline"] = [{**row, "report": report} for row in tables["headline"]]
    return tables


def read_eval_tables(run: RunDir) -> dict[str, list[dict[str, Any]]]:
    return run.read_json("evaluate", "tables.json") or {}


def write_json(url: str, data: Any) -> None:
    """Plain JSON (tables for dashboards and sweeps), written atomically."""
    atomic_write(url, json.dumps(data, indent=1, default=str))
