"""The train stage: a NECTAR module from the cached targets (pure function, no Prefect).

    train(targets_url, cfg, base, doc_kv, out_url)  →  out_url/module.safetensors
                                                       out_url/module.json         (ModuleSpec)
                                                       out_url/train_log.parquet   (TrainLogRow)
                                                       out_url/checkpoints/last.pt (resume state)

A killed run resumes from its last checkpoint when called again with the same inputs. Under
``torchrun`` every process calls ``train`` and they train data-parallel; rank 0 writes the files.
"""
from __future__ import annotations

from typing import Callable

from ..base_model import BaseLM
from ..schemas.config import TrainConfig
from ..training.fit import fit

TRAIN_OUTPUTS = ["module.safetensors", "module.json", "train_log.parquet"]


def train(
    targets_url: str,
    cfg: TrainConfig,
    base: BaseLM,
    doc_kv,  # nectar.attention.doc_kv.DocKV | None (needed by quadrature modules and online targets)
    out_url: str,
    progress: Callable[[int, int], None] | None = None,
    stop_after: int | None = None,  # stop (as if killed) after this many steps; for tests
    document: str | None = None,  # init recon_fit: the document text …
    spans: list[tuple[str, str]] | None = None,  # … and its reconstruction spans (nectar/queries/recon.py)
) -> dict:
    """Train, write the module, spec and log into ``out_url``; return the stage counts."""
    return fit(targets_url, cfg, base, doc_kv, out_url, progress, stop_after, document, spans)[1]
