"""benchmarks/document_panel.py end to end on the tiny model: two documents × two budgets, the table's
rows and columns, the paired Δ and its interval recomputed from the per-pair scores, and a re-run that
resumes (finished cells skipped, a missing one redone alone, an edited questions file redoing its
document's cells)."""
import csv
import importlib.util
import sys
from pathlib import Path

import pytest

from nectar.comparison.differences import paired
from nectar.evaluation import scoring

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "document_panel.py"
# the kvpress presses are swapped for closed-form references in the fast test (their venv is the slow
# test's); the machinery — fit, score, Δ, cells, resume — is the same
ARGS = ["--model", "tiny", "--documents", "naming,try", "--budgets", "0.02,0.05", "--probes", "12",
        "--set", "evaluate.bootstrap_resamples=200"]
REFS = ["--references", "recon_select@int4,recon_select@int8", "--reference", "recon_select@int4"]


@pytest.fixture(scope="module")
def panel():
    spec = importlib.util.spec_from_file_location("document_panel", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["document_panel"] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def scored(monkeypatch):
    """Every score_providers pass of the run: (its per-pair sums, its selection, its config)."""
    calls = []
    real = scoring.score_providers

    def spy(base, n, providers, sel, cfg, *args, **kw):
        sums, quality = real(base, n, providers, sel, cfg, *args, **kw)
        calls.append((sums, sel, cfg))
        return sums, quality

    monkeypatch.setattr(scoring, "score_providers", spy)
    return calls


def test_the_panel_names_its_documents_and_which_were_tuned_on(panel):
    docs = panel.PANEL
    assert len(docs) >= 8 and len({d.name for d in docs}) == len(docs)
    assert {"legal", "technical reference", "prose"} <= {d.kind for d in docs}
    assert any(d.yarn for d in docs)
    assert {d.name for d in docs if d.tuned} == {"naming", "lgpl3", "gpl3"}
    picked = panel.pick_documents("try,/tmp/own.txt,pydoc:import")
    assert [(d.name, d.kind) for d in picked] == [("try", "technical reference"), ("own", "other"), ("import", "other")]


def test_panel_end_to_end_on_the_tiny_model_and_resume(panel, scored, tmp_path, capsys):
    out = tmp_path / "panel"
    asked = tmp_path / "questions"  # naming's own questions (three answered, one left to the full model)
    asked.mkdir()
    lines = (Path(panel.__file__).parents[1] / "docs/examples/naming-questions.jsonl").read_text().splitlines()
    unanswered = next(line for line in lines if '"answer"' not in line)
    (asked / "naming-questions.jsonl").write_text("\n".join([*lines[:3], unanswered]) + "\n")
    args = [*ARGS, "--questions", str(asked), *REFS, "--out", str(out)]
    rows = panel.main(args)
    cells = {(r["document"], r["rho"]) for r in rows}
    assert cells == {(d, rho) for d in ("naming", "try") for rho in (0.02, 0.05)}
    assert {r["split"] for r in rows} <= {"probes", "probes_withheld", "questions"}
    assert {(r["document"], r["rho"]) for r in rows if r["split"] == "probes"} == cells
    # the questions split: naming's four (try has no file), with their Δ like any split
    asked_rows = [r for r in rows if r["split"] == "questions"]
    assert {(r["document"], r["n_pairs"]) for r in asked_rows} == {("naming", 4)} and len(asked_rows) == 2
    assert all(r["delta_ref"] is not None for r in asked_rows)
    # the table: the CSV's columns, the markdown's tables, the figure
    with open(out / "panel.csv") as f:
        table = list(csv.DictReader(f))
    assert tuple(table[0]) == panel.COLUMNS and len(table) == len(rows)
    md = (out / "panel.md").read_text()
    assert "## probes" in md and "| naming* | 1,528 |" in md and "| try |" in md and "2 % / 4 %" in md
    assert (out / "panel_delta.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "panel.parquet").exists()
    for r in rows:
        assert r["state"] == "recon_first@int4" and r["ref"] == "recon_select@int4"
        assert r["bf16_share"] == 2 * r["rho"] and r["kv_bytes_bf16"] == r["kv_bytes_fp32"] // 2
        for key in ("state_bytes", "ref_bytes", "best_bytes"):  # equal bytes: ρ of the float32 KV at most
            assert 0.9 * r["rho"] * r["kv_bytes_fp32"] < r[key] <= r["rho"] * r["kv_bytes_fp32"]
        assert r["best"] in ("recon_select@int4", "recon_select@int8")
        assert r["delta_ref"] == pytest.approx(r["state_recovered"] - r["ref_recovered"], abs=1e-9)
        assert r["delta_best"] == pytest.approx(r["state_recovered"] - r["best_recovered"], abs=1e-9)
        if r["n_pairs"] > 1:  # (one withheld probe has no interval: nan)
            assert r["delta_ref_low"] <= r["delta_ref"] <= r["delta_ref_high"]
    # the Δ interval is the paired bootstrap of the per-pair scores (one pass per document)
    assert len(scored) == 2
    for (sums, sel, cfg), doc in zip(scored, ("naming", "try")):
        for split, idx in sel.split_index().items():
            for rho in (0.02, 0.05):
                want = paired(sums, idx, split, [(f"recon_first@int4@{rho:g}", f"recon_select@int4@{rho:g}")], cfg)[0]
                row = next(r for r in rows if (r["document"], r["rho"], r["split"]) == (doc, rho, split))
                assert (row["delta_ref"], row["delta_ref_low"], row["delta_ref_high"]) == pytest.approx(
                    (want["delta_recovered_kl"], want["low"], want["high"]), nan_ok=True)
                assert row["n_pairs"] == len(idx)
    # a re-run: every cell done, nothing fitted or scored, the same table
    written = {p: p.stat().st_mtime_ns for p in (out / "cells").glob("*/info.json")}
    try_pairs = [p.pair_id for p in scored[1][1].pairs]
    scored.clear()
    assert panel.main(args) == rows
    assert scored == [] and "naming: every cell done; skipped" in capsys.readouterr().out
    assert {p: p.stat().st_mtime_ns for p in (out / "cells").glob("*/info.json")} == written
    # a cell left unfinished (no info.json) is redone alone: one pass, its document only, its budget only
    (out / "cells" / "try@0.05" / "info.json").unlink()
    again = panel.main(args)
    assert len(scored) == 1 and [p.pair_id for p in scored[0][1].pairs] == try_pairs
    assert set(scored[0][0]) == {"none", "full", "recon_first@int4@0.05", "recon_select@int4@0.05",
                                 "recon_select@int8@0.05"}
    assert again == rows  # the fitted states came from the cache: the same figures
    # an edited questions file redoes its document's cells (its answers' cache is keyed by the file)
    (asked / "naming-questions.jsonl").write_text("\n".join(lines[:2]) + "\n")
    scored.clear()
    edited = panel.main(args)
    assert len(scored) == 1 and len(scored[0][1].per_split["questions"]) == 2  # naming's pass alone
    assert {r["n_pairs"] for r in edited if r["split"] == "questions"} == {2}
    assert [r for r in edited if r["document"] == "try"] == [r for r in rows if r["document"] == "try"]
    # other settings into the same folder are refused, not mixed in
    with pytest.raises(SystemExit, match="other settings \\(probes"):
        panel.main([*ARGS[:-3], "8", *ARGS[-2:], "--questions", str(asked), *REFS, "--out", str(out)])


@pytest.mark.slow
def test_panel_against_kvzip_at_each_precision(panel, kvpress_env, tmp_path):
    rows = panel.main([*ARGS, "--documents", "naming", "--out", str(tmp_path / "panel")])
    assert {(r["rho"], r["split"]) for r in rows} >= {(0.02, "probes"), (0.05, "probes")}
    for r in rows:
        assert r["ref"] == "kvpress:kvzip:int4"
        assert r["best"] in ("kvpress:kvzip", "kvpress:kvzip:int8", "kvpress:kvzip:int4")
        assert r["best_recovered"] >= r["ref_recovered"]
        assert r["n_pairs"] < 2 or r["delta_ref_low"] <= r["delta_ref"] <= r["delta_ref_high"]
        assert r["ref_bytes"] <= 1.01 * r["rho"] * r["kv_bytes_fp32"]  # kvpress keeps whole entries: a rounding over


def test_every_panel_questions_file_reads_and_names_a_panel_document(panel):
    """docs/examples/<name>-questions.jsonl: each a valid questions file (read_questions' checks) of a panel
    entry, most answers hand-written."""
    from nectar.evaluation.questions import read_questions

    files = sorted((Path(panel.__file__).parents[1] / "docs" / "examples").glob("*-questions.jsonl"))
    names = {d.name for d in panel.PANEL}
    assert len(files) >= 7
    for path in files:
        doc = path.name.removesuffix("-questions.jsonl")
        assert doc in names, f"{path.name}: no panel document {doc!r}"
        assert panel.document_questions(next(d for d in panel.PANEL if d.name == doc), "docs/examples").resolve() == path
        rows = [row for _, row in read_questions(str(path)).rows]
        assert len(rows) >= 12 and sum(r.answer is not None for r in rows) >= 0.7 * len(rows)
