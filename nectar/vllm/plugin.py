"""vLLM general plugin for servers of document states: reads their states' prefix cache for prompt
log-probabilities, and registers the NECTAR attention backend (``nectar.vllm.backend``) for CPU_ATTN.

vLLM calls its general plugins in every process it starts (API server, engine core, workers). The
entry point (``vllm.general_plugins: nectar``) is the one-module distribution in ``infra/vllm-plugin``
that ``nectar.vllm.venv.ensure_plugin`` installs into vLLM's own environment; it calls ``register()``
here only when the server runs with ``NECTAR_VLLM_STATES=1`` (``nectar.vllm.serve.state_server_spec``
sets it for every server of document states), so other vLLM servers in that environment never import
nectar. This module is imported from the checkout on the server's PYTHONPATH.

* **Prompt log-probabilities.** vLLM makes a request that asks for ``prompt_logprobs`` skip reading the
  prefix cache (its cached positions would have no log-probability) — and the KV connector's document
  state IS what the request would read there: without it the placeholders run through the model as
  ordinary tokens and every log-probability is the model's without the document. On these servers every
  request reads the cache; the positions it did not compute (the m placeholders, and any cached prefix
  after them) are reported as token 0 with log-probability 0 — no meaningful value (vLLM's own buffer
  there is uninitialised and its ids crash the API server's detokenizer).
* **The attention backend**, when ``NECTAR_VLLM_ATTENTION=biased`` (states with β): CPU only in this release.
"""
from __future__ import annotations

import os

STATES_ENV = "NECTAR_VLLM_STATES"
ENV = "NECTAR_VLLM_ATTENTION"
BIASED = "biased"
BACKEND = "nectar.vllm.backend.NectarAttentionBackend"


def register() -> None:
    from vllm.logger import init_logger

    log = init_logger(f"vllm.{__name__}")  # under "vllm": its handler prints it
    _read_prefix_cache_for_prompt_logprobs()
    if os.environ.get(ENV) != BIASED:
        return
    import torch
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if torch.cuda.is_available():
        raise RuntimeError(f"{ENV}={BIASED}: the NECTAR attention backend is CPU-only in this release (the CUDA "
                           "one wraps flash attention's LSE and is not built); serve the β-free refit on GPU")
    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND)
    log.info("nectar: attention backend registered (%s for CPU_ATTN, pid %d)", BACKEND, os.getpid())


def _read_prefix_cache_for_prompt_logprobs() -> None:
    """In the engine core, where the scheduler asks each request whether to skip the prefix cache."""
    from vllm.v1.outputs import LogprobsTensors
    from vllm.v1.request import Request

    def never_skip(self) -> bool:
        return False  # the document's state lives in the prefix cache

    Request.get_skip_reading_prefix_cache = never_skip
    empty_cpu = LogprobsTensors.empty_cpu
    if getattr(empty_cpu, "_nectar", False):
        return

    def zeroed_cpu(num_positions: int, num_tokens_per_position: int) -> LogprobsTensors:
        # The runner fills prompt log-probs from the first computed position on; the rows before it
        # (placeholders, cached prefix) would hold garbage ids the API server cannot detokenize.
        t = empty_cpu(num_positions, num_tokens_per_position)
        for x in (t.logprob_token_ids, t.logprobs, t.selected_token_ranks):
            x.zero_()
        return t

    zeroed_cpu._nectar = True  # type: ignore[attr-defined]
    LogprobsTensors.empty_cpu = staticmethod(zeroed_cpu)


def backend_registered() -> bool:
    """Whether this process serves CPU_ATTN through the NECTAR backend (the connector checks it)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return AttentionBackendEnum.CPU_ATTN.get_path() == BACKEND
