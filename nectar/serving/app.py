"""The HTTP API: OpenAI's ``/v1/models`` and ``/v1/chat/completions`` (plain and streamed), ``/health``.

A request is checked (supported fields, the conversation, the limits), rendered into query tokens
as ``nectar ask`` renders a question, and queued as a job for the scheduler's engine thread; the
handler then waits for the job's events on the event loop, so any number of clients can wait
while one thread decodes their batches.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from ..modules.provider import ModuleDocState
from .body_limit import BodySizeLimit
from .chat_prompt import ChatPrompt
from .engine import ModuleEngine
from .errors import ApiError, error_json, install_error_handlers
from .job import Job
from .limits import ServeLimits, refuse_unsupported, sampling_params
from .loader import ServedModule
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
from .scheduler import QueueFull, Scheduler, ShuttingDown


class ServerState:
    """What the handlers share: the served module, the limits, the scheduler, the draining flag."""

    def __init__(self, served: ServedModule, limits: ServeLimits):
        self.served, self.limits = served, limits
        self.prompt = ChatPrompt(served.layout, served.base.tokenizer)
        engine = ModuleEngine(served.base, ModuleDocState(served.module), served.n_context)
        self.scheduler = Scheduler(engine, limits.max_batch, limits.max_queue, limits.batch_wait_ms / 1000)
        self.started = int(time.time())
        self.draining = False  # set on SIGTERM (runner) and at shutdown: refuse new work


def create_app(served: ServedModule, limits: ServeLimits) -> FastAPI:
    state = ServerState(served, limits)

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

    @app.get("/health")
    async def health() -> JSONResponse:
        s = state.scheduler
        body = {"status": "draining" if state.draining else "ok", "model": served.name,
                "waiting": s.waiting, "running": s.running, "batches": s.stats.batches, "rows": s.stats.rows,
                "largest_batch": s.stats.largest_batch, "completion_tokens": s.stats.tokens,
                "failed_batches": s.stats.failed_batches, "max_batch": limits.max_batch,
                "max_queue": limits.max_queue}
        return JSONResponse(body, status_code=503 if state.draining else 200)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[_model_card(state)])

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> ModelCard:
        _check_model(state, model_id)
        return _model_card(state)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        job = _admit(state, req)
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(_sse(job, cid, created, served.name, include_usage),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        await _wait(job, request)
        return ChatCompletion(id=cid, created=created, model=served.name, usage=_usage(job),
                              choices=[Choice(message=AssistantMessage(content=job.text),
                                              finish_reason=job.finish_reason)])

    return app


def _check_model(state: ServerState, model_id: str) -> None:
    if model_id != state.served.name:
        raise ApiError(404, f"model {model_id!r} is not served here; this server serves {state.served.name!r} "
                       "(GET /v1/models)", code="model_not_found", param="model")


def _model_card(state: ServerState) -> ModelCard:
    served, spec = state.served, state.served.spec
    return ModelCard(id=served.name, created=state.started, root=spec.base_model, nectar={
        "run_dir": served.run_dir, "doc_sha256": spec.doc_sha256, "n_context": spec.n_context, "arch": spec.arch,
        "rho": spec.rho, "module_bytes": spec.module_bytes, "kv_cache_bytes": spec.kv_cache_bytes,
        "window": served.base.max_context_tokens})


def _admit(state: ServerState, req: ChatCompletionRequest) -> Job:
    """Check the request, render its prompt and queue it; every refusal is an ApiError."""
    _check_model(state, req.model)
    refuse_unsupported(req)
    served, limits = state.served, state.limits
    prompt = state.prompt.ids(req.messages)
    params = sampling_params(req, len(prompt), served.n_context, served.base.max_context_tokens,
                             served.defaults, limits)
    job = Job(prompt, params, served.base.tokenizer, asyncio.get_running_loop())
    try:
        if state.draining:
            raise ShuttingDown
        state.scheduler.submit(job)
    except QueueFull as full:
        raise ApiError(503, f"the server is busy: {full.waiting} requests are waiting, the queue limit is "
                       f"{full.limit} (nectar serve --max-queue); retry in {full.retry_after_s} s",
                       type="server_error", code="queue_full", headers={"Retry-After": str(full.retry_after_s)})
    except ShuttingDown:
        raise ApiError(503, "the server is shutting down and takes no new requests; retry on another replica "
                       "or after the restart", type="server_error", code="shutting_down",
                       headers={"Retry-After": "5"})
    return job


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


async def _sse(job: Job, cid: str, created: int, model: str, include_usage: bool) -> AsyncIterator[str]:
    """The answer as server-sent events: a role chunk, content chunks, a finish chunk, [DONE]."""
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
