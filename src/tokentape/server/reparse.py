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
"""

from __future__ import annotations

import functools
import re
import secrets
from dataclasses import dataclass
from typing import Any

import orjson
import xxhash

from tokentape.core.bounded import BoundedCache

__all__ = ["MIN_BODY_BYTES", "Reparser"]

MIN_BODY_BYTES = 32 * 1024  # below this a whole parse costs about as little as the bookkeeping
KEPT_BYTES = 64 << 20  # the histories' JSON remembered across sessions, least recently used first
_SEED = secrets.randbits(64)
_SENTINEL = secrets.token_hex(12)  # the placeholder key no client can know
_PREFIX = b'{"' + _SENTINEL.encode() + b'":[0'
_PER_ITEM_BYTES = 700  # a parsed message beyond its text (its dicts, a tool call's): measured on agent histories
# sessions finished or deleted lately: a body sent to one (the SDKs retry a refusal twice) keeps nothing
CLOSED_REMEMBERED = 4096


@dataclass(frozen=True, slots=True)
class _Kept:
    field: str  # the history's key
    end: int  # the offset just past the history's last element
    digest: bytes  # xxh3-128 of the body before `end`
    head: dict[str, Any]  # the keys before the history, in order, the history's key holding 0
    items: tuple[Any, ...]  # the history's parsed elements: each body gets a list of its own


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
    return kept.end + _PER_ITEM_BYTES * len(kept.items) if type(kept) is _Kept else 64


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

    def parse(self, key: str | None, body: bytes, field: str) -> Any:
        if key is None or len(body) < self.min_bytes or self._closed.get(key):
            return orjson.loads(body)
        kept = self._kept.get(key)
        if type(kept) is _Declined and kept.field == field:
            return orjson.loads(body)
        if type(kept) is _Kept and kept.field == field:
            data = self._after(key, kept, body)
            if data is not None:
                self.reused += 1
                return data
        data = orjson.loads(body)
        self._remember(key, body, data, field)
        return data

    def forget(self, key: str) -> None:
        """Drop what is kept for `key`: its session is finished or deleted, and the bodies still sent
        to it are refused, so none of them is kept either."""
        self._kept.discard(key)
        self._closed.put(key, True)

    def _after(self, key: str, kept: _Kept, body: bytes) -> dict[str, Any] | None:
        """The body parsed from `kept`, or None where it does not start with the same bytes (or is not
        JSON: the whole parse then raises the error it raises)."""
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
            self._kept.discard(key)
        else:
            digest = _digest(memoryview(body)[:follows])
            self._kept.put(key, _Kept(kept.field, follows, digest, kept.head, (*kept.items, *new)))
        return data

    def _remember(self, key: str, body: bytes, data: Any, field: str) -> None:
        items = data.get(field) if type(data) is dict else None
        if type(items) is not list or not items:
            self._kept.discard(key)
            return
        self._kept.put(key, _kept(body, items, field) or _Declined(field))


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
    return _Kept(field, end, _digest(memoryview(body)[:end]), head, tuple(items))


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
