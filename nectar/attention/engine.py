"""The one decode engine: batched sampling over query tokens with a document provider (docs/design.md §12).

Used by ``nectar ask``, evaluate's generations, the generation benchmark, the local LLM backend and
the server. A batch of requests (prompts of different lengths, each with its own token budget,
temperature, top-p, seed and callbacks) runs as:

  prefill   the prompts left-padded into one [b, w] forward, real tokens at positions n, n+1, …
            (explicit position ids), the LM head on the last position only;
  decode    one token per row per step. Everything a step touches lives on the device and is
            preallocated: the local KV cache and its masks (``LocalKV``), the positions, the sampling
            parameters, the token buffer. The host reads tokens back only every ``check_every``
            steps (stop ids, budgets and callbacks are applied then; on a CPU, where every op is
            synchronous anyway, after every step, so streaming is per token), and finished rows
            leave the batch at those checks.
  graphs    on CUDA the decode step is captured once per batch size in a CUDA graph (static
            shapes: the cache is attended over its whole capacity with future slots masked) and
            replayed, so a step costs one launch instead of a few thousand.

``generate`` keeps the old call (one set of sampling parameters, or a sequence per row).
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from ..base_model import BaseLM
from .interface import DocStateProvider, nectar_attention
from .local_cache import LocalKV
from .sampling import SamplingParams, sample

CAPACITY_STEP = 64  # local-cache capacities are rounded up to this, so runs of similar size share buffers
BUFFER_SETS = 4  # buffer sets (and their CUDA graphs) an engine keeps, least recently used dropped

# (row index in the request list, token) → True to end that row after this token
OnToken = Callable[[int, int], bool | None]
# (logits [b_active, V] float32, request index of each row) → mask logits in place (e.g. a grammar)
LogitsHook = Callable[[torch.Tensor, list[int]], None]


@dataclass
class Request:
    """One row: its prompt (query tokens, placed at positions n, n+1, …) and how to sample it."""

    prompt: Sequence[int]
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0


@dataclass
class GenerationResult:
    tokens: list[list[int]]  # generated ids per request (stop token excluded)
    ttft_s: float  # prefill of the prompts + first sampled token on the host
    decode_s: float
    n_decoded: int  # tokens produced after the first, over the batch
    finish_reasons: list[str] = field(default_factory=list)  # "stop" | "length" | "callback"
    extra: dict = field(default_factory=dict)

    @property
    def decode_tok_s(self) -> float:
        return self.n_decoded / self.decode_s if self.decode_s > 0 else float("nan")


def default_stop_ids(base: BaseLM) -> tuple[int, ...]:
    """The model's end-of-sequence ids (generation config and tokenizer)."""
    eos = base.model.generation_config.eos_token_id if base.model.generation_config else None
    ids = eos if isinstance(eos, list) else [eos] if eos is not None else []
    if base.tokenizer.eos_token_id is not None:
        ids.append(base.tokenizer.eos_token_id)
    return tuple(sorted(set(ids)))


class _Row:
    """Host-side state of one request while it decodes."""

    __slots__ = ("index", "request", "tokens", "finish_reason", "produced")

    def __init__(self, index: int, request: Request):
        self.index, self.request = index, request
        self.tokens: list[int] = []
        self.finish_reason: str | None = None
        self.produced = 0  # tokens sampled for this row, the stop token included


class DecodeEngine:
    """Decodes batches of requests with ``base`` and a document ``provider`` at offset ``n``.

    ``check_every``: decode steps between host reads of the sampled tokens (default: 1 on CPU, 8 on
    CUDA). ``cuda_graphs``: capture the decode step (default: on when the model is on CUDA).
    ``static_shapes``: the graph-capturable step without the capture (always on with graphs; tests
    use it on CPU)."""

    def __init__(self, base: BaseLM, provider: DocStateProvider | None, n: int,
                 stop_ids: Sequence[int] | None = None, check_every: int | None = None,
                 cuda_graphs: bool | None = None, static_shapes: bool = False):
        self.base, self.provider, self.n = base, provider, n
        self.device = base.device
        on_cuda = self.device.type == "cuda"
        self.stop_ids = frozenset(default_stop_ids(base) if stop_ids is None else stop_ids)
        self.check_every = max(1, check_every if check_every is not None else (8 if on_cuda else 1))
        self.cuda_graphs = on_cuda if cuda_graphs is None else cuda_graphs
        if self.cuda_graphs and not on_cuda:
            raise ValueError("cuda_graphs needs the model on CUDA")
        self.static_shapes = static_shapes or self.cuda_graphs
        self._buffers: OrderedDict[tuple[int, int], _Buffers] = OrderedDict()
        self._lock = threading.Lock()  # one batch at a time: runs share the engine's buffers

    def buffers(self, b: int, capacity: int) -> "_Buffers":
        key = (b, capacity)
        if key not in self._buffers:
            self._buffers[key] = _Buffers(self, b, capacity)
            while len(self._buffers) > BUFFER_SETS:
                self._buffers.popitem(last=False)
        self._buffers.move_to_end(key)
        return self._buffers[key]

    # ----- public API -----

    @torch.inference_mode()
    def run(self, requests: Sequence[Request], on_token: OnToken | None = None,
            logits_hook: LogitsHook | None = None) -> GenerationResult:
        """Decode every request to its stop id, its budget, or until ``on_token`` returns True.

        ``on_token(i, token)`` sees every kept token of request i in order (streaming); an exception
        raised in it ends the whole batch (the attention hooks are removed on the way out).
        ``logits_hook`` runs before every sampling, so with it the host checks after every step."""
        if not requests:
            return GenerationResult([], 0.0, 0.0, 0)
        for r in requests:
            if r.max_new_tokens < 1 or not len(r.prompt):
                raise ValueError(f"every request needs a non-empty prompt and max_new_tokens >= 1, got "
                                 f"{len(r.prompt)} prompt tokens and max_new_tokens={r.max_new_tokens}")
        with self._lock:
            return self._run(requests, on_token, logits_hook)

    def _run(self, requests, on_token, logits_hook) -> GenerationResult:
        check_every = 1 if logits_hook is not None else self.check_every
        batch = _Batch(self, requests)
        t0 = time.perf_counter()
        with nectar_attention(self.base.model, self.provider, local_kv=batch):
            logits = batch.prefill()
            tokens = batch.sample(logits, logits_hook)  # token 0 of every row
            batch.record(tokens)
            batch.check(on_token, self.stop_ids)  # the first token reaches the host: TTFT
            ttft = time.perf_counter() - t0
            t1 = time.perf_counter()
            while batch.active and batch.index < batch.max_new:
                if self.cuda_graphs and logits_hook is None:
                    batch.graph_step()
                else:
                    batch.record(batch.sample(batch.forward_step(), logits_hook))
                if batch.index - batch.checked >= check_every or batch.index >= batch.max_new:
                    batch.check(on_token, self.stop_ids)
            batch.check(on_token, self.stop_ids)
            _sync(self.device)
        decode_s = time.perf_counter() - t1
        rows = batch.rows
        n_decoded = sum(max(0, r.produced - 1) for r in rows)
        return GenerationResult([r.tokens for r in rows], ttft, decode_s, n_decoded,
                                [r.finish_reason or "length" for r in rows])

    @torch.inference_mode()
    def prefill_logits(self, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        """The next-token logits [b, V] after each prompt (what the first token is sampled from)."""
        with self._lock:
            batch = _Batch(self, [Request(p, 1) for p in prompts])
            with nectar_attention(self.base.model, self.provider, local_kv=batch):
                return batch.prefill()


class _Buffers:
    """The device state of ``b`` rows with room for ``capacity`` local tokens. An engine keeps a few
    and reuses them for every run of the same shape, so the CUDA graphs captured over them are
    reused too (a graph replays fixed addresses)."""

    def __init__(self, engine: DecodeEngine, b: int, capacity: int):
        base, dev = engine.base, engine.device
        self.kv = LocalKV(base.num_layers, b, base.num_kv_heads, base.num_q_heads, base.head_dim, capacity, dev,
                          engine.static_shapes)
        self.out = torch.zeros((b, capacity), dtype=torch.long, device=dev)  # sampled tokens per row
        self.next_tok = torch.zeros(b, dtype=torch.long, device=dev)  # [b] input of the next step
        self.pos = torch.zeros(b, dtype=torch.long, device=dev)  # [b] its position
        self.index_t = torch.zeros((), dtype=torch.long, device=dev)  # tokens sampled per row (device)
        self.temperature = torch.zeros(b, dtype=torch.float32, device=dev)
        self.top_p = torch.ones(b, dtype=torch.float32, device=dev)
        self.seeds = torch.zeros(b, dtype=torch.int64, device=dev)
        self.graphs: dict[tuple, _GraphedStep] = {}  # by the sampler's code path

    def params(self, any_sampled: bool, any_nucleus: bool, any_full: bool) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_p, self.seeds, any_sampled, any_nucleus, any_full)


class _Batch:
    """One engine run: host rows and the device buffers they decode in; rows that finish leave the
    batch at host checks (their state moves into the engine's buffers for the smaller batch). The
    attention function reaches the current buffers through ``attend``."""

    def __init__(self, engine: DecodeEngine, requests: Sequence[Request]):
        self.engine = engine
        self.rows = [_Row(i, r) for i, r in enumerate(requests)]
        self.active = list(self.rows)  # in device row order
        self.width = max(len(r.prompt) for r in requests)
        self.max_new = max(r.max_new_tokens for r in requests)
        self.capacity = -(-(self.width + self.max_new) // CAPACITY_STEP) * CAPACITY_STEP
        self.bufs = engine.buffers(len(requests), self.capacity)
        self.bufs.kv.reset()
        self.bufs.index_t.zero_()
        self.bufs.temperature.copy_(torch.tensor([float(r.temperature) for r in requests]))
        self.bufs.top_p.copy_(torch.tensor([float(r.top_p) for r in requests]))
        self.bufs.seeds.copy_(torch.tensor([int(r.seed) & 0x7FFF_FFFF_FFFF_FFFF for r in requests], dtype=torch.int64))
        self.params = self.bufs.params(*_sampler_path(requests))
        self.index = 0  # tokens sampled per row so far (the answer position of the next one)
        self.checked = 0  # tokens already handed to the host

    @property
    def kv(self) -> LocalKV:
        return self.bufs.kv

    def attend(self, layer, q, k, v, scaling, doc) -> torch.Tensor:
        return self.bufs.kv.attend(layer, q, k, v, scaling, doc)

    # ----- device work -----

    def prefill(self) -> torch.Tensor:
        e, dev = self.engine, self.engine.device
        b, w = len(self.rows), self.width
        pad = e.base.tokenizer.pad_token_id or 0
        ids = torch.full((b, w), pad, dtype=torch.long)
        real = torch.zeros((b, w), dtype=torch.bool)
        for i, row in enumerate(self.rows):
            p = list(row.request.prompt)
            ids[i, w - len(p):] = torch.tensor(p)
            real[i, w - len(p):] = True
        ids, real = ids.to(dev), real.to(dev)
        positions = (e.n + real.long().cumsum(-1) - 1).clamp(min=e.n)  # [b, w]: real tokens at n, n+1, …
        self.kv.begin_prefill(real)
        logits = e.base.model(input_ids=ids, position_ids=positions, use_cache=False, logits_to_keep=1).logits
        self.kv.end_forward(w)
        self.bufs.pos.copy_(positions[:, -1] + 1)
        return logits[:, -1].float()  # [b, V]

    def forward_step(self) -> torch.Tensor:
        """One decode forward over ``next_tok`` at ``pos`` → logits [b, V] (float32)."""
        bufs = self.bufs
        bufs.kv.begin_decode_step()
        logits = self.engine.base.model(input_ids=bufs.next_tok[:, None], position_ids=bufs.pos[:, None],
                                        use_cache=False, logits_to_keep=1).logits
        bufs.kv.end_forward(1)
        bufs.pos += 1
        return logits[:, -1].float()

    def sample(self, logits: torch.Tensor, hook: LogitsHook | None) -> torch.Tensor:
        if hook is not None:
            hook(logits, [r.index for r in self.active])
        static = self.engine.static_shapes
        return sample(logits, self.params, self.bufs.index_t if static else self.index, host_checks=not static)

    def record(self, tokens: torch.Tensor) -> None:
        bufs = self.bufs
        if self.engine.static_shapes:
            bufs.out.index_copy_(1, bufs.index_t.view(1), tokens[:, None])
        else:
            bufs.out[:, self.index] = tokens
        bufs.index_t += 1
        bufs.next_tok.copy_(tokens)
        self.index += 1

    def graph_step(self) -> None:
        """forward + sample + record, replayed from a CUDA graph captured over these buffers."""
        p = self.params
        key = (p.any_sampled, p.any_nucleus, p.any_full)
        if key not in self.bufs.graphs:
            self.bufs.graphs[key] = _GraphedStep(self)
        self.bufs.graphs[key].replay()
        self.kv.length += 1  # host mirrors of what the graph advanced on the device
        self.index += 1

    def _static_step(self) -> None:
        """The captured body: reads and writes only the buffers' preallocated device tensors."""
        bufs = self.bufs
        tokens = sample(self.forward_step(), self.params, bufs.index_t, host_checks=False)
        bufs.out.index_copy_(1, bufs.index_t.view(1), tokens[:, None])
        bufs.index_t += 1
        bufs.next_tok.copy_(tokens)

    # ----- host work -----

    def check(self, on_token: OnToken | None, stop_ids: frozenset[int]) -> None:
        """Hand the tokens sampled since the last check to their rows; drop rows that finished."""
        if self.index == self.checked or not self.active:
            return
        block = self.bufs.out[:, self.checked:self.index].tolist()  # the one host read per check
        for row, toks in zip(self.active, block):
            for tok in toks:
                if row.finish_reason is not None:
                    break
                row.produced += 1
                if tok in stop_ids:
                    row.finish_reason = "stop"
                    break
                row.tokens.append(tok)
                if on_token is not None and on_token(row.index, tok):
                    row.finish_reason = "callback"
                elif len(row.tokens) >= row.request.max_new_tokens:
                    row.finish_reason = "length"
        self.checked = self.index
        keep = [j for j, r in enumerate(self.active) if r.finish_reason is None]
        if len(keep) < len(self.active):
            self._select(keep)

    def _select(self, keep: list[int]) -> None:
        """Move the rows in ``keep`` into the engine's buffers for a batch of len(keep)."""
        self.active = [self.active[j] for j in keep]
        if not keep:
            return
        old = self.bufs
        rows = torch.tensor(keep, dtype=torch.long, device=self.engine.device)
        new = self.engine.buffers(len(keep), self.capacity)
        new.kv.copy_rows(old.kv, rows)
        for name in ("out", "next_tok", "pos", "temperature", "top_p", "seeds"):
            getattr(new, name).copy_(getattr(old, name)[rows])
        new.index_t.copy_(old.index_t)
        self.bufs = new
        self.params = new.params(*_sampler_path([r.request for r in self.active]))
        self.max_new = max(r.request.max_new_tokens for r in self.active)


def _sampler_path(requests: Sequence[Request]) -> tuple[bool, bool, bool]:
    """(any sampled row, any nucleus row, any full-softmax row): which sampler paths a batch needs."""
    sampled = [r for r in requests if r.temperature > 0]
    return bool(sampled), any(r.top_p < 1.0 for r in sampled), any(r.top_p >= 1.0 for r in sampled)


class _GraphedStep:
    """A CUDA graph of ``_Batch._static_step`` over the batch's current buffers.

    Warm-up runs (on a side stream, as capture requires) really execute the step, so the small
    mutable state is saved before and restored after: the decode then resumes exactly where it was
    (the K/V written into future slots is masked again by the restored bias and overwritten later).
    Graphs of one engine share a memory pool."""

    _pool = None

    def __init__(self, batch: _Batch, warmup: int = 2):
        b = batch.bufs
        state = [b.next_tok, b.pos, b.index_t, b.kv.slot, b.kv.bias, b.out]
        saved, length = [t.clone() for t in state], batch.kv.length
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(warmup):
                batch._static_step()
        torch.cuda.current_stream().wait_stream(stream)
        self._restore(state, saved, batch, length)
        if _GraphedStep._pool is None:
            _GraphedStep._pool = torch.cuda.graph_pool_handle()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=_GraphedStep._pool):
            batch._static_step()
        self._restore(state, saved, batch, length)  # capture records the step but does not run it

    @staticmethod
    def _restore(state, saved, batch, length) -> None:
        for t, s in zip(state, saved):
            t.copy_(s)
        batch.kv.length = length

    def replay(self) -> None:
        self.graph.replay()


@torch.inference_mode()
def generate(
    base: BaseLM,
    provider: DocStateProvider | None,
    n: int,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int | Sequence[int],
    temperature: float | Sequence[float] = 0.0,
    top_p: float | Sequence[float] = 1.0,
    seed: int | Sequence[int] = 0,
    stop_ids: Sequence[int] | None = None,
    on_token: OnToken | None = None,
    logits_hook: LogitsHook | None = None,
    check_every: int | None = None,
) -> GenerationResult:
    """Sample answers to ``prompts`` (query tokens after an n-token document the provider stands for).

    Sampling parameters are one value for every row or a sequence with one per row. A single ``seed``
    s gives row i the seed s + i. Each row's draws depend only on its seed and token index, so a row
    samples the same answer in any batch. ``on_token(row, token)`` sees every kept token (streaming);
    returning True ends that row; an exception ends the batch. ``stop_ids`` default to the model's
    end-of-sequence ids; ``()`` decodes every row to its budget."""
    b = len(prompts)
    seeds = [seed + i for i in range(b)] if isinstance(seed, int) else list(seed)
    reqs = [Request(p, m, t, tp, s) for p, m, t, tp, s in zip(
        prompts, _per_row(max_new_tokens, b), _per_row(temperature, b), _per_row(top_p, b), seeds)]
    engine = DecodeEngine(base, provider, n, stop_ids=stop_ids, check_every=check_every)
    return engine.run(reqs, on_token=on_token, logits_hook=logits_hook)


def _per_row(value, b: int) -> list:
    if isinstance(value, (int, float)):
        return [value] * b
    values = list(value)
    if len(values) != b:
        raise ValueError(f"got {len(values)} per-row values for {b} prompts")
    return values


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
