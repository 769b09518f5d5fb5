"""Choosing the next token: greedy at temperature 0, else temperature + nucleus (top-p) sampling.

Each row samples with its own torch.Generator seeded from its request, so a request's output
depends only on its own seed and logits — not on which other requests share its batch.
Sampling is by inverse CDF (one uniform draw per token) over the nucleus; the nucleus is found
in the top-256 probabilities when they hold enough mass (almost always for a trained model), with
a full sort as the exact fallback — sorting a 50k–150k vocabulary per token dominated decode time.
"""
from __future__ import annotations

import torch

NUCLEUS_FAST_K = 256


def row_generator(seed: int, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(seed & 0x7FFF_FFFF_FFFF_FFFF)
    return g


def next_token(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> int:
    """logits [V] (already masked by any grammar: forbidden tokens are -inf) → one token id."""
    if temperature <= 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / temperature, dim=-1)  # [V]
    if top_p >= 1.0:
        order, cdf = None, probs.cumsum(dim=0)  # [V]
    else:
        vals, order = probs.topk(min(NUCLEUS_FAST_K, probs.numel()))  # [k] descending
        if float(vals.sum()) < top_p:  # the nucleus is wider than the top-k: exact full sort
            vals, order = probs.sort(descending=True)
        # smallest prefix whose mass reaches top_p (always at least the top token)
        keep = int(((vals.cumsum(dim=0) - vals) < top_p).sum())
        order, cdf = order[:keep], vals[:keep].cumsum(dim=0)  # [keep]
    u = torch.rand((), generator=generator, device=probs.device) * cdf[-1]
    i = min(int(torch.searchsorted(cdf, u, right=True)), cdf.numel() - 1)
    return int(order[i]) if order is not None else i
