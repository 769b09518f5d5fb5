"""The kvpress bridge's worker: run by the kvpress venv's python, never imported by it from nectar.

Standalone on purpose (torch + transformers + kvpress only; it loads the torch-only
nectar/quantization.py by path when a quantized row is asked for): kvpress 0.5.5 pins a transformers
older than this project's, so it lives in a venv of its own (nectar/kvpress/env.py) and is fed the
run's exact token ids through files:

  WORKDIR/request.json    model folder and dtype, the document prefix ids, every pair's ids and
                          response start, the jobs (press, compression ratio, bits, group), tolerance
  WORKDIR/reference.npy   float32 [K, V]: OUR full-context model's log-probs at the K scored
                          positions of all pairs, pairs concatenated in request order
  WORKDIR/result.json     per job: per-pair sums (correct, nll, kl, n), press seconds, kept entries,
                          stored bytes; the guard's largest per-token KL; unavailable presses

Per job, the document is prefilled under the press (``compression_ratio`` = 1 − kept share), the kept
keys and values are optionally rounded through ``bits``-bit group quantization, and then every pair is
teacher-forced against a copy of the compressed cache at positions n, n+1, … . A response token t is
scored by the logits at t − 1 (nectar/evaluation/metrics.py): KL(ours_full ‖ kvpress), −log p(target),
argmax == target. KVzip's scores do not depend on the ratio (SCORED_ONCE): its reconstruction pass
runs once per request and every KVzip job (each budget and precision) selects from those scores, the
same masks a pass of its own gives; such a job's ``press_s`` is that shared pass plus its own selection
and rounding, what the state alone costs. Entries a head-wise press drops are masked out of the softmax exactly
(``exact_head_masks``, in place of kvpress's fake-key search). The guard first scores the uncompressed cache the same way: its largest per-token KL
to our full model must stay under the tolerance, or every row is refused.

The module-level tables (PRESSES, UNAVAILABLE) are plain data: nectar imports this file to know the
press names without importing kvpress.
"""
from __future__ import annotations

import argparse
import copy
import functools
import importlib.util
import json
import sys
import time
from pathlib import Path

CACHE_CALL_PY = Path(__file__).resolve().parents[1] / "cache_call.py"

# name → (kvpress class, constructor kwargs besides compression_ratio, wrapper class or None, description)
PRESSES: dict[str, tuple[str, dict, str | None, str]] = {
    "kvzip": ("KVzipPress", {}, None,
              "KVzip: keys scored by how much reconstructing the document attends to them, one budget "
              "across all layers and KV heads"),
    "kvzip_layerwise": ("KVzipPress", {"layerwise": True}, None, "KVzip with a budget per layer"),
    "expected_attention": ("ExpectedAttentionPress", {}, None,
                           "keys scored by the attention expected from future queries"),
    "adakv_expected_attention": ("ExpectedAttentionPress", {}, "AdaKVPress",
                                 "ExpectedAttention with AdaKV's head-wise budget"),
    "snapkv": ("SnapKVPress", {}, None, "keys scored by the attention of the document's last 64 tokens"),
    "pyramidkv": ("PyramidKVPress", {}, None, "SnapKV scores with a pyramid of per-layer budgets"),
    "streaming_llm": ("StreamingLLMPress", {}, None, "the first 4 tokens (sinks) and the most recent ones"),
    "knorm": ("KnormPress", {}, None, "keys with the smallest norm kept"),
    "tova": ("TOVAPress", {}, None, "keys scored by the last token's attention (averaged over heads)"),
    "keydiff": ("KeyDiffPress", {}, None, "keys least similar to the mean key kept"),
}

# Presses whose scores do not depend on compression_ratio (KVzip's reconstruction attention): one
# scoring pass serves every job of the press; compress_post picks each ratio's masks from its scores.
SCORED_ONCE = frozenset({"kvzip", "kvzip_layerwise"})

# Presses that fetch weights or data from the Hugging Face hub (nothing is fetched at run time here).
UNAVAILABLE: dict[str, str] = {
    "duo_attention": "DuoAttentionPress downloads its head patterns (or the booksum dataset) from the hub",
    "qfilter": "QFilterPress downloads its Q-filters (nthngdy/<model>_qfilt) from the hub",
    "fastkvzip": "FastKVzipPress downloads its gates (Jang-Hyun/Fast-KVzip) from the hub",
    "kvzap": "KVzapPress downloads its scoring model from the hub",
    "restorekv": "RestoreKVPress downloads its restore embeddings from the hub",
    "expected_attention_stats": "ExpectedAttentionStatsPress downloads query statistics (a dataset) from the hub",
}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def load_by_path(name: str, path: str | Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up while being defined
    spec.loader.exec_module(mod)
    return mod


def load_quantization(path: str | None):
    """nectar/quantization.py, by path (torch-only), or None when no quantized job is asked for."""
    return load_by_path("nectar_quantization", path) if path else None


@functools.cache
def _cache_call():
    return load_by_path("nectar_cache_call", CACHE_CALL_PY)


def cache_kwargs(module, cache) -> dict:
    """nectar/cache_call.py's ``cache_kwargs`` (dependency-free, beside this file's package): the
    cache argument's name this transformers declares (``past_key_values`` in kvpress's pin)."""
    return _cache_call().cache_kwargs(module, cache)


def exact_head_masks() -> None:
    """Head-wise presses (KVzip global, AdaKV) leave the entries they drop in each attention module's
    ``masked_key_indices``; kvpress then hides them by overwriting their keys with a "fake key" found
    by a hyperplane search, which can fail (it raises on the tiny test model's pair queries). Here the
    same entries are masked out of the softmax exactly instead: same semantics (their weight is 0),
    no search. Registered over kvpress's patch of the sdpa attention function."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    def masked_sdpa(module, query, key, value, attention_mask, dropout=0.0, **kwargs):
        b, hq, q, _ = query.shape  # [b, Hq, q, d]
        hkv, k = key.shape[1], key.shape[2]  # [b, Hkv, k, d]
        if q == k:
            module.masked_key_indices = None  # a prefill: kvpress's rule, the press sets them afterwards
        idx = getattr(module, "masked_key_indices", None)
        if idx is not None:
            keep = torch.ones(b, hkv, k, dtype=torch.bool, device=query.device)  # [b, Hkv, k]
            keep[idx] = False
            keep = keep.repeat_interleave(hq // hkv, dim=1).unsqueeze(2)  # [b, Hq, 1, k]
            if attention_mask is None:  # causal: query i sits at position k − q + i
                attention_mask = torch.ones(q, k, dtype=torch.bool, device=query.device).tril(k - q)  # [q, k]
            elif attention_mask.dtype != torch.bool:
                attention_mask = attention_mask == 0  # additive float mask: 0 = attend
            attention_mask = attention_mask[..., :k] & keep  # [b, Hq, q, k]
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, **kwargs)

    ALL_ATTENTION_FUNCTIONS["sdpa"] = masked_sdpa


def build_press(name: str, compression_ratio: float):
    import kvpress

    cls, kwargs, wrapper, _ = PRESSES[name]
    press = getattr(kvpress, cls)(compression_ratio=compression_ratio, **kwargs)
    return getattr(kvpress, wrapper)(press) if wrapper else press


def model_config(req: dict):
    """The model folder's config, with the RoPE our model runs with when the request carries one
    (YaRN or another static scaling applied at load): the same positions, or the guard refuses."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(req["model_dir"])
    if req.get("rope_parameters"):
        config.rope_parameters = dict(req["rope_parameters"])
        config.max_position_embeddings = int(req["max_position_embeddings"])
        for step in ("standardize_rope_params", "validate_rope"):
            if hasattr(config, step):
                getattr(config, step)()
    return config


def reset_masks(model) -> None:
    """Head-wise presses (KVzip, AdaKV) leave the pruned indices on the attention modules; the next
    job must start without them."""
    for layer in model.model.layers:
        layer.self_attn.masked_key_indices = None


def prefill(model, doc_ids, press=None):
    """The document's cache, compressed by ``press`` when given (kvpress's own prefill path)."""
    import contextlib

    from transformers import DynamicCache

    cache = DynamicCache()
    with press(model) if press is not None else contextlib.nullcontext():
        model.model(input_ids=doc_ids, **cache_kwargs(model.model, cache))
    return cache


def score_once(model, doc_ids, name: str, compression_ratio: float):
    """(the document's cache, KVzip's scores [L, 1, Hkv, n]) from one press pass: the scores are copied
    when kvpress selects, before its context manager clears them. The cache is the whole document's
    (kvpress masks, it does not cut)."""
    press = build_press(name, compression_ratio)
    captured = {}
    select = press.compress_post

    def keep_scores(model_):
        captured["scores"] = press.score_val.clone()  # [L, 1, Hkv, n]
        select(model_)

    press.compress_post = keep_scores
    cache = prefill(model, doc_ids, press)
    return cache, captured["scores"]


def select_from_scores(model, name: str, compression_ratio: float, scores) -> None:
    """Set the attention modules' masks as a KVzip pass at ``compression_ratio`` would, from its scores."""
    press = build_press(name, compression_ratio)
    press.score_val = scores.clone()  # compress_post raises the sinks' scores in place
    press.compress_post(model)


def compressed_cache(model, doc_ids, job: dict, shared: dict | None):
    """(the job's compressed cache, seconds it cost): a press pass of its own, or, for SCORED_ONCE
    presses, a copy of the shared pass's cache with this ratio's masks (the pass's seconds counted in)."""
    name, ratio = job["press"], job["compression_ratio"]
    if shared is None or name not in SCORED_ONCE:
        t0 = time.perf_counter()
        return prefill(model, doc_ids, build_press(name, ratio)), time.perf_counter() - t0
    if name not in shared:
        t0 = time.perf_counter()
        cache, scores = score_once(model, doc_ids, name, ratio)
        shared[name] = (cache, scores, time.perf_counter() - t0)
        reset_masks(model)
    cache, scores, pass_s = shared[name]
    t0 = time.perf_counter()
    select_from_scores(model, name, ratio, scores)
    return copy.deepcopy(cache), pass_s + time.perf_counter() - t0


def kept_entries(model, cache) -> int:
    """(layer, KV head, token) entries the compressed cache keeps: its length per layer and head,
    less the entries a head-wise press masks out."""
    total = 0
    for i, layer in enumerate(cache.layers):
        b, h, t, _ = layer.keys.shape  # [1, Hkv, t, d]
        masked = getattr(model.model.layers[i].self_attn, "masked_key_indices", None)
        total += b * h * t - (0 if masked is None else int(masked[0].numel()))
    return total


def quantize_cache(cache, quant, bits: int, group: int) -> None:
    """Round every key and value through ``bits``-bit group quantization (groups along head_dim)."""
    for layer in cache.layers:
        layer.keys = quant.fake_quantize(layer.keys, bits, group)  # [1, Hkv, t, d]
        layer.values = quant.fake_quantize(layer.values, bits, group)


def entry_bytes(head_dim: int, bits: int, group: int, quant) -> int:
    """Stored bytes of one kept (layer, head, token) entry: its key and value rows."""
    return 2 * head_dim * 4 if bits == 32 else 2 * quant.quantized_nbytes((head_dim,), bits, group)


def pair_sums(model, cache, doc_len: int, pair: dict, ref, row0: int):
    """(correct, nll, kl, n, max token KL) of one pair teacher-forced against a copy of ``cache``."""
    import numpy as np
    import torch

    ids = torch.tensor([pair["ids"]], dtype=torch.long)  # [1, m]
    m, rs = ids.shape[1], pair["response_start"]
    positions = torch.arange(doc_len, doc_len + m).unsqueeze(0)  # [1, m]
    out = model(input_ids=ids, **cache_kwargs(model, copy.deepcopy(cache)), position_ids=positions, use_cache=True)
    rows = torch.arange(rs - 1, m - 1)  # logits row t predicts response token t + 1
    lp = torch.log_softmax(out.logits[0, rows].float(), dim=-1)  # [k, V]
    tgt = ids[0, rows + 1]  # [k]
    lp_ref = torch.from_numpy(np.array(ref[row0: row0 + len(rows)]))  # [k, V] (a copy: the memmap is read-only)
    kl = (lp_ref.exp() * (lp_ref - lp)).sum(-1).double().clamp_min(0.0)  # [k]
    correct = float((lp.argmax(-1) == tgt).double().sum())
    nll = float(-lp.gather(-1, tgt.unsqueeze(-1)).double().sum())
    return correct, nll, float(kl.sum()), len(rows), float(kl.max()) if len(rows) else 0.0


def score_pairs(model, cache, doc_len: int, pairs: list[dict], ref) -> dict:
    sums = {"correct": [], "nll": [], "kl": [], "n": []}
    row0, worst = 0, 0.0
    for pair in pairs:
        c, nll, kl, n, mx = pair_sums(model, cache, doc_len, pair, ref, row0)
        for k, v in zip(("correct", "nll", "kl", "n"), (c, nll, kl, n)):
            sums[k].append(v)
        row0 += n
        worst = max(worst, mx)
    return {"sums": sums, "max_token_kl": worst}


def run(workdir: Path) -> dict:
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    import kvpress

    exact_head_masks()

    req = json.loads((workdir / "request.json").read_text())
    torch.set_num_threads(int(req.get("threads") or torch.get_num_threads()))
    ref = np.load(workdir / "reference.npy", mmap_mode="r")  # [K, V]
    model = AutoModelForCausalLM.from_pretrained(req["model_dir"], config=model_config(req),
                                                 dtype=getattr(torch, req["dtype"]), attn_implementation="sdpa").eval()
    quant = load_quantization(req.get("quantization_py"))
    doc_ids = torch.tensor([req["doc_ids"]], dtype=torch.long)  # [1, n]
    n, pairs = doc_ids.shape[1], req["pairs"]
    head_dim = model.config.head_dim if getattr(model.config, "head_dim", None) else \
        model.config.hidden_size // model.config.num_attention_heads
    out: dict = {"kvpress_version": kvpress.__version__ if hasattr(kvpress, "__version__") else None,
                 "transformers_version": __import__("transformers").__version__,
                 "torch_version": torch.__version__, "jobs": {}, "unavailable": UNAVAILABLE}
    with torch.no_grad():
        t0 = time.perf_counter()
        full = prefill(model, doc_ids)
        out["prefill_s"] = time.perf_counter() - t0
        guard = score_pairs(model, full, n, pairs, ref)
        out["guard"] = {"max_token_kl": guard["max_token_kl"], "tolerance": req["tolerance"],
                        "mean_token_kl": sum(guard["sums"]["kl"]) / max(1, sum(guard["sums"]["n"]))}
        log(f"guard: largest per-token KL(ours ‖ kvpress full cache) = {guard['max_token_kl']:.2e}")
        if not guard["max_token_kl"] <= req["tolerance"]:
            out["refused"] = (f"kvpress's full-cache logits disagree with this project's: largest per-token KL "
                              f"{guard['max_token_kl']:.3g} > tolerance {req['tolerance']:g}")
            return out
        del full
        # SCORED_ONCE press → (its pass's cache, scores, seconds); None: a pass per job (the request's
        # "score_once": false, which the bridge's test compares against)
        shared: dict | None = {} if req.get("score_once", True) else None
        for job in req["jobs"]:
            key, bits, group = job["key"], int(job["bits"]), int(job["group"])
            if bits != 32 and quant is None:
                out["jobs"][key] = {"error": "quantized rows need nectar/quantization.py (not in this checkout)"}
                continue
            reset_masks(model)
            cache, seconds = compressed_cache(model, doc_ids, job, shared)
            t0 = time.perf_counter()
            if bits != 32:
                quantize_cache(cache, quant, bits, group)
            seconds += time.perf_counter() - t0
            kept = kept_entries(model, cache)
            t0 = time.perf_counter()
            scored = score_pairs(model, cache, n, pairs, ref)
            out["jobs"][key] = {"press_s": seconds, "score_s": time.perf_counter() - t0,
                                "scored_once": shared is not None and job["press"] in SCORED_ONCE,
                                "kept_entries": kept, "state_bytes": kept * entry_bytes(head_dim, bits, group, quant),
                                "sums": scored["sums"]}
            kl = sum(scored["sums"]["kl"]) / max(1, sum(scored["sums"]["n"]))
            log(f"{key}: press {seconds:.1f}s, kept {kept} entries, KL {kl:.4f}")
            del cache
        reset_masks(model)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workdir")
    args = ap.parse_args()
    workdir = Path(args.workdir)
    result = run(workdir)
    tmp = workdir / "result.json.tmp"
    tmp.write_text(json.dumps(result, allow_nan=True))
    tmp.rename(workdir / "result.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
