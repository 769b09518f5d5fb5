"""The kvpress presses' rows: scored on the same pairs in kvpress's own venv (nectar/kvpress/), joining
the paired bootstrap through their per-pair sums.
"""
from __future__ import annotations

from typing import Any

from ..evaluation.teacher import EvalPair
from ..kvpress import BridgeResult, KvpressEnvError, KvpressError, PressJob, score_presses
from ..orchestration.context import RunContext
from .jobs import Job
from .obtain import Obtained
from .outputs import url_to_fs


def score_kvpress(ctx: RunContext, base, context_ids, doc_kv, pairs: list[EvalPair], jobs: list[Job],
                  obtained: dict[str, "Obtained"], sums: dict, notes: dict[str, Any],
                  out: str | None = None) -> list[Job]:
    """Score the kvpress jobs in kvpress's venv; fill ``sums`` and ``obtained`` for those that ran and
    return them. Jobs that cannot run are reported (printed and in ``notes``) and left out: the
    comparison goes on without their rows."""
    if not jobs:
        return []
    press_jobs = [PressJob(j.key, j.system.press, j.rho, j.system.bits) for j in jobs]
    try:
        result: BridgeResult = score_presses(base, ctx.config.model, list(context_ids), doc_kv, pairs, press_jobs,
                                             url_to_fs(f"{out.rstrip('/')}/kvpress")[1] if out else ctx.run.local_path("compare", "kvpress"))
    except (KvpressEnvError, KvpressError) as exc:
        print(f"kvpress rows left out: {exc}")
        notes["kvpress"] = {"error": str(exc)}
        return []
    notes["kvpress"] = {**result.facts, "guard_max_token_kl": result.guard_max_kl, "errors": result.errors}
    for key, why in result.errors.items():
        print(f"kvpress row {key} left out: {why}")
    ran = []
    for j in jobs:
        r = result.results.get(j.key)
        if r is None:
            continue
        sums[j.key] = r.sums
        precision = "fp32" if j.system.bits == 32 else f"int{j.system.bits}"
        obtained[j.key] = Obtained(None, r.state_bytes, r.press_s, j.system.press,
                                   f"kvpress {result.facts.get('kvpress_version') or ''} {j.system.press}, "
                                   f"{r.kept_entries} entries at {precision}")
        ran.append(j)
    return ran
