"""The OpenAI chat-completions wire format, as pydantic models (the subset ``nectar serve`` speaks).

Requests accept and ignore fields this server has no use for (``user``, ``metadata``, …), as
OpenAI-compatible servers do, so existing clients work unchanged; fields that would change the
answer and are not supported (``n`` > 1, tools, logprobs, penalties, …) are refused by
``nectar.serving.limits.refuse_unsupported`` with a 400 that names them.
"""
from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")


class ChatMessage(_Lenient):
    role: str
    # A string, or a list of content parts ({"type": "text", "text": ...}); None on tool-call turns.
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class StreamOptions(_Lenient):
    include_usage: bool = False


class ChatCompletionRequest(_Lenient):
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # the newer name of max_tokens
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = None
    # Accepted only at the values that leave the answer as this server computes it.
    n: int | None = 1
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logprobs: bool | None = False
    top_logprobs: int | None = None
    logit_bias: dict[str, float] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any | None = None
    functions: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


FinishReason = Literal["stop", "length"]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class Choice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: FinishReason
    logprobs: None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    finish_reason: FinishReason | None = None
    logprobs: None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None

    def sse(self) -> str:
        """One server-sent event. Empty delta fields are left out and ``finish_reason`` is always
        present (null until the last chunk), as in OpenAI's stream."""
        data = self.model_dump(exclude_none=True)
        for out, choice in zip(data["choices"], self.choices):
            out["finish_reason"] = choice.finish_reason
        return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "nectar"
    root: str  # the base model the module plugs into
    # What the module stands in for: the document (sha256, n tokens) and its size vs the KV cache.
    nectar: dict[str, Any] = {}


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail
