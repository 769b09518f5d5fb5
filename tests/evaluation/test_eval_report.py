"""The report: plain-data tables, markdown, and an HTML page with no external assets."""
import re

import pytest

from nectar.evaluation.report import ReportInputs, report_tables, write_report
from nectar.schemas.artifacts import BenchmarkRow, PerLayerRow
from nectar.schemas import GenerationRow, JudgmentRow, MetricsRow, TrainLogRow


def _inputs():
    metrics = [MetricsRow(split="test", model=m, token_acc=a, cross_entropy=ce, kl_to_full=kl, n_tokens=100,
                          n_pairs=8, token_acc_ci_low=a - 0.05, token_acc_ci_high=a + 0.05, kl_ci_low=kl * 0.8,
                          kl_ci_high=kl * 1.25, recovered_kl=rec, recovered_kl_ci_low=rec_lo, recovered_kl_ci_high=rec_hi)
               for m, a, ce, kl, rec, rec_lo, rec_hi in (("module", 0.55, 2.1, 0.3, 2 / 3, 0.6, 0.72),
                                                         ("full", 0.60, 1.9, 0.0, 1.0, 1.0, 1.0),
                                                         ("none", 0.40, 2.8, 0.9, 0.0, 0.0, 0.0))]
    per_layer = [PerLayerRow(split="test", layer=l, q_head=h, kv_head=h // 2, mse_alpha=0.1, mse_A=0.2,
                             rte_alpha=-3.0, rte_A=-1.0 - l, n_tokens=50) for l in range(3) for h in range(4)]
    gens = [GenerationRow(pair_id=f"p{i}", split="test", task=t, instruction=f"Question <{i}>?",
                          ground_truth="truth & more", module_output="module answer", full_output="full answer\nsecond | line")
            for i, t in enumerate(("qa", "qa", "quoting"))]
    judg = []
    for i, (b, m) in enumerate(((5, 4), (4, 4), (3, None))):
        for c, s in (("base_vs_truth", b), ("module_vs_truth", m), ("module_vs_base", 4)):
            judg.append(JudgmentRow(pair_id=f"p{i}", split="test", task=gens[i].task, comparison=c, score=s,
                                    reasoning="", raw="", parse_error=None if s else "unparsed"))
    bench = [BenchmarkRow(n_context=n, system=s, ttft_s=t, decode_tok_s=r, peak_memory_bytes=2**28,
                          memory_method="m", state_bytes=sb, prompt_tokens=10, new_tokens=8, repeats=1,
                          device="cpu") for n in (512, 1024)
             for s, t, r, sb in (("module", 0.02, 40.0, 1000), ("full_cold", 0.5 * n / 512, 30.0, 20000),
                                 ("full_cached", 0.03, 35.0, 20000))]
    log = [TrainLogRow(step=s, samples=s * 64, split=sp, lr=1e-4, loss=1.0 / (s + 1), loss_alpha=0.1, loss_A=0.5,
                       loss_kl=0.0, rte_A=-s / 10) for s in range(0, 50, 10) for sp in ("train", "heldout")]
    return ReportInputs(title="Run <x>", metrics=metrics, per_layer=per_layer, generations=gens, judgments=judg,
                        benchmark=bench, train_log=log, module_bytes=2**20, kv_bytes=20 * 2**20,
                        facts={"model": "tiny:llama", "n": 700}, notes=["judge: local"])


def test_tables_are_plain_data_with_the_headline_numbers():
    t = report_tables(_inputs())
    h = t["headline"][0]
    assert h["token_acc_gap"] == pytest.approx(0.05)
    assert h["recovered_fraction"] == pytest.approx(0.75)
    assert h["delta_s"] == pytest.approx(0.5) and h["judged"] == 2 and h["judge_unparsed"] == 1
    assert h["rte_A_total"] == pytest.approx(4 * (-1 - 2 - 3))
    assert h["bench_n"] == 1024 and h["ttft_ms_module"] == pytest.approx(20.0)
    assert t["benchmark_ratios"][1]["ttft_speedup_vs_cold"] == pytest.approx(50.0)
    assert len(t["per_layer"]) == 3 and t["per_layer"][2]["rte_A"] == pytest.approx(-3.0)
    import json
    json.dumps(t)  # publishable as artifacts as is


def test_written_report_is_self_contained(tmp_path):
    out = write_report(str(tmp_path), _inputs())
    assert {"report.md", "report.html"} <= set(out.files)
    html = (tmp_path / "report.html").read_text()
    srcs = re.findall(r'src="([^"]+)"', html)
    assert len(srcs) >= 4 and all(s.startswith("data:image/png;base64,") for s in srcs)
    assert "<link" not in html and "<script" not in html and "http" not in html
    assert "Question &lt;0&gt;?" in html and "truth &amp; more" in html  # escaped, side by side
    assert "0.50 ± " in html or "0.500" in html
    md = (tmp_path / "report.md").read_text()
    assert "full answer<br>second \\| line" in md and "Question &lt;0&gt;?" in md
    assert "## Headline" in md and "| test: token-accuracy gap (full − module) | 5.00 pts |" in md
    # intervals: in the metrics table and the headline, with the sample size
    assert "| test | module | 8 | 100 | 0.550 [0.500, 0.600] |" in md
    assert "0.300 [0.240, 0.375]" in md and "0.300 [0.240, 0.375]" in html
    assert "(95% CI over 8 pairs, 100 tokens) | 66.7 % [60.0, 72.0] |" in md
    assert "../compare/comparison.md" in md and "nectar compare" in html
    for rel in out.files:
        if rel.endswith(".png"):
            assert (tmp_path / rel).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
            assert f"]({rel})" in md


def test_empty_parts_render_without_figures(tmp_path):
    out = write_report(str(tmp_path), ReportInputs(title="empty"))
    assert out.files == ["report.md", "report.html"]
    assert "no training log" in (tmp_path / "report.html").read_text()
