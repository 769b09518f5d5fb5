"""SIGKILL inside each stage (slow rows of the matrix): a real process running the tiny pipeline is
killed at a fixed point of a stage's work (kill_injector.py: FAILURE INJECTION); what it leaves is
checked, then the same run is started again and must finish — with the same artifacts as the
uninterrupted run (targets, train, evaluate: equal to float tolerance; synthesize and verify: the
resume contract)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from matrix_helpers import outputs, run_pipeline
from safetensors.numpy import load_file

from nectar.orchestration.executor import RunDir, stage_status
from nectar.schemas.artifacts import DatasetRow, MetricsRow, PairRow
from nectar.schemas.config import STAGES
from nectar.stages.verify import AnswerRow
from nectar.tables import read_table
from float_tolerance import close_reordered

pytestmark = pytest.mark.slow
HERE = Path(__file__).resolve().parent


def kill_inside(run_dir: str, stage: str) -> None:
    for later in STAGES[STAGES.index(stage):]:  # the stage and what follows run again
        shutil.rmtree(Path(run_dir) / later, ignore_errors=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parents[1]), str(HERE)]), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(HERE / "kill_injector.py"), run_dir, stage], capture_output=True,
                          text=True, env=env, timeout=600)
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, proc.stdout[-2000:], proc.stderr[-3000:])


def resume(run_dir: str) -> None:
    out = run_pipeline(run_dir)
    assert out.error is None, out.user_line
    assert out.notices and out.notices[0].startswith(f"taking over the lock on {run_dir} from pid")
    assert "that process is gone" in out.notices[0]
    assert all(stage_status(RunDir(run_dir), s)["state"] in ("done", "cached") for s in STAGES)


def left_behind(run_dir: str, stage: str) -> None:
    run = RunDir(run_dir)
    assert run.read_manifest(stage) is None  # nothing looks complete
    assert all(run.read_manifest(s) is not None for s in STAGES[: STAGES.index(stage)])  # upstream kept
    assert json.loads((Path(run_dir) / "run.lock").read_text())["pid"] > 0  # the dead holder's lock


def test_sigkill_inside_chunk(run_copy, complete_run):
    kill_inside(run_copy, "chunk")
    left_behind(run_copy, "chunk")
    assert (Path(run_copy) / "chunk" / "chunks.parquet.tmp").exists()  # killed mid atomic write
    assert not (Path(run_copy) / "chunk" / "chunks.parquet").exists()
    resume(run_copy)
    assert outputs(run_copy)["chunk"] == outputs(complete_run)["chunk"]


def test_sigkill_inside_synthesize(run_copy):
    kill_inside(run_copy, "synthesize")
    left_behind(run_copy, "synthesize")
    partial = sorted((Path(run_copy) / "synthesize" / "partial").glob("*.parquet"))
    saved = {p.stem: read_table(str(p), PairRow) for p in partial}
    assert len(saved) == 2
    resume(run_copy)
    manifest = RunDir(run_copy).read_manifest("synthesize")
    assert manifest.counts["resumed_requests"] == 2 and manifest.counts["requests"] == 12  # none asked twice
    rows = read_table(f"{run_copy}/synthesize/pairs.parquet", PairRow)
    for name, kept in saved.items():  # finished replies kept byte for byte
        assert [r for r in rows if r.pair_id.startswith(name + "-")] == kept
    assert len({r.pair_id for r in rows}) == len(rows)


def test_sigkill_inside_verify(run_copy, monkeypatch):
    from nectar.llm.local import LocalBackend

    kill_inside(run_copy, "verify")
    left_behind(run_copy, "verify")
    answers = sorted((Path(run_copy) / "verify" / "partial" / "answers").glob("*.parquet"))
    assert len(answers) == 1
    saved = {r.pair_id: r.text for r in read_table(str(answers[0]), AnswerRow)}
    asked = []  # a spy on the real backend: how many requests each call sends
    real = LocalBackend.chat_many
    monkeypatch.setattr(LocalBackend, "chat_many", lambda self, reqs, *a, **k: asked.append(len(reqs)) or
                        real(self, reqs, *a, **k))
    resume(run_copy)
    candidates = RunDir(run_copy).read_manifest("verify").counts["answer_requests"]
    assert asked[0] == candidates - len(saved)  # the answers: none of the saved ones asked again
    rows = {r.pair_id: r for r in read_table(f"{run_copy}/verify/dataset.parquet", DatasetRow)}
    assert all(rows[pid].full_answer == text for pid, text in saved.items())  # byte for byte


def test_sigkill_inside_targets(run_copy, complete_run):
    from nectar.targets.store import open_targets

    kill_inside(run_copy, "targets")
    left_behind(run_copy, "targets")
    g, header = open_targets(f"{run_copy}/targets/targets.zarr")
    assert int(g.attrs["written_tokens"]) == 64 and not header.complete  # the first shard is on disk
    resume(run_copy)
    ref, _ = open_targets(f"{complete_run}/targets/targets.zarr")
    got, _ = open_targets(f"{run_copy}/targets/targets.zarr")
    for name in ("q", "alpha", "A", "topk_logprobs", "topk_ids", "token_ids", "positions", "pair_offsets"):
        a, b = got[name][:], ref[name][:]  # resumed in another batch packing: floats to the reordering bound
        assert close_reordered(a, b, name=name) if b.dtype.kind == "f" else np.array_equal(a, b), name
    assert outputs(run_copy)["targets"]["pairs.parquet"] == outputs(complete_run)["targets"]["pairs.parquet"]


def test_sigkill_inside_train(run_copy, complete_run):
    kill_inside(run_copy, "train")
    left_behind(run_copy, "train")
    assert (Path(run_copy) / "train" / "checkpoints" / "last.pt").exists()
    resume(run_copy)
    assert RunDir(run_copy).read_manifest("train").counts["resumed_from_step"] == 25
    ref, got = (load_file(f"{d}/train/module.safetensors") for d in (complete_run, run_copy))
    assert set(ref) == set(got) and all(np.allclose(got[k], ref[k], atol=1e-6) for k in ref)


def test_sigkill_inside_evaluate(run_copy, complete_run):
    kill_inside(run_copy, "evaluate")
    left_behind(run_copy, "evaluate")
    resume(run_copy)
    ref, got = (read_table(f"{d}/evaluate/metrics.parquet", MetricsRow) for d in (complete_run, run_copy))
    assert [(r.split, r.model, r.n_tokens) for r in got] == [(r.split, r.model, r.n_tokens) for r in ref]
    assert np.allclose([r.token_acc for r in got], [r.token_acc for r in ref], atol=1e-6)
    assert np.allclose([r.kl_to_full for r in got], [r.kl_to_full for r in ref], atol=1e-5)
