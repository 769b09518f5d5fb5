"""Fixtures for the server tests: run directories with a module trained on the ``tiny`` preset
(targets → train from a hand-written verified dataset, as tests/pipeline/test_orchestration_tail.py
does: seconds) — the lighthouse document, and a second document for the many-documents tests —, the
module loaded in-process, the server's registry of them, and real ``nectar serve`` processes on
localhost."""
from __future__ import annotations

from pathlib import Path

import pytest
from sample_document import DOC
from serve_procs import ServerProcess

QA = [("Who bought the island?", "Captain Ilse Brandt bought Varn Island."),
      ("What ran aground?", "The schooner Meridian ran aground on the northern reef."),
      ("What was the cargo?", "Salt cod and barrels of lamp oil."),
      ("How many sailors were saved?", "Seven sailors were rowed ashore."),
      ("When did the Meridian run aground?", "In the winter of 1871."),
      ("Who kept a ledger?", "The lighthouse keeper of Varn Island.")]


# The second document: another story, so its module and its n differ from the lighthouse one's.
DOC2 = ("The orchard at Kessel Farm was planted in 1902 by the brothers Anton and Emil Roth. They grafted "
        "forty pear trees onto quince stock and kept a record of every harvest in a green notebook. In the dry "
        "summer of 1911 the well failed, and the brothers carried water from the river for six weeks. The "
        "notebook says the pears that year were small but sweet, and that Emil sold them at the market in "
        "Lindau for twice the usual price.")


def build_served_run(root: Path, text: str = DOC, overrides: tuple[str, ...] = ()) -> str:
    from nectar import orchestration
    from nectar.orchestration.executor import run_stage
    from nectar.schemas import DatasetRow, load_config
    from nectar.tables import write_table

    doc = root / ("lighthouse.txt" if text == DOC else "orchard.txt")
    doc.write_text(text)
    ctx = orchestration.prepare_run(str(doc), load_config("tiny", overrides=["train.samples=200", *overrides]), str(root / "run"))
    orchestration.run_chunk(ctx)
    rows = [DatasetRow(pair_id=f"p{i}", chunk_id=0, task="qa", instruction=q, response=a, full_answer=a,
                       judge_raw="{}", is_consistent=True, confidence=0.9, reasoning="", verdict="consistent",
                       kept=True, split="train" if i < 4 else "test", challenge=i == 5)
            for i, (q, a) in enumerate(QA)]

    def body(url):
        write_table(f"{url}/dataset.parquet", rows, DatasetRow)
        return ["dataset.parquet"], {"kept": len(rows)}

    run_stage(ctx.run, "verify", {"hand": "written"}, {}, body)
    for stage in ("targets", "train"):
        assert orchestration.STAGE_RUNNERS[stage](ctx, False).status == "done", stage
    return ctx.run.root


@pytest.fixture(scope="session")
def served_run(tmp_path_factory) -> str:
    return build_served_run(tmp_path_factory.mktemp("served"))


@pytest.fixture(scope="session")
def second_run(tmp_path_factory) -> str:
    return build_served_run(tmp_path_factory.mktemp("served2"), DOC2)


# the cpu default's kind of module on the tiny model: a KVzip-fitted quadrature state stored at int4
INT4_QUADRATURE = ("train.module.arch=quadrature", "train.module.bits=4", "train.module.init=recon_fit",
                   "train.module.bias=true", "train.module.rho=0.05")


@pytest.fixture(scope="session")
def int4_run(tmp_path_factory) -> str:
    return build_served_run(tmp_path_factory.mktemp("served_int4"), overrides=INT4_QUADRATURE)


@pytest.fixture(scope="session")
def registry(served_run):
    from nectar.serving.loader import open_served_run
    from nectar.serving.registry import open_registry

    return open_registry([open_served_run(served_run)], None, 2_000_000_000)


@pytest.fixture(scope="session")
def served(served_run):
    from nectar.serving.loader import open_served_run
    from nectar.serving.loader import load_served_module

    return load_served_module(served_run)


@pytest.fixture(scope="module")
def server(served_run, tmp_path_factory):
    """One server for a test module, with small limits so the limit tests stay small."""
    srv = ServerProcess(served_run, tmp_path_factory.mktemp("server"), "--max-tokens", "256",
                        "--max-prompt-tokens", "200", "--max-body-bytes", "20000", "--max-batch", "8")
    yield srv
    srv.terminate()
