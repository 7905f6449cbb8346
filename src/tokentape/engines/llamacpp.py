"""The embedded engine: llama.cpp on the CPU through llama-cpp-python, driven token by token.

One model instance generates one choice at a time on its own thread, so the event loop stays free
and concurrent requests queue instead of corrupting each other's KV cache. The prompt is given as
token IDs; the KV cache is reused for the longest prefix shared with the previous generation (which
is what makes multi-turn sessions cheap). Sampling is done here, in numpy, not by llama.cpp's
sampler, so that the recorded logprob is the one the token was drawn from.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import threading
from collections.abc import AsyncGenerator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tokentape.core.sampling import SamplingParams
from tokentape.engines.base import Constraint, SampledToken, logprob_mode
from tokentape.engines.sampler import sample_token
from tokentape.errors import ContextOverflow, EngineFailure, InvalidRequest

__all__ = ["LlamaCppEngine", "LlamaCppSettings", "default_threads"]

_DONE = object()


def default_threads() -> int:
    # ggml's thread pool busy-waits: using every core next to any other busy process (the agent,
    # a test runner) slows generation by two orders of magnitude. Leave one core free.
    return max(1, (os.cpu_count() or 2) - 1)


@dataclass(frozen=True, slots=True)
class LlamaCppSettings:
    model_path: Path
    context_length: int = 8192
    threads: int = 0  # 0: default_threads()
    batch_size: int = 512
    # Flash attention stays off on the CPU: on, it moved logprobs by up to 0.1 nats.
    flash_attention: bool = False


class LlamaCppEngine:
    """A GGUF model in-process. `generate` is safe to call from many tasks at once."""

    def __init__(self, settings: LlamaCppSettings) -> None:
        import llama_cpp

        self._lib = llama_cpp
        threads = settings.threads or default_threads()
        self.settings = settings
        self._llama = llama_cpp.Llama(
            str(settings.model_path),
            n_ctx=settings.context_length,
            n_threads=threads,
            n_threads_batch=threads,
            n_batch=settings.batch_size,
            flash_attn=settings.flash_attention,
            verbose=False,
        )
        vocab = llama_cpp.llama_model_get_vocab(self._llama.model)
        n_vocab = self._llama.n_vocab()
        self.vocab_size: int = n_vocab
        self._end_of_turn = frozenset(t for t in range(n_vocab) if llama_cpp.llama_vocab_is_eog(vocab, t))
        self.model_id = settings.model_path.stem
        self.context_length = self._llama.n_ctx()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llamacpp")
        self.waiting = 0  # generations queued or running
        self._counting = threading.Lock()
        self.tokens_generated = 0  # every token handed over since start, aborted generations included
        self.tokens_sampled = 0  # every token the worker sampled, also one sampled as its generation closed

    async def generate(
        self,
        prompt: Sequence[int],
        params: SamplingParams,
        *,
        seed: int | None,
        session_id: str | None = None,
        constraint: Constraint | None = None,
        whole: bool = False,
    ) -> AsyncGenerator[SampledToken, None]:
        if not prompt:
            raise EngineFailure("empty prompt")
        if len(prompt) >= self.context_length:
            raise ContextOverflow(
                f"the prompt has {len(prompt)} tokens; the context holds {self.context_length}", param="messages"
            )
        grammar = self.grammar_text(constraint) if constraint is not None else None
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[object] = asyncio.Queue()
        cancel = threading.Event()

        def emit(item: object) -> None:
            with contextlib.suppress(RuntimeError):  # the caller's event loop is closed: nobody listens
                loop.call_soon_threadsafe(queue.put_nowait, item)

        with self._counting:
            self.waiting += 1
        loop.run_in_executor(self._executor, self._run, list(prompt), params, seed, grammar, cancel, emit)
        try:
            while True:
                item = await queue.get()
                if item is _DONE:
                    break
                if isinstance(item, InvalidRequest):
                    raise item
                if isinstance(item, BaseException):
                    raise EngineFailure(f"the embedded engine failed: {item}") from item
                assert isinstance(item, SampledToken)
                # counted as it is handed over, as the remote engines count: a token the worker sampled
                # while this generation was being closed reaches nobody, so no tape is one short of it
                self.tokens_generated += 1
                yield item
        finally:
            cancel.set()  # the worker stops before its next token; the executor stays serial

    @staticmethod
    def grammar_text(constraint: Constraint) -> str:
        """The constraint as a llama.cpp grammar (JSON schemas through llama.cpp's own converter)."""
        if constraint.kind == "grammar":
            return constraint.value
        if constraint.kind == "json_schema":
            from llama_cpp.llama_grammar import json_schema_to_gbnf

            try:
                return str(json_schema_to_gbnf(constraint.value))
            except (ValueError, KeyError, TypeError, RecursionError) as exc:
                raise InvalidRequest(f"the JSON schema cannot be enforced: {exc}", param="response_format") from exc
        raise InvalidRequest(
            f"the embedded engine cannot constrain output by {constraint.kind.replace('_', ' ')}",
            param="response_format",
        )

    def _run(
        self,
        prompt: list[int],
        params: SamplingParams,
        seed: int | None,
        grammar: str | None,
        cancel: threading.Event,
        emit: Callable[[object], None],
    ) -> None:
        try:
            if not cancel.is_set():
                self._generate_blocking(prompt, params, seed, grammar, cancel, emit)
        except Exception as exc:  # reported to the waiting coroutine, never lost in the thread
            emit(exc)
        finally:
            emit(_DONE)
            with self._counting:  # counted here, not on the caller's loop, which may be gone by now
                self.waiting -= 1

    def _generate_blocking(
        self,
        prompt: list[int],
        params: SamplingParams,
        seed: int | None,
        grammar: str | None,
        cancel: threading.Event,
        emit: Callable[[object], None],
    ) -> None:
        llama = self._llama
        rng = np.random.default_rng(seed)
        stop_ids = self._end_of_turn | frozenset(params.stop_token_ids)
        room = self.context_length - len(prompt)
        limit = room if params.max_tokens is None else min(params.max_tokens, room)
        mode = logprob_mode(params, scaled=True)  # the sampler records logits / temperature, untruncated
        mask = _GrammarMask(self._lib, self._llama, grammar) if grammar is not None else None
        try:
            logits = self._prefill(prompt)
            for _ in range(limit):
                if cancel.is_set():
                    return
                if mask is not None:
                    logits = mask.apply(logits)
                    if not np.isfinite(logits).any():  # the grammar allows nothing more: a dead end
                        return
                token, logprob, top = sample_token(logits, params, rng)
                self.tokens_sampled += 1
                emit(SampledToken(token, logprob, tuple((t, lp) for t, lp in top if np.isfinite(lp)), mode))
                if token in stop_ids:
                    return
                if mask is not None:
                    mask.accept(token)
                llama.eval([token])
                logits = self._last_logits()
        finally:
            if mask is not None:
                mask.close()

    def _prefill(self, prompt: list[int]) -> np.ndarray:
        """Evaluate the prompt, reusing the KV cache for the prefix shared with the last call."""
        llama = self._llama
        cached = llama.input_ids[: llama.n_tokens]
        shared = 0
        for a, b in zip(cached, prompt, strict=False):
            if a != b:
                break
            shared += 1
        shared = min(shared, len(prompt) - 1)  # the last prompt token is always evaluated for its logits
        if shared > 0 and llama._ctx.kv_cache_seq_rm(-1, shared, -1):
            llama.n_tokens = shared
        else:
            llama.reset()  # type: ignore[no-untyped-call]
            shared = 0
        llama.eval(prompt[shared:])
        return self._last_logits()

    def _last_logits(self) -> np.ndarray:
        pointer = self._lib.llama_get_logits_ith(self._llama.ctx, -1)
        return np.ctypeslib.as_array(pointer, shape=(self._llama.n_vocab(),)).copy()

    def describe(self) -> dict[str, Any]:
        return {
            "kind": "llama.cpp",
            "model": self.model_id,
            "context_length": self.context_length,
            "flash_attention": self.settings.flash_attention,
            "waiting": self.waiting,
            "tokens_generated": self.tokens_generated,
            "tokens_sampled": self.tokens_sampled,
        }

    async def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
        self._llama.close()


class _GrammarMask:
    """llama.cpp's grammar sampler used as a mask only: it sets the logit of every token that would
    leave the grammar to -inf, and our own sampler draws from what is left (so the recorded logprob is
    the constrained distribution's). After the grammar is complete only end-of-turn tokens remain."""

    def __init__(self, lib: Any, llama: Any, grammar: str) -> None:
        self._lib = lib
        vocab = lib.llama_model_get_vocab(llama.model)
        self._sampler = lib.llama_sampler_init_grammar(vocab, grammar.encode(), b"root")
        if not self._sampler:
            raise InvalidRequest("the grammar does not parse", param="grammar")
        n_vocab = llama.n_vocab()
        self._data = (lib.llama_token_data * n_vocab)()
        self._view = np.ctypeslib.as_array(self._data)  # a structured view: id, logit, p
        self._ids = np.arange(n_vocab, dtype=np.int32)
        self._array = lib.llama_token_data_array(data=self._data, size=n_vocab, selected=-1, sorted=False)

    def apply(self, logits: np.ndarray) -> np.ndarray:
        self._view["id"] = self._ids
        self._view["logit"] = logits
        self._view["p"] = 0.0
        self._array.size = len(self._ids)
        self._array.selected = -1
        self._array.sorted = False
        self._lib.llama_sampler_apply(self._sampler, ctypes.byref(self._array))
        masked = np.full_like(logits, -np.inf)
        masked[self._view["id"]] = self._view["logit"]
        return masked

    def accept(self, token: int) -> None:
        self._lib.llama_sampler_accept(self._sampler, token)

    def close(self) -> None:
        self._lib.llama_sampler_free(self._sampler)
