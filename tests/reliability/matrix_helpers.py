"""Driving runs for the fault matrix: the orchestration the Prefect flows call (stages in order,
under the run-directory lock) and the CLI in-process; what a user sees is the CLI's own mapping of
an exception to one line and an exit code (nectar/pipeline/errors.py)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from nectar import orchestration
from nectar.pipeline.errors import classify
from nectar.orchestration.executor import RunDir
from nectar.schemas.config import STAGES
from nectar.schemas.presets import load_config

DOCUMENT = "pydoc:naming"


def tiny_config(*overrides: str):
    return load_config("tiny", None, None, list(overrides))


@dataclass
class Outcome:
    statuses: dict[str, str] = field(default_factory=dict)  # stage -> done / cached
    notices: list[str] = field(default_factory=list)
    error: BaseException | None = None

    @property
    def user_line(self) -> str | None:
        return None if self.error is None else classify(self.error)[0]

    @property
    def exit_code(self) -> int:
        return 0 if self.error is None else classify(self.error)[1]


def run_pipeline(run_dir: str, *overrides: str, document: str = DOCUMENT, only: str | None = None,
                 from_stage: str | None = None, stages=STAGES) -> Outcome:
    """What ``nectar run DOC --preset tiny --run-dir RUN [--set …]`` does, without Prefect: the same
    orchestration core with each stage run in this process; errors are caught and classified as the
    CLI does."""
    out = Outcome()

    def run_one(ctx, stage: str, force: bool):  # each stage's status as it ends (kept when a later one fails)
        out.statuses[stage] = orchestration.run_here(ctx, stage, force).status

    try:
        orchestration.run_document(document, tiny_config(*overrides), run_dir, from_stage=from_stage, only_stage=only,
                                   stages=stages, run_one=run_one, notify=out.notices.append, wait=False)
    except Exception as exc:  # noqa: BLE001 - the row records what the user would see
        out.error = exc
    return out


def build_complete_run(run_dir: str, *overrides: str) -> None:
    out = run_pipeline(run_dir, *overrides)
    if out.error is not None:
        raise out.error
    assert set(out.statuses.values()) <= {"done", "cached"}


def manifests(run_dir: str) -> dict[str, Any]:
    run = RunDir(run_dir)
    return {s: run.read_manifest(s) for s in STAGES}


def outputs(run_dir: str) -> dict[str, dict[str, str]]:
    """Each stage's output digests (what downstream keys and the 'same artifacts' checks use)."""
    return {s: (m.outputs if m else None) for s, m in manifests(run_dir).items()}


def cli(args: list[str], env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """The real ``nectar`` command in this process (bad inputs fail before Prefect starts)."""
    from typer.testing import CliRunner

    from nectar.pipeline.cli import app

    result = CliRunner().invoke(app, args, env=env)
    return result.exit_code, result.stdout, result.stderr


Damage = Callable[[str], None]
