"""Reading the targets group: splits, pair batches aligned with the teacher's next-token targets,
a data order that is a pure function of (seed, step), and the normalisation statistics."""
import numpy as np
import pytest
import torch

from nectar.tables import ArtifactError
from nectar.training.data import TargetsData, batch_items, shard_for_rank, target_statistics


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
    for i, p in enumerate(pairs):
        s, e = data.offsets[p], data.offsets[p + 1]
        k = e - s
        assert b.attention_mask[i].sum() == k
        assert torch.equal(b.input_ids[i, :k], torch.from_numpy(data.token_ids[s:e]))
        assert torch.equal(b.next_ids[i, : k - 1], torch.from_numpy(data.token_ids[s + 1:e]))
        # KL/accuracy positions: t predicts t+1, which must be a response token of this pair
        assert torch.equal(b.kl_mask[i, : k - 1], torch.from_numpy(data.response_mask[s + 1:e]))
        assert not b.kl_mask[i, k - 1:].any()
    assert b.targets.n_tokens == data.pair_tokens(pairs)
    assert data.kl_positions(pairs) == int(b.kl_mask.sum())
    assert torch.equal(b.targets.alpha, data.rows(np.concatenate(
        [np.arange(data.offsets[p], data.offsets[p + 1]) for p in pairs])).alpha)


def test_rows_from_zarr_equal_rows_from_memory(tiny_targets, data):
    lazy = TargetsData(tiny_targets[0] + "/targets.zarr", in_memory_bytes=0)
    idx = np.array([17, 3, 3, 40])
    a, b = data.rows(idx), lazy.rows(idx)
    assert torch.equal(a.q, b.q) and torch.equal(a.A, b.A) and torch.equal(a.alpha, b.alpha)


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
