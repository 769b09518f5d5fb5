"""batch_plan: pairs in plan order, at most batch_size pairs and batch_tokens tokens per batch;
resume_batches: a resume runs the uninterrupted plan's own batches."""
from hypothesis import given, strategies as st

from nectar.schemas.artifacts import TargetsPairRow
from nectar.stages.targets import PlannedPair, batch_plan, resume_batches


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


def test_a_resume_mid_batch_runs_that_whole_batch_of_the_uninterrupted_plan():
    batches = batch_plan(planned([10, 10, 10, 11, 100, 30]), batch_size=8, batch_tokens=41)  # [0-3] [4] [5]
    assert resume_batches(batches, 0) == batches
    assert resume_batches(batches, 16) == batches  # mid pair 1: the batch from pair 0, not one from pair 1
    assert resume_batches(batches, 41) == batches[1:]  # the first batch is on disk
    assert resume_batches(batches, 100) == batches[1:]
    assert resume_batches(batches, 141) == batches[2:]
    assert resume_batches(batches, 171) == []


@given(st.lists(st.integers(1, 400), min_size=1, max_size=60), st.integers(1, 16), st.integers(1, 1000),
       st.floats(0, 1))
def test_resume_batches_are_a_suffix_of_the_plan_covering_every_unwritten_token(lengths, batch_size, batch_tokens,
                                                                               share):
    batches = batch_plan(planned(lengths), batch_size, batch_tokens)
    written = int(share * sum(lengths))
    rest = resume_batches(batches, written)
    assert rest == batches[len(batches) - len(rest):]  # whole batches, the plan's own
    if rest:
        assert rest[0][0].row.start <= written  # nothing unwritten is skipped
    done = batches[: len(batches) - len(rest)]
    assert all(p.row.start + p.row.length <= written for b in done for p in b)
