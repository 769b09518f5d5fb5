"""The training loop on real targets of a tiny model: it learns, resumes bit-for-bit, masks
non-finite steps, stops a diverging run with its last good checkpoint, and runs every regime."""
import shutil

import numpy as np
import pytest
import torch
import zarr

from nectar.schemas.config import ModuleConfig, TrainConfig
from nectar.stages.train import train
from nectar.tables import read_table
from nectar.schemas.artifacts import TrainLogRow
from nectar.training.checkpoint import CHECKPOINT
from nectar.targets.reader import TargetsData
from nectar.training.data import stream as data_stream
from nectar.training.loop import TrainingDiverged

MODULE = ModuleConfig(rho=0.25, depths=(0, 2, 2))


def _cfg(**kw):
    args = dict(samples=240, batch_size=16, eval_every=5, checkpoint_every=5, peak_lr=3e-3, module=MODULE)
    args.update(kw)
    return TrainConfig(**args)


def _log(out):
    return read_table(str(out / "train_log.parquet"), TrainLogRow)


def _params(out):
    from safetensors.torch import load_file

    return load_file(str(out / "module.safetensors"))


@pytest.mark.slow
def test_regression_lowers_heldout_target_error(tiny_llama, tiny_targets, tmp_path):
    targets, _, kv, _ = tiny_targets
    counts = train(targets, _cfg(), tiny_llama, kv, str(tmp_path))
    rows = _log(tmp_path)
    held = [r for r in rows if r.split == "heldout"]
    assert held[0].step == 0 and held[-1].step == counts["steps"] == 15
    assert held[-1].loss_A < 0.8 * held[0].loss_A
    assert held[-1].rte_A < held[0].rte_A
    assert [r.step for r in rows if r.split == "train"] == [5, 10, 15]
    assert counts["skipped_nonfinite"] == 0 and counts["samples"] == 240
    assert (tmp_path / "module.json").exists() and (tmp_path / "checkpoints" / CHECKPOINT).exists()


@pytest.mark.parametrize("regime", [
    dict(lambda_alpha=0.1, lambda_A=1.0, lambda_kl=2.0),  # mixed
    dict(lambda_alpha=0.0, lambda_A=0.0, lambda_kl=1.0, module=ModuleConfig(arch="quadrature", rho=0.25)),  # cartridges
])
def test_distillation_regimes_train_on_pairs_through_the_base_model(regime, tiny_llama, tiny_targets, tmp_path):
    targets, _, kv, _ = tiny_targets
    counts = train(targets, _cfg(samples=12, batch_size=4, eval_every=3, checkpoint_every=3, **regime),
                   tiny_llama, kv, str(tmp_path))
    assert counts["steps"] == 3 and counts["train_items"] == 9  # pairs, not tokens
    train_rows = [r for r in _log(tmp_path) if r.split == "train"]
    assert train_rows[-1].token_acc is not None and np.isfinite(train_rows[-1].loss_kl)
    assert train_rows[-1].grad_norm > 0


@pytest.mark.slow
def test_resume_after_a_stop_reaches_the_same_params_and_log(tiny_llama, tiny_targets, tmp_path):
    targets, _, kv, _ = tiny_targets
    cfg = _cfg(samples=192, eval_every=4, checkpoint_every=4)
    train(targets, cfg, tiny_llama, kv, str(tmp_path / "straight"))
    stopped = train(targets, cfg, tiny_llama, kv, str(tmp_path / "resumed"), stop_after=7)
    assert stopped["stopped_early"] and not (tmp_path / "resumed" / "module.safetensors").exists()
    counts = train(targets, cfg, tiny_llama, kv, str(tmp_path / "resumed"))
    assert counts["resumed_from_step"] == 4  # the last checkpoint before the stop at step 7
    a, b = _params(tmp_path / "straight"), _params(tmp_path / "resumed")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert _log(tmp_path / "straight") == _log(tmp_path / "resumed")


def test_checkpoint_of_another_config_is_not_resumed(tiny_llama, tiny_targets, tmp_path):
    targets, _, kv, _ = tiny_targets
    train(targets, _cfg(samples=64), tiny_llama, kv, str(tmp_path), stop_after=4)
    counts = train(targets, _cfg(samples=64, peak_lr=1e-3), tiny_llama, kv, str(tmp_path))
    assert counts["resumed_from_step"] == 0


def _poison(tiny_targets, tmp_path, steps, cfg):
    """Failure injection: a copy of the targets whose tokens used at ``steps`` hold NaN scores."""
    dst = tmp_path / "poisoned" / "targets.zarr"
    shutil.copytree(tiny_targets[0] + "/targets.zarr", dst)
    stream = data_stream(TargetsData(str(dst), window_tokens=cfg.shuffle_window_tokens), "train", False, cfg.seed)
    bad = np.unique(np.concatenate([stream.batch(s, cfg.batch_size) for s in steps]))
    g = zarr.open_group(str(dst), mode="r+")
    alpha = g["alpha"][:]
    alpha[bad] = np.nan
    g["alpha"][:] = alpha
    return str(dst)


def test_nan_batch_is_skipped_and_counted_with_fake_poisoned_targets(tiny_llama, tiny_targets, tmp_path):
    cfg = _cfg(samples=160)  # 10 steps of 16 tokens: one epoch of the 215 train tokens, no repeats
    poisoned = _poison(tiny_targets, tmp_path, [3], cfg)
    counts = train(poisoned, cfg, tiny_llama, tiny_targets[2], str(tmp_path / "out"))
    assert counts["skipped_nonfinite"] == 1 and counts["steps"] == 10
    assert all(torch.isfinite(t).all() for t in _params(tmp_path / "out").values())
    assert np.isfinite(counts["heldout_loss_A"])  # NaN did not reach the parameters


def test_diverging_run_stops_with_a_clear_error_and_keeps_its_last_good_checkpoint(
        tiny_llama, tiny_targets, tmp_path):
    cfg = _cfg(samples=192, checkpoint_every=2, max_bad_steps=3)
    poisoned = _poison(tiny_targets, tmp_path, range(5, 12), cfg)
    with pytest.raises(TrainingDiverged, match="3 consecutive steps"):
        train(poisoned, cfg, tiny_llama, tiny_targets[2], str(tmp_path / "out"))
    ckpt = torch.load(tmp_path / "out" / "checkpoints" / CHECKPOINT, weights_only=False)
    assert ckpt["state"]["step"] == 6 and ckpt["state"]["skipped"] == 1
    assert all(torch.isfinite(t).all() for t in ckpt["module"].values())
    assert not (tmp_path / "out" / "module.safetensors").exists()


def test_regression_scale_changes_the_loss_units_not_where_training_goes(tiny_llama, tiny_targets, tmp_path):
    """"mean" divides LA by L·Hq·d: a constant, so the optimum is the same point and Adam (invariant to
    a constant loss scale up to its eps; clipping off) takes the same path; only the logged units change."""
    from nectar.targets.store import targets_zarr_url

    targets, _, kv, _ = tiny_targets
    held = {}
    for scale in ("sum", "mean"):
        cfg = _cfg(lambda_alpha=0.0, lambda_A=1.0, grad_clip=1e9, regression_scale=scale)
        train(targets, cfg, tiny_llama, kv, str(tmp_path / scale))
        held[scale] = [r.loss_A for r in _log(tmp_path / scale) if r.split == "heldout"]
    h = TargetsData(targets_zarr_url(targets)).header
    elems = h.num_layers * h.num_q_heads * h.head_dim
    assert held["sum"][0] == pytest.approx(held["mean"][0] * elems, rel=1e-5)  # same untrained module
    # the same trajectory: every held-out point agrees in the same units (Adam's eps: well under 1 %)
    assert [x / elems for x in held["sum"]] == pytest.approx(held["mean"], rel=1e-2)
    assert held["mean"][-1] < 0.9 * held["mean"][0]  # and it did train
    # per element, an untrained module (it predicts the targets' mean) sits near 1, KL's scale
    assert 0.2 < held["mean"][0] < 5
