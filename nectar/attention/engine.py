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
            replayed, so a step costs one launch instead of a few thousand;
  joins     (continuous batching) at every host check ``admit`` may hand over new requests: they are
            prefilled on their own, then merged into the running batch, which continues with them
            (their prompts right-aligned with the running rows' caches, so every row still writes
            the same slot; leading slots no row uses any more are dropped at the merge);
  documents a request may carry its own document provider (``Request.doc``): rows of different
            documents decode in the same steps, each layer asking every provider for its own rows;
  GEMMs     on a CPU in float32 the base model's linear layers with more than one row run through
            oneDNN while the engine runs (``cpu_gemm.onednn_linears``: MKL's few-row GEMM is several
            times slower per row there), so a batch of 8 costs what it should.

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
from .cpu_gemm import onednn_linears
from .interface import DocStateProvider, nectar_attention
from .local_cache import LocalKV
from .sampling import SamplingParams, sample
from .state import AttnState

CAPACITY_STEP = 64  # local-cache capacities are rounded up to this, so runs of similar size share buffers
BUFFER_SETS = 4  # buffer sets (and their CUDA graphs) an engine keeps, least recently used dropped

# (row index in the request list, token) → True to end that row after this token
OnToken = Callable[[int, int], bool | None]
# (logits [b_active, V] float32, request index of each row) → mask logits in place (e.g. a grammar)
LogitsHook = Callable[[torch.Tensor, list[int]], None]
# (rows still decoding) → requests that join the running batch now (continuous batching)
Admit = Callable[[int], Sequence["Request"]]


@dataclass
class Request:
    """One row: its prompt (query tokens, placed at positions n, n+1, …) and how to sample it."""

    prompt: Sequence[int]
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    doc: DocStateProvider | None = None  # this row's document (None: the engine's provider)
    n: int | None = None  # its length, the prompt's first position (None: the engine's n)


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

    __slots__ = ("index", "request", "tokens", "finish_reason", "produced", "start")

    def __init__(self, index: int, request: Request, start: int = 0):
        self.index, self.request = index, request
        self.tokens: list[int] = []
        self.finish_reason: str | None = None
        self.produced = 0  # tokens sampled for this row, the stop token included
        self.start = start  # local slot (past the virtual keys) of the row's first real token

    @property
    def remaining(self) -> int:
        return self.request.max_new_tokens - self.produced


class DecodeEngine:
    """Decodes batches of requests with ``base`` and a document ``provider`` at offset ``n``.

    ``check_every``: decode steps between host reads of the sampled tokens (default: 1 on CPU, 8 on
    CUDA). ``cuda_graphs``: capture the decode step (default: on when the model is on CUDA).
    ``static_shapes``: the graph-capturable step without the capture (always on with graphs; tests
    use it on CPU). ``onednn``: a float32 CPU model's multi-row linear layers through oneDNN while
    the engine runs (``cpu_gemm``; False: MKL throughout, for A/B measurements)."""

    def __init__(self, base: BaseLM, provider: DocStateProvider | None, n: int,
                 stop_ids: Sequence[int] | None = None, check_every: int | None = None,
                 cuda_graphs: bool | None = None, static_shapes: bool = False, onednn: bool = True):
        self.base, self.provider, self.n, self.onednn = base, provider, n, onednn
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
            logits_hook: LogitsHook | None = None, admit: Admit | None = None) -> GenerationResult:
        """Decode every request to its stop id, its budget, or until ``on_token`` returns True.

        ``on_token(i, token)`` sees every kept token of request i in order (streaming); an exception
        raised in it ends the whole batch (the attention hooks are removed on the way out).
        ``logits_hook`` runs before every sampling, so with it the host checks after every step.
        ``admit(active)``, called at every host check, returns requests that join the batch there;
        they are numbered after the ones before them (``on_token`` and the result use that index)."""
        if not requests:
            return GenerationResult([], 0.0, 0.0, 0)
        _check_requests(requests)
        with self._lock:
            return self._run(requests, on_token, logits_hook, admit)

    def _run(self, requests, on_token, logits_hook, admit) -> GenerationResult:
        check_every = 1 if logits_hook is not None else self.check_every
        batch = _Batch(self, requests)
        current = _Current(batch)
        t0 = time.perf_counter()
        with nectar_attention(self.base.model, current.doc_state, local_kv=current), \
                onednn_linears(self.base.model, self.onednn):
            logits = batch.prefill()
            tokens = batch.sample(logits, logits_hook)  # token 0 of every row
            batch.record(tokens)
            batch.check(on_token, self.stop_ids)  # the first token reaches the host: TTFT
            ttft = time.perf_counter() - t0
            t1 = time.perf_counter()
            if admit is not None:
                batch.join(admit, current, on_token, logits_hook)
            while batch.active and batch.step < batch.horizon:
                if self.cuda_graphs and logits_hook is None:
                    batch.graph_step()
                else:
                    batch.record(batch.sample(batch.forward_step(), logits_hook))
                if batch.step - batch.checked >= check_every or batch.step >= batch.horizon:
                    batch.check(on_token, self.stop_ids)
                    if admit is not None:
                        batch.join(admit, current, on_token, logits_hook)
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
            current = _Current(batch)
            with nectar_attention(self.base.model, current.doc_state, local_kv=current), \
                    onednn_linears(self.base.model, self.onednn):
                return batch.prefill()


def _check_requests(requests: Sequence[Request]) -> None:
    for r in requests:
        if r.max_new_tokens < 1 or not len(r.prompt):
            raise ValueError(f"every request needs a non-empty prompt and max_new_tokens >= 1, got "
                             f"{len(r.prompt)} prompt tokens and max_new_tokens={r.max_new_tokens}")


class _Current:
    """What the attention function reaches during a run: the batch being forwarded now (the running
    batch, or requests joining it while they are prefilled on their own)."""

    def __init__(self, batch: "_Batch"):
        self.batch = batch

    def attend(self, layer, q, k, v, scaling, doc) -> torch.Tensor:
        return self.batch.bufs.kv.attend(layer, q, k, v, scaling, doc)

    def doc_state(self, layer: int, q: torch.Tensor, scaling: float) -> AttnState | None:
        return self.batch.doc_state(layer, q, scaling)


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
        self.index_t = torch.zeros(b, dtype=torch.long, device=dev)  # [b] tokens sampled per row (device)
        self.step_t = torch.zeros((), dtype=torch.long, device=dev)  # column of ``out`` the next step writes
        self.temperature = torch.zeros(b, dtype=torch.float32, device=dev)
        self.top_p = torch.ones(b, dtype=torch.float32, device=dev)
        self.seeds = torch.zeros(b, dtype=torch.int64, device=dev)
        self.graphs: dict[tuple, _GraphedStep] = {}  # by the sampler's code path

    def params(self, any_sampled: bool, any_nucleus: bool, any_full: bool) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_p, self.seeds, any_sampled, any_nucleus, any_full)


class _Batch:
    """One engine run: host rows and the device buffers they decode in; rows that finish leave the
    batch at host checks (their state moves into the engine's buffers for the smaller batch), and
    requests that ``admit`` hands over join it there (``join``). The attention function reaches the
    current buffers through ``_Current``.

    ``step`` counts the decode steps recorded into ``bufs.out`` since its columns were last reset (at
    a join); ``checked`` those already handed to the host; ``horizon`` is the step by which every
    row has spent its budget. Each row's own answer index (what its draws depend on) is
    ``bufs.index_t``."""

    def __init__(self, engine: DecodeEngine, requests: Sequence[Request], first_index: int = 0,
                 private: bool = False):
        self.engine, self.private = engine, private
        self.width = max(len(r.prompt) for r in requests)
        self.rows = [_Row(first_index + i, r, self.width - len(r.prompt)) for i, r in enumerate(requests)]
        self.active = list(self.rows)  # in device row order
        self.capacity = _round_capacity(self.width + max(r.max_new_tokens for r in requests))
        # a joining batch gets buffers of its own: the engine's could be the running batch's
        self.bufs = _Buffers(engine, len(requests), self.capacity) if private else \
            engine.buffers(len(requests), self.capacity)
        self.bufs.kv.reset()
        self.bufs.index_t.zero_()
        self.bufs.step_t.zero_()
        self.bufs.temperature.copy_(torch.tensor([float(r.temperature) for r in requests]))
        self.bufs.top_p.copy_(torch.tensor([float(r.top_p) for r in requests]))
        self.bufs.seeds.copy_(torch.tensor([int(r.seed) & 0x7FFF_FFFF_FFFF_FFFF for r in requests], dtype=torch.int64))
        self.step = 0
        self.checked = 0
        self._rows_changed()

    @property
    def kv(self) -> LocalKV:
        return self.bufs.kv

    def _rows_changed(self) -> None:
        """Host facts that follow the active rows: sampler paths, budget horizon, document groups."""
        reqs = [r.request for r in self.active]
        self.params = self.bufs.params(*_sampler_path(reqs)) if reqs else None
        self.horizon = self.step + max((r.remaining for r in self.active), default=0)
        self.docs = _DocGroups(self.engine.provider, reqs, self.engine.device)

    def doc_state(self, layer: int, q: torch.Tensor, scaling: float) -> AttnState | None:
        return self.docs(layer, q, scaling)

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
        n = torch.tensor([e.n if r.request.n is None else r.request.n for r in self.rows], device=dev)[:, None]
        positions = torch.maximum(n + real.long().cumsum(-1) - 1, n)  # [b, w]: real tokens at n, n+1, …
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
        return sample(logits, self.params, self.bufs.index_t, host_checks=not self.engine.static_shapes)

    def record(self, tokens: torch.Tensor) -> None:
        bufs = self.bufs
        if self.engine.static_shapes:
            bufs.out.index_copy_(1, bufs.step_t.view(1), tokens[:, None])
        else:
            bufs.out[:, self.step] = tokens
        bufs.index_t += 1
        bufs.step_t += 1
        bufs.next_tok.copy_(tokens)
        self.step += 1

    def graph_step(self) -> None:
        """forward + sample + record, replayed from a CUDA graph captured over these buffers."""
        p = self.params
        key = (p.any_sampled, p.any_nucleus, p.any_full, self.docs.key)
        if key not in self.bufs.graphs:
            self.bufs.graphs[key] = _GraphedStep(self)
        self.bufs.graphs[key].replay()
        self.kv.length += 1  # host mirrors of what the graph advanced on the device
        self.step += 1

    def _static_step(self) -> None:
        """The captured body: reads and writes only the buffers' preallocated device tensors."""
        bufs = self.bufs
        tokens = sample(self.forward_step(), self.params, bufs.index_t, host_checks=False)
        bufs.out.index_copy_(1, bufs.step_t.view(1), tokens[:, None])
        bufs.index_t += 1
        bufs.step_t += 1
        bufs.next_tok.copy_(tokens)

    # ----- host work -----

    def check(self, on_token: OnToken | None, stop_ids: frozenset[int]) -> None:
        """Hand the tokens sampled since the last check to their rows; drop rows that finished."""
        if self.step == self.checked or not self.active:
            return
        block = self.bufs.out[:, self.checked:self.step].tolist()  # the one host read per check
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
        self.checked = self.step
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
        new = _Buffers(self.engine, len(keep), self.capacity) if self.private else \
            self.engine.buffers(len(keep), self.capacity)
        new.kv.copy_rows(old.kv, rows)
        for name in ("out", "next_tok", "pos", "temperature", "top_p", "seeds", "index_t"):
            getattr(new, name).copy_(getattr(old, name)[rows])
        new.step_t.copy_(old.step_t)
        self.bufs = new
        self._rows_changed()

    def join(self, admit: Admit, current: _Current, on_token: OnToken | None,
             hook: LogitsHook | None) -> None:
        """Continuous batching, at a host check (every sampled token handed over): prefill what
        ``admit`` hands over on its own, then merge the rows still going into this batch."""
        requests = list(admit(len(self.active)))
        if not requests:
            return
        _check_requests(requests)
        joining = _Batch(self.engine, requests, first_index=len(self.rows), private=True)
        self.rows.extend(joining.rows)
        current.batch = joining
        try:
            joining.record(joining.sample(joining.prefill(), hook))  # their token 0
            joining.check(on_token, self.engine.stop_ids)
        finally:
            current.batch = self
        if joining.active:
            self._merge(joining)

    def _merge(self, joining: "_Batch") -> None:
        """New buffers for the active rows of both batches (``joining``'s after this one's). Both
        caches end at their current length; each is right-aligned at the merged length ``span``,
        leading slots no row of it uses dropped, so every row keeps writing the same slot."""
        old_rows, new_rows = self.active, joining.active
        old_span = self.kv.length - min((r.start for r in old_rows), default=self.kv.length)
        new_span = joining.kv.length - min(r.start for r in new_rows)
        span = max(old_span, new_span)
        rows = old_rows + new_rows
        self.capacity = _round_capacity(span + max(r.remaining for r in rows))
        merged = self.engine.buffers(len(rows), self.capacity)
        merged.kv.reset()
        a = len(old_rows)
        if old_rows:
            merged.kv.place(slice(0, a), self.kv, self.kv.length - old_span, span - old_span, old_span)
        merged.kv.place(slice(a, len(rows)), joining.kv, joining.kv.length - new_span, span - new_span, new_span)
        merged.kv.set_length(span)
        for name in ("next_tok", "pos", "temperature", "top_p", "seeds", "index_t"):
            parts = ([getattr(self.bufs, name)] if old_rows else []) + [getattr(joining.bufs, name)]
            getattr(merged, name).copy_(torch.cat(parts))
        merged.step_t.zero_()  # every sampled token is on the host: ``out`` starts over
        for r in old_rows:
            r.start += span - self.kv.length
        for r in new_rows:
            r.start += span - joining.kv.length
        self.bufs, self.active = merged, rows
        self.step = self.checked = 0
        self._rows_changed()


class _DocGroups:
    """The document state of a batch whose rows may read different documents (``Request.doc``): each
    provider is asked for its own rows' queries, and the states are put back in row order. With one
    document (the usual case) it is that provider's call, unchanged."""

    def __init__(self, default: DocStateProvider | None, requests: Sequence[Request], device: torch.device):
        providers = [r.doc if r.doc is not None else default for r in requests]
        distinct = list({id(p): p for p in providers}.values())
        self.single = distinct[0] if len(distinct) == 1 else None
        self.groups: list[tuple[DocStateProvider, torch.Tensor]] = []
        # which providers read which rows: a CUDA graph of the step bakes both in (its captured
        # kernels read these index tensors and the providers' weights), so it is part of the graph's key
        self.key: tuple = (id(self.single),)
        if len(distinct) > 1:
            if any(p is None for p in distinct):
                raise ValueError("a batch cannot mix rows with a document and rows without one")
            for p in distinct:
                rows = [i for i, q in enumerate(providers) if q is p]
                self.groups.append((p, torch.tensor(rows, dtype=torch.long, device=device)))
            self.key = tuple((id(p), tuple(g.tolist())) for p, g in self.groups)

    def __call__(self, layer: int, q: torch.Tensor, scaling: float) -> AttnState | None:
        if not self.groups:
            return self.single(layer, q, scaling) if self.single is not None else None
        out = lse = None
        for provider, rows in self.groups:  # q [b, hq, m, d]; each group's rows [b_g, hq, m, d]
            state = provider(layer, q.index_select(0, rows), scaling)
            if out is None:
                out = torch.empty(q.shape, dtype=state.out.dtype, device=q.device)  # [b, hq, m, d]
                lse = torch.empty(q.shape[:3], dtype=state.lse.dtype, device=q.device)  # [b, hq, m]
            out.index_copy_(0, rows, state.out)
            lse.index_copy_(0, rows, state.lse)
        return AttnState(out, lse)


def _round_capacity(tokens: int) -> int:
    return -(-tokens // CAPACITY_STEP) * CAPACITY_STEP


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
        state = [b.next_tok, b.pos, b.index_t, b.step_t, b.kv.slot, b.kv.bias, b.out]
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
        self.docs = batch.docs  # the graph reads its index tensors and providers: keep them (and their ids) alive

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
