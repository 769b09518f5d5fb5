"""The file a document's state travels in to vLLM: names and checks shared by the exporter
(``state.py``, in this project's environment) and the connector (``connector.py``, inside
the vLLM server's own environment) — so this module imports only safetensors.

    k.{layer}, v.{layer}   [hkv, m, d]  keys rotated for queries at positions m + t; values
    b.{layer}              [hkv, m]     v2, when metadata bias = "1": each pair's log-mass β; −inf pads a
                                        head (or layer) whose budget is below m — served only by the
                                        NECTAR attention backend (``nectar.vllm.backend``)
    metadata               format, version, base_model, base_model_hash, doc_sha256, n, m,
                           num_layers, num_kv_heads, head_dim, source (the state's system), dtype, bias
Version 1 files (no β, no bias key) are still read.
"""
from __future__ import annotations

from safetensors import safe_open

STATE_FORMAT = "nectar-vllm-state"
STATE_VERSION = "2"
READABLE_VERSIONS = ("1", "2")
STATE_FILE = f"state.v{STATE_VERSION}.safetensors"


def read_state_meta(path: str) -> dict[str, str]:
    """The metadata of a state file; refuses a file of another format or version."""
    try:
        with safe_open(path, "pt") as f:
            meta = f.metadata() or {}
    except Exception as exc:  # a missing, truncated or foreign file: one line naming it
        raise ValueError(f"{path}: not a readable state file ({type(exc).__name__}: {str(exc)[:120]}); re-export it "
                         "with `nectar serve RUN_DIR --engine vllm`") from None
    if meta.get("format") != STATE_FORMAT or meta.get("version") not in READABLE_VERSIONS:
        raise ValueError(f"{path}: not a {STATE_FORMAT} v{STATE_VERSION} file (found {meta.get('format')!r} "
                         f"v{meta.get('version')!r}); re-export it with `nectar serve RUN_DIR --engine vllm`")
    return meta


def has_bias(meta: dict[str, str]) -> bool:
    """Whether the state carries β (``b.{layer}``): it then needs the NECTAR attention backend."""
    return meta.get("bias") == "1"
