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
    assert result.exit_code == 1 and "no trained module" in result.output


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
