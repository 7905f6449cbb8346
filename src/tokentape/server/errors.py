"""The one place that turns failures into HTTP. Every exception becomes a `TokentapeError` (the tree
in `tokentape.errors`), and each API family spells it its own way through an `ErrorShape`: OpenAI's
`{"error": {"message", "type", "param", "code"}}`, or Anthropic's `{"type": "error", "error":
{"type", "message"}}` on the Messages route. The serving layer marks each request with its dialect's
shape; the guard in front of every route picks it by path (the dialect registry's `shape_for_path`);
routes outside the dialects (sessions, admin, unknown paths) answer in OpenAI's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import orjson
import pydantic
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException

from tokentape.errors import ContextOverflow, InvalidRequest, NotFound, TokentapeError

__all__ = [
    "ANTHROPIC_ERRORS",
    "ErrorShape",
    "OPENAI_ERRORS",
    "error_body",
    "error_response",
    "handle_error",
    "install_error_handlers",
    "invalid_from_validation",
    "json_response",
    "use_error_shape",
]

log = logging.getLogger("tokentape.server")

_SHAPE_KEY = "tokentape.error_shape"  # where a request's dialect leaves its shape in the ASGI scope
_LOOKUP_KEY = "error_shape_for_path"  # the app's path -> shape lookup, installed with the handlers


def json_response(body: object, status_code: int = 200, headers: dict[str, str] | None = None) -> Response:
    # numpy arrays (a prompt's token IDs, straight from the tape) are written in C
    body_bytes = orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)
    return Response(body_bytes, status_code=status_code, headers=headers, media_type="application/json")


def error_body(message: str, error_type: str, param: str | None = None, code: str | None = None) -> dict[str, object]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def _openai_body(exc: TokentapeError) -> dict[str, object]:
    return error_body(exc.message, exc.error_type, exc.param, exc.code)


def _openai_event(exc: TokentapeError) -> bytes:
    # the openai SDK raises APIError for an SSE event that carries "error"; [DONE] still follows
    return b"data: " + orjson.dumps(_openai_body(exc)) + b"\n\n"


@dataclass(frozen=True, slots=True)
class ErrorShape:
    """How one API family spells an error: as a response body, and as an event inside a stream."""

    name: str
    body: Callable[[TokentapeError], dict[str, object]]
    stream_event: Callable[[TokentapeError], bytes]


OPENAI_ERRORS = ErrorShape("openai", _openai_body, _openai_event)

# Anthropic's error types by HTTP status
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    431: "invalid_request_error",
    503: "overloaded_error",
}


def _anthropic_message(exc: TokentapeError) -> str:
    """The message, with a context overflow in the words of Anthropic's API, which Claude Code parses:
    `input length and `max_tokens` exceed context limit: I + M > C` (it asks again with `max_tokens`
    C - I - 1000) and `prompt is too long: I tokens > N maximum` (it compacts the conversation)."""
    if isinstance(exc, ContextOverflow) and exc.prompt_tokens is not None and exc.context_length is not None:
        prompt, context = exc.prompt_tokens, exc.context_length
        if prompt >= context:  # no room for a single token
            return f"prompt is too long: {prompt} tokens > {context - 1} maximum"
        return (
            f"input length and `max_tokens` exceed context limit: {prompt} + {exc.max_tokens} > {context}, "
            "decrease input length or `max_tokens` and try again"
        )
    return exc.message


def _anthropic_body(exc: TokentapeError) -> dict[str, object]:
    error_type = _ANTHROPIC_TYPES.get(exc.status, "api_error")
    return {"type": "error", "error": {"type": error_type, "message": _anthropic_message(exc)}}


def _anthropic_event(exc: TokentapeError) -> bytes:
    return b"event: error\ndata: " + orjson.dumps(_anthropic_body(exc)) + b"\n\n"


ANTHROPIC_ERRORS = ErrorShape("anthropic", _anthropic_body, _anthropic_event)


def use_error_shape(request: Request, shape: ErrorShape) -> None:
    """Answer this request's errors in `shape` (the serving layer calls this first)."""
    request.scope[_SHAPE_KEY] = shape


def _shape_of(request: Request) -> ErrorShape:
    shape = request.scope.get(_SHAPE_KEY)
    if isinstance(shape, ErrorShape):
        return shape
    app = request.scope.get("app")
    lookup = getattr(getattr(app, "state", None), _LOOKUP_KEY, None)
    return lookup(request.url.path) if lookup is not None else OPENAI_ERRORS  # before any route ran


def error_response(exc: TokentapeError, shape: ErrorShape = OPENAI_ERRORS) -> Response:
    # the code in a header too: the anthropic shape has no field for it, and clients tell errors apart by it
    headers = {"x-tokentape-error-code": exc.code} if exc.code else {}
    if exc.retry_after is not None:  # what the openai SDK honours before it retries
        headers["retry-after"] = str(max(1, round(exc.retry_after)))
        headers["retry-after-ms"] = str(int(exc.retry_after * 1000))
    return json_response(shape.body(exc), exc.status, headers)


def invalid_from_validation(exc: pydantic.ValidationError | RequestValidationError) -> InvalidRequest:
    """The first problem pydantic found, named the way OpenAI names parameters."""
    first = exc.errors()[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(loc) or None
    where = f" at '{param}'" if param else ""
    return InvalidRequest(f"invalid request{where}: {first.get('msg', 'invalid value')}", param=param)


def _from_http(exc: HTTPException) -> TokentapeError:
    """Starlette's own errors (unknown route, wrong method) in the tree."""
    error: TokentapeError = NotFound(str(exc.detail)) if exc.status_code == 404 else InvalidRequest(str(exc.detail))
    if exc.status_code not in (400, 404):
        error.status = exc.status_code
        error.code = None
        if exc.status_code >= 500:
            error.error_type = "server_error"
    return error


async def handle_error(request: Request, exc: Exception) -> Response:
    """Any exception a route raised, as an error response in the request's dialect."""
    if isinstance(exc, TokentapeError):
        return error_response(exc, _shape_of(request))
    if isinstance(exc, RequestValidationError):
        return error_response(invalid_from_validation(exc), _shape_of(request))
    if isinstance(exc, HTTPException):
        return error_response(_from_http(exc), _shape_of(request))
    log.exception("unexpected error", exc_info=exc)
    return error_response(TokentapeError("internal server error", code="internal_error"), _shape_of(request))


def install_error_handlers(app: FastAPI, shape_for_path: Callable[[str], ErrorShape]) -> None:
    """Errors of `app` in their dialect's shape: the one a route set, else the one `shape_for_path`
    (the dialect registry's) gives for an answer made before any route ran."""
    setattr(app.state, _LOOKUP_KEY, shape_for_path)
    for kind in (TokentapeError, RequestValidationError, HTTPException, Exception):
        app.add_exception_handler(kind, handle_error)
