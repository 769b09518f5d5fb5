"""A vLLM KV connector that serves a document's compact state as m pseudo-tokens of plain KV.

Loaded INSIDE the vLLM server process (its own venv), by ``--kv-transfer-config``'s
``kv_connector_module_path``: it imports only torch, safetensors and vLLM, never the rest of nectar.

A state with the same number m of (key, value) pairs per (layer, KV head) and no log-mass bias is
exactly what attention over m cached tokens computes. A request's prompt is m placeholder tokens
followed by its query tokens; the scheduler side tells vLLM that the first m tokens are "externally
cached" (``get_num_new_matched_tokens``), vLLM allocates their blocks, and the worker side writes the
state's keys/values into those slots of every layer (``start_load_kv``) before the forward that reads
them. Keys are stored already rotated for queries at positions m + t (``nectar.vllm.state``).

A state with β (the product's default: per-pair log-mass, ragged per-head budgets padded with
β = −inf) needs the NECTAR attention backend (``nectar.vllm.backend``, registered by the plugin when
the server runs with NECTAR_VLLM_ATTENTION=biased): its layers keep a β per cache slot, and the
connector writes each pseudo-token's β with its key and value (``write_state_slots``). A biased state
on a server without that backend is refused at start, naming the file.

The document is named by the request's ``cache_salt`` (vLLM's own field, which also salts the prefix
cache, so two documents never share blocks); with a single state the salt may be left out. Full
blocks of placeholders then live in vLLM's prefix cache like any prompt, so a document's state is
written once and shared by every request on it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.logger import init_logger

from .format import has_bias, read_state_meta
from .plugin import ENV as BACKEND_ENV, BIASED, backend_registered

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = init_logger(f"vllm.{__name__}")  # under "vllm": its handler prints it

_LAYER_INDEX = re.compile(r"layers\.(\d+)\.")


@dataclass
class _Load:
    doc: str
    start: int  # first pseudo-token to write (earlier ones came from the prefix cache)
    stop: int  # m
    slots: list[int]  # paged-cache slot of each pseudo-token start … stop-1


@dataclass
class NectarStateMetadata(KVConnectorMetadata):
    loads: list[_Load] = field(default_factory=list)


class NectarStateConnector(KVConnectorBase_V1):
    """extra config: {"states": {doc_id: path}, "placeholder_id": int}."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig | None" = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        cfg = self._kv_transfer_config
        self._block_size = vllm_config.cache_config.block_size
        self._placeholder = int(cfg.get_from_extra_config("placeholder_id", 0))
        paths: dict[str, str] = dict(cfg.get_from_extra_config("states", {}))
        if not paths:
            raise ValueError("NectarStateConnector: kv_connector_extra_config.states is empty")
        self._meta = {doc: read_state_meta(p) for doc, p in paths.items()}
        _check_model(vllm_config, self._meta, paths)
        self._m = {doc: int(meta["m"]) for doc, meta in self._meta.items()}
        self._pending: dict[str, tuple[str, int]] = {}  # req id → (doc, first token to load)
        self._need_load: dict[str, tuple["Request", str, int]] = {}
        self._kv: dict[str, tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor] | None]] = {}
        if role == KVConnectorRole.WORKER:
            _check_backend(self._meta, paths)
            self._kv = {doc: _read_kv(p) for doc, p in paths.items()}
            for doc, (keys, values, betas) in self._kv.items():
                if betas is not None:  # the backend holds it densely too: one GEMM per step for all its requests
                    from .backend import register_document

                    register_document(doc, self._m[doc], keys, values, betas)
        logger.info("nectar: serving %d document state(s): %s", len(paths),
                    {d: self._m[d] for d in paths})

    # ----- scheduler side -----
    def _doc_of(self, request: "Request") -> str | None:
        salt = getattr(request, "cache_salt", None)
        if salt in self._m:
            return salt
        if salt is None and len(self._m) == 1:
            return next(iter(self._m))
        return None

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        doc = self._doc_of(request)
        if doc is None:
            return 0, False
        m = self._m[doc]
        prompt = request.prompt_token_ids or []
        if len(prompt) <= m or any(t != self._placeholder for t in prompt[:m]):
            logger.warning("nectar: request %s for document %s does not start with its %d placeholders; "
                           "no state loaded", request.request_id, doc, m)
            return 0, False
        if num_computed_tokens >= m:
            return 0, False  # every pseudo-token came from the prefix cache
        self._pending[request.request_id] = (doc, num_computed_tokens)
        return m - num_computed_tokens, False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        pending = self._pending.pop(request.request_id, None)
        if num_external_tokens > 0 and pending is not None:
            self._need_load[request.request_id] = (request, *pending)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = NectarStateMetadata()
        for req in scheduler_output.scheduled_new_reqs:
            if req.req_id in self._need_load:
                _, doc, start = self._need_load.pop(req.req_id)
                meta.loads.append(self._load(doc, start, req.block_ids[0]))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if req_id in self._need_load and cached.new_block_ids[i] is not None:
                # resumed after preemption: new_block_ids holds all of the request's blocks
                _, doc, start = self._need_load.pop(req_id)
                meta.loads.append(self._load(doc, start, cached.new_block_ids[i][0]))
        return meta

    def _load(self, doc: str, start: int, block_ids: list[int]) -> _Load:
        bs = self._block_size
        slots = [block_ids[p // bs] * bs + p % bs for p in range(start, self._m[doc])]
        return _Load(doc, start, self._m[doc], slots)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._pending.pop(request.request_id, None)
        self._need_load.pop(request.request_id, None)
        return False, None

    # ----- worker side -----
    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, NectarStateMetadata)
        if not meta.loads:
            return
        for name, layer in forward_context.no_compile_layers.items():
            kv_cache = getattr(layer, "kv_cache", None)
            if kv_cache is None or not hasattr(getattr(layer, "impl", None), "do_kv_cache_update"):
                continue
            index = int(_LAYER_INDEX.search(name).group(1))
            for load in meta.loads:
                keys, values, betas = self._kv[load.doc]
                k = keys[index][:, load.start:load.stop].transpose(0, 1)  # [count, hkv, d]
                v = values[index][:, load.start:load.stop].transpose(0, 1)
                k = k.to(kv_cache.device, kv_cache.dtype).contiguous()
                v = v.to(kv_cache.device, kv_cache.dtype).contiguous()
                slots = torch.tensor(load.slots, dtype=torch.int64, device=kv_cache.device)
                if betas is not None:  # the NECTAR backend (checked at start): keys, values and β
                    b = betas[index][:, load.start:load.stop].transpose(0, 1).contiguous()  # [count, hkv]
                    layer.impl.write_state_slots(kv_cache, k, v, b.to(kv_cache.device), slots)
                else:
                    # The backend's own writer: the CPU kernels keep keys in an ISA-specific block layout.
                    layer.impl.do_kv_cache_update(layer, k, v, kv_cache, slots)
        for load in meta.loads:  # every layer written: the block where a state starts names its document
            if load.start == 0 and self._kv[load.doc][2] is not None:
                from .backend import mark_state_block

                mark_state_block(load.slots[0] // self._block_size, load.doc)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return

    def wait_for_save(self):
        return


def _check_model(vllm_config: "VllmConfig", metas: dict[str, dict[str, str]], paths: dict[str, str]) -> None:
    """Refuse a state whose shape is not this model's (another base model): layers, KV heads, head dim."""
    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    have = (mc.get_num_layers(pc), mc.get_num_kv_heads(pc), mc.get_head_size())
    for doc, meta in metas.items():
        want = (int(meta["num_layers"]), int(meta["num_kv_heads"]), int(meta["head_dim"]))
        if want != have:
            raise ValueError(f"{paths[doc]}: state of {meta.get('base_model')!r} has (layers, KV heads, head dim) "
                             f"{want}, the served model {mc.model!r} has {have}; serve it with its own base model")


def _check_backend(metas: dict[str, dict[str, str]], paths: dict[str, str]) -> None:
    """Refuse a state with β on a server whose attention cannot add it (one line, naming the file)."""
    for doc, meta in metas.items():
        if has_bias(meta) and not backend_registered():
            raise ValueError(f"{paths[doc]}: the state carries β (log-mass per pair), which vLLM's own attention "
                             f"cannot add; start the server with {BACKEND_ENV}={BIASED} and the nectar-vllm-plugin "
                             "installed (`nectar serve --engine vllm` does both), or export the β-free refit")


def _read_kv(path: str) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor] | None]:
    meta = read_state_meta(path)
    layers = int(meta["num_layers"])
    with safe_open(path, "pt") as f:
        keys = [f.get_tensor(f"k.{i}") for i in range(layers)]  # [hkv, m, d]
        values = [f.get_tensor(f"v.{i}") for i in range(layers)]
        betas = [f.get_tensor(f"b.{i}") for i in range(layers)] if has_bias(meta) else None  # [hkv, m]
    want = (int(meta["num_kv_heads"]), int(meta["m"]), int(meta["head_dim"]))
    for i in range(layers):
        if tuple(keys[i].shape) != want or tuple(values[i].shape) != want or (
                betas is not None and tuple(betas[i].shape) != want[:2]):
            raise ValueError(f"{path}: layer {i}'s tensors do not have the shapes its metadata says ([hkv, m, d] = "
                             f"{list(want)}); the file is damaged: re-export it with `nectar serve RUN_DIR --engine vllm`")
    return keys, values, betas

