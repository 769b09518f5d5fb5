"""LLM access: one chat interface (``ChatBackend.chat_many``); backends local, openai and vllm (docs/design.md §7).

    backend = make_backend(cfg.synthesize.llm, cfg.model)
    results = backend.chat_many([make_request(cfg.synthesize.llm, "Hello")])
"""
from __future__ import annotations

from ..schemas.config import LLMConfig, ModelConfig
from .types import (ChatBackend, ChatRequest, ChatResult, LLMError, LLMUnavailableError, Message, OnResult,
                    Progress, make_request)

__all__ = [
    "ChatBackend", "ChatRequest", "ChatResult", "LLMError", "LLMUnavailableError", "Message", "OnResult",
    "Progress", "make_request", "make_backend",
]


def make_backend(llm_cfg: LLMConfig, base_model_cfg: ModelConfig) -> ChatBackend:
    """The backend ``llm_cfg`` names. ``local`` / ``vllm`` with no model serve the pipeline's base model.

    ``vllm`` without ``base_url`` starts (or reuses) a server in the active server scope
    (``nectar.vllm.pool``); ``auto`` does the same and falls back to ``local``, saying so in
    one line, when vLLM can't be set up or started."""
    if llm_cfg.backend in ("vllm", "auto"):
        from .vllm_backend import VLLMBackend
        from ..vllm.notices import say
        from ..vllm.venv import VLLMError

        if llm_cfg.backend == "vllm" and llm_cfg.base_url:
            return VLLMBackend(base_url=llm_cfg.base_url, model=llm_cfg.model, **_client_args(llm_cfg))
        try:
            server = _managed_server(llm_cfg, base_model_cfg)
            # auto: when the server can't be kept up, the local loop finishes the stage
            local_cfg = llm_cfg.model_copy(update={"backend": "local"})
            fallback = (lambda: make_backend(local_cfg, base_model_cfg)) if llm_cfg.backend == "auto" else None
            return VLLMBackend.managed(server, max_restarts=llm_cfg.max_server_restarts, fallback=fallback,
                                       **_client_args(llm_cfg))
        except VLLMError as exc:
            if llm_cfg.backend == "vllm":
                raise
            say(f"llm: vLLM unavailable, using the local backend ({exc})")
        llm_cfg = llm_cfg.model_copy(update={"backend": "local"})
    if llm_cfg.backend == "local":
        from ..base_model import load_base_model
        from .local import LocalBackend

        model_cfg = base_model_cfg
        if llm_cfg.model is not None and llm_cfg.model != base_model_cfg.name:
            # Another local model (e.g. a longer-context answerer) on the same device and dtype.
            model_cfg = base_model_cfg.model_copy(update={"name": llm_cfg.model, "yarn_factor": None,
                                                          "rope_scaling": None, "max_context_tokens": None})
        return LocalBackend(load_base_model(model_cfg), batch_size=llm_cfg.batch_size)
    if llm_cfg.backend == "openai":
        from .openai_backend import OpenAIBackend, api_key_from_env

        return OpenAIBackend(base_url=llm_cfg.base_url, model=llm_cfg.model, **_client_args(llm_cfg))
    raise ValueError(f"unknown LLM backend {llm_cfg.backend!r}; use 'local', 'openai', 'vllm' or 'auto'")


def _client_args(llm_cfg: LLMConfig) -> dict:
    from .openai_backend import api_key_from_env

    return dict(api_key=api_key_from_env(llm_cfg.api_key_env), max_concurrency=llm_cfg.max_concurrency,
                max_retries=llm_cfg.max_retries, timeout_s=llm_cfg.timeout_s, retry_budget_s=llm_cfg.retry_budget_s)


def server_spec(llm_cfg: LLMConfig, base_model_cfg: ModelConfig):
    """The vLLM server ``llm_cfg`` asks for: its model directory, dtype, context, port and KV space."""
    from ..vllm.server import ServerSpec
    from ..vllm.venv import VLLMError

    name = llm_cfg.model or base_model_cfg.name
    if name.startswith("tiny:"):
        raise VLLMError(f"{name} is a random model built in-process; vLLM can only serve a model directory or id")
    if name.startswith("embedded:"):
        from ..base_model import embedded_smollm2_dir

        if name != "embedded:smollm2-135m":
            raise VLLMError(f"unknown embedded model {name!r} for vLLM; use embedded:smollm2-135m")
        path = str(embedded_smollm2_dir())
    else:
        path = name
    return ServerSpec(model=path, served_name=name, dtype=llm_cfg.server_dtype, max_model_len=llm_cfg.max_model_len,
                      kv_cache_gib=llm_cfg.kv_cache_gib, port=llm_cfg.port, compile=llm_cfg.server_compile,
                      execute_timeout_s=llm_cfg.execute_timeout_s)


def _managed_server(llm_cfg: LLMConfig, base_model_cfg: ModelConfig):
    from ..vllm.pool import active_pool

    return active_pool().acquire(server_spec(llm_cfg, base_model_cfg))
