"""Every benchmark script imports against the current package (the benchmarks are not run by the
suite, so a renamed module or function would otherwise surface only when someone measures)."""
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.parametrize("script", sorted(p.name for p in BENCH.glob("bench_*.py")) + ["mlp_data_curve.py", "document_panel.py"])
def test_benchmark_script_imports(script):
    code = ("import importlib.util, sys; sys.argv = ['x']; sys.path.insert(0, %r); "
            "spec = importlib.util.spec_from_file_location('bench', %r); m = importlib.util.module_from_spec(spec); "
            # registered as an import would (dataclasses resolve annotations through sys.modules)
            "sys.modules['bench'] = m; spec.loader.exec_module(m); [getattr(m, n) for n in dir(m)]") % (str(BENCH), str(BENCH / script))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
