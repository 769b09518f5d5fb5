"""Load what a module answers with — for ``nectar serve`` and ``nectar ask`` alike: runs as the server
reads them (``ServedRun``: the document, the base model's config, the trained module's directory,
the evaluation's generation defaults), and for ``nectar ask`` one run's base model, module and
prompt layout.

The run's train stage must have completed, and the module must have been trained for this base
model (weights hash) and this document (sha256); ``registry.py`` applies those checks. The document
text is tokenized (no forward pass) only to build the layout around the questions.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..base_model import BaseLM, load_base_model
from ..layout import PromptLayout
from ..modules.builder import NectarModule
from ..modules.io import load_module
from ..orchestration.context import open_run
from ..orchestration.live import LIVE, read_live
from ..schemas.artifacts import ModuleSpec
from .limits import GenerationDefaults
from .registry import ServedRun, open_document


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


def open_served_run(run_dir: str) -> ServedRun:
    """A run with a live state — the first state (document alone) from the first stage on, the
    refined one once the promote stage found it better (orchestration/live.py) — FileNotFoundError
    otherwise, naming the fix."""
    ctx = open_run(run_dir)
    live = read_live(ctx.run)
    if live is None:
        raise FileNotFoundError(f"{ctx.run.root}: no state to answer with yet (run the pipeline through "
                                "the first stage, or the train stage, first)")
    ev = ctx.config.evaluate
    return ServedRun(run_dir=ctx.run.root, doc_id=ctx.info.doc_id, doc_sha256=ctx.info.sha256, text=ctx.text,
                     model=ctx.config.model, module_url=live.url,
                     defaults=GenerationDefaults(ev.max_new_tokens_other, ev.temperature, ev.top_p))


def expand_run_dirs(paths: list[str]) -> list[str]:
    """Run directories as given; a directory that is not a run stands for the trained runs under it
    (``runs/`` or ``runs/<doc-id>/``, as ``nectar run`` lays them out)."""
    found: list[str] = []
    for p in paths:
        root = Path(p)
        if (root / "run.json").exists() or not root.is_dir():
            found.append(p)  # a run (open_run explains what is wrong with a path that is not)
            continue
        live = "/".join(LIVE)
        patterns = ("*/train/module.json", "*/*/train/module.json", f"*/{live}", f"*/*/{live}")
        runs = sorted({str(m.parent.parent) for pattern in patterns
                       for m in root.glob(pattern) if (m.parent.parent / "run.json").exists()})
        if not runs:
            raise FileNotFoundError(f"{p}: neither a run directory (no run.json) nor a directory of runs "
                                    f"with a state (no */train/module.json or */{live} under it, one level "
                                    "or two down)")
        found.extend(runs)
    return found


def open_served_runs(paths: list[str]) -> list[ServedRun]:
    return [open_served_run(r) for r in expand_run_dirs(paths)]


def load_served_module(run_dir: str, name: str | None = None) -> ServedModule:
    run = open_served_run(run_dir)
    base = load_base_model(run.model)
    doc = open_document(run, base.tokenizer, name)
    module, spec = load_module(doc.module_url, base, doc.doc_sha256, device=base.device)
    return ServedModule(name=doc.name, run_dir=doc.run_dir, base=base, module=module, spec=spec,
                        layout=doc.layout, defaults=doc.defaults)
