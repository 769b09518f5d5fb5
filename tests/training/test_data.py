"""Reading the targets group: splits, pair batches aligned with the teacher's next-token targets,
a data order that is a pure function of (seed, step), and the normalisation statistics."""
import numpy as np
import pytest
import torch

from nectar.tables import ArtifactError
from nectar.targets.reader import TargetsData
from nectar.training.data import (batch_items, limit_query_tokens, shard_for_rank, stream, subset_pairs,
                                  target_statistics)


@pytest.fixture(scope="module")
def data(tiny_targets):
    return TargetsData(tiny_targets[0] + "/targets.zarr")


def test_splits_partition_the_pairs_and_tokens(data):
    train, test = data.pairs("train"), data.pairs("test")
    assert len(train) == 9 and len(test) == 3
    assert set(train).isdisjoint(test) and len(train) + len(test) == data.header.n_pairs
    assert len(data.tokens("train")) + len(data.tokens("test")) == data.header.n_tokens


def test_pair_batch_aligns_next_tokens_masks_and_rows(data):
    pairs = data.pairs("test")[:2]
    b = data.pair_batch(pairs)
    token_ids = data.group["token_ids"][:].astype(np.int64)  # read directly, not through the loader
    response_mask = data.group["response_mask"][:]
    for i, p in enumerate(pairs):
        s, e = data.offsets[p], data.offsets[p + 1]
        k = e - s
        assert b.attention_mask[i].sum() == k
        assert torch.equal(b.input_ids[i, :k], torch.from_numpy(token_ids[s:e]))
        assert torch.equal(b.next_ids[i, : k - 1], torch.from_numpy(token_ids[s + 1:e]))
        # KL/accuracy positions: t predicts t+1, which must be a response token of this pair
        assert torch.equal(b.kl_mask[i, : k - 1], torch.from_numpy(response_mask[s + 1:e]))
        assert not b.kl_mask[i, k - 1:].any()
    assert b.targets.n_tokens == data.pair_tokens(pairs)
    assert data.kl_positions(pairs) == int(b.kl_mask.sum())
    assert torch.equal(b.targets.alpha, data.rows(np.concatenate(
        [np.arange(data.offsets[p], data.offsets[p + 1]) for p in pairs])).alpha)


def test_streamed_rows_equal_direct_zarr_reads(tiny_targets, data):
    small = TargetsData(tiny_targets[0] + "/targets.zarr", cache_bytes=0, window_tokens=16)  # 4 chunks cached
    idx = np.array([17, 3, 3, 40, data.header.n_tokens - 1, 0])
    for reader in (data, small):
        got = reader.rows(idx)
        for name in ("q", "alpha", "A"):
            assert torch.equal(getattr(got, name), torch.from_numpy(data.group[name][:][idx]))
    assert small.cache.capacity == 4 and len(small.cache._chunks) <= 4


def test_data_order_is_a_pure_function_of_seed_and_step_and_covers_each_epoch():
    items = np.arange(100, 137)
    seen = np.concatenate([batch_items(items, s, 8, seed=3) for s in range(10)])  # 80 = 2 epochs + 6
    assert sorted(seen[:37]) == list(items) and sorted(seen[37:74]) == list(items)
    assert np.array_equal(batch_items(items, 7, 8, seed=3), seen[56:64])
    assert not np.array_equal(batch_items(items, 0, 8, seed=4), seen[:8])
    shares = [shard_for_rank(seen[:8], r, 3) for r in range(3)]
    assert sorted(np.concatenate(shares)) == sorted(seen[:8])


def test_statistics_are_per_layer_and_kv_head(data):
    h = data.header
    st = target_statistics(data, h.num_kv_heads)
    assert st["A_mean"].shape == (h.num_layers, h.num_kv_heads, h.head_dim)
    assert st["alpha_std"].shape == (h.num_layers, h.num_kv_heads)
    rows = data.rows(data.tokens("train"))
    g = h.num_q_heads // h.num_kv_heads
    a0 = rows.alpha[:, 1, :g]  # layer 1, the query heads of KV head 0
    assert float(st["alpha_mean"][1, 0]) == pytest.approx(float(a0.double().mean()), rel=1e-5)


def test_incomplete_targets_are_refused(tiny_targets, tmp_path):
    import shutil

    import zarr

    dst = tmp_path / "t.zarr"
    shutil.copytree(tiny_targets[0] + "/targets.zarr", dst)
    g = zarr.open_group(str(dst), mode="r+")
    header = dict(g.attrs["nectar_targets"])
    header["complete"] = False
    g.attrs["nectar_targets"] = header
    with pytest.raises(ArtifactError, match="incomplete"):
        TargetsData(str(dst))
    with pytest.raises(ArtifactError, match="no targets group"):
        TargetsData(str(tmp_path / "missing.zarr"))


def test_token_stream_visits_every_train_token_once_per_epoch_in_a_pure_order(data):
    train = np.sort(data.tokens("train"))
    n, b = len(train), 16
    tokens = stream(data, "train", by_pairs=False, seed=3)  # window_tokens=4096: one window here
    small = stream(TargetsData(data.url, window_tokens=32), "train", by_pairs=False, seed=3)  # 2-chunk windows
    for s in (tokens, small):
        assert s.n_items == n
        seen = np.concatenate([s.batch(step, b) for step in range(-(-2 * n // b))])
        assert np.array_equal(np.sort(seen[:n]), train) and np.array_equal(np.sort(seen[n:2 * n]), train)
        assert not np.array_equal(seen[:n], seen[n:2 * n])  # each epoch reshuffled
    again = stream(TargetsData(data.url, window_tokens=32), "train", by_pairs=False, seed=3)
    assert np.array_equal(again.batch(7, b), small.batch(7, b))  # resume: the order is a function of (seed, step)
    other = stream(TargetsData(data.url, window_tokens=32), "train", by_pairs=False, seed=4)
    assert not np.array_equal(other.batch(0, b), small.batch(0, b))
    # a 2-chunk window: the first 16 items of an epoch come from at most two chunks of the store
    first = small._window_items(0, 0)
    assert len(np.unique(first // data.chunk_tokens)) <= 2


def _synthetic_store(path, n_pairs, pair_tokens=64, chunk=64):
    """A real targets group with random values (failure-free stand-in for a big capture)."""
    from nectar.schemas.artifacts import TargetsHeader
    from nectar.targets.store import create_targets

    T = n_pairs * pair_tokens
    header = TargetsHeader(model="synthetic", model_hash="x", doc_sha256="x", n_context=100, num_layers=4,
                           num_q_heads=4, num_kv_heads=2, head_dim=32, scaling=0.17, top_k=4, dtype="float32",
                           n_pairs=n_pairs, n_tokens=T, split_pairs={"train": n_pairs - 1, "test": 1},
                           complete=True)
    g = create_targets(str(path), header, chunk, 16 * chunk)
    rng = np.random.default_rng(0)
    for start in range(0, T, 16 * chunk):
        stop = min(T, start + 16 * chunk)
        for name in ("q", "A", "alpha"):
            g[name][start:stop] = rng.standard_normal((stop - start, *g[name].shape[1:]), dtype=np.float32)
    g["pair_offsets"][:] = np.arange(n_pairs + 1) * pair_tokens
    g["pair_split"][:] = np.array([0] * (n_pairs - 1) + [1], dtype=np.int8)
    return str(path)


def _epoch_peak_bytes(url, batch=64):
    """Peak Python/numpy allocations while streaming one epoch of token batches (tracemalloc sees
    numpy buffers and the prefetch thread), the store's value bytes, chunk reads, chunks, cache bound."""
    import tracemalloc

    d = TargetsData(url, cache_bytes=0, window_tokens=128)  # 2-chunk windows: the cache holds 6 chunks
    tokens = stream(d, "train", by_pairs=False, seed=0)
    tracemalloc.start()
    for step in range(tokens.n_items // batch):
        d.rows(tokens.batch(step, batch))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    d.close()
    chunk_bytes = d.chunk_tokens * 4 * 4 * (2 * 32 + 1) * 4
    return peak, d.value_bytes(), d.cache.reads, -(-d.header.n_tokens // d.chunk_tokens), d.cache.capacity * chunk_bytes


def test_streaming_memory_does_not_grow_with_the_store(tmp_path):
    small = _epoch_peak_bytes(_synthetic_store(tmp_path / "small.zarr", n_pairs=16))  # 1k tokens, 4 MB
    big = _epoch_peak_bytes(_synthetic_store(tmp_path / "big.zarr", n_pairs=128))  # 8k tokens, 34 MB
    assert big[1] == 8 * small[1]
    assert big[0] < 1.3 * small[0] + (1 << 20), (small, big)  # flat: the cache bound, not the store
    assert big[0] < 2 * big[4] < 0.2 * big[1]
    for peak, value_bytes, reads, n_chunks, _ in (small, big):
        assert reads <= n_chunks + 4  # chunk-aligned: every chunk read about once per epoch


def test_query_token_subsets_are_nested_whole_pairs_within_the_cap(tiny_targets):
    data = TargetsData(tiny_targets[0] + "/targets.zarr")
    lengths = np.diff(data.offsets)
    total = int(lengths[data.pairs("train")].sum())
    kept = [subset_pairs(data, "train", n, seed=0) for n in (1, total // 3, total // 2, total)]
    assert len(kept[0]) == 1  # below one pair's length: still one pair
    for small, large in zip(kept, kept[1:]):
        assert set(small) <= set(large)
    for n, k in zip((total // 3, total // 2), kept[1:3]):
        assert lengths[k].sum() <= n < lengths[k].sum() + lengths[data.pairs("train")].max()
    assert set(kept[-1]) == set(data.pairs("train"))
    assert not np.array_equal(subset_pairs(data, "train", total // 2, seed=1), kept[2]) or len(kept[2]) <= 1


def test_limit_query_tokens_leaves_the_rest_out_of_every_reader_view(tiny_targets):
    data = TargetsData(tiny_targets[0] + "/targets.zarr")
    test_before = data.pairs("test").copy()
    half = int(np.diff(data.offsets)[data.pairs("train")].sum()) // 2
    tokens = limit_query_tokens(data, "train", half, seed=0)
    kept = data.pairs("train")
    assert np.array_equal(kept, subset_pairs(TargetsData(tiny_targets[0] + "/targets.zarr"), "train", half, 0))
    assert tokens == data.pair_tokens(kept) <= half and np.array_equal(data.pairs("test"), test_before)
    s = stream(data, "train", by_pairs=False, seed=0)
    assert s.n_items == tokens  # the token stream visits only the subset
    allowed = set(data.tokens("train").tolist())
    assert set(s.batch(0, tokens).tolist()) == allowed
    assert (TargetsData(tiny_targets[0] + "/targets.zarr").pair_split >= 0).all()  # the store is untouched
