"""Online targets: q, α, A of stored query tokens recomputed when training asks for them.

A cached group stores q, α, A for every query token (about 140 kB per token on SmolLM2-135M in
float32, 460 kB on Qwen3-1.7B); an "online" group stores only the token ids, positions, masks and
the teacher's top-K. Training then gets its (q, α, A) rows from ``OnlineTargets``: the pairs that
hold the requested tokens are run through the SAME capture code as the targets stage
(``capture_packed``: query-only forwards, packed, with the exact document state from the document
KV — prefilled once by the targets stage, loaded once onto the device here), each pair only up to
its last requested token (attention is causal, so a prefix gives the same rows).

What it costs: a step of b random tokens runs up to b pairs' prefixes through the frozen model (no
gradient, no LM head), instead of reading b rows; a step of b pairs runs those pairs once more.
What it saves: the q, α, A bytes (all but ~1 % of the group).
"""
from __future__ import annotations

import numpy as np
import torch

from ..attention.doc_kv import DocKV
from ..attention.exact import ExactDocState
from ..base_model import BaseLM
from .reader import TargetsData, TokenBatch
from .capture import capture_packed


class OnlineTargets:
    """A value source for ``TargetsData.attach_values``: rows computed from the document KV."""

    def __init__(self, data: TargetsData, base: BaseLM, doc_kv: DocKV, backend: str = "auto",
                 batch_pairs: int = 64, batch_tokens: int = 2048):
        if doc_kv.n != data.header.n_context:
            raise ValueError(f"document KV has n={doc_kv.n} tokens, the targets n={data.header.n_context}")
        self.data, self.base = data, base
        on_device = DocKV([k.to(base.device) for k in doc_kv.keys], [v.to(base.device) for v in doc_kv.values])
        self.provider = ExactDocState(on_device, backend=backend)
        self.batch_pairs, self.batch_tokens = batch_pairs, batch_tokens
        self.tokens_run = 0  # query tokens forwarded so far (for benchmarks: the compute it costs)

    def __call__(self, index: np.ndarray) -> TokenBatch:
        d = self.data
        index = np.asarray(index, dtype=np.int64)
        pair = np.searchsorted(d.offsets, index, side="right") - 1  # [N] the pair of each token
        # each pair only up to its last requested token: (start, stop) in global token indices
        spans = [(int(d.offsets[p]), int(index[pair == p].max()) + 1) for p in np.unique(pair)]
        ids = d.token_rows("token_ids", np.concatenate([np.arange(a, b) for a, b in spans])).astype(np.int64)
        seqs, at = [], 0
        for a, b in spans:
            seqs.append(ids[at:at + b - a].tolist())
            at += b - a
        row_of: dict[int, int] = {}  # global token index → row of the concatenated outputs
        q, alpha, A, done = [], [], [], 0
        for group in _groups([b - a for a, b in spans], self.batch_pairs, self.batch_tokens):
            cap = capture_packed(self.base, self.provider, [seqs[i] for i in group], d.header.n_context, top_k=1,
                                 logit_rows=torch.zeros(sum(len(seqs[i]) for i in group), dtype=torch.bool,
                                                        device=self.base.device))  # no LM head
            for i in group:
                a, b = spans[i]
                row_of.update(zip(range(a, b), range(done, done + b - a)))
                done += b - a
            q.append(cap.q)
            alpha.append(cap.alpha)
            A.append(cap.A)
        self.tokens_run += done
        take = torch.as_tensor([row_of[int(i)] for i in index], device=self.base.device)
        return TokenBatch(torch.cat(q)[take], torch.cat(alpha)[take], torch.cat(A)[take])


def _groups(lengths: list[int], max_pairs: int, max_tokens: int) -> list[list[int]]:
    """Consecutive groups of sequences, at most ``max_pairs`` and ``max_tokens`` each (a longer one
    alone): the targets stage's packing bounds (nectar.stages.targets.batch_plan)."""
    groups, cur, tokens = [], [], 0
    for i, n in enumerate(lengths):
        if cur and (len(cur) >= max_pairs or tokens + n > max_tokens):
            groups.append(cur)
            cur, tokens = [], 0
        cur.append(i)
        tokens += n
    if cur:
        groups.append(cur)
    return groups
