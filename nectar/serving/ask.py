"""``nectar ask RUN_DIR "question"``: answer from the trained module, without the document.

The base model sees only the question's query tokens, at positions n, n+1, … (as if the n-token
document preceded them); every attention layer blends the module's (A_θ, a_θ) with the local
causal state over the question and the answer so far (docs/design.md §2). No document KV is loaded:
memory is the base model plus the module and a local cache of the query tokens.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..attention.engine import generate
from ..base_model import BaseLM
from ..layout import PromptLayout
from ..modules.builder import NectarModule
from ..modules.provider import inference_provider
from .composite import composed_provider
from .loader import load_served_module, open_served_runs
from .registry import open_registry
from .text_stream import Detokenizer, TextCallback


@dataclass
class Answer:
    text: str
    token_ids: list[int]
    n_context: int  # the document length the module stands in for


def stream_tokens(base: BaseLM, provider, n: int, prompt: list[int], max_new_tokens: int,
                  temperature: float, top_p: float, seed: int, on_token: Callable[[int], None],
                  stop_ids: tuple[int, ...] | None = None) -> list[int]:
    """Sample one answer (prompt at positions n, n+1, …), calling ``on_token`` as tokens arrive."""
    result = generate(base, provider, n, [prompt], max_new_tokens, temperature, top_p, seed, stop_ids,
                      on_token=lambda _row, tok: on_token(tok))
    return result.tokens[0]


def answer(base: BaseLM, module: NectarModule, layout: PromptLayout, n_context: int, question: str,
           stream: TextCallback | None = None, max_new_tokens: int = 196, temperature: float = 0.7,
           top_p: float = 0.8, seed: int = 0) -> Answer:
    if not question.strip():
        raise ValueError("the question is empty")
    detok = Detokenizer(base.tokenizer, stream)
    prompt = layout.prompt(question).ids
    provider = inference_provider(module, base.dtype)  # the fused module (modules/fused.py)
    tokens = stream_tokens(base, provider, n_context, prompt, max_new_tokens, temperature, top_p, seed, detok.push)
    return Answer(detok.text(), tokens, n_context)


def ask(run_dir: str, question: str, stream: TextCallback | None = None, *,
        max_new_tokens: int | None = None, temperature: float | None = None, top_p: float | None = None,
        seed: int = 0) -> Answer:
    """Load the run's base model and trained module and answer ``question``, streaming text.

    Generation defaults are the run's evaluation settings (nucleus p, temperature, the non-QA
    token limit); the module is checked against the run's model and document before use.
    """
    served = load_served_module(run_dir)  # the server's loader: the same checks
    base, module, layout, spec, ev = served.base, served.module, served.layout, served.spec, served.defaults
    return answer(base, module, layout, spec.n_context, question, stream,
                  max_new_tokens if max_new_tokens is not None else ev.max_tokens,
                  temperature if temperature is not None else ev.temperature,
                  top_p if top_p is not None else ev.top_p, seed)


def ask_composed(run_dirs: list[str], question: str, stream: TextCallback | None = None, *,
                 positions: str = "concat", max_new_tokens: int | None = None, temperature: float | None = None,
                 top_p: float | None = None, seed: int = 0) -> Answer:
    """Answer ``question`` from several runs' modules at once: their states composed (the documents in
    the order given, nectar/attention/compose.py). The runs must share one base model (the server's
    check, one line); generation defaults are the first run's."""
    if not question.strip():
        raise ValueError("the question is empty")
    registry = open_registry(open_served_runs(run_dirs), None, max_module_bytes=1 << 62)
    docs = list(registry.documents.values())
    base = registry.base
    provider, n = composed_provider(base, [registry.provider(d.name) for d in docs], docs, positions)
    ev = docs[0].defaults
    detok = Detokenizer(base.tokenizer, stream)
    prompt = docs[0].layout.prompt(question).ids  # the query part: the same for every document of one tokenizer
    tokens = stream_tokens(base, provider, n, prompt, max_new_tokens if max_new_tokens is not None else ev.max_tokens,
                           temperature if temperature is not None else ev.temperature,
                           top_p if top_p is not None else ev.top_p, seed, detok.push)
    return Answer(detok.text(), tokens, n)
