"""In-process chat backend: batched generation with transformers, xgrammar constraints, and one
shared-prefix KV cache reused across requests (DESIGN.md §7).

How a call runs: every prompt is rendered with the model's chat template and tokenized; the
longest token prefix shared by all prompts (in verification: template + instructions + the whole
document) is prefilled once — or found in the LRU of earlier prefixes — and requests run in
batches of ``batch_size`` after it. The batch never copies the prefix: each attention layer
merges the exact attention over the one shared prefix KV with the attention over the row's own
tokens (nectar.attention's exact document-state provider), so the cost per request does not
grow with batch × document. Within a batch the suffixes are left-padded (masked out, with
explicit positions so every real token keeps the position it would have unpadded); rows that
finish are removed from the batch so the rest decode faster.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch

from ..models import BaseModel
from .grammar import SchemaGrammar
from .kvcache import preallocated_cache
from .parsing import find_json
from .prefix import PrefixCacheLRU, PrefixKV, common_prefix_len, prefill
from .sampling import next_token, row_generator
from .types import ChatRequest, ChatResult, OnResult, Progress


@dataclass
class _Row:
    request: ChatRequest
    generator: torch.Generator | None
    matcher: object | None
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None


class LocalBackend:
    name = "local"

    def __init__(self, base: BaseModel, batch_size: int = 8, reuse_prefix: bool = True,
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
        entry = prefill(self.model, prompts[0][:common], base=cached)
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

    @contextlib.contextmanager
    def _prefix_attention(self, prefix: PrefixKV | None) -> Iterator[None]:
        """With a shared prefix, every attention layer merges the exact attention over the ONE
        prefix KV (batch folded into the query axis: no per-row copy of the document) with the
        attention over the row's own cached tokens — nectar.attention's exact provider."""
        if prefix is None:
            yield
            return
        from ..attention.interface import nectar_attention
        from ..attention.prefix import ExactDocState

        with nectar_attention(self.model, ExactDocState(prefix.doc_kv())):
            yield

    @torch.inference_mode()
    def _generate(self, suffixes: list[list[int]], requests: list[ChatRequest],
                  prefix: PrefixKV | None) -> list[ChatResult]:
        with self._prefix_attention(prefix):
            return self._decode(suffixes, requests, prefix)

    def _decode(self, suffixes: list[list[int]], requests: list[ChatRequest],
                prefix: PrefixKV | None) -> list[ChatResult]:
        device, p = self.base.device, (prefix.length if prefix else 0)
        cache, attn, logits = self._start_batch(suffixes, prefix, requests)
        rows = [self._new_row(req) for req in requests]
        next_pos = torch.tensor([p + len(x) for x in suffixes], device=device)  # [b]
        active = list(range(len(suffixes)))  # rows still decoding, in cache order
        while active:
            keep, tokens = self._step(logits, [rows[r] for r in active])
            if not keep:
                break
            if len(keep) < len(active):  # drop finished rows from the cache and masks
                idx = torch.tensor(keep, device=device)
                cache.batch_select_indices(idx)
                attn, next_pos = attn[idx], next_pos[idx]
                active = [active[j] for j in keep]
            attn = torch.cat([attn, torch.ones((len(active), 1), dtype=attn.dtype, device=device)], dim=1)
            step_ids = torch.tensor(tokens, device=device)[:, None]  # [b_active, 1]
            out = self.model(input_ids=step_ids, attention_mask=attn, position_ids=next_pos[:, None],
                             past_key_values=cache, use_cache=True)
            next_pos = next_pos + 1
            logits = out.logits[:, -1, :].float()
        return [self._result(row, p + len(x)) for row, x in zip(rows, suffixes)]

    @torch.inference_mode()
    def _start_batch(self, suffixes: list[list[int]], prefix: PrefixKV | None, requests: list[ChatRequest]):
        """Run the suffixes after the prefix: (cache, attention mask [b, s], last logits [b, V]).

        The cache and mask hold only the rows' own tokens; the prefix is attended through
        ``_prefix_attention`` (which must be active when a prefix is given)."""
        device, config = self.base.device, self.model.config
        b, s, p = len(suffixes), max(len(x) for x in suffixes), (prefix.length if prefix else 0)
        ids = torch.full((b, s), self.tokenizer.pad_token_id, dtype=torch.long, device=device)  # [b, s]
        real = torch.zeros((b, s), dtype=torch.long, device=device)  # [b, s] 1 = real token
        for r, x in enumerate(suffixes):
            ids[r, s - len(x):] = torch.tensor(x, device=device)
            real[r, s - len(x):] = 1
        # Real tokens sit at p, p+1, … exactly as without padding; pads get any valid position.
        pos = (p + real.cumsum(dim=1) - 1).clamp(min=0)  # [b, s]
        cache = preallocated_cache(config, b, s + max(r.max_new_tokens for r in requests))
        out = self.model(input_ids=ids, attention_mask=real, position_ids=pos, past_key_values=cache,
                         use_cache=True, logits_to_keep=1)
        self.prefill_tokens += int(real.sum())
        return cache, real, out.logits[:, -1, :].float()

    def _new_row(self, req: ChatRequest) -> _Row:
        gen = row_generator(req.seed, self.base.device) if req.temperature > 0 else None
        matcher = self._grammar_for().matcher(req.json_schema) if req.constrained else None
        return _Row(req, gen, matcher)

    def _step(self, logits: torch.Tensor, rows: list[_Row]) -> tuple[list[int], list[int]]:
        """Pick one token per active row; return (indices of rows still going, their tokens)."""
        matchers = [row.matcher for row in rows]
        if any(m is not None for m in matchers):
            self._grammar_for().mask_logits(logits, matchers)
        keep, tokens = [], []
        for j, row in enumerate(rows):
            tok = next_token(logits[j], row.request.temperature, row.request.top_p, row.generator)
            if row.matcher is not None and not row.matcher.accept_token(tok):
                row.finish_reason, row.error = "error", f"grammar rejected token {tok}"
                continue
            if tok in self.stop_ids:
                row.finish_reason = "stop"
                continue
            row.tokens.append(tok)
            if len(row.tokens) >= row.request.max_new_tokens:
                row.finish_reason = "length"
                continue
            keep.append(j)
            tokens.append(tok)
        return keep, tokens

    def _result(self, row: _Row, n_prompt: int) -> ChatResult:
        text = self.tokenizer.decode(row.tokens, skip_special_tokens=True)
        parsed = find_json(text) if row.request.json_schema is not None and row.error is None else None
        return ChatResult(text=text, parsed=parsed, error=row.error, finish_reason=row.finish_reason or "length",
                          prompt_tokens=n_prompt, completion_tokens=len(row.tokens))


def _stop_token_ids(tokenizer, model) -> set[int]:
    ids = {tokenizer.eos_token_id}
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos])
    return {i for i in ids if i is not None}
