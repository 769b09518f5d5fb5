"""The documents one server serves: many runs' modules over ONE base model.

A module is MBs where the document's KV cache is tens of MBs to GBs, so one process holds the base
model once and any number of documents. At start every run is opened (config, document, module
spec, prompt layout: no weights) and checked to use the same base model as the first one; a
module's weights are loaded the first time a request asks for its model id, and the loaded modules
are kept under a byte bound, least recently used dropped first. The bytes charged are what the
loaded module holds (``FusedModule.resident_bytes``): for a quantized module its codes AND the float
weights dequantized once at load (``keep_dequantized``, the default: no per-step dequantization), or
its codes alone (``keep_dequantized=False``: each decode step dequantizes). A row that is decoding
keeps its module alive until it ends, so the bound can be passed by the modules of rows in flight.
"""
from __future__ import annotations

import dataclasses
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from ..layout import PromptLayout, build_layout
from ..base_model import BaseLM, load_base_model
from ..modules.io import ModuleMismatch, load_module, read_spec
from ..modules.provider import FusedModuleDocState, inference_provider
from ..schemas.artifacts import ModuleSpec
from ..schemas.config import ModelConfig
from .limits import GenerationDefaults

LIVE_CHECK_S = 1.0  # how often a served run's live pointer is re-read (orchestration/live.py)

# ModelConfig fields that say where the model runs, not which model it is
_RESOURCE_FIELDS = {"device", "attention_backend"}


class ServedRunsError(ValueError):
    """The runs given to one server cannot be served together (as given)."""


class BaseModelDiffers(ServedRunsError):
    """Two runs given to one server were trained on different base models."""


@dataclass(frozen=True)
class ServedRun:
    """What the server needs of a run (``loader.open_served_run`` reads it from the run directory)."""

    run_dir: str
    doc_id: str
    doc_sha256: str
    text: str  # the document (tokenized for the prompt layout only)
    model: ModelConfig
    module_url: str  # the live state's directory (orchestration/live.py)
    defaults: GenerationDefaults  # the run's evaluation settings, where a request leaves a field out


@dataclass(frozen=True)
class ServedDocument:
    """One run's module as the server knows it before (and after) its weights load."""

    name: str  # the model id clients send
    run_dir: str
    module_url: str  # the live state's directory (orchestration/live.py)
    doc_sha256: str
    spec: ModuleSpec
    layout: PromptLayout
    defaults: GenerationDefaults
    model: ModelConfig

    @property
    def n_context(self) -> int:
        return self.spec.n_context


def default_name(run_dir: str, doc_id: str) -> str:
    """``<doc-id>/<run-id>``: names the document and the configuration the module was trained with."""
    return f"{doc_id}/{run_dir.rstrip('/').split('/')[-1]}"


def open_document(run: ServedRun, tokenizer, name: str | None = None) -> ServedDocument:
    """The run's module spec, checked against its document's length under this tokenizer."""
    spec = read_spec(run.module_url)
    layout = build_layout(tokenizer, run.text)
    if layout.n != spec.n_context:  # the module's positions would not be the document's length
        raise ModuleMismatch(f"{run.module_url}: module was trained for a {spec.n_context}-token "
                             f"document, the run's document is {layout.n} tokens under this tokenizer")
    return ServedDocument(name=name or default_name(run.run_dir, run.doc_id), run_dir=run.run_dir,
                          module_url=run.module_url, doc_sha256=run.doc_sha256, spec=spec, layout=layout,
                          defaults=run.defaults, model=run.model)


def same_model(a: ModelConfig, b: ModelConfig) -> bool:
    return a.model_dump(exclude=_RESOURCE_FIELDS) == b.model_dump(exclude=_RESOURCE_FIELDS)


class ModuleRegistry:
    """The base model, the served documents by model id, and their modules loaded on demand (LRU,
    bounded in bytes). Thread-safe: requests ask for providers from worker threads."""

    def __init__(self, base: BaseLM, documents: list[ServedDocument], max_module_bytes: int,
                 keep_dequantized: bool = True):
        self.base, self.max_module_bytes, self.keep_dequantized = base, max_module_bytes, keep_dequantized
        self.documents = {d.name: d for d in documents}
        self._loaded: OrderedDict[str, FusedModuleDocState] = OrderedDict()
        self._lock = threading.Lock()
        self._checked: dict[str, float] = {}  # name → when its live pointer was last read
        self.loads = 0  # module loads so far (a document dropped and asked again loads again)
        self.evictions = 0

    @property
    def names(self) -> list[str]:
        return list(self.documents)

    @property
    def loaded(self) -> list[str]:
        with self._lock:
            return list(self._loaded)

    @property
    def loaded_bytes(self) -> int:
        with self._lock:
            return self._bytes()

    def provider(self, name: str) -> FusedModuleDocState:
        """The document's module as a decode provider, loading it (and dropping the least recently
        used ones past the byte bound) if it is not loaded."""
        with self._lock:  # one load at a time: two requests for a cold document load it once
            self._follow_live(name)
            if name in self._loaded:
                self._loaded.move_to_end(name)
                return self._loaded[name]
            doc = self.documents[name]
            module, _ = load_module(doc.module_url, self.base, doc.doc_sha256, device=self.base.device)
            provider = inference_provider(module, self.base.dtype, self.keep_dequantized)  # as nectar ask
            self._loaded[name] = provider
            self.loads += 1
            while len(self._loaded) > 1 and self._bytes() > self.max_module_bytes:
                self._loaded.popitem(last=False)
                self.evictions += 1
            return provider

    def _follow_live(self, name: str) -> None:
        """A run whose live state changed since it was opened (its promote stage put the refined state
        live while it was served): serve the new state from the next request on; rows decoding with
        the old one finish on it. The pointer is re-read at most every LIVE_CHECK_S."""
        from ..orchestration.executor import RunDir
        from ..orchestration.live import read_live

        now = time.monotonic()
        if now - self._checked.get(name, float("-inf")) < LIVE_CHECK_S:
            return
        self._checked[name] = now
        doc = self.documents[name]
        try:
            state = read_live(RunDir(doc.run_dir))
            if state is None or state.url == doc.module_url:
                return
            spec = read_spec(state.url)
        except (OSError, ValueError, KeyError):  # unreadable now: keep serving what is loaded
            return
        if spec.n_context != doc.spec.n_context or spec.doc_sha256 != doc.doc_sha256:
            return
        self.documents[name] = dataclasses.replace(doc, module_url=state.url, spec=spec)
        self._loaded.pop(name, None)

    def _bytes(self) -> int:
        return sum(p.module.resident_bytes for p in self._loaded.values())


def open_registry(runs: list[ServedRun], names: list[str] | None, max_module_bytes: int,
                  keep_dequantized: bool = True) -> ModuleRegistry:
    """Check the runs (one base model, distinct model ids), load the base model, read the specs."""
    if names and len(names) != len(runs):
        raise ServedRunsError(f"--served-name given {len(names)} times for {len(runs)} runs; give one per run "
                              "(in the order of the runs) or none")
    first = runs[0]
    for run in runs[1:]:
        if not same_model(run.model, first.model):
            raise BaseModelDiffers(f"{run.run_dir}: base model {run.model.name!r} ({run.model.dtype}) differs from "
                                   f"{first.model.name!r} ({first.model.dtype}) of {first.run_dir}; one server holds "
                                   "one base model: serve this run from another nectar serve")
    base = load_base_model(first.model)
    documents = [open_document(r, base.tokenizer, names[i] if names else None) for i, r in enumerate(runs)]
    seen: dict[str, str] = {}
    for d in documents:
        if d.name in seen:
            raise ServedRunsError(f"{d.run_dir} and {seen[d.name]} would both be served as {d.name!r}; give "
                                  "each run its own --served-name")
        seen[d.name] = d.run_dir
        if d.spec.base_model_hash != base.weights_hash:
            raise ModuleMismatch(f"{d.module_url}: module was trained for base model {d.spec.base_model!r} "
                                 f"(weights hash {d.spec.base_model_hash}), the loaded model's weights hash "
                                 f"is {base.weights_hash}")
    return ModuleRegistry(base, documents, max_module_bytes, keep_dequantized)
