"""batch_plan: pairs in plan order, at most batch_size per batch, padding within max_padding."""
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


def test_a_long_pair_starts_its_own_batch():
    batches = batch_plan(planned([10, 10, 10, 11, 100]), batch_size=8, max_padding=0.1)
    assert [[p.row.length for p in b] for b in batches] == [[10, 10, 10, 11], [100]]


def test_batch_size_caps_equal_lengths():
    assert [len(b) for b in batch_plan(planned([5] * 10), batch_size=4, max_padding=0.1)] == [4, 4, 2]


@given(st.lists(st.integers(1, 400), min_size=1, max_size=60), st.integers(1, 16), st.floats(0, 1))
def test_plan_order_size_and_padding_bounds(lengths, batch_size, max_padding):
    lengths = sorted(lengths)  # the stage sorts by length within a split
    batches = batch_plan(planned(lengths), batch_size, max_padding)
    assert [p.row.index for b in batches for p in b] == list(range(len(lengths)))
    for b in batches:
        assert 1 <= len(b) <= batch_size
        real = sum(p.row.length for p in b)
        if len(b) > 1:  # a single pair never pads
            assert max(p.row.length for p in b) * len(b) <= (1 + max_padding) * real + 1e-9
