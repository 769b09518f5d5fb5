"""The target-caching benchmark script runs end to end (tiny model, no speed claim): every kind of
run, alternating rounds, and a verdict the exit code follows."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_targets.py"


def _run(tmp_path, min_ratio):
    out = tmp_path / f"bench-{min_ratio}.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--model", "tiny:llama", "--pairs", "3", "--rounds", "2",
                           "--min-ratio", str(min_ratio), "--json", str(out)], capture_output=True, text=True)
    return proc, out


@pytest.mark.slow
def test_bench_targets_runs_rounds_and_reports_a_median(tmp_path):
    proc, out = _run(tmp_path, 0)
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads(out.read_text())["results"]
    kinds = [(r["method"], r.get("round")) for r in results]
    assert kinds == [("stage", None), ("compute", 0), ("naive", 0), ("compute", 1), ("naive", 1)]
    stage = results[0]
    assert stage["bytes_written"] > 0 and stage["query_tokens"] == results[1]["query_tokens"] > 0
    assert "median of 2 rounds" in proc.stdout and "OK" in proc.stdout


@pytest.mark.slow
def test_bench_targets_exits_1_below_the_target(tmp_path):
    proc, _ = _run(tmp_path, 1e6)  # no run reaches a million-fold speed-up
    assert proc.returncode == 1 and "BELOW TARGET" in proc.stdout
