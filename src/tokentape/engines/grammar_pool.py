"""The threads the embedded engine's grammars mask logits on: a fixed number, whatever comes.

A grammar's mask for one token can cost anything from microseconds to half a minute (see
`formats.gbnf`), so masks run off the engine's worker thread. They run on at most `size` threads
(`GRAMMAR_THREADS`, 4 by default), started as they are first needed and kept. A mask waits in line
while every thread is busy. A mask whose generation stopped waiting for it (the grammar took too
long, or the client left) is taken out of the line if it has not started; one already running
cannot be stopped, so its thread stays busy until it returns, and counts against the `size` all
that time: a flood of costly grammars holds at most `size` threads, never one per token.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

__all__ = ["GRAMMAR_THREADS", "GrammarPool"]

T = TypeVar("T")
GRAMMAR_THREADS = 4  # masks run at once, at most, per engine; more wait in line
THREAD_NAME = "llamacpp-grammar"
_STOP = object()


class GrammarPool:
    """At most `size` threads; `submit` puts a task in line and returns its future (cancel it to
    take a task that has not started out of the line)."""

    def __init__(self, size: int = GRAMMAR_THREADS) -> None:
        if size < 1:
            raise ValueError("a grammar pool needs at least one thread")
        self.size = size
        self._line: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | object] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._outstanding = 0  # tasks in line or running
        self._running = 0
        self._closed = False
        self.peak_running = 0  # the most tasks that ran at once

    @property
    def threads(self) -> int:
        """Threads started (they are kept): never more than `size`."""
        with self._lock:
            return len(self._threads)

    @property
    def running(self) -> int:
        """Tasks running now: a timed-out one too, until it returns."""
        with self._lock:
            return self._running

    @property
    def waiting(self) -> int:
        """Tasks in line, not started (cancelled ones until a thread takes them out)."""
        with self._lock:
            return self._outstanding - self._running

    def submit(self, task: Callable[[], T]) -> Future[T]:
        done: Future[T] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("the grammar pool is closed")
            self._outstanding += 1
            if self._outstanding > len(self._threads) and len(self._threads) < self.size:  # all have one
                thread = threading.Thread(target=self._serve, name=THREAD_NAME, daemon=True)
                self._threads.append(thread)
                thread.start()
            self._line.put((task, done))
        return done

    def close(self) -> None:
        """Stop the threads once they are done with what they run; tasks still in line are cancelled."""
        with self._lock:
            self._closed = True
            threads = len(self._threads)
        for _ in range(threads):
            self._line.put(_STOP)

    def _serve(self) -> None:
        while True:
            item = self._line.get()
            if item is _STOP:
                return
            assert isinstance(item, tuple)
            task: Callable[[], Any] = item[0]
            done: Future[Any] = item[1]
            if self._closed:
                done.cancel()
            if done.set_running_or_notify_cancel():  # False: cancelled while it waited in line
                with self._lock:
                    self._running += 1
                    self.peak_running = max(self.peak_running, self._running)
                try:
                    result = task()
                except BaseException as exc:
                    self._ended(ran=True)  # counted free before its waiters hear of it
                    done.set_exception(exc)
                else:
                    self._ended(ran=True)
                    done.set_result(result)
            else:
                self._ended(ran=False)

    def _ended(self, *, ran: bool) -> None:
        with self._lock:
            self._outstanding -= 1
            self._running -= int(ran)
