"""The file a document's plain-KV state travels in to vLLM: names and checks shared by the exporter
(``state.py``, in this project's environment) and the connector (``connector.py``, inside
the vLLM server's own environment) — so this module imports only safetensors.

    k.{layer}, v.{layer}   [hkv, m, d]  keys rotated for queries at positions m + t; values
    metadata               format, version, base_model, base_model_hash, doc_sha256, n, m,
                           num_layers, num_kv_heads, head_dim, source (the state's system), dtype
"""
from __future__ import annotations

from safetensors import safe_open

STATE_FORMAT = "nectar-vllm-state"
STATE_VERSION = "1"
STATE_FILE = f"state.v{STATE_VERSION}.safetensors"


def read_state_meta(path: str) -> dict[str, str]:
    """The metadata of a state file; refuses a file of another format or version."""
    with safe_open(path, "pt") as f:
        meta = f.metadata() or {}
    if meta.get("format") != STATE_FORMAT or meta.get("version") != STATE_VERSION:
        raise ValueError(f"{path}: not a {STATE_FORMAT} v{STATE_VERSION} file (found {meta.get('format')!r} "
                         f"v{meta.get('version')!r}); re-export it with `nectar serve RUN_DIR --engine vllm`")
    return meta
