"""Every benchmark script imports against the current package (the benchmarks are not run by the
suite, so a renamed module or function would otherwise surface only when someone measures)."""
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.parametrize("script", sorted(p.name for p in BENCH.glob("bench_*.py")) + ["mlp_data_curve.py", "document_panel.py",
                                                                                    "first_state_scaling.py"])
def test_benchmark_script_imports(script):
    code = ("import importlib.util, sys; sys.argv = ['x']; sys.path.insert(0, %r); "
            "spec = importlib.util.spec_from_file_location('bench', %r); m = importlib.util.module_from_spec(spec); "
            # registered as an import would (dataclasses resolve annotations through sys.modules)
            "sys.modules['bench'] = m; spec.loader.exec_module(m); [getattr(m, n) for n in dir(m)]") % (str(BENCH), str(BENCH / script))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_first_state_scaling_counts_overlapping_nnls_calls_once_as_wall_seconds():
    """The fit runs one head per core, so the NNLS calls overlap: nnls_wall_s is the union of their
    intervals, not the sum (that is nnls_thread_s)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("first_state_scaling", BENCH / "first_state_scaling.py")
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    two_cores = [(0.0, 2.0), (1.0, 3.0), (2.5, 2.8), (5.0, 6.0)]  # sum 5.3 thread-seconds
    assert m.covered_seconds(two_cores) == pytest.approx(4.0)
    assert m.covered_seconds([(1.0, 2.0)]) == 1.0 and m.covered_seconds([]) == 0.0
