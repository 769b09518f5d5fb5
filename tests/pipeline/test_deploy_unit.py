"""deploy.py without a server: parameters, names, env mapping, CLI errors. (Server tests: test_deploy_server.py.)"""
from __future__ import annotations

import typer
from typer.testing import CliRunner

import pytest

from nectar.pipeline import deploy as dep
from nectar.pipeline import operations
from nectar.schemas.presets import ConfigError, load_config


@pytest.fixture
def no_server():
    """Behave as a fresh shell: no PREFECT_API_URL configured."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(restore_defaults={PREFECT_API_URL}):
        yield


def test_llm_overrides_from_env_cover_every_role_and_build_a_valid_config():
    env = {"NECTAR_LLM_BASE_URL": "http://vllm:8000/v1", "NECTAR_GEN_MODEL": "Qwen/Qwen3-8B",
           "NECTAR_JUDGE_BASE_URL": "http://vllm-judge:8000/v1", "NECTAR_JUDGE_MODEL": "judge-model",
           "NECTAR_ANSWER_MODEL": ""}
    cfg = load_config("paper", overrides=dep.llm_overrides_from_env(env))
    assert cfg.synthesize.llm.base_url == "http://vllm:8000/v1" and cfg.synthesize.llm.model == "Qwen/Qwen3-8B"
    # An empty answer model falls back to the generation server and model.
    assert (cfg.verify.answer_llm.base_url, cfg.verify.answer_llm.model) == ("http://vllm:8000/v1", "Qwen/Qwen3-8B")
    for judge in (cfg.verify.judge, cfg.evaluate.judge):
        assert (judge.backend, judge.base_url, judge.model) == ("openai", "http://vllm-judge:8000/v1", "judge-model")


def test_no_llm_env_means_no_overrides():
    assert dep.llm_overrides_from_env({}) == []
    assert dep.llm_overrides_from_env({"NECTAR_GEN_MODEL": "x", "NECTAR_LLM_BASE_URL": ""}) == []


@pytest.mark.parametrize("uri,name", [
    ("/data/docs/Employee Handbook.txt", "doc-employee-handbook"),
    ("s3://bucket/manuals/router-v2.md", "doc-router-v2"),
    ("pydoc:naming", "doc-pydoc-naming"),
])
def test_document_deployment_names_come_from_the_uri(uri, name):
    assert dep.document_deployment_name(uri) == name


def test_pipeline_parameters_validate_the_config_at_deploy_time():
    assert dep.pipeline_parameters("tiny", overrides=["train.samples=10"], document="d.txt") == {
        "preset": "tiny", "config_file": None, "overrides": ["train.samples=10"], "document": "d.txt"}
    with pytest.raises(ConfigError, match="unknown preset 'gpu'"):
        dep.pipeline_parameters("gpu")
    with pytest.raises(ConfigError, match="train.sample"):
        dep.pipeline_parameters("tiny", overrides=["train.sample=10"])


def test_pull_step_moves_flow_runs_into_the_working_dir():
    assert dep.pull_steps("/data") == [
        {"prefect.deployments.steps.set_working_directory": {"directory": "/data"}}]
    assert dep.job_variables("/data", {"A": "1"}) == {"working_dir": "/data", "env": {"A": "1"}}


def test_server_commands_without_a_server_say_what_is_missing(no_server):
    with pytest.raises(dep.DeployError, match="PREFECT_API_URL is not set"):
        operations.trigger("doc.txt")
    with pytest.raises(dep.DeployError, match="PREFECT_API_URL is not set"):
        dep.ensure_work_pool("p")


def test_rerun_rejects_an_unknown_stage_before_calling_the_server():
    with pytest.raises(dep.DeployError, match="unknown stage 'trian'"):
        operations.rerun_stage("runs/x/y", "trian")


def app_with_ops() -> typer.Typer:
    from nectar.pipeline.cli import app

    return app


def test_the_nectar_app_has_the_ops_commands():
    result = CliRunner().invoke(app_with_ops(), ["--help"])
    assert result.exit_code == 0
    for name in ("deploy", "schedule", "trigger", "rerun", "retry", "run"):
        assert name in result.output


def test_cli_errors_are_clear_and_exit_nonzero(no_server):
    app, runner = app_with_ops(), CliRunner()
    out = runner.invoke(app, ["deploy", "--cron", "0 2 * * *"])
    assert out.exit_code == 2 and "--cron needs --document" in out.output
    out = runner.invoke(app, ["trigger", "doc.txt"])
    assert out.exit_code == 2 and "PREFECT_API_URL is not set" in out.output
    out = runner.invoke(app, ["deploy", "--preset", "nope"])
    assert out.exit_code == 2 and "unknown preset 'nope'" in out.output


def test_a_documents_own_deployment_runs_one_at_a_time():
    from prefect.client.schemas.objects import ConcurrencyLimitStrategy

    own = dep.pipeline_deployment("nectar", {"document": "/d/manual.txt", "preset": "tiny"}, "/wd", name="doc-manual")
    assert own.concurrency_limit == 1
    assert own.concurrency_options.collision_strategy == ConcurrencyLimitStrategy.ENQUEUE
    generic = dep.pipeline_deployment("nectar", {"preset": "tiny"}, "/wd")  # documents come per trigger
    assert generic.concurrency_limit is None  # ordered per document by the nectar-doc-<id> limit instead
