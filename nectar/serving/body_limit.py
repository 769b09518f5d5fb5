"""ASGI middleware: refuse a request body over ``max_bytes`` with 413, before anything parses it.

A declared ``Content-Length`` over the limit is refused without reading the body; a chunked body is
read up to the limit and refused as soon as it passes it. Bodies within the limit are handed to the
app unchanged (buffered: they are at most ``max_bytes``).
"""
from __future__ import annotations

import json

from .errors import error_json


class BodySizeLimit:
    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large(send, int(declared))
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._too_large(send, None)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # later reads: disconnect notices

        await self.app(scope, replay, send)

    async def _too_large(self, send, size: int | None) -> None:
        what = f"{size} bytes" if size is not None else f"over {self.max_bytes} bytes"
        payload = json.dumps(error_json(
            f"request body is {what}, over this server's limit of {self.max_bytes} bytes (nectar serve "
            "--max-body-bytes); send a shorter conversation", "invalid_request_error", "request_too_large",
        )).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"connection", b"close"),
                                (b"content-length", str(len(payload)).encode())]})
        await send({"type": "http.response.body", "body": payload})
