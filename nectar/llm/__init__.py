"""LLM access: one chat interface (``ChatBackend.chat_many``), two backends (docs/design.md §7).

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
    """The backend ``llm_cfg`` names. ``local`` with no model is the pipeline's base model."""
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

        return OpenAIBackend(
            base_url=llm_cfg.base_url, model=llm_cfg.model, api_key=api_key_from_env(llm_cfg.api_key_env),
            max_concurrency=llm_cfg.max_concurrency, max_retries=llm_cfg.max_retries, timeout_s=llm_cfg.timeout_s,
            retry_budget_s=llm_cfg.retry_budget_s,
        )
    raise ValueError(f"unknown LLM backend {llm_cfg.backend!r}; use 'local' or 'openai'")
