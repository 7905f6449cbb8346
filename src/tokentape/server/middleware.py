"""Pure ASGI guards in front of every route (pure ASGI keeps streaming and disconnects working):
header and body size limits, and keys: trainer keys and session keys (`auth.py` decides who may
call what; `keys.py` knows the session keys). Each rejection is an error in the shape of the dialect
at its path (Anthropic's on the Messages route, OpenAI's everywhere else), sent before the body is
read (but for a body naming a session), so a refused request changes nothing."""

from __future__ import annotations

import hmac
from collections.abc import MutableMapping, Sequence
from pathlib import Path
from typing import Any

import orjson

from tokentape.errors import TokentapeError
from tokentape.server.auth import KEY_PREFIX, Kind, Refusal, body_session, decide, key_digest, offered_key
from tokentape.server.dialects.registry import shape_for_path
from tokentape.server.keys import KeyState, SessionKeys

__all__ = ["DEFAULT_MAX_BODY_BYTES", "Guard", "GuardSettings", "OPEN_PATHS", "reject", "replaying"]

# a 128k-token history is 1-2 MB of JSON; 16 MiB leaves room for tools and long tool results
DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]

OPEN_PATHS = frozenset({"/health"})  # liveness probes carry no key


class GuardSettings:
    def __init__(
        self,
        api_keys: Sequence[str] = (),
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        max_header_bytes: int = 64 * 1024,
        *,
        require_session_keys: bool = False,
        max_in_flight_per_key: int | None = None,
        weights_dirs: Sequence[str | Path] | None = None,
    ) -> None:
        """`api_keys`: trainer keys, allowed everything (none: open mode). `require_session_keys`:
        generation needs a session key, which only a trainer key can create sessions for (so it
        needs one: in open mode anyone could create them). `max_in_flight_per_key`: requests one
        session key may have running at once (429 past it), so one agent cannot take every
        admission slot. `weights_dirs`: the directories `POST /admin/weights` may load from (None:
        any path, for a gateway in the trainer's own process)."""
        if require_session_keys and not api_keys:
            raise ValueError(
                "session keys required needs a trainer key: without one, anyone may create sessions and their keys"
            )
        # digests: every comparison is of 32 bytes, whatever the length of the key offered
        self.api_keys = tuple(key_digest(key.encode()) for key in api_keys)
        self.trainer_key = api_keys[0] if api_keys else None  # what an in-process trainer's own calls carry
        self.max_body_bytes = max_body_bytes
        self.max_header_bytes = max_header_bytes
        self.require_session_keys = require_session_keys
        self.max_in_flight_per_key = max_in_flight_per_key
        self.weights_dirs = None if weights_dirs is None else tuple(Path(d).resolve() for d in weights_dirs)


_SLOT = "tokentape.key_slot"  # the session whose key holds an in-flight slot for this request


class Guard:
    """Keys and limits for every route. `admit` is also called on its own by the generation routes'
    lean path, which answers before this middleware's place in the stack (and then `release`)."""

    def __init__(self, app: Any, settings: GuardSettings, keys: SessionKeys | None = None) -> None:
        self.app = app
        self.settings = settings
        self.keys = keys  # None: no session keys are known (a bare app)

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        body = await self.admit(scope, receive, send)
        if body is None:
            return
        try:
            await self.app(scope, replaying(body, receive), send)
        finally:
            self.release(scope)

    def release(self, scope: Scope) -> None:
        """Give back the request's in-flight slot of its session key, if it holds one."""
        held = scope.pop(_SLOT, None)
        if held is not None and self.keys is not None:
            self.keys.release(held)

    async def admit(self, scope: Scope, receive: Any, send: Any) -> bytes | None:
        """The request's body, or None once a rejection (431, 401, 403, 409, 429, 413) has been sent."""
        headers: list[tuple[bytes, bytes]] = scope["headers"]
        settings = self.settings
        if sum(len(k) + len(v) for k, v in headers) > settings.max_header_bytes:
            await reject(
                scope,
                send,
                431,
                f"request headers exceed {settings.max_header_bytes} bytes",
                "headers",
                "request_header_fields_too_large",
            )
            return None
        values = dict(headers)
        offered = offered_key(values.get(b"authorization"), values.get(b"x-api-key"))
        key_session: str | bool = True
        # open mode and a request with no session key (the local default): nothing to check
        if settings.api_keys or settings.require_session_keys or offered[:4] == KEY_PREFIX:
            key_session = await self._authorise(scope, send, offered)
            if key_session is False:
                return None
        declared = values.get(b"content-length")
        too_large = declared is not None and declared.isdigit() and int(declared) > settings.max_body_bytes
        body = None if too_large else await self._read_body(receive)
        if body is None:
            await reject(
                scope,
                send,
                413,
                f"the request body exceeds {settings.max_body_bytes} bytes",
                None,
                "request_too_large",
            )
            self.release(scope)
            return None
        if isinstance(key_session, str) and scope["path"][:10] != "/sessions/":
            # at the root the key names the session: a body naming another one is refused
            in_body = body_session(body) if scope["method"] == "POST" else None
            if in_body is not None and in_body != key_session:
                self.release(scope)
                await reject(
                    scope,
                    send,
                    403,
                    "a session key may only name its own session",
                    None,
                    "session_key_forbidden",
                    "permission_error",
                )
                return None
            others = [(k, v) for k, v in headers if k != b"x-session-id"]
            scope["headers"] = [*others, (b"x-session-id", key_session.encode())]
        return body

    def is_trainer_key(self, offered: bytes) -> bool:
        """Whether `offered` is one of the trainer keys: its digest compared with every key's, always,
        so the time taken tells nothing about which key nearly matched, nor how nearly."""
        digest = key_digest(offered)
        return sum(hmac.compare_digest(digest, key) for key in self.settings.api_keys) > 0

    async def _authorise(self, scope: Scope, send: Any, offered: bytes) -> str | bool:
        """False once a refusal is sent; else the session of a session key, or True (any other key)."""
        settings = self.settings
        kind = Kind.NONE
        key_session: str | None = None
        if offered[:4] == KEY_PREFIX and self.keys is not None:
            state, key_session = await self.keys.check(offered)
            if state is KeyState.LIVE:
                kind = Kind.SESSION
            elif state is not KeyState.UNKNOWN:  # the right key of a session that is over
                word = "finished" if state is KeyState.FINISHED else "deleted"
                message = f"session {key_session!r} is {word}; its key no longer works"
                await reject(scope, send, 409, message, "session_id", f"session_{word}")
                return False
            else:
                kind = Kind.UNKNOWN
        elif offered:
            kind = Kind.UNKNOWN
            if settings.api_keys and self.is_trainer_key(offered):
                kind = Kind.TRAINER
        path: str = scope["path"]
        refusal = decide(
            kind,
            path,
            key_session=key_session,
            header_sessions=[v for k, v in scope["headers"] if k == b"x-session-id"] if key_session else (),
            trainer_keys=bool(settings.api_keys),
            require_session_keys=settings.require_session_keys,
        )
        if refusal is not None:
            await _refuse(scope, send, refusal)
            return False
        if kind is not Kind.SESSION:
            return True
        assert key_session is not None and self.keys is not None
        if settings.max_in_flight_per_key is not None:
            if not self.keys.take(key_session):
                await reject(
                    scope,
                    send,
                    429,
                    f"this session key has {settings.max_in_flight_per_key} requests in flight; retry later",
                    None,
                    "too_many_requests_for_key",
                    "rate_limit_error",
                    retry_after=1.0,
                )
                return False
            scope[_SLOT] = key_session
        return key_session

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


async def reject(
    scope: Scope,
    send: Any,
    status: int,
    message: str,
    param: str | None,
    code: str,
    error_type: str = "invalid_request_error",
    *,
    retry_after: float | None = None,
) -> None:
    error = TokentapeError(message, param=param, code=code)
    error.status, error.error_type = status, error_type
    payload = orjson.dumps(shape_for_path(scope["path"]).body(error))
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    if retry_after is not None:  # what the SDKs honour before they retry, as the gateway's own 429 says it
        headers += [
            (b"retry-after", b"%d" % max(1, round(retry_after))),
            (b"retry-after-ms", b"%d" % (retry_after * 1000)),
        ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


async def _refuse(scope: Scope, send: Any, refusal: Refusal) -> None:
    error_type = "authentication_error" if refusal.status == 401 else "permission_error"
    await reject(scope, send, refusal.status, refusal.message, None, refusal.code, error_type)
