"""Load what a module answers with — for ``nectar serve`` and ``nectar ask`` alike: a run's base model,
its trained module and its prompt layout.

The run's train stage must have completed, and the module must
have been trained for this base model (weights hash) and this document (sha256). The document text
is tokenized (no forward pass) only to build the layout around the questions.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..base_model import BaseLM, load_base_model
from ..layout import PromptLayout, build_layout
from ..modules.builder import NectarModule
from ..modules.io import ModuleMismatch, load_module
from ..orchestration.context import open_run
from ..schemas.artifacts import ModuleSpec
from .limits import GenerationDefaults


@dataclass(frozen=True)
class ServedModule:
    name: str  # the model id clients send
    run_dir: str
    base: BaseLM
    module: NectarModule
    spec: ModuleSpec
    layout: PromptLayout
    defaults: GenerationDefaults

    @property
    def n_context(self) -> int:
        return self.spec.n_context


def default_name(run_dir: str, doc_id: str) -> str:
    """``<doc-id>/<run-id>``: names the document and the configuration the module was trained with."""
    return f"{doc_id}/{run_dir.rstrip('/').split('/')[-1]}"


def load_served_module(run_dir: str, name: str | None = None) -> ServedModule:
    ctx = open_run(run_dir)
    if not ctx.run.exists("train", "module.json"):
        raise FileNotFoundError(f"{ctx.run.url('train')}: no trained module (run the pipeline through "
                                "the train stage first)")
    base = load_base_model(ctx.config.model)
    module, spec = load_module(ctx.run.url("train"), base, ctx.info.sha256, device=base.device)
    layout = build_layout(base.tokenizer, ctx.text)
    if layout.n != spec.n_context:  # the module's positions would not be the document's length
        raise ModuleMismatch(f"{ctx.run.url('train')}: module was trained for a {spec.n_context}-token "
                             f"document, the run's document is {layout.n} tokens under this tokenizer")
    ev = ctx.config.evaluate
    return ServedModule(
        name=name or default_name(ctx.run.root, ctx.info.doc_id), run_dir=ctx.run.root, base=base,
        module=module, spec=spec, layout=layout,
        defaults=GenerationDefaults(ev.max_new_tokens_other, ev.temperature, ev.top_p))
