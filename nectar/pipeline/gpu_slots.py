"""One GPU, many runs: a Prefect global concurrency limit around the GPU stages (and one per
document around pipeline runs, ``doc_slot``).

A pipeline run executes its stages as subflows inside ONE flow-run process, so work-pool or
work-queue limits (which count whole flow runs) cannot stop two documents' ``train`` stages from
sharing a GPU. A global concurrency limit can: ``nectar deploy`` creates ``nectar-gpu`` with one
slot per GPU, and each GPU stage body runs inside ``gpu_slot(stage)``; a second run's GPU stage
waits (its flow run shows as Running, its logs say it is waiting) until the slot is free.

Without a Prefect server (ephemeral mode, ``PREFECT_API_URL`` unset) there is nobody to coordinate
with, so the slot is a no-op; with a server but no limit created, Prefect logs a warning and skips.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator

GPU_LIMIT = "nectar-gpu"
# A slot's lease: the holder renews it while alive; a dead host's slot is freed this long after its
# last renewal (Prefect's default 300 s, its minimum 60 s). NECTAR_SLOT_LEASE_S shortens it.
SLOT_LEASE_S = max(60.0, float(os.environ.get("NECTAR_SLOT_LEASE_S", "300")))
GPU_STAGES: tuple[str, ...] = ("first", "targets", "train", "promote", "evaluate")


def uses_gpu(stage: str) -> bool:
    return stage in GPU_STAGES


def server_configured() -> bool:
    from prefect.settings import PREFECT_API_URL

    return bool(PREFECT_API_URL.value() or os.environ.get("PREFECT_API_URL"))


@contextmanager
def gpu_slot(stage: str, limit_name: str = GPU_LIMIT, timeout_s: float | None = None) -> Iterator[bool]:
    """Hold one slot of ``limit_name`` while a GPU stage runs. Yields whether a slot was taken."""
    if not uses_gpu(stage) or not server_configured():
        yield False
        return
    from prefect.concurrency.sync import concurrency

    # strict=False: a server without the limit (deploy not run yet) still runs the stage.
    with concurrency(limit_name, occupy=1, timeout_seconds=timeout_s, lease_duration=SLOT_LEASE_S, strict=False):
        yield True


# ----- one pipeline run per document at a time (on a server) ------------------------------------------

DOC_LIMIT_PREFIX = "nectar-doc-"


def doc_limit_name(doc_id: str) -> str:
    return f"{DOC_LIMIT_PREFIX}{doc_id}"[:100]


@contextmanager
def doc_slot(doc_id: str, timeout_s: float | None = None) -> Iterator[bool]:
    """Hold the document's one-slot global concurrency limit (``nectar-doc-<doc-id>``, created on
    first use) while a pipeline run for it is in progress: a schedule firing while the last run of
    the same document is still going waits for it instead of racing it (the run-directory lock
    stops two writers of one run directory; this also orders runs of one document in several
    directories). Without a server it is a no-op; the run-directory lock still applies."""
    if not server_configured():
        yield False
        return
    from prefect.client.orchestration import get_client
    from prefect.concurrency.sync import concurrency
    from prefect.exceptions import ObjectAlreadyExists

    name = doc_limit_name(doc_id)
    with get_client(sync_client=True) as client:
        try:
            client.read_global_concurrency_limit_by_name(name)
        except Exception:  # ObjectNotFound: the first run of this document
            try:
                client.upsert_global_concurrency_limit_by_name(name, 1)
            except ObjectAlreadyExists:
                pass  # another process's first run of it created the limit between our read and write
    with concurrency(name, occupy=1, timeout_seconds=timeout_s, lease_duration=SLOT_LEASE_S, strict=False):
        yield True
