"""Keys chosen together for the fit (nectar/states/greedy_keys.py): as many as the allocation gave, the
anchors first, no two carrying the same attention pattern while a distinct one is left out."""
import pytest
import torch

from nectar.schemas.config import SelectionConfig
from nectar.states.greedy_keys import GREEDY_SHARE, choose_keys, chooses_greedy


def _duplicated(seed: int = 0, N: int = 400, d: int = 8):
    """Five distinct attention patterns over N queries; the strongest one carried by six near-copies."""
    g = torch.Generator().manual_seed(seed)
    base = torch.rand(N, 5, generator=g)
    P = torch.cat([base[:, [0]].repeat(1, 6) + 1e-3 * torch.rand(N, 6, generator=g), 0.5 * base[:, 1:]], 1)  # [N, 10]
    return P, base @ torch.randn(5, d, generator=g)  # A [N, d]


def test_it_keeps_one_copy_of_a_repeated_pattern_and_every_distinct_one():
    P, A = _duplicated()
    chosen = choose_keys(P, A, 5, torch.zeros(10, dtype=torch.bool))
    assert len(set(chosen.tolist())) == 5
    assert sum(j < 6 for j in chosen.tolist()) == 1 and set(range(6, 10)) <= set(chosen.tolist())
    # the five with the most attention on their own are all copies of the one pattern
    assert set(torch.topk(P.sum(0), 5).indices.tolist()) <= set(range(6))


def test_the_forced_columns_come_first_and_the_count_is_kept():
    P, A = _duplicated(1)
    forced = torch.zeros(10, dtype=torch.bool)
    forced[[2, 3]] = True  # two copies forced in (sinks): the rest still covers the distinct patterns
    chosen = choose_keys(P, A, 6, forced).tolist()
    assert chosen[:2] == [2, 3] and len(set(chosen)) == 6 and set(range(6, 10)) <= set(chosen)


def test_more_keys_than_distinct_patterns_still_gives_that_many_different_keys():
    P, A = _duplicated(2)
    chosen = choose_keys(P, A, 9, torch.zeros(10, dtype=torch.bool)).tolist()
    assert len(chosen) == len(set(chosen)) == 9


def test_greedy_choice_needs_the_fit():
    for choice in ("greedy", "auto"):
        with pytest.raises(ValueError, match=f"select.key_choice={choice}"):
            SelectionConfig(fit=False, key_choice=choice)


def test_a_head_over_the_cap_keeps_its_top_keys_and_one_under_it_is_rechosen(monkeypatch):
    from types import SimpleNamespace

    import nectar.states.greedy_keys as greedy

    monkeypatch.setattr(greedy, "MAX_GREEDY_KEYS", 20)
    g = torch.Generator().manual_seed(3)
    n, d, T = 400, 8, 64
    keys = [torch.randn(2, n, d, generator=g)]  # one layer, two KV heads [Hkv, n, d]
    queries = SimpleNamespace(q=torch.randn(T, 1, 2, d, generator=g), alpha=torch.zeros(T, 1, 2),
                              A=torch.randn(T, 1, 2, d, generator=g))  # one query head per KV head
    scores = torch.rand(1, 2, n, generator=g)
    kept = [[torch.topk(scores[0, 0], 20).indices.sort().values, torch.topk(scores[0, 1], 21).indices.sort().values]]
    out = greedy.greedy_kept(kept, scores, queries, SimpleNamespace(keys=keys), 0.35, torch.zeros(n, dtype=torch.bool))
    assert torch.equal(out[0][1], kept[0][1])  # over the cap: its own keys
    assert out[0][0].numel() == 20 and not torch.equal(out[0][0], kept[0][0])


def test_auto_key_choice_counts_the_share_of_every_layer_and_head():
    n = 1000
    at = int(GREEDY_SHARE * n * 4)  # four (layer, head) lists: exactly the share
    kept = [[torch.arange(at // 4)] * 2] * 2
    assert chooses_greedy("auto", kept, n) and chooses_greedy("greedy", kept, n) and not chooses_greedy("top", kept, n)
    more = [[torch.arange(at // 4 + 1)] * 2] * 2
    assert not chooses_greedy("auto", more, n) and chooses_greedy("greedy", more, n)
