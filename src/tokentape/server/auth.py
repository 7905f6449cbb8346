"""Who may call what. Pure: the guard (`middleware.py`) reads the request and the keys it knows,
this module decides.

Two kinds of key. Trainer keys (`serve --api-key`, `TOKENTAPE_API_KEYS`) may call every route. A
session key, issued by `POST /sessions`, belongs to that session alone: it may call the generation
routes (every dialect and Messages' token count, the token route, tokenize/detokenize, models) under
its session's base URL,
or at the root, where the key itself names the session (a header or body field naming another
session is refused). Everything else is refused with 403: rewards, finish, export, listings,
deletes, other sessions, /admin, /metrics, /view, /docs. In agent RL the agent is what is optimised
against the reward, so nothing it can reach may pay it, end it, read other episodes or stop the
engines.

A session key reads `tts.<session id>.<secret>`: the session id is no secret (it is in every URL
the agent calls); carrying it lets any gateway of a cluster route the key to the gateway that owns
the session, and the key be checked there against one stored digest. The secret is 32 random bytes
from `secrets`, so a fast hash is enough to store it: SHA-256 of a 256-bit random value cannot be
reversed or guessed, and a slow password hash (bcrypt, argon2) protects low-entropy secrets only,
at a cost on every request.
"""

from __future__ import annotations

import enum
import hashlib
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import orjson

from tokentape.errors import InvalidRequest
from tokentape.gateway.sessions import check_session_id
from tokentape.server.dialects.registry import PATHS, SIDE_PATHS

__all__ = [
    "GENERATION_ROUTES",
    "Kind",
    "Refusal",
    "SESSION_KEY_ROUTES",
    "body_session",
    "decide",
    "is_generation",
    "key_digest",
    "new_session_key",
    "offered_key",
    "session_of_key",
]

KEY_PREFIX = b"tts."
_SECRET_BYTES = 32
_SECRET_CHARS = 43  # len(secrets.token_urlsafe(32))
_TAIL = _SECRET_CHARS + 1  # "." + secret

# The routes that sample (the per-key limit and `--session-keys required` are about these).
GENERATION_ROUTES = frozenset(PATHS)  # every dialect's route
# What a session key may call, at the root or under its session's base URL.
SESSION_KEY_ROUTES = GENERATION_ROUTES | {*SIDE_PATHS, "/v1/tokenize", "/v1/detokenize", "/v1/models", "/v1/health"}
_GENERATION_SUFFIXES = tuple(GENERATION_ROUTES)
_ROOT_ONLY = frozenset({"/tokenize", "/detokenize", "/health"})  # these live at the root alone
_SESSIONS = "/sessions/"


class Kind(enum.Enum):
    """What the offered key is, as the guard found it."""

    NONE = "none"  # no key sent
    UNKNOWN = "unknown"  # a key that is neither a trainer key nor a live session's key
    TRAINER = "trainer"
    SESSION = "session"


@dataclass(frozen=True, slots=True)
class Refusal:
    status: int  # 401 or 403
    message: str
    code: str


_NO_KEY = Refusal(
    401, "a valid API key is required (Authorization: Bearer <key>, or x-api-key: <key>)", "invalid_api_key"
)
_NO_SESSION_KEY = Refusal(
    401,
    "this server requires a session key for generation: POST /sessions answers one (api_key)",
    "session_key_required",
)


def new_session_key(session_id: str) -> str:
    return f"tts.{session_id}.{secrets.token_urlsafe(_SECRET_BYTES)}"


def key_digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


def session_of_key(key: bytes) -> str | None:
    """The session a session key names, or None if `key` is not shaped as one (no secret is read)."""
    if not key.startswith(KEY_PREFIX) or len(key) <= len(KEY_PREFIX) + _TAIL or key[-_TAIL] != ord("."):
        return None
    try:
        return check_session_id(key[len(KEY_PREFIX) : -_TAIL].decode("ascii"))
    except (UnicodeDecodeError, InvalidRequest):
        return None


def offered_key(authorization: bytes | None, x_api_key: bytes | None) -> bytes:
    """The key a request carries: `Authorization: Bearer` (the openai SDK), else `x-api-key`
    (the anthropic SDK); empty if neither."""
    if authorization is not None and authorization[:7].lower() == b"bearer ":
        return authorization[7:].strip()
    return x_api_key or b""


def is_generation(path: str) -> bool:
    """Whether `path` reaches a generation route, at the root or under any base URL (a malformed
    session name included: the app's session paths match any text)."""
    return path in GENERATION_ROUTES or (path.startswith(_SESSIONS) and path.endswith(_GENERATION_SUFFIXES))


def decide(
    kind: Kind,
    path: str,
    *,
    key_session: str | None = None,
    header_sessions: Sequence[bytes] = (),
    trainer_keys: bool = False,
    require_session_keys: bool = False,
) -> Refusal | None:
    """None if the request may go on; else why not. `key_session` is the session of a session key;
    `header_sessions` the X-Session-ID headers sent; `trainer_keys` whether the server has any (none:
    open mode, where a request without a key may call everything, as before keys existed).
    A body field naming the session is checked once the body is read (`body_session`)."""
    if kind is Kind.SESSION:
        assert key_session is not None
        if path in SESSION_KEY_ROUTES or path in _ROOT_ONLY:
            named = key_session.encode()
            if any(header != named for header in header_sessions):
                return Refusal(403, "a session key may only name its own session", "session_key_forbidden")
            return None
        prefix = f"{_SESSIONS}{key_session}"
        if path.startswith(prefix) and path[len(prefix) :] in SESSION_KEY_ROUTES:
            return None  # a differing header or body name is kept as the client's trace id, as without keys
        return Refusal(
            403,
            "a session key may only call the generation routes of its own session (chat, completions, "
            "responses, messages and its token count, generate, tokenize, detokenize, models)",
            "session_key_forbidden",
        )
    if kind is Kind.TRAINER:
        if require_session_keys and is_generation(path):
            return Refusal(
                403,
                "this server requires the session's own key for generation, not a trainer key",
                "session_key_required",
            )
        return None
    if path == "/health":  # liveness probes carry no key
        return None
    if trainer_keys:
        return _NO_KEY
    if require_session_keys and is_generation(path):
        return _NO_SESSION_KEY
    return None


def body_session(body: bytes) -> str | None:
    """The `session_id` field of a JSON body, if it is a string. Most bodies do not mention it and
    are not parsed here; one that could spell the field with an escape is."""
    if b"session_id" not in body and b"\\u" not in body:
        return None
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None  # the route answers 400 itself
    value = data.get("session_id") if isinstance(data, dict) else None
    return value if isinstance(value, str) else None
