"""vLLM general plugin: registers the NECTAR attention backend (``nectar.vllm.backend``) for CPU_ATTN.

vLLM calls its general plugins in every process it starts (API server, engine core, workers). The
entry point (``vllm.general_plugins: nectar``) is the one-module distribution in ``infra/vllm-plugin``
that ``nectar.vllm.venv.ensure_plugin`` installs into vLLM's own environment; it calls ``register()``
here only when the server runs with ``NECTAR_VLLM_ATTENTION=biased`` (set by
``nectar.vllm.serve.state_server_spec`` for states with β), so other vLLM servers in that environment
never import nectar. This module is imported from the checkout on the server's PYTHONPATH.
"""
from __future__ import annotations

import os

ENV = "NECTAR_VLLM_ATTENTION"
BIASED = "biased"
BACKEND = "nectar.vllm.backend.NectarAttentionBackend"


def register() -> None:
    import torch
    from vllm.logger import init_logger
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if torch.cuda.is_available():
        raise RuntimeError(f"{ENV}={BIASED}: the NECTAR attention backend is CPU-only in this release (the CUDA "
                           "one wraps flash attention's LSE and is not built); serve the β-free refit on GPU")
    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND)
    init_logger(f"vllm.{__name__}").info("nectar: attention backend registered (%s for CPU_ATTN, pid %d)", BACKEND, os.getpid())


def backend_registered() -> bool:
    """Whether this process serves CPU_ATTN through the NECTAR backend (the connector checks it)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return AttentionBackendEnum.CPU_ATTN.get_path() == BACKEND
