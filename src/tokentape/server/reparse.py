"""Parsing a generation body without parsing again the history a session's last body carried.

An agent resends its whole history on every call: at 128k tokens, about 470 KB of JSON that orjson
takes half a millisecond to parse into the values it parsed last time. `Reparser` remembers, for each
session, where the last body's history array ended (`end`, just past its last element), a digest of
the bytes before that, and the parse. A body that starts with the same bytes is, at `end`, in the
same parser state: inside the history array, after its last element. Only the rest is parsed (`{"<sentinel>":[0` and
the rest: the new elements after a placeholder, then the keys that follow) and joined onto the
remembered parse, with JSON's rule for a key written twice (the last one counts) kept.

Where the history ends is found without a scan of the body: a client that writes JSON compactly (the
openai SDK through httpx, JavaScript's `JSON.stringify`) writes the array byte for byte as orjson
does, so it is found by its bytes, and the text before it is checked to be the history's key at the
top level. A session whose body is written otherwise (a space after each separator) has its bodies
parsed whole, and is not looked at again.

The digest (xxh3-128, seeded per process) is an accelerator, as the tape's digests are: it is only
ever compared with the same session's last body, so a crafted collision could only mislabel that
session's own history.

What is kept is counted as what its parse holds in Python objects (`core.held.parsed_bytes`, a bound
measured with tracemalloc: a history of agent messages holds about twice its JSON, a text of empty
objects 24 times it), not as its JSON, against `KEPT_BYTES` and in the gateway's one account of what
it holds ("parses": past the budget they go before any session leaves memory). A parse is kept only
once its request was accepted (`PendingParse.keep`, after the gateway planned the turn): a refused
body, whatever its size, leaves nothing behind.
"""

from __future__ import annotations

import functools
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson
import xxhash

from tokentape.core.bounded import BoundedCache
from tokentape.core.held import parsed_bytes

__all__ = ["MIN_BODY_BYTES", "PendingParse", "Reparser"]

MIN_BODY_BYTES = 32 * 1024  # below this a whole parse costs about as little as the bookkeeping
KEPT_BYTES = 64 << 20  # what the histories' parses kept across sessions hold, least recently used first
_SEED = secrets.randbits(64)
_SENTINEL = secrets.token_hex(12)  # the placeholder key no client can know
_PREFIX = b'{"' + _SENTINEL.encode() + b'":[0'
_DECLINED_BYTES = 64  # what remembering a session as parsed whole costs
# sessions finished or deleted lately: a body sent to one (the SDKs retry a refusal twice) keeps nothing
CLOSED_REMEMBERED = 4096


@dataclass(frozen=True, slots=True)
class _Kept:
    field: str  # the history's key
    end: int  # the offset just past the history's last element
    digest: bytes  # xxh3-128 of the body before `end`
    head: dict[str, Any]  # the keys before the history, in order, the history's key holding 0
    items: tuple[Any, ...]  # the history's parsed elements: each body gets a list of its own
    size: int  # what the parse of the body before `end` holds (`parsed_bytes`)


@dataclass(frozen=True, slots=True)
class _Declined:
    """A session whose history is not written as orjson writes it: its bodies are parsed whole,
    without looking again for where the history ends (orjson's writing of it and a search of the
    body cost 0.28 ms at 128k)."""

    field: str


def _digest(data: bytes | memoryview) -> bytes:
    return xxhash.xxh3_128_digest(data, seed=_SEED)


def _one(_: bool) -> int:
    return 1


def _size(kept: _Kept | _Declined) -> int:
    return kept.size if type(kept) is _Kept else _DECLINED_BYTES


def _nothing() -> None:
    pass


class PendingParse:
    """One request's parser (`json_object`'s `parse`): it parses as `Reparser.read` does, and what
    the reparser would keep of it is kept only on `keep()`, once the request was accepted."""

    __slots__ = ("_field", "_keep", "_key", "_reparser")

    def __init__(self, reparser: Reparser, key: str, field: str) -> None:
        self._reparser = reparser
        self._key = key
        self._field = field
        self._keep: Callable[[], None] = _nothing

    def __call__(self, body: bytes) -> Any:
        data, self._keep = self._reparser.read(self._key, body, self._field)
        return data

    def keep(self) -> None:
        keep, self._keep = self._keep, _nothing
        keep()


class Reparser:
    """`parse(key, body, field)`: the body parsed (orjson's errors raised as orjson raises them),
    reusing the parse of the history array `field` that the last body under `key` shared. The
    history's elements are shared with later parses (each gets a list and a top-level dict of its
    own): the gateway reads messages and never changes them in place."""

    def __init__(self, max_bytes: int = KEPT_BYTES, min_bytes: int = MIN_BODY_BYTES) -> None:
        self._kept: BoundedCache[str, _Kept | _Declined] = BoundedCache(max_bytes, _size)
        self._closed: BoundedCache[str, bool] = BoundedCache(CLOSED_REMEMBERED, _one)  # one a session
        self.min_bytes = min_bytes
        self.reused = 0  # bodies parsed from a remembered prefix (what the tests watch)

    @property
    def held_bytes(self) -> int:
        """What the kept parses hold (`parsed_bytes` of each), the gateway's "parses"."""
        return self._kept.held_bytes

    def shed(self, wanted: int) -> int:
        """Forget the least recently used parses until `wanted` bytes are freed or none is left."""
        return self._kept.shed(wanted)

    def parser(self, key: str, field: str) -> PendingParse:
        """A parser for one request's body that keeps nothing until its `keep()`."""
        return PendingParse(self, key, field)

    def parse(self, key: str | None, body: bytes, field: str) -> Any:
        """The body parsed, and what is kept of it kept at once (for a body already accepted)."""
        data, keep = self.read(key, body, field)
        keep()
        return data

    def read(self, key: str | None, body: bytes, field: str) -> tuple[Any, Callable[[], None]]:
        """The body parsed, and what to call to keep it for the next body (nothing changes until then)."""
        if key is None or len(body) < self.min_bytes or self._closed.get(key):
            return orjson.loads(body), _nothing
        kept = self._kept.get(key)
        if type(kept) is _Declined and kept.field == field:
            return orjson.loads(body), _nothing
        if type(kept) is _Kept and kept.field == field:
            after = self._after(kept, body)
            if after is not None:
                self.reused += 1
                data, keep = after
                return data, functools.partial(self._put, key, keep)
        data = orjson.loads(body)
        # where its history ends is looked for only if it is kept: a refused body costs its parse alone
        return data, functools.partial(self._put_whole, key, body, data, field)

    def _put_whole(self, key: str, body: bytes, data: Any, field: str) -> None:
        self._put(key, _remembered(body, data, field))

    def _put(self, key: str, kept: _Kept | _Declined | None) -> None:
        if self._closed.get(key):  # closed while the request ran
            return
        if kept is None:
            self._kept.discard(key)
        else:
            self._kept.put(key, kept)

    def forget(self, key: str) -> None:
        """Drop what is kept for `key`: its session is finished or deleted, and the bodies still sent
        to it are refused, so none of them is kept either."""
        self._kept.discard(key)
        self._closed.put(key, True)

    def _after(self, kept: _Kept, body: bytes) -> tuple[dict[str, Any], _Kept | None] | None:
        """The body parsed from `kept` and what to keep of it next, or None where it does not start
        with the same bytes (or is not JSON: the whole parse then raises the error it raises)."""
        end = kept.end
        if len(body) <= end or _digest(memoryview(body)[:end]) != kept.digest:
            return None
        try:
            rest = orjson.loads(_PREFIX + memoryview(body)[end:])
        except orjson.JSONDecodeError:
            return None
        added = rest.pop(_SENTINEL, None)
        if type(added) is not list or not added or added[0] != 0:
            return None
        new = added[1:]
        items = [*kept.items, *new]
        data = dict(kept.head)
        data[kept.field] = items
        # a key written again after the history (even the history's own) takes its last value; the
        # history array is still where the next body may pick up
        data.update(rest)
        follows = _extended(body, end, new)
        if follows is None:
            return data, None
        digest = _digest(memoryview(body)[:follows])
        size = kept.size + parsed_bytes(body[end:follows])
        return data, _Kept(kept.field, follows, digest, kept.head, (*kept.items, *new), size)


def _remembered(body: bytes, data: Any, field: str) -> _Kept | _Declined | None:
    """What to keep of a body parsed whole (None: nothing, and forget what was kept)."""
    items = data.get(field) if type(data) is dict else None
    if type(items) is not list or not items:
        return None
    return _kept(body, items, field) or _Declined(field)


def _extended(body: bytes, end: int, new: list[Any]) -> int | None:
    """Where the history array ends now, if the new elements are written as orjson writes them."""
    try:
        written = b"".join(b"," + orjson.dumps(item) for item in new)
    except orjson.JSONEncodeError:
        return None
    follows = end + len(written)
    return follows if body[end:follows] == written else None


def _kept(body: bytes, items: list[Any], field: str) -> _Kept | None:
    """What to remember of a body parsed whole: found where orjson's writing of the history is."""
    try:
        written = orjson.dumps(items)
    except orjson.JSONEncodeError:
        return None
    start = body.find(written)
    head = _head(body, start, field) if start > 0 else None
    if head is None:
        return None
    end = start + len(written) - 1
    return _Kept(field, end, _digest(memoryview(body)[:end]), head, tuple(items), parsed_bytes(body[:end]))


@functools.cache
def _key_pattern(field: str) -> re.Pattern[bytes]:
    return re.compile(rb'[{,]\s*"' + re.escape(field.encode()) + rb'"\s*:\s*\Z')


def _head(body: bytes, start: int, field: str) -> dict[str, Any] | None:
    """The keys before the array at `start`, if it is the value of `field` in the top-level object:
    the text before it ends with `field`'s key (its opening quote after `{` or `,`, so not an escaped
    quote inside a string) and, with a 0 for the array, closes into an object (so no bracket is open
    but the top level's)."""
    before = body[:start]
    if not _key_pattern(field).search(before):
        return None
    try:
        head = orjson.loads(before + b"0}")
    except orjson.JSONDecodeError:
        return None
    return head if type(head) is dict else None
