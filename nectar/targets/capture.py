"""One forward per batch of pairs that both runs the model exactly and records its targets.

With ``ExactDocState`` as provider, the NECTAR attention merges the exact document state with the
local causal state, so the logits equal the ordinary full forward; the recorder keeps, at every layer
and query head, the rotated query q and the document state (A, α) for every query token.

The pairs of a batch are packed into one row, back to back (no padding): every query token sits at
its own position n + i, attends to the document through the provider and to its own pair's earlier
tokens locally. The recorded rows are then already the token-major rows the Zarr group stores.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention.interface import nectar_attention
from ..attention.exact import ExactDocState
from ..attention.state import AttnState
from ..base_model import BaseLM

# LM-head rows per step: a [rows, V] logit block stays cache-sized instead of one [T, V] tensor
# (49k vocabulary x 750 tokens is 147 MB, written and re-read three times by topk/logsumexp).
HEAD_ROWS = 128


@dataclass
class CapturedRows:
    q: torch.Tensor | None  # [T, L, hq, d] float32 (None when not recorded)
    alpha: torch.Tensor | None  # [T, L, hq]
    A: torch.Tensor | None  # [T, L, hq, d]
    topk_ids: torch.Tensor  # [T, K] int32 (zeros outside logit_rows)
    topk_logprobs: torch.Tensor  # [T, K] float32 (zeros outside logit_rows)
    logits: torch.Tensor | None = None  # [T, V] (only when asked; tests use it)


class _Recorder:
    """Writes each layer's q, α, A straight into preallocated token-major tensors (one copy each,
    no per-layer list to stack afterwards)."""

    def __init__(self, num_layers: int):
        self.num_layers = num_layers
        self.q = self.alpha = self.A = None

    def __call__(self, layer: int, q: torch.Tensor, doc: AttnState | None, local: AttnState | None = None) -> None:
        # q, doc.out: [1, hq, T, d]; doc.lse: [1, hq, T] → rows [T, hq, (d)] of layer `layer`
        if self.q is None:
            _, hq, t, d = q.shape
            self.q = torch.empty((t, self.num_layers, hq, d), dtype=torch.float32, device=q.device)
            self.A = torch.empty_like(self.q)
            self.alpha = torch.empty((t, self.num_layers, hq), dtype=torch.float32, device=q.device)
        self.q[:, layer] = q[0].transpose(0, 1)
        self.alpha[:, layer] = doc.lse[0].transpose(0, 1)
        self.A[:, layer] = doc.out[0].transpose(0, 1)


def pack(sequences: list[list[int]], n: int, device) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, int]]]:
    """Token ids [1, T], positions [1, T] (n, n+1, … within each sequence) and the segments."""
    segments, start = [], 0
    for s in sequences:
        if not s:
            raise ValueError("cannot pack an empty sequence")
        segments.append((start, start + len(s)))
        start += len(s)
    ids = torch.tensor([t for s in sequences for t in s], dtype=torch.long, device=device).unsqueeze(0)
    positions = torch.cat([torch.arange(n, n + len(s), device=device) for s in sequences]).unsqueeze(0)
    return ids, positions, segments


@torch.no_grad()
def capture_packed(
    base: BaseLM,
    provider: ExactDocState,
    sequences: list[list[int]],  # the pairs' query tokens (instruction + response)
    n: int,
    top_k: int,
    logit_rows: torch.Tensor | None = None,  # [T] bool: rows that need the teacher's top-K
    keep_logits: bool = False,
    record: bool = True,
) -> CapturedRows:
    """``logit_rows`` = None computes the top-K at every token; otherwise the LM head runs only on
    those rows (the KL loss reads the top-K only where the next token is a response token, and the
    head is ~15% of the capture's FLOPs) and the other rows of the top-K are zeros. ``record`` =
    False skips q, α, A (online targets store only the teacher's top-K)."""
    ids, positions, segments = pack(sequences, n, base.device)
    t = ids.shape[1]
    rec = _Recorder(base.num_layers) if record else None
    with nectar_attention(base.model, provider, recorder=rec, segments=segments):
        hidden = base.model.get_decoder()(input_ids=ids, position_ids=positions,
                                          use_cache=False).last_hidden_state[0]  # [T, H]
    rows = torch.arange(t, device=ids.device) if logit_rows is None else logit_rows.nonzero().squeeze(1)
    ids_k, lp_k, logits = _head_topk(base, hidden[rows], top_k, keep_logits)  # [N, K]
    top_ids = torch.zeros((t, top_k), dtype=torch.int32, device=ids.device)
    top_lp = torch.zeros((t, top_k), dtype=torch.float32, device=ids.device)
    top_ids[rows], top_lp[rows] = ids_k.int(), lp_k
    full_logits = None
    if keep_logits:
        full_logits = torch.zeros((t, logits.shape[-1]), dtype=logits.dtype, device=logits.device)
        full_logits[rows] = logits
    return CapturedRows(q=rec.q if rec else None, alpha=rec.alpha if rec else None, A=rec.A if rec else None,
                        topk_ids=top_ids, topk_logprobs=top_lp, logits=full_logits)


def _head_topk(base: BaseLM, hidden: torch.Tensor, top_k: int, keep_logits: bool):
    """The LM head over ``hidden`` [N, H] in blocks of HEAD_ROWS → top-K ids, log-probs [N, K]."""
    head = base.model.get_output_embeddings()
    ids, lps, kept = [], [], []
    for start in range(0, hidden.shape[0], HEAD_ROWS):
        logits = head(hidden[start:start + HEAD_ROWS])  # [rows, V]
        i, lp = topk_logprobs(logits, top_k)
        ids.append(i)
        lps.append(lp)
        if keep_logits:
            kept.append(logits)
    if not ids:
        empty = hidden.new_zeros((0, top_k))
        return empty.long(), empty.float(), hidden.new_zeros((0, head.out_features)) if keep_logits else None
    return torch.cat(ids), torch.cat(lps), torch.cat(kept) if keep_logits else None


def topk_logprobs(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-K ids and log-probs over the last axis: top-K of the logits minus their log-sum-exp,
    without writing a second vocabulary-sized tensor."""
    top = logits.topk(top_k, dim=-1)
    lse = torch.logsumexp(logits.float(), dim=-1, keepdim=True)
    return top.indices, top.values.float() - lse
