"""recon_mixed — recon_fit's selection with the bits allocated by rate and distortion (issue 38's lever):
each (layer, KV head)'s kept pairs stored at int2, int4 or int8, the keys past its count evicted (the
0-bit end), the choice made across the whole state by distortion removed per byte.

  1. rank      recon_fit's ranking (``recon_fit.ranking``: reconstruction scores s [L, Hkv, n]), its anchors
               (sinks) first, so every head keeps at least those: a head keeps its first c ranked keys
  2. distort   per key j and precision b, the share of its contribution that rounding loses,
                   ε_b(j) = min(1, scaling · √(Δk_jᵀ C Δk_j) + ‖Δv_j‖ / ‖v_j‖),   Δx = x − Q_b(x)
               — the RMS logit error the head's reconstruction queries see (C: their second moment
               [d, d]; centred when β is fitted, since a fitted β absorbs a key's mean logit shift and
               only the spread across queries is lost), plus the value's relative error — capped at 1:
               rounding never loses more than evicting. Keeping j at b removes s_j · (1 − ε_b(j)) of the
               distortion Σ_j s_j that evicting everything would leave (s is attention probability)
  3. allocate  every head picks (b, c), costing c · P_b bytes (P_b: one pair as stored,
               ``budget.ragged_pair_bytes``), to minimise distortion + λ · bytes; λ is bisected to the
               smallest that fits the plan's bytes; then single pairs at each head's own b, best gain
               per byte first, while one still fits — the bytes end within one pair of the budget and
               never over it (``allocate_bits``)
  4. fit       β and values in closed form on the reconstruction queries (recon_fit's ``build_selected``),
               each head against its keys as stored at its own precision

Storage: the module format holds ONE precision per module (``ModulePlan.bits``; modules/stored.py stores
every ragged row of a module at it), so per-head bits do not fit one module without a format change.
The state is therefore up to three ragged modules, one per precision used, each holding the pairs of the
heads at that precision (the other heads' slots masked, 0 bytes); attention over it is the exact merge
of the parts' states (disjoint pairs: ``attention.state.merge_states``) and its bytes are the parts'
stored bytes. ``nectar compare`` and benchmarks/document_panel.py score it; serving it from one file
(``nectar ask``, the server, ``train.module.init``) would need per-head bits in the ragged format — not built.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from ..attention.state import AttnState, merge_states
from ..modules.budget import ragged_pair_bytes
from ..modules.builder import ModulePlan
from ..modules.provider import group_queries
from ..quantization import QUANT_BITS, fake_quantize
from ..schemas.config import SelectionConfig
from .interface import FitInputs, FittedState, StateMethod
from .recon_fit import anchors, fit_queries, ranking, recon_reads
from .reconstruction import build_selected, selection_plan

PRECISIONS = (*QUANT_BITS, 32)  # what a head's pairs may be stored at (32: float32)


@dataclass
class MixedState:
    """A state whose heads are stored at different precisions: one ragged module per precision used
    (``parts``), merged exactly at attention time. Called and sized like a ``FittedState``."""

    name: str
    parts: tuple[FittedState, ...]  # each a ragged quadrature module at its own bits
    head_bits: tuple[tuple[int, ...], ...]  # [L][Hkv] the precision of each head's pairs
    plan: ModulePlan  # every kept pair per head, all precisions (quad_head_pairs: the heat map's counts)
    scores: torch.Tensor | None = None  # [L, Hkv, n]: what the allocation ranked

    def __call__(self, layer: int, q: torch.Tensor, scaling: float) -> AttnState:
        state = None
        for part in self.parts:
            s = part(layer, q, scaling)
            # a head with no pair in this part: lse −inf, and its out (a softmax over masked slots) nan
            state = merge_states(state, AttnState(s.out.nan_to_num(0.0), s.lse))
        return state

    @property
    def nbytes(self) -> int:
        """Bytes as stored: the parts' (each head's real pairs at its precision, β bf16)."""
        return sum(p.nbytes for p in self.parts)


@dataclass
class BitAllocation:
    """Per (layer, KV head): its precision and how many of its ranked keys it keeps."""

    bits: torch.Tensor  # [L, H] int: each head's precision (a value of ``choices``)
    counts: torch.Tensor  # [L, H] kept pairs
    order: torch.Tensor  # [L, H, n] key indices by rank (anchors first)
    nbytes: int  # Σ counts · pair bytes at each head's precision

    def kept(self, bits: int | None = None) -> list[list[torch.Tensor]]:
        """Kept key indices per (layer, head), document order; only the heads at ``bits`` when given
        (the others empty)."""
        L, H, _ = self.order.shape
        return [[self.order[layer, h, :int(self.counts[layer, h])].sort().values
                 if bits is None or int(self.bits[layer, h]) == bits else torch.zeros(0, dtype=torch.long)
                 for h in range(H)] for layer in range(L)]


def rank_order(scores: torch.Tensor, forced: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys by rank per head ([G, n], G = L·H rows of ``scores`` [L, H, n] flattened) and how many
    lead it unconditionally ([G]): the ``forced`` [n] anchors, or the head's best key when there are
    none (every head keeps at least one, as recon_fit's ``allocate``)."""
    L, H, n = scores.shape
    rank = scores.reshape(L * H, n).double().clone()
    rank[:, forced] = float("inf")
    rank.scatter_(-1, rank.argmax(-1, keepdim=True), float("inf"))
    order = torch.sort(rank, dim=-1, descending=True, stable=True).indices  # [G, n]
    return order, torch.isinf(rank).sum(-1)


def allocate_bits(scores: torch.Tensor, errors: torch.Tensor, choices: tuple[int, ...], pair_bytes: tuple[int, ...],
                  budget: int, forced: torch.Tensor) -> BitAllocation:
    """Each head's precision and count within ``budget`` bytes (never over; within one pair of it
    unless every key is kept). ``scores`` [L, H, n] ≥ 0 (a key's attention mass), ``errors``
    [B, L, H, n] in [0, 1] (ε_b: the share of it rounding at ``choices[b]`` loses), ``pair_bytes`` [B]
    (one pair as stored at each choice), ``forced`` [n] bool (anchors, kept by every head)."""
    L, H, n = scores.shape
    B, G = len(choices), L * H
    order, c_min = rank_order(scores, forced)  # [G, n], [G]
    s = scores.reshape(G, n).double().gather(1, order)  # [G, n] by rank
    eps = errors.reshape(B, G, n).double().clamp(0.0, 1.0).gather(2, order.expand(B, G, n))
    gain = s.unsqueeze(0) * (1.0 - eps)  # [B, G, n]: distortion removed by keeping each ranked key
    cum = torch.cat([torch.zeros(B, G, 1, dtype=torch.float64), gain.cumsum(-1)], -1)  # [B, G, n+1]
    P = torch.tensor(pair_bytes, dtype=torch.float64)  # [B]
    c = torch.arange(n + 1, dtype=torch.float64)
    valid = c.unsqueeze(0) >= c_min.unsqueeze(1)  # [G, n+1]
    least = int((c_min * int(min(pair_bytes))).sum())
    if least > budget:
        raise ValueError(f"the anchors every head keeps need {least} bytes at the cheapest precision, over "
                         f"the budget of {budget}; lower select.sink_tokens or raise rho")

    def choose(lam: float) -> tuple[torch.Tensor, torch.Tensor, int]:  # min over (b, c) of D + λ·bytes per head
        value = (cum - lam * c.view(1, 1, -1) * P.view(-1, 1, 1)).masked_fill(~valid.unsqueeze(0), float("-inf"))
        best, count = value.max(-1)  # [B, G]
        b = best.argmax(0)  # [G]
        counts = count.gather(0, b.unsqueeze(0)).squeeze(0)
        return b, counts, int((counts.double() * P[b]).sum())

    lo, hi = 0.0, 1.0
    b, counts, nbytes = choose(0.0)
    if nbytes > budget:
        while choose(hi)[2] > budget:  # a λ large enough that every head takes its cheapest choice
            lo, hi = hi, 2 * hi
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if choose(mid)[2] > budget else (lo, mid)
        b, counts, nbytes = choose(hi)
    counts, nbytes = _fill(gain.numpy(), b.numpy(), counts.numpy().copy(), np.asarray(pair_bytes), budget, nbytes)
    return BitAllocation(torch.tensor([choices[i] for i in b.tolist()]).reshape(L, H),
                         torch.from_numpy(counts).reshape(L, H), order.reshape(L, H, n), nbytes)


def _fill(gain: np.ndarray, b: np.ndarray, counts: np.ndarray, pair_bytes: np.ndarray, budget: int,
          nbytes: int) -> tuple[np.ndarray, int]:
    """Spend what the Lagrangian choice left: one pair at a time at its head's precision, the best
    distortion removed per byte first, while one fits. gain [B, G, n], b [G], counts [G]."""
    G, n = gain.shape[1:]
    per = pair_bytes[b]  # [G] bytes of one more pair of each head
    heads = np.arange(G)
    while True:
        room = (counts < n) & (per <= budget - nbytes)
        if not room.any():
            return counts, nbytes
        nxt = gain[b, heads, np.minimum(counts, n - 1)] / per
        g = int(np.argmax(np.where(room, nxt, -np.inf)))
        counts[g] += 1
        nbytes += int(per[g])


@torch.no_grad()
def rounding_errors(doc_kv, q: torch.Tensor, scaling: float, choices: tuple[int, ...], group: int = 64,
                    centred: bool = True) -> torch.Tensor:
    """[B, L, Hkv, n]: ε_b of every document key at each precision (module docstring, step 2). ``q``
    [T, L, Hq, d]: the reconstruction queries; ``centred``: their covariance instead of their second
    moment (a fitted β absorbs the mean shift)."""
    L = len(doc_kv.keys)
    H, n, d = doc_kv.keys[0].shape
    out = torch.zeros(len(choices), L, H, n)
    for layer in range(L):
        k = doc_kv.keys[layer].detach().float().cpu()  # [H, n, d]
        v = doc_kv.values[layer].detach().float().cpu()
        qg = group_queries(q[:, layer].float(), H)  # [T·g, H, d]
        if centred:
            qg = qg - qg.mean(0, keepdim=True)
        C = torch.einsum("thd,the->hde", qg, qg) / max(len(qg), 1)  # [H, d, d]
        for i, bits in enumerate(choices):
            dk = k - fake_quantize(k, bits, group)  # [H, n, d]: each row rounded as stored
            logit = scaling * torch.einsum("hnd,hde,hne->hn", dk, C, dk).clamp_min(0).sqrt()  # [H, n]
            dv = (v - fake_quantize(v, bits, group)).norm(dim=-1) / v.norm(dim=-1).clamp_min(1e-12)
            out[i, layer] = (logit + dv).clamp(max=1.0)
    return out


@dataclass(frozen=True)
class ReconMixed(StateMethod):
    """recon_fit's keys, each head's at its own precision (module docstring). Defaults: the first
    state's queries (reconstruction alone: a state from the document alone, no LLM server)."""

    choices: tuple[int, ...] = (2, 4, 8)  # precisions a head's pairs may be stored at
    aggregate: Literal["max", "mean"] = "max"  # a key's score over the reconstruction queries
    sink_tokens: int = 4  # the first tokens, always kept (at their head's precision)
    template_tokens: bool = False  # also keep every chat-template token of the context
    fit_pairs: bool = True  # closed-form β (NNLS) and values (least squares) on the kept keys
    fit_queries: Literal["recon", "recon+train"] = "recon"  # queries of the closed-form fit
    score_queries: Literal["recon", "recon+train"] = "recon"  # queries whose attention ranks the keys
    quant_aware: bool = True  # fit β and values to the keys (and β) as stored at each head's precision

    name = "recon_mixed"
    READS = frozenset({"doc_kv", "document", "train_queries"})

    def __post_init__(self) -> None:
        bad = [b for b in self.choices if b not in PRECISIONS]
        if not self.choices or bad:
            raise ValueError(f"recon_mixed choices {self.choices}: each must be one of {PRECISIONS}")

    @property
    def reads(self) -> frozenset[str]:
        return recon_reads(self)

    @property
    def select(self) -> SelectionConfig:
        """recon_fit's settings for the ranking and the fit (one budget across the state)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "choices"}
        return SelectionConfig(fit=fields.pop("fit_pairs"), budget="global", **fields)

    def plan(self, plan: ModulePlan, bits: int | None = None) -> ModulePlan:
        """The budget: the module plan's total bytes (``bits`` unused: each head's precision is chosen)."""
        return plan

    def fit(self, plan: ModulePlan, inputs: FitInputs) -> MixedState:  # type: ignore[override]
        if inputs.base is None or inputs.layout is None or inputs.document is None:
            raise ValueError("recon_mixed selects keys by reconstructing the document: pass base, layout, document "
                             "and spans in FitInputs")
        select = self.select
        # the recon+train ranking's cut is taken at the richest precision's pair count
        top = dataclasses.replace(plan, bits=max(self.choices))
        cap, train, scores = ranking(inputs.base, inputs.layout, inputs.doc_kv, inputs.targets, top, select,
                                     list(inputs.spans), inputs.seed)
        errors = rounding_errors(inputs.doc_kv, cap.q, plan.scaling, self.choices, plan.quant_group,
                                 centred=select.fit)
        pair_bytes = tuple(ragged_pair_bytes(plan.head_dim, select.fit, b, plan.quant_group) for b in self.choices)
        alloc = allocate_bits(scores, errors, self.choices, pair_bytes, 4 * plan.num_kv_heads * sum(plan.budgets),
                              anchors(inputs.layout, inputs.document, select))
        queries = fit_queries(cap, train, select, inputs.seed) if select.fit else None
        parts = []
        for bits in self.choices:
            kept = alloc.kept(bits)
            if any(k.numel() for heads in kept for k in heads):
                qplan = selection_plan(dataclasses.replace(plan, bits=bits), kept, select.fit)
                parts.append(FittedState(self.name, build_selected(qplan, kept, inputs.doc_kv, queries,
                                                                   select.quant_aware), qplan))
        return MixedState(self.name, tuple(parts), tuple(tuple(int(x) for x in row) for row in alloc.bits.tolist()),
                          selection_plan(plan, alloc.kept(), select.fit), scores)
