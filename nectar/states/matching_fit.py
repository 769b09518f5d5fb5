"""Attention Matching (Zweiger et al. 2026, "Fast KV compaction via attention matching"), closed form
on the (q, α, A) targets the pipeline already captures.

Given the kept keys S of one (layer, KV head) and the training queries:
  1. masses — each query's document mass is Σ_j exp(s·q·k_j) = exp(α(q)). Fit w ≥ 0 so that
     Σ_{j∈S} w_j exp(s·q·k_j) ≈ exp(α(q)) for every query: non-negative least squares on the
     relative masses M[r, j] = exp(s·q_r·k_j − α_r) against 1 (with a small ridge towards w = 1);
     β_j = log w_j is the log-mass bias.
  2. values — with those weights the compacted attention of q is R[r] = softmax_j(s·q_r·k_j + β_j);
     the values Z minimise Σ_r ‖R[r] Z − A(q_r)‖², with a small ridge towards the original values
     so keys that no query reaches keep sensible values.
Then a(q) = LSE(s·Wq + β) matches α and A(q) = softmax(s·Wq + β)ᵀ Z matches 𝒜 on the training queries.

A head that keeps more keys than a cap solves only the cap's worth jointly (``fitted_keys``): the keys with
the most mass on the fit queries; the others keep β = 0 and their own values, and both fits target what
those fixed keys leave. The solves are cubic and the Gram products quadratic in the keys solved, and with
more keys than fit queries (N) the system is rank-deficient anyway — the ridge alone decides the rest.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from scipy.linalg import solve_triangular
from scipy.optimize import nnls

from .selection import attention_probs
from .value_rounding import gptq_rows

MIN_MASS = 1e-12  # w_j floor: β ≥ log(1e-12) ≈ −27.6, a key that no query needs contributes nothing
RIDGE = 1e-3  # ridges (masses towards β = 0, values towards the kept values), relative to the Gram diagonal


def fitted_keys(mass: torch.Tensor, cap: int | None) -> torch.Tensor | None:
    """Which of a head's p kept keys its fit solves jointly: all (None) up to ``cap`` keys, else the
    ``cap`` keys with the most mass on the fit queries (indices [cap], ascending). The rest keep β = 0
    and their values: the ridge would hold a key no fit query reaches near there anyway."""
    if cap is None or mass.shape[1] <= cap:
        return None
    # [p] each key's mass over the fit queries; a float32 sum (pairwise, ~2e-7 relative) only ranks
    # them — float64 accumulation read the [N, p] masses 6× slower (0.37 s a head at 6k × 11k)
    return _most_reached(mass.float().sum(0), cap)


def _most_reached(reach: torch.Tensor, cap: int) -> torch.Tensor:
    """The ``cap`` keys of the largest ``reach`` [p], as ascending indices [cap]."""
    return torch.topk(reach, cap).indices.sort().values


# float32 masses per row block of ``capped_masses``: 4 MB stays in the last-level cache; on the 2-core
# VM 0.25 MB blocks took 1.5×, 1–8 MB within 20 % of each other (10 of the 12k document's heads)
MASS_BLOCK = 1 << 20


@dataclass(frozen=True)
class CappedMasses:
    """What a capped head's fits read of its [N, p] masses: the fitted keys' columns and the fixed keys'
    sums. The fixed keys keep β = 0 (w = 1), so their share of every fit is a plain sum over them."""

    free: torch.Tensor  # [k] the fitted keys (ascending indices of the p kept)
    cols: torch.Tensor  # [N, k] float32 mass[:, free]
    fixed_mass: torch.Tensor  # [N] float32 Σ over the fixed keys of mass[r, j]
    fixed_out: torch.Tensor | None  # [N, d] float32 Σ over the fixed keys of mass[r, j]·prior_j (None: not asked)

    @classmethod
    def of(cls, mass: torch.Tensor, free: torch.Tensor, prior: torch.Tensor | None = None) -> "CappedMasses":
        """From masses already formed [N, p] (and the priors [p, d] when the value fit follows)."""
        M = mass.float()
        fixed = _fixed(M.shape[1], free).float()  # [p]
        sums = M @ (fixed.unsqueeze(1) if prior is None else torch.cat([prior.float() * fixed.unsqueeze(1),
                                                                          fixed.unsqueeze(1)], 1))
        return cls(free, M[:, free].contiguous(), sums[:, -1], None if prior is None else sums[:, :-1])


def capped_masses(q: torch.Tensor, alpha: torch.Tensor, keys: torch.Tensor, prior: torch.Tensor, scaling: float,
                  cap: int | None) -> CappedMasses | None:
    """A head's ``CappedMasses`` from its fit queries q [N, d], α [N] and kept keys [p, d] (priors [p, d]),
    or None when it keeps at most ``cap`` keys (its fit reads the whole masses: ``attention_probs``).

    The masses exp(s·q·k − α) over all p keys are formed in row blocks of ``MASS_BLOCK`` and never as a
    whole: one pass sums each key's (the ranking of ``fitted_keys``) and each row's, with and without the
    priors; the fitted columns are then formed on their own (N·k), and the fixed keys' sums are the rows'
    less the fitted columns' (~1e-7 of the row's mass: float32's rounding of the sums themselves). The
    whole [N, p] (up to 6,144 × 11k, 280 MB a head on a long document) took longer to write and read
    back than to compute — every pass over it ran from memory, and a fresh buffer that size costs ~0.2 s
    of page faults on a VM (docs/benchmarks.md)."""
    N, p = q.shape[0], keys.shape[0]
    if cap is None or p <= cap:
        return None
    with_one = torch.cat([prior.float(), torch.ones(p, 1)], 1)  # [p, d + 1]: the priors, and a 1 to count the mass
    step = max(1, MASS_BLOCK // p)
    block = torch.empty(min(step, N), p)  # [rows, p] one block of masses, reused
    reach = torch.zeros(p)  # [p] each key's summed mass (the ranking of ``fitted_keys``)
    totals = torch.empty(N, with_one.shape[1])  # [N, d + 1] Σ_j mass·prior_j and Σ_j mass, every kept key
    for start in range(0, N, step):
        end = min(start + step, N)
        masses = attention_probs(q[start:end], alpha[start:end], keys, scaling, out=block[:end - start])
        reach += masses.sum(0)
        torch.mm(masses, with_one, out=totals[start:end])
    free = _most_reached(reach, cap)
    cols = attention_probs(q, alpha, keys[free], scaling)  # [N, k] the fitted keys' masses
    fixed = totals - cols @ with_one[free]  # [N, d + 1] the fixed keys' sums
    return CappedMasses(free, cols, fixed[:, -1].clamp_min(0.0), fixed[:, :-1].contiguous())


def _fixed(p: int, free: torch.Tensor) -> torch.Tensor:
    """[p] bool: the keys outside ``free`` (indices)."""
    fixed = torch.ones(p, dtype=torch.bool)
    fixed[free] = False
    return fixed


def fit_log_mass(mass: torch.Tensor, free: torch.Tensor | None = None, prior: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """mass [N, p] = exp(s·q·k_j − α) for the kept keys → β [p] with Σ_j e^{β_j} mass[r, j] ≈ 1.

    A small ridge towards w = 1 (β = 0) picks, among weightings that fit equally well (queries of a
    head are often nearly collinear), the one closest to the plain kept keys — so keeping every key
    gives back exactly the document's state. ``free`` (``fitted_keys``): only those keys' β are
    fitted, to the mass the others (β = 0) leave; theirs stay 0. ``prior`` [p]: the weights w the ridge
    pulls toward instead of 1 (merged keys' masses, ``select.fit_prior: merged``)."""
    if free is not None:
        return capped_log_mass(CappedMasses.of(mass, free), mass.shape[1])
    return _solve_log_mass(mass.float().contiguous(), None, prior)


def capped_log_mass(masses: CappedMasses, p: int) -> torch.Tensor:
    """``fit_log_mass`` of a capped head: β [p] float64, fitted on ``masses.free`` to the mass the fixed
    keys (β = 0) leave, 0 elsewhere."""
    # 1 less the fixed keys' share: the mass the fitted keys must make up [N]
    target = (1.0 - masses.fixed_mass).clamp_min(0.0)
    out = torch.zeros(p, dtype=torch.float64)  # [p]: β = 0 on the fixed keys
    out[masses.free] = _solve_log_mass(masses.cols, target)
    return out


def _solve_log_mass(M: torch.Tensor, target: torch.Tensor | None, prior: torch.Tensor | None = None) -> torch.Tensor:
    """β [k] float64 with Σ_j e^{β_j} M[r, j] ≈ target[r] (1 when None) by the ridged NNLS, M [N, k] float32;
    the ridge pulls w = e^β toward ``prior`` [k] (1 when None)."""
    G = gram(M)  # [k, k]: the fit only needs MᵀM and Mᵀt, so N (thousands of queries) drops out
    mu2 = RIDGE * max(float(G.diagonal().mean()), 1e-12)
    G.diagonal().add_(mu2)  # MᵀM + μ²I
    # Mᵀ1 + μ²·1 (Mᵀt + μ²·1 with fixed keys): float32 products (each entry a sum of N terms, ~1e-7
    # relative — the Gram's own precision) where a float64 copy of M cost more than the fit's Gram
    rhs = (M.sum(0, dtype=torch.float64) if target is None else (M.T @ target.float()).double())
    rhs = rhs + (mu2 if prior is None else mu2 * prior.double())
    # ‖Mw − t‖² + μ²‖w − 1‖² (w − prior with a prior) = wᵀGw − 2 rhsᵀw + const: a strictly convex QP over w ≥ 0 (the same
    # NNLS as ‖Lᵀw − L⁻¹rhs‖² with G = LLᵀ), solved exactly by block principal pivoting on G.
    return torch.log(nnls_gram(G, rhs).clamp_min(MIN_MASS)).cpu()  # [k] float64


def nnls_gram(G: torch.Tensor, rhs: torch.Tensor, max_iter: int = 100) -> torch.Tensor:
    """argmin_{w ≥ 0} ½wᵀGw − rhsᵀw for a positive definite G [p, p] (float64) → w [p].

    Block principal pivoting (Kim & Park 2011, "Fast nonnegative matrix factorization: an active-set-like
    method and comparisons"): solve on the free set F, then move EVERY variable that breaks the KKT
    conditions (w_F < 0, or a gradient y = Gw − rhs < 0 at a zero) across at once, with Murty's
    single-exchange backup when the count of broken ones stops falling. Started from the unconstrained
    solution's support, it usually ends in 1–5 solves — where scipy's Lawson–Hanson ``nnls`` adds one
    variable per iteration (p iterations, each a least-squares solve: ~p⁴; 28 minutes of a 3.7k-token
    document's fit). Each solve reuses the one Cholesky factor of the whole G (``FreeSetSolver``).
    The solution is the same unique optimum. Falls back to scipy's ``nnls`` in the rare case pivoting
    does not settle within ``max_iter`` exchanges."""
    p = G.shape[0]
    tol_y = 1e-10 * max(float(rhs.abs().max()), 1e-300)  # KKT slack relative to the problem's scale
    free = torch.ones(p, dtype=torch.bool)  # the first exchange leaves the unconstrained solution's support
    solver = FreeSetSolver(G, rhs)
    best, backup = p + 1, 3
    for _ in range(max_iter):
        w = solver.solve(free)
        y = G @ w - rhs  # [p] gradient; 0 on the free set
        tol_w = 1e-12 * max(float(w.abs().max()), 1.0)
        broken = (free & (w < -tol_w)) | (~free & (y < -tol_y))
        count = int(broken.sum())
        if count == 0:
            return w.clamp_min(0.0)
        if count < best:
            best, backup = count, 3
            free ^= broken
        elif backup > 0:
            backup -= 1
            free ^= broken
        else:  # single exchange of the largest broken index: finite termination
            last = int(broken.nonzero().max())
            free[last] = ~free[last]
    L = torch.linalg.cholesky(G)
    w, _ = nnls(L.T.cpu().numpy(), tri_solve(L, rhs).numpy(), maxiter=50 * p)
    return torch.from_numpy(w)


class FreeSetSolver:
    """w [p] with w_F = G_FF⁻¹ rhs_F on a free set F and 0 elsewhere, for many F of one G.

    Pivoting changes F by a few percent per exchange, and a fresh Cholesky of G_FF costs |F|³/3 each
    time (1–1.5 s at |F| ≈ 3.6k here, 3–4 times per head). Instead G = LLᵀ is factored once; with
    D = the zeros, x = G⁻¹(rhs − E_D λ) solves G_FF x_F = rhs_F with x_D = 0 when the multipliers λ
    solve (G⁻¹)_DD λ = (G⁻¹rhs)_D — and (G⁻¹)_DD = YᵀY with Y = L⁻¹E_D, one triangular solve with
    |D| right-hand sides (p²·|D|). Used while that is cheaper than the direct factorization."""

    def __init__(self, G: torch.Tensor, rhs: torch.Tensor):
        self.G, self.rhs = G, rhs
        self.L, info = torch.linalg.cholesky_ex(G)
        self.factored = int(info) == 0
        self.x = _chol_solve(self.L, rhs) if self.factored else None  # [p] the unconstrained optimum

    def solve(self, free: torch.Tensor) -> torch.Tensor:
        zeros = (~free).nonzero().squeeze(1)
        p, d = free.numel(), zeros.numel()
        if self.factored and d == 0:
            return self.x.clone()
        if self.factored and 3 * p * p * d + d ** 3 < (p - d) ** 3:  # Schur update vs fresh factor's FLOPs
            return self._schur(zeros)
        return _solve_free(self.G, self.rhs, free)

    def _schur(self, zeros: torch.Tensor) -> torch.Tensor:
        E = torch.zeros(self.L.shape[0], zeros.numel(), dtype=self.L.dtype)  # [p, |D|] unit columns
        E[zeros, torch.arange(zeros.numel())] = 1.0
        Y = tri_solve(self.L, E)  # [p, |D|] L⁻¹E_D
        S = Y.T @ Y  # [|D|, |D|] (G⁻¹)_DD, positive definite
        Ls, info = torch.linalg.cholesky_ex(S)
        lam = _chol_solve(Ls, self.x[zeros]) if int(info) == 0 else \
            torch.linalg.lstsq(S, self.x[zeros].unsqueeze(1)).solution.squeeze(1)
        w = self.x - tri_solve(self.L, Y @ lam, transpose=True)
        w[zeros] = 0.0  # exactly (the update leaves ~1e-16 there)
        return w


def _solve_free(G: torch.Tensor, rhs: torch.Tensor, free: torch.Tensor) -> torch.Tensor:
    """w [p] with w_F = G_FF⁻¹ rhs_F on the free set F and 0 elsewhere (a fresh factorization of G_FF)."""
    w = torch.zeros_like(rhs)
    idx = free.nonzero().squeeze(1)
    if idx.numel():
        sub = G if idx.numel() == G.shape[0] else G[idx.unsqueeze(1), idx]  # G_FF (one gather, not two)
        L, info = torch.linalg.cholesky_ex(sub)
        sol = _chol_solve(L, rhs[idx]) if int(info) == 0 else \
            torch.linalg.lstsq(sub, rhs[idx].unsqueeze(1)).solution.squeeze(1)
        w[idx] = sol
    return w


def _chol_solve(L: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """x with L Lᵀ x = b, b [p] or [p, k] (two triangular solves on the one factor)."""
    z = tri_solve(L, b)
    return tri_solve(L, z, transpose=True)


def tri_solve(L: torch.Tensor, b: torch.Tensor, transpose: bool = False) -> torch.Tensor:
    """L⁻¹b (or L⁻ᵀb) for a lower-triangular float64 L [p, p] and b [p] or [p, k], by LAPACK's trtrs
    through scipy on the same memory. torch.linalg.solve_triangular took 0.4 s for ONE right-hand side
    at p = 3,000 (it re-lays the factor out on every call) against 1–2 ms here; the block pivoting
    makes hundreds of these solves per document."""
    out = solve_triangular(L.numpy(), b.numpy(), lower=True, trans="T" if transpose else "N", check_finite=False)
    return torch.from_numpy(out)


def fit_values(mass: torch.Tensor, beta: torch.Tensor, targets: torch.Tensor,
               prior: torch.Tensor, free: torch.Tensor | None = None, grid: tuple[int, int] | None = None
               ) -> torch.Tensor:
    """Least-squares values Z [p, d] for the compacted attention softmax(log mass + β) against the
    captured outputs ``targets`` [N, d]; ridge towards ``prior`` [p, d] (the kept keys' values).
    ``free`` (``fitted_keys``): only those keys' values are solved, to what the others' (their
    priors) leave; the others keep their priors. ``grid`` (bits, group): the solved rows rounded onto
    that storage grid by the fit's own objective (value_rounding.py), else left in float."""
    if free is not None:
        return _fit_some_values(mass, beta, targets, prior, free, grid)
    # softmax over the kept keys of log mass + β, shifted by each row's largest term so float32
    # neither overflows (β up to +27) nor underflows: R is the same as in float64 to ~1e-7
    logits = torch.log(mass.float().clamp_min(1e-38)) + beta.float().unsqueeze(0)  # [N, p]
    R = torch.softmax(logits, dim=1)  # [N, p] compacted attention
    R[mass.float() <= 0] = 0.0
    return _solve_values(R, targets, prior, grid)


def _fit_some_values(mass: torch.Tensor, beta: torch.Tensor, targets: torch.Tensor, prior: torch.Tensor,
                     free: torch.Tensor, grid: tuple[int, int] | None = None) -> torch.Tensor:
    """``fit_values`` of a capped head from its formed masses [N, p] (``capped_values``)."""
    return capped_values(CappedMasses.of(mass, free, prior), beta, targets, prior, grid)


def capped_values(masses: CappedMasses, beta: torch.Tensor, targets: torch.Tensor, prior: torch.Tensor,
                  grid: tuple[int, int] | None = None) -> torch.Tensor:
    """Z [p, d] float64 of a capped head: the priors, with the fitted keys' rows solved against the
    targets [N, d] less the fixed keys' share of the compacted attention. ``beta`` [p] is 0 on the fixed
    keys (``capped_log_mass``; a ValueError otherwise).

    The compacted attention is R[r, j] = mass[r, j]·w_j / Σ_i mass[r, i]·w_i (w = e^β; the softmax of
    log mass + β, written without the log), and w = 1 on the fixed keys, so their share is the sums
    ``CappedMasses`` carries: only the fitted [N, k] columns are read (docs/benchmarks.md, "The first
    state's time"). In float32: w reaches e^27 and the masses 1e-38, so mass·w stays in float32's range,
    and a quotient carries ~1e-7 relative rounding — the Gram's own. ``grid``: the solved rows rounded
    as ``fit_values`` says (the fixed keys' priors are rounded to nearest when the module is stored)."""
    free = masses.free
    fixed = _fixed(beta.shape[0], free)
    if beta[fixed].any():
        raise ValueError("the capped value fit needs β = 0 on the keys it does not fit (capped_log_mass's)")
    w = beta[free].double().exp().float()  # [k]
    den = (masses.cols @ w + masses.fixed_mass).clamp_min(1e-38).unsqueeze(1)  # [N, 1] Σ_i mass·w, every kept key
    rest = targets.float() - masses.fixed_out / den  # [N, d] what the fitted keys must make up
    R = (masses.cols * w).div_(den)  # [N, k] the fitted keys' compacted attention
    Z = prior.double().clone()
    Z[free] = _solve_values(R, rest, prior[free], grid).double()
    return Z


def _solve_values(R: torch.Tensor, targets: torch.Tensor, prior: torch.Tensor,
                  grid: tuple[int, int] | None = None) -> torch.Tensor:
    """argmin_Z ‖RZ − targets‖² + λ‖Z − prior‖² → Z [p, d] (float64), R [N, p]; with ``grid`` (bits,
    group) rounded onto it by that objective (``gptq_rows``)."""
    G = gram(R)  # [p, p]
    lam = RIDGE * max(float(G.diagonal().mean()), 1e-12)
    G.diagonal().add_(lam)  # RᵀR + λI
    rhs = (R.T @ targets.float()).double() + lam * prior.double()  # [p, d]
    # RᵀR + λI is symmetric positive definite: Cholesky (p³/3) instead of LU (2p³/3), same solution
    L, info = torch.linalg.cholesky_ex(G)
    Z = torch.linalg.solve(G, rhs) if int(info) != 0 else _chol_solve(L, rhs)  # [p, d]
    return Z if grid is None else gptq_rows(Z, G, *grid)


def gram(X: torch.Tensor) -> torch.Tensor:
    """XᵀX [p, p] float64 of X [N, p]: formed in float32 by BLAS's symmetric rank-k update (numpy
    calls syrk for ``a.T @ a``: half a general product's FLOPs, and float32 runs at twice float64's
    rate) — 3–4× faster than float64 ``X.T @ X``, the fits' largest cost (N·p² per head). The
    entries carry float32's ~1e-7 relative rounding; the ridge (≥ 1e-3 of the mean diagonal) keeps
    the solves' conditioning where that moves the fits' outputs by less than their int4 storage."""
    a = X.detach().float().contiguous().numpy()
    return torch.from_numpy(a.T @ a).double()
