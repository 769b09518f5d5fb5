"""What a document-state method is: one small interface every method implements.

A state method turns the document's exact KV (and, as it declares, the captured training queries or
the model reading the document) into a quadrature state (``nectar.modules.quadrature``: stored (key,
value) pairs per (layer, KV head), optionally with a log-mass bias β) in the bytes of a NECTAR module
of the same budget ρ. One method is one ``@dataclass(frozen=True)`` in one file: its fields are its
settings, its class says what it reads, and it holds its whole algorithm:

  reads  what its fit reads (``StateMethod.reads``): ``doc_kv`` (always), ``train_queries`` (the
         targets' captured train split: q, α, A), ``document`` (the model reads the document:
         FitInputs.base, layout, document, spans)
  plan   how its state is laid out in the bytes of the module plan, at a storage precision:
         ``StateMethod.plan(module_plan, bits) -> ModulePlan`` (arch "quadrature", pairs per layer)
  fit    how the state's pairs are chosen and fitted: ``StateMethod.fit(module_plan, FitInputs)``
  init   (optional) the same fit as the start of a trained module (``train.module.init``: the
         ``matching`` regime trains on from one): ``StateMethod.init(plan, module, FitInputs)``
  size   the bytes it stores: ``FittedState.nbytes`` (every stored tensor, as for a module)

registry.py lists the methods by name (docs/architecture.md, "Adding a state method").
"""
from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch

from ..attention.state import AttnState
from ..base_model import BaseLM
from ..layout import PromptLayout
from ..modules.builder import ModulePlan, NectarModule
from ..modules.provider import ModuleDocState
from ..modules.stored import stored_nbytes
from ..schemas.config import ModuleConfig

Reads = Literal["doc_kv", "train_queries", "document"]


@dataclass(frozen=True)
class FitInputs:
    """What a method may fit from. Every method reads ``doc_kv``; the rest as its ``reads`` says."""

    doc_kv: Any  # the document's exact KV (DocKV): keys/values [Hkv, n, d] per layer
    targets: Any = None  # train_queries: the targets stage's URL or an open TargetsData (q, α, A)
    seed: int = 0  # the sample of training query tokens
    bits: int | None = None  # storage precision of the kept entries (None: the module plan's)
    max_tokens: int | None = None  # training query tokens fitted on (None: MAX_FIT_TOKENS)
    # document: methods that read the document with the model
    base: BaseLM | None = None
    layout: PromptLayout | None = None
    document: str | None = None
    spans: tuple[tuple[str, str], ...] = ()  # (instruction, response) reconstruction spans


@dataclass
class FittedState:
    """A fitted state: callable as a document-state provider, with the bytes it stores."""

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


class StateMethod(ABC):
    """One document-state method: its settings (dataclass fields), what it reads, its state's plan in
    a module plan's bytes, and its fit. Subclasses are ``@dataclass(frozen=True)``."""

    name: ClassVar[str]  # the registry's key, ``System.method`` and (if it can start training) ``module.init``
    READS: ClassVar[frozenset[str]] = frozenset({"doc_kv"})  # what its fit reads (see ``reads``)

    @property
    def reads(self) -> frozenset[str]:
        """What this instance's fit reads (its settings may leave out a part its class can read)."""
        return self.READS

    @property
    def reads_document(self) -> bool:
        return "document" in self.reads

    @property
    def reads_train_queries(self) -> bool:
        return "train_queries" in self.reads

    def configured(self, module: ModuleConfig) -> "StateMethod":
        """This method with the run's settings for it (``train.module``); most methods have none there."""
        return self

    def with_options(self, **options: Any) -> "StateMethod":
        """This method with some settings changed (a compare system's switches)."""
        return dataclasses.replace(self, **options) if options else self

    @abstractmethod
    def plan(self, plan: ModulePlan, bits: int | None = None) -> ModulePlan:
        """The quadrature plan of this method's state in the bytes of ``plan`` (any arch, same ρ),
        its pairs stored at ``bits`` (None: the plan's)."""

    @abstractmethod
    def fit(self, plan: ModulePlan, inputs: FitInputs) -> FittedState:
        """The fitted state in the bytes of the module plan ``plan``."""

    def init(self, plan: ModulePlan, module: NectarModule, inputs: FitInputs) -> tuple[ModulePlan, NectarModule]:
        """The start of a trained quadrature module of ``plan`` (``train.module.init``): its plan and module."""
        raise ValueError(f"state method {self.name!r} cannot start a trained module")
