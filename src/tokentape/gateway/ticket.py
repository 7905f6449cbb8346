"""A request's hold on shared state, taken with `async with` and given back in one place.

A ticket holds the request's session (one this request opened is forgotten again if nothing was
recorded in it), its request number and its claim on its retry key (a retry waits for the claim),
an admission slot (past `Admission.max_active` requests at once: `Overloaded`) and the session's
in-flight count (a session with requests in flight is never evicted).

The turns a request records are written to the store under its ticket. The claim is released only
when every one of those writes has finished, even if the client left mid-write and the request was
cancelled: a retry can never be answered with a turn that is not durable. A write is never
cancelled with its request, and a turn whose write failed is neither acknowledged nor replayed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from types import TracebackType

from tokentape.core.images import DecodedImage
from tokentape.core.tape import TurnNode
from tokentape.errors import Conflict, Overloaded, StoreFailure
from tokentape.gateway.sessions import Claim, Session, SessionRegistry

__all__ = ["Admission", "Ticket"]

log = logging.getLogger("tokentape.gateway")


def _log_failure(write: asyncio.Future[None]) -> None:
    """Failed writes are logged here, whether or not a request is still waiting for them."""
    if not write.cancelled() and (exc := write.exception()) is not None:
        log.error("%s", exc)


class Admission:
    """Active requests (admitted and not done: waiting for or using the engine), at most `max_active`
    at once; more get `Overloaded` (429 with Retry-After) before any work. One name throughout:
    `--max-active`, `GatewayStats.requests_active`, the `tokentape_requests_active` gauge."""

    def __init__(self, max_active: int) -> None:
        self.max_active = max_active
        self.active = 0

    def take(self) -> None:
        if self.active >= self.max_active:
            raise Overloaded(f"{self.active} requests are already active; retry shortly", retry_after=1.0)
        self.active += 1

    def give(self) -> None:
        self.active -= 1


class Ticket:
    def __init__(
        self,
        sessions: SessionRegistry,
        admission: Admission,
        session: Session,
        *,
        created: bool,
        key: bytes | None,
        track_write: Callable[[asyncio.Future[None]], None],
        on_written: Callable[[float], None] = lambda seconds: None,
    ) -> None:
        self.sessions = sessions
        self.admission = admission
        self.session = session
        self.created = created  # this request opened the session
        self.key = key
        self.request: int | None = None  # the session's number for this request, once claimed
        self._track_write = track_write
        self._on_written = on_written  # seconds one turn's store write took
        self._claim: Claim | None = None
        self._admitted = False
        self._in_flight = False
        self._writes: list[asyncio.Future[None]] = []

    async def __aenter__(self) -> Ticket:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._admitted:
            self.admission.give()
        if self._in_flight:
            self.session.in_flight -= 1
        pending = [write for write in self._writes if not write.done()]
        if pending:  # the client may be gone; the claim waits for the store all the same
            asyncio.gather(*pending, return_exceptions=True).add_done_callback(lambda _: self._finish())
        else:
            self._finish()

    def _finish(self) -> None:
        session, claim = self.session, self._claim
        if claim is not None:
            if self.key is not None and session.claims.get(self.key) is claim:
                del session.claims[self.key]
            if not claim.done.done():
                claim.done.set_result(None)
        if self.created and not session.tree.nodes and not session.in_flight and not session.claims:
            self.sessions.discard(session.id)

    # -- the steps of a request, in order ----------------------------------------------------------
    async def first_attempt(self) -> int | None:
        """For a retry: the number of the request it repeats (the latest with its key), once that
        request has finished and its turns are written; None if there is none."""
        if self.key is None:
            return None
        running = self.session.claims.get(self.key)
        if running is not None:
            self.sessions.retries_waiting += 1
            try:
                await asyncio.shield(running.done)
            finally:
                self.sessions.retries_waiting -= 1
        return self.session.latest.get(self.key)

    def claim(self) -> None:
        """Number the request, claim its key, admit it, count it in flight."""
        session = self.session
        session.numbered += 1
        self.request = session.numbered
        if self.key is not None:
            self._claim = Claim(self.request, asyncio.get_running_loop().create_future())
            session.claims[self.key] = self._claim
            session.latest[self.key] = self.request
        session.check_open()
        if self.sessions.over_budget():  # the running sessions alone hold the budget: wait, never OOM
            raise Overloaded(
                f"the gateway holds {self.sessions.held_bytes:,} bytes in memory, past the budget of "
                f"{self.sessions.limits.max_bytes:,} (tokentape serve --max-memory-bytes); retry shortly",
                retry_after=5.0,
            )
        self.admission.take()
        self._admitted = True
        session.in_flight += 1
        self._in_flight = True

    def write(self, node: TurnNode, images: Sequence[DecodedImage] = ()) -> asyncio.Future[None]:
        """Start writing a recorded turn (with the bytes of the images its prompt shows: each stored
        once, by digest); the write runs to its end whatever happens to the request. The future it
        returns settles when the store's job does (a callback, not a task per turn: a lone turn is
        usually committed before this returns)."""
        session = self.session
        written: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        started = time.monotonic()

        def fail(error: Exception) -> None:
            session.unstored.add(node.id)
            written.set_exception(error)

        def not_stored(exc: BaseException) -> None:
            error = StoreFailure(f"turn {node.id} of session {session.id!r} was not stored: {exc}")
            error.__cause__ = exc
            fail(error)

        def settle(landed: asyncio.Future[bool]) -> None:
            exc = StoreFailure("the write was cancelled") if landed.cancelled() else landed.exception()
            if exc is not None:
                not_stored(exc)
            elif not landed.result():
                fail(Conflict(f"session {session.id!r} was deleted", param="session_id", code="session_deleted"))
            else:
                self._on_written(time.monotonic() - started)
                written.set_result(None)

        shown: dict[str, DecodedImage] = {}
        try:
            brought = {run.digest for run in node.images}  # the images new to the path: the others are stored
            shown = {image.digest: image for image in images if image.digest in brought}
            landing = self.sessions.store.save_turn(session.tree, node, self.key, shown).landing()
        except Exception as exc:  # the row could not even be made
            not_stored(exc)
        else:
            landing.add_done_callback(settle)
        written.add_done_callback(_log_failure)
        if shown:  # read back from the store from now on; held until the write lands
            self.sessions.images.keep(shown.values(), written)
        self._writes.append(written)
        self._track_write(written)
        return written

    @staticmethod
    async def durable(write: asyncio.Future[None]) -> None:
        """Wait until a write is done (raising its error); cancelling the wait leaves the write running."""
        await asyncio.shield(write)
