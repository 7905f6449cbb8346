"""The one place that turns failures into HTTP: every error is an OpenAI error object
`{"error": {"message", "type", "param", "code"}}` with the matching status."""

from __future__ import annotations

import logging

import orjson
import pydantic
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException

from tokentape.errors import InvalidRequest, Overloaded, TokentapeError

__all__ = ["error_body", "error_response", "install_error_handlers", "invalid_from_validation", "json_response"]

log = logging.getLogger("tokentape.server")

_STATUS_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}


def json_response(body: object, status_code: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(body), status_code=status_code, headers=headers, media_type="application/json")


def error_body(message: str, error_type: str, param: str | None = None, code: str | None = None) -> dict[str, object]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_response(exc: TokentapeError) -> Response:
    headers = None
    if isinstance(exc, Overloaded):  # what the openai SDK honours before it retries
        headers = {
            "retry-after": str(max(1, round(exc.retry_after))),
            "retry-after-ms": str(int(exc.retry_after * 1000)),
        }
    return json_response(error_body(exc.message, exc.error_type, exc.param, exc.code), exc.status, headers)


def invalid_from_validation(exc: pydantic.ValidationError | RequestValidationError) -> InvalidRequest:
    """The first problem pydantic found, named the way OpenAI names parameters."""
    first = exc.errors()[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(loc) or None
    where = f" at '{param}'" if param else ""
    return InvalidRequest(f"invalid request{where}: {first.get('msg', 'invalid value')}", param=param)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(TokentapeError)
    async def _known(_: Request, exc: TokentapeError) -> Response:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> Response:
        return error_response(invalid_from_validation(exc))

    @app.exception_handler(HTTPException)
    async def _http(_: Request, exc: HTTPException) -> Response:
        error_type = _STATUS_TYPES.get(exc.status_code, "server_error")
        code = "not_found" if exc.status_code == 404 else None
        return json_response(error_body(str(exc.detail), error_type, None, code), exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> Response:
        log.exception("unexpected error")
        return json_response(error_body("internal server error", "server_error", None, "internal_error"), 500)
