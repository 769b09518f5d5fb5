"""vLLM general plugin for servers of document states: reads their states' prefix cache for prompt
log-probabilities, and registers the NECTAR attention backend (``nectar.vllm.backend``) for CPU_ATTN.

vLLM calls its general plugins in every process it starts (API server, engine core, workers). The
entry point (``vllm.general_plugins: nectar``) is the one module in ``infra/vllm-plugin``, which
``nectar.vllm.venv.ensure_plugin`` installs into vLLM's own environment as a wheel; it calls ``register()``
here only when the server runs with ``NECTAR_VLLM_STATES=1`` (``nectar.vllm.serve.state_server_spec``
sets it for every server of document states), so other vLLM servers in that environment never import
nectar. This module is imported from the checkout on the server's PYTHONPATH.

* **Prompt log-probabilities.** vLLM makes a request that asks for ``prompt_logprobs`` skip the prefix
  cache (cached positions would have no log-probability) — and with it the KV connector's tokens, so
  the placeholders ran through the model as ordinary tokens and every log-probability was the model's
  without the document. On these servers such a request still takes its state from the connector and
  only the local prefix cache is skipped: every position after the m placeholders is computed. The
  placeholders' own rows are reported as token 0 with log-probability 0 (no meaningful value; vLLM's
  buffer there is uninitialised and its ids crashed the API server's detokenizer).
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
    """In the engine core: a request asking for prompt log-probs keeps its external (state) tokens but no
    local prefix-cache hit, so every position after the m placeholders is computed."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.outputs import LogprobsTensors
    from vllm.v1.request import Request

    if getattr(Request.get_skip_reading_prefix_cache, "_nectar", False):
        return
    vllm_skip = Request.get_skip_reading_prefix_cache
    lookup = KVCacheManager.prefix_cache_lookup_enabled
    empty_cpu = LogprobsTensors.empty_cpu

    def read_external(self) -> bool:
        self.nectar_local_cache_off = vllm_skip(self)  # what vLLM asked: no local hits for prompt log-probs
        return False  # … but the scheduler still asks the connector for the state's tokens

    def local_lookup(self, request) -> bool:
        return lookup(self, request) and not getattr(request, "nectar_local_cache_off", False)

    def zeroed_cpu(num_positions: int, num_tokens_per_position: int) -> LogprobsTensors:
        # The runner fills prompt log-probs from the first computed position on; the placeholders' rows
        # would hold garbage ids the API server cannot detokenize.
        t = empty_cpu(num_positions, num_tokens_per_position)
        for x in (t.logprob_token_ids, t.logprobs, t.selected_token_ranks):
            x.zero_()
        return t

    read_external._nectar = True  # type: ignore[attr-defined]
    Request.get_skip_reading_prefix_cache = read_external
    KVCacheManager.prefix_cache_lookup_enabled = local_lookup
    LogprobsTensors.empty_cpu = staticmethod(zeroed_cpu)


def backend_registered() -> bool:
    """Whether this process serves CPU_ATTN through the NECTAR backend (the connector checks it)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return AttentionBackendEnum.CPU_ATTN.get_path() == BACKEND
