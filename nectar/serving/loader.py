"""Load one run's module with its base model — for ``nectar ask`` (the server loads its modules through
``registry.py``, with the same checks: the train stage completed, the module trained for this base
model (weights hash) and this document (sha256); the document text is tokenized, no forward pass,
only to build the layout around the questions).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..layout import PromptLayout
from ..models import BaseModel, load_base_model
from ..modules.builder import NectarModule
from ..modules.io import load_module
from ..schemas.artifacts import ModuleSpec
from .limits import GenerationDefaults
from .registry import ServedRun, open_document


@dataclass(frozen=True)
class ServedModule:
    name: str  # the model id clients send
    run_dir: str
    base: BaseModel
    module: NectarModule
    spec: ModuleSpec
    layout: PromptLayout
    defaults: GenerationDefaults

    @property
    def n_context(self) -> int:
        return self.spec.n_context


def load_served_module(run: ServedRun, name: str | None = None) -> ServedModule:
    base = load_base_model(run.model)
    doc = open_document(run, base.tokenizer, name)
    module, spec = load_module(doc.module_url, base, doc.doc_sha256, device=base.device)
    return ServedModule(name=doc.name, run_dir=doc.run_dir, base=base, module=module, spec=spec,
                        layout=doc.layout, defaults=doc.defaults)
