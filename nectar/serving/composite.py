"""Composite model ids: ``docA+docB`` asks over several served documents at once.

Any served model ids joined by ``+`` name the composition of their modules (nectar/attention/compose.py:
the merge of their attention states, each document at its offset in the order given, the question after
their sum). Nothing is loaded or trained for it: the parts are the registry's providers, loaded on first
use as for a single id, and one composed provider is kept per id while its parts stay loaded. The query
part of the prompt layout is the same for every document of one tokenizer, so the first part's layout
renders the conversation.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

from ..attention.compose import compose, composed_layout, shared_prefix
from ..attention.doc_kv import prefill_document
from ..attention.exact import ExactDocState
from ..layout import PromptLayout
from .limits import GenerationDefaults
from .registry import ModuleRegistry, ServedDocument

JOIN = "+"
# The concatenated documents' positions, and the shared chat-template prefix held once (its exact KV,
# prefilled from the model): together exact for exact KVs (tests/attention/test_compose.py), i.e. the
# concatenation's context minus the later document attending to the earlier. Which layout keeps most
# with fitted states is what `nectar compare RUN_A RUN_B` measures: this one, on two pairs of documents
# (docs/quality.md, "Several documents at once").
POSITIONS = "concat"
PREFIX_ONCE = True
HOW_TO_COMPOSE = (f"join served model ids with '{JOIN}' (e.g. 'a{JOIN}b') to ask over several documents at once: "
                  "their states are composed (the documents back to back in that order)")


class UnknownPart(KeyError):
    """A part of a composite id that is not served here."""


@dataclass(frozen=True)
class CompositeDocument:
    """What a composite id stands for: its parts in order, the question's position after their sum."""

    name: str
    parts: tuple[ServedDocument, ...]
    n_context: int
    positions: str = POSITIONS

    @property
    def layout(self) -> PromptLayout:
        return self.parts[0].layout

    @property
    def defaults(self) -> GenerationDefaults:
        return self.parts[0].defaults

    def card(self) -> dict:
        """The model card's ``nectar`` facts: the parts and the bytes of all their states."""
        return {"composite": True, "parts": [p.name for p in self.parts], "positions": self.positions,
                "n_context": self.n_context, "module_bytes": sum(p.spec.module_bytes for p in self.parts),
                "kv_cache_bytes": sum(p.spec.kv_cache_bytes for p in self.parts)}


def is_composite(model_id: str) -> bool:
    return JOIN in model_id


def resolve(registry: ModuleRegistry, model_id: str) -> CompositeDocument:
    """The composition a ``+``-joined id names (UnknownPart names the first part not served)."""
    names = [n.strip() for n in model_id.split(JOIN)]
    for n in names:
        if n not in registry.documents:
            raise UnknownPart(n)
    parts = tuple(registry.documents[n] for n in names)
    return CompositeDocument(model_id, parts, composed_layout([p.n_context for p in parts], POSITIONS).n)


def composed_provider(base, parts: list, docs: list, positions: str = POSITIONS, prefix_once: bool = PREFIX_ONCE,
                      prefixes: dict | None = None):
    """The composition of ``parts`` (providers of the served ``docs``, in order) and the question's
    position: what a composite id and ``nectar ask RUN_A RUN_B`` decode with. ``prefixes``: a cache of
    the shared prefix's exact state by its token ids (one per tokenizer, a few dozen tokens)."""
    prefix = None
    if prefix_once and len(docs) > 1:
        ids = tuple(shared_prefix([d.layout.context_ids for d in docs]))
        cache = {} if prefixes is None else prefixes
        if ids and ids not in cache:
            cache[ids] = ExactDocState(prefill_document(base, ids))
        prefix = cache.get(ids)
    return compose(parts, [d.n_context for d in docs], positions, base.model, prefix=prefix)


class CompositeProviders:
    """One composed provider per composite id, rebuilt when one of its parts was reloaded (the LRU
    dropped it): a decoding row keeps the providers it was given alive, as for a single id."""

    def __init__(self, registry: ModuleRegistry):
        self.registry = registry
        self._built: dict[str, tuple[tuple[int, ...], object]] = {}
        self._prefixes: dict = {}
        self._lock = threading.Lock()

    def provider(self, doc: CompositeDocument):
        parts = [self.registry.provider(p.name) for p in doc.parts]  # loads what is not loaded
        key = tuple(id(p) for p in parts)
        with self._lock:
            built = self._built.get(doc.name)
            if built is None or built[0] != key:
                provider, _ = composed_provider(self.registry.base, parts, list(doc.parts), doc.positions,
                                                prefixes=self._prefixes)
                self._built[doc.name] = built = (key, provider)
            return built[1]
