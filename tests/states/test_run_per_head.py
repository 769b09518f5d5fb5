"""The closed-form fits run one head per core (reconstruction.run_per_head): results in task order,
each task's BLAS single-threaded, torch's thread count restored afterwards — also when a task fails."""
from __future__ import annotations

import pytest
import torch

from nectar.states.reconstruction import run_per_head


def test_results_come_back_in_task_order_with_single_threaded_kernels():
    g = torch.Generator().manual_seed(0)
    tasks = [torch.randn(n, n, generator=g, dtype=torch.float64) for n in (5, 80, 20, 160, 40)]
    before = torch.get_num_threads()
    seen = []

    def fit(x):
        seen.append(torch.get_num_threads())
        return torch.linalg.cholesky(x @ x.T + torch.eye(x.shape[0], dtype=x.dtype))

    out = run_per_head(fit, tasks, cost=lambda x: x.shape[0])
    for x, L in zip(tasks, out):
        assert torch.allclose(L @ L.T, x @ x.T + torch.eye(x.shape[0], dtype=x.dtype))
    if before > 1:
        assert set(seen) == {1}
    assert torch.get_num_threads() == before


def test_a_failing_task_restores_the_thread_count():
    before = torch.get_num_threads()

    def fit(x):
        if x == 2:
            raise ValueError("head 2 failed")
        return x

    with pytest.raises(ValueError, match="head 2"):
        run_per_head(fit, [1, 2, 3], cost=lambda x: x)
    assert torch.get_num_threads() == before
