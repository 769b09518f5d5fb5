"""ASGI middleware: refuse a request body over ``max_bytes`` with 413, before anything parses it.

A declared ``Content-Length`` over the limit is refused without parsing the body; a chunked body is
read up to the limit and refused as soon as it passes it. Either way the rest of the body is read and
dropped first (up to ``DRAIN_BYTES``): closing a connection with unread bytes in its receive buffer
makes the kernel reset it, and the client then sees "connection reset" instead of the 413. Bodies within the limit are handed to the
app unchanged (buffered: they are at most ``max_bytes``).
"""
from __future__ import annotations

import json

from .errors import error_json


DRAIN_BYTES = 16 << 20  # past this much unread body, refuse at once and let the reset happen


class BodySizeLimit:
    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            if int(declared) <= DRAIN_BYTES:
                await self._drain(receive)
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
                if message.get("more_body", False):
                    await self._drain(receive, size)
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

    @staticmethod
    async def _drain(receive, read: int = 0) -> None:
        """Read and drop the rest of the body (at most ``DRAIN_BYTES`` in all)."""
        while read <= DRAIN_BYTES:
            message = await receive()
            if message["type"] != "http.request":
                return
            read += len(message.get("body", b""))
            if not message.get("more_body", False):
                return

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
