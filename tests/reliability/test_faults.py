"""The fault half of the matrix (docs/artifacts.md, "What goes wrong"), on copies of one complete
``tiny`` run. Each row checks what the user sees (the notice or the CLI's one line and exit code),
what is kept, and that the re-run finishes with the same artifacts as the uninterrupted run — for the
LLM stages, the resume contract (nothing finished asked again, finished replies byte for byte).

Failure injection uses FAKES, named so: a FAKE OpenAI server (tests/llm/fake_openai.py) and a FAKE
size-limited filesystem (fake_full_disk.py). Damage is done to real files with real writes.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import fsspec
import numpy as np
import pytest
from float_tolerance import close_reordered
from matrix_helpers import DOCUMENT, cli, outputs, run_pipeline

from nectar.orchestration.executor import RunDir, stage_status
from nectar.schemas.artifacts import DatasetRow, PairRow
from nectar.tables import ArtifactError, read_table

SHARD = "targets.zarr/q/c/1/0/0/0"  # the second shard of q: tokens 64-127 of the tiny run


def zero_keeping_mtime(path: Path) -> None:
    """Overwrite a file with zeros of the same size and put its mtime back (the issue's repro)."""
    st = path.stat()
    with open(path, "r+b") as f:
        f.write(b"\0" * st.st_size)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def targets_arrays(run_dir: str) -> dict[str, np.ndarray]:
    from nectar.targets.store import open_targets

    g, _ = open_targets(f"{run_dir}/targets/targets.zarr")
    return {name: g[name][:] for name in ("q", "alpha", "A", "topk_ids", "topk_logprobs", "token_ids")}


# ------------------------------------------------------------------------------ damaged outputs


def test_zeroed_shard_is_stale_and_only_its_shards_are_redone(run_copy, complete_run):
    shard = Path(run_copy) / "targets" / SHARD
    kept = Path(run_copy) / "targets" / "targets.zarr/q/c/0/0/0/0"
    kept_mtime = kept.stat().st_mtime_ns
    zero_keeping_mtime(shard)
    st = stage_status(RunDir(run_copy), "targets")
    assert st["state"] == "stale" and st["stale"] == f"targets/{SHARD} changed (sha256 differs)"

    out = run_pipeline(run_copy)
    assert out.error is None and out.exit_code == 0
    assert out.notices == [f"targets: targets/{SHARD} changed (sha256 differs) since the stage completed; "
                           "redoing targets"]
    assert out.statuses["targets"] == "done"
    assert all(out.statuses[s] == "cached" for s in ("chunk", "synthesize", "verify"))
    assert kept.stat().st_mtime_ns == kept_mtime  # the intact shard was not rewritten: a partial redo
    ref, got = targets_arrays(complete_run), targets_arrays(run_copy)
    # shards redone in another batch packing: floats to the reordering bound, integers exact
    assert all(close_reordered(got[k], ref[k]) if got[k].dtype.kind == "f" else np.array_equal(got[k], ref[k])
               for k in ref)
    same = outputs(run_copy)["targets"] == outputs(complete_run)["targets"]
    # downstream is redone exactly when the rebuilt targets differ (by content) from what it was made of
    assert all(out.statuses[s] == ("cached" if same else "done") for s in ("train", "evaluate"))
    assert stage_status(RunDir(run_copy), "targets")["state"] == "done"


def test_truncated_dataset_is_refused_naming_the_file_and_the_rebuild(run_copy):
    path = Path(run_copy) / "verify" / "dataset.parquet"
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size // 2)
    before = outputs(run_copy)
    out = run_pipeline(run_copy, only="targets")
    assert out.exit_code == 2
    assert out.user_line == (
        f"{run_copy}/verify/dataset.parquet changed size ({size} → {size // 2} bytes) since verify completed; "
        f"targets will not read it: rebuild it with `nectar run {DOCUMENT} --run-dir {run_copy} --from verify`")
    assert outputs(run_copy) == before  # nothing else touched
    assert stage_status(RunDir(run_copy), "verify")["state"] == "stale"


def test_unreadable_parquet_names_the_file_not_arrow(tmp_path):
    """What every reader of a table gets (without a manifest to compare with): the file and the problem."""
    from nectar.tables import write_table

    url = str(tmp_path / "dataset.parquet")
    write_table(url, [], DatasetRow)
    data = Path(url).read_bytes()
    Path(url).write_bytes(data[: len(data) // 2])
    with pytest.raises(ArtifactError, match=r"dataset\.parquet: not a readable DatasetRow table \(ArrowInvalid"):
        read_table(url, DatasetRow)


def test_deleted_manifest_resumes_from_the_stage_files(run_copy, complete_run):
    os.remove(Path(run_copy) / "targets" / "manifest.json")
    assert stage_status(RunDir(run_copy), "targets")["state"] == "missing"
    assert stage_status(RunDir(run_copy), "train")["state"] == "stale"  # its input's manifest is gone
    out = run_pipeline(run_copy)
    assert out.error is None and out.notices == []
    assert out.statuses["targets"] == "done" and out.statuses["train"] == out.statuses["evaluate"] == "cached"
    assert outputs(run_copy) == outputs(complete_run)


def test_flipped_byte_in_a_chunk_fails_its_read_and_is_named_before_training(run_copy):
    from nectar.targets.reader import TargetsData

    shard = Path(run_copy) / "targets" / SHARD
    st = shard.stat()
    with open(shard, "r+b") as f:  # one bit inside the first chunk's float data
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0x01]))
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(ValueError, match="Stored and computed checksum do not match"):
        TargetsData(f"{run_copy}/targets/targets.zarr").rows(np.arange(64, 70))  # crc32c per chunk
    out = run_pipeline(run_copy, only="train")
    assert out.exit_code == 2 and f"targets/{SHARD} changed (sha256 differs)" in out.user_line
    assert "--from targets" in out.user_line


# ------------------------------------------------------------------------------ one writer


HOLD = """
import sys, time
from nectar.orchestration.lock import run_lock
with run_lock(sys.argv[1]):
    print("held", flush=True)
    time.sleep(60)
"""


def test_second_run_on_a_locked_run_dir_exits_at_once_naming_the_holder(run_copy):
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    holder = subprocess.Popen([sys.executable, "-c", HOLD, run_copy], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert holder.stdout.readline().strip() == "held"
        before = outputs(run_copy)
        code, _, stderr = cli(["run", DOCUMENT, "--preset", "tiny", "--run-dir", run_copy, "--no-wait"])
        (line,) = [x for x in stderr.splitlines() if x.strip()]
        assert code == 3 and line.startswith(f"error: {run_copy} is being written by pid {holder.pid} on ")
        assert "wait for it to finish" in line and outputs(run_copy) == before
    finally:
        holder.kill()
        holder.wait()
    # the holder died without releasing: the next run takes the lock over, says so, and is all cache hits
    out = run_pipeline(run_copy)
    assert out.error is None and out.notices[0].startswith(f"taking over the lock on {run_copy} from pid {holder.pid}")
    assert set(out.statuses.values()) == {"cached"}


# ------------------------------------------------------------------------------ LLM server faults


def synthesis_reply(body, n):
    """A healthy FAKE server: a deterministic, well-formed synthesis reply per request (by its seed)."""
    from fake_openai import completion

    seed = body.get("seed")
    return 200, completion('{"scratchpad": "notes", "pairs": [{"instruction": "What is bound in block %s?", '
                           '"response": "Names, per block %s."}]}' % (seed, seed))


def _llm_overrides(url: str, *extra: str) -> tuple[str, ...]:
    return ("synthesize.llm.backend=openai", f"synthesize.llm.base_url={url}", "synthesize.llm.model=fake-model",
            "synthesize.llm.max_retries=1", "synthesize.llm.timeout_s=5", *extra)


def _synthesize(run_dir: str, url: str, *extra: str):
    return run_pipeline(run_dir, *_llm_overrides(url, *extra), stages=("chunk", "synthesize"))


@pytest.fixture
def healthy_pairs(complete_run, tmp_path_factory):
    """The uninterrupted run against the healthy FAKE server: the artifacts a recovered run must match."""
    import shutil

    from fake_openai import fake_server

    ref = str(tmp_path_factory.mktemp("healthy") / "run")
    shutil.copytree(complete_run, ref)
    with fake_server(synthesis_reply) as srv:
        out = _synthesize(ref, srv.url)
    assert out.error is None, out.user_line

    def check(run_dir: str) -> None:
        assert read_table(f"{run_dir}/synthesize/pairs.parquet", PairRow) == \
            read_table(f"{ref}/synthesize/pairs.parquet", PairRow)
        assert outputs(run_dir)["synthesize"] == outputs(ref)["synthesize"]
    return check


def _fails_then_recovers(run_copy, healthy_pairs, reply, fragment, *extra, delay_s=0.0):
    from fake_openai import fake_server

    with fake_server(reply, delay_s=delay_s) as srv:
        failed = _synthesize(run_copy, srv.url, *extra)
        url, port = srv.url, int(srv.url.rsplit(":", 1)[1].split("/")[0])
    assert failed.exit_code == 1 and failed.user_line.startswith("synthesize failed: SynthesizeError: ")
    assert fragment in failed.user_line and "a re-run asks only the failed ones" in failed.user_line
    run = RunDir(run_copy)
    assert run.read_manifest("synthesize") is None and run.read_manifest("chunk") is not None  # chunk kept
    assert stage_status(run, "synthesize")["state"] == "failed"
    saved = {p.name for p in Path(run_copy, "synthesize", "partial").glob("*.parquet")}
    with fake_server(synthesis_reply, port=port) as healthy:  # the server is fixed, at the same URL
        assert healthy.url == url
        again = _synthesize(run_copy, url)
        asked = len(healthy.bodies)
    assert again.error is None and again.statuses["synthesize"] == "done"
    assert asked == 12 - len(saved)  # nothing finished is asked again
    healthy_pairs(run_copy)
    return saved


def test_server_answering_500_with_fake_failing_server(run_copy, healthy_pairs):
    def reply(body, n):  # every other request fails, persistently
        return (500, {"error": "boom"}) if body["seed"] % 2 else synthesis_reply(body, n)

    saved = _fails_then_recovers(run_copy, healthy_pairs, reply, "server answered 500")
    assert 0 < len(saved) < 12  # the requests that succeeded were kept


def test_garbage_reply_with_fake_garbage_server(run_copy, healthy_pairs):
    _fails_then_recovers(run_copy, healthy_pairs, lambda body, n: (200, "<html>502 bad gateway</html>"),
                         "malformed response from")


def test_timeout_with_fake_slow_server(run_copy, healthy_pairs):
    _fails_then_recovers(run_copy, healthy_pairs, synthesis_reply, "timed out after 0.3s (1 attempt(s))",
                         "synthesize.llm.timeout_s=0.3", "synthesize.llm.max_retries=0", delay_s=1.0)


def test_429_with_retry_after_with_fake_rate_limiting_server(run_copy, healthy_pairs):
    from fake_openai import fake_server

    def reply(body, n):
        return (429, {"error": "rate limited"}, {"Retry-After": "1"}) if n == 1 else synthesis_reply(body, n)

    with fake_server(reply) as srv:
        out = _synthesize(run_copy, srv.url, "synthesize.llm.max_concurrency=1")
        times = list(srv.times)
    assert out.error is None and out.statuses["synthesize"] == "done"
    assert times[1] - times[0] >= 0.95  # the server's Retry-After, not the client's own 0.5 s backoff
    healthy_pairs(run_copy)


def test_reply_that_is_not_json_is_a_counted_parse_failure_with_fake_chatty_server(run_copy):
    from fake_openai import completion, fake_server

    with fake_server(lambda body, n: (200, completion("Sure! Here are some great questions."))) as srv:
        out = _synthesize(run_copy, srv.url)
    assert out.error is None
    counts = RunDir(run_copy).read_manifest("synthesize").counts
    assert counts["parse_failures"] == 12 and counts["pairs"] == 0  # recorded, never dropped


# ------------------------------------------------------------------------------ a full disk, a NaN loss


def test_full_disk_with_fake_size_limited_filesystem(complete_run):
    import fake_full_disk as disk

    disk.FullDiskFS.reset(None)
    fs = fsspec.filesystem(disk.PROTOCOL)
    fs.put(complete_run, "/runs/full", recursive=True)
    for stage in ("targets", "train", "evaluate"):
        fs.rm(f"/runs/full/{stage}", recursive=True)
    root = f"{disk.PROTOCOL}://runs/full"
    disk.FullDiskFS.quota = disk.FullDiskFS.used() + 200_000  # the targets need ~2 MB
    out = run_pipeline(root, stages=("chunk", "synthesize", "verify", "targets"))
    assert out.exit_code == 1
    assert out.user_line.startswith("targets failed: OSError: [Errno 28] No space left on device")
    run = RunDir(root)
    assert run.read_manifest("verify") is not None and run.read_manifest("targets") is None  # upstream kept
    disk.FullDiskFS.quota = None  # space freed
    again = run_pipeline(root, stages=("chunk", "synthesize", "verify", "targets"))
    assert again.error is None and again.statuses["targets"] == "done"
    assert outputs(root)["targets"] == outputs(complete_run)["targets"]
    disk.FullDiskFS.reset(None)


def test_nan_loss_stops_training_and_a_sane_rerun_matches(run_copy, complete_run):
    bad = run_pipeline(run_copy, "train.peak_lr=1e30", "train.max_bad_steps=3")
    assert bad.exit_code == 1
    assert bad.user_line.startswith("train failed: TrainingDiverged: training diverged: 3 consecutive steps with "
                                    "a non-finite loss or gradient")
    assert "lower train.peak_lr" in bad.user_line
    run = RunDir(run_copy)
    assert run.read_manifest("train") is None and stage_status(run, "train")["state"] == "failed"
    assert stage_status(run, "evaluate")["state"] == "stale"  # made from a train result that is gone
    again = run_pipeline(run_copy)
    assert again.error is None and again.statuses["train"] == "done" and again.statuses["evaluate"] == "cached"
    assert outputs(run_copy) == outputs(complete_run)
