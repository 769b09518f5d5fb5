"""recon_fit's mechanics (recon_fit.py fits them together): keys scored by how much reconstructing the
document attends to them — KVzip's context reconstruction (Kim et al. 2025, "KVzip: query-agnostic KV
cache compression with context reconstruction") — one budget ranked across all layers and KV heads,
anchors kept exact; then, optionally, Attention Matching's closed-form β and values on the kept keys
(what this project adds on top).

  1. score    the reconstruction spans (nectar/queries/recon.py) run through the model against the
              exact document KV; at every layer, key j of KV head h scores its attention probability
              under the WHOLE softmax (document keys and the query's own tokens: a head that mostly
              reads its local context gives the document little), aggregated over the response
              tokens and the GQA group by max (no position starved) or mean; with a score window,
              only over the batches whose spans lie within W tokens of key j (KVzip's chunk-local
              scoring)                                                            → [L, Hkv, n]
  2. allocate the plan's total bytes as (key, value) pairs: one ranking over every (layer, head,
              key) (``global``), per layer (``layer``) or per head (``head``); anchors (first
              ``sink_tokens`` tokens, optionally every chat-template token) first, and every head
              keeps at least its best key                                         → counts [L, Hkv]
  3. fit      (``fit``) β by NNLS and values by least squares on the kept keys (matching_fit.py),
              on the reconstruction queries (and the targets' train queries)
The state is a quadrature module whose layers are as wide as their widest head; a head with fewer
keys has masked slots (β = −inf, W = Z = 0) that no query reaches and that count no bytes.
"""
from __future__ import annotations

import bisect
import dataclasses
import time
from dataclasses import dataclass

import torch

from ..attention.exact import ExactDocState
from ..attention.interface import nectar_attention
from ..attention.state import AttnState
from ..layout import PromptLayout
from ..base_model import BaseLM
from ..modules.budget import ragged_beta_bits
from ..modules.builder import ModulePlan, NectarModule, build_module
from ..modules.provider import group_queries, grouped_targets
from ..modules.stored import quantize_module_
from ..quantization import fake_quantize
from ..targets.capture import pack
from .merging import merge_head
from .matching_fit import capped_log_mass, capped_masses, capped_values, fit_log_mass, fit_values
from .selection import attention_probs

RECON_BATCH_TOKENS = 1024  # query tokens per scoring forward (bounds the [Hq, T, n] probabilities)


@dataclass
class ReconCapture:
    """What reconstructing the document gives: key scores and the response tokens' exact targets."""

    scores: torch.Tensor  # [L, Hkv, n] aggregated attention probability of every document key
    q: torch.Tensor  # [T, L, Hq, d] rotated queries of the response tokens
    alpha: torch.Tensor  # [T, L, Hq] log-sum-exp over the document keys
    A: torch.Tensor  # [T, L, Hq, d] document attention outputs


class _ScoreRecorder:
    """Per layer: the max (or summed) whole-softmax probability of every document key over the
    response rows of the batch, and those rows' (q, α, A)."""

    def __init__(self, keys: list[torch.Tensor], rows: torch.Tensor, scaling: float, aggregate: str,
                 scores: torch.Tensor, ranges: list[tuple[int, int]] | None = None):
        self.keys, self.rows, self.scaling, self.aggregate = keys, rows, scaling, aggregate
        self.ranges = ranges  # [start, end) intervals of the keys scored (max only); None: every key
        self.scores = scores  # [L, Hkv, n], updated in place
        self.q: dict[int, torch.Tensor] = {}
        self.alpha: dict[int, torch.Tensor] = {}
        self.A: dict[int, torch.Tensor] = {}

    def __call__(self, layer: int, q: torch.Tensor, doc: AttnState | None, local: AttnState | None) -> None:
        qr = q[0][:, self.rows].float()  # [Hq, R, d]
        doc_lse = doc.lse[0][:, self.rows].float()  # [Hq, R]
        total = doc_lse if local is None else torch.logaddexp(doc_lse, local.lse[0][:, self.rows].float())
        keys = self.keys[layer].float()  # [Hkv, n, d]
        if self.aggregate == "max":
            self.scores[layer] = torch.maximum(self.scores[layer], self._max_probs(qr, total, keys, self.ranges))
        else:
            hkv, g = keys.shape[0], qr.shape[0] // keys.shape[0]
            logits = torch.einsum("hgrd,hnd->hgrn", qr.reshape(hkv, g, -1, qr.shape[-1]), keys)  # [Hkv, g, R, n]
            # in place: exp(logits · s − total) without two more [Hkv, g, R, n] buffers
            self.scores[layer] += logits.mul_(self.scaling).sub_(total.reshape(hkv, g, -1, 1)).exp_().sum(dim=(1, 2))
        self.q[layer] = qr.transpose(0, 1)  # [R, Hq, d]
        self.alpha[layer] = doc_lse.transpose(0, 1)  # [R, Hq]
        self.A[layer] = doc.out[0][:, self.rows].float().transpose(0, 1)  # [R, Hq, d]

    def _max_probs(self, qr: torch.Tensor, total: torch.Tensor, keys: torch.Tensor,
                   ranges: list[tuple[int, int]] | None = None) -> torch.Tensor:
        """[Hkv, n]: max over the rows and a KV head's query heads of exp(s·q·k − total); only the keys
        in ``ranges`` ([start, end) intervals; None: all), the others 0 (exp(−inf)).

        max_r exp(x_r) = exp(max_r x_r), so the max is taken before the exp, and −total is folded into
        the product as one more dimension ([s·q, −total]·[k, 1]). The keys go through in blocks of
        ``score_keys(g·R)``: a [Hkv, keys, g·R] logit block stays in the cache between the matmul that
        writes it and the max that reads it along its rows — contiguous, where a block of query rows
        maxed down its columns ran at half the speed (benchmarks/first_state_scaling.py;
        docs/benchmarks.md), and the whole [Hkv, g·R, n] (450 MB per layer at R = 1k rows and n = 12k
        keys) went out to memory and back. The max is exact, so the blocks change only the matmul's
        summation order."""
        hkv, (hq, R, d) = keys.shape[0], qr.shape
        qa = torch.cat([qr * self.scaling, -total.unsqueeze(-1)], -1).reshape(hkv, hq // hkv * R, d + 1)
        qa = qa.transpose(1, 2).contiguous()  # [Hkv, d + 1, g·R]
        ka = torch.cat([keys, keys.new_ones(*keys.shape[:2], 1)], -1)  # [Hkv, n, d + 1]
        n = keys.shape[1]
        best = torch.full((hkv, n), float("-inf"), device=keys.device)  # [Hkv, n]
        step = score_keys(qa.shape[2])
        for lo, hi in ([(0, n)] if ranges is None else ranges):
            for start in range(lo, hi, step):
                end = min(start + step, hi)
                best[:, start:end] = torch.bmm(ka[:, start:end], qa).amax(dim=2)
        return best.exp_()


def score_keys(rows: int) -> int:
    """Keys per scoring block against ``rows`` query rows (g·R): ~4 MB of float32 logits per KV head,
    32 to 512 keys. Measured on the 2-core AMD VM (``_max_probs``, 3 KV heads, 11,485 keys, alternating
    with the row blocks it replaced): idle at 2,640 rows 105–120 ms against 185–260 ms (the matmul's rate
    against half of it); beside the test suite at 3,000 rows 0.35–0.74 s against 1.49–1.60 s; level at
    3,652 keys; 256–512 keys a block best, 1,024 slower."""
    return max(32, min(512, (1 << 20) // max(rows, 1)))


@torch.no_grad()
def recon_capture(base: BaseLM, layout: PromptLayout, doc_kv, spans: list[tuple[str, str]],
                  aggregate: str = "max", gap: int = 0, window: int | None = None) -> ReconCapture:
    """Run the reconstruction spans ((instruction, response) pairs) against the exact document KV.

    ``gap``: the spans start ``gap`` positions after the document (at n + gap instead of n) while its
    keys stay at 0 … n − 1 — as a composition asks this document when ``gap`` tokens of other
    documents follow it (nectar/attention/compose.py ``part_gaps``). Their (α, A) over this document's
    keys are exactly this part's share of the composed merge; 0 is the document alone, bit for bit.

    ``window`` (max aggregate only): a batch scores only the keys within ``window`` tokens of the
    document text its spans reconstruct (``score_ranges``), as KVzip scores a chunk's keys by that
    chunk's reconstruction alone — the scoring's cost then grows with n, not n² (the attention itself
    still reads every key). None: every batch scores every key."""
    if not spans:
        raise ValueError("no reconstruction spans: the document has no unit outside the withheld blocks")
    if window is not None and aggregate != "max":
        raise ValueError(f"a score window needs the max aggregate (got {aggregate!r}): a windowed mean would "
                         "average each key over a different set of rows; set score_window=null")
    pairs = [layout.pair(i, r) for i, r in spans]
    spans_keys = None if window is None else response_tokens(layout, [r for _, r in spans])
    L, n = base.num_layers, layout.n
    keys = [k.to(base.device) for k in doc_kv.keys]
    scores = torch.zeros(L, base.num_kv_heads, n, device=base.device)
    provider = ExactDocState(doc_kv)
    qs, alphas, As = [], [], []
    for index, ranges in scored_batches(pairs, spans_keys, window, n):
        batch = [pairs[i] for i in index]
        ids, positions, segments = pack([p.ids for p in batch], n + gap, base.device)
        rows = torch.cat([torch.arange(s + p.response_start, e, device=base.device)
                          for p, (s, e) in zip(batch, segments)])  # response tokens (the span itself)
        rec = _ScoreRecorder(keys, rows, base.scaling, aggregate, scores, ranges)
        with nectar_attention(base.model, provider, recorder=rec, segments=segments):
            base.model.get_decoder()(input_ids=ids, position_ids=positions, use_cache=False)
        qs.append(torch.stack([rec.q[i] for i in range(L)], 1).cpu())  # [R, L, Hq, d]
        alphas.append(torch.stack([rec.alpha[i] for i in range(L)], 1).cpu())
        As.append(torch.stack([rec.A[i] for i in range(L)], 1).cpu())
    if aggregate == "mean":
        scores /= sum(len(q) for q in qs) * (base.num_q_heads // base.num_kv_heads)
    return ReconCapture(scores.cpu(), torch.cat(qs), torch.cat(alphas), torch.cat(As))


def recon_batches(lengths: list[int], max_tokens: int):
    """Indices of consecutive pairs, as many as ``max_tokens`` tokens hold (at least one)."""
    batch, tokens = [], 0
    for i, length in enumerate(lengths):
        if batch and tokens + length > max_tokens:
            yield batch
            batch, tokens = [], 0
        batch.append(i)
        tokens += length
    if batch:
        yield batch


def scored_batches(pairs, spans_keys: list[tuple[int, int] | None] | None, window: int | None, n: int):
    """(indices, ranges) per reconstruction batch: the pairs it packs (``RECON_BATCH_TOKENS``) and the key
    intervals it scores — None (every key) without a window, or when one of its spans could not be
    placed (exact, as without a window)."""
    for index in recon_batches([len(p.ids) for p in pairs], RECON_BATCH_TOKENS):
        placed = None if spans_keys is None else [spans_keys[i] for i in index]
        yield index, (None if placed is None or None in placed else score_ranges(placed, window, n))


def response_tokens(layout: PromptLayout, responses: list[str]) -> list[tuple[int, int] | None]:
    """[start, end) of each response's tokens in the document's context: the text found in the decoded
    context after the previous response (a tiling pass is in document order; a response not found
    there is searched from the start — the next pass), mapped to tokens by the tokenizer's offsets.
    None for a response that cannot be placed (not found, or a tokenizer without character offsets
    or whose decoded context re-tokenizes otherwise): its batch then scores every key."""
    tok, ids = layout.tokenizer, list(layout.context_ids)
    text = tok.decode(ids)
    try:
        enc = tok(text, return_offsets_mapping=True, add_special_tokens=False)
    except (NotImplementedError, ValueError, TypeError):
        return [None] * len(responses)  # a slow tokenizer: no offsets
    if list(enc["input_ids"]) != ids:
        return [None] * len(responses)
    starts = [a for a, _ in enc["offset_mapping"]]
    ends = [b for _, b in enc["offset_mapping"]]
    ranges: list[tuple[int, int] | None] = []
    cursor = 0
    for response in responses:
        needle = response.strip()
        at = text.find(needle, cursor) if needle else -1
        at = text.find(needle) if at < 0 and needle else at
        if at < 0:
            ranges.append(None)
            continue
        first, last = bisect.bisect_right(ends, at), bisect.bisect_left(starts, at + len(needle))
        ranges.append((first, max(last, first + 1)))
        cursor = at + len(needle)
    return ranges


def score_ranges(spans_keys: list[tuple[int, int]], window: int, n: int) -> list[tuple[int, int]]:
    """The keys a batch scores: each of its spans' tokens ± ``window``, within [0, n), merged into
    disjoint [start, end) intervals in order."""
    merged: list[list[int]] = []
    for lo, hi in sorted((max(0, a - window), min(n, b + window)) for a, b in spans_keys):
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return [(lo, hi) for lo, hi in merged]


def anchor_mask(n: int, sink_tokens: int, template: torch.Tensor | None = None) -> torch.Tensor:
    """[n] bool: the first ``sink_tokens`` context tokens, and the template tokens when given."""
    mask = torch.zeros(n, dtype=torch.bool)
    mask[:min(sink_tokens, n)] = True
    if template is not None:
        mask |= template
    return mask


def template_mask(layout: PromptLayout, document: str) -> torch.Tensor:
    """[n] bool: context tokens outside the document text (the chat template and the wrapper)."""
    tok, ids = layout.tokenizer, list(layout.context_ids)
    text = tok.decode(ids)
    start = text.find(document.strip()[:64])
    if start < 0:
        raise ValueError("the document text is not found in its decoded context; cannot mark template tokens")
    end = start + len(document.strip())

    def first_token_reaching(chars: int) -> int:  # smallest i whose decoded prefix ids[:i] covers `chars`
        lo, hi = 0, len(ids)
        while lo < hi:
            mid = (lo + hi) // 2
            if len(tok.decode(ids[:mid])) >= chars:
                hi = mid
            else:
                lo = mid + 1
        return lo

    mask = torch.ones(len(ids), dtype=torch.bool)
    mask[first_token_reaching(start + 1) - 1: first_token_reaching(end)] = False  # tokens touching the text
    return mask


def allocate(scores: torch.Tensor, plan: ModulePlan, pair_bytes: int, mode: str,
             anchors: torch.Tensor) -> list[list[torch.Tensor]]:
    """Kept key indices per (layer, KV head) (document order) within the plan's total budget.

    scores [L, H, n]; ``pair_bytes`` stored bytes per kept key (``budget.ragged_pair_bytes``: 4·2d
    float32, or 4·(2d + 1) with β; fewer at int8/int4, so more keys). The total is the plan's bytes,
    4·H·ΣP_ℓ, as every other system at this ρ; ``layer``/``head`` split it as the plan does."""
    L, H, n = scores.shape
    s = scores.clone().float()
    s[:, :, anchors] = float("inf")  # anchors first
    best = s.argmax(-1)  # [L, H]: every head keeps at least one key
    s.scatter_(-1, best.unsqueeze(-1), float("inf"))
    keep = torch.zeros(L, H, n, dtype=torch.bool)
    if mode == "global":
        total = 4 * H * sum(plan.budgets) // pair_bytes
        _keep_top(keep.view(-1), s.view(-1), total, "the whole state")
    elif mode == "layer":
        for layer in range(L):
            _keep_top(keep[layer].view(-1), s[layer].reshape(-1), 4 * H * plan.budgets[layer] // pair_bytes,
                      f"layer {layer}")
    elif mode == "head":
        for layer in range(L):
            for h in range(H):
                _keep_top(keep[layer, h], s[layer, h], 4 * plan.budgets[layer] // pair_bytes, f"layer {layer} head {h}")
    else:
        raise ValueError(f"unknown budget mode {mode!r}; use global, layer or head")
    return [[keep[layer, h].nonzero().squeeze(1) for h in range(H)] for layer in range(L)]


def combined_scores(recon: torch.Tensor, train: torch.Tensor, keys: int) -> torch.Tensor:
    """max(recon / t_r, train / t_t) [L, H, n], each score divided by its own value at the ``keys``-th
    rank (what alone would just make the budget's cut), so 1 means "kept by this ranking on its own":
    neither the reconstruction queries' whole-softmax probabilities nor the train queries' document
    probabilities (larger: their softmax leaves out the query's own tokens) swamp the other."""
    def at_cut(x: torch.Tensor) -> torch.Tensor:
        k = max(1, min(keys, x.numel()))
        return torch.topk(x.reshape(-1).float(), k).values[-1].clamp_min(1e-30)
    return torch.maximum(recon.float() / at_cut(recon), train.float() / at_cut(train))


@torch.no_grad()
def train_scores(data, keys: list[torch.Tensor], scaling: float, aggregate: str = "max") -> torch.Tensor:
    """[L, Hkv, n]: every document key's attention probability under the train queries (``data``:
    q [T, L, Hq, d], alpha [T, L, Hq]), max (or mean) over the queries and the GQA group."""
    L = len(keys)
    hkv = keys[0].shape[0]
    out = torch.zeros(L, hkv, keys[0].shape[1])
    for layer in range(L):
        q = group_queries(data.q[:, layer].float(), hkv)  # [T·g, Hkv, d]
        alpha = group_queries(data.alpha[:, layer].float().unsqueeze(-1), hkv).squeeze(-1)  # [T·g, Hkv]
        for h in range(hkv):
            probs = attention_probs(q[:, h], alpha[:, h], keys[layer][h].float().cpu(), scaling)  # [T·g, n]
            out[layer, h] = probs.amax(0) if aggregate == "max" else probs.mean(0)
    return out


def _keep_top(keep: torch.Tensor, scores: torch.Tensor, k: int, where: str) -> None:
    forced = int(torch.isinf(scores).sum())
    if forced > k:
        raise ValueError(f"{where}: {forced} anchor keys need more than its budget of {k} pairs; "
                         "lower select.sink_tokens, turn off select.template_tokens or raise rho")
    keep[torch.topk(scores, min(k, scores.numel())).indices] = True


def selection_plan(plan: ModulePlan, kept: list[list[torch.Tensor]], fit: bool) -> ModulePlan:
    """The quadrature plan holding ``kept``: each layer as wide as its widest head, with β (masks)."""
    counts = tuple(tuple(int(i.numel()) for i in heads) for heads in kept)
    return dataclasses.replace(plan, arch="quadrature", mlp_widths=(), quad_bias=True,
                               quad_pairs=tuple(max(c) for c in counts), quad_head_pairs=counts,
                               quad_bias_stored=fit)


@torch.no_grad()
def build_selected(plan: ModulePlan, kept: list[list[torch.Tensor]], doc_kv, queries=None,
                   quant_aware: bool = True, timings: dict[str, float] | None = None,
                   fit_keys: int | None = None, value_rounding: str = "nearest", fit_prior: str = "kept",
                   merge: bool = False, choose: bool = False) -> NectarModule:
    """The module of the kept keys: exact KV (β = 0), or with fitted β and values when ``queries``
    (an object with q [T, L, Hq, d], alpha [T, L, Hq], A [T, L, Hq, d]) are given.

    At ``plan.bits`` < 32 the pairs are stored quantized (modules/stored.py: keys and values as codes,
    β as bf16). ``quant_aware``: β is fitted to the masses of the keys as stored and the values to
    those keys and the stored β (Attention Matching's fit, aware of the rounding); otherwise fitted in
    float and rounded after. The module returned holds the stored values either way. ``timings``:
    the fit's wall seconds (fit_s) and its β fits' and value solves' shares of them (fit_mass_s,
    fit_values_s) added to it. ``fit_keys``: at most this many keys of a head fitted jointly
    (matching_fit.fitted_keys; None: all). ``value_rounding`` "gptq": with ``quant_aware`` below 32 bits,
    the fitted values reach their grid by the value fit's own objective (value_rounding.py), else each
    is rounded to its nearest point when the module is stored. ``fit_prior`` "merged": the fit's ridge pulls
    β and the values toward the evicted keys merged into the kept ones (merging.py) instead of β = 0 and
    the kept keys' own values (heads over ``fit_keys`` keep the plain prior). ``merge``: β and the values
    are the merge itself, no least squares (``select.fit_by``). ``choose``: each head's least squares or merge,
    whichever holds up better on the fit queries it was not fitted on (``_HeadFit.choose``; ``fit_by: choose``),
    the share of heads merged added to ``timings`` as ``fit_merged_share``."""
    timings = {} if timings is None else timings
    module = build_module(plan)
    hkv, bits, group = plan.num_kv_heads, plan.bits, plan.quant_group
    aware = quant_aware and bits < 32
    grid = (bits, group) if aware and value_rounding == "gptq" else None  # the values' rounding in the fit

    def rows(x: torch.Tensor) -> torch.Tensor:  # [c, d] as stored (each row quantized along d)
        return fake_quantize(x, bits, group) if aware else x

    def log_mass(beta: torch.Tensor) -> torch.Tensor:  # β as stored
        return fake_quantize(beta.float(), ragged_beta_bits(bits)) if aware else beta

    pairs, heads = [], []
    for layer in range(len(module.layers)):
        p = plan.quad_pairs[layer]
        keys = doc_kv.keys[layer].detach().float().cpu()  # [Hkv, n, d]
        values = doc_kv.values[layer].detach().float().cpu()
        W = torch.zeros(hkv, p, plan.head_dim)
        Z = torch.zeros(hkv, p, plan.head_dim)
        B = torch.full((hkv, p), float("-inf"))  # masked slots
        if queries is not None:
            q, alpha, A = grouped_targets(queries, layer, hkv)  # [T·g, Hkv, d], [T·g, Hkv], [T·g, Hkv, d]
        for h, idx in enumerate(kept[layer]):
            c = idx.numel()
            if c == 0:  # a head this state keeps nothing of (a mixed-precision part): all slots masked
                continue
            Wh = rows(keys[h, idx])  # [c, d]
            W[h, :c], Z[h, :c], B[h, :c] = Wh, values[h, idx], 0.0
            if queries is not None:
                merged_from = (keys[h], values[h], idx) if fit_prior == "merged" or merge or choose else None
                heads.append(_HeadFit(layer, h, q[:, h], alpha[:, h], A[:, h], Wh, values[h, idx], merged_from,
                                      prior_merged=fit_prior == "merged"))
        pairs.append((W, Z, B))
    if heads:
        start = time.perf_counter()
        def solve(t: _HeadFit):
            if choose:
                return t.choose(plan.scaling, log_mass, rows, fit_keys, grid)
            return t.merge(plan.scaling) if merge else t.fit(plan.scaling, log_mass, fit_keys, grid)

        fitted = run_per_head(solve, heads, cost=lambda t: min(t.keys.shape[0], fit_keys or t.keys.shape[0]))
        if choose:
            timings["fit_merged_share"] = sum(f[4] for f in fitted) / len(fitted)
        wall = time.perf_counter() - start
        for t, (beta, Zh, *_) in zip(heads, fitted):
            _, Z, B = pairs[t.layer]
            c = t.keys.shape[0]
            Z[t.head, :c], B[t.head, :c] = Zh, beta
        busy = sum(f[2] + f[3] for f in fitted) or 1.0
        timings["fit_s"] = timings.get("fit_s", 0.0) + wall
        for key, share in (("fit_mass_s", sum(f[2] for f in fitted) / busy),
                           ("fit_values_s", sum(f[3] for f in fitted) / busy)):
            timings[key] = timings.get(key, 0.0) + wall * share
    for net, (W, Z, B) in zip(module.layers, pairs):
        net.set_pairs(W, Z, B)
    return quantize_module_(module).eval()  # real pairs onto the stored grid (no-op at 32 bits)


@dataclass
class _HeadFit:
    """One (layer, KV head)'s closed-form fit: its fit queries and its kept keys (as stored) and values."""

    layer: int
    head: int
    q: torch.Tensor  # [T·g, d]
    alpha: torch.Tensor  # [T·g]
    A: torch.Tensor  # [T·g, d]
    keys: torch.Tensor  # [c, d]
    values: torch.Tensor  # [c, d]
    # the head's document keys and values [n, d] and the kept indices [c], which the merge (merging.py) reads;
    # None where nothing merges
    merged_from: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # select.fit_prior "merged": the merge is the ridge's prior for β and the values; else β = 0 and the kept values
    prior_merged: bool = False

    def fit(self, scaling: float, log_mass, cap: int | None = None, grid: tuple[int, int] | None = None
            ) -> tuple[torch.Tensor, torch.Tensor, float, float]:
        """(β [c], values [c, d], seconds of the β fit, seconds of the value solve); at most ``cap``
        keys solved jointly (the rest keep β = 0 and their values); ``grid`` (bits, group): the solved
        values rounded onto it by the fit's objective (matching_fit.fit_values)."""
        start = time.perf_counter()
        # over the cap: the fitted keys' masses and the fixed keys' sums, in row blocks; else None
        capped = capped_masses(self.q, self.alpha, self.keys, self.values, scaling, cap)
        prior_w, prior = None, self.values
        if capped is None:
            if self.prior_merged:  # the merge as the ridge's prior (a capped head keeps the plain one)
                merged_beta, prior = merge_head(self.q, self.alpha, *self.merged_from, self.keys, scaling)
                prior_w = merged_beta.double().exp()
            mass = attention_probs(self.q, self.alpha, self.keys, scaling)  # [T·g, c]
            beta = log_mass(fit_log_mass(mass, prior=prior_w))
        else:
            beta = log_mass(capped_log_mass(capped, self.keys.shape[0]))
        mid = time.perf_counter()
        Z = fit_values(mass, beta, self.A, prior, grid=grid) if capped is None else \
            capped_values(capped, beta, self.A, self.values, grid)
        return beta.float(), Z.float(), mid - start, time.perf_counter() - mid


    def merge(self, scaling: float) -> tuple[torch.Tensor, torch.Tensor, float, float]:
        """(β [c], values [c, d], seconds, 0): the evicted keys merged into the kept ones (merging.py)."""
        start = time.perf_counter()
        beta, Z = merge_head(self.q, self.alpha, *self.merged_from, self.keys, scaling)
        return beta, Z, time.perf_counter() - start, 0.0

    def choose(self, scaling: float, log_mass, stored, cap: int | None = None, grid: tuple[int, int] | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, float, float, bool]:
        """``fit``'s or ``merge``'s (β, values, seconds, seconds), whichever does better on queries it did not see,
        and whether that is the merge: both are made from the fit queries less every HELD_OUT_EVERY-th block of
        HELD_OUT_BLOCK rows (neighbouring tokens' queries are alike, so single held-out rows would flatter least
        squares, which follows its queries closely), scored on the held-out blocks as stored (β by ``log_mass``,
        the values by ``stored``) by ``held_out_error``, and the winner is made again from every query.

        Why per head: least squares holds up where a head keeps few keys for its queries and overfits where it
        keeps many (docs/quality.md, "Merging evicted keys instead of fitting"); at 1 % of the bytes the two trade
        places by document, so the data of each head decide. (Where heads keep tens of keys this measure misleads:
        docs/quality.md, "Least squares or merge, head by head".)"""
        held = held_out_rows(self.q.shape[0])
        if not held.any():  # too few queries to hold any out: least squares, as below the merge's share
            return (*self.fit(scaling, log_mass, cap, grid), False)
        seen, unseen = self.rows(~held), self.rows(held)
        errors = [unseen.held_out_error(scaling, log_mass(beta), stored(Z))
                  for beta, Z, *_ in (seen.fit(scaling, log_mass, cap, grid), seen.merge(scaling))]
        merged = errors[1] <= errors[0]
        return (*(self.merge(scaling) if merged else self.fit(scaling, log_mass, cap, grid)), merged)

    def rows(self, mask: torch.Tensor) -> "_HeadFit":
        """This head with only the fit queries ``mask`` [T·g] bool selects."""
        return dataclasses.replace(self, q=self.q[mask], alpha=self.alpha[mask], A=self.A[mask])

    def held_out_error(self, scaling: float, beta: torch.Tensor, Z: torch.Tensor) -> float:
        """Σ_q ‖M_q·o_q − A_q‖² / Σ_q ‖A_q‖² of the state (the kept keys, β [c], values Z [c, d]) on these queries:
        M_q its attention mass relative to the document's (1 exactly), o_q its output, A_q the document's — the
        document's share of the attention numerator, so a wrong mass counts as well as a wrong output."""
        mass = attention_probs(self.q, self.alpha, self.keys, scaling).double() * beta.double().exp()  # [N, c]
        error = ((mass @ Z.double() - self.A.double()) ** 2).sum()  # [N, d] → Σ
        return float(error / (self.A.double() ** 2).sum().clamp_min(1e-30))


HELD_OUT_BLOCK = 96  # fit-query rows a held-out block (32 tokens' queries at g = 3)
HELD_OUT_EVERY = 5  # every 5th block held out: a fifth of the queries


def held_out_rows(n: int) -> torch.Tensor:
    """[n] bool: the rows of every HELD_OUT_EVERY-th block of HELD_OUT_BLOCK (the blocks at 4, 9, 14, …, so
    fewer than 5 blocks hold none out)."""
    return (torch.arange(n) // HELD_OUT_BLOCK) % HELD_OUT_EVERY == HELD_OUT_EVERY - 1


def run_per_head(fn, tasks: list, cost) -> list:
    """``[fn(t) for t in tasks]``, the tasks spread over torch's thread count of Python threads, each
    running its BLAS/LAPACK calls single-threaded, largest ``cost`` first.

    A head's fit is ~10 BLAS/LAPACK calls on matrices of a few hundred to a few thousand rows: split
    across two threads each call waits at a barrier for the slower one, and on a shared 2-core machine
    a descheduled BLAS thread stalls every call (the 1.5k document's fit took 20 s at load 3 against
    7 s idle). One head per core keeps both cores busy without a barrier; torch, numpy and scipy
    release the GIL inside their kernels."""
    workers = min(torch.get_num_threads(), len(tasks))
    if workers <= 1:
        return [fn(t) for t in tasks]
    from concurrent.futures import ThreadPoolExecutor

    from threadpoolctl import threadpool_limits

    order = sorted(range(len(tasks)), key=lambda i: -cost(tasks[i]))
    previous = torch.get_num_threads()
    results: list = [None] * len(tasks)
    with threadpool_limits(limits=1):  # numpy's and scipy's OpenBLAS
        torch.set_num_threads(1)
        try:
            with ThreadPoolExecutor(max_workers=workers) as pool:
                for i, out in zip(order, pool.map(lambda i: fn(tasks[i]), order)):
                    results[i] = out
        finally:
            torch.set_num_threads(previous)
    return results
