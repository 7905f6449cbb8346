"""How the batching worker samples each generation's next token after a step: from its row of logits
at once, or, for a generation with a grammar (its output constraint), once the grammar has masked them.

A generation's grammar is followed off the worker, on the engine's grammar threads (`grammar_pool`: at
most `GRAMMAR_THREADS`, 4, however many masks are asked for; more wait in line): llama.cpp's grammar
sampler costs what the grammar makes it cost (an ambiguous pattern such as `^(a?){160}$` took half a
minute a token), so the worker waits for a mask only as long as the step's decode took, steps on
without a generation whose mask is late (it samples once the mask is ready), and fails one whose mask
is not there `GRAMMAR_SECONDS` after it was asked for (in line or running); the others never wait on
it. A mask that cannot be stopped keeps its thread until it returns, and counts against the pool all
that time; one still in line when its generation ends never runs. An error while sampling one
generation fails that generation alone. Part of the batching worker (`engines.batching.Batcher`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ALL_COMPLETED, FIRST_COMPLETED, Future, wait
from typing import TYPE_CHECKING

import numpy as np

from tokentape.engines.base import SampledToken
from tokentape.engines.generation import Generation
from tokentape.engines.grammar_pool import GrammarPool
from tokentape.engines.llama_context import Native
from tokentape.engines.sampler import sample_token
from tokentape.errors import InvalidRequest, Overloaded

__all__ = ["GRAMMAR_SECONDS", "BatchSampling"]

log = logging.getLogger("tokentape.engine")

# A generation whose grammar takes longer than this to mask the logits of one token fails (its request's
# output constraint is too costly to follow); the others were never held up by it.
GRAMMAR_SECONDS = 30.0


class BatchSampling:
    """The batching worker's sampling and the grammar masks it waits for (`when_grammars_done` from
    any thread, the rest on the worker)."""

    native: Native
    active: list[Generation]
    grammars: GrammarPool  # the threads masks run on
    _grammar_jobs: set[Future[np.ndarray]]  # masks still running (also of ended generations)
    _jobs_lock: threading.Lock
    tokens_sampled: int
    faults: int  # errors the worker caught and survived

    if TYPE_CHECKING:

        def _finish(self, generation: Generation) -> None: ...

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
