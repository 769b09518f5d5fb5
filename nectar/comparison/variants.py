"""Variant run directories: a child run ``RUN/sweep/<name>/`` that trains other settings on its parent's
data stages. ``nectar sweep`` makes one per grid point; ``nectar compare`` one per trained system and
budget, reusing any variant that already trained the same settings.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..orchestration.context import RunContext, StageInputError, open_run
from ..orchestration.executor import CODE_VERSION, RunDir, now
from ..schemas.artifacts import RunManifest
from ..schemas.config import PipelineConfig
from ..storage import atomic_write
from ..tables import ArtifactError, read_json_artifact, write_json_artifact


def _same_training(a: PipelineConfig, b: PipelineConfig) -> bool:
    return a.train == b.train and a.model == b.model


def variant_for(parent: RunContext, name: str, config: PipelineConfig) -> RunContext:
    """The run directory whose train stage trains ``config``: the parent itself, an existing variant
    with the same training settings, or a new variant directory (sharing the parent's data stages)."""
    if _same_training(parent.config, config):
        return parent
    fs = parent.run.fs
    for path in sorted(fs.glob(parent.run.local_path("sweep", "*", "run.json"))):
        root = parent.run.url("sweep", path.rstrip("/").split("/")[-2])
        try:
            manifest = read_json_artifact(RunDir(root).url("run.json"), RunManifest)
            if _same_training(PipelineConfig.model_validate(manifest.config), config):
                return open_run(root, parent.progress)
        except (ArtifactError, ValueError, StageInputError):
            continue  # an unreadable or foreign variant: not reused
    return prepare_variant(parent, Variant(name, {}, config))


@dataclass(frozen=True)
class Variant:
    name: str
    settings: dict[str, Any]  # grid key → value
    config: PipelineConfig


def variant_context(parent: RunContext, variant: Variant) -> RunContext:
    """The parent run itself for a variant whose config is the parent's (its train/evaluate stages
    are then cached from ``nectar run``), otherwise a child run directory."""
    if variant.config == parent.config:
        return parent
    return prepare_variant(parent, variant)


def prepare_variant(parent: RunContext, variant: Variant) -> RunContext:
    """A child run directory whose data stages resolve to the parent's."""
    run = RunDir(parent.run.url("sweep", variant.name))
    write_json_artifact(run.url("run.json"), RunManifest(
        doc_id=parent.doc_id, run_id=variant.name, source_uri=parent.info.source_uri,
        config=variant.config.model_dump(mode="json"), code_version=parent_code_version(),
        created_at=now(), parent_run=parent.run.root))
    atomic_write(run.url("document", "document.txt"), parent.text)
    write_json_artifact(run.url("document", "info.json"), parent.info)
    return RunContext(run, variant.config, parent.text, parent.info, parent.progress, parent.run)


def parent_code_version() -> str:
    return CODE_VERSION
