"""Tolerances for comparing float32 results that were computed in two different orders.

Two exact computations of the same quantity in another order of operations — another batch packing,
cached rows against rows recomputed online, a fused kernel against the reference, one decode engine
against another — agree only up to rounding. How much rounding depends on the processor: torch picks
its BLAS and reduction kernels by vector width (AVX2, AVX512, NEON) and by the shapes, so the same
test sums in another order on another machine. A bound that holds on any processor torch supports is
therefore scaled to the magnitude of the values compared (never an absolute constant tuned on one
machine) and to the depth of the computation between the two sides:

  REDUCTION  one reordered reduction (a matmul, a softmax-weighted sum over keys, an LSE merge):
             float32's unit roundoff is 6e-8 and a sum of k terms reordered moves by ~sqrt(k)·eps of
             the largest term in practice; 1e-5 of the largest magnitude covers k up to ~10⁴ with
             slack, and still fails on any real bug (a wrong mask or scale moves values by > 1e-2).
  FORWARD    a full forward through a model (logits through every layer): each layer's reordering is
             amplified by the following layers; 1e-4 of the largest logit.

Trained parameters are different: Adam divides each step by the running gradient RMS, so an element
whose gradient is near zero turns a rounding-size gradient difference into a step-size difference.
``assert_trained_close`` bounds those by what an optimizer can do (see there) instead of by rounding.

Set ``NECTAR_TOLERANCE_REPORT=<file>`` to append each comparison's largest error and its bound (the
margin on this machine) to that file.
"""
from __future__ import annotations

import os

import torch

REDUCTION = 1e-5
FORWARD = 1e-4


def _report(name: str, err: float, bound: float) -> None:
    path = os.environ.get("NECTAR_TOLERANCE_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(f"{name}\t{err:.3e}\t{bound:.3e}\t{err / bound if bound else float('inf'):.4f}\n")


def reorder_atol(want: torch.Tensor, rel: float) -> float:
    """The absolute bound for a tensor compared at ``rel`` of its largest magnitude (floored at 1, so
    values that are all near zero still get float32's rounding of unit-size intermediates)."""
    finite = want.detach()[torch.isfinite(want.detach())]  # masked logits hold -inf
    scale = float(finite.abs().max()) if finite.numel() else 0.0
    return rel * max(scale, 1.0)


def _max_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest |got - want| over finite entries; inf where the non-finite entries (masks) differ."""
    got, want = got.detach(), want.detach()  # a comparison, not part of any graph
    finite = torch.isfinite(want)
    if not torch.equal(finite, torch.isfinite(got)) or not torch.equal(got[~finite], want[~finite]):
        return float("inf")
    return float((got[finite] - want[finite]).abs().max()) if finite.any() else 0.0


def close_reordered(got, want, rel: float = REDUCTION, name: str = "") -> bool:
    """Whether ``got`` equals ``want`` up to the rounding of computing it in another order (module doc)."""
    got, want = torch.as_tensor(got).float(), torch.as_tensor(want).float()
    if got.shape != want.shape:
        return False
    bound = reorder_atol(want, rel)
    err = _max_err(got, want)
    _report(name or "tensor", err, bound)
    return err <= bound


def assert_close_reordered(got: torch.Tensor, want: torch.Tensor, rel: float = REDUCTION, name: str = "") -> None:
    """``got`` equals ``want`` up to the rounding of computing it in another order (module doc)."""
    got, want = torch.as_tensor(got), torch.as_tensor(want)
    assert got.shape == want.shape, (name, got.shape, want.shape)
    bound = reorder_atol(want.float(), rel)
    err = _max_err(got.float(), want.float())
    _report(name or "tensor", err, bound)
    assert err <= bound, f"{name}: max |got - want| = {err:.3e} > {bound:.3e} ({rel:g} of the largest magnitude)"


def assert_trained_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], *, steps: int,
                         lr: float, name: str = "") -> None:
    """Two trainings of the same parameters from the same seed, whose gradients differ by rounding
    only (the same rows computed in other packings), after ``steps`` Adam steps of peak rate ``lr``.

    - Every element: |Δ| ≤ 2 · lr · steps. Adam moves an element by at most ~lr per step whatever its
      gradient (its first step is lr·sign(g)), so an element whose gradient is near zero — where
      rounding can flip the sign — may differ by up to two steps' worth per step. No tighter
      per-element bound holds on every processor.
    - The bulk: at least 99 % of each tensor's elements within steps · 1e-5 of its largest magnitude
      (rounding, compounded once per step). A real divergence — another data order, a wrong target
      row — moves nearly every element by ~lr, so this still fails on any such bug.
    """
    assert got.keys() == want.keys(), name
    for key in want:
        a, b = got[key].float(), want[key].float()
        if not b.numel():
            continue
        diff = (a - b).abs()
        elem_bound = 2 * lr * steps
        _report(f"{name}{key}:elem", float(diff.max()), elem_bound)
        assert float(diff.max()) <= elem_bound, f"{key}: max |Δ| = {float(diff.max()):.3e} > 2·lr·steps = {elem_bound:.3e}"
        tight = reorder_atol(b, steps * REDUCTION)
        outside = float((diff > tight).float().mean())
        _report(f"{name}{key}:bulk-outside", outside, 0.01)
        assert outside <= 0.01, f"{key}: {outside:.1%} of elements differ by > {tight:.2e} (at most 1 % may)"


def same_greedy_until_near_tie(next_logits, a: list[int], b: list[int], margin: float = 10.0) -> bool:
    """Two greedy decodes of one prompt computed in different orders (batched vs alone, prefix reuse vs
    none, one engine vs another) agree token for token up to the first step where the reference's top-2
    logits are within ``margin`` times the forward's rounding bound: there another order may pick the
    other token, and everything after it legitimately differs. ``next_logits(prefix)`` returns the
    reference's next-token logits [V] after the generated ``prefix`` (masked as the decode was)."""
    for t in range(min(len(a), len(b)) + 1):
        if t < min(len(a), len(b)) and a[t] == b[t]:
            continue
        if len(a) == len(b) == t:
            return True
        row = next_logits(list(a[:t])).float()
        top2 = row.topk(2).values
        return bool(top2[0] - top2[1] < margin * reorder_atol(row, FORWARD))
    return True
