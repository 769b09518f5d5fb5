"""nectar.orchestration.executor: run directories, manifests written last, cache-keyed stage execution and failure records.

Everything runs for real on a tmp directory: stage bodies write real files, manifests are real JSON.
"""
from __future__ import annotations

import json
import os

import pytest

from nectar.orchestration.executor import (
    CODE_VERSION, RunDir, StageError, cache_key, doc_id_for, hash_url, last_invocation, record_failure, run_stage,
    slug, stage_status,
)
from nectar.schemas.artifacts import StageManifest
from nectar.schemas.config import ChunkConfig, TargetsConfig
from nectar.tables import ArtifactError

INPUTS = {"document": "sha-of-doc"}


class Body:
    """A stage body that writes one output file and counts its calls."""

    def __init__(self, run: RunDir, stage: str = "chunk", text: str = "rows", fail: BaseException | None = None):
        self.run, self.stage, self.text, self.fail = run, stage, text, fail
        self.calls = 0
        self.manifest_seen: list[bool] = []

    def __call__(self, stage_url: str):
        self.calls += 1
        assert stage_url == self.run.url(self.stage)
        # the manifest is never present while the body runs: a killed run never looks complete
        self.manifest_seen.append(self.run.exists(self.stage, "manifest.json"))
        with open(os.path.join(self.run.local_path(self.stage), "out.txt"), "w") as f:
            f.write(self.text)
        if self.fail is not None:
            raise self.fail
        return ["out.txt"], {"rows": len(self.text)}


@pytest.fixture
def run(tmp_path) -> RunDir:
    return RunDir(str(tmp_path / "doc-12345678" / "run-1"))


# --- RunDir --------------------------------------------------------------------------------------


def test_rundir_paths_and_dirs(tmp_path):
    run = RunDir(str(tmp_path) + "/r/")
    assert run.url("chunk", "manifest.json") == f"{tmp_path}/r/chunk/manifest.json"
    assert run.manifest_url("train") == f"{tmp_path}/r/train/manifest.json"
    assert not run.exists("chunk")
    assert run.makedirs("chunk", "sub") == f"{tmp_path}/r/chunk/sub"
    assert (tmp_path / "r" / "chunk" / "sub").is_dir() and run.exists("chunk", "sub")
    assert run.local_path("chunk") == f"{tmp_path}/r/chunk"
    assert run.read_manifest("chunk") is None
    run.invalidate("chunk")  # no manifest: nothing to do, no error
    assert run.read_error("chunk") is None


def test_rundir_error_records(run):
    run.write_error("verify", "boom")
    err = run.read_error("verify")
    assert err["stage"] == "verify" and err["error"] == "boom" and err["at"]
    run.clear_error("verify")
    assert run.read_error("verify") is None


def test_slug_and_doc_id():
    assert slug("My Report (final).PDF") == "my-report-final-.pdf"
    assert slug("///") == "doc"
    assert len(slug("x" * 100)) == 48
    assert doc_id_for("Annual Report.txt", "0123456789abcdef") == "annual-report.txt-01234567"


# --- run_stage: success and the manifest ----------------------------------------------------------


def test_run_stage_writes_outputs_then_manifest(run):
    body = Body(run, "targets")
    cfg = TargetsConfig(top_k=8, batch_size=3)
    outcome = run_stage(run, "targets", cfg, INPUTS, body)
    assert outcome.status == "done" and outcome.stage == "targets"
    manifest = run.read_manifest("targets")
    assert manifest == outcome.manifest
    assert manifest.cache_key == cache_key("targets", cfg, INPUTS)
    assert manifest.config == cfg.cache_dict() and "batch_size" not in manifest.config
    assert manifest.inputs == INPUTS
    assert manifest.outputs == outcome.outputs == {"out.txt": hash_url(run.url("targets", "out.txt"))}
    assert manifest.counts == {"rows": 4}
    assert manifest.code_version == CODE_VERSION
    assert manifest.duration_s >= 0 and manifest.started_at <= manifest.finished_at
    assert last_invocation(run, "targets")["status"] == "done"
    assert run.read_error("targets") is None
    assert not run.exists("targets", "manifest.json.tmp")
    assert body.calls == 1 and body.manifest_seen == [False]


def test_unknown_stage_is_refused_before_anything_runs(run):
    body = Body(run, "tokenize")
    with pytest.raises(ValueError, match="unknown stage 'tokenize'"):
        run_stage(run, "tokenize", {}, INPUTS, body)
    assert body.calls == 0 and not run.exists("tokenize")


def test_document_pseudo_stage_is_accepted(run):
    assert run_stage(run, "document", {}, INPUTS, Body(run, "document")).status == "done"


# --- the cache -----------------------------------------------------------------------------------


def test_same_key_is_a_cache_hit_and_the_body_is_not_called_again(run):
    body = Body(run)
    first = run_stage(run, "chunk", {"words": 60}, INPUTS, body)
    second = run_stage(run, "chunk", {"words": 60}, INPUTS, body)
    assert body.calls == 1
    assert second.status == "cached"
    assert second.manifest == first.manifest and second.outputs == first.outputs
    assert last_invocation(run, "chunk")["status"] == "cached"
    assert stage_status(run, "chunk")["state"] == "cached"


def test_resource_only_config_change_is_still_a_cache_hit(run):
    body = Body(run, "targets")
    run_stage(run, "targets", TargetsConfig(batch_size=1, batch_tokens=64), INPUTS, body)
    again = run_stage(run, "targets", TargetsConfig(batch_size=64, batch_tokens=8192), INPUTS, body)
    assert again.status == "cached" and body.calls == 1


@pytest.mark.parametrize("change", ["config", "inputs", "force"])
def test_changed_config_or_inputs_or_force_reruns(run, change):
    body = Body(run)
    first = run_stage(run, "chunk", ChunkConfig(words=60, overlap=10), INPUTS, body)
    cfg, inputs, force = ChunkConfig(words=60, overlap=10), dict(INPUTS), False
    if change == "config":
        cfg = ChunkConfig(words=61, overlap=10)
    elif change == "inputs":
        inputs = {"document": "another-sha"}
    else:
        force = True
    body.text = "new rows"
    second = run_stage(run, "chunk", cfg, inputs, body, force=force)
    assert body.calls == 2 and second.status == "done"
    assert body.manifest_seen == [False, False]  # the old manifest was removed before the body ran
    assert second.manifest.cache_key == cache_key("chunk", cfg, inputs)
    assert (second.manifest.cache_key != first.manifest.cache_key) == (change != "force")
    assert second.outputs["out.txt"] != first.outputs["out.txt"]  # outputs re-hashed
    assert run.read_manifest("chunk") == second.manifest
    # and the new key is now the cached one
    assert run_stage(run, "chunk", cfg, inputs, body).status == "cached" and body.calls == 2


def test_stages_cache_independently(run):
    chunk, synth = Body(run, "chunk"), Body(run, "synthesize")
    run_stage(run, "chunk", {"a": 1}, INPUTS, chunk)
    run_stage(run, "synthesize", {"a": 1}, INPUTS, synth)  # same config and inputs, other stage
    assert (chunk.calls, synth.calls) == (1, 1)
    assert run.read_manifest("chunk").cache_key != run.read_manifest("synthesize").cache_key


def test_invalidate_forces_a_rerun(run):
    body = Body(run)
    run_stage(run, "chunk", {}, INPUTS, body)
    run.invalidate("chunk")
    assert run.read_manifest("chunk") is None and stage_status(run, "chunk")["state"] == "missing"
    assert run_stage(run, "chunk", {}, INPUTS, body).status == "done" and body.calls == 2


# --- failures ------------------------------------------------------------------------------------


def test_failing_body_leaves_no_manifest_and_records_the_error(run):
    body = Body(run, fail=RuntimeError("judge endpoint refused the connection"))
    with pytest.raises(StageError, match="judge endpoint refused") as info:
        run_stage(run, "chunk", {}, INPUTS, body)
    assert info.value.stage == "chunk" and isinstance(info.value.cause, RuntimeError)
    assert info.value.__cause__ is info.value.cause
    assert run.read_manifest("chunk") is None
    assert not run.exists("chunk", "manifest.json")
    assert run.exists("chunk", "out.txt")  # partial outputs stay for the body to resume from
    err = run.read_error("chunk")
    assert err["stage"] == "chunk"
    assert err["error"].startswith("RuntimeError: judge endpoint refused the connection\n")
    assert "Traceback" in err["error"]
    assert last_invocation(run, "chunk")["status"] == "failed"
    status = stage_status(run, "chunk")
    assert status["state"] == "failed" and "judge endpoint refused" in status["error"]
    assert status["counts"] == {} and status["duration_s"] is None
    # record_failure (what the flows call around every stage) does not record it a second time
    error_file = run.url("chunk", "error.json")
    with open(error_file) as f:
        before = f.read()
    assert record_failure(run, "chunk", info.value) is info.value
    with open(error_file) as f:
        assert f.read() == before


def test_failure_after_a_success_removes_the_stale_manifest(run):
    run_stage(run, "chunk", {"words": 1}, INPUTS, Body(run))
    with pytest.raises(StageError) as info:
        run_stage(run, "chunk", {"words": 2}, INPUTS, Body(run, fail=KeyError("missing column")))
    assert isinstance(info.value.cause, KeyError)
    assert run.read_manifest("chunk") is None  # downstream can't mistake the old outputs for the new config
    assert stage_status(run, "chunk")["state"] == "failed"


def test_keyboard_interrupt_is_recorded_too(run):
    with pytest.raises(KeyboardInterrupt):
        run_stage(run, "train", {}, INPUTS, Body(run, "train", fail=KeyboardInterrupt()))
    assert run.read_manifest("train") is None
    assert run.read_error("train")["error"].startswith("KeyboardInterrupt")


def test_success_after_failure_clears_the_error(run):
    body = Body(run, fail=RuntimeError("flaky"))
    with pytest.raises(StageError):
        run_stage(run, "chunk", {}, INPUTS, body)
    body.fail = None
    outcome = run_stage(run, "chunk", {}, INPUTS, body)
    assert outcome.status == "done" and body.calls == 2
    assert run.read_error("chunk") is None
    status = stage_status(run, "chunk")
    assert status["state"] == "done" and status["error"] is None and status["counts"] == {"rows": 4}


def test_body_declaring_a_missing_output_is_not_marked_complete(run):
    def body(stage_url):
        return ["never-written.parquet"], {}

    with pytest.raises(StageError, match="never-written.parquet: missing") as info:
        run_stage(run, "chunk", {}, INPUTS, body)
    assert isinstance(info.value.cause, ArtifactError)
    assert run.read_manifest("chunk") is None


def test_record_failure_for_errors_outside_the_body(run):
    failure = record_failure(run, "verify", FileNotFoundError("synthesize/pairs.parquet"))
    assert isinstance(failure, StageError) and failure.stage == "verify"
    assert isinstance(failure.cause, FileNotFoundError)
    status = stage_status(run, "verify")
    assert status["state"] == "failed"
    assert status["error"] == "FileNotFoundError: synthesize/pairs.parquet"


def test_stage_error_reads_as_its_cause_and_pickles():
    import pickle

    exc = StageError("train", ValueError("diverged"))
    assert str(exc) == "diverged" and exc.stage == "train"
    again = pickle.loads(pickle.dumps(exc))  # Prefect hands task failures across processes
    assert again.stage == "train" and isinstance(again.cause, ValueError) and str(again) == "diverged"


# --- stage_status --------------------------------------------------------------------------------


def test_stage_status_missing_done_and_cached(run):
    assert stage_status(run, "verify") == {"stage": "verify", "state": "missing", "counts": {},
                                           "duration_s": None, "finished_at": None, "error": None,
                                           "stale": None}
    body = Body(run, "verify")
    run_stage(run, "verify", {}, INPUTS, body)
    done = stage_status(run, "verify")
    assert done["state"] == "done" and done["counts"] == {"rows": 4} and done["finished_at"]
    run_stage(run, "verify", {}, INPUTS, body)
    assert stage_status(run, "verify")["state"] == "cached"


def test_manifest_without_invocation_record_counts_as_done(run):
    run_stage(run, "chunk", {}, INPUTS, Body(run))
    os.remove(run.url("chunk", "last_invocation.json"))  # e.g. a run dir copied from an older release
    assert stage_status(run, "chunk")["state"] == "done"


def test_corrupt_manifest_is_an_artifact_error(run):
    run_stage(run, "chunk", {}, INPUTS, Body(run))
    path = run.url("chunk", "manifest.json")
    data = json.loads(open(path).read())
    del data["cache_key"]
    with open(path, "w") as f:
        json.dump(data, f)
    with pytest.raises(ArtifactError, match="field 'cache_key'"):
        run.read_manifest("chunk")


# --- hash_url ------------------------------------------------------------------------------------


def test_hash_url_of_files_and_directories(tmp_path):
    f = tmp_path / "a.bin"
    f.write_bytes(b"hello")
    h = hash_url(str(f))
    assert len(h) == 64 and h == hash_url(str(f))
    f.write_bytes(b"hellp")  # same size, other content
    assert hash_url(str(f)) != h

    d = tmp_path / "store.zarr"
    (d / "q").mkdir(parents=True)
    (d / "zarr.json").write_text('{"shape": [3]}')
    (d / "q" / "0").write_bytes(b"\x01" * (1 << 17))  # a big chunk: its content is hashed too
    dh = hash_url(str(d))
    assert dh.startswith("tree:") and hash_url(str(d)) == dh
    (d / "q" / "0.tmp").write_bytes(b"half")  # an interrupted atomic write is not content
    assert hash_url(str(d)) == dh
    (d / "q" / "0").write_bytes(b"\x00" * (1 << 17))  # zeroed, same size
    assert hash_url(str(d)) != dh
    dh2 = hash_url(str(d))
    (d / "q" / "1").write_bytes(b"\x01")  # a new chunk
    assert hash_url(str(d)) != dh2

    with pytest.raises(ArtifactError, match="nope: missing"):
        hash_url(str(tmp_path / "nope"))


def test_directory_outputs_are_hashed_into_the_manifest(run):
    def body(stage_url):
        os.makedirs(f"{stage_url}/model.zarr")
        with open(f"{stage_url}/model.zarr/meta.json", "w") as f:
            f.write("{}")
        return ["model.zarr"], {"arrays": 1}

    outcome = run_stage(run, "targets", {}, INPUTS, body)
    assert outcome.outputs["model.zarr"] == hash_url(run.url("targets", "model.zarr"))
    assert outcome.outputs["model.zarr"].startswith("tree:")
    assert set(outcome.manifest.files) == {"model.zarr/meta.json"}
    assert isinstance(outcome.manifest, StageManifest)


# --- integrity: cached means the outputs still match their digests --------------------------------


def _zarr_like_body(stage_url):
    """Writes a folder of 'shards' with plain writes (like zarr) and a file through atomic_write."""
    from nectar.storage import atomic_write

    for i in range(3):
        os.makedirs(f"{stage_url}/t.zarr/q/c/{i}", exist_ok=True)
        with open(f"{stage_url}/t.zarr/q/c/{i}/0", "wb") as f:
            f.write(bytes([i + 1]) * 4096)
    atomic_write(f"{stage_url}/pairs.parquet", b"PAR1 rows PAR1")
    return ["t.zarr", "pairs.parquet"], {"shards": 3}


def _zero_keeping_mtime(path):
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.write(b"\0" * st.st_size)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # even the old mtime is restored


def test_manifest_records_a_digest_per_file(run):
    import hashlib

    outcome = run_stage(run, "targets", {}, INPUTS, _zarr_like_body)
    files = outcome.manifest.files
    assert set(files) == {"pairs.parquet", "t.zarr/q/c/0/0", "t.zarr/q/c/1/0", "t.zarr/q/c/2/0"}
    assert files["t.zarr/q/c/1/0"].sha256 == hashlib.sha256(b"\x02" * 4096).hexdigest()
    assert files["pairs.parquet"].sha256 == hashlib.sha256(b"PAR1 rows PAR1").hexdigest()
    assert outcome.outputs["pairs.parquet"] == files["pairs.parquet"].sha256
    assert outcome.outputs["t.zarr"].startswith("tree:")


def test_atomic_write_digests_are_recorded_not_reread(run, monkeypatch):
    from nectar import integrity

    read = []
    real = integrity.hash_file
    monkeypatch.setattr(integrity, "hash_file", lambda fs, p: read.append(p.rsplit("/", 1)[-1]) or real(fs, p))
    run_stage(run, "targets", {}, INPUTS, _zarr_like_body)
    assert "pairs.parquet" not in read and sorted(read) == ["0", "0", "0"]  # the plain writes are read back


def test_zeroed_shard_of_the_same_size_is_detected_and_only_that_stage_redone(run):
    notices = []
    first = run_stage(run, "targets", {}, INPUTS, _zarr_like_body, notify=notices.append)
    _zero_keeping_mtime(run.local_path("targets", "t.zarr", "q", "c", "1", "0"))
    st = stage_status(run, "targets")
    assert st["state"] == "stale" and st["stale"] == "targets/t.zarr/q/c/1/0 changed (sha256 differs)"
    again = run_stage(run, "targets", {}, INPUTS, _zarr_like_body, notify=notices.append)
    assert again.status == "done" and again.outputs == first.outputs  # rebuilt to the same content
    assert notices == ["targets: targets/t.zarr/q/c/1/0 changed (sha256 differs) since the stage completed; "
                       "redoing targets"]
    assert run_stage(run, "targets", {}, INPUTS, _zarr_like_body).status == "cached"


@pytest.mark.parametrize("damage", ["truncate", "delete", "extra"])
def test_truncated_deleted_or_added_files_are_detected(run, damage):
    run_stage(run, "targets", {}, INPUTS, _zarr_like_body)
    path = run.local_path("targets", "pairs.parquet")
    if damage == "truncate":
        with open(path, "r+b") as f:
            f.truncate(4)
    elif damage == "delete":
        os.remove(path)
    else:
        with open(run.local_path("targets", "t.zarr", "q", "c", "9"), "wb") as f:
            f.write(b"x")
    st = stage_status(run, "targets")
    expected = {"truncate": "targets/pairs.parquet changed size (14 → 4 bytes)",
                "delete": "targets/pairs.parquet is missing",
                "extra": "targets/t.zarr/q/c/9 appeared (not written by the stage)"}[damage]
    assert st["state"] == "stale" and st["stale"] == expected
    notices = []
    assert run_stage(run, "targets", {}, INPUTS, _zarr_like_body, notify=notices.append).status == "done"
    assert len(notices) == 1 and expected in notices[0]
    assert stage_status(run, "targets")["state"] == "done"


def test_damaged_file_in_a_folder_output_is_handed_to_repair(run):
    """Without a repair the whole folder output is removed; a stage's repair can redo just a part."""
    run_stage(run, "targets", {}, INPUTS, _zarr_like_body)
    _zero_keeping_mtime(run.local_path("targets", "t.zarr", "q", "c", "2", "0"))
    seen = []

    def repair(stage_url, changes):
        seen.extend(c.path for c in changes)
        os.remove(f"{stage_url}/t.zarr/q/c/2/0")  # the stage's own partial redo
        return []

    present = {}

    def body(stage_url):
        present.update({i: os.path.exists(f"{stage_url}/t.zarr/q/c/{i}/0") for i in range(3)})
        return _zarr_like_body(stage_url)

    assert run_stage(run, "targets", {}, INPUTS, body, repair=repair).status == "done"
    assert seen == ["t.zarr/q/c/2/0"]
    assert present == {0: True, 1: True, 2: False}  # the intact shards were there to resume from


def test_manifest_of_an_older_release_is_never_cached(run):
    run_stage(run, "chunk", {}, INPUTS, Body(run))
    path = run.url("chunk", "manifest.json")
    data = json.loads(open(path).read())
    data.pop("files")
    with open(path, "w") as f:
        json.dump(data, f)
    body = Body(run)
    assert run_stage(run, "chunk", {}, INPUTS, body).status == "done" and body.calls == 1


def test_changed_upstream_output_makes_downstream_stale(run):
    run_stage(run, "chunk", {}, INPUTS, Body(run, "chunk"))
    chunk = run.read_manifest("chunk")
    downstream_inputs = {**INPUTS, **{f"chunk/{k}": v for k, v in chunk.outputs.items()}}
    run_stage(run, "synthesize", {}, downstream_inputs, Body(run, "synthesize"))
    assert stage_status(run, "synthesize")["state"] == "done"
    run_stage(run, "chunk", {"words": 2}, INPUTS, Body(run, "chunk", text="other rows"))
    st = stage_status(run, "synthesize")
    assert st["state"] == "stale" and "its input chunk/out.txt changed" in st["stale"]


def test_partial_files_are_resumed_only_for_the_same_key(run):
    def body(stage_url):
        marker = f"{stage_url}/partial.txt"
        seen = os.path.exists(marker)
        with open(marker, "w") as f:
            f.write("x")
        if not seen:
            raise RuntimeError("killed")
        return ["partial.txt"], {"resumed": seen}

    with pytest.raises(StageError):
        run_stage(run, "chunk", {"a": 1}, INPUTS, body)
    assert run_stage(run, "chunk", {"a": 1}, INPUTS, body).manifest.counts == {"resumed": True}
    with pytest.raises(StageError):  # another configuration: the folder starts empty
        run_stage(run, "chunk", {"a": 2}, INPUTS, body)
    with pytest.raises(StageError):  # forced: starts empty too
        run_stage(run, "chunk", {"a": 2}, INPUTS, body, force=True)


def test_code_version_enters_the_key(run):
    body = Body(run)
    run_stage(run, "chunk", {}, INPUTS, body, code="0.2.0+aaaa")
    assert run_stage(run, "chunk", {}, INPUTS, body, code="0.2.0+aaaa").status == "cached"
    again = run_stage(run, "chunk", {}, INPUTS, body, code="0.2.0+bbbb")
    assert again.status == "done" and again.manifest.code_version == "0.2.0+bbbb" and body.calls == 2
