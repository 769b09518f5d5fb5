"""Every benchmark script imports against the current package (the benchmarks are not run by the
suite, so a renamed module or function would otherwise surface only when someone measures)."""
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.parametrize("script", sorted(p.name for p in BENCH.glob("bench_*.py")) + ["mlp_data_curve.py", "document_panel.py",
                                                                                    "first_state_scaling.py",
                                                                                    "key_channel_scales.py"])
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


def test_key_channel_scales_rounds_each_channel_onto_its_own_grid_and_leaves_other_systems_alone():
    """The simulated lever: keys [c, d] on 2**bits levels per channel spanning that channel's own range
    (an outlier channel no longer widens every row's grid), β and other systems rounded as before."""
    import importlib.util

    import torch

    from nectar.quantization import fake_quantize

    spec = importlib.util.spec_from_file_location("key_channel_scales", BENCH / "key_channel_scales.py")
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(37, 64, generator=g)
    keys[:, 5] *= 40.0  # an outlier channel
    rounded = m.per_channel(keys, 4)
    for ch in range(64):
        levels = rounded[:, ch].unique()
        assert len(levels) <= 16
        span = keys[:, ch].max() - keys[:, ch].min()
        assert (rounded[:, ch] - keys[:, ch]).abs().max() <= span / 15 / 2 * 1.01 + 1e-3
    # per row, the outlier channel sets every row's step: the other channels lose far more
    others = [c for c in range(64) if c != 5]
    row_err = (fake_quantize(keys, 4, 64) - keys)[:, others].pow(2).mean()
    assert (rounded - keys)[:, others].pow(2).mean() < row_err / 10
    assert not m.ACTIVE["on"]  # off unless the simulated system is being fitted
    assert torch.equal(m.keys_round(keys, 4), fake_quantize(keys, 4, 64))
    beta = torch.randn(37, generator=g)
    m.ACTIVE["on"] = True
    try:
        assert torch.equal(m.keys_round(keys, 4), rounded)
        assert torch.equal(m.keys_round(beta, 16), fake_quantize(beta, 16, 64))  # β as before
    finally:
        m.ACTIVE["on"] = False
