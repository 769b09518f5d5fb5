"""The HTTP API: OpenAI's ``/v1/models`` and ``/v1/chat/completions`` (plain and streamed), ``/health``,
``/metrics``.

The server serves one or more documents (``registry.py``), each under its own model id. A request
is checked (its model id, supported fields, the conversation, the limits), rendered into query
tokens as ``nectar ask`` renders a question, given its document's module (loaded on first use) and
queued as a job for the scheduler's engine thread, where it joins the running batch with the jobs
of any document; the handler then waits for the job's events on the event loop, so any number of
clients can wait while one thread decodes.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from .auth import ApiKeyAuth
from .body_limit import BodySizeLimit
from .chat_prompt import ChatPrompt
from .engine import ModuleEngine
from .errors import ApiError, error_json, install_error_handlers
from .job import Job
from .limits import ServeLimits, refuse_unsupported, sampling_params
from .metrics import CONTENT_TYPE, ServeMetrics
from .openai_schemas import (
    AssistantMessage,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Choice,
    ChunkChoice,
    Delta,
    ModelCard,
    ModelList,
    Usage,
)
from .composite import HOW_TO_COMPOSE, CompositeDocument, CompositeProviders, UnknownPart, is_composite, resolve
from .registry import ModuleRegistry, ServedDocument
from .scheduler import QueueFull, Scheduler, ShuttingDown


class ServerState:
    """What the handlers share: the documents, the limits, the scheduler, the metrics, the draining flag."""

    def __init__(self, registry: ModuleRegistry, limits: ServeLimits):
        self.registry, self.limits = registry, limits
        base = registry.base
        self.prompts = {name: ChatPrompt(doc.layout, base.tokenizer) for name, doc in registry.documents.items()}
        self.composites = CompositeProviders(registry)  # ids "a+b": the documents' states composed
        self.scheduler = Scheduler(ModuleEngine(base), limits.max_batch, limits.max_queue, limits.batch_wait_ms / 1000)
        self.metrics = ServeMetrics(self.scheduler, registry)
        self.started = int(time.time())
        self.draining = False  # set on SIGTERM (runner) and at shutdown: refuse new work


def create_app(registry: ModuleRegistry, limits: ServeLimits, api_keys: tuple[str, ...] = ()) -> FastAPI:
    state = ServerState(registry, limits)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        state.scheduler.start()
        yield
        # uvicorn has already waited for in-flight requests; whatever is left is decoded, then the thread stops.
        state.draining = True
        await asyncio.to_thread(state.scheduler.close, limits.shutdown_timeout_s)

    app = FastAPI(title="nectar serve", lifespan=lifespan)
    app.state.nectar = state
    install_error_handlers(app)
    app.add_middleware(BodySizeLimit, max_bytes=limits.max_body_bytes)
    if api_keys:  # added last: the outermost layer, so nothing runs before the key is checked
        app.add_middleware(ApiKeyAuth, keys=api_keys, on_refused=lambda: state.metrics.refused(None, 401))

    @app.get("/health")
    async def health() -> JSONResponse:
        s = state.scheduler
        body = {"status": "draining" if state.draining else "ok", "models": registry.names,
                "loaded": registry.loaded, "waiting": s.waiting, "running": s.running, "batches": s.stats.batches,
                "rows": s.stats.rows, "largest_batch": s.stats.largest_batch, "completion_tokens": s.stats.tokens,
                "failed_batches": s.stats.failed_batches, "max_batch": limits.max_batch,
                "max_queue": limits.max_queue}
        return JSONResponse(body, status_code=503 if state.draining else 200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.text(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[_model_card(state, d) for d in registry.documents.values()])

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> ModelCard:
        return _model_card(state, _document(state, model_id))

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        try:
            job = await _admit(state, req)
        except ApiError as exc:
            state.metrics.refused(req.model, exc.status)
            raise
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(_sse(state, job, cid, created, include_usage),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        try:
            await _wait(job, request)
        except ApiError as exc:
            state.metrics.ran(job, exc.status)
            raise
        state.metrics.ran(job, 200)
        return ChatCompletion(id=cid, created=created, model=job.model, usage=_usage(job),
                              choices=[Choice(message=AssistantMessage(content=job.text),
                                              finish_reason=job.finish_reason)])

    return app


def _document(state: ServerState, model_id: str) -> ServedDocument | CompositeDocument:
    doc = state.registry.documents.get(model_id)
    if doc is not None:
        return doc
    missing = f"model {model_id!r}"
    if is_composite(model_id):
        try:
            return resolve(state.registry, model_id)
        except UnknownPart as part:
            missing = f"model {part.args[0]!r} (in {model_id!r})"
    served = ", ".join(repr(n) for n in state.registry.names)
    raise ApiError(404, f"{missing} is not served here; this server serves {served}, and {HOW_TO_COMPOSE} "
                   "(GET /v1/models)", code="model_not_found", param="model")


def _model_card(state: ServerState, doc: ServedDocument | CompositeDocument) -> ModelCard:
    if isinstance(doc, CompositeDocument):
        return ModelCard(id=doc.name, created=state.started, root=doc.parts[0].spec.base_model,
                         nectar={**doc.card(), "window": state.registry.base.max_context_tokens})
    spec = doc.spec
    return ModelCard(id=doc.name, created=state.started, root=spec.base_model, nectar={
        "run_dir": doc.run_dir, "doc_sha256": spec.doc_sha256, "n_context": spec.n_context, "arch": spec.arch,
        "rho": spec.rho, "module_bytes": spec.module_bytes, "kv_cache_bytes": spec.kv_cache_bytes,
        "window": state.registry.base.max_context_tokens, "loaded": doc.name in state.registry.loaded,
        "compose": HOW_TO_COMPOSE})


def _provider(state: ServerState, doc: ServedDocument | CompositeDocument):
    """The document's module, or the composition of its parts' modules (each loaded on first use)."""
    if isinstance(doc, CompositeDocument):
        return state.composites.provider(doc)
    return state.registry.provider(doc.name)


async def _admit(state: ServerState, req: ChatCompletionRequest) -> Job:
    """Check the request, render its prompt, get its module and queue it; every refusal is an ApiError."""
    doc = _document(state, req.model)
    refuse_unsupported(req)
    base, limits = state.registry.base, state.limits
    prompt = state.prompts[doc.parts[0].name if isinstance(doc, CompositeDocument) else doc.name].ids(req.messages)
    params = sampling_params(req, len(prompt), doc.n_context, base.max_context_tokens, doc.defaults, limits)
    if state.draining:
        raise _shutting_down()
    provider = await asyncio.to_thread(_provider, state, doc)  # loads the module(s) on first use
    job = Job(prompt, params, base.tokenizer, asyncio.get_running_loop(), model=doc.name, doc=provider,
              n=doc.n_context)
    try:
        if state.draining:
            raise ShuttingDown
        state.scheduler.submit(job)
    except QueueFull as full:
        raise ApiError(503, f"the server is busy: {full.waiting} requests are waiting, the queue limit is "
                       f"{full.limit} (nectar serve --max-queue); retry in {full.retry_after_s} s",
                       type="server_error", code="queue_full", headers={"Retry-After": str(full.retry_after_s)})
    except ShuttingDown:
        raise _shutting_down()
    return job


def _shutting_down() -> ApiError:
    return ApiError(503, "the server is shutting down and takes no new requests; retry on another replica "
                    "or after the restart", type="server_error", code="shutting_down", headers={"Retry-After": "5"})


def _usage(job: Job) -> Usage:
    prompt = len(job.prompt_ids)
    return Usage(prompt_tokens=prompt, completion_tokens=job.completion_tokens,
                 total_tokens=prompt + job.completion_tokens)


async def _wait(job: Job, request: Request) -> None:
    """Wait for a non-streamed job to finish; a client that hangs up cancels it."""
    async def watch() -> None:
        while not await request.is_disconnected():
            await asyncio.sleep(0.5)
        job.cancel()

    watcher = asyncio.create_task(watch())
    try:
        async for event in job.events():
            if event.kind == "error":
                raise ApiError(500, event.text, type="server_error", code="engine_error")
            if event.kind == "cancelled":  # nobody will read the answer
                raise ApiError(499, "the client closed the connection", code="client_closed")
    except asyncio.CancelledError:  # the server gave up on this request (shutdown timeout): free its row
        job.cancel()
        raise
    finally:
        watcher.cancel()


async def _sse(state: ServerState, job: Job, cid: str, created: int, include_usage: bool) -> AsyncIterator[str]:
    """The answer as server-sent events: a role chunk, content chunks, a finish chunk, [DONE]."""
    model = job.model

    def chunk(delta: Delta, finish_reason=None) -> str:
        return ChatCompletionChunk(id=cid, created=created, model=model,
                                   choices=[ChunkChoice(delta=delta, finish_reason=finish_reason)]).sse()

    try:
        yield chunk(Delta(role="assistant", content=""))
        async for event in job.events():
            if event.kind == "delta":
                yield chunk(Delta(content=event.text))
            elif event.kind == "done":
                yield chunk(Delta(), event.finish_reason)
            elif event.kind == "cancelled":
                return
            else:  # the status line is sent already: report the failure in the stream, as OpenAI does
                yield f"data: {json.dumps(error_json(event.text, 'server_error', 'engine_error'))}\n\n"
        if include_usage:
            yield ChatCompletionChunk(id=cid, created=created, model=model, choices=[], usage=_usage(job)).sse()
        yield "data: [DONE]\n\n"
    finally:
        job.cancel()  # the client hung up mid-stream (or we are done: then this changes nothing)
        status = {"stop": 200, "length": 200, "error": 500}.get(job.finish_reason, 499)
        state.metrics.ran(job, status)
