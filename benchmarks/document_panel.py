"""Issue 38's document panel: the first state against kvpress's KVzip at equal bytes, on documents nobody
tuned on and down to 200× compression — one command, resumable.

    python benchmarks/document_panel.py --out panel                       # every panel document, 0.5–5 %
    python benchmarks/document_panel.py --out panel --documents lgpl3,gfdl13 --budgets 0.01,0.05
    python benchmarks/document_panel.py --out /tmp/p --model tiny --documents naming,try --budgets 0.02,0.05

What each cell (document × budget ρ) compares, on the same held-out document probes:

  * the state, ``recon_first@int4``: the FIRST state — the default state's algorithm from the document
    alone (keys ranked, β and values fitted on the reconstruction queries, int4, and where keys are scarce
    — 0.5 % — refined end to end on the reconstruction; no LLM server, no self-study;
    ``recon_first_fit@int4`` is its fit alone). It is not the default *served* state after self-study (``recon_fit_qa@int4``, then
    refined), which needs the whole LLM pipeline per document; ``--runs NAME=RUN_DIR`` scores a run's live
    state as well (``run:live``, at the run's own ρ, when that ρ is one of the budgets). ``--states`` adds
    other document-only states (e.g. ``recon_mixed``, the bit-allocation lever).
  * ``kvpress:kvzip:int4`` (kvpress's KVzip, kept entries at int4: the reference of ``--reference``), and
    KVzip at float32 and int8: the best of the ``--references`` per budget and split is "KVzip at its
    best precision".
  * ``none`` and ``full`` (no document; the exact KV): the ends recovered KL is measured between.

Budgets ρ are shares of the document's float32 KV bytes (what every state is sized by): 0.5 % is 200×
smaller than the float32 KV and 100× smaller than a bf16 one — 5 % of float32 is 10 % of bf16; both
shares are in the tables. Teacher forced on up to ``--probes`` held-out probes per document (seeded),
recovered KL with 95 % paired bootstrap intervals over probes, and the paired Δ (state − reference)
with its interval from the same resamples. Reconstruction leaves ``--withheld`` (0.1) of the document
out (targets.recon.withheld_fraction): ``probes_withheld`` are the probes lying wholly there, text the
state's fit never reconstructed (issue 38 item 3); KVzip's press reconstructs the whole document, so the
``probes`` figures lean against the state. Where ``--questions`` (docs/examples) holds
``<name>-questions.jsonl`` — questions written by hand from the document's text, as a user would ask
them, most with a hand-written answer and the rest answered once by the full-context model — every
system is also teacher-forced on those answers: the ``questions`` split ("test no worse", issue 38
item 2), as ``nectar compare --questions`` scores them (docs/quality.md, "Your own questions").

Machinery: ``nectar compare``'s, without a targets stage (as ``nectar compare RUN_A RUN_B`` does): each
document is a run directory holding only its text (OUT/runs/<name>); states fitted by
``compose.fit_part`` and presses scored by ``compose.kvpress_entries``, both cached in OUT/cache/<name>;
one ``score_providers`` pass per document; Δ by ``differences.paired`` and ``to_best_press``. Each cell
is written when done (OUT/cells/<name>@<ρ>/: comparison.parquet, comparison.md, info.json) and a re-run
skips finished cells; then OUT/panel.csv, panel.parquet, panel.md (the tables of docs/quality.md) and
panel_delta.png (Δ by document) are written from every finished cell.

The panel (``PANEL``): ``--documents`` names its entries, or gives a path or pydoc:<topic> ad hoc. The
``tuned`` column says which documents were used while tuning any setting: pydoc:naming (the default
document), LGPL-3 and GPL-3 (the first state's fit cap). A text missing on this machine is skipped, with one line. A document over the
model's window (with the longest query) runs under YaRN ×2, as do the entries marked ``yarn``.
"""
from __future__ import annotations

import argparse
import csv
import gzip
import glob
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SETTINGS = ("model", "withheld", "probes", "set", "states", "references", "reference", "questions")
QUESTIONS = "docs/examples"  # <name>-questions.jsonl per document (a relative path not here: the repository's)


@dataclass(frozen=True)
class PanelDocument:
    name: str
    kind: str  # legal | technical reference | prose
    source: str  # pydoc:<topic>, or a path (a glob; read decompressed when it ends in .gz)
    tuned: bool = False  # used while tuning any setting
    yarn: bool = False  # runs under YaRN ×2 whatever its length (the panel's long texts)
    note: str = ""


PANEL = (
    PanelDocument("naming", "technical reference", "pydoc:naming", tuned=True,
                  note="CPython reference, naming and binding; the default document"),
    PanelDocument("try", "technical reference", "pydoc:try", note="CPython reference, the try statement"),
    PanelDocument("formatstrings", "technical reference", "pydoc:formatstrings",
                  note="CPython reference, the format specification mini-language"),
    PanelDocument("lgpl3", "legal", "/usr/share/common-licenses/LGPL-3", tuned=True, note="GNU LGPL v3"),
    PanelDocument("apache2", "legal", "/usr/share/common-licenses/Apache-2.0", note="Apache License 2.0"),
    PanelDocument("mpl2", "legal", "/usr/share/common-licenses/MPL-2.0", note="Mozilla Public License 2.0"),
    PanelDocument("gfdl13", "legal", "/usr/share/common-licenses/GFDL-1.3", note="GNU FDL 1.3"),
    PanelDocument("xz-history", "prose", "/usr/share/doc/xz-utils/history.txt.gz",
                  note="XZ Utils' history of LZMA Utils, narrative (Debian's xz-utils docs)"),
    PanelDocument("vim-usr02", "prose", "/usr/share/vim/vim*/doc/usr_02.txt",
                  note="Vim user manual, 'The first steps in Vim', tutorial prose (vim-runtime)"),
    PanelDocument("gpl3", "legal", "/usr/share/common-licenses/GPL-3", tuned=True, yarn=True,
                  note="GNU GPL v3, long; the first state's fit cap (first.select.fit_keys) was chosen on it"),
    PanelDocument("types", "technical reference", "pydoc:types", yarn=True,
                  note="CPython reference, the standard type hierarchy, long"),
)


def pick_documents(names: str | None) -> list[PanelDocument]:
    """Panel entries by name, in the order given; a path or pydoc:<topic> is an ad hoc entry."""
    by_name = {d.name: d for d in PANEL}
    if not names:
        return list(PANEL)
    out = []
    for name in (n.strip() for n in names.split(",") if n.strip()):
        if name in by_name:
            out.append(by_name[name])
        else:
            stem = Path(name.removeprefix("pydoc:")).stem
            out.append(PanelDocument(stem, "other", name, note="ad hoc"))
    return out


def document_text(doc: PanelDocument) -> str | None:
    """The entry's text (normalised as nectar reads a document), or None when it is not on this machine."""
    from nectar.documents import DocumentError, decode_text, load_document, normalise

    if doc.source.startswith("pydoc:"):
        return load_document(doc.source)[0]
    paths = sorted(glob.glob(doc.source))
    if not paths:
        return None
    raw = gzip.open(paths[-1]).read() if paths[-1].endswith(".gz") else Path(paths[-1]).read_bytes()
    try:
        return normalise(decode_text(raw, paths[-1]))
    except DocumentError:
        return None


# ----- one document: its run, probes, states, presses, scores -----

def document_run(doc: PanelDocument, text: str, args, out: Path, runs: dict[str, str]):
    """The run context a document's cells are fitted and scored in: ``--runs``'s run directory (its own
    configuration, with the panel's withheld share), or OUT/runs/<name> holding only the text."""
    from nectar.layout import ContextTooLongError
    from nectar.orchestration.context import open_run, prepare_run
    from nectar.schemas.presets import load_config

    if doc.name in runs:
        ctx = open_run(runs[doc.name])
        if ctx.text != text:
            raise SystemExit(f"--runs {doc.name}={runs[doc.name]}: that run's document is not the panel's "
                             f"{doc.source} (another text); give the run of this document")
        ctx.config = with_withheld(ctx.config, args.withheld)
        return ctx
    path = out / "documents" / f"{doc.name}.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    overrides = [f"targets.recon.withheld_fraction={args.withheld}", "evaluate.agreement_max_samples=0",
                 *args.set]
    preset = {"smollm2": "cpu", "tiny": "tiny"}[args.model]
    run_dir = str(out / "runs" / doc.name)
    if not doc.yarn:
        try:
            return prepare_run(str(path), load_config(preset, overrides=overrides), run_dir)
        except ContextTooLongError:  # over the window with the longest query: YaRN ×2
            pass
    return prepare_run(str(path), load_config(preset, overrides=[*overrides, "model.yarn_factor=2"]), run_dir)


def with_withheld(config, fraction: float):
    """``config`` with reconstruction leaving ``fraction`` of the document out (probes_withheld)."""
    targets = config.targets
    recon = targets.recon.model_copy(update={"withheld_fraction": fraction})
    return config.model_copy(update={"targets": targets.model_copy(update={"recon": recon})})


def panel_prompts(ctx, per_doc: int, seed: int):
    """Up to ``per_doc`` held-out probes (compose's seeded sample), split ``probes`` and, for those
    wholly in the withheld units, ``probes_withheld``."""
    import dataclasses

    from nectar.comparison.compose import composed_prompts
    from nectar.queries.probes import make_probes
    from nectar.queries.recon import withheld_probes

    tcfg = ctx.config.targets
    prompts = composed_prompts([("doc", ctx.text)], ctx, per_doc, 0, seed)
    withheld = withheld_probes(ctx.text, tcfg.recon, tcfg.probes, make_probes(ctx.text, tcfg.probes))
    return [dataclasses.replace(p, pair_id=p.pair_id.removeprefix("doc:"),
                                splits=("probes", "probes_withheld") if p.pair_id.removeprefix("doc:") in withheld
                                else ("probes",)) for p in prompts]


def live_entry(ctx, base):
    """The run's live state (first or refined) as an entry at the run's ρ, or None when it has none."""
    from nectar.comparison.compose import Entry
    from nectar.modules.io import load_module
    from nectar.modules.provider import ModuleDocState
    from nectar.orchestration.live import live_stage

    stage = live_stage(ctx.run)
    if stage is None:
        return None
    module, spec = load_module(ctx.run.url(stage), base, ctx.info.sha256, device=base.device)
    rho = ctx.config.train.module.rho
    return Entry(f"run:live@{rho:g}", "run", rho, ModuleDocState(module), spec.module_bytes, None,
                 f"{ctx.run.url(stage)} (live: the {stage} stage's)", spec.arch)


def document_questions(doc: PanelDocument, folder: str | None) -> Path | None:
    """The document's own questions (``FOLDER/<name>-questions.jsonl``: hand-written from its text, not
    from self-study), or None where the folder holds none for it."""
    if not folder:
        return None
    root = Path(folder)
    if not root.is_absolute() and not root.exists():  # the default names the repository's own folder
        root = Path(__file__).resolve().parents[1] / folder
    path = root / f"{doc.name}-questions.jsonl"
    return path if path.is_file() else None


def questions_sha256(doc: PanelDocument, folder: str | None) -> str | None:
    """The sha256 of the document's questions file as nectar reads it (a bad file stops here, in one line,
    before anything loads)."""
    from nectar.evaluation.questions import read_questions

    path = document_questions(doc, folder)
    return read_questions(str(path)).sha256 if path is not None else None


def cell_done(out: Path, doc: PanelDocument, rho: float, questions: str | None) -> bool:
    """A finished cell, scored on the document's questions as they are now (an edited file redoes it)."""
    path = cell_dir(out, doc, rho) / "info.json"
    return path.exists() and json.loads(path.read_text()).get("questions_sha256") == questions


def cell_dir(out: Path, doc: PanelDocument, rho: float) -> Path:
    return out / "cells" / f"{doc.name}@{rho:g}"


def run_document(doc: PanelDocument, text: str, rhos: list[float], args, out: Path, runs: dict[str, str]) -> None:
    """Fit, press and score the document's unfinished cells in one pass, and write each cell."""
    from nectar.attention.doc_kv import prefill_document
    from nectar.attention.exact import ExactDocState
    from nectar.comparison.compose import Entry, Part, fit_part, kvpress_entries, selection
    from nectar.comparison.run import SCORE_BATCH
    from nectar.comparison.systems import resolve
    from nectar.evaluation.questions import load_questions, with_questions
    from nectar.evaluation.scoring import score_providers
    from nectar.layout import build_layout
    from nectar.orchestration.context import load_base

    load0, t0 = os.getloadavg(), time.perf_counter()
    ctx = document_run(doc, text, args, out, runs)
    base = load_base(ctx.config)
    layout = build_layout(base.tokenizer, ctx.text)
    t1 = time.perf_counter()
    doc_kv = prefill_document(base, layout.context_ids)
    timings = {"prefill_s": time.perf_counter() - t1}
    cfg = ctx.config.evaluate
    sel = selection(panel_prompts(ctx, args.probes, cfg.seed), layout)
    asked = document_questions(doc, args.questions)
    if asked is not None:  # the user's measure beside the probes: a `questions` split, answers cached in the run
        loaded = load_questions(str(asked), base, layout, ExactDocState(doc_kv), ctx.run.url("questions"), cfg)
        sel = with_questions(sel, loaded.pairs, cfg)
    print(f"panel: {doc.name} ({doc.kind}) n={layout.n}{' YaRN x2' if ctx.config.model.yarn_factor else ''}: "
          f"{', '.join(f'{k} {len(v)}' for k, v in sel.per_split.items())} pairs; cells "
          f"{', '.join(f'{r:g}' for r in rhos)} (load {fmt_load(load0)})", flush=True)
    cache = out / "cache" / doc.name
    part = Part(ctx, doc.name, layout, doc_kv)
    entries = [Entry("none", "reference", None, None, 0, 0.0, "no document"),
               Entry("full", "reference", None, ExactDocState(doc_kv), doc_kv.nbytes(), timings["prefill_s"],
                     "the document's KV cache")]
    states, refs = resolve(args.states), resolve(args.references)
    t1 = time.perf_counter()
    for s in states + [r for r in refs if r.kind != "kvpress"]:
        for rho in rhos:
            st = fit_part(part, s, rho, base, str(cache / "states"))
            entries.append(Entry(f"{s.name}@{rho:g}", s.kind, rho, st.provider, st.nbytes, st.seconds,
                                 f"fit_part({s.name!r}) on the document alone", st.arch))
    timings["fit_s"] = time.perf_counter() - t1
    live = live_entry(ctx, base) if doc.name in runs else None
    live_in = live is not None and any(math.isclose(live.rho, r) for r in rhos)
    if live_in:
        entries.append(live)
    elif live is not None:
        print(f"panel: {doc.name}: the run's live state is at ρ {live.rho:g}, not a panel budget; left out")
    sums_extra: dict = {}
    notes: dict[str, Any] = {}
    t1 = time.perf_counter()
    entries += kvpress_entries([(r, rho) for r in refs if r.kind == "kvpress" for rho in rhos], base, ctx,
                               layout.context_ids, doc_kv, sel, str(cache / "kvpress"), sums_extra, notes)
    timings["kvpress_s"] = time.perf_counter() - t1
    providers = {e.key: e.provider for e in entries if e.kind != "kvpress"}
    sums, quality = score_providers(base, layout.n, providers, sel, cfg, SCORE_BATCH, 8, None, timings, sums_extra)
    reference_keys = {f"{r.name}@{rho:g}" for r in refs for rho in rhos}
    facts = {"document": doc.name, "kind": doc.kind, "tuned": doc.tuned, "source": doc.source, "note": doc.note,
             "model": base.name, "yarn_factor": ctx.config.model.yarn_factor, "n": layout.n,
             "kv_bytes": doc_kv.nbytes(), "kv_dtype": str(doc_kv.keys[0].dtype).removeprefix("torch."),
             "withheld_fraction": ctx.config.targets.recon.withheld_fraction, "run": ctx.run.root,
             "questions": str(asked) if asked is not None else None,
             "questions_sha256": loaded.file.sha256 if asked is not None else None,
             "states": [s.name for s in states] + (["run:live"] if live_in else []),
             "references": [r.name for r in refs]}
    for rho in rhos:
        mine = [e for e in entries if e.rho is None or math.isclose(e.rho, rho)]
        diffs = cell_differences(mine, reference_keys, f"{args.reference}@{rho:g}", rho, sums, sel, quality, cfg)
        write_cell(cell_dir(out, doc, rho), mine, quality, {**facts, "rho": rho, "bf16_share": 2 * rho},
                   {**timings, "document_total_s": time.perf_counter() - t0},
                   {**notes, "differences": diffs, "load_before": list(load0), "load_after": list(os.getloadavg())})
    print(f"panel: {doc.name} done in {time.perf_counter() - t0:.0f} s (load {fmt_load(os.getloadavg())})", flush=True)


def cell_differences(entries, reference_keys: set[str], reference: str, rho: float, sums, sel, quality,
                     cfg) -> list[dict[str, Any]]:
    """Each state's paired Δ recovered KL to the named reference (``against`` "reference") and to the
    best of the references at this budget on each split (``against`` "best")."""
    from nectar.comparison.differences import paired, to_best_press

    refs = [e.key for e in entries if e.key in reference_keys]
    states = [e.key for e in entries if e.rho is not None and e.key not in reference_keys]
    out = []
    if reference in refs:
        for split, idx in sel.split_index().items():
            if len(idx) and split in quality:
                out += [{**d, "against": "reference"} for d in paired(sums, idx, split, [(k, reference) for k in states], cfg)]
    items = [(k, rho, False) for k in states] + [(k, rho, True) for k in refs]
    return out + [{**d, "against": "best"} for d in to_best_press(items, sums, sel, quality, cfg)]


def write_cell(path: Path, entries, quality, facts: dict[str, Any], timings: dict[str, float],
               notes: dict[str, Any]) -> None:
    """comparison.parquet / .md / info.json of one cell, info.json last (its presence: the cell is done)."""
    from nectar.comparison.compose import rows
    from nectar.comparison.outputs import write_comparison
    from nectar.comparison.table import comparison_markdown, differences_markdown

    table = rows(entries, quality)
    data = [r.model_dump(exclude={"schema_version"}) for r in table]
    md = comparison_markdown(data, {k: v for k, v in facts.items() if k not in ("note", "run")})
    md = md.replace("# Equal-bytes comparison", f"# Document panel: {facts['document']} at ρ {facts['rho']:g}", 1)
    shown = {(d["split"], d["system"], d["reference"]): d for d in notes["differences"]}  # both Δ may be one
    md += differences_markdown(list(shown.values()))
    path.mkdir(parents=True, exist_ok=True)
    write_comparison(str(path), table, md, {**facts, "systems": [e.key for e in entries]}, timings, notes)


# ----- the panel's tables and figure, from every finished cell -----

def panel_rows(out: Path, docs: list[PanelDocument]) -> list[dict[str, Any]]:
    """One row per (document, budget, split, state): the state's recovered KL, and (when the references
    were scored) the named reference's and the best reference's with the two paired Δ; bytes on both
    bases."""
    from nectar.schemas.artifacts import ComparisonRow
    from nectar.tables import read_table

    order = {d.name: i for i, d in enumerate(docs)}
    rows = []
    for info_path in sorted((out / "cells").glob("*/info.json")):
        info = json.loads(info_path.read_text())
        if info["document"] not in order:
            continue
        by = {(r.system, r.split): r for r in read_table(str(info_path.parent / "comparison.parquet"), ComparisonRow)}
        diffs = {(d["system"].rsplit("@", 1)[0], d["split"], d["against"]): d for d in info.get("differences", [])}
        for (system, split), state in by.items():
            if system in info["states"]:
                rows.append(_row(info, state, by, diffs))
    return sorted(rows, key=lambda r: (order[r["document"]], r["rho"], r["split"] != "probes", r["state"]))


def _row(info: dict[str, Any], state, by: dict, diffs: dict) -> dict[str, Any]:
    row = {"document": info["document"], "kind": info["kind"], "tuned": info["tuned"], "n": info["n"],
           "yarn_factor": info["yarn_factor"], "rho": info["rho"], "bf16_share": info["bf16_share"],
           "kv_bytes_fp32": info["kv_bytes"], "kv_bytes_bf16": info["kv_bytes"] // 2, "split": state.split,
           "n_pairs": state.n_pairs, "state": state.system, "state_bytes": state.state_bytes,
           "state_recovered": state.recovered_kl, "state_low": state.recovered_kl_ci_low,
           "state_high": state.recovered_kl_ci_high}
    for against, prefix in (("reference", "ref"), ("best", "best")):
        d = diffs.get((state.system, state.split, against))
        if d is None:
            continue
        ref = by[(d["reference"].rsplit("@", 1)[0], state.split)]
        row.update({prefix: ref.system, f"{prefix}_bytes": ref.state_bytes, f"{prefix}_recovered": ref.recovered_kl,
                    f"{prefix}_low": ref.recovered_kl_ci_low, f"{prefix}_high": ref.recovered_kl_ci_high,
                    f"delta_{prefix}": d["delta_recovered_kl"], f"delta_{prefix}_low": d["low"],
                    f"delta_{prefix}_high": d["high"]})
    return row


COLUMNS = ("document", "kind", "tuned", "n", "yarn_factor", "rho", "bf16_share", "kv_bytes_fp32", "kv_bytes_bf16",
           "split", "n_pairs", "state", "state_bytes", "state_recovered", "state_low", "state_high",
           "ref", "ref_bytes", "ref_recovered", "ref_low", "ref_high", "delta_ref", "delta_ref_low", "delta_ref_high",
           "best", "best_bytes", "best_recovered", "best_low", "best_high", "delta_best", "delta_best_low",
           "delta_best_high")


def write_panel(out: Path, docs: list[PanelDocument], settings: dict[str, Any]) -> list[dict[str, Any]]:
    """OUT/panel.csv, panel.parquet, panel.md and panel_delta.png from every finished cell."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from nectar.evaluation.plots import delta_by_document
    from nectar.storage import atomic_write

    rows = [{c: r.get(c) for c in COLUMNS} for r in panel_rows(out, docs)]
    with open(out / "panel.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    pq.write_table(pa.Table.from_pylist(rows), str(out / "panel.parquet"))
    points = [{"document": r["document"], "tuned": r["tuned"], "split": r["split"], "state": r["state"],
               "against": settings["reference"] if name == "ref" else "the best reference",
               "rho": r["rho"], "delta": r[f"delta_{name}"], "low": r[f"delta_{name}_low"],
               "high": r[f"delta_{name}_high"]}
              for r in rows for name in ("ref", "best")]
    png = delta_by_document(points)
    if png is not None:
        atomic_write(str(out / "panel_delta.png"), png)
    atomic_write(str(out / "panel.md"), panel_markdown(rows, docs, settings, png is not None))
    return rows


def _pct(v: float | None, lo: float | None = None, hi: float | None = None, sign: bool = False) -> str:
    if v is None:
        return "–"
    f = "{:+.1f}" if sign else "{:.1f}"
    if lo is None or hi is None or math.isnan(lo) or math.isnan(hi):  # (one probe: no interval)
        return f.format(100 * v)
    return f.format(100 * v) + f" [{f.format(100 * lo)}, {f.format(100 * hi)}]"


def panel_markdown(rows: list[dict[str, Any]], docs: list[PanelDocument], settings: dict[str, Any],
                   figure: bool) -> str:
    from nectar.tables import markdown_table

    md = ["# Document panel: the state against KVzip at equal bytes\n",
          " · ".join(f"**{k}** {v}" for k, v in settings.items()) + "\n",
          "Recovered no-document KL, %, 95 % paired bootstrap over probes; Δ = state − reference in points, "
          "paired (same resamples). ρ is the share of the float32 KV's bytes (the bf16 share is 2ρ). "
          "* = used while tuning a setting.\n",
          "## Documents\n",
          markdown_table(("name", "kind", "tuned", "source", "note"),
                         ((d.name, d.kind, "yes" if d.tuned else "no", f"`{d.source}`", d.note) for d in docs))]
    for split in dict.fromkeys(r["split"] for r in rows):
        sel = [r for r in rows if r["split"] == split]
        md.append(f"## {split}\n")
        md.append(markdown_table(
            ("document", "n", "ρ fp32 / bf16", "state", "bytes (× fp32 KV)", "state, %", "reference, %",
             "Δ vs reference", "best reference, %", "Δ vs best", "probes"),
            ((f"{r['document']}{'*' if r['tuned'] else ''}", f"{r['n']:,}" + (" (YaRN)" if r["yarn_factor"] else ""),
              f"{100 * r['rho']:g} % / {100 * r['bf16_share']:g} %", r["state"],
              f"{r['state_bytes'] / 1e6:.3f} MB ({r['kv_bytes_fp32'] / max(r['state_bytes'], 1):.0f}×)",
              _pct(r["state_recovered"], r["state_low"], r["state_high"]),
              f"{r['ref'] or '–'}: {_pct(r['ref_recovered'], r['ref_low'], r['ref_high'])}",
              _pct(r["delta_ref"], r["delta_ref_low"], r["delta_ref_high"], sign=True),
              f"{r['best'] or '–'}: {_pct(r['best_recovered'], r['best_low'], r['best_high'])}",
              _pct(r["delta_best"], r["delta_best_low"], r["delta_best_high"], sign=True), r["n_pairs"])
             for r in sel)))
    if figure:
        md.append("![Δ by document](panel_delta.png)\n")
    return "\n".join(md)


# ----- the command -----

def fmt_load(load) -> str:
    return " ".join(f"{x:.2f}" for x in load)


def check_settings(out: Path, settings: dict[str, Any]) -> None:
    """A re-run resumes only a panel made with the same settings (its cells would not compare)."""
    path = out / "panel.json"
    if path.exists():
        old = json.loads(path.read_text())
        changed = [k for k in SETTINGS if old.get(k) != settings.get(k)]
        if changed:
            raise SystemExit(f"{out} holds a panel made with other settings ({', '.join(changed)}: "
                             f"{[old.get(k) for k in changed]}); give another --out")
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(settings, indent=1))


def parse_args(argv: list[str] | None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="the panel's folder (resumed when it holds one)")
    ap.add_argument("--documents", default=None, help=f"panel entries ({', '.join(d.name for d in PANEL)}; "
                    "default all) or ad hoc paths / pydoc:<topic>")
    ap.add_argument("--budgets", default="0.005,0.01,0.02,0.05", help="shares of the float32 KV's bytes")
    ap.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2",
                    help="smollm2: the cpu preset's SmolLM2-135M; tiny: the tests' random model")
    ap.add_argument("--states", default="recon_first@int4", help="document-only states, each at every budget")
    ap.add_argument("--references", default="kvpress:kvzip,kvpress:kvzip:int8,kvpress:kvzip:int4",
                    help="what the states are compared with (the best of them per budget and split)")
    ap.add_argument("--reference", default="kvpress:kvzip:int4", help="the one reference of the first Δ")
    ap.add_argument("--probes", type=int, default=80, help="held-out probes per document (seeded sample)")
    ap.add_argument("--withheld", type=float, default=0.1, help="share of the document reconstruction leaves out")
    ap.add_argument("--runs", default="", help="NAME=RUN_DIR,…: score that run's live state too")
    ap.add_argument("--questions", default=QUESTIONS,
                    help="a folder of <name>-questions.jsonl files (the `questions` split); '' for none")
    ap.add_argument("--set", action="append", default=[], help="a config override KEY=VALUE (repeatable)")
    args = ap.parse_args(argv)
    args.questions = args.questions or None
    args.states = [s for s in args.states.split(",") if s]
    args.references = [s for s in args.references.split(",") if s]
    if args.reference not in args.references:
        ap.error(f"--reference {args.reference} must be one of --references")
    return args


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    from nectar.comparison.inputs import parse_rhos

    args = parse_args(argv)
    out = Path(args.out)
    rhos = parse_rhos(args.budgets, "--budgets")
    runs = dict(item.split("=", 1) for item in args.runs.split(",") if item)
    docs = pick_documents(args.documents)
    settings = {k: getattr(args, k) for k in SETTINGS}
    check_settings(out, settings)
    t0, load0 = time.perf_counter(), os.getloadavg()
    present = []
    for doc in docs:
        text = runs_text(runs[doc.name]) if doc.name in runs else document_text(doc)
        if text is None:
            print(f"panel: {doc.name}: {doc.source} is not on this machine; skipped")
            continue
        present.append(doc)
        sha = questions_sha256(doc, args.questions)
        todo = [rho for rho in rhos if not cell_done(out, doc, rho, sha)]
        if not todo:
            print(f"panel: {doc.name}: every cell done; skipped")
            continue
        run_document(doc, text, todo, args, out, runs)
    rows = write_panel(out, present, {**settings, "documents": [d.name for d in present]})
    print(f"panel: {len(rows)} rows in {out / 'panel.md'}; {time.perf_counter() - t0:.0f} s, load "
          f"{fmt_load(load0)} → {fmt_load(os.getloadavg())}")
    return rows


def runs_text(run_dir: str) -> str:
    from nectar.orchestration.context import open_run

    return open_run(run_dir).text


if __name__ == "__main__":
    main()
