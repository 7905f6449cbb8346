"""Chain hashes of a request's message prefixes, each message canonicalised and hashed once per session.

An agent resends its whole history every turn. Canonicalising and hashing every message again would
make a turn's cost grow with the history, so a session remembers, for its latest requests, the chain
hash after each message. A new request reuses the chain hashes of the messages it shares with a
remembered request; only the messages after them are canonicalised and hashed (`messages.chain_step`).

Finding what is shared costs one pass in C over the request: its messages are serialised once
(`orjson.dumps` of the list) and a streaming xxh3-128 digest over those bytes is compared, at each
remembered request's length, with that request's digest. A JSON object ends where its bytes say, so
equal bytes up to there mean the same messages, serialised alike. A request that matches none of
them (an edit deep in the history, a branch that is not remembered) is compared message by message
through a fingerprint of each (`fingerprint`), in order.

Digests and fingerprints are accelerators, not identity: seeded per process (from Python's hash
seed), so two messages or histories only share one when they serialise alike or collide by chance
(about 2**-64 for a fingerprint, 2**-128 for a digest; xxh3 is not built against crafted collisions,
and a client that crafted one would only mislabel its own session's history). A message that differs
in any way, even in a way the canonical form ignores, is simply hashed again. `start` is the chain's
seed: the identity of everything besides the messages that the template reads; requests with another
seed share nothing.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import orjson
import xxhash

from tokentape.core.messages import EMPTY_CHAIN, Message, hash_chain

__all__ = ["ChainCache", "fingerprint", "fingerprints"]

REQUESTS_REMEMBERED = 4  # concurrent branches of one session (n>1 agents, retries) each keep theirs
_SEED = hash(b"tokentape.digests") & (1 << 64) - 1  # random per process, like the fingerprints


def fingerprints(messages: Sequence[Message]) -> array[int]:
    """`fingerprint` of each message, in one pass in C for the usual request."""
    try:
        return array("q", map(hash, map(orjson.dumps, messages)))
    except TypeError:
        return array("q", map(fingerprint, messages))


def fingerprint(message: Message) -> int:
    """A keyed 64-bit hash of a message's JSON (so `1` and `true` differ, and field order counts)."""
    try:
        return hash(orjson.dumps(message))
    except TypeError:  # integers past 64 bits, or a mapping orjson does not take: the repr tells them apart
        return hash(repr(sorted(dict(message).items(), key=lambda item: str(item[0]))))


@dataclass(slots=True)
class _Request:
    start: bytes
    prints: array[int]  # one fingerprint per message
    chains: list[bytes]  # the chain hash after each message
    size: int  # bytes of the messages' JSON list without its closing bracket; 0 when not serialisable
    digest: int  # xxh3-128 of those bytes


class ChainCache:
    """The chain hashes of the last few requests of one session, reused by the next ones."""

    __slots__ = ("_requests",)

    def __init__(self) -> None:
        self._requests: list[_Request] = []

    def chains(self, messages: Sequence[Message], start: bytes = EMPTY_CHAIN) -> list[bytes]:
        """The chain hash of every prefix of `messages` (of length 1, 2, ...), seeded with `start`."""
        try:
            body = memoryview(orjson.dumps(messages))[:-1]  # "[m0,m1,...": each prefix ends at a comma
        except TypeError:  # not a list orjson takes: compared message by message only
            body = memoryview(b"")
        known, size, digest = self._same_bytes(body, start)
        if known is not None:
            shared = len(known.prints)
            prints = known.prints[:]
            prints.extend(fingerprints(messages[shared:]))
        else:
            prints = fingerprints(messages)
            known, shared = self._longest_shared(prints, start)
        chains = known.chains[:shared] if known is not None else []
        chains.extend(hash_chain(messages[shared:], chains[-1] if chains else start))
        request = _Request(start, prints, chains.copy(), size, digest)
        if known is not None and shared == len(known.prints):
            self._requests.remove(known)  # the new request extends it: keep the longer one only
        self._requests.append(request)
        del self._requests[:-REQUESTS_REMEMBERED]
        return chains

    def clear(self) -> None:
        self._requests.clear()

    def _same_bytes(self, body: memoryview, start: bytes) -> tuple[_Request | None, int, int]:
        """The longest remembered request whose messages' JSON `body` starts with, and `body`'s own
        size and digest; one streaming pass over `body`."""
        if not body:
            return None, 0, 0
        candidates = sorted(
            (r for r in self._requests if r.start == start and 0 < r.size <= len(body)),
            key=lambda r: r.size,
        )
        digest = xxhash.xxh3_128(seed=_SEED)
        done = 0
        best: _Request | None = None
        for request in candidates:
            if request.size < len(body) and body[request.size] != ord(","):
                continue  # no message of ours ends where theirs did: cannot match, skip the digest
            digest.update(body[done : request.size])
            done = request.size
            if digest.intdigest() == request.digest:
                best = request
        digest.update(body[done:])
        return best, len(body), digest.intdigest()

    def _longest_shared(self, prints: array[int], start: bytes) -> tuple[_Request | None, int]:
        best: _Request | None = None
        shared = 0
        for request in reversed(self._requests):
            if request.start != start:
                continue
            n = min(len(request.prints), len(prints))
            if request.prints[:n] != prints[:n]:  # compared in C; scan only when they differ
                n = next(i for i, (a, b) in enumerate(zip(request.prints, prints, strict=False)) if a != b)
            if n > shared:
                best, shared = request, n
        return best, shared
