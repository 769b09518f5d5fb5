"""Teacher-forced metrics (paper §4.2, App. C): pure functions over logits and attention states.

Three models answer the same query tokens under teacher forcing: the module-plugged model, the
full-context model (exact document state) and the no-document model. On the *response* tokens of
each pair we measure next-token accuracy, LM cross-entropy and the KL to the full-context model;
from the cached targets we measure, per layer and query head, the score/target squared errors and
the relative transport error of App. C (eq. rte).

Conventions, used throughout:
  * logits[t] predicts token t+1, so response token t (t >= response_start >= 1) is scored by
    logits[t-1]. Prompt tokens are never scored: the module exists to help answer, not to recite
    the instruction.
  * KL is KL(full || model) = sum_v p_full(v) (log p_full(v) - log p_model(v)), in nats: the
    distillation direction of the paper's L_KL (teacher first).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# Floor for the squared errors inside the log of the relative transport error: an exact prediction
# (error 0, e.g. the exact provider checked against its own targets) would otherwise give -inf.
RTE_FLOOR = 1e-20


def response_targets(input_ids: torch.Tensor, response_start: torch.Tensor,
                     lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token targets and the mask of positions whose target is a response token.

    input_ids [b, m] (right-padded), response_start [b], lengths [b] (unpadded lengths).
    Returns targets [b, m] (ids shifted left by one; last column 0) and mask [b, m] bool, where
    mask[i, t] means "logits[i, t] predicts response token t+1 of pair i".
    """
    b, m = input_ids.shape
    targets = torch.zeros_like(input_ids)
    targets[:, :-1] = input_ids[:, 1:]
    t = torch.arange(m, device=input_ids.device).unsqueeze(0)  # [1, m]
    predicted = t + 1  # the position each logit row predicts
    mask = (predicted >= response_start.unsqueeze(1)) & (predicted < lengths.unsqueeze(1))
    if (response_start < 1).any():
        raise ValueError("response_start must be >= 1: a response token needs a token before it")
    return targets, mask


@dataclass
class TokenSums:
    """Running sums over scored tokens for one model; merge batches with ``add``."""

    correct: float = 0.0
    nll: float = 0.0
    kl: float = 0.0
    n: int = 0

    def add(self, other: "TokenSums") -> "TokenSums":
        return TokenSums(self.correct + other.correct, self.nll + other.nll, self.kl + other.kl,
                         self.n + other.n)

    @property
    def token_acc(self) -> float:
        return self.correct / self.n if self.n else float("nan")

    @property
    def cross_entropy(self) -> float:
        return self.nll / self.n if self.n else float("nan")

    @property
    def kl_to_full(self) -> float:
        return self.kl / self.n if self.n else float("nan")


def scored_sums(logits: torch.Tensor, lp_full: torch.Tensor, targets: torch.Tensor, rows: torch.Tensor,
                n_rows: int, p_full: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """Per-row sums of correct predictions, NLL and KL(full || model), and the token counts.

    logits [k, V] at the k scored positions; lp_full [k, V] the full model's log-probs there (its
    probs ``p_full`` when already computed); targets [k]; rows [k] the row (pair) of each position.
    Returns four float64 tensors [n_rows]: correct, nll, kl, n.
    """
    lp = torch.log_softmax(logits.float(), dim=-1)  # [k, V]
    p_full = lp_full.exp() if p_full is None else p_full
    correct = (lp.argmax(dim=-1) == targets).double()  # [k]
    nll = -lp.gather(-1, targets.unsqueeze(-1)).squeeze(-1).double()  # [k]
    # KL ≥ 0 per token; summing 49k terms leaves float noise of ±1e-7 around 0 for identical models
    kl = (p_full * (lp_full - lp)).sum(-1).double().clamp_min(0.0)  # [k]
    return tuple(torch.zeros(n_rows, dtype=torch.float64, device=x.device).index_add_(0, rows, x)
                 for x in (correct, nll, kl, torch.ones_like(correct)))


def token_sums(logits: torch.Tensor, full_logits: torch.Tensor, targets: torch.Tensor,
               mask: torch.Tensor) -> TokenSums:
    """Sums of correct predictions, NLL and KL(full || model) over the masked positions.

    logits, full_logits [b, m, V]; targets [b, m] long; mask [b, m] bool.
    """
    if logits.shape != full_logits.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and full_logits {tuple(full_logits.shape)} differ")
    sel = mask.bool()
    lp_full = torch.log_softmax(full_logits[sel].float(), dim=-1)  # [k, V]
    rows = torch.zeros(int(sel.sum()), dtype=torch.long, device=logits.device)  # one row: everything
    correct, nll, kl, n = scored_sums(logits[sel], lp_full, targets[sel], rows, 1)
    return TokenSums(float(correct), float(nll), float(kl), int(n))


def accuracy_gap(acc_full: float, acc_module: float) -> float:
    """Token-accuracy gap (lower is better): full-context accuracy minus module accuracy."""
    return acc_full - acc_module


def recovered_fraction(acc_module: float, acc_full: float, acc_none: float,
                       min_benefit: float = 1e-9) -> float | None:
    """Share of the document's accuracy benefit the module recovers:
    (acc_module - acc_none) / (acc_full - acc_none). None when the document brings no benefit
    (full <= none: the ratio is undefined or flips sign, and a number would mislead)."""
    benefit = acc_full - acc_none
    if not math.isfinite(benefit) or benefit < min_benefit:
        return None
    return (acc_module - acc_none) / benefit


@dataclass
class HeadErrors:
    """Per-(layer, query head) sums of the App. C diagnostics over cached query tokens.

    Arrays are [L, Hq] float64 sums; ``means()`` divides by the number of tokens ``n``.
    """

    sq_err_alpha: torch.Tensor
    sq_err_A: torch.Tensor
    log_ratio_alpha: torch.Tensor
    log_ratio_A: torch.Tensor
    n: int = 0

    @classmethod
    def zeros(cls, num_layers: int, num_heads: int) -> "HeadErrors":
        z = lambda: torch.zeros(num_layers, num_heads, dtype=torch.float64)  # noqa: E731
        return cls(z(), z(), z(), z(), 0)

    def add_layer(self, layer: int, sums: dict[str, torch.Tensor]) -> None:
        """Add one layer's [Hq] sums from ``layer_head_errors`` (tokens are counted separately)."""
        for name in ("sq_err_alpha", "sq_err_A", "log_ratio_alpha", "log_ratio_A"):
            getattr(self, name)[layer] += sums[name]

    def means(self) -> dict[str, torch.Tensor]:
        """mse_alpha, mse_A (E_q ||A_theta - A||^2, the paper's L_A per head), rte_alpha, rte_A."""
        if self.n == 0:
            raise ValueError("no query tokens were scored")
        return {
            "mse_alpha": self.sq_err_alpha / self.n,
            "mse_A": self.sq_err_A / self.n,
            "rte_alpha": self.log_ratio_alpha / self.n,
            "rte_A": self.log_ratio_A / self.n,
        }


def layer_head_errors(q: torch.Tensor, alpha: torch.Tensor, A: torch.Tensor,
                      pred_alpha: torch.Tensor, pred_A: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-head sums over tokens of one layer's errors against the cached targets.

    q, A, pred_A [T, Hq, d]; alpha, pred_alpha [T, Hq]. Returns [Hq] float64 sums of
    (a - alpha)^2, ||A_theta - A||^2, log((a - alpha)^2 / alpha^2) and
    log(||A_theta - A||^2 / ||q - A||^2) (App. C eq. rte; the per-query log ratio).
    """
    q, alpha, A = q.double(), alpha.double(), A.double()
    pred_alpha, pred_A = pred_alpha.double(), pred_A.double()
    se_alpha = (pred_alpha - alpha) ** 2  # [T, Hq]
    se_A = ((pred_A - A) ** 2).sum(-1)  # [T, Hq]
    base_A = ((q - A) ** 2).sum(-1)  # [T, Hq]: the query-to-target baseline distance
    lr_alpha = torch.log(se_alpha.clamp_min(RTE_FLOOR)) - torch.log((alpha ** 2).clamp_min(RTE_FLOOR))
    lr_A = torch.log(se_A.clamp_min(RTE_FLOOR)) - torch.log(base_A.clamp_min(RTE_FLOOR))
    return {"sq_err_alpha": se_alpha.sum(0), "sq_err_A": se_A.sum(0),
            "log_ratio_alpha": lr_alpha.sum(0), "log_ratio_A": lr_A.sum(0)}


def total_rte(per_head_rte: torch.Tensor) -> float:
    """App. C's E_rel: the per-head expectations summed over layers and heads."""
    return float(per_head_rte.sum().item())
