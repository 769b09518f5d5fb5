"""Fitting one NECTAR module on a targets store: plan, initialise, normalise, run the ``Trainer``,
write the module, its spec and the training log (the train stage's work, callable from any process:
the stage, ``nectar compare`` and the distributed launcher)."""
from __future__ import annotations

import contextlib
from typing import Callable

from ..base_model import BaseLM
from ..layout import build_layout
from ..modules.builder import NectarModule, build_module, plan_from_config
from ..modules.io import make_spec, save_module
from ..modules.stored import quantize_module_, trained_as_stored
from ..schemas.artifacts import TargetsHeader, TrainLogRow
from ..schemas.base import stable_hash
from ..schemas.config import TrainConfig
from ..states import FitInputs, FittedState, init_method
from ..states.recon_refine import refine_fitted
from ..tables import write_table
from ..targets.online import OnlineTargets
from ..targets.reader import TargetsData
from ..targets.store import targets_zarr_url
from .data import limit_query_tokens, target_statistics
from .distributed import barrier, dist_info
from .loop import Trainer


class TrainInputError(ValueError):
    pass


def check_targets_fit(header: TargetsHeader, base: BaseLM, where: str) -> None:
    if header.model_hash != base.weights_hash:
        raise TrainInputError(f"{where}: targets were cached with model {header.model!r} (weights hash "
                              f"{header.model_hash}), not the loaded {base.name!r} ({base.weights_hash}); "
                              "re-run the targets stage")
    for name in ("num_layers", "num_q_heads", "num_kv_heads", "head_dim"):
        if getattr(header, name) != getattr(base, name):
            raise TrainInputError(f"{where}: targets have {name}={getattr(header, name)}, "
                                  f"the model has {getattr(base, name)}")


def fit(targets_url: str, cfg: TrainConfig, base: BaseLM, doc_kv, out_url: str,
        progress: Callable[[int, int], None] | None = None,
        stop_after: int | None = None, document: str | None = None,
        spans: list[tuple[str, str]] | None = None) -> tuple[NectarModule, dict]:
    """``train`` that also hands back the trained in-memory module (this process's replica)."""
    zurl = targets_zarr_url(targets_url)
    data = TargetsData(zurl, window_tokens=cfg.shuffle_window_tokens)
    h = data.header
    check_targets_fit(h, base, zurl)
    if data.online:  # q, α, A are recomputed in every step from the document KV (nectar/targets/online.py)
        if doc_kv is None:
            raise TrainInputError("online targets are computed from the document KV during training; pass doc_kv")
        data.attach_values(OnlineTargets(data, base, doc_kv))
    if "recon" in cfg.splits and len(data.pairs("recon")) == 0:
        raise TrainInputError(f"train.splits={cfg.splits!r} but the targets hold no reconstruction spans: "
                              "set targets.recon.capture=true (and rerun the targets stage)")
    train_tokens = data.pair_tokens(data.pairs(cfg.splits))
    if cfg.max_query_tokens is not None:  # a nested subset of the training pairs (the data curve)
        train_tokens = limit_query_tokens(data, cfg.splits, cfg.max_query_tokens, cfg.seed)
    plan = plan_from_config(cfg.module, h.num_layers, h.num_kv_heads, h.head_dim, h.n_context, h.scaling)
    if cfg.end_to_end.steps > 0 and (plan.arch != "quadrature" or spans is None or document is None):
        raise TrainInputError("train.end_to_end steps refine a quadrature state on the document's reconstruction: "
                              "set train.module.arch=quadrature and train.module.init=recon_fit (or "
                              "train.end_to_end.steps=0)")
    if plan.arch == "quadrature":
        if doc_kv is None:
            raise TrainInputError("a quadrature module is initialised from the document KV; pass doc_kv")
        if doc_kv.n != h.n_context:
            raise TrainInputError(f"document KV has n={doc_kv.n} tokens, the targets n={h.n_context}")
    keys = doc_kv.keys if doc_kv is not None and plan.arch == "quadrature" else None
    values = doc_kv.values if keys is not None else None
    module = build_module(plan, keys, values, seed=cfg.seed)
    method = init_method(cfg.module.init) if plan.arch == "quadrature" else None
    if method is not None:  # a state method's fit is the start (the plan may become its own: recon_fit's)
        method = method.configured(cfg.module)
        inputs = FitInputs(doc_kv, data, seed=cfg.seed)
        if method.reads_document:
            if document is None or spans is None:
                raise TrainInputError(f"init {method.name} reads the document: pass the document text and its "
                                      "reconstruction spans")
            inputs = FitInputs(doc_kv, data, seed=cfg.seed, base=base, layout=build_layout(base.tokenizer, document),
                               document=document, spans=tuple(spans))
        try:
            plan, module = method.init(plan, module, inputs)
        except ValueError as exc:
            raise TrainInputError(str(exc)) from exc
    if plan.normalize_targets:
        module.set_normalization(target_statistics(data, h.num_kv_heads, seed=cfg.seed))
    module = module.to(base.device)
    if not cfg.refine:
        if method is None:
            raise TrainInputError("train.refine=false keeps a closed-form init as the state: set "
                                  "train.module.arch=quadrature and train.module.init to evict, attention_matching or recon_fit")
        data.close()
        rows: list[TrainLogRow] = []
        counts: dict = {"steps": 0, "total_steps": 0, "samples": 0, "refined": False}
    else:
        fingerprint = stable_hash({"train": cfg.cache_dict(), "plan": plan.to_dict(),
                                   "targets": h.model_dump(mode="json"), "data_tokens": int(data.offsets[-1])})
        as_stored = trained_as_stored(module) if cfg.quant_aware else contextlib.nullcontext()
        try:
            with as_stored:  # the optimizer is built inside: it steps the float parameters behind the rounding
                trainer = Trainer(module, plan.arch, data, base, cfg, f"{out_url.rstrip('/')}/checkpoints",
                                  fingerprint)
                result = trainer.run(progress=progress, stop_after=stop_after)
        finally:
            data.close()  # the prefetch thread
        s = result.state
        rows = result.rows
        counts = {"steps": s.step, "total_steps": result.schedule.total_steps, "samples": s.samples,
                  "skipped_nonfinite": s.skipped, "resumed_from_step": result.resumed_from,
                  "warmup_steps": result.schedule.warmup_steps, "peak_lr": result.schedule.peak_lr,
                  "train_items": result.schedule.n_items, "stopped_early": result.stopped_early}
        if result.stopped_early:
            return module, counts
    # stored and served on its train.module.bits grid (trained in float, or as stored: train.quant_aware)
    quantize_module_(module)
    if cfg.end_to_end.steps > 0:  # steps on the stored state, end to end on the reconstruction spans
        timings: dict[str, float] = {}
        refined = refine_fitted(base, build_layout(base.tokenizer, document), doc_kv, spans,
                                FittedState("train", module, plan), cfg.end_to_end, cfg.seed, timings, progress)
        module = refined.module
        counts.update({k: round(v, 4) for k, v in timings.items()})
    info = dist_info()
    spec = make_spec(module.cpu(), plan, base.name, base.weights_hash, h.doc_sha256, h.num_q_heads,
                     normalization={"enabled": plan.normalize_targets, "source": "train split targets"})
    if info.is_main:
        save_module(module, spec, out_url)
        write_table(f"{out_url.rstrip('/')}/train_log.parquet", rows, TrainLogRow)
    barrier(info)
    module.to(base.device)
    counts.update(train_query_tokens=train_tokens, n_params=spec.n_params, module_bytes=spec.module_bytes, kv_cache_bytes=spec.kv_cache_bytes,
                  kv_over_module=round(spec.kv_cache_bytes / spec.module_bytes, 2), **_final_metrics(rows))
    return module, counts


def _final_metrics(rows: list[TrainLogRow]) -> dict:
    out = {}
    for split in ("train", "heldout"):
        last = [r for r in rows if r.split == split]
        if last:
            r = last[-1]
            out.update({f"{split}_loss": r.loss, f"{split}_loss_A": r.loss_A, f"{split}_loss_kl": r.loss_kl,
                        f"{split}_rte_A": r.rte_A, f"{split}_token_acc": r.token_acc})
    first = [r for r in rows if r.split == "heldout"]
    if first:
        out.update(heldout_initial_loss_A=first[0].loss_A, heldout_initial_loss_kl=first[0].loss_kl,
                   heldout_initial_token_acc=first[0].token_acc)
    return out
