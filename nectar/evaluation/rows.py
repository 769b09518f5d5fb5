"""Row schemas of the evaluation tables not (yet) in nectar/schemas/artifacts.py.

per_layer.parquet (PerLayerRow) and benchmark.parquet (BenchmarkRow); kept here, additive, until
the lead moves them beside the other artifact schemas.
"""
from __future__ import annotations

from typing import Literal

from ..schemas.base import Artifact

BenchSystem = Literal["module", "full_cached", "full_cold"]


class PerLayerRow(Artifact):
    """App. C diagnostics of the module for one (split, layer, query head), over cached queries."""

    schema_version: int = 1
    split: str
    layer: int
    q_head: int
    kv_head: int
    mse_alpha: float  # E_q (a_θ(q) − α(q))²
    mse_A: float  # E_q ‖A_θ(q) − A(q)‖² (the paper's L_A for this head)
    rte_alpha: float  # E_q log((a_θ − α)² / α²)
    rte_A: float  # E_q log(‖A_θ − A‖² / ‖q − A‖²)   (App. C eq. rte)
    n_tokens: int


class BenchmarkRow(Artifact):
    """One generation-benchmark measurement (paper App. F): one system at one document length."""

    schema_version: int = 1
    n_context: int
    system: BenchSystem  # module | full KV cache already computed | full KV cache prefilled first
    ttft_s: float  # time to first token (cold: includes the document prefill)
    decode_tok_s: float
    peak_memory_bytes: int
    memory_method: str
    state_bytes: int  # bytes standing in for the document: module parameters or the KV cache
    prompt_tokens: int
    new_tokens: int
    repeats: int
    device: str
    note: str = ""  # e.g. "random-init module of the same architecture (timing only)"
