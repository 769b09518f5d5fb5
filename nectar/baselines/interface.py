"""What a closed-form baseline is: one small interface every method implements.

A baseline turns the document's exact KV (and the captured targets, or the model reading the
document) into a quadrature state (``nectar.modules.quadrature``: stored (key, value) pairs per
(layer, KV head), optionally with a log-mass bias β) in the bytes of a NECTAR module of the same
budget ρ. Three things define one:

  plan   how its state is laid out in the bytes of the module plan, at a storage precision:
         ``Baseline.plan(module_plan, bits) -> ModulePlan`` (arch "quadrature", pairs per layer)
  fit    how the state's pairs are chosen and fitted: ``Baseline.fit(module_plan, FitInputs)``
  size   the bytes it stores: ``FittedBaseline.nbytes`` (every stored tensor, as for a module)

One file per method (truncate.py, evict.py, attention_matching.py, attention_matching_kv.py,
kvzip_baseline.py); registry.py lists them.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..attention.state import AttnState
from ..base_model import BaseLM
from ..layout import PromptLayout
from ..modules.builder import ModulePlan, NectarModule
from ..modules.provider import ModuleDocState
from ..modules.stored import stored_nbytes
from ..schemas.config import SelectionConfig
from .selection import KeyScore


@dataclass(frozen=True)
class FitInputs:
    """What a baseline may fit from. Every method reads ``doc_kv``; the rest as it needs."""

    doc_kv: Any  # the document's exact KV (DocKV): keys/values [Hkv, n, d] per layer
    targets: Any = None  # the targets stage's URL or an open TargetsData (training queries' q, α, A)
    seed: int = 0  # the sample of training query tokens
    bits: int | None = None  # storage precision of the kept entries (None: the module plan's)
    score: KeyScore = "mean"  # how a key's attention mass is aggregated over the queries (evict, AM)
    max_tokens: int | None = None  # training query tokens fitted on (None: MAX_FIT_TOKENS)
    # methods that read the document with the model (``Baseline.reads_document``):
    base: BaseLM | None = None
    layout: PromptLayout | None = None
    document: str | None = None
    spans: tuple[tuple[str, str], ...] = ()  # (instruction, response) reconstruction spans
    select: SelectionConfig | None = None


@dataclass
class FittedBaseline:
    """A fitted baseline: callable as a document-state provider, with the bytes it stores."""

    name: str
    module: NectarModule
    plan: ModulePlan
    scores: torch.Tensor | None = None  # [L, Hkv, n]: what a selection ranked (the report's heat map)

    def __post_init__(self) -> None:
        self._provider = ModuleDocState(self.module)

    def __call__(self, layer: int, q: torch.Tensor, scaling: float) -> AttnState:
        return self._provider(layer, q, scaling)

    @property
    def nbytes(self) -> int:
        """Bytes as stored (codes, fp16 scales and zeros at bits < 32; β and buffers included; with
        heads of different widths only their real pairs)."""
        return stored_nbytes(self.module, self.plan)


class Baseline(ABC):
    """One closed-form method: its state's plan in a module plan's bytes, and its fit."""

    name: ClassVar[str]  # the registry's key and ``System.baseline``
    reads_document: ClassVar[bool] = False  # True: fit runs the model over the document (FitInputs.base …)

    @abstractmethod
    def plan(self, plan: ModulePlan, bits: int | None = None) -> ModulePlan:
        """The quadrature plan of this method's state in the bytes of ``plan`` (any arch, same ρ),
        its pairs stored at ``bits`` (None: the plan's)."""

    @abstractmethod
    def fit(self, plan: ModulePlan, inputs: FitInputs) -> FittedBaseline:
        """The fitted state in the bytes of the module plan ``plan``."""
