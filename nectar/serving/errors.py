"""Errors in OpenAI's JSON shape: ``{"error": {"message", "type", "param", "code"}}``.

Every refusal names what was wrong and, for a limit, the limit and the server flag that sets it, so
a client developer can fix the request without reading the server's logs. A bad request never
takes the server down: handlers turn every exception into a response.
"""
from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .openai_schemas import ErrorDetail, ErrorResponse

log = logging.getLogger("nectar.serve")


class ApiError(Exception):
    """A request the server refuses (4xx) or cannot serve now (503)."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param
        self.headers = headers or {}


def error_json(message: str, type: str, code: str | None = None, param: str | None = None) -> dict:
    return ErrorResponse(error=ErrorDetail(message=message, type=type, code=code, param=param)).model_dump()


def error_response(exc: ApiError) -> JSONResponse:
    return JSONResponse(error_json(exc.message, exc.type, exc.code, exc.param), status_code=exc.status,
                        headers=exc.headers)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    first = exc.errors()[0] if exc.errors() else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid request")
    return (f"invalid request: {param}: {msg}" if param else f"invalid request: {msg}"), param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        # OpenAI answers malformed requests with 400, not FastAPI's 422.
        message, param = _validation_message(exc)
        return JSONResponse(error_json(message, "invalid_request_error", "invalid_value", param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return JSONResponse(error_json(str(exc.detail), "invalid_request_error", code), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("request failed")
        return JSONResponse(error_json(f"internal error: {type(exc).__name__}: {exc}", "server_error"),
                            status_code=500)
