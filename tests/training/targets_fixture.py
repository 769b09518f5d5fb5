"""Building a real targets group for tests: the targets stage run on a (tiny) model over a short
document with hand-written QA pairs (train and test split)."""
import hashlib

from nectar.attention.doc_kv import prefill_document
from nectar.layout import build_layout
from nectar.schemas.artifacts import DatasetRow
from nectar.schemas.config import TargetsConfig
from nectar.stages.targets import build_targets

from sample_document import DOC  # noqa: F401 (re-exported for the training tests)

QA = [
    ("Who kept a ledger of passing ships?", "The lighthouse keeper of Varn Island."),
    ("What ran aground in 1871?", "The schooner Meridian ran aground on the northern reef."),
    ("How many sailors did the keeper save?", "Seven sailors."),
    ("What did the Meridian carry?", "Salt cod and barrels of lamp oil."),
    ("Who was the captain of the Meridian?", "Ilse Brandt."),
    ("What did Ilse Brandt buy later?", "She bought the island."),
    ("Where did the Meridian run aground?", "On the northern reef of Varn Island."),
    ("How often did the keeper row out?", "He rowed out twice."),
    ("In which season was the wreck?", "In the winter of 1871."),
    ("What does the ledger record?", "Every ship that passed, and the Meridian's cargo."),
    ("Quote the sentence about the cargo.", "The ledger records that the Meridian carried salt cod."),
    ("Summarize the story in one line.", "A keeper rescued a wrecked crew whose captain later bought the island."),
]


def dataset_rows(qa=QA, test_every=4):
    rows = []
    for i, (instr, resp) in enumerate(qa):
        rows.append(DatasetRow(
            pair_id=f"p{i:03d}", chunk_id=0, task="qa", instruction=instr, response=resp, full_answer=resp,
            judge_raw="", is_consistent=True, confidence=1.0, reasoning="", verdict="consistent", kept=True,
            split="test" if i % test_every == test_every - 1 else "train"))
    return rows


def make_targets(base, document, out_dir, top_k=8, **targets_cfg):
    layout = build_layout(base.tokenizer, document)
    kv = prefill_document(base, layout.context_ids)
    sha = hashlib.sha256(document.encode()).hexdigest()
    cfg = TargetsConfig(top_k=top_k, max_query_tokens=64, chunk_tokens=16, shard_tokens=64, batch_size=4,
                        **targets_cfg)
    build_targets(base, layout, kv, dataset_rows(), cfg, str(out_dir), sha)
    return layout, kv, sha
