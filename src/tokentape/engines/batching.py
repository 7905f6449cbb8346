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

Idle slots' KV leaves the cache while a long prompt is read. llama.cpp attends every row of a step
over every cell up to the highest one in use and masks the cells of other sequences; flash attention
skips their arithmetic but still walks their mask, per row, head and layer, so a prompt read beside
12k cells of sessions between turns took 2-4x as long as in an empty cache. When a generation starts
with at least `_OFFLOAD_FROM` prompt tokens to compute, every idle slot's KV is copied to host memory
(llama.cpp's sequence state: the cells as they are, so nothing is recomputed and the logits of the
session's next turn are bit for bit the same) and cut from the cache, as llama-server does with idle
slots (`--cache-ram`); it is put back when its session's next turn starts. Host memory holds at most
`stored_tokens` tokens of it (the oldest dropped first, to be recomputed if their session comes back).

A generation's grammar (its output constraint) is followed off the worker, on the engine's grammar
threads (`grammar_pool`: at most `GRAMMAR_THREADS`, 4, however many masks are asked for; more wait in
line): llama.cpp's grammar sampler costs what the grammar makes it cost (an ambiguous pattern such as
`^(a?){160}$` took half a minute a token), so the worker waits for a mask only as long as the step's
decode took, steps on without a generation whose mask is late (it samples once the mask is ready), and
fails one whose mask is not there `GRAMMAR_SECONDS` after it was asked for (in line or running); the
others never wait on it. A mask that cannot be stopped keeps its thread until it returns, and counts
against the pool all that time; one still in line when its generation ends never runs.

No request can stop the worker: an error while sampling one generation fails that generation alone;
an error anywhere else in a step fails the generations of that step, whose KV is dropped, and the
worker serves on (`faults`). Should the worker thread die anyway, it is started again on the next
submission or by a waiting caller's check (`ensure_alive`, `restarts`), and everything it held is
failed, so no caller waits forever.
"""

from __future__ import annotations

import ctypes
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ALL_COMPLETED, FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tokentape.core.sampling import SamplingParams
from tokentape.engines.base import LogprobMode, SampledToken
from tokentape.engines.grammar_pool import GRAMMAR_THREADS, GrammarPool
from tokentape.engines.sampler import LogitShaper, sample_token
from tokentape.engines.slots import SlotTable, shared_prefix
from tokentape.engines.threads import ThreadTuner
from tokentape.errors import InvalidRequest, Overloaded

__all__ = [
    "Batcher",
    "Generation",
    "Native",
    "NativeSettings",
    "WorkerFault",
    "DONE",
    "GRAMMAR_SECONDS",
    "GRAMMAR_THREADS",
]

log = logging.getLogger("tokentape.engine")

DONE = object()  # the last item a generation's listener gets
_CLOSE = object()
# a prompt that would share at least this many more tokens with one being prefilled waits one step for it
_WAIT_FOR_SHARED = 16
# a generation with this many prompt tokens to compute moves idle slots' KV out of the cache first
_OFFLOAD_FROM = 256
# A generation whose grammar takes longer than this to mask the logits of one token fails (its request's
# output constraint is too costly to follow); the others were never held up by it.
GRAMMAR_SECONDS = 30.0
# How long the worker sleeps at most while every running generation waits for its grammar (it then
# looks for new arrivals to admit).
_MASK_POLL_SECONDS = 0.05


@dataclass(frozen=True, slots=True)
class NativeSettings:
    threads: int
    batch_size: int
    cache_tokens: int  # KV cells shared by all sequences
    sequences: int  # sequence ids (KV slots)
    flash_attention: bool
    kv_cache_f32: bool


class Native:
    """A llama.cpp model and one context over it whose KV cache holds many sequences."""

    def __init__(self, lib: Any, path: Path, settings: NativeSettings) -> None:
        logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)  # llama.cpp's own chatter
        lib.llama_backend_init()
        self._lib = lib
        params = lib.llama_model_default_params()
        # No repacked weights (llama.cpp's extra buffer types: AMX tiles, interleaved Q4_0): another
        # kernel, so another rounding than a reference context computes; on a CPU with AMX, llama.cpp
        # 0.3.36's AMX matmul of the shipped Q4_1 weights crashed. F32 and Q4_1 run as before elsewhere.
        params.use_extra_bufts = False
        self.model = lib.llama_model_load_from_file(str(path).encode(), params)
        if not self.model:
            raise ValueError(f"llama.cpp could not load {path}")
        self.ctx = None
        try:
            self.ctx = lib.llama_init_from_model(self.model, self._context_params(settings))
            if not self.ctx:
                raise ValueError(f"llama.cpp could not create a context for {path}")
        except BaseException:
            self.close()
            raise
        self.memory = lib.llama_get_memory(self.ctx)
        self.n_vocab: int = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self.model))
        self.batch_size = settings.batch_size
        self._batch = lib.llama_batch_init(settings.batch_size, 0, 1)

    def _context_params(self, settings: NativeSettings) -> Any:
        lib = self._lib
        params = lib.llama_context_default_params()
        params.n_ctx = settings.cache_tokens
        params.n_batch = params.n_ubatch = settings.batch_size
        params.n_seq_max = settings.sequences
        params.kv_unified = True  # one pool of cells: a sequence may grow to the whole context
        params.n_threads = params.n_threads_batch = settings.threads
        params.flash_attn_type = (
            lib.LLAMA_FLASH_ATTN_TYPE_ENABLED if settings.flash_attention else lib.LLAMA_FLASH_ATTN_TYPE_DISABLED
        )
        if settings.kv_cache_f32:
            params.type_k = params.type_v = 0  # GGML_TYPE_F32; else llama.cpp's F16
        return params

    def decode(self, tokens: list[tuple[int, int, int, bool]]) -> int:
        """Evaluate (token, position, sequence id, wants logits) rows; llama_decode's status."""
        batch = self._batch
        batch.n_tokens = len(tokens)
        for i, (token, position, seq_id, logits) in enumerate(tokens):
            batch.token[i] = token
            batch.pos[i] = position
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq_id
            batch.logits[i] = logits
        return int(self._lib.llama_decode(self.ctx, batch))

    def logits(self, row: int) -> np.ndarray:
        """The row's logits, a copy of its own (for a grammar thread that runs past the next decode)."""
        return self.logits_view(row).copy()

    def logits_view(self, row: int) -> np.ndarray:
        """The row's logits in llama.cpp's buffer, valid until the next decode: what the worker samples
        from at once (a copy of a 49k row page-faults, the buffer being past the mmap threshold)."""
        pointer = self._lib.llama_get_logits_ith(self.ctx, row)
        return np.ctypeslib.as_array(pointer, shape=(self.n_vocab,))

    def cut(self, seq_id: int, start: int) -> None:
        """Drop the sequence's KV from position `start` on."""
        self._lib.llama_memory_seq_rm(self.memory, seq_id, start, -1)

    def copy(self, source: int, target: int, length: int) -> None:
        """Give `target` the first `length` positions of `source` (the cells are shared, not copied)."""
        self._lib.llama_memory_seq_cp(self.memory, source, target, 0, length)

    def save(self, seq_id: int) -> ctypes.Array[ctypes.c_uint8]:
        """The sequence's KV cells as llama.cpp writes them (its sequence state), in host memory."""
        lib = self._lib
        size = int(lib.llama_state_seq_get_size_ext(self.ctx, seq_id, 0))
        data = (ctypes.c_uint8 * size)()
        if int(lib.llama_state_seq_get_data_ext(self.ctx, data, size, seq_id, 0)) != size:
            raise RuntimeError(f"llama.cpp could not save sequence {seq_id}'s KV")
        return data

    def restore(self, seq_id: int, data: ctypes.Array[ctypes.c_uint8]) -> bool:
        """Put saved KV back into the sequence (replacing what it holds); False when the cache has no room."""
        return int(self._lib.llama_state_seq_set_data_ext(self.ctx, data, len(data), seq_id, 0)) == len(data)

    def set_threads(self, threads: int) -> None:
        self._lib.llama_set_n_threads(self.ctx, threads, threads)

    def close(self) -> None:
        lib = self._lib
        if getattr(self, "_batch", None) is not None:
            lib.llama_batch_free(self._batch)
            self._batch = None
        if self.ctx:
            lib.llama_free(self.ctx)
            self.ctx = None
        if self.model:
            lib.llama_model_free(self.model)
            self.model = None


@dataclass(eq=False)
class Generation:
    """One choice being generated: its tokens so far and everything its sampling needs."""

    tokens: list[int]  # the prompt, then every token sampled (the last one not yet in the KV)
    params: SamplingParams
    rng: np.random.Generator
    session: str | None
    grammar: str | None
    cancel: threading.Event
    emit: Callable[[object], None]
    stop_ids: frozenset[int]
    limit: int  # tokens it may sample
    mode: LogprobMode
    mask: Any = None  # a _GrammarMask, made on the worker
    masking: Future[np.ndarray] | None = None  # its grammar masking its next logits, on a thread of its own
    masking_since: float = 0.0  # time.monotonic() when that began
    unaccepted: int | None = None  # its last token, which its grammar takes in before masking the next
    shaper: LogitShaper | None = None  # the request's logit bias and penalties, if any
    slot: Any = None  # its slots.Slot while it runs
    fed: int = 0  # how many of `tokens` its slot's KV holds
    sampled: int = 0
    admitted: int = 0  # the step it joined at (the last to join gives its KV back first)
    reused: list[int] = field(default_factory=list)  # prompt tokens taken from the cache, per admission
    finished: bool = False  # its listener has had DONE (once, whatever path ended it)


class WorkerFault(RuntimeError):
    """The engine's worker failed while it held this generation (not the request's fault)."""


@dataclass(eq=False)
class _Command:
    run: Callable[[], Any]
    done: Future[Any]


class Batcher:
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

    def when_grammars_done(self, run: Callable[[], None]) -> None:
        """Run `run` once every grammar mask running now has ended, at once if none is: a mask of a
        generation that has failed may still be reading the model's vocabulary, so the model is freed
        (after a swap, or at close) only then."""
        with self._jobs_lock:
            jobs = list(self._grammar_jobs)
        if not jobs:
            run()
            return
        left = [len(jobs)]
        counting = threading.Lock()

        def one_done(_: object) -> None:
            with counting:
                left[0] -= 1
                last = left[0] == 0
            if last:
                run()

        for job in jobs:
            job.add_done_callback(one_done)

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
        if self.stored_tokens and len(generation.tokens) - assignment.reused >= _OFFLOAD_FROM:
            self._offload_idle()  # after the copy: the cells copied stay, as the target's
        generation.slot = slot
        generation.fed = assignment.reused
        generation.admitted = self._steps
        generation.reused.append(assignment.reused)
        if not generation.sampled:  # a generation given back and recomputed counts its prompt once
            self.prompt_tokens += len(generation.tokens)
            self.prefill_tokens_saved += assignment.reused
        self.active.append(generation)

    def _bring_back(self, session: str | None) -> None:
        """The slot a generation of `session` is about to take holds its KV in the cache again: put
        back when it is the session's own, else forgotten (it is cut anyway)."""
        slot = self.slots.target(session)
        if slot is None or slot.stored is None:
            return
        data, slot.stored = slot.stored, None
        if session is not None and slot.session == session and slot.version == self.version:
            while not self.native.restore(slot.seq_id, data):
                evicted = self.slots.evict()  # no room: the least recently used idle KV in the cache goes
                if evicted is None:
                    break
                self.native.cut(evicted.seq_id, 0)
            else:
                self.restored += 1
                return
        self.native.cut(slot.seq_id, 0)  # what a failed restore left
        slot.tokens = []

    def _offload_idle(self) -> None:
        """Move every idle slot's KV from the cache to host memory, within `stored_tokens` (the least
        recently used first out of host memory, the most recently used first into it)."""
        idle = sorted(
            (s for s in self.slots.slots if not s.busy and s.tokens and s.stored is None),
            key=lambda s: -s.last_used,
        )
        for slot in idle:
            if len(slot.tokens) > self.stored_tokens:
                continue  # stays in the cache
            self._trim_stored(self.stored_tokens - len(slot.tokens), newer_than=slot.last_used)
            if self._stored() + len(slot.tokens) > self.stored_tokens:
                break  # only newer KV is held: this and older stay in the cache
            try:
                slot.stored = self.native.save(slot.seq_id)
            except RuntimeError as exc:  # it stays in the cache
                log.warning("an idle slot's KV could not be saved to host memory: %s", exc)
                continue
            self.native.cut(slot.seq_id, 0)
            self.offloaded += 1

    def _stored(self) -> int:
        return sum(len(s.tokens) for s in self.slots.slots if s.stored is not None)

    def _trim_stored(self, room: int, *, newer_than: int) -> None:
        """Forget stored KV, oldest first, older than `newer_than`, until at most `room` tokens are held."""
        held = sorted((s for s in self.slots.slots if s.stored is not None), key=lambda s: s.last_used)
        total = sum(len(s.tokens) for s in held)
        for slot in held:
            if total <= room or slot.last_used >= newer_than:
                return
            total -= len(slot.tokens)
            slot.stored, slot.tokens, slot.session = None, [], None

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

    def _mask_later(self, generation: Generation, logits: np.ndarray) -> None:
        """Put the generation's grammar to work on its logits, on the grammar threads (see the module's doc)."""
        mask, token = generation.mask, generation.unaccepted
        generation.unaccepted = None

        def run() -> np.ndarray:
            if token is not None:
                mask.accept(token)
            masked: np.ndarray = mask.apply(logits)
            return masked

        done = self.grammars.submit(run)
        with self._jobs_lock:
            self._grammar_jobs.add(done)
        done.add_done_callback(self._forget_job)
        generation.masking, generation.masking_since = done, time.monotonic()

    def _forget_job(self, job: Future[np.ndarray]) -> None:
        with self._jobs_lock:
            self._grammar_jobs.discard(job)

    def _await_masks(self, seconds: float, *, every: bool = False) -> None:
        """Wait up to `seconds` for the running generations' masks (for every one, or the first), then
        sample those that are ready and fail those past `GRAMMAR_SECONDS`."""
        pending = [g.masking for g in self.active if g.masking is not None]
        if pending:
            wait(pending, timeout=seconds, return_when=ALL_COMPLETED if every else FIRST_COMPLETED)
        self._collect_masks()

    def _collect_masks(self) -> None:
        now = time.monotonic()
        for generation in [g for g in self.active if g.masking is not None]:
            masking = generation.masking
            assert masking is not None
            if masking.done():
                generation.masking = None
                exc = masking.exception()
                if exc is not None:
                    self.faults += 1
                    log.warning("a grammar failed for one generation: %s: %s", type(exc).__name__, exc)
                    generation.emit(exc)
                    self._finish(generation)
                else:
                    self._sample(generation, masking.result(), masked=True)
            elif now - generation.masking_since > GRAMMAR_SECONDS:
                if masking.running():
                    log.warning("a grammar took over %.0f s for one token; its generation fails", GRAMMAR_SECONDS)
                    generation.emit(
                        InvalidRequest(
                            f"the output constraint's grammar took more than {GRAMMAR_SECONDS:g} s to follow for one"
                            " token; the generation was stopped (a simpler schema or pattern is needed)",
                            code="grammar_too_costly",
                        )
                    )
                else:  # still in line: every grammar thread was busy with others the whole time
                    log.warning(
                        "a grammar waited over %.0f s for a grammar thread; its generation fails", GRAMMAR_SECONDS
                    )
                    busy = Overloaded(
                        f"every grammar thread ({self.grammars.size}) was busy with other output constraints for"
                        f" more than {GRAMMAR_SECONDS:g} s; retry later",
                        retry_after=GRAMMAR_SECONDS,
                    )
                    busy.code = "grammar_threads_busy"
                    generation.emit(busy)
                self._finish(generation)

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

    def _sample(self, generation: Generation, logits: np.ndarray, *, masked: bool = False) -> None:
        if generation.cancel.is_set():
            self._finish(generation)
            return
        try:
            if masked:
                self._sample_one(generation, logits, masked=True)
            else:
                self._sample_one(generation, logits)
        except Exception as exc:
            self.faults += 1
            log.warning("sampling failed for one generation: %s: %s", type(exc).__name__, exc)
            generation.emit(exc)
            self._finish(generation)

    def _sample_one(self, generation: Generation, logits: np.ndarray, masked: bool = False) -> None:
        if generation.mask is not None:
            if not masked:  # called with raw logits: the grammar masks them here (on this thread)
                if generation.unaccepted is not None:
                    generation.mask.accept(generation.unaccepted)
                    generation.unaccepted = None
                logits = generation.mask.apply(logits)
            if not np.isfinite(logits).any():  # the grammar allows nothing more: a dead end
                self._finish(generation)
                return
        token, logprob, top = sample_token(logits, generation.params, generation.rng, generation.shaper)
        self.tokens_sampled += 1
        generation.sampled += 1
        alternatives = tuple((t, lp) for t, lp in top if np.isfinite(lp))
        generation.emit(SampledToken(token, logprob, alternatives, generation.mode))
        if token in generation.stop_ids or generation.sampled >= generation.limit:
            self._finish(generation)
            return
        if generation.mask is not None:
            generation.unaccepted = token  # taken in by its grammar with the next logits, off this thread
        if generation.shaper is not None:
            generation.shaper.accept(token)
        generation.tokens.append(token)

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
