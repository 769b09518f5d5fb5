"""The CLI's one line for a failure: a StageError names its stage and is classified by its cause."""
from nectar.orchestration.executor import StageError
from nectar.pipeline.errors import BAD_INPUT, STAGE_FAILED, classify
from nectar.tables import ArtifactError


def test_a_stage_failure_names_the_stage_and_the_cause():
    line, code = classify(StageError("train", RuntimeError("training diverged")))
    assert code == STAGE_FAILED
    assert line.startswith("train failed: RuntimeError: training diverged — fix the cause")


def test_bad_input_inside_a_stage_is_bad_input_with_the_stage_named():
    assert classify(StageError("targets", ArtifactError("pairs.parquet: missing"))) == (
        "targets: pairs.parquet: missing", BAD_INPUT)


def test_an_error_outside_any_stage_is_not_attributed_to_one():
    line, code = classify(RuntimeError("boom"))
    assert (line, code) == ("RuntimeError: boom", STAGE_FAILED)
