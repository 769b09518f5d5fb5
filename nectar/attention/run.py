"""Forward passes over query tokens only, with the document supplied by a provider.

``provider`` = ExactDocState(doc_kv)    → the full-context model (exact, document prefilled once)
``provider`` = ModuleDocState(module)   → the NECTAR-plugged model (no document KV at all)
``provider`` = None                     → the no-document model
Query tokens always sit at positions n … n+m-1 (DESIGN.md §3).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..models import BaseModel
from .interface import DocStateProvider, nectar_attention


def query_logits(
    base: BaseModel,
    provider: DocStateProvider | None,
    input_ids: torch.Tensor,  # [b, m] right-padded
    n: int,
    attention_mask: torch.Tensor | None = None,  # [b, m] 1 = real token
) -> torch.Tensor:
    """Teacher-forced logits [b, m, V] of the query tokens; differentiable w.r.t. the provider."""
    b, m = input_ids.shape
    positions = (n + torch.arange(m, device=input_ids.device)).unsqueeze(0).expand(b, m)  # [b, m]
    with nectar_attention(base.model, provider):
        out = base.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions,
                         use_cache=False)
    return out.logits


@dataclass
class GenerationResult:
    tokens: list[list[int]]  # generated ids per prompt (stop token excluded)
    ttft_s: float  # prefill of the prompts + first sampled token
    decode_s: float
    n_decoded: int  # tokens produced after the first, over the batch
    extra: dict = field(default_factory=dict)

    @property
    def decode_tok_s(self) -> float:
        return self.n_decoded / self.decode_s if self.decode_s > 0 else float("nan")


def sample_next(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator | None):
    """logits [b, V] → ids [b]; greedy when temperature == 0, else nucleus sampling."""
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    sorted_p, sorted_i = probs.sort(dim=-1, descending=True)
    keep = sorted_p.cumsum(-1) - sorted_p < top_p  # always keeps the top token
    sorted_p = sorted_p * keep
    choice = torch.multinomial(sorted_p / sorted_p.sum(-1, keepdim=True), 1, generator=gen)  # [b, 1]
    return sorted_i.gather(-1, choice).squeeze(-1)


@torch.no_grad()
def generate(
    base: BaseModel,
    provider: DocStateProvider | None,
    n: int,
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    stop_ids: tuple[int, ...] | None = None,
    on_token: Callable[[int, int], None] | None = None,
) -> GenerationResult:
    """Batched sampling over query tokens with a local KV cache only (left-padded prompts).

    ``on_token(row, token)`` is called for every kept token as it is sampled (streaming)."""
    from transformers import DynamicCache

    device = base.device
    stop = set(stop_ids if stop_ids is not None else _stop_ids(base))
    pad = base.tokenizer.pad_token_id or 0
    b, width = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((b, width), pad, dtype=torch.long, device=device)
    mask = torch.zeros((b, width), dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.as_tensor(p, device=device)
        mask[i, width - len(p):] = 1
    positions = (n + mask.cumsum(-1) - 1).clamp(min=n)  # [b, width]: real tokens at n, n+1, …
    gen = torch.Generator(device=device).manual_seed(seed) if temperature > 0 else None
    cache = DynamicCache(config=base.model.config)
    out_tokens: list[list[int]] = [[] for _ in range(b)]
    done = torch.zeros(b, dtype=torch.bool, device=device)
    t0 = time.perf_counter()
    with nectar_attention(base.model, provider):
        logits = base.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                            past_key_values=cache, use_cache=True).logits[:, -1]
        nxt = sample_next(logits, temperature, top_p, gen)
        _sync(device)
        ttft = time.perf_counter() - t0
        t1, n_decoded = time.perf_counter(), 0
        next_pos = positions[:, -1] + 1
        for step in range(max_new_tokens):
            for i in range(b):
                if not done[i]:
                    tok = int(nxt[i])
                    if tok in stop:
                        done[i] = True
                    else:
                        out_tokens[i].append(tok)
                        if on_token is not None:
                            on_token(i, tok)
            if bool(done.all()) or step == max_new_tokens - 1:
                break
            mask = torch.cat([mask, torch.ones((b, 1), dtype=mask.dtype, device=device)], dim=1)
            logits = base.model(input_ids=nxt.unsqueeze(1), attention_mask=mask,
                                position_ids=next_pos.unsqueeze(1), past_key_values=cache,
                                use_cache=True).logits[:, -1]
            nxt = sample_next(logits, temperature, top_p, gen)
            next_pos = next_pos + 1
            n_decoded += int((~done).sum())
        _sync(device)
    return GenerationResult(out_tokens, ttft, time.perf_counter() - t1, n_decoded)


def _stop_ids(base: BaseModel) -> tuple[int, ...]:
    eos = base.model.generation_config.eos_token_id if base.model.generation_config else None
    ids = eos if isinstance(eos, list) else [eos] if eos is not None else []
    if base.tokenizer.eos_token_id is not None:
        ids.append(base.tokenizer.eos_token_id)
    return tuple(sorted(set(ids)))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
