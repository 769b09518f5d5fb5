"""The run report: tables as plain data, a markdown file and a self-contained HTML page.

``report_tables`` returns every table as lists of dicts (the Prefect flow publishes them as table
artifacts); ``render_markdown`` / ``render_html`` lay the same tables out with the figures and
side-by-side sample generations in the style of the paper's App. D. The HTML embeds its figures as
base64 PNGs and its CSS inline: one file that opens anywhere, offline.
"""
from __future__ import annotations

import base64
import html
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

from ..schemas.artifacts import GenerationRow, JudgmentRow, MetricsRow, TrainLogRow
from . import plots
from .benchmark import ratios
from .judge import judge_summary
from .metrics import accuracy_gap, recovered_fraction
from .quality import INTERVAL_PREFIX
from ..schemas.artifacts import BenchmarkRow, PerLayerRow
from ..tables import markdown_table


@dataclass
class ReportInputs:
    title: str
    metrics: list[MetricsRow] = field(default_factory=list)
    per_layer: list[PerLayerRow] = field(default_factory=list)
    generations: list[GenerationRow] = field(default_factory=list)
    judgments: list[JudgmentRow] = field(default_factory=list)
    benchmark: list[BenchmarkRow] = field(default_factory=list)
    train_log: list[TrainLogRow] = field(default_factory=list)
    module_bytes: int | None = None
    kv_bytes: int | None = None
    facts: dict[str, Any] = field(default_factory=dict)  # model, document, n, arch, rho, …
    notes: list[str] = field(default_factory=list)  # caveats shown at the top
    samples_per_split: int = 4


def _num(x: float | None) -> float | None:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else x


METRIC_COLUMNS = ("split", "model", "n_pairs", "n_tokens", *[c for metric, prefix in INTERVAL_PREFIX.items()
                                                              for c in (metric, f"{prefix}_ci_low",
                                                                        f"{prefix}_ci_high")], "n_agreement")


def metrics_table(metrics: Sequence[MetricsRow]) -> list[dict[str, Any]]:
    """Every metric with its interval bounds as plain numbers (for dashboards and sweeps)."""
    return [{c: getattr(m, c) for c in METRIC_COLUMNS} for m in metrics]


def fmt_interval(value: Any, low: Any, high: Any) -> str:
    """``0.723 [0.701, 0.745]``; the bare value when there is no interval."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if low is None or high is None:
        return fmt(value)
    return f"{fmt(value)} [{fmt(low)}, {fmt(high)}]"


def with_intervals(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows for display: each metric's ``_ci_low/_ci_high`` folded into one "value [low, high]" cell."""
    bounds = {f"{p}_ci_{end}" for p in INTERVAL_PREFIX.values() for end in ("low", "high")}
    out = []
    for r in rows:
        row = {}
        for key, value in r.items():
            if key in bounds:
                continue
            prefix = INTERVAL_PREFIX.get(key)
            row[key] = fmt_interval(value, r.get(f"{prefix}_ci_low"), r.get(f"{prefix}_ci_high")) if prefix else value
        out.append(row)
    return out


METRICS_NOTE = ("Every pair of each split, teacher forced on its response tokens; [low, high] is a 95 % paired "
                "bootstrap interval over pairs. recovered_kl = 1 − KL_model / KL_none: the share of the document's "
                "effect on the next-token distribution the model keeps (none 0, full 1). agreement_*: greedy "
                "continuations of n_agreement prompts compared with the full-context model's (exact match, "
                "ROUGE-L F1, all-MiniLM-L6-v2 cosine).")
COMPARE_NOTE = ("How the module compares with the equal-bytes alternatives (a truncated or evicted KV cache, "
                "Attention Matching, cartridges, other training regimes): `nectar compare {run}` writes "
                "[../compare/comparison.md](../compare/comparison.md) and a quality/memory frontier figure.")


def per_layer_summary(rows: Sequence[PerLayerRow]) -> list[dict[str, Any]]:
    """Per split and layer: means over heads; plus E_rel (App. C: summed over layers and heads)."""
    out = []
    for split in sorted({r.split for r in rows}):
        sel = [r for r in rows if r.split == split]
        for layer in sorted({r.layer for r in sel}):
            lr = [r for r in sel if r.layer == layer]
            out.append({"split": split, "layer": layer,
                        **{k: sum(getattr(r, k) for r in lr) / len(lr)
                           for k in ("mse_alpha", "mse_A", "rte_alpha", "rte_A")}})
    return out


def headline_table(inputs: ReportInputs, judge_rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per split: the numbers the README quotes."""
    acc = {(m.split, m.model): m for m in inputs.metrics}
    judged = {r["split"]: r for r in judge_rows if r["task"] == "all"}
    rte = {}
    for r in inputs.per_layer:
        rte[r.split] = rte.get(r.split, 0.0) + r.rte_A
    bench = _bench_headline(inputs.benchmark)
    out = []
    for split in sorted({m.split for m in inputs.metrics} | set(judged)):
        full, mod, none = (acc.get((split, k)) for k in ("full", "module", "none"))
        row: dict[str, Any] = {"split": split}
        if full and mod and none:
            row["token_acc_module"] = mod.token_acc
            row["token_acc_full"] = full.token_acc
            row["token_acc_none"] = none.token_acc
            row["token_acc_gap"] = accuracy_gap(full.token_acc, mod.token_acc)
            row["recovered_fraction"] = recovered_fraction(mod.token_acc, full.token_acc, none.token_acc)
            row["ce_gap"] = mod.cross_entropy - full.cross_entropy
            row["kl_module"] = mod.kl_to_full
            row["kl_module_ci"] = [mod.kl_ci_low, mod.kl_ci_high]
            row["kl_none"] = none.kl_to_full
            row["recovered_kl"] = mod.recovered_kl
            row["recovered_kl_ci"] = [mod.recovered_kl_ci_low, mod.recovered_kl_ci_high]
            row["agreement_rouge_l_module"] = mod.agreement_rouge_l
            row["agreement_rouge_l_none"] = none.agreement_rouge_l
            row["n_pairs"] = mod.n_pairs
            row["n_tokens"] = mod.n_tokens
        if split in rte:
            row["rte_A_total"] = rte[split]
        j = judged.get(split)
        if j:
            row["delta_s"] = _num(j["delta_s"])
            row["delta_s_ci"] = _num(j["delta_s_ci"])
            row["judged"] = j["n_paired"]
            row["judge_unparsed"] = j["n_unparsed"]
        row["module_bytes"] = inputs.module_bytes
        row["kv_bytes"] = inputs.kv_bytes
        row.update(bench)
        out.append(row)
    return out


def _bench_headline(rows: Sequence[BenchmarkRow]) -> dict[str, Any]:
    """TTFT and tok/s of module vs full cache at the largest benchmarked n."""
    if not rows:
        return {}
    n = max(r.n_context for r in rows if r.system == "module") if any(
        r.system == "module" for r in rows) else max(r.n_context for r in rows)
    by = {r.system: r for r in rows if r.n_context == n}
    out: dict[str, Any] = {"bench_n": n}
    for system, r in by.items():
        out[f"ttft_ms_{system}"] = r.ttft_s * 1000
        out[f"tok_s_{system}"] = r.decode_tok_s
    return out


def report_tables(inputs: ReportInputs) -> dict[str, list[dict[str, Any]]]:
    """Every table of the report as plain data (lists of flat dicts)."""
    judge_rows = judge_summary(inputs.judgments)
    return {
        "headline": headline_table(inputs, judge_rows),
        "metrics": metrics_table(inputs.metrics),
        "judge": judge_rows,
        "benchmark": [{**r.model_dump(exclude={"schema_version"}), "peak_memory_mib": r.peak_memory_bytes / 2**20,
                       "state_mib": r.state_bytes / 2**20} for r in inputs.benchmark],
        "benchmark_ratios": ratios(inputs.benchmark),
        "per_layer": per_layer_summary(inputs.per_layer),
    }


def report_figures(inputs: ReportInputs, tables: dict[str, list[dict[str, Any]]]) -> dict[str, bytes]:
    figs: dict[str, bytes | None] = {"training_curves": plots.training_curves(inputs.train_log),
                                     "benchmark": plots.benchmark_curves(inputs.benchmark)}
    for split in sorted({r.split for r in inputs.per_layer}):
        figs[f"rte_A_heatmap_{split}"] = plots.layer_heatmap(inputs.per_layer, split, "rte_A")
    for split in sorted({r["split"] for r in tables["judge"]}):
        figs[f"judge_scores_{split}"] = plots.judge_scores(tables["judge"], split)
    return {k: v for k, v in figs.items() if v is not None}


# ---------------------------------------------------------------- formatting


def fmt(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}" if abs(value) >= 10_000 else str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "–"
        if value != 0 and (abs(value) >= 1e5 or abs(value) < 1e-3):
            return f"{value:.3g}"
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


def _mb(x: int | None) -> str:
    return "–" if x is None else f"{x / 2**20:.2f} MB"


def headline_lines(tables: dict[str, list[dict[str, Any]]]) -> list[tuple[str, str]]:
    """The headline as (label, value) pairs for the first table of the report, one per split."""
    out = []
    for h in tables["headline"]:
        s = h["split"]
        if "token_acc_gap" in h:
            out.append((f"{s}: token-accuracy gap (full − module)", f"{100 * h['token_acc_gap']:.2f} pts"))
            rf = h.get("recovered_fraction")
            out.append((f"{s}: document benefit recovered", "undefined (full ≤ none: the document brings no benefit)" if rf is None
                        else f"{100 * rf:.1f} %"))
            out.append((f"{s}: token accuracy module / full / none",
                        f"{100 * h['token_acc_module']:.1f} / {100 * h['token_acc_full']:.1f} / "
                        f"{100 * h['token_acc_none']:.1f} %"))
        if h.get("recovered_kl") is not None:
            lo, hi = h["recovered_kl_ci"]
            out.append((f"{s}: share of the no-document KL recovered, 1 − KL_module/KL_none (95% CI over "
                        f"{h['n_pairs']} pairs, {h['n_tokens']} tokens)",
                        f"{100 * h['recovered_kl']:.1f} %"
                        + ("" if lo is None else f" [{100 * lo:.1f}, {100 * hi:.1f}]")))
            lo, hi = h["kl_module_ci"]
            out.append((f"{s}: KL(full ‖ module) / KL(full ‖ none), nats per token",
                        f"{fmt_interval(h['kl_module'], lo, hi)} / {fmt(h['kl_none'])}"))
        if h.get("agreement_rouge_l_module") is not None:
            out.append((f"{s}: greedy agreement with the full model, ROUGE-L module / none",
                        f"{fmt(h['agreement_rouge_l_module'])} / {fmt(h['agreement_rouge_l_none'])}"))
        if "delta_s" in h:
            ci = h.get("delta_s_ci")
            val = "–" if h["delta_s"] is None else (f"{h['delta_s']:.2f}" + (f" ± {ci:.2f}" if ci is not None else ""))
            out.append((f"{s}: Δs = mean(base) − mean(module) (95% t-CI)",
                        f"{val} (n={h['judged']}, unparsed {h['judge_unparsed']})"))
    if tables["headline"]:
        h = tables["headline"][0]
        if h.get("module_bytes") and h.get("kv_bytes"):
            out.append(("module bytes vs document KV bytes",
                        f"{_mb(h['module_bytes'])} vs {_mb(h['kv_bytes'])} "
                        f"({h['kv_bytes'] / h['module_bytes']:.1f}× smaller)"))
        if "bench_n" in h:
            n = h["bench_n"]
            for system in ("module", "full_cached", "full_cold"):
                if f"ttft_ms_{system}" in h:
                    out.append((f"n={n}: TTFT / decode tok/s, {system}",
                                f"{h[f'ttft_ms_{system}']:.1f} ms / {h[f'tok_s_{system}']:.1f}"))
    return out


def _md_cell(value: Any) -> str:
    """One table cell: pipes escaped, line breaks as <br> (a raw newline would end the table)."""
    text = fmt(value).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return text.replace("|", "\\|").replace("\r", "").replace("\n", "<br>")


def _md_table(rows: list[dict[str, Any]], columns: Sequence[str] | None = None) -> str:
    if not rows:
        return "_none_\n"
    cols = list(columns or rows[0].keys())
    return markdown_table(cols, ([_md_cell(r.get(c)) for c in cols] for r in rows))


def sample_generations(inputs: ReportInputs) -> list[GenerationRow]:
    """A few samples per split, spread over tasks (App. D-style side-by-side tables)."""
    out: list[GenerationRow] = []
    shown: set[str] = set()
    for split in sorted({g.split for g in inputs.generations}, key=lambda s: (s != "test", s)):
        # a challenge pair is also a test pair: show each pair once
        rows = [g for g in inputs.generations if g.split == split and g.pair_id not in shown]
        rows.sort(key=lambda g: (g.task, g.pair_id))
        by_task: dict[str, list[GenerationRow]] = {}
        for g in rows:
            by_task.setdefault(g.task, []).append(g)
        picked: list[GenerationRow] = []
        while len(picked) < min(inputs.samples_per_split, len(rows)):  # round-robin over tasks
            for t in list(by_task):
                if by_task[t] and len(picked) < inputs.samples_per_split:
                    picked.append(by_task[t].pop(0))
        out += picked
        shown |= {g.pair_id for g in picked}
    return out


def _judge_scores_for(inputs: ReportInputs, g: GenerationRow) -> dict[str, str]:
    out = {}
    for j in inputs.judgments:
        if j.pair_id == g.pair_id and j.split == g.split:
            out[j.comparison] = str(j.score) if j.score is not None else "unparsed"
    return out


JUDGE_COLUMNS = ("split", "task", "n_samples", "n_paired", "n_unparsed", "judge_errors", "delta_s",
                 "delta_s_ci", "base_mean", "module_mean", "agreement_mean")
BENCH_COLUMNS = ("n_context", "system", "ttft_s", "decode_tok_s", "peak_memory_mib", "state_mib",
                 "new_tokens", "note")


def render_markdown(inputs: ReportInputs, tables: dict[str, list[dict[str, Any]]],
                    figure_files: dict[str, str] | None = None) -> str:
    """The report as markdown; ``figure_files`` maps figure name → relative PNG path."""
    md = [f"# {inputs.title}\n"]
    if inputs.facts:
        md.append(" · ".join(f"**{k}** {fmt(v)}" for k, v in inputs.facts.items()) + "\n")
    md += [f"> {n}\n" for n in inputs.notes]
    md.append("## Headline\n")
    md.append(_md_table([{"metric": k, "value": v} for k, v in headline_lines(tables)]))
    md.append("## Teacher-forced metrics and agreement with the full-context model\n")
    md.append(METRICS_NOTE + "\n")
    md.append(_md_table(with_intervals(tables["metrics"])))
    md.append("## Comparison with equal-bytes baselines\n")
    md.append(COMPARE_NOTE.format(run=inputs.facts.get("run", "RUN_DIR")) + "\n")
    md.append("## LLM judge: Δs = mean(base) − mean(module), 95% Student-t intervals\n")
    md.append(_md_table(tables["judge"], JUDGE_COLUMNS))
    md.append("## Generation benchmark (App. F)\n")
    md.append(_md_table(tables["benchmark"], BENCH_COLUMNS))
    md.append(_md_table(tables["benchmark_ratios"]))
    md.append("## Per-layer errors (means over heads; App. C)\n")
    md.append(_md_table(tables["per_layer"]))
    for name, path in (figure_files or {}).items():
        md.append(f"![{name}]({path})\n")
    md.append("## Sample generations\n")
    for g in sample_generations(inputs):
        scores = _judge_scores_for(inputs, g)
        md.append(f"**{g.split} · {g.task} · {g.pair_id}** — judge: module {scores.get('module_vs_truth', '–')}, "
                  f"full {scores.get('base_vs_truth', '–')}, agreement {scores.get('module_vs_base', '–')}\n")
        md.append(_md_table([{"": "Instruction", "text": g.instruction}, {"": "Ground truth", "text": g.ground_truth},
                             {"": "Full KV-cache", "text": g.full_output},
                             {"": "NECTAR module", "text": g.module_output}]))
    return "\n".join(md)


_CSS = """
body{font-family:-apple-system,Segoe UI,Helvetica,Arial,sans-serif;max-width:1100px;margin:2em auto;
padding:0 1em;color:#222}table{border-collapse:collapse;margin:.6em 0 1.4em;font-size:13px;display:block;
overflow-x:auto;max-width:100%}
td,th{border:1px solid #ccc;padding:3px 7px;text-align:left;vertical-align:top}th{background:#f3f3f3}
.note{background:#fff7e0;border-left:4px solid #e0a800;padding:.4em .8em;margin:.4em 0}
.sample td{white-space:pre-wrap}.sample td:first-child{font-weight:bold;width:13%;white-space:nowrap}img{max-width:100%}
h2{border-bottom:1px solid #ddd;padding-bottom:.2em;margin-top:1.6em}.facts{color:#555}
"""


def _html_table(rows: list[dict[str, Any]], columns: Sequence[str] | None = None, cls: str = "") -> str:
    if not rows:
        return "<p><em>none</em></p>"
    cols = list(columns or rows[0].keys())
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(fmt(r.get(c)))}</td>" for c in cols) + "</tr>"
                   for r in rows)
    return f'<table class="{cls}"><tr>{head}</tr>{body}</table>'


def _img(png: bytes, alt: str) -> str:
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{base64.b64encode(png).decode()}">'


def render_html(inputs: ReportInputs, tables: dict[str, list[dict[str, Any]]], figures: dict[str, bytes]) -> str:
    h = [f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(inputs.title)}</title>"
         f"<style>{_CSS}</style></head><body><h1>{html.escape(inputs.title)}</h1>"]
    if inputs.facts:
        h.append('<p class="facts">' + " · ".join(f"<b>{html.escape(k)}</b> {html.escape(fmt(v))}"
                                                    for k, v in inputs.facts.items()) + "</p>")
    h += [f'<div class="note">{html.escape(n)}</div>' for n in inputs.notes]
    h.append("<h2>Headline</h2>" + _html_table([{"metric": k, "value": v} for k, v in headline_lines(tables)]))
    h.append("<h2>Teacher-forced metrics and agreement with the full-context model</h2>"
             f"<p>{html.escape(METRICS_NOTE)}</p>" + _html_table(with_intervals(tables["metrics"])))
    run = html.escape(str(inputs.facts.get("run", "RUN_DIR")))
    h.append("<h2>Comparison with equal-bytes baselines</h2><p>How the module compares with the equal-bytes "
             "alternatives (a truncated or evicted KV cache, Attention Matching, cartridges, other training "
             f"regimes): <code>nectar compare {run}</code> writes "
             '<a href="../compare/comparison.md">../compare/comparison.md</a> and '
             '<a href="../compare/frontier.png">a quality/memory frontier figure</a>.</p>')
    h.append("<h2>LLM judge</h2><p>Δs = mean(base) − mean(module) over samples where both judgments "
             "parsed (lower is better); ± is the 95% Student-t half width.</p>"
             + _html_table(tables["judge"], JUDGE_COLUMNS))
    for name, png in figures.items():
        if name.startswith("judge_scores"):
            h.append(_img(png, name))
    h.append("<h2>Generation benchmark (App. F)</h2>" + _html_table(tables["benchmark"], BENCH_COLUMNS)
             + _html_table(tables["benchmark_ratios"]))
    if "benchmark" in figures:
        h.append(_img(figures["benchmark"], "benchmark"))
    h.append("<h2>Training</h2>")
    h.append(_img(figures["training_curves"], "training curves") if "training_curves" in figures
             else "<p><em>no training log</em></p>")
    h.append("<h2>Per-layer errors (App. C)</h2>" + _html_table(tables["per_layer"]))
    for name, png in figures.items():
        if name.startswith("rte_A_heatmap"):
            h.append(_img(png, name))
    h.append("<h2>Sample generations</h2>")
    for g in sample_generations(inputs):
        s = _judge_scores_for(inputs, g)
        h.append(f"<p><b>{html.escape(g.split)} · {html.escape(g.task)} · {html.escape(g.pair_id)}</b> — judge: "
                 f"module {s.get('module_vs_truth', '–')}, full {s.get('base_vs_truth', '–')}, "
                 f"agreement {s.get('module_vs_base', '–')}</p>")
        rows = (("Instruction", g.instruction), ("Ground truth", g.ground_truth),
                ("Full KV-cache", g.full_output), ("NECTAR module", g.module_output))
        h.append('<table class="sample">' + "".join(
            f"<tr><td>{k}</td><td>{html.escape(v)}</td></tr>" for k, v in rows) + "</table>")
    h.append("</body></html>")
    return "\n".join(h)


@dataclass
class WrittenReport:
    files: list[str]  # paths relative to the output folder
    tables: dict[str, list[dict[str, Any]]]


def write_report(out_url: str, inputs: ReportInputs) -> WrittenReport:
    """Write report.md (+ figures/*.png it links) and the self-contained report.html."""
    from ..storage import atomic_write

    tables = report_tables(inputs)
    figures = report_figures(inputs, tables)
    root = out_url.rstrip("/")
    files, fig_paths = [], {}
    for name, png in figures.items():
        rel = f"figures/{name}.png"
        atomic_write(f"{root}/{rel}", png)
        files.append(rel)
        fig_paths[name] = rel
    for rel, text in (("report.md", render_markdown(inputs, tables, fig_paths)),
                      ("report.html", render_html(inputs, tables, figures))):
        atomic_write(f"{root}/{rel}", text)
        files.append(rel)
    return WrittenReport(files, tables)
