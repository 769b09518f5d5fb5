"""batch_plan: pairs in plan order, at most batch_size pairs and batch_tokens tokens per batch."""
from hypothesis import given, strategies as st

from nectar.schemas.artifacts import TargetsPairRow
from nectar.stages.targets import PlannedPair, batch_plan


def planned(lengths: list[int]) -> list[PlannedPair]:
    out, start = [], 0
    for i, n in enumerate(lengths):
        out.append(PlannedPair(TargetsPairRow(index=i, pair_id=f"p{i}", task="qa", split="train", challenge=False,
                                              start=start, length=n, response_start=0, truncated=False), [1] * n))
        start += n
    return out


def test_token_cap_closes_a_batch_and_a_longer_pair_runs_alone():
    batches = batch_plan(planned([10, 10, 10, 11, 100, 30]), batch_size=8, batch_tokens=41)
    assert [[p.row.length for p in b] for b in batches] == [[10, 10, 10, 11], [100], [30]]


def test_batch_size_caps_equal_lengths():
    assert [len(b) for b in batch_plan(planned([5] * 10), batch_size=4, batch_tokens=2048)] == [4, 4, 2]


@given(st.lists(st.integers(1, 400), min_size=1, max_size=60), st.integers(1, 16), st.integers(1, 1000))
def test_plan_order_size_and_token_bounds(lengths, batch_size, batch_tokens):
    batches = batch_plan(planned(lengths), batch_size, batch_tokens)
    assert [p.row.index for b in batches for p in b] == list(range(len(lengths)))
    for i, b in enumerate(batches):
        assert 1 <= len(b) <= batch_size
        tokens = sum(p.row.length for p in b)
        assert tokens <= batch_tokens or len(b) == 1  # only a single over-long pair exceeds the cap
        if i + 1 < len(batches) and len(b) < batch_size:  # a batch closes only when the next pair won't fit
            assert tokens + batches[i + 1][0].row.length > batch_tokens
