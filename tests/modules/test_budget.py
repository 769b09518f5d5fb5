"""Budgets: per-layer ρ keeps its mean, widths are the largest that fit, errors name the limit."""
import pytest

from nectar.modules.budget import (BudgetError, head_budget, layer_groups, layer_rhos, mlp_layer_shapes,
                                   quadrature_pairs, skip_mlp_params, solve_width)
from nectar.modules.builder import plan_module


def test_layer_groups_are_contiguous_and_cover_every_layer():
    assert layer_groups(30, 4) == [0] * 8 + [1] * 8 + [2] * 7 + [3] * 7
    assert layer_groups(2, 4) == [0, 1]


@pytest.mark.parametrize("num_layers", [2, 7, 28, 30])
def test_layer_rhos_keep_the_mean_and_follow_the_multipliers(num_layers):
    rhos = layer_rhos(num_layers, 0.02, (1, 2, 5, 2))
    assert sum(rhos) / num_layers == pytest.approx(0.02)
    if num_layers >= 4:
        groups = layer_groups(num_layers, 4)
        first, third = rhos[groups.index(0)], rhos[groups.index(2)]
        assert third / first == pytest.approx(5.0)


def test_head_budget_is_rho_times_head_kv_entries():
    assert head_budget(0.05, 1000, 64) == int(0.05 * 2 * 1000 * 64)


@pytest.mark.parametrize("budget,depth,out", [(400, 4, 1), (8640, 4, 64), (5000, 1, 64), (20000, 3, None)])
def test_solved_width_is_the_largest_that_fits(budget, depth, out):
    w = solve_width(budget, 64, 64, depth, out, False, "t")
    assert skip_mlp_params(64, 64, w, depth, out, False) <= budget
    assert skip_mlp_params(64, 64, w + 1, depth, out, False) > budget


def test_skip_mlp_param_count_by_hand():
    # depth 2, in=d=4, w=3, out=1: U0 4·3+3, (V1 4·3 + U1 3·3 + b 3), Wout 3·1+1
    assert skip_mlp_params(4, 4, 3, 2, 1, False) == 15 + 24 + 4
    assert skip_mlp_params(4, 4, 3, 2, 1, True) == 15 + 24 + 4 + 2 * 2 * 3


def test_score_target_split_follows_score_fraction():
    s = mlp_layer_shapes(50_000, 64, (0, 2, 2), 0.1, False, 0)
    assert s.score.n_params() <= 5000 < s.target.n_params() <= 45_000
    assert s.n_params() <= 50_000


def test_budget_too_small_names_the_budget_and_minimum():
    with pytest.raises(BudgetError, match=r"at least \d+ parameters .* budget is 100"):
        solve_width(100, 64, 64, 4, 64, False, "layer 0 target head")
    with pytest.raises(BudgetError, match="at least 128 parameters"):
        quadrature_pairs(100, 64, 1000, 0)
    with pytest.raises(BudgetError, match="more than the document's n=10"):
        quadrature_pairs(64 * 2 * 11, 64, 10, 0)


def test_plan_reports_exact_per_head_counts_below_budget():
    plan = plan_module("mlp", 30, 3, 64, 1500, 0.125, 0.05)
    for i in range(30):
        assert 0 < plan.head_params(i) <= plan.budgets[i]
    quad = plan_module("quadrature", 30, 3, 64, 1500, 0.125, 0.05)
    assert [quad.head_params(i) for i in range(30)] == [2 * p * 64 for p in quad.quad_pairs]
    assert quad.quad_pairs[0] == int(layer_rhos(30, 0.05, (1, 2, 5, 2))[0] * 1500)
