"""A run whose LLM stages are replaced by a verified dataset written by hand: the short test document,
chunked, with these QA pairs as the verify stage's output (the LLM stages have their own tests and the
end-to-end CLI test). Shared by the tests that need a run with targets (tests/ is on sys.path)."""
from __future__ import annotations

from nectar import orchestration
from nectar.orchestration.executor import run_stage
from nectar.schemas import DatasetRow, load_config
from nectar.tables import write_table

from sample_document import DOC

QA = [("Who bought the island?", "Captain Ilse Brandt bought Varn Island."),
      ("What ran aground?", "The schooner Meridian ran aground on the northern reef."),
      ("What was the cargo?", "Salt cod and barrels of lamp oil."),
      ("How many sailors were saved?", "Seven sailors were rowed ashore."),
      ("When did the Meridian run aground?", "In the winter of 1871."),
      ("Who kept a ledger?", "The lighthouse keeper of Varn Island."),
      ("Where is the reef?", "North of Varn Island."),
      ("What did the keeper do?", "He rowed out twice to rescue the sailors."),
      ("What did the captain buy?", "The whole of Varn Island."),
      ("What did the keeper write down?", "Every ship that passed the island.")]


def write_verified(ctx, qa=QA, n_train: int = 6, challenge=()) -> None:
    """The verify stage's dataset: ``qa``, the first ``n_train`` pairs train and the rest test, the
    indices in ``challenge`` marked as challenge questions."""
    rows = [DatasetRow(pair_id=f"p{i}", chunk_id=0, task="qa", instruction=q, response=a, full_answer=a,
                       judge_raw="{}", is_consistent=True, confidence=0.9, reasoning="", verdict="consistent",
                       kept=True, split="train" if i < n_train else "test", challenge=i in challenge)
            for i, (q, a) in enumerate(qa)]

    def body(url):
        write_table(f"{url}/dataset.parquet", rows, DatasetRow)
        return ["dataset.parquet"], {"kept": len(rows)}

    run_stage(ctx.run, "verify", {"hand": "written"}, {}, body)


def run_with_targets(root, preset: str, overrides: list[str], **verified):
    """A run of DOC under ``root`` (the ``preset`` with ``overrides``): chunked, the hand-written
    dataset (``write_verified``'s settings), and its targets stage run. Returns its RunContext."""
    (root / "doc.txt").write_text(DOC)
    ctx = orchestration.prepare_run(str(root / "doc.txt"), load_config(preset, overrides=overrides),
                                    str(root / "run"))
    orchestration.run_chunk(ctx)
    write_verified(ctx, **verified)
    orchestration.run_targets(ctx)
    return ctx
