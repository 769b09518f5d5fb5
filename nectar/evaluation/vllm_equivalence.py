"""Does vLLM with a document's state answer as the torch engine with the same state?

For each instruction: the torch engine (``nectar.attention.engine.generate``, the state as an exact
KV provider at the document's positions) and vLLM (``/v1/completions`` on the placeholder prompt,
``cache_salt`` naming the document) each decode ``new_tokens`` greedy tokens with no stop token; the
first ``new_tokens`` must be identical. The per-token KL(torch ‖ vLLM) is measured along vLLM's
tokens: torch's full distribution (teacher-forced) against vLLM's top-k log-probabilities with the
rest of the vocabulary as one bucket — a coarse-graining, so it is a lower bound of the full KL that
is tight when the top k hold nearly all the mass (the bucket is reported; k is at most the server's
max_logprobs: 20 under ``nectar serve --engine vllm``, 100 in the tests).
"""
from __future__ import annotations

import json
import math
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from ..attention.doc_kv import DocKV
from ..attention.engine import generate
from ..attention.exact import ExactDocState
from ..attention.forward import query_logits
from ..attention.state import AttnState
from ..base_model import BaseLM
from .bootstrap import Estimate, PairedBootstrap
from ..layout import PromptLayout
from ..vllm.format import has_bias
from ..vllm.state import check_state, rope_inv_freq, shift_keys


class BiasedKVState:
    """Provider: attention over (keys, values) with a per-pair log-mass β [hkv, m] added to the scores —
    the quadrature module's own form (``nectar.modules.quadrature``), read back from a state file."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], betas: list[torch.Tensor]):
        self.keys, self.values, self.betas = keys, values, betas

    def __call__(self, layer: int, q: torch.Tensor, scaling: float) -> AttnState:
        k, v, beta = self.keys[layer].float(), self.values[layer].float(), self.betas[layer].float()  # [hkv, m, ·]
        b, hq, t, d = q.shape
        hkv = k.shape[0]
        g = hq // hkv
        qg = q.float().reshape(b, hkv, g, t, d).permute(1, 0, 2, 3, 4).reshape(hkv, b * g * t, d)
        logits = torch.bmm(qg, k.transpose(1, 2)) * scaling + beta.unsqueeze(1)  # [hkv, N, m]
        lse = torch.logsumexp(logits, -1)  # [hkv, N]
        out = torch.bmm(torch.softmax(logits, -1), v)  # [hkv, N, d]
        out = out.reshape(hkv, b, g, t, d).permute(1, 0, 2, 3, 4).reshape(b, hq, t, d)
        return AttnState(out, lse.reshape(hkv, b, g, t).permute(1, 0, 2, 3).reshape(b, hq, t))


def torch_provider(state_path: str, base: BaseLM, drop_bias: bool = False) -> tuple[ExactDocState | BiasedKVState, int]:
    """The state file as the torch engine's provider (keys rotated back to the document's positions; β
    added when the file has it, unless ``drop_bias``) and the document length n the query follows."""
    from safetensors.torch import load_file

    meta = check_state(state_path, base.weights_hash)
    n, m, layers = int(meta["n"]), int(meta["m"]), int(meta["num_layers"])
    t = load_file(state_path)
    inv = rope_inv_freq(base)
    keys = [shift_keys(t[f"k.{i}"], inv, n - m).to(base.device, base.dtype) for i in range(layers)]  # [hkv, m, d]
    values = [t[f"v.{i}"].to(base.device, base.dtype) for i in range(layers)]
    if has_bias(meta):
        betas = [t[f"b.{i}"].to(base.device) for i in range(layers)]  # [hkv, m]
        if drop_bias:  # β = 0 on the real pairs; the −inf pads stay pads
            betas = [torch.where(torch.isfinite(b), torch.zeros_like(b), b) for b in betas]
        return BiasedKVState(keys, values, betas), n
    return ExactDocState(DocKV(keys, values), backend="torch"), n


def vllm_complete(url: str, model: str, prompt: list[int], max_tokens: int, doc_id: str | None,
                  logprobs: int = 0, timeout_s: float = 600.0, **extra) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "return_tokens_as_token_ids": True, **extra}
    if logprobs:
        body["logprobs"] = logprobs
    if doc_id is not None:
        body["cache_salt"] = doc_id
    req = urllib.request.Request(url.rstrip("/") + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.loads(r.read())["choices"][0]


def token_ids(choice: dict) -> list[int]:
    """Generated ids of a completion choice (``return_tokens_as_token_ids``: tokens are 'token_id:N')."""
    if choice.get("token_ids"):
        return list(choice["token_ids"])
    return [int(t.split(":", 1)[1]) for t in choice["logprobs"]["tokens"]]


def coarse_kl(torch_logp: torch.Tensor, top: dict[str, float]) -> tuple[float, float]:
    """KL(torch ‖ vLLM) over {vLLM's top-k tokens, the rest} and the rest's vLLM mass.
    torch_logp [V] float64 log-probabilities; top {'token_id:N': logprob}."""
    ids = torch.tensor([int(k.split(":", 1)[1]) for k in top], dtype=torch.long)
    lv = torch.tensor(list(top.values()), dtype=torch.float64)  # [k]
    lt = torch_logp[ids]  # [k]
    kl = float((lt.exp() * (lt - lv)).sum())
    rest_t = max(0.0, 1.0 - float(lt.exp().sum()))
    rest_v = max(1e-300, 1.0 - float(lv.exp().sum()))
    if rest_t > 0:
        kl += rest_t * math.log(rest_t / rest_v)
    return kl, rest_v


@dataclass
class Equivalence:
    prompts: int
    tokens: int
    identical: Estimate  # share of prompts whose first new_tokens greedy tokens are identical
    kl: Estimate  # per-token KL(torch ‖ vLLM), nats
    max_rest_mass: float  # largest vLLM mass outside its top k (how tight the KL bound is)
    first_divergence: list[int | None]  # per prompt: index of the first differing token, None if none

    def line(self) -> str:
        return (f"{self.prompts} prompts × {self.tokens // max(self.prompts, 1)} tokens: identical greedy "
                f"{self.identical.fmt(3)}; per-token KL(torch‖vLLM) {self.kl.fmt(6)} nats "
                f"(top-k rest mass ≤ {self.max_rest_mass:.1e})")


@torch.no_grad()
def equivalence(base: BaseLM, layout: PromptLayout, state_path: str, url: str, model: str,
                instructions: list[str], placeholder_id: int, doc_id: str | None, new_tokens: int = 32,
                top_k: int = 1000, seed: int = 0) -> Equivalence:
    prompts = [layout.prompt(text).ids for text in instructions]
    return equivalence_ids(base, state_path, url, model, prompts, placeholder_id, doc_id, new_tokens, top_k, seed)


@torch.no_grad()
def equivalence_ids(base: BaseLM, state_path: str, url: str, model: str, prompts: list[list[int]],
                    placeholder_id: int, doc_id: str | None, new_tokens: int = 32, top_k: int = 1000,
                    seed: int = 0) -> Equivalence:
    """``equivalence`` on prompts given as the query-side token ids (what follows the document)."""
    provider, n = torch_provider(state_path, base)
    m = int(check_state(state_path, base.weights_hash)["m"])
    with ThreadPoolExecutor(max_workers=16) as pool:  # in flight together: vLLM batches them
        choices = list(pool.map(lambda p: vllm_complete(url, model, [placeholder_id] * m + p, new_tokens, doc_id,
                                                         logprobs=top_k), prompts))
    torch_out = generate(base, provider, n, prompts, new_tokens, stop_ids=()).tokens
    same, kl_sums, counts, rests, first = [], [], [], [], []
    for prompt, mine, choice in zip(prompts, torch_out, choices):
        theirs = token_ids(choice)
        diff = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), None)
        if diff is None and len(mine) != len(theirs):
            diff = min(len(mine), len(theirs))
        first.append(diff)
        same.append(float(diff is None))
        ids = torch.tensor([prompt + theirs[:-1]], device=base.device)  # [1, L]
        logp = torch.log_softmax(query_logits(base, provider, ids, n)[0, len(prompt) - 1:].double(), -1)  # [T, V]
        total = 0.0
        for t, top in enumerate(choice["logprobs"]["top_logprobs"]):
            kl, rest = coarse_kl(logp[t].cpu(), top)
            total += kl
            rests.append(rest)
        kl_sums.append(total)
        counts.append(len(theirs))
    boot = PairedBootstrap(len(prompts), seed=seed, key="vllm-equivalence")
    return Equivalence(len(prompts), int(sum(counts)), boot.mean(np.array(same)),
                       boot.ratio(np.array(kl_sums), np.array(counts, dtype=float)),
                       float(max(rests)) if rests else float("nan"), first)


def vllm_prompt_logprobs(url: str, model: str, prompt: list[int], doc_id: str | None, top_k: int,
                         timeout_s: float = 600.0) -> list[dict[str, float] | None]:
    """vLLM's teacher-forced top-k log-probabilities at every prompt position ({token id: logprob}, the
    prompt's own token always included; None at position 0), from ``prompt_logprobs``."""
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": top_k}
    if doc_id is not None:
        body["cache_salt"] = doc_id
    req = urllib.request.Request(url.rstrip("/") + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        got = json.loads(r.read())
    rows = got["choices"][0].get("prompt_logprobs") or got.get("prompt_logprobs")
    out: list[dict[str, float] | None] = []
    for row in rows:
        out.append(None if row is None else {f"token_id:{int(k)}": float(v["logprob"] if isinstance(v, dict) else v)
                                             for k, v in row.items()})
    return out


@dataclass
class ProbeFidelity:
    pairs: int
    tokens: int
    recovered_vllm: Estimate  # 1 − KL(full ‖ vLLM) / KL(full ‖ none), coarse-grained on vLLM's top-k buckets
    recovered_torch: Estimate  # the same state through the torch engine, the same buckets
    recovered_torch_exact: Estimate  # the torch engine, full vocabulary (the module's own figure)
    kl_torch_vllm: Estimate  # KL(torch ‖ vLLM), coarse, nats/token
    kl_vllm: Estimate  # KL(full ‖ vLLM), coarse, nats/token (the KL that recovered_vllm is 1 − · / KL(none) of)
    top_k: int  # the buckets: vLLM's top k at each position, and the rest of the vocabulary as one

    def line(self) -> str:
        pct = lambda e: e.fmt(1, 100.0)  # noqa: E731
        return (f"{self.pairs} pairs / {self.tokens} tokens: KL recovered through vLLM {pct(self.recovered_vllm)} % vs "
                f"torch {pct(self.recovered_torch)} % (same top-k buckets; torch, full vocabulary "
                f"{pct(self.recovered_torch_exact)} %); KL(torch‖vLLM) {self.kl_torch_vllm.fmt(6)} nats/token")

    def as_dict(self) -> dict:
        """The figures as JSON: each estimate as [value, low, high] (the benchmark's and compare's notes)."""
        est = ("recovered_vllm", "recovered_torch", "recovered_torch_exact", "kl_torch_vllm", "kl_vllm")
        return {"line": self.line(), "pairs": self.pairs, "tokens": self.tokens, "top_k": self.top_k,
                **{k: [getattr(self, k).value, getattr(self, k).low, getattr(self, k).high] for k in est}}


def _kl(p_log: torch.Tensor, q_log: torch.Tensor) -> float:
    return float((p_log.exp() * (p_log - q_log)).sum())


def _coarse(logp: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """[V] log-probs → [k + 1]: the k bucket tokens, then the rest of the vocabulary as one."""
    top = logp[ids]
    rest = torch.clamp(1.0 - top.exp().sum(), min=1e-300).log()
    return torch.cat([top, rest.view(1)])


@torch.no_grad()
def probe_fidelity(base: BaseLM, doc_kv: DocKV, state_path: str, url: str, model: str, pairs: list, placeholder_id: int,
                   doc_id: str | None, top_k: int = 100, seed: int = 0) -> ProbeFidelity:
    """Teacher-forced quality of the served state on held-out pairs (``EvalPair``: query-side ids, response start)
    through vLLM's ``prompt_logprobs`` against the same state in the torch engine and the full-context model.
    vLLM returns only its top k per position, so every KL here is taken over {those k tokens, the rest}: a
    coarse-graining, the same for every system compared; the torch engine's full-vocabulary figure is beside it."""
    provider, n = torch_provider(state_path, base)
    m = int(check_state(state_path, base.weights_hash)["m"])
    full = ExactDocState(doc_kv, backend="torch")
    with ThreadPoolExecutor(max_workers=16) as pool:
        served = list(pool.map(lambda p: vllm_prompt_logprobs(url, model, [placeholder_id] * m + list(p.ids), doc_id,
                                                               top_k), pairs))
    sums = {k: [] for k in ("none", "vllm", "torch", "none_exact", "torch_exact", "tv")}
    counts = []
    for pair, rows in zip(pairs, served):
        ids = torch.tensor([list(pair.ids)], device=base.device)
        lp = {name: torch.log_softmax(query_logits(base, prov, ids, n)[0].double().cpu(), -1)  # [L, V]
              for name, prov in (("full", full), ("torch", provider), ("none", None))}
        acc = dict.fromkeys(sums, 0.0)
        positions = range(pair.response_start, len(pair.ids))
        for t in positions:  # token t is predicted at position t − 1
            top = rows[m + t]
            bucket = torch.tensor([int(k.split(":", 1)[1]) for k in top])
            lv = torch.tensor(list(top.values()), dtype=torch.float64)
            v = torch.cat([lv, torch.clamp(1.0 - lv.exp().sum(), min=1e-300).log().view(1)])
            f, tr, no = (_coarse(lp[k][t - 1], bucket) for k in ("full", "torch", "none"))
            acc["vllm"] += _kl(f, v)
            acc["torch"] += _kl(f, tr)
            acc["none"] += _kl(f, no)
            acc["tv"] += _kl(tr, v)
            acc["torch_exact"] += _kl(lp["full"][t - 1], lp["torch"][t - 1])
            acc["none_exact"] += _kl(lp["full"][t - 1], lp["none"][t - 1])
        for k in sums:
            sums[k].append(acc[k])
        counts.append(len(positions))
    a = {k: np.array(v) for k, v in sums.items()}
    boot = PairedBootstrap(len(pairs), seed=seed, key="vllm-probe-fidelity")
    tokens = np.array(counts, dtype=float)
    return ProbeFidelity(len(pairs), int(sum(counts)), boot.recovered(a["vllm"], a["none"]),
                         boot.recovered(a["torch"], a["none"]), boot.recovered(a["torch_exact"], a["none_exact"]),
                         boot.ratio(a["tv"], tokens), boot.ratio(a["vllm"], tokens), top_k)
