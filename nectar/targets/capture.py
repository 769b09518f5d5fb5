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
) -> CapturedBatch:
    b, m = input_ids.shape
    rec = _Recorder(base.num_layers)
    positions = (n + torch.arange(m, device=input_ids.device)).unsqueeze(0).expand(b, m)
    with nectar_attention(base.model, provider, recorder=rec):
        # Right padding needs no mask under causal attention (pads only follow real tokens), and
        # without one the local part takes the fused causal kernel.
        logits = base.model(input_ids=input_ids, position_ids=positions, use_cache=False).logits  # [b, m, V]
    # top-K of the logits minus their log-sum-exp = top-K of the log-softmax, without writing a
    # second [b, m, V] tensor.
    top = logits.topk(top_k, dim=-1)
    lse = torch.logsumexp(logits.float(), dim=-1, keepdim=True)  # [b, m, 1]
    return CapturedBatch(
        q=torch.stack(rec.q, dim=2), alpha=torch.stack(rec.alpha, dim=2), A=torch.stack(rec.A, dim=2),
        topk_ids=top.indices.int(), topk_logprobs=top.values.float() - lse,
        logits=logits if keep_logits else None,
    )
