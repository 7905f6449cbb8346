"""The one exception tree of tokentape; `server/errors.py` maps it to HTTP in one place.

TokentapeError                 base; carries an OpenAI error type and code
├── InvalidRequest             400 invalid_request_error (bad parameter or message)
│   └── ContextOverflow        400 prompt + max_tokens exceed the model's context
├── NotFound                   404 unknown model, session or route
├── Conflict                   409 request conflicts with recorded state (strict rewrite policy)
├── Overloaded                 429 queue full; retry later
├── EngineFailure              502 the engine failed: transport error or a 5xx answer
│   └── EngineProtocolError    502 the engine answered something its protocol does not allow
├── EngineUnavailable          503 no engine is healthy right now; retry later
└── StoreFailure               500 a turn could not be written (it is not acknowledged) or a session read
"""

from __future__ import annotations

__all__ = [
    "Conflict",
    "ContextOverflow",
    "EngineFailure",
    "EngineProtocolError",
    "EngineUnavailable",
    "Forbidden",
    "InvalidRequest",
    "NotFound",
    "Overloaded",
    "StoreFailure",
    "TokentapeError",
]


class TokentapeError(Exception):
    """Base of every error tokentape raises on purpose."""

    status = 500
    error_type = "server_error"
    default_code: str | None = None
    retry_after: float | None = None  # seconds; sent as Retry-After when set

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code if code is not None else self.default_code


class InvalidRequest(TokentapeError):
    """The request is malformed or a parameter is out of range."""

    status = 400
    error_type = "invalid_request_error"
    default_code = "invalid_value"


class ContextOverflow(InvalidRequest):
    """The prompt, plus room to generate, does not fit the model's context window. The figures, where
    the gateway knows them, let each API family word it its own way (Anthropic's clients parse them)."""

    default_code = "context_length_exceeded"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        prompt_tokens: int | None = None,
        max_tokens: int | None = None,
        context_length: int | None = None,
    ) -> None:
        super().__init__(message, param=param, code=code)
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.context_length = context_length


class NotFound(TokentapeError):
    """An unknown model, session or route."""

    status = 404
    error_type = "invalid_request_error"
    default_code = "not_found"


class Forbidden(TokentapeError):
    """Allowed to nobody by the operator's settings (e.g. weights from a directory not allowed)."""

    status = 403
    error_type = "permission_error"
    default_code = "forbidden"


class Conflict(TokentapeError):
    """The request conflicts with what the session has recorded."""

    status = 409
    error_type = "invalid_request_error"
    default_code = "conflict"


class Overloaded(TokentapeError):
    """Too many requests are waiting; the client should retry later."""

    status = 429
    error_type = "rate_limit_error"
    default_code = "overloaded"

    def __init__(self, message: str, *, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class EngineFailure(TokentapeError):
    """The engine failed: it could not be reached, dropped the connection, or answered 5xx. Counts
    against the engine's health when it happens before the first token."""

    status = 502
    error_type = "server_error"
    default_code = "engine_error"
    engine_down = True  # whether this says something about the engine rather than about one request


class EngineProtocolError(EngineFailure):
    """The engine answered, but with something its wire format does not allow (a malformed event, a
    logprob of an unexpected shape). The request fails; the engine stays in rotation."""

    default_code = "engine_protocol_error"
    engine_down = False


class EngineUnavailable(TokentapeError):
    """No engine can take the request right now (all unhealthy or draining)."""

    status = 503
    error_type = "server_error"
    default_code = "engine_unavailable"

    def __init__(self, message: str, *, retry_after: float = 5.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class StoreFailure(TokentapeError):
    """The trajectory store could not write a turn (it is not acknowledged) or read a stored session
    (code `session_corrupt`: that session alone is unreadable; the others are served)."""

    status = 500
    error_type = "server_error"
    default_code = "store_error"
