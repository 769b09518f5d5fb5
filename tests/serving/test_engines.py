"""`nectar serve --engine NAME` looks NAME up in ``nectar.serving.engines.ENGINES``: a toy engine added
under a new name is chosen (no vLLM, no model), an unknown name is refused in one line listing the
choices, and an engine's EngineError becomes one line and its exit code (docs/architecture.md,
"Adding a serving engine")."""
from __future__ import annotations

from typer.testing import CliRunner

from nectar.pipeline.cli import app
from nectar.serving import engines
from nectar.serving.engines import EngineError, EngineUsageError, ServeOptions, ServingEngine


class ToyEngine:
    name = "toy"
    help = "answers nothing; records what nectar serve handed it"

    def __init__(self, error: EngineError | None = None):
        self.calls: list[tuple[list[str], ServeOptions]] = []
        self.error = error

    def serve(self, run_dirs, opts, log) -> None:
        self.calls.append((run_dirs, opts))
        log(f"toy serving {len(run_dirs)} run(s) on {opts.host}:{opts.port}")
        if self.error is not None:
            raise self.error


def test_a_toy_engine_registered_under_a_new_name_is_chosen_by_engine(monkeypatch, tmp_path):
    toy = ToyEngine()
    assert isinstance(toy, ServingEngine)  # the protocol: name, help, serve
    monkeypatch.setitem(engines.ENGINES, "toy", toy)
    result = CliRunner().invoke(app, ["serve", str(tmp_path / "a"), str(tmp_path / "b"), "--engine", "toy",
                                      "--port", "0", "--max-batch", "3", "--served-name", "x", "--dtype", "float32"])
    assert result.exit_code == 0, result.output
    [(run_dirs, opts)] = toy.calls
    assert run_dirs == [str(tmp_path / "a"), str(tmp_path / "b")]
    assert (opts.port, opts.max_batch, opts.served_name, opts.dtype, opts.host) == (0, 3, ("x",), "float32", "127.0.0.1")
    assert "toy serving 2 run(s)" in result.output


def test_an_unknown_engine_is_refused_in_one_line_listing_the_choices(tmp_path):
    result = CliRunner().invoke(app, ["serve", str(tmp_path), "--engine", "nope"])
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert lines == ["error: --engine 'nope': choose torch or vllm"]


def test_an_engines_error_is_one_line_and_its_exit_code(monkeypatch, tmp_path):
    monkeypatch.setitem(engines.ENGINES, "toy", ToyEngine(EngineError("the toy cannot serve that")))
    result = CliRunner().invoke(app, ["serve", str(tmp_path), "--engine", "toy"])
    assert result.exit_code == 1 and result.output.splitlines()[-1] == "error: the toy cannot serve that"
    monkeypatch.setitem(engines.ENGINES, "toy", ToyEngine(EngineUsageError("--dtype: not for toys")))
    result = CliRunner().invoke(app, ["serve", str(tmp_path), "--engine", "toy"])
    assert result.exit_code == 2 and result.output.splitlines()[-1] == "error: --dtype: not for toys"


def test_the_registry_holds_the_two_engines_under_their_names():
    assert {name: e.name for name, e in engines.ENGINES.items()} == {"torch": "torch", "vllm": "vllm"}
    assert all(isinstance(e, ServingEngine) for e in engines.ENGINES.values())


def test_vllm_takes_one_served_name(tmp_path):
    result = CliRunner().invoke(app, ["serve", str(tmp_path), "--engine", "vllm", "--served-name", "a",
                                      "--served-name", "b"])
    assert result.exit_code == 2 and "serves every document under one model id" in result.output
