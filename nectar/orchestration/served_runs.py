"""Runs as ``nectar serve`` and ``nectar ask`` read them: a run directory (or a directory of runs)
→ ``serving.registry.ServedRun`` (the document, the base model's config, the trained module's
directory, the evaluation's generation defaults). The server itself never opens run directories.
"""
from __future__ import annotations

from pathlib import Path

from ..serving.limits import GenerationDefaults
from ..serving.registry import ServedRun
from .context import open_run


def open_served_run(run_dir: str) -> ServedRun:
    """A run whose train stage completed (FileNotFoundError otherwise, naming the fix)."""
    ctx = open_run(run_dir)
    if not ctx.run.exists("train", "module.json"):
        raise FileNotFoundError(f"{ctx.run.url('train')}: no trained module (run the pipeline through "
                                "the train stage first)")
    ev = ctx.config.evaluate
    return ServedRun(run_dir=ctx.run.root, doc_id=ctx.info.doc_id, doc_sha256=ctx.info.sha256, text=ctx.text,
                     model=ctx.config.model, module_url=ctx.run.url("train"),
                     defaults=GenerationDefaults(ev.max_new_tokens_other, ev.temperature, ev.top_p))


def expand_run_dirs(paths: list[str]) -> list[str]:
    """Run directories as given; a directory that is not a run stands for the trained runs under it
    (``runs/`` or ``runs/<doc-id>/``, as ``nectar run`` lays them out)."""
    found: list[str] = []
    for p in paths:
        root = Path(p)
        if (root / "run.json").exists() or not root.is_dir():
            found.append(p)  # a run (open_run explains what is wrong with a path that is not)
            continue
        runs = sorted({str(m.parent.parent) for pattern in ("*/train/module.json", "*/*/train/module.json")
                       for m in root.glob(pattern) if (m.parent.parent / "run.json").exists()})
        if not runs:
            raise FileNotFoundError(f"{p}: neither a run directory (no run.json) nor a directory of trained "
                                    "runs (no */train/module.json or */*/train/module.json under it)")
        found.extend(runs)
    return found


def open_served_runs(paths: list[str]) -> list[ServedRun]:
    return [open_served_run(r) for r in expand_run_dirs(paths)]
