"""ASGI middleware: API keys. Every route but ``/health`` needs ``Authorization: Bearer <key>`` with
one of the server's keys; otherwise 401 in OpenAI's error shape, before the body is read.

The presented key is compared with every configured key by ``hmac.compare_digest`` (time independent
of where the strings differ, and of which key matched), and is never logged or echoed.
"""
from __future__ import annotations

import hmac
import json
from collections.abc import Callable

from .errors import error_json

OPEN_PATHS = frozenset({"/health"})  # a load balancer's probe carries no key


def key_matches(presented: bytes, keys: tuple[bytes, ...]) -> bool:
    ok = False
    for key in keys:  # no early exit: the time does not say which key matched
        ok |= hmac.compare_digest(presented, key)
    return ok


def bearer(headers) -> bytes | None:
    value = dict(headers or []).get(b"authorization")
    if value is None:
        return None
    scheme, _, token = value.partition(b" ")
    return token.strip() if scheme.lower() == b"bearer" and token.strip() else None


class ApiKeyAuth:
    def __init__(self, app, keys: tuple[str, ...], on_refused: Callable[[], None] | None = None):
        self.app = app
        self.keys = tuple(k.encode() for k in keys)
        self.on_refused = on_refused

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        token = bearer(scope.get("headers"))
        if token is not None and key_matches(token, self.keys):
            await self.app(scope, receive, send)
            return
        if self.on_refused is not None:
            self.on_refused()
        what = "no API key" if token is None else "an invalid API key"
        body = json.dumps(error_json(
            f"the request has {what}; send one of this server's keys as 'Authorization: Bearer <key>' "
            "(nectar serve --api-key or NECTAR_API_KEY)", "invalid_request_error", "invalid_api_key")).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
