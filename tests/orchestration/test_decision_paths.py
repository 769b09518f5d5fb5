"""promote's decision.json names the live state's folder relative to the run's root: a run directory
moved or copied elsewhere still names its own state, not the folder it was written in."""
import json
import os
import shutil

from nectar.orchestration import live
from nectar.orchestration.executor import RunDir
from nectar.orchestration.readers import write_json


def _run_with_a_train_state(root) -> RunDir:
    (root / "train").mkdir(parents=True)
    (root / "train" / "module.safetensors").write_bytes(b"weights")
    (root / "train" / "module.json").write_text("{}")
    return RunDir(str(root))


def test_decision_json_holds_no_absolute_path_and_reads_back_after_a_move(tmp_path):
    run = _run_with_a_train_state(tmp_path / "old" / "run")
    state = live.publish(run, "train", "no first state")
    write_json(run.url(*live.DECISION), live.decision_record(run, "train", "no first state", state, {"n": 3}))
    text = (tmp_path / "old" / "run" / "promote" / "decision.json").read_text()
    record = json.loads(text)
    assert not os.path.isabs(record["dir"]) and record["dir"].startswith("state/") and str(tmp_path) not in text
    assert record["live"] == "train" and record["n"] == 3

    shutil.move(str(tmp_path / "old"), str(tmp_path / "new"))
    moved = RunDir(str(tmp_path / "new" / "run"))
    back = live.read_decision(moved)
    assert back["dir"] == moved.url(*record["dir"].split("/")) and os.path.isdir(back["dir"])
    assert back["dir"] == live.read_live(moved).url  # the same folder the live pointer names


def test_an_old_absolute_decision_dir_is_re_rooted_in_the_run_that_holds_it(tmp_path):
    run = _run_with_a_train_state(tmp_path / "run")
    state = live.publish(run, "train", "x")
    sha16 = state.url.rsplit("/", 1)[1]
    # written by promote before the path was relative, in a run since moved from /somewhere/else
    write_json(run.url(*live.DECISION), {"live": "train", "reason": "x", "dir": f"/somewhere/else/run/state/{sha16}"})
    assert live.read_decision(run)["dir"] == run.url("state", sha16)
    # an absolute folder this run does not hold is left as it was
    write_json(run.url(*live.DECISION), {"live": "train", "reason": "x", "dir": "/somewhere/else/other"})
    assert live.read_decision(run)["dir"] == "/somewhere/else/other"
    assert live.read_decision(RunDir(str(tmp_path / "empty"))) is None
