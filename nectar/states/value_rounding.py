"""The fitted values rounded onto their storage grid by the value fit's own objective (GPTQ's rounding,
Frantar et al. 2023, "GPTQ: accurate post-training quantization for generative pre-trained transformers").

The value fit (matching_fit.py) solves Z* = argmin_Z ‖RZ − T‖² + λ‖Z − prior‖² with H = RᵀR + λI. Rounding
each row of Z* to its nearest grid point on its own (``quantize_module_``) ignores that the rows are read
together: every fit query's output is a mix R[r]·Z of them. The error the rounding adds to the objective
is tr((Z − Z*)ᵀ H (Z − Z*)), and GPTQ lowers it by rounding the rows one at a time and moving the rows not
yet rounded to absorb each rounding error — the least-squares correction, read off H⁻¹'s Cholesky
factor. The rows are taken in order of decreasing H diagonal (the keys the fit queries read most first:
GPTQ's "act order"), so the keys that matter most are rounded before any correction lands on them and the
corrections pile up on keys few queries read.

A row keeps its own grid (its fp16 scale and zero from its own min and max, ``quantize``'s scheme), taken
when its turn comes, after the corrections from the rows before it; rows already on a grid quantize back
to themselves, so ``quantize_module_`` leaves the result unchanged and the bytes are those of
round-to-nearest exactly.
"""
from __future__ import annotations

import numpy as np
import torch

from ..quantization import fake_quantize


def gptq_rows(Z: torch.Tensor, H: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """Z [p, d] (the least-squares values) on the ``bits``/``group`` grid, row by row, each rounding error
    spread over the rows not yet rounded by H [p, p] (symmetric positive definite, the fit's Gram with
    its ridge) → [p, d] float64, every row on its own grid."""
    p = Z.shape[0]
    if p == 0:
        return Z.double()
    order = torch.argsort(H.diagonal(), descending=True)  # [p] the most-read keys first
    Hp = H[order][:, order].double().numpy()  # [p, p] H in that order
    # the upper Cholesky factor U of H⁻¹ (H⁻¹ = UᵀU): row i of U holds, scaled by U[i, i], the least-squares
    # move of the later rows when row i is fixed at a new value — GPTQ's update without a fresh inverse
    U = np.linalg.cholesky(_inverse(Hp)).T  # [p, p] upper
    W = Z[order].double().numpy().copy()  # [p, d] rows in rounding order, updated as earlier rows are rounded
    for i in range(p):
        row = torch.from_numpy(W[i])
        rounded = fake_quantize(row.float().unsqueeze(0), bits, group).squeeze(0).double().numpy()  # [d]
        err = (W[i] - rounded) / U[i, i]  # [d]
        W[i] = rounded
        W[i + 1:] -= np.outer(U[i, i + 1:], err)  # [p - i - 1, d] the later rows absorb it
    out = torch.empty(p, Z.shape[1], dtype=torch.float64)
    out[order] = torch.from_numpy(W)
    return out


def _inverse(H: np.ndarray) -> np.ndarray:
    """H⁻¹ [p, p] of a symmetric positive definite H, by its Cholesky factor (symmetrised: the factor of
    the inverse needs it exactly symmetric)."""
    L = np.linalg.cholesky(H)
    Linv = np.linalg.solve(L, np.eye(H.shape[0]))
    inv = Linv.T @ Linv
    return (inv + inv.T) / 2
