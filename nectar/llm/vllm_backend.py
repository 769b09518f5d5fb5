"""Chat backend for a vLLM server: the OpenAI client plus what vLLM adds.

- ``cache_salt``: the prefix cache is namespaced per document, so verification's hundreds of
  ``document + question`` prompts reuse one cached document prefix, and no two documents share one.
- ``n > 1``: a request that wants several samples (synthesize's samples per chunk) gets them in one
  request, sharing the prompt's prefill.
- JSON-schema ``response_format`` is enforced by vLLM's structured-output engine (xgrammar), so the
  reply is the schema's JSON, not free text to dig in.
The server is either one this process manages (``nectar.llm.server_pool``) or one at ``base_url``.
"""
from __future__ import annotations

import json
import urllib.request
from typing import Any

from .openai_backend import OpenAIBackend
from .types import ChatRequest
from .vllm_server import VLLMServer


class VLLMBackend(OpenAIBackend):
    name = "vllm"

    def __init__(self, base_url: str, model: str | None, server: VLLMServer | None = None, **kwargs: Any):
        super().__init__(base_url=base_url, model=model, **kwargs)
        self.server = server

    @classmethod
    def managed(cls, server: VLLMServer, **kwargs: Any) -> "VLLMBackend":
        return cls(base_url=server.url, model=server.spec.served_name, server=server, **kwargs)

    def _extra_body(self, req: ChatRequest) -> dict[str, Any]:
        return {"cache_salt": req.cache_salt} if req.cache_salt else {}

    def describe(self) -> dict[str, Any]:
        if self.server is not None:
            return {**self.server.describe(), "max_concurrency": self.max_concurrency}
        return {**super().describe(), "server_version": self._version()}

    def _version(self) -> str | None:
        root = self.url.rstrip("/").removesuffix("/v1")
        try:
            with urllib.request.urlopen(f"{root}/version", timeout=10) as r:
                return json.loads(r.read()).get("version")
        except (OSError, ValueError):
            return None
