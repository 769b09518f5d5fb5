"""Choosing the next token for a batch of rows on the device: greedy or temperature + nucleus (top-p).

Every row has its own temperature, top-p and seed, and its random draw depends only on (seed, index
of the token in the row's answer) — a counter-based hash computed on the device — so a row samples
the same answer whatever else shares its batch, nothing is read back to the host, and the step can
be captured in a CUDA graph (a ``torch.Generator`` per row could not).

Sampling is by inverse CDF (one uniform per token). Rows at temperature 0 take the argmax; rows with
top_p >= 1 sample the whole softmax in token order; the others sample their nucleus (the smallest
set of most probable tokens whose mass reaches top_p) in descending-probability order. On the CPU
the nucleus is looked for in the top-256 probabilities first (a host check, which costs nothing
there) with a full sort as the exact fallback — sorting a 50k–150k vocabulary per token is most of
the sampler's time on a CPU; on CUDA (one sort kernel, and no host check allowed) it is always the sort.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

NUCLEUS_FAST_K = 256
_P = 2_147_483_647  # 2^31 - 1: products of a residue and a 32-bit multiplier stay below 2^63
_MULTS = (2_654_435_761, 2_246_822_519, 3_266_489_917)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """int64 in [0, P) -> int64 in [0, P): modular multiplications and xor-shifts (no overflow)."""
    for mult, shift in zip(_MULTS, (15, 13, 16)):
        x = (x * mult + 1) % _P
        x = x ^ (x >> shift)
    return x


def uniform(seeds: torch.Tensor, index: int | torch.Tensor) -> torch.Tensor:
    """seeds [b] int64, index: the token's position in the row's answer → u [b] float32 in [0, 1)."""
    x = _mix(seeds % _P)
    x = _mix((x + (index + 1) * 40_503) % _P)
    return (x.double() / _P).float()


@dataclass
class SamplingParams:
    """Per-row sampling parameters of a batch, as device tensors (rows can be dropped with ``select``)."""

    temperature: torch.Tensor  # [b] float32; 0 = greedy
    top_p: torch.Tensor  # [b] float32
    seeds: torch.Tensor  # [b] int64
    any_sampled: bool  # host facts, so a batch computes only the paths its rows use
    any_nucleus: bool
    any_full: bool

    @classmethod
    def make(cls, temperature, top_p, seeds, device: torch.device) -> "SamplingParams":
        t = [float(x) for x in temperature]
        p = [float(x) for x in top_p]
        return cls(torch.tensor(t, dtype=torch.float32, device=device),
                   torch.tensor(p, dtype=torch.float32, device=device),
                   torch.tensor([int(s) & 0x7FFF_FFFF_FFFF_FFFF for s in seeds], dtype=torch.int64, device=device),
                   any(x > 0 for x in t), any(x > 0 and y < 1.0 for x, y in zip(t, p)),
                   any(x > 0 and y >= 1.0 for x, y in zip(t, p)))

    def select(self, rows: torch.Tensor) -> "SamplingParams":
        return SamplingParams(self.temperature[rows], self.top_p[rows], self.seeds[rows], self.any_sampled,
                              self.any_nucleus, self.any_full)


def sample(logits: torch.Tensor, params: SamplingParams, index: int | torch.Tensor,
           host_checks: bool = True) -> torch.Tensor:
    """logits [b, V] (already masked by any grammar: forbidden tokens are -inf) → token ids [b] (long).

    ``index``: the position of the token being drawn in each row's answer (0 for the first).
    ``host_checks=False`` (CUDA graphs): no data-dependent branch; the nucleus always uses the sort."""
    greedy = logits.argmax(dim=-1)  # [b]
    if not params.any_sampled:
        return greedy
    t = params.temperature.clamp_min(1e-6).unsqueeze(-1)  # [b, 1]
    probs = torch.softmax(logits.float() / t, dim=-1)  # [b, V]
    u = uniform(params.seeds, index).unsqueeze(-1)  # [b, 1]
    tok = greedy
    if params.any_full:  # rows with top_p >= 1: the whole softmax, in token order
        tok = _inverse_cdf(probs.cumsum(dim=-1), u, None)
    if params.any_nucleus:
        vals, order = _nucleus_candidates(probs, params.top_p, host_checks)  # [b, k] descending
        keep = (vals.cumsum(dim=-1) - vals) < params.top_p.unsqueeze(-1)  # prefix reaching top_p
        nucleus = _inverse_cdf((vals * keep).cumsum(dim=-1), u, order)
        tok = torch.where(params.top_p < 1.0, nucleus, tok)
    return torch.where(params.temperature > 0, tok, greedy)


def _nucleus_candidates(probs: torch.Tensor, top_p: torch.Tensor, host_checks: bool):
    if host_checks and probs.shape[-1] > NUCLEUS_FAST_K:
        vals, order = probs.topk(NUCLEUS_FAST_K, dim=-1)  # [b, K], descending
        if bool((vals.sum(dim=-1) >= top_p).all()):  # every nucleus lies in the top-K
            return vals, order
    return probs.sort(dim=-1, descending=True)


def _inverse_cdf(cdf: torch.Tensor, u: torch.Tensor, order: torch.Tensor | None) -> torch.Tensor:
    """cdf [b, k] (unnormalised, non-decreasing), u [b, 1] → the sampled id per row [b]."""
    i = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp_max(cdf.shape[-1] - 1)  # [b, 1]
    return (i if order is None else order.gather(-1, i)).squeeze(-1)
