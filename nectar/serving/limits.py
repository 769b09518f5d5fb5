"""What a request may ask of the server: the limits, and the checks that apply them.

Each refusal names the limit, its value and the ``nectar serve`` flag that sets it. The token
limits protect the decode engine (one long request holds a batch row for its whole answer); the
model's window is a hard bound on top: the module stands in for n document tokens, so the prompt
sits at positions n, n+1, … and n + prompt + answer must fit in the window.
"""
from __future__ import annotations

from dataclasses import dataclass

from pydantic import Field

from ..schemas.base import FrozenConfig
from .errors import ApiError
from .job import SamplingParams
from .openai_schemas import ChatCompletionRequest


class ServeLimits(FrozenConfig):
    """``nectar serve``'s knobs (flat CLI flags of the same names)."""

    max_batch: int = Field(8, ge=1, le=1024, description="rows decoded together")
    max_queue: int = Field(64, ge=1, description="requests waiting for a batch before 503")
    max_body_bytes: int = Field(1_000_000, ge=1024, description="request body size before 413")
    max_prompt_tokens: int = Field(4096, ge=1, description="query tokens of one conversation")
    max_tokens: int = Field(512, ge=1, description="answer tokens one request may ask for")
    max_stop: int = Field(4, ge=0, description="stop strings per request (OpenAI allows 4)")
    batch_wait_ms: float = Field(5.0, ge=0, description="how long a new batch waits for company")
    shutdown_timeout_s: float = Field(120.0, gt=0, description="SIGTERM: wait this long for in-flight requests")
    max_module_bytes: int = Field(2_000_000_000, ge=1, description="modules kept loaded (LRU) before dropping one")
    keep_dequantized: bool = Field(True, description="a quantized module's float weights kept beside its codes "
                                   "(counted against max_module_bytes); False: codes only, dequantized every step")


@dataclass(frozen=True)
class GenerationDefaults:
    """Used where a request leaves a field out: the run's evaluation settings, as ``nectar ask``."""

    max_tokens: int
    temperature: float
    top_p: float


def refuse_unsupported(req: ChatCompletionRequest) -> None:
    """400 for request fields that would change the answer in ways this server does not implement."""
    def refuse(param: str, what: str) -> None:
        raise ApiError(400, f"{param}: {what} is not supported by nectar serve", code="unsupported_parameter",
                       param=param)

    if req.n not in (None, 1):
        refuse("n", f"n={req.n} (one choice per request; send several requests, they are batched)")
    if req.logprobs or req.top_logprobs:
        refuse("logprobs", "returning log-probabilities")
    if req.tools or req.functions or req.tool_choice not in (None, "none"):
        refuse("tools", "tool calling")
    if req.response_format and req.response_format.get("type", "text") != "text":
        refuse("response_format", f"response_format {req.response_format.get('type')!r} (only 'text')")
    if req.logit_bias:
        refuse("logit_bias", "logit_bias")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name) not in (None, 0, 0.0):
            refuse(name, f"a non-zero {name}")


def stop_strings(req: ChatCompletionRequest, limits: ServeLimits) -> tuple[str, ...]:
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stops) > limits.max_stop:
        raise ApiError(400, f"stop: {len(stops)} stop strings, over this server's limit of {limits.max_stop} "
                       "(nectar serve --max-stop)", code="too_many_stop_strings", param="stop")
    if any(s == "" for s in stops):
        raise ApiError(400, "stop: an empty stop string would stop before the first token; remove it",
                       code="invalid_value", param="stop")
    return tuple(stops)


def sampling_params(req: ChatCompletionRequest, prompt_tokens: int, n_context: int, window: int,
                    defaults: GenerationDefaults, limits: ServeLimits) -> SamplingParams:
    """Apply the defaults and every token limit to one request (prompt already rendered)."""
    if prompt_tokens > limits.max_prompt_tokens:
        raise ApiError(400, f"messages: the conversation is {prompt_tokens} prompt tokens, over this server's "
                       f"limit of {limits.max_prompt_tokens} (nectar serve --max-prompt-tokens); send a shorter "
                       "conversation", code="context_length_exceeded", param="messages")
    room = window - n_context - prompt_tokens  # positions left in the model's window for the answer
    asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if asked is not None and asked > limits.max_tokens:
        raise ApiError(400, f"max_tokens: {asked} is over this server's limit of {limits.max_tokens} "
                       f"(nectar serve --max-tokens); ask for at most {limits.max_tokens}",
                       code="max_tokens_exceeded", param="max_tokens")
    max_tokens = asked if asked is not None else min(defaults.max_tokens, limits.max_tokens, room)
    if max_tokens > room or room < 1:
        raise ApiError(400, f"the module stands in for a {n_context}-token document, so the prompt "
                       f"({prompt_tokens} tokens) and the answer (max_tokens {max_tokens}) must fit the "
                       f"model's window of {window} tokens after it ({n_context + prompt_tokens + max_tokens} "
                       f"> {window}); lower max_tokens or shorten the conversation",
                       code="context_length_exceeded", param="max_tokens")
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=req.temperature if req.temperature is not None else defaults.temperature,
        top_p=req.top_p if req.top_p is not None else defaults.top_p,
        seed=req.seed,
        stop=stop_strings(req, limits),
    )
