"""Pure ASGI guards in front of every route (pure ASGI keeps streaming and disconnects working):
header and body size limits, and API keys. Each rejection is an error in the shape of the dialect
at its path (Anthropic's on the Messages route, OpenAI's everywhere else)."""

from __future__ import annotations

import hmac
from collections.abc import MutableMapping, Sequence
from typing import Any

import orjson

from tokentape.errors import TokentapeError
from tokentape.server.dialects.registry import shape_for_path

__all__ = ["Guard", "GuardSettings", "OPEN_PATHS", "replaying"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]

OPEN_PATHS = frozenset({"/health"})  # liveness probes carry no key


class GuardSettings:
    def __init__(
        self,
        api_keys: Sequence[str] = (),
        # a 128k-token history is 1-2 MB of JSON; 16 MiB leaves room for tools and long tool results
        max_body_bytes: int = 16 * 1024 * 1024,
        max_header_bytes: int = 64 * 1024,
    ) -> None:
        self.api_keys = tuple(key.encode() for key in api_keys)
        self.max_body_bytes = max_body_bytes
        self.max_header_bytes = max_header_bytes


class Guard:
    """Keys and limits for every route. `admit` is also called on its own by the generation routes'
    lean path, which answers before this middleware's place in the stack."""

    def __init__(self, app: Any, settings: GuardSettings) -> None:
        self.app = app
        self.settings = settings

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        body = await self.admit(scope, receive, send)
        if body is None:
            return
        await self.app(scope, replaying(body, receive), send)

    async def admit(self, scope: Scope, receive: Any, send: Any) -> bytes | None:
        """The request's body, or None once a rejection (431, 401, 413) has been sent."""
        headers: list[tuple[bytes, bytes]] = scope["headers"]
        settings = self.settings
        if sum(len(k) + len(v) for k, v in headers) > settings.max_header_bytes:
            await _reject(
                scope,
                send,
                431,
                f"request headers exceed {settings.max_header_bytes} bytes",
                "headers",
                "request_header_fields_too_large",
            )
            return None
        if settings.api_keys and scope["path"] not in OPEN_PATHS and not self._authorised(headers):
            await _reject(
                scope,
                send,
                401,
                "a valid API key is required (Authorization: Bearer <key>, or x-api-key: <key>)",
                None,
                "invalid_api_key",
                "authentication_error",
            )
            return None
        declared = dict(headers).get(b"content-length")
        too_large = declared is not None and declared.isdigit() and int(declared) > settings.max_body_bytes
        body = None if too_large else await self._read_body(receive)
        if body is None:
            await _reject(
                scope,
                send,
                413,
                f"the request body exceeds {settings.max_body_bytes} bytes",
                None,
                "request_too_large",
            )
        return body

    def _authorised(self, headers: list[tuple[bytes, bytes]]) -> bool:
        values = dict(headers)
        offered = values.get(b"x-api-key", b"")
        authorization = values.get(b"authorization", b"")
        if authorization[:7].lower() == b"bearer ":
            offered = authorization[7:].strip()
        # compare against every key, always, so timing tells nothing about which one nearly matched
        matches = [hmac.compare_digest(offered, key) for key in self.settings.api_keys]
        return bool(offered) and any(matches)

    async def _read_body(self, receive: Any) -> bytes | None:
        """The whole body, or None past the limit. Bodies are small JSON; reading them here lets the
        limit hold for clients that send no content-length."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return b"".join(chunks)
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.settings.max_body_bytes:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def replaying(body: bytes, receive: Any) -> Any:
    """A `receive` that gives the body already read, then whatever comes next (a disconnect)."""
    replayed = False

    async def replay() -> Message:
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        message: Message = await receive()
        return message

    return replay


async def _reject(
    scope: Scope,
    send: Any,
    status: int,
    message: str,
    param: str | None,
    code: str,
    error_type: str = "invalid_request_error",
) -> None:
    error = TokentapeError(message, param=param, code=code)
    error.status, error.error_type = status, error_type
    payload = orjson.dumps(shape_for_path(scope["path"]).body(error))
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": payload})
