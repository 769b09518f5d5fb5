"""In-process chat backend: batched generation with transformers, xgrammar constraints, and one
shared-prefix KV cache reused across requests (docs/design.md §7).

How a call runs: every prompt is rendered with the model's chat template and tokenized; the
longest token prefix shared by all prompts (in verification: template + instructions + the whole
document) is prefilled once — or found in the LRU of earlier prefixes — and requests run in
batches of ``batch_size`` after it. The batch never copies the prefix: each attention layer
merges the exact attention over the one shared prefix KV with the attention over the row's own
tokens (nectar.attention's exact document-state provider), so the cost per request does not
grow with batch × document. Decoding is the project's one decode engine
(``nectar.attention.engine``): suffixes left-padded with explicit positions, a preallocated local
cache, each row with its own budget, temperature, top-p and seed; rows that finish leave the batch
so the rest decode faster. A JSON-schema row masks its logits before every sampling (xgrammar) and
feeds each token back to its matcher.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from ..attention.engine import DecodeEngine, Request
from ..attention.exact import ExactDocState
from ..base_model import BaseLM
from .grammar import SchemaGrammar
from .parsing import find_json
from .prefix import PrefixCacheLRU, PrefixKV, common_prefix_len, prefill
from .types import ChatRequest, ChatResult, OnResult, Progress


@dataclass
class _Row:
    request: ChatRequest
    matcher: object | None
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None


class LocalBackend:
    name = "local"

    def __init__(self, base: BaseLM, batch_size: int = 8, reuse_prefix: bool = True,
                 min_prefix_tokens: int = 32, prefix_slack_tokens: int = 64, prefix_entries: int = 4):
        self.base = base
        self.model, self.tokenizer = base.model, base.tokenizer
        self.batch_size = max(1, batch_size)
        self.reuse_prefix = reuse_prefix
        # Prefixes shorter than this aren't worth a cache entry (a chat template's system header).
        self.min_prefix_tokens = min_prefix_tokens
        # A cached prefix is reused when the call's common prefix is at most this much longer:
        # re-running a few shared question tokens per row beats re-prefilling the document.
        self.prefix_slack_tokens = prefix_slack_tokens
        self.prefixes = PrefixCacheLRU(prefix_entries)
        self.stop_ids = _stop_token_ids(self.tokenizer, self.model)
        self._grammar: SchemaGrammar | None = None
        self.prefill_tokens = 0  # tokens run through the model in prompt processing (for benchmarks)

    # ----- the ChatBackend interface -----

    def context_window(self) -> int:
        return self.base.max_context_tokens

    def encode(self, request: ChatRequest) -> list[int]:
        text = self.tokenizer.apply_chat_template(list(request.messages), add_generation_prompt=True, tokenize=False)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prompt_tokens(self, request: ChatRequest) -> int:
        return len(self.encode(request))

    def chat_many(self, requests: Sequence[ChatRequest], progress: Progress | None = None,
                  on_result: OnResult | None = None) -> list[ChatResult]:
        results: list[ChatResult | None] = [None] * len(requests)

        def finish(i: int, result: ChatResult) -> None:
            results[i] = result
            if on_result is not None:
                on_result(i, result)

        encoded = [self.encode(r) for r in requests]
        runnable = []
        for i, (req, ids) in enumerate(zip(requests, encoded)):
            too_long = self._too_long(len(ids), req.max_new_tokens)
            if too_long:
                finish(i, ChatResult(text="", error=too_long, finish_reason="error", prompt_tokens=len(ids)))
            else:
                runnable.append(i)
        done = len(requests) - len(runnable)
        if progress is not None and done:
            progress(done, len(requests))
        prefix = self._shared_prefix([encoded[i] for i in runnable])
        p = prefix.length if prefix else 0
        # Longest suffixes first: rows of similar length share a batch, so little padding.
        order = sorted(runnable, key=lambda i: len(encoded[i]), reverse=True)
        for b in range(0, len(order), self.batch_size):
            batch = order[b:b + self.batch_size]
            outs = self._generate_safely([encoded[i][p:] for i in batch], [requests[i] for i in batch], prefix)
            for i, out in zip(batch, outs):
                finish(i, out)
            done += len(batch)
            if progress is not None:
                progress(done, len(requests))
        return results  # type: ignore[return-value]

    # ----- internals -----

    def _too_long(self, n_prompt: int, max_new: int) -> str | None:
        window = self.base.max_context_tokens
        if n_prompt + max_new > window:
            return (f"prompt is {n_prompt} tokens + max_new_tokens {max_new} = {n_prompt + max_new}, over the "
                    f"model's window of {window} tokens ({self.base.name})")
        return None

    def _shared_prefix(self, prompts: list[list[int]]) -> PrefixKV | None:
        if not self.reuse_prefix or not prompts:
            return None
        cached = self.prefixes.longest_shared(prompts)
        # Leave at least one token per prompt to run: its logits start generation.
        common = min(common_prefix_len(prompts), min(len(p) for p in prompts) - 1)
        if cached is not None and common - cached.length <= self.prefix_slack_tokens:
            self.prefixes.hits += 1
            return cached
        if len(prompts) < 2 or common < self.min_prefix_tokens:
            return cached  # a one-off prompt isn't worth a cache entry
        self.prefixes.misses += 1
        entry = prefill(self.base, prompts[0][:common], start=cached)
        self.prefill_tokens += common - (cached.length if cached else 0)
        self.prefixes.put(entry)
        return entry

    def _generate_safely(self, suffixes, requests, prefix) -> list[ChatResult]:
        try:
            return self._generate(suffixes, requests, prefix)
        except (RuntimeError, MemoryError) as exc:  # e.g. out of memory: fail this batch, not the call
            msg = f"local generation failed: {type(exc).__name__}: {exc}"
            return [ChatResult(text="", error=msg, finish_reason="error") for _ in requests]

    def _grammar_for(self) -> SchemaGrammar:
        if self._grammar is None:
            vocab = self.model.get_output_embeddings().weight.shape[0]
            self._grammar = SchemaGrammar(self.tokenizer, vocab, sorted(self.stop_ids))
        return self._grammar

    def engine(self, prefix: PrefixKV | None) -> DecodeEngine:
        """The decode engine over ``prefix``: every attention layer merges the exact attention over
        the ONE prefix KV (batch folded into the query axis: no per-row copy of the document) with
        the attention over the row's own tokens — nectar.attention's exact provider."""
        provider = ExactDocState(prefix.doc_kv()) if prefix is not None else None
        return DecodeEngine(self.base, provider, prefix.length if prefix else 0, stop_ids=sorted(self.stop_ids))

    def _generate(self, suffixes: list[list[int]], requests: list[ChatRequest],
                  prefix: PrefixKV | None) -> list[ChatResult]:
        rows = [_Row(req, self._grammar_for().matcher(req.json_schema) if req.constrained else None)
                for req in requests]

        def on_token(i: int, tok: int) -> bool:
            row = rows[i]
            if row.matcher is not None and not row.matcher.accept_token(tok):
                row.finish_reason, row.error = "error", f"grammar rejected token {tok}"
                return True
            row.tokens.append(tok)
            return False

        hook = None
        if any(row.matcher is not None for row in rows):
            def hook(logits: torch.Tensor, active: list[int]) -> None:
                self._grammar_for().mask_logits(logits, [rows[i].matcher for i in active])

        reqs = [Request(x, r.max_new_tokens, r.temperature, r.top_p, r.seed) for x, r in zip(suffixes, requests)]
        res = self.engine(prefix).run(reqs, on_token=on_token, logits_hook=hook)
        self.prefill_tokens += sum(len(x) for x in suffixes)
        p = prefix.length if prefix else 0
        for row, reason in zip(rows, res.finish_reasons):
            row.finish_reason = row.finish_reason or reason
        return [self._result(row, p + len(x)) for row, x in zip(rows, suffixes)]

    def _result(self, row: _Row, n_prompt: int) -> ChatResult:
        text = self.tokenizer.decode(row.tokens, skip_special_tokens=True)
        parsed = find_json(text) if row.request.json_schema is not None and row.error is None else None
        return ChatResult(text=text, parsed=parsed, error=row.error, finish_reason=row.finish_reason or "length",
                          prompt_tokens=n_prompt, completion_tokens=len(row.tokens),
                          meta={"completion_ids": list(row.tokens)})


def _stop_token_ids(tokenizer, model) -> set[int]:
    ids = {tokenizer.eos_token_id}
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos])
    return {i for i in ids if i is not None}
