"""Targets that fit: the size estimate equals what the stage writes, the stage refuses a run over
targets.max_bytes with the three ways out, half-precision storage keeps the values to its precision
(bf16 as a uint16 view), and online groups store no q/α/A."""
import fsspec
import numpy as np
import pytest
import torch

from nectar.attention.doc_kv import prefill_document
from nectar.layout import build_layout
from nectar.schemas import DatasetRow, TargetsConfig
from nectar.stages import targets as targets_stage
from nectar.targets.size import TargetsTooLarge
from nectar.targets.store import VALUE_ARRAYS, decode_values, open_targets

QA = [("Who bought the island?", "Ilse Brandt."), ("What ran aground?", "The schooner Meridian."),
      ("What cargo?", "Salt cod and lamp oil."), ("How many sailors?", "Seven."),
      ("When?", "In the winter of 1871."), ("Where?", "On the northern reef."),
      ("Who kept the ledger?", "The lighthouse keeper of Varn Island."), ("How often?", "Twice.")]


def _rows():
    return [DatasetRow(pair_id=f"p{i}", chunk_id=0, task="qa", instruction=a, response=b, full_answer=b,
                       judge_raw="{}", is_consistent=True, confidence=0.9, reasoning="", verdict="consistent",
                       kept=True, split="test" if i % 4 == 3 else "train") for i, (a, b) in enumerate(QA)]


@pytest.fixture(scope="module")
def setup(tiny_llama):
    from sample_document import DOC

    layout = build_layout(tiny_llama.tokenizer, DOC)
    return tiny_llama, layout, prefill_document(tiny_llama, layout.context_ids)


def _build(setup, tmp_path, **cfg):
    base, layout, kv = setup
    cfg = TargetsConfig(top_k=4, chunk_tokens=16, shard_tokens=64, batch_size=4, **cfg)
    planned = targets_stage.plan_pairs(_rows(), layout, cfg)
    size = targets_stage.targets_size(planned, base, cfg)
    targets_stage.build_targets(base, layout, kv, _rows(), cfg, str(tmp_path), "sha", planned=planned)
    fs, path = fsspec.core.url_to_fs(str(tmp_path / "targets.zarr"))
    return size, int(fs.du(path))


@pytest.mark.parametrize("dtype,mode", [("float32", "cached"), ("float16", "cached"), ("bfloat16", "cached"),
                                        ("float32", "online")])
def test_estimate_matches_the_bytes_written(setup, tmp_path, dtype, mode):
    size, written = _build(setup, tmp_path, dtype=dtype, mode=mode)
    # Float arrays are stored raw, so they match to the byte, zarr's metadata and shard indexes to
    # within a few hundred bytes; only the zstd-compressed integer arrays come out smaller.
    assert size.total - size.compressible_bytes() <= written <= size.total, (written, size.total)
    if mode == "cached":  # the compressed part is small: the estimate is the written size within 3 %
        assert written >= 0.97 * size.total
    if mode == "cached":
        assert size.value_bytes_per_token() == 2 * 4 * (2 * 16 * {"float32": 4}.get(dtype, 2) + 4)


def test_half_precision_halves_the_values_and_online_drops_them(setup, tmp_path):
    fp32, w32 = _build(setup, tmp_path / "fp32")
    bf16, w16 = _build(setup, tmp_path / "bf16", dtype="bfloat16")
    online, w0 = _build(setup, tmp_path / "online", mode="online")
    assert 0.5 < w16 / w32 < 0.6  # q and A halve; α (float32), the teacher's top-K and metadata don't
    assert w0 < 0.1 * w32
    g, header = open_targets(str(tmp_path / "online" / "targets.zarr"))
    assert header.mode == "online" and not any(name in g for name in VALUE_ARRAYS)
    assert header.complete and g["topk_logprobs"].shape[0] == header.n_tokens


def test_half_precision_values_are_the_float32_targets_rounded(setup, tmp_path):
    _build(setup, tmp_path / "fp32")
    ref, _ = open_targets(str(tmp_path / "fp32" / "targets.zarr"))
    for dtype in ("float16", "bfloat16"):
        _build(setup, tmp_path / dtype, dtype=dtype)
        g, header = open_targets(str(tmp_path / dtype / "targets.zarr"))
        assert header.dtype == dtype
        for name in ("q", "A"):
            want = torch.from_numpy(ref[name][:]).to(getattr(torch, dtype)).float().numpy()
            if dtype == "bfloat16":
                assert g[name].dtype == np.uint16 and g[name].attrs["nectar_view"] == "bfloat16"
            got = decode_values(g[name][:], g[name].attrs.get("nectar_view"))
            assert got.dtype == np.float32 and np.array_equal(got, want), name
        assert g["alpha"].dtype == np.float32 and np.array_equal(g["alpha"][:], ref["alpha"][:])


def test_targets_over_max_bytes_are_refused_with_the_three_ways_out(setup, tmp_path):
    base, layout, kv = setup
    cfg = TargetsConfig(top_k=4, chunk_tokens=16, shard_tokens=64, max_bytes=100_000)
    planned = targets_stage.plan_pairs(_rows(), layout, cfg)
    assert targets_stage.targets_size(planned, base, cfg).total > 100_000
    with pytest.raises(TargetsTooLarge) as err:
        targets_stage.build_targets(base, layout, kv, _rows(), cfg, str(tmp_path), "sha", planned=planned)
    msg = str(err.value)
    assert "over targets.max_bytes = 100.00 kB" in msg and "\n" not in msg
    assert "targets.max_pairs=" in msg and "targets.dtype=bfloat16" in msg and "targets.mode=online" in msg
    assert not (tmp_path / "targets.zarr").exists()  # refused before anything was written
    fit = int(msg.split("targets.max_pairs=")[1].split()[0])
    smaller = cfg.model_copy(update={"max_pairs": fit})
    assert targets_stage.targets_size(targets_stage.plan_pairs(_rows(), layout, smaller), base, smaller).total <= 100_000
    online = cfg.model_copy(update={"mode": "online"})
    targets_stage.build_targets(base, layout, kv, _rows(), online, str(tmp_path), "sha")  # fits


def test_max_pairs_keeps_a_stable_subset_of_every_split(setup):
    _, layout, _ = setup
    six = targets_stage.plan_pairs(_rows(), layout, TargetsConfig(max_pairs=6))
    seven = targets_stage.plan_pairs(_rows(), layout, TargetsConfig(max_pairs=7))
    assert len(six) == 6 and {p.row.pair_id for p in six} < {p.row.pair_id for p in seven}
    assert [p.row.start for p in six] == list(np.cumsum([0] + [p.row.length for p in six[:-1]]))
