"""Chain hashes of a request's message prefixes, each message canonicalised and hashed once per session.

An agent resends its whole history every turn. Canonicalising and hashing every message again would
make a turn's cost grow with the history, so a session remembers, for the messages of its latest
requests, a fingerprint of each message and the chain hash up to it. A new request's messages are
fingerprinted and compared in order with a remembered request; the chain hashes of the shared prefix
are reused and only the messages after it are canonicalised and hashed (`messages.chain_step`).

A fingerprint is an accelerator, not identity: it is Python's keyed 64-bit hash (random per process)
of a message's JSON, so two messages only share one when they serialise alike or collide by chance
(about 2**-64). A message that differs in any way, even in a way the canonical form
ignores, is simply hashed again. `start` is the chain's seed: the identity of everything besides the
messages that the template reads; requests with another seed share nothing.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import orjson

from tokentape.core.messages import EMPTY_CHAIN, Message, hash_chain

__all__ = ["ChainCache", "fingerprint", "fingerprints"]

REQUESTS_REMEMBERED = 4  # concurrent branches of one session (n>1 agents, retries) each keep theirs


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


class ChainCache:
    """The chain hashes of the last few requests of one session, reused by the next ones."""

    __slots__ = ("_requests",)

    def __init__(self) -> None:
        self._requests: list[_Request] = []

    def chains(self, messages: Sequence[Message], start: bytes = EMPTY_CHAIN) -> list[bytes]:
        """The chain hash of every prefix of `messages` (of length 1, 2, ...), seeded with `start`."""
        prints = fingerprints(messages)
        known, shared = self._longest_shared(prints, start)
        chains = known.chains[:shared] if known is not None else []
        chains.extend(hash_chain(messages[shared:], chains[-1] if chains else start))
        request = _Request(start, prints, chains.copy())
        if known is not None and shared == len(known.prints):
            self._requests.remove(known)  # the new request extends it: keep the longer one only
        self._requests.append(request)
        del self._requests[:-REQUESTS_REMEMBERED]
        return chains

    def clear(self) -> None:
        self._requests.clear()

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
