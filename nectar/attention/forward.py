"""Teacher-forced forwards over query tokens only, with the document supplied by a provider.

``provider`` = ExactDocState(doc_kv)    → the full-context model (exact, document prefilled once)
``provider`` = ModuleDocState(module)   → the NECTAR-plugged model (no document KV at all)
``provider`` = None                     → the no-document model
Query tokens always sit at positions n … n+m-1 (docs/design.md §3). Sampling is ``engine.generate``.
"""
from __future__ import annotations

import torch

from ..base_model import BaseLM
from .interface import DocStateProvider, nectar_attention


def query_logits(
    base: BaseLM,
    provider: DocStateProvider | None,
    input_ids: torch.Tensor,  # [b, m] right-padded
    n: int,
    attention_mask: torch.Tensor | None = None,  # [b, m] 1 = real token
) -> torch.Tensor:
    """Teacher-forced logits [b, m, V] of the query tokens; differentiable w.r.t. the provider."""
    b, m = input_ids.shape
    positions = (n + torch.arange(m, device=input_ids.device)).unsqueeze(0).expand(b, m)  # [b, m]
    with nectar_attention(base.model, provider):
        out = base.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions,
                         use_cache=False)
    return out.logits
