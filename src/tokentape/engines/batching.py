"""Continuous batching for the embedded engine: one worker thread decodes up to `parallel` generations
together, one llama.cpp batch per step, each generation its own sequence id in a KV cache they share.

A step feeds every running generation's pending tokens (one sampled token each, or a chunk of a new
prompt) in one `llama_decode`, then samples each generation's next token from its own row of logits
(in numpy: the recorded logprob is the distribution the token was drawn from). Generations join and
leave at step boundaries; a cancelled one leaves before the next step. Commands (a weight update, a
probe) run between steps once every generation queued before them has ended, so none ever sees half
an update, exactly as with a serial worker. KV slots outlive their generation: a session's next turn
skips the prefix its slot still holds (`slots.SlotTable`). When the cache is full, the least recently
used idle slot is emptied; if none is idle, the generation that joined last gives its KV back and
waits to be recomputed (its sampled tokens, its random state and its grammar state kept), so one
client's long turn never fails another's.

Idle slots' KV leaves the cache while a long prompt is read, and comes back for its session's next
turn (`kv_offload`). Each generation's next token is sampled from its row of logits, a generation with
a grammar once its grammar has masked them on a grammar thread, which the worker waits for only as long
as the step's decode took (`batch_sampling`). The llama.cpp context is `llama_context.Native`; a
generation's state is `generation.Generation`.

No request can stop the worker: an error while sampling one generation fails that generation alone;
an error anywhere else in a step fails the generations of that step, whose KV is dropped, and the
worker serves on (`faults`). Should the worker thread die anyway, it is started again on the next
submission or by a waiting caller's check (`ensure_alive`, `restarts`), and everything it held is
failed, so no caller waits forever.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np

from tokentape.engines.batch_sampling import BatchSampling
from tokentape.engines.generation import Generation, WorkerFault
from tokentape.engines.grammar_pool import GRAMMAR_THREADS, GrammarPool
from tokentape.engines.kv_offload import OFFLOAD_FROM, KvOffload
from tokentape.engines.llama_context import Native
from tokentape.engines.slots import SlotTable, shared_prefix
from tokentape.engines.threads import ThreadTuner
from tokentape.errors import InvalidRequest

__all__ = ["Batcher"]

log = logging.getLogger("tokentape.engine")

_CLOSE = object()
# a prompt that would share at least this many more tokens with one being prefilled waits one step for it
_WAIT_FOR_SHARED = 16
# How long the worker sleeps at most while every running generation waits for its grammar (it then
# looks for new arrivals to admit).
_MASK_POLL_SECONDS = 0.05


@dataclass(eq=False)
class _Command:
    run: Callable[[], Any]
    done: Future[Any]


class Batcher(BatchSampling, KvOffload):
    """The worker thread and its state; every method but `submit`, `call`, `close` runs on it."""

    def __init__(
        self,
        native: Native,
        *,
        parallel: int,
        sequences: int,
        make_mask: Callable[[Native, str], Any],
        on_finish: Callable[[Generation], None],
        threads: int = 1,
        tuner: ThreadTuner | None = None,
        grammar_threads: int = GRAMMAR_THREADS,
        stored_tokens: int = 0,
    ) -> None:
        self.native = native
        self.stored_tokens = stored_tokens  # idle KV kept in host memory, in tokens; 0: none leaves the cache
        self.threads = threads  # what the native context computes with now
        self.tuner = tuner  # None: `threads` stays, unless set_threads asks for others
        self.parallel = parallel
        self.slots = SlotTable(sequences)
        self.version = 0  # the weights version new KV is computed under
        self._make_mask = make_mask
        self._on_finish = on_finish
        self._inbox: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._pending: list[Generation | _Command] = []
        self.active: list[Generation] = []
        self._steps = 0
        # counters (read by describe(); written here only)
        self.tokens_sampled = 0
        self.prompt_tokens = 0  # prompt tokens of every admission
        self.prefill_tokens_saved = 0  # of those, taken from a cached slot instead of computed
        self.steps = 0
        self.batched_sequences = 0  # sequences sampled from, summed over steps: / steps = mean batch
        self.preempted = 0
        self.offloaded = 0  # idle slots' KV moved to host memory
        self.restored = 0  # and put back for its session's next turn
        self.faults = 0  # errors the worker caught and survived (each failed the generations it concerned)
        self.restarts = 0  # times the worker thread died and was started again
        self._threads: int | None = None
        self._closed = False
        self._reviving = threading.Lock()
        self._decode_seconds = 0.0  # how long the last step's decode took: what a late mask may be waited for
        self._grammar_jobs: set[Future[np.ndarray]] = set()  # masks still running (also of ended generations)
        self._jobs_lock = threading.Lock()
        self.grammars = GrammarPool(grammar_threads)  # the threads masks run on
        self._thread = self._launch()

    # -- from any thread -------------------------------------------------------------------------------
    def submit(self, generation: Generation) -> None:
        self._inbox.put(generation)
        self.ensure_alive()

    def call(self, run: Callable[[], Any]) -> Future[Any]:
        """Run `run` on the worker once every generation submitted before has ended; its result."""
        done: Future[Any] = Future()
        self._inbox.put(_Command(run, done))
        self.ensure_alive()
        return done

    def request_threads(self, threads: int) -> None:
        self._threads = threads  # applied by the worker before its next step

    def close(self) -> None:
        self._inbox.put(_CLOSE)
        self.ensure_alive()  # a dead worker is started again to take the close and fail what it held
        self._thread.join()
        self._closed = True
        self.grammars.close()

    def ensure_alive(self) -> bool:
        """Start the worker again if its thread has died; whether it had."""
        if self._closed or self._thread.is_alive():
            return False
        with self._reviving:
            if self._thread.is_alive():
                return False
            self.restarts += 1
            log.error("the embedded engine's worker had stopped; started again (restart %d)", self.restarts)
            self._thread = self._launch(revived=True)
            return True

    def _launch(self, *, revived: bool = False) -> threading.Thread:
        thread = threading.Thread(target=self._serve, args=(revived,), name="llamacpp", daemon=True)
        thread.start()
        return thread

    # -- the worker ------------------------------------------------------------------------------------
    def _serve(self, revived: bool) -> None:
        """The worker's life: serve until closed; whatever escapes a step fails what the worker held
        at that moment, and it serves on."""
        if revived:  # what the dead thread held is in an unknown state: fail it, forget its KV
            self._recover(WorkerFault("the engine's worker stopped while generating; it has been restarted"))
        while True:
            try:
                self._work()
                return
            except BaseException as exc:
                self.faults += 1
                log.exception("the embedded engine's worker failed a step; the generations in it fail, it serves on")
                self._recover(WorkerFault(f"the engine's worker failed: {type(exc).__name__}: {exc}"))

    def _recover(self, failure: Exception) -> None:
        """Fail every running generation (their KV is dropped: what the failed call left is unknown)."""
        for generation in list(self.active):
            try:
                if generation.slot is not None:
                    self.native.cut(generation.slot.seq_id, 0)
                    generation.slot.tokens = []
            finally:
                generation.emit(failure)
                self._finish(generation)

    def _work(self) -> None:
        while True:
            if not self.active and not self._pending:
                item = self._inbox.get()  # idle: sleep until something comes
                if item is _CLOSE:
                    break
                self._pending.append(item)  # type: ignore[arg-type]
            closing = self._drain()
            self._admit()
            if self._threads is not None:  # asked for: fixed from now on
                self.tuner = None
                self._use_threads(self._threads)
                self._threads = None
            if self.active:
                self._step()
            if closing:
                break
        for generation in [*self.active, *(p for p in self._pending if isinstance(p, Generation))]:
            self._finish(generation)
        for command in self._pending:
            if isinstance(command, _Command):
                command.done.cancel()

    def _drain(self) -> bool:
        closing = False
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return closing
            if item is _CLOSE:
                closing = True
            else:
                self._pending.append(item)  # type: ignore[arg-type]

    def _admit(self) -> None:
        index = 0
        while index < len(self._pending):
            item = self._pending[index]
            if isinstance(item, _Command):
                if self.active:
                    return  # a barrier: what was submitted before it must end first
                del self._pending[index]
                try:
                    item.done.set_result(item.run())
                except BaseException as exc:  # handed to the caller
                    item.done.set_exception(exc)
                continue
            if item.cancel.is_set() or item.sampled >= item.limit:
                del self._pending[index]
                self._finish(item)
                continue
            if len(self.active) >= self.parallel:
                return
            if self._worth_waiting(item):
                index += 1
                continue
            del self._pending[index]
            try:
                self._start(item)
            except Exception as exc:  # out of every list now: fail it here, or nobody would
                self.faults += 1
                log.exception("a generation could not start; it fails, the worker serves on")
                item.emit(WorkerFault(f"the engine's worker could not start this generation: {exc}"))
                self._finish(item)

    def _worth_waiting(self, generation: Generation) -> bool:
        """Whether a running generation will soon hold in its KV a longer prefix of this one's prompt
        than any slot holds now (n > 1 choices of one prompt, episodes on one question): then it joins
        a step later and copies that prefix instead of computing it again."""
        _, cached = self.slots.best_source(generation.tokens, self.version)
        for other in self.active:
            could = min(shared_prefix(other.tokens, generation.tokens), len(generation.tokens) - 1)
            if could >= max(cached, other.fed) + _WAIT_FOR_SHARED:
                return True
        return False

    def _start(self, generation: Generation) -> None:
        if generation.grammar is not None and generation.mask is None:
            try:
                generation.mask = self._make_mask(self.native, generation.grammar)
            except InvalidRequest as exc:
                generation.emit(exc)
                self._finish(generation)
                return
        self._bring_back(generation.session)
        assignment = self.slots.assign(generation.tokens, generation.session, self.version)
        assert assignment is not None  # fewer generations run than there are slots
        slot = assignment.slot
        self.native.cut(slot.seq_id, assignment.keep)
        if assignment.source is not None:
            self.native.cut(slot.seq_id, 0)
            self.native.copy(assignment.source.seq_id, slot.seq_id, assignment.copy)
        if self.stored_tokens and len(generation.tokens) - assignment.reused >= OFFLOAD_FROM:
            self._offload_idle()  # after the copy: the cells copied stay, as the target's
        generation.slot = slot
        generation.fed = assignment.reused
        generation.admitted = self._steps
        generation.reused.append(assignment.reused)
        if not generation.sampled:  # a generation given back and recomputed counts its prompt once
            self.prompt_tokens += len(generation.tokens)
            self.prefill_tokens_saved += assignment.reused
        self.active.append(generation)

    def _finish(self, generation: Generation) -> None:
        if generation in self.active:
            self.active.remove(generation)
        if generation.finished:
            return
        generation.finished = True
        try:
            if generation.slot is not None:
                self.slots.release(generation.slot)
                generation.slot = None
            if generation.mask is not None:
                mask, generation.mask = generation.mask, None
                masking, generation.masking = generation.masking, None
                if masking is None:
                    mask.close()
                else:  # freed once its thread is done with it (at once if it is, or never started)
                    masking.cancel()  # still in line: it never runs
                    masking.add_done_callback(lambda _: mask.close())
        finally:
            self._on_finish(generation)

    def _give_back(self, generation: Generation) -> None:
        """Free the KV of a running generation; it waits at the front of the queue to be recomputed."""
        slot = generation.slot
        self.native.cut(slot.seq_id, 0)
        slot.tokens = []
        self.slots.release(slot)
        generation.slot = None
        generation.fed = 0
        self.active.remove(generation)
        self._pending.insert(0, generation)
        self.preempted += 1

    def _step(self) -> None:
        self._steps += 1
        for generation in [g for g in self.active if g.cancel.is_set()]:
            self._finish(generation)  # at a token boundary: it samples nothing more
        self._collect_masks()
        while self.active:
            rows, outputs = self._plan()
            if not rows:  # every running generation waits for its grammar
                self._await_masks(_MASK_POLL_SECONDS)
                return
            if self.tuner is not None:
                self._use_threads(self.tuner.threads_for(len(rows)))
            started = time.perf_counter()
            status = self.native.decode(rows)
            self._decode_seconds = time.perf_counter() - started
            if status == 0:
                if self.tuner is not None:
                    self.tuner.record(self.threads, len(rows), self._decode_seconds)
                self._after(rows, outputs)
                return
            if status != 1 or not self._make_room():
                self._recover(RuntimeError(f"llama_decode returned {status}"))
                return
            # the cache was full: an idle slot was emptied or a generation gave its KV back; again

    def _use_threads(self, threads: int) -> None:
        if threads != self.threads:
            self.native.set_threads(threads)
            self.threads = threads

    def _after(self, rows: list[tuple[int, int, int, bool]], outputs: list[tuple[Generation, int]]) -> None:
        self.steps += 1
        self.batched_sequences += len(outputs)
        fed: dict[int, int] = {}
        for _, _, seq_id, _ in rows:
            fed[seq_id] = fed.get(seq_id, 0) + 1
        for generation in self.active:
            generation.fed += fed.get(generation.slot.seq_id, 0)
            generation.slot.tokens = generation.tokens[: generation.fed]
        masking = False
        for generation, row in outputs:
            if generation.cancel.is_set():
                self._finish(generation)
            elif generation.mask is not None:
                self._mask_later(generation, self.native.logits(row))
                masking = True
            else:
                self._sample(generation, self.native.logits_view(row))
        if masking:  # as long as the decode took: a grammar that is late holds up no other generation longer
            self._await_masks(self._decode_seconds, every=True)

    def _plan(self) -> tuple[list[tuple[int, int, int, bool]], list[tuple[Generation, int]]]:
        """This step's rows: every generation's pending tokens, the decoding ones (one token) first,
        prompts in chunks filling what is left of the batch."""
        rows: list[tuple[int, int, int, bool]] = []
        outputs: list[tuple[Generation, int]] = []
        room = self.native.batch_size
        waiting = [g for g in self.active if g.masking is None]  # none with a grammar still masking
        for generation in sorted(waiting, key=lambda g: len(g.tokens) - g.fed):
            count = min(room, len(generation.tokens) - generation.fed)
            if count <= 0:
                break
            start, seq_id = generation.fed, generation.slot.seq_id
            for position in range(start, start + count):
                last = position == len(generation.tokens) - 1
                if last:
                    outputs.append((generation, len(rows)))
                rows.append((generation.tokens[position], position, seq_id, last))
            room -= count
        return rows, outputs

    def _make_room(self) -> bool:
        slot = self.slots.evict()
        if slot is not None:
            self.native.cut(slot.seq_id, 0)
            return True
        if len(self.active) > 1:
            self._give_back(max(self.active, key=lambda g: g.admitted))
            return True
        return False

    def reset_slots(self) -> None:
        """Forget every slot's KV (a new context: another model was loaded)."""
        for slot in self.slots.slots:
            slot.tokens = []
            slot.session = None
            slot.stored = None

    def drop_stale(self) -> None:
        """Free the KV computed under other weights than the current ones (it is never reused)."""
        for slot in self.slots.slots:
            if slot.version != self.version and not slot.busy:
                self.native.cut(slot.seq_id, 0)
                slot.tokens = []
                slot.stored = None

    def adopt_cache(self) -> None:
        """Mark every slot's KV as computed under the current weights (an update that said keep)."""
        for slot in self.slots.slots:
            slot.version = self.version
