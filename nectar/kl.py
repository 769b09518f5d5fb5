"""The KL between a teacher's next-token distribution, kept as its top-K log-probs, and a student's logits:
the distillation loss of training (training/loop.py) and of a state refined end to end
(states/recon_refine.py) — one implementation, below both.

With p_k = teacher probs of its top-K ids and p_tail = 1 − Σ p_k (likewise q_k, q_tail for the student at
the same ids), KL = Σ_k p_k log(p_k / q_k) + p_tail log(p_tail / q_tail): the exact KL between the two
distributions coarsened to K+1 outcomes — a lower bound of the full-vocabulary KL (data-processing
inequality) that, unlike renormalising both to the top-K, still penalises student mass that falls outside
the teacher's top-K.
"""
from __future__ import annotations

import torch

_EPS = 1e-12


def kl_topk_tail_sum(logits: torch.Tensor, topk_ids: torch.Tensor, topk_logprobs: torch.Tensor,
                     mask: torch.Tensor) -> torch.Tensor:
    """Σ over masked positions of KL(teacher top-K + tail ‖ student top-K + tail).

    logits [b, m, V] (student), topk_ids / topk_logprobs [b, m, K] (teacher), mask [b, m] bool.
    """
    logq = torch.log_softmax(logits.float(), dim=-1).gather(-1, topk_ids)  # [b, m, K]
    logp = topk_logprobs.float()  # [b, m, K]
    p = logp.exp()
    head = (p * (logp - logq)).sum(-1)  # [b, m]
    p_tail = (1.0 - p.sum(-1)).clamp_min(0.0)  # [b, m]
    q_tail = -torch.expm1(torch.logsumexp(logq, dim=-1).clamp_max(-_EPS))  # 1 − Σ q_k, kept > 0
    tail = torch.xlogy(p_tail, p_tail) - p_tail * torch.log(q_tail.clamp_min(_EPS))
    kl = head + tail  # [b, m]
    return torch.where(mask, kl, torch.zeros_like(kl)).sum()
