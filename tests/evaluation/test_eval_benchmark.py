"""Generation benchmark: rows, sizes and ratios on the tiny model (no timing assertions: speed
claims live in benchmarks/bench_generation.py)."""
import pytest

from nectar.evaluation.benchmark import (BenchmarkError, context_of_length, ratios, run_benchmark,
                                         same_architecture)
from nectar.evaluation.memory import track_peak_memory
from nectar.layout import build_layout
from nectar.modules import plan_module

DOC = "Chapter one. The schooner Meridian ran aground on the northern reef. " * 12


def test_context_of_length_repeats_and_truncates():
    assert context_of_length([1, 2, 3], 7) == [1, 2, 3, 1, 2, 3, 1]
    assert context_of_length([1, 2, 3], 2) == [1, 2]
    with pytest.raises(BenchmarkError, match="no tokens"):
        context_of_length([], 4)


@pytest.mark.parametrize("arch", ["mlp", "quadrature"])
def test_benchmark_rows_for_every_system_and_length(tiny_llama, arch):
    base = tiny_llama
    layout = build_layout(base.tokenizer, DOC)
    plan = plan_module(arch, base.num_layers, base.num_kv_heads, base.head_dim, layout.n, base.scaling,
                       rho=0.5, depths=(0, 1, 1))
    prompt = layout.prompt("Summarize.").ids
    res = run_benchmark(base, layout.context_ids, prompt, [96, 192], same_architecture(base, plan), new_tokens=3)
    assert res.skipped == []
    assert [(r.n_context, r.system) for r in res.rows] == [
        (n, s) for n in (96, 192) for s in ("module", "full_cold", "full_cached")]
    kv_bytes = lambda n: 2 * base.num_layers * base.num_kv_heads * n * base.head_dim * 4  # noqa: E731
    for r in res.rows:
        assert r.ttft_s > 0 and r.decode_tok_s > 0 and r.peak_memory_bytes > 0
        assert r.new_tokens == 3 and r.prompt_tokens == len(prompt)
        if r.system == "module":
            assert "random-init" in r.note and r.state_bytes < kv_bytes(r.n_context)
        else:
            assert r.state_bytes == kv_bytes(r.n_context)
    rat = ratios(res.rows)
    assert [e["n_context"] for e in rat] == [96, 192]
    mod = next(r for r in res.rows if r.system == "module" and r.n_context == 192)
    cold = next(r for r in res.rows if r.system == "full_cold" and r.n_context == 192)
    assert rat[1]["ttft_speedup_vs_cold"] == pytest.approx(cold.ttft_s / mod.ttft_s)


def test_lengths_too_small_for_the_budget_are_skipped_with_the_reason(tiny_llama):
    base = tiny_llama
    plan = plan_module("mlp", base.num_layers, base.num_kv_heads, base.head_dim, 1000, base.scaling, rho=0.05)
    res = run_benchmark(base, list(range(100, 200)), [5, 6, 7], [32], same_architecture(base, plan), new_tokens=2)
    assert res.rows == [] and "n=32" in res.skipped[0] and "budget" in res.skipped[0]


def test_window_is_enforced(tiny_llama):
    plan = plan_module("quadrature", 2, 2, 16, 1000, 0.25, rho=0.1)
    with pytest.raises(BenchmarkError, match="window"):
        run_benchmark(tiny_llama, [1, 2, 3], [4, 5], [tiny_llama.max_context_tokens], same_architecture(tiny_llama, plan), 4)


def test_peak_memory_sees_a_large_allocation():
    import torch

    with track_peak_memory("cpu") as small:
        torch.ones(10)
    with track_peak_memory("cpu") as big:
        x = torch.ones(64 * 2**20 // 4)  # 64 MiB
        x += 1
    assert big.peak_bytes - small.peak_bytes > 32 * 2**20
    assert small.method
