"""Several documents' states as one: attention over the union of their keys (docs/design.md §2, §13).

Attention over two disjoint key sets is the merge of the two states, so a query can attend over the
states of several documents at once (each a module, a fitted state or an exact document KV) with one
``merge_states`` per part: ``ComposedDocState``. What the merge does not supply is positions: each
state was made with its document at positions 0 … n_k − 1 and the query right after it. RoPE makes a
logit depend only on the query-key distance, so a part whose keys should sit at offset o_k is served
by rotating the query back by o_k before asking that part (``RopeShift``) — exact for an exact KV and
for any state whose keys are rotated document keys. The layouts (``POSITIONS``):

  concat   the documents back to back in the order given (part k at o_k = Σ_{j<k} n_j), the question
           after their sum N = Σ n_k: the positions of the concatenated documents' full context
  own      every part sees the question right after itself (o_k = N − n_k): the distances each state
           was fitted at, whatever the other documents
  longest  no shift: every part at 0 … n_k − 1, the question after the longest (N = max n_k)

What composition cannot supply is the documents attending to each other (in a full context the second
document's tokens see the first), and each state brings its own copy of the chat-template prefix and
attention sink: docs/quality.md, "Several documents at once", measures what that costs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .interface import DocStateProvider
from .state import AttnState, merge_states

POSITIONS = ("concat", "own", "longest")


class CompositionError(ValueError):
    """States that cannot be composed as asked (one line: what, the limit, the fix)."""


@dataclass(frozen=True)
class Layout:
    """Where the composed documents sit: the question's first position and each part's query shift."""

    n: int  # the question's first position (what the engine takes as the document length)
    shifts: tuple[int, ...]  # per part: positions the query is moved back by before asking that part


def composed_layout(lengths: Sequence[int], positions: str = "concat") -> Layout:
    """The question's position and the per-part shifts for documents of ``lengths`` tokens."""
    if positions not in POSITIONS:
        raise CompositionError(f"positions {positions!r} is not one of {list(POSITIONS)}; "
                               "use concat (the concatenated documents' positions), own or longest")
    if not lengths:
        raise CompositionError("no documents to compose; give at least one run")
    if positions == "longest":
        return Layout(max(lengths), tuple(0 for _ in lengths))
    total = sum(lengths)
    if positions == "own":
        return Layout(total, tuple(total - n for n in lengths))
    offsets = [sum(lengths[:k]) for k in range(len(lengths))]
    return Layout(total, tuple(offsets))


def part_gaps(lengths: Sequence[int], positions: str = "concat") -> tuple[int, ...]:
    """Per part: how many positions after its own end the composed question starts (in the part's own
    frame: its keys at 0 … n_k − 1, the question at n_k + gap_k). ``concat``: the tokens of the parts
    after it (0 for the last); ``own``: 0; ``longest``: the longest minus its own length. The question's
    ``at`` in ``compose`` does not change them (the shifts absorb it). A state fitted with its
    reconstruction queries at this gap (recon_fit ``fit_gaps``) has seen the distances it is asked from."""
    lay = composed_layout(lengths, positions)
    return tuple(lay.n - s - n for s, n in zip(lay.shifts, lengths))


class RopeShift:
    """Rotates post-RoPE queries to another position: q at p → q at p − δ (RoPE is a rotation per
    frequency, so rotating by −δ moves the query δ positions back, exactly).

    The frequencies are the model's own (its rotary embedding's ``inv_freq``: RoPE scaling included;
    the YaRN magnitude factor, if any, is already in q and is not applied twice). Models rotate the
    first ``2·len(inv_freq)`` dims in two halves (``rotate_half``, Llama/Qwen/Mistral); the rest pass."""

    def __init__(self, inv_freq: torch.Tensor):
        self.inv_freq = inv_freq.detach().double().cpu()  # [r/2]
        self._cache: dict[tuple[int, torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    @classmethod
    def of_model(cls, model: torch.nn.Module) -> "RopeShift":
        for mod in model.modules():
            inv = getattr(mod, "inv_freq", None)
            if isinstance(inv, torch.Tensor):
                return cls(inv)
        raise CompositionError(f"{type(model).__name__} has no rotary embedding (no inv_freq); composing at "
                               "shifted positions needs RoPE: use positions=longest")

    def _cos_sin(self, delta: int, device: torch.device, dtype: torch.dtype):
        key = (delta, device, dtype)
        if key not in self._cache:
            ang = -float(delta) * self.inv_freq  # [r/2], angles in float64: δ may be tens of thousands
            cos, sin = torch.cos(ang), torch.sin(ang)
            self._cache[key] = (torch.cat([cos, cos]).to(device, dtype), torch.cat([sin, sin]).to(device, dtype))
        return self._cache[key]

    def __call__(self, q: torch.Tensor, delta: int) -> torch.Tensor:
        """q [..., d] at position p → the same query at p − delta."""
        if delta == 0:
            return q
        cos, sin = self._cos_sin(delta, q.device, q.dtype)  # [r]
        r = cos.shape[0]
        rot, rest = q[..., :r], q[..., r:]
        half = r // 2
        rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)  # rotate_half
        out = rot * cos + rotated * sin
        return out if rest.shape[-1] == 0 else torch.cat([out, rest], dim=-1)


# The largest share of a part's attention mass the shared prefix may take away (a fitted state can
# carry less mass on its template tokens than their exact keys): the rest of the part is kept.
MAX_PREFIX_SHARE = 0.99


def remove_state(total: AttnState, part: AttnState, max_share: float = MAX_PREFIX_SHARE) -> AttnState:
    """The state over ``total``'s keys without ``part``'s (the inverse of ``merge_states``, exact when
    ``part``'s keys are among ``total``'s): lse − part's mass, out without part's weighted values."""
    r = torch.exp(part.lse - total.lse).nan_to_num(0.0).clamp(0.0, max_share)  # [b, h, m]: part's share
    keep = (1.0 - r).unsqueeze(-1)  # [b, h, m, 1]
    out = (total.out - r.unsqueeze(-1) * part.out.to(total.out.dtype)) / keep
    return AttnState(out, total.lse + torch.log1p(-r))


class ComposedDocState:
    """Provider over several parts: each part's state for the query (shifted to its layout), merged.

    A part of None (no document) adds nothing: ``merge_states`` keeps the other side as it is, so one
    state composed with nothing is that state, bit for bit. ``prefix``: the exact state of the chat-
    template prefix every document's context starts with; given, it is taken out of every part but the
    first (``remove_state``), so the composition holds that prefix — and its attention sink — once, as
    the concatenated documents' context does."""

    def __init__(self, parts: Sequence[DocStateProvider | None], shifts: Sequence[int] | None = None,
                 rope: RopeShift | None = None, prefix: DocStateProvider | None = None):
        shifts = tuple(shifts) if shifts is not None else tuple(0 for _ in parts)
        if len(shifts) != len(parts):
            raise CompositionError(f"{len(parts)} parts but {len(shifts)} shifts; give one shift per part")
        if any(shifts) and rope is None:
            raise CompositionError("shifted parts need the model's RoPE frequencies (RopeShift.of_model)")
        self.parts, self.shifts, self.rope, self.prefix = list(parts), shifts, rope, prefix

    def __call__(self, layer: int, q: torch.Tensor, scaling: float) -> AttnState | None:
        state, first = None, True
        for provider, shift in zip(self.parts, self.shifts):  # q [b, hq, m, d]
            if provider is None:
                continue
            qk = self.rope(q, shift) if shift else q  # the query as this part's state expects it
            part = provider(layer, qk, scaling)
            if self.prefix is not None and not first:  # this part's copy of the shared prefix, out
                part = remove_state(part, self.prefix(layer, qk, scaling))
            state, first = merge_states(state, part), False
        return state


def compose(parts: Sequence[DocStateProvider | None], lengths: Sequence[int], positions: str = "concat",
            model: torch.nn.Module | None = None, at: int | None = None,
            prefix: DocStateProvider | None = None) -> tuple[ComposedDocState, int]:
    """The composed provider of ``parts`` (documents of ``lengths`` tokens) and the question's first
    position, under the ``positions`` layout (module docstring). ``at``: the caller places the question
    there instead (e.g. after the concatenated documents' own context, to score against it): every
    part's shift absorbs the difference, so each part still sees the distances of its layout.
    ``prefix``: the shared template prefix's exact state, held once (``ComposedDocState``)."""
    lay = composed_layout(lengths, positions)
    n = lay.n if at is None else at
    shifts = tuple(s + n - lay.n for s in lay.shifts)  # part k wants the question at lay.n - s_k
    rope = RopeShift.of_model(model) if any(shifts) and model is not None else None
    return ComposedDocState(parts, shifts, rope, prefix), n


def shared_prefix(contexts: Sequence[Sequence[int]]) -> list[int]:
    """The tokens every document's context starts with (the chat template before the document text)."""
    first = list(contexts[0])
    k = len(first)
    for ids in contexts[1:]:
        k = next((i for i, (a, b) in enumerate(zip(first[:k], ids)) if a != b), min(k, len(ids)))
    return first[:k]


# ModelConfig fields that say where the model runs, not which model it is
_RESOURCE_FIELDS = {"device", "attention_backend"}


def refuse_different_models(runs: Sequence[tuple[str, object]]) -> None:
    """States of different base models do not compose (their keys live in different spaces): refuse
    in one line, naming the first run that differs. ``runs``: (run directory, its ModelConfig)."""
    (first_dir, first), *rest = runs
    want = first.model_dump(exclude=_RESOURCE_FIELDS)
    for run_dir, model in rest:
        if model.model_dump(exclude=_RESOURCE_FIELDS) != want:
            raise CompositionError(f"{run_dir}: base model {model.name!r} ({model.dtype}) differs from "
                                   f"{first.name!r} ({first.dtype}) of {first_dir}; states compose only over one "
                                   "base model: compose runs of the same model")
