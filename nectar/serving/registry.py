"""The documents one server serves: many runs' modules over ONE base model.

A module is MBs where the document's KV cache is tens of MBs to GBs, so one process holds the base
model once and any number of documents. At start every run is opened (config, document, module
spec, prompt layout: no weights) and checked to use the same base model as the first one; a
module's weights are loaded the first time a request asks for its model id, and the loaded modules
are kept under a byte bound, least recently used dropped first. A row that is decoding keeps its
module alive until it ends, so the bound can be passed by the modules of rows in flight.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from ..layout import PromptLayout, build_layout
from ..models import BaseModel, load_base_model
from ..modules.io import ModuleMismatch, load_module, read_spec
from ..modules.provider import FusedModuleDocState, inference_provider
from ..orchestration import open_run
from ..schemas.artifacts import ModuleSpec
from ..schemas.config import ModelConfig
from .limits import GenerationDefaults

# ModelConfig fields that say where the model runs, not which model it is
_RESOURCE_FIELDS = {"device", "attention_backend"}


class ServedRunsError(ValueError):
    """The runs given to one server cannot be served together (as given)."""


class BaseModelDiffers(ServedRunsError):
    """Two runs given to one server were trained on different base models."""


@dataclass(frozen=True)
class ServedDocument:
    """One run's module as the server knows it before (and after) its weights load."""

    name: str  # the model id clients send
    run_dir: str
    module_url: str  # the train stage's directory
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


def open_document(run_dir: str, tokenizer, name: str | None = None) -> ServedDocument:
    """A run whose train stage completed, its module's spec checked against its document."""
    ctx = open_run(run_dir)
    if not ctx.run.exists("train", "module.json"):
        raise FileNotFoundError(f"{ctx.run.url('train')}: no trained module (run the pipeline through "
                                "the train stage first)")
    spec = read_spec(ctx.run.url("train"))
    layout = build_layout(tokenizer, ctx.text)
    if layout.n != spec.n_context:  # the module's positions would not be the document's length
        raise ModuleMismatch(f"{ctx.run.url('train')}: module was trained for a {spec.n_context}-token "
                             f"document, the run's document is {layout.n} tokens under this tokenizer")
    ev = ctx.config.evaluate
    return ServedDocument(
        name=name or default_name(ctx.run.root, ctx.info.doc_id), run_dir=ctx.run.root,
        module_url=ctx.run.url("train"), doc_sha256=ctx.info.sha256, spec=spec, layout=layout,
        defaults=GenerationDefaults(ev.max_new_tokens_other, ev.temperature, ev.top_p), model=ctx.config.model)


def run_model_config(run_dir: str) -> ModelConfig:
    return open_run(run_dir).config.model


def expand_run_dirs(paths: list[str]) -> list[str]:
    """Run directories as given; a directory that is not a run stands for the trained runs under it
    (``runs/`` or ``runs/<doc-id>/``, as ``nectar run`` lays them out)."""
    found: list[str] = []
    for p in paths:
        root = Path(p)
        if (root / "run.json").exists() or not root.is_dir():
            found.append(p)  # a run (open_run explains what is wrong with a path that is not)
            continue
        runs = sorted({str(m.parent.parent) for pattern in ("*/train/module.json", "*/*/train/module.json")
                       for m in root.glob(pattern) if (m.parent.parent / "run.json").exists()})
        if not runs:
            raise FileNotFoundError(f"{p}: neither a run directory (no run.json) nor a directory of trained "
                                    "runs (no */train/module.json or */*/train/module.json under it)")
        found.extend(runs)
    return found


def same_model(a: ModelConfig, b: ModelConfig) -> bool:
    return a.model_dump(exclude=_RESOURCE_FIELDS) == b.model_dump(exclude=_RESOURCE_FIELDS)


class ModuleRegistry:
    """The base model, the served documents by model id, and their modules loaded on demand (LRU,
    bounded in bytes). Thread-safe: requests ask for providers from worker threads."""

    def __init__(self, base: BaseModel, documents: list[ServedDocument], max_module_bytes: int):
        self.base, self.max_module_bytes = base, max_module_bytes
        self.documents = {d.name: d for d in documents}
        self._loaded: OrderedDict[str, FusedModuleDocState] = OrderedDict()
        self._lock = threading.Lock()
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
            return sum(self.documents[n].spec.module_bytes for n in self._loaded)

    def provider(self, name: str) -> FusedModuleDocState:
        """The document's module as a decode provider, loading it (and dropping the least recently
        used ones past the byte bound) if it is not loaded."""
        with self._lock:  # one load at a time: two requests for a cold document load it once
            if name in self._loaded:
                self._loaded.move_to_end(name)
                return self._loaded[name]
            doc = self.documents[name]
            module, _ = load_module(doc.module_url, self.base, doc.doc_sha256, device=self.base.device)
            provider = inference_provider(module, self.base.dtype)  # the fused module, as nectar ask
            self._loaded[name] = provider
            self.loads += 1
            while len(self._loaded) > 1 and self._bytes() > self.max_module_bytes:
                self._loaded.popitem(last=False)
                self.evictions += 1
            return provider

    def _bytes(self) -> int:
        return sum(self.documents[n].spec.module_bytes for n in self._loaded)


def open_registry(run_dirs: list[str], names: list[str] | None, max_module_bytes: int) -> ModuleRegistry:
    """Open every run (no weights), refuse a second base model or a repeated model id, load the base."""
    runs = expand_run_dirs(run_dirs)
    if names and len(names) != len(runs):
        raise ServedRunsError(f"--served-name given {len(names)} times for {len(runs)} runs; give one per run "
                         "(in the order of the runs) or none")
    models = [run_model_config(r) for r in runs]
    for run, model in zip(runs[1:], models[1:]):
        if not same_model(model, models[0]):
            raise BaseModelDiffers(f"{run}: base model {model.name!r} ({model.dtype}) differs from "
                                   f"{models[0].name!r} ({models[0].dtype}) of {runs[0]}; one server holds one "
                                   "base model: serve this run from another nectar serve")
    base = load_base_model(models[0])
    documents = [open_document(r, base.tokenizer, names[i] if names else None) for i, r in enumerate(runs)]
    seen: dict[str, str] = {}
    for d in documents:
        if d.name in seen:
            raise ServedRunsError(f"{d.run_dir} and {seen[d.name]} would both be served as {d.name!r}; give each "
                             "run its own --served-name")
        seen[d.name] = d.run_dir
        if d.spec.base_model_hash != base.weights_hash:
            raise ModuleMismatch(f"{d.module_url}: module was trained for base model {d.spec.base_model!r} "
                                 f"(weights hash {d.spec.base_model_hash}), the loaded model's weights hash "
                                 f"is {base.weights_hash}")
    return ModuleRegistry(base, documents, max_module_bytes)
