"""JSON-schema constrained decoding with xgrammar (the grammar engine vLLM uses).

One compiler per tokenizer per process, and compiled grammars cached by schema, shared by every
backend in the process: compiling length-bounded strings (``maxLength``) costs seconds, once. Each constrained row of a
batch gets its own GrammarMatcher: before sampling, the matcher fills that row's bit of the token
bitmask and the bitmask sets every token the schema forbids to -inf; after sampling the chosen
token is fed back to the matcher.
"""
from __future__ import annotations

import json
from typing import Any

import torch
import xgrammar as xgr


_SHARED: dict[tuple, tuple[xgr.GrammarCompiler, dict[str, xgr.CompiledGrammar]]] = {}


class SchemaGrammar:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]):
        self.vocab_size = vocab_size
        key = (getattr(tokenizer, "name_or_path", ""), len(tokenizer), vocab_size, tuple(sorted(stop_token_ids)))
        if key not in _SHARED:
            info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
            _SHARED[key] = (xgr.GrammarCompiler(info, max_threads=2), {})
        self._compiler, self._compiled = _SHARED[key]

    def matcher(self, schema: dict[str, Any]) -> xgr.GrammarMatcher:
        key = json.dumps(schema)  # not sort_keys: property order is the order the model must write them
        if key not in self._compiled:
            # Compact separators: no free whitespace, so a weak model can't stall in endless blanks.
            self._compiled[key] = self._compiler.compile_json_schema(key, any_whitespace=False)
        return xgr.GrammarMatcher(self._compiled[key])

    def mask_logits(self, logits: torch.Tensor, matchers: list[xgr.GrammarMatcher | None]) -> None:
        """In place: logits [b, V]; row i is constrained by matchers[i] (None = unconstrained)."""
        rows = [i for i, m in enumerate(matchers) if m is not None and not m.is_terminated()]
        if not rows:
            return
        bitmask = xgr.allocate_token_bitmask(len(matchers), self.vocab_size)  # [b, ceil(V/32)] int32
        for i in rows:
            matchers[i].fill_next_token_bitmask(bitmask, i)
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size, indices=rows)
