"""One document through the stages: the orchestration core that ``nectar run``, the Prefect flows,
sweeps and the reliability tests call (``compare`` runs its stages through the same ``RunOne``).

    request = plan_document(document, config, run_dir, from_stage, only_stage, force)  # checks; writes nothing
    with open_document(request, config, notify=…) as ctx:     # the lock, then run.json (or reopen)
        for stage, force in request.plan:                      # one vLLM server shared by the loop
            run_one(ctx, stage, force)                         # cache check → body → manifest

``run_one(ctx, stage, force)`` runs one stage. ``run_here`` calls its runner in this process
(``STAGE_RUNNERS``: inputs from the upstream manifests, then ``executor.run_stage``); the Prefect
flows pass one that runs it as the ``nectar-stage`` subflow, so the dashboard shows one entry per
stage. No Prefect import here.
"""
from __future__ import annotations

from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

from ..schemas.config import STAGES, PipelineConfig
from .context import CheckedRun, RunContext, check_request, open_run, prepare_run
from .executor import RunDir, StageOutcome
from .lock import run_lock
from .runners import STAGE_RUNNERS, check_inputs_done, llm_scope, plan_stages

RunOne = Callable[[RunContext, str, bool], Any]  # (run, stage, force) → what running it returned
Slot = Callable[[str], AbstractContextManager]  # doc_id → a scope held while the run's stages run


def run_here(ctx: RunContext, stage: str, force: bool = False) -> StageOutcome:
    """Run ``stage`` of ``ctx`` in this process (a cache hit when it is complete and current)."""
    return STAGE_RUNNERS[stage](ctx, force)


def _no_slot(doc_id: str) -> AbstractContextManager:
    return nullcontext()


@dataclass(frozen=True)
class DocumentRequest:
    """A run asked for and checked: the stages to run (with their force flags) and the run directory."""

    document: str
    checked: CheckedRun
    plan: list[tuple[str, bool]]

    @property
    def run(self) -> RunDir:
        return self.checked.run


@dataclass
class DocumentRun:
    ctx: RunContext
    results: dict[str, Any]  # stage → what run_one returned


def plan_document(document: str | None, config: PipelineConfig, run_dir: str | None = None,
                  from_stage: str | None = None, only_stage: str | None = None,
                  force: bool = False) -> DocumentRequest:
    """Everything a user can get wrong, checked before anything is written or started: the stages
    asked for, the document and the run directory, and (``--only``) that the stage's inputs exist."""
    plan = plan_stages(from_stage, only_stage, force)
    checked = check_request(document, config, run_dir, only_stage)
    if only_stage:
        check_inputs_done(checked.run, only_stage, checked.info.source_uri)
    return DocumentRequest(document or checked.info.source_uri, checked, plan)


@contextmanager
def open_document(request: DocumentRequest, config: PipelineConfig, *, notify: Callable[[str], None] | None = None,
                  wait: bool = True, slot: Slot = _no_slot) -> Iterator[RunContext]:
    """Hold the run directory's lock (one writer; ``wait=False``: RunLocked at once) and then the
    document's slot — always in this order, so no lock cycle — and create the run directory (run.json,
    the document), or reopen it for ``--only`` on an existing run."""
    with run_lock(request.run.root, wait=wait, notify=notify), slot(request.checked.info.doc_id):
        if request.checked.reopen:
            ctx = open_run(request.run.root)
        else:
            ctx = prepare_run(request.document, config, checked=request.checked)
        if notify is not None:
            ctx.notify = notify
        yield ctx


def run_document(document: str | None, config: PipelineConfig, run_dir: str | None = None, *,
                 from_stage: str | None = None, only_stage: str | None = None, force: bool = False,
                 stages: Sequence[str] = STAGES, run_one: RunOne = run_here,
                 notify: Callable[[str], None] | None = None, wait: bool = True, slot: Slot = _no_slot) -> DocumentRun:
    """chunk → first → synthesize → verify → targets → train → promote → evaluate (of the live state)
    for one document (those of them in ``stages``), each through its cache; the outputs and manifests
    land in the run directory."""
    request = plan_document(document, config, run_dir, from_stage, only_stage, force)
    results: dict[str, Any] = {}
    with open_document(request, config, notify=notify, wait=wait, slot=slot) as ctx, llm_scope(ctx):
        for stage, stage_force in request.plan:
            if stage in stages:
                results[stage] = run_one(ctx, stage, stage_force)
    return DocumentRun(ctx, results)
