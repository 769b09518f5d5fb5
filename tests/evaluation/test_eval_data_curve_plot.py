"""The data-curve plot (benchmarks/mlp_data_curve.py): a PNG with one panel per split present."""
from nectar.evaluation.plots import data_curve


def _point(system, split, tokens, value):
    return {"system": system, "split": split, "train_query_tokens": tokens, "recovered_kl": value,
            "ci": [value - 0.05, value + 0.02], "n_pairs": 24}


def test_data_curve_draws_a_png_and_nothing_without_points():
    points = [_point(s, split, n, v) for s in ("regression", "matching") for split in ("test", "probes")
              for n, v in ((1000, -0.1), (10000, 0.3))]
    png = data_curve(points, {"test": {"recovered_kl": 0.99, "ci": [0.98, 0.99]}})
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert data_curve([]) is None
