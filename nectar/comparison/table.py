"""The comparison as markdown: one table per split, every figure with its 95 % interval."""
from __future__ import annotations

from typing import Any, Sequence

from ..evaluation.bootstrap import Estimate
from ..evaluation.report import fmt_interval
from ..tables import markdown_table

HOW_TO_READ = """\
How to read it. Every system stands in for the document in the same base model, at the bytes in the
`bytes` column — as stored: integer codes, fp16 scales and zeros, β and buffers included (× = how many
times smaller than the document's KV cache at its dtype, % = its share of it); every system at the same
ρ fits the same bytes (ρ is a share of the float32 KV's bytes; `@int8` / `@int4` systems keep as many
entries as those bytes buy at that precision). **KL to full** is KL(full-context model ‖ system) per response
token, teacher forced (nats; lower is better); **KL recovered** = 1 − KL_system / KL_none is the share of
the document's effect on the next-token distribution the system keeps (none 0 %, full 100 %; it can go
below 0 when a system misleads the model more than having no document). **ROUGE-L / exact / cosine**
compare the system's greedy continuation of each prompt with the full-context model's. Brackets are 95 %
paired bootstrap intervals over pairs (all systems resampled on the same pairs): two systems whose
intervals don't overlap differ on this split; overlapping intervals can still differ (the paired
difference is tighter than either interval). `train s` is the training time of a trained system (from
its train stage, cached runs included), the fit time of a closed-form baseline or the press time of a
kvpress press. `state s` is the time from the document to a usable state: the document's prefill (full);
the run's data stages (chunk → targets, from their manifests) plus training, or plus the fit for the
baselines that read the captured queries (evict, attention_matching); the fit alone (truncate); the
press alone (kvpress, in its own venv; no greedy agreement is run for kvpress rows).
"""

SPLIT_ORDER = {"test": 0, "challenge": 1, "probes": 2}


def _bytes(n: int, kv: int | None) -> str:
    if n == 0:
        return "0"
    ratio = f" ({kv / n:.1f}×, {100 * n / kv:.2f} %)" if kv else ""
    return f"{n / 1e6:.3f} MB{ratio}"


def _pct(row: dict[str, Any], key: str, prefix: str) -> str:
    v, lo, hi = row.get(key), row.get(f"{prefix}_ci_low"), row.get(f"{prefix}_ci_high")
    if v is None:
        return "–"
    if lo is None or hi is None:
        return f"{100 * v:.1f}"
    return f"{100 * v:.1f} [{100 * lo:.1f}, {100 * hi:.1f}]"


def _ci(row: dict[str, Any], key: str, prefix: str) -> str:
    return fmt_interval(row.get(key), row.get(f"{prefix}_ci_low"), row.get(f"{prefix}_ci_high"))


def _seconds(s: float | None) -> str:
    return "–" if s is None else f"{s:.0f}" if s >= 10 else f"{s:.1f}"


def sort_key(row: dict[str, Any]) -> tuple:
    ref = {"none": 0, "full": 1}.get(row["system"], 2)
    rec = row.get("recovered_kl")
    return (ref, row.get("rho") or 0.0, -(rec if rec is not None else float("-inf")))


def split_table(rows: Sequence[dict[str, Any]], kv_bytes: int | None) -> str:
    head = ("system", "kind", "ρ", "bytes", "KL to full [95% CI]", "KL recovered, % [95% CI]",
            "token acc, % [95% CI]", "cross-entropy [95% CI]", "ROUGE-L vs full [95% CI]", "exact", "cosine",
            "train s", "state s")
    return markdown_table(head, (_split_cells(r, kv_bytes) for r in sorted(rows, key=sort_key)))


def _split_cells(r: dict[str, Any], kv_bytes: int | None) -> tuple:
    return (r["system"], r["kind"], "–" if r.get("rho") is None else f"{r['rho']:g}",
            _bytes(r["state_bytes"], kv_bytes), _ci(r, "kl_to_full", "kl"),
            _pct(r, "recovered_kl", "recovered_kl"),
            _pct(r, "token_acc", "token_acc"), _ci(r, "cross_entropy", "cross_entropy"),
            _ci(r, "agreement_rouge_l", "agreement_rouge_l"),
            "–" if r.get("agreement_exact") is None else f"{100 * r['agreement_exact']:.0f} %",
            "–" if r.get("agreement_cosine") is None else f"{r['agreement_cosine']:.3f}",
            _seconds(r.get("train_seconds")), _seconds(r.get("state_seconds")))


def comparison_markdown(rows: Sequence[dict[str, Any]], facts: dict[str, Any], figure: str | None = None) -> str:
    kv = facts.get("kv_bytes")
    md = ["# Equal-bytes comparison\n",
          " · ".join(f"**{k}** {v}" for k, v in facts.items() if k != "kv_bytes")
          + (f" · **document KV cache** {kv / 1e6:.2f} MB" if kv else "") + "\n", HOW_TO_READ]
    rows = [r for r in rows if not r.get("kl_basis")]  # served rows: KL over other buckets (served_markdown)
    for split in sorted({r["split"] for r in rows}, key=lambda s: (SPLIT_ORDER.get(s, 9), s)):
        sel = [r for r in rows if r["split"] == split]
        first = sel[0]
        agree = f"; agreement on {first['n_agreement']} prompts" if first.get("n_agreement") else ""
        md.append(f"## {split}: {first['n_pairs']} pairs, {first['n_tokens']} response tokens{agree}\n")
        md.append(split_table(sel, kv))
    if figure:
        md.append(f"![KL recovered vs bytes]({figure})\n")
    return "\n".join(md)


def differences_markdown(differences: list[dict[str, Any]]) -> str:
    """The paired gaps as a section of comparison.md ('' when there are none)."""
    if not differences:
        return ""
    lines = ["", "", "## Paired differences: recovered KL minus a reference's at the same budget", "",
             "The reference is the best kvpress press at that budget, or, for a refined state, the closed-form "
             "state its gradient steps start from, or, for a `+gaps` composition, the same composition fitted "
             "without the gaps. Points of recovered KL, 95 % paired bootstrap over the "
             "split's pairs (the same resamples as the intervals above): an interval wholly above 0 means the "
             "system keeps more of the document than the reference on these pairs; one containing 0 is a tie.", "",
             "| split | system | reference | pairs | Δ recovered KL, points [95% CI] |", "|---|---|---|---|---|"]
    for d in differences:
        est = Estimate(d["delta_recovered_kl"], d["low"], d["high"], d["n_pairs"])
        lines.append(f"| {d['split']} | {d['system']} | {d['reference']} | {d['n_pairs']} | "
                     f"{est.fmt(1, 100)} |")
    return "\n".join(lines) + "\n"


def served_markdown(served: dict[str, dict[str, Any]]) -> str:
    """The served rows (``vllm:…``, notes['served']) as a section of comparison.md: the probe KL recovered
    through vLLM beside the torch engine's for the same state file on the same coarse buckets, and the torch
    engine's full-vocabulary figure ('' when no served system was asked for)."""
    if not served:
        return ""
    done = {k: v for k, v in served.items() if "error" not in v}
    top_k = sorted({v["top_k"] for v in done.values()}) or ["k"]
    lines = ["", "", f"## Served by vLLM: probe KL over vLLM's top-{', '.join(map(str, top_k))} buckets", "",
             "vLLM returns only its top k log-probabilities per position, so these KLs are taken over k + 1 "
             "buckets (those k tokens, the rest of the vocabulary as one): a lower bound of the full-vocabulary "
             "KL, **not comparable with the tables above**. What serving changes is the gap between the state "
             "through vLLM and the same state file through the torch engine on the same buckets; the torch "
             "engine's full-vocabulary figure is the one comparable with the tables above. KL recovered = "
             "1 − KL / KL(none) on the same buckets; 95 % paired bootstrap intervals over the probes.", "",
             "| system | state | pairs | tokens | KL recovered through vLLM, % [95% CI] | torch engine, same "
             "buckets, % | torch engine, full vocabulary, % | KL(torch ‖ vLLM), nats/token |",
             "|---|---|---|---|---|---|---|---|"]
    for key, f in done.items():
        est = {k: Estimate(*f[k], f["pairs"]) for k in ("recovered_vllm", "recovered_torch", "recovered_torch_exact",
                                                         "kl_torch_vllm")}
        state = (f"{f['state']}, m={f['m']}{', β (NECTAR backend)' if f['bias'] else ''}, "
                 f"{f['bytes'] / 1e6:.2f} MB as vLLM loads it, vLLM {f.get('vllm') or '?'}")
        lines.append(f"| {key} | {state} | {f['pairs']} | {f['tokens']} | {est['recovered_vllm'].fmt(1, 100)} | "
                     f"{est['recovered_torch'].fmt(1, 100)} | {est['recovered_torch_exact'].fmt(1, 100)} | "
                     f"{est['kl_torch_vllm'].fmt(6)} |")
    lines += [f"- {key}: left out: {v['error']}" for key, v in served.items() if "error" in v]
    return "\n".join(lines) + "\n"
