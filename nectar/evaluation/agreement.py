"""Judge-free generation agreement with the full-context model (docs/design.md §11).

Every system and the full-context model continue the same prompts greedily (a pair's query tokens up
to its response: the instruction in the prompt layout); each system's continuation is compared with
the full model's: exact match (identical tokens), ROUGE-L F1 (word LCS, ``rouge.py``) and the cosine
of the two texts' all-MiniLM-L6-v2 embeddings. On document probes ("continue this passage") exact
match and ROUGE-L say whether the system reproduces what the document makes the model say; on test
answers ROUGE-L and the cosine say whether it answers alike. The full model's continuations are
generated once and shared by every system; generations are capped (``max_new_tokens``) since
agreement needs the start of an answer, not all of it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from ..attention.engine import generate
from ..base_model import BaseLM
from .rouge import rouge_l

Embed = Callable[[list[str]], np.ndarray]  # texts → unit-norm embeddings [N, e]


@dataclass
class AgreementScores:
    """Per-pair agreement of one system with the full-context model, arrays [P] in prompt order."""

    exact: np.ndarray  # 1.0 where the greedy token sequences are identical
    rouge_l: np.ndarray  # ROUGE-L F1 of the decoded texts
    cosine: np.ndarray  # embedding cosine (nan without an embedder)


def greedy_continuations(
    base: BaseLM,
    n: int,
    providers: dict[str, Callable | None],
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    batch_size: int = 8,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, list[list[int]]]:
    """{system: greedy continuation tokens per prompt}; prompts are batched by length (less left
    padding) and the results put back in the given order."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: dict[str, list[list[int]]] = {name: [[] for _ in prompts] for name in providers}
    done, total = 0, len(prompts) * len(providers)
    for lo in range(0, len(order), batch_size):
        idx = order[lo: lo + batch_size]
        batch = [list(prompts[i]) for i in idx]
        for name, provider in providers.items():
            res = generate(base, provider, n, batch, max_new_tokens=max_new_tokens, temperature=0.0)
            for i, toks in zip(idx, res.tokens):
                out[name][i] = list(toks)
            done += len(batch)
            if progress:
                progress(done, total)
    return out


def agreement_scores(decode: Callable[[list[int]], str], reference: Sequence[Sequence[int]],
                     candidate: Sequence[Sequence[int]], embed: Embed | None = None) -> AgreementScores:
    """Agreement of ``candidate`` continuations with the ``reference`` (full-context) ones."""
    if len(reference) != len(candidate):
        raise ValueError(f"{len(candidate)} continuations to compare with {len(reference)} references")
    ref_text = [decode(list(r)) for r in reference]
    cand_text = [decode(list(c)) for c in candidate]
    exact = np.array([float(list(r) == list(c)) for r, c in zip(reference, candidate)])
    rouge = np.array([rouge_l(c, r).f1 for c, r in zip(cand_text, ref_text)])
    if embed is None or not reference:
        cosine = np.full(len(reference), np.nan)
    else:
        e = embed(ref_text + cand_text)  # [2P, e], unit norm
        cosine = np.clip((e[: len(ref_text)] * e[len(ref_text):]).sum(-1), -1.0, 1.0)
        cosine[exact == 1.0] = 1.0  # the same tokens: the same text, whatever the float rounding says
    return AgreementScores(exact, rouge, cosine)


def sentence_embedder(path: str) -> Embed:
    """Unit-norm sentence embeddings from a sentence-transformers folder (``models.embedder_path``)."""
    from ..base_model import load_embedder

    model = load_embedder(path)

    def embed(texts: list[str]) -> np.ndarray:
        # One text per forward: a text's embedding must not depend on which others share its batch
        # (padding to the longest changes the matmul shapes, so the float result moves in its last
        # bits). A resumed run, whose batch held other texts, then scores exactly as an uninterrupted
        # one. Each distinct text once; MiniLM on ~1k short continuations costs seconds either way.
        unique = list(dict.fromkeys(texts))
        vectors = {t: np.asarray(model.encode([t], normalize_embeddings=True, convert_to_numpy=True,
                                              batch_size=1, show_progress_bar=False), dtype=np.float64)[0]
                   for t in unique}
        return np.stack([vectors[t] for t in texts]) if texts else np.zeros((0, 0))

    return embed
