"""`nectar serve` refuses bad input in one line, before or instead of loading anything."""
import re
import socket

from typer.testing import CliRunner

from nectar.pipeline.cli import app


def test_a_run_without_a_module_is_refused(tmp_path, document):
    from nectar.orchestration import prepare_run
    from nectar.schemas.presets import load_config

    doc = tmp_path / "doc.txt"
    doc.write_text(document)
    ctx = prepare_run(str(doc), load_config("tiny"), str(tmp_path / "run"))
    result = CliRunner().invoke(app, ["serve", ctx.run.root, "--port", "0"])
    assert result.exit_code == 1 and "no state to answer with yet" in result.output


def test_bad_limits_and_a_busy_port_are_refused(tmp_path):
    result = CliRunner().invoke(app, ["serve", str(tmp_path), "--max-batch", "0"])
    assert result.exit_code == 2 and "--max-batch" in result.output
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = CliRunner().invoke(app, ["serve", str(tmp_path), "--port", str(port)])
    assert result.exit_code == 1 and f"cannot listen on 127.0.0.1:{port}" in result.output


def test_every_limit_has_its_flag():
    """Error messages name `nectar serve --<flag>`: each ServeLimits field must be a CLI option."""
    from nectar.serving.limits import ServeLimits

    help_text = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "200"}).output
    for field in ServeLimits.model_fields:
        flag = "--" + field.removesuffix("_s").replace("_", "-")
        assert re.search(rf"{flag}(?![\w-])", help_text), flag


def test_a_non_loopback_address_without_a_key_is_refused_before_anything_loads(tmp_path, monkeypatch):
    monkeypatch.delenv("NECTAR_API_KEY", raising=False)
    result = CliRunner().invoke(app, ["serve", str(tmp_path), "--host", "0.0.0.0", "--port", "0"])
    assert result.exit_code == 1
    assert "--host 0.0.0.0 exposes the modules" in result.output and "--allow-unauthenticated" in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_api_keys_come_from_the_flag_and_the_environment(monkeypatch):
    from nectar.serving.runner import api_keys

    monkeypatch.setenv("NECTAR_API_KEY", "k2, k3,,")
    assert api_keys(["k1", "k2"]) == ("k1", "k2", "k3")


def test_a_run_on_another_base_model_is_refused_at_start(served_run, tmp_path, document):
    """The second run's config names tiny:qwen2 (its module is the first run's, copied: the base
    model check comes before any module is read)."""
    import shutil

    from nectar.orchestration import prepare_run
    from nectar.schemas.presets import load_config

    doc = tmp_path / "doc.txt"
    doc.write_text(document)
    ctx = prepare_run(str(doc), load_config("tiny", overrides=["model.name=tiny:qwen2"]), str(tmp_path / "qwen"))
    shutil.copytree(f"{served_run}/train", f"{ctx.run.root}/train")
    result = CliRunner().invoke(app, ["serve", served_run, ctx.run.root, "--port", "0"])
    assert result.exit_code == 1, result.output
    assert "base model 'tiny:qwen2'" in result.output and "differs from 'tiny:llama'" in result.output
    assert len(result.output.strip().splitlines()) == 1
