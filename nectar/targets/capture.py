"""One forward per batch of pairs that both runs the model exactly and records its targets.

With ``ExactDocState`` as provider, the NECTAR attention merges the exact document state with the
local causal state, so the logits equal the ordinary full forward; the recorder keeps, at every layer
and query head, the rotated query q and the document state (A, α) for every query token.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention.interface import nectar_attention
from ..attention.prefix import ExactDocState
from ..attention.state import AttnState
from ..models import BaseModel


@dataclass
class CapturedBatch:
    q: torch.Tensor  # [b, m, L, hq, d]
    alpha: torch.Tensor  # [b, m, L, hq]
    A: torch.Tensor  # [b, m, L, hq, d]
    topk_ids: torch.Tensor  # [b, m, K] int
    topk_logprobs: torch.Tensor  # [b, m, K] float32
    logits: torch.Tensor | None = None  # [b, m, V] (only when asked; tests use it)


class _Recorder:
    def __init__(self, num_layers: int):
        self.q: list[torch.Tensor | None] = [None] * num_layers
        self.alpha: list[torch.Tensor | None] = [None] * num_layers
        self.A: list[torch.Tensor | None] = [None] * num_layers

    def __call__(self, layer: int, q: torch.Tensor, doc: AttnState | None) -> None:
        # q: [b, hq, m, d] → stored token-major [b, m, hq, d]
        self.q[layer] = q.detach().float().transpose(1, 2)
        self.alpha[layer] = doc.lse.detach().transpose(1, 2)  # [b, m, hq]
        self.A[layer] = doc.out.detach().transpose(1, 2)  # [b, m, hq, d]


@torch.no_grad()
def capture_batch(
    base: BaseModel,
    provider: ExactDocState,
    input_ids: torch.Tensor,  # [b, m] right-padded
    attention_mask: torch.Tensor,  # [b, m]
    n: int,
    top_k: int,
    keep_logits: bool = False,
    logit_mask: torch.Tensor | None = None,  # [b, m] bool: positions that need the teacher's top-K
) -> CapturedBatch:
    """``logit_mask`` = None computes the top-K at every position; otherwise the LM head runs only
    on the masked positions (the KL loss reads the top-K only where the next token is a response
    token, and the head is ~15% of the capture's FLOPs) and the other rows of the top-K are zeros."""
    b, m = input_ids.shape
    rec = _Recorder(base.num_layers)
    positions = (n + torch.arange(m, device=input_ids.device)).unsqueeze(0).expand(b, m)
    with nectar_attention(base.model, provider, recorder=rec):
        # Right padding needs no mask under causal attention (pads only follow real tokens), and
        # without one the local part takes the fused causal kernel.
        if logit_mask is None:
            logits = base.model(input_ids=input_ids, position_ids=positions, use_cache=False).logits  # [b, m, V]
            top_ids, top_lp = _topk_logprobs(logits, top_k)
        else:
            hidden = base.model.get_decoder()(input_ids=input_ids, position_ids=positions,
                                              use_cache=False).last_hidden_state  # [b, m, H]
            logits = base.model.get_output_embeddings()(hidden[logit_mask])  # [N, V]
            ids, lp = _topk_logprobs(logits, top_k)  # [N, K]
            top_ids = torch.zeros((b, m, top_k), dtype=ids.dtype, device=ids.device)
            top_lp = torch.zeros((b, m, top_k), dtype=lp.dtype, device=lp.device)
            top_ids[logit_mask], top_lp[logit_mask] = ids, lp
    return CapturedBatch(
        q=torch.stack(rec.q, dim=2), alpha=torch.stack(rec.alpha, dim=2), A=torch.stack(rec.A, dim=2),
        topk_ids=top_ids.int(), topk_logprobs=top_lp,
        logits=logits if keep_logits else None,
    )


def _topk_logprobs(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-K ids and log-probs over the last axis: top-K of the logits minus their log-sum-exp,
    without writing a second vocabulary-sized tensor."""
    top = logits.topk(top_k, dim=-1)
    lse = torch.logsumexp(logits.float(), dim=-1, keepdim=True)
    return top.indices, top.values.float() - lse
