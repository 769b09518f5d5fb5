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
    checks, lock and stage runners; errors are caught and classified as the CLI does."""
    out = Outcome()
    try:
        cfg = tiny_config(*overrides)
        plan = orchestration.plan_stages(from_stage, only, False)
        checked = orchestration.check_request(document, cfg, run_dir, only)
        if only:
            orchestration.check_inputs_done(checked.run, only, checked.info.source_uri)
        with orchestration.run_lock(checked.run.root, wait=False, notify=out.notices.append):
            ctx = (orchestration.open_run(checked.run.root) if checked.reopen
                   else orchestration.prepare_run(document, cfg, checked=checked))
            ctx.notify = out.notices.append
            for stage, force in plan:
                if stage in stages:
                    out.statuses[stage] = orchestration.STAGE_RUNNERS[stage](ctx, force).status
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
