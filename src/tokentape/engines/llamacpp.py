"""The embedded engine: llama.cpp on the CPU through llama-cpp-python, driven token by token.

Generations are decoded together (continuous batching, `engines.batching`): up to `parallel` of them
per llama.cpp batch on one worker thread, so the event loop stays free and every generation has its
own sequence in a KV cache they share. Prompts are given as token IDs; a KV slot per session keeps
its prefix between turns, so a session's next turn prefills only its new tokens (`engines.slots`).
Sampling is done here, in numpy, not by llama.cpp's sampler, so that the recorded logprob is the one
the token was drawn from, for that generation's row of logits.

Its weights change under a live gateway (the `engines.weights` seam): a LoRA adapter in GGUF form is
swapped onto the loaded base model (a new adapter object per update, set on the context before the
old one is freed; no reload), or a whole GGUF of the same architecture and vocabulary replaces the
model. Every step runs on the worker thread once the generations queued before it have ended, so no
generation ever sees half an update. Each slot remembers the weights version that computed its KV,
which is reused only under the same version (unless the update asked to keep the old KV).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import threading
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tokentape.core.sampling import SamplingParams
from tokentape.engines import sampling_salt
from tokentape.engines.base import Constraint, SampledToken, logprob_mode
from tokentape.engines.batching import Batcher
from tokentape.engines.generation import DONE, Generation
from tokentape.engines.llama_context import Native, NativeSettings
from tokentape.engines.sampler import LogitShaper
from tokentape.engines.threads import ThreadTuner
from tokentape.engines.weights import InFlight, WeightSource, WeightUpdateFailed, WeightUpdateRefused
from tokentape.errors import ContextOverflow, EngineFailure, InvalidRequest, Overloaded
from tokentape.formats.gbnf import check_grammar, schema_grammar
from tokentape.formats.gguf import FLOAT_TYPES, GGUFHeader, read_header

__all__ = ["DEFAULT_PARALLEL", "LlamaCppEngine", "LlamaCppSettings", "all_threads", "default_threads"]

# Sequences decoded together. On a CPU a step's cost grows with the batch far slower than linearly
# (the weights are read once per step), up to where the matmuls become compute-bound.
DEFAULT_PARALLEL = 16
_MAX_SEQUENCES = 256  # llama.cpp's LLAMA_MAX_SEQ: KV slots, running or cached
# A caller that has heard nothing for this long checks that the worker still lives (and starts it again
# if not): a generation is never waited on forever.
_WORKER_CHECK_SECONDS = 5.0


def default_threads() -> int:
    # ggml's threads wait for each other after every operation: using every core next to any other
    # busy process (the agent, a test runner) slows generation several times over. Start with one
    # core free; with threads=0 the engine also tries every core and keeps what runs faster (`threads`).
    return max(1, (os.cpu_count() or 2) - 1)


def all_threads() -> int:
    """Every core: for a phase in which nothing else in the process competes for them."""
    return max(1, os.cpu_count() or 1)


def default_cache_tokens(context_length: int, parallel: int) -> int:
    """KV cells shared by every slot: room for one full context, or for `parallel` sessions of 1k
    tokens each, up to four contexts' worth (the memory of four single-sequence contexts)."""
    return max(context_length, min(4 * context_length, parallel * 1024))


@dataclass(frozen=True, slots=True)
class LlamaCppSettings:
    model_path: Path
    context_length: int = 8192  # per sequence: prompt + generation
    threads: int = 0  # 0: default_threads(), or every core while that runs faster (engines.threads)
    batch_size: int = 512
    # Flash attention; None: on, unless the KV cache is F32. Off, llama.cpp attends every sequence over
    # every cell up to the highest one in use, so the KV that slots keep for sessions' next turns slows
    # every step (a token took 11 ms beside no such cells, 70 ms beside 15k of them); on, a sequence
    # skips the cells it does not see. Its CPU kernels round to F16 in places: on an F16 cache that is
    # the size of what F16 costs already, but on an F32 cache (a trainer's ratios) it moved logprobs by
    # 1e-3 nats where the plain path agrees with an F32 torch forward to 1e-5.
    flash_attention: bool | None = None
    # An F32 KV cache (llama.cpp's default is F16): with F32 weights, logprobs then agree with an F32
    # torch forward to ~1e-5 nats instead of ~2e-3 (a trainer's importance ratios need that)
    kv_cache_f32: bool = False
    parallel: int = 0  # generations decoded together; 0: DEFAULT_PARALLEL
    cache_tokens: int = 0  # KV cells shared by all sequences; 0: default_cache_tokens()
    # Idle sessions' KV held in host memory while a long prompt is read (`engines.batching`), in
    # tokens (23 KB each for the shipped model); None: as many as the cache holds; 0: it stays in the cache
    stored_tokens: int | None = None


class LlamaCppEngine:
    """A GGUF model in-process. `generate` is safe to call from many tasks at once."""

    def __init__(self, settings: LlamaCppSettings) -> None:
        from tokentape.native import llama_cpp as load

        llama_cpp = self._lib = load()
        self.settings = settings
        self.parallel = settings.parallel or DEFAULT_PARALLEL
        self.context_length = settings.context_length
        self.cache_tokens = settings.cache_tokens or default_cache_tokens(settings.context_length, self.parallel)
        if self.parallel < 1 or self.cache_tokens < self.context_length:
            raise ValueError("parallel must be >= 1 and the KV cache must hold at least one context")
        # KV slots, running or cached for a session's next turn. parallel 1 keeps one slot: the engine
        # as it was before batching, one cached prefix whose cells always start at the cache's first,
        # so its logprobs are bit for bit those of a context of its own.
        self._sequences = 1 if self.parallel == 1 else min(_MAX_SEQUENCES, max(4 * self.parallel, 32))
        self.threads = settings.threads or default_threads()
        self.flash_attention = (
            not settings.kv_cache_f32 if settings.flash_attention is None else settings.flash_attention
        )
        native = self._open(settings.model_path)
        vocab = llama_cpp.llama_model_get_vocab(native.model)
        self.vocab_size: int = native.n_vocab
        self._end_of_turn = frozenset(t for t in range(native.n_vocab) if llama_cpp.llama_vocab_is_eog(vocab, t))
        self.model_id = settings.model_path.stem
        # the weights: the model file loaded, the adapter set on it (if any), and their version
        self.model_path = settings.model_path
        self.adapter_path: Path | None = None
        self._adapter: Any = None  # llama_adapter_lora_p
        self._probe_ctx: Any = None  # llama_context_p of the loaded model, for probe_weights
        self.weights_version = 0
        self._model_header: GGUFHeader | None = None  # read on the first check
        self.swap_seconds: float | None = None  # how long the last load took
        self.waiting = 0  # generations queued or running
        self._counting = threading.Lock()
        self.tokens_generated = 0  # every token handed over since start, aborted generations included
        tuned = not settings.threads and all_threads() > self.threads
        self._batcher = Batcher(
            native,
            parallel=self.parallel,
            sequences=self._sequences,
            threads=self.threads,
            tuner=ThreadTuner(self.threads, all_threads()) if tuned else None,
            make_mask=lambda n, grammar: _GrammarMask(self._lib, n, grammar),
            on_finish=self._finished,
            stored_tokens=self.cache_tokens if settings.stored_tokens is None else settings.stored_tokens,
        )

    @property
    def tokens_sampled(self) -> int:
        """Every token the worker sampled, also one sampled as its generation closed."""
        return self._batcher.tokens_sampled

    def _open(self, path: Path) -> Native:
        settings = NativeSettings(
            threads=self.threads,
            batch_size=self.settings.batch_size,
            cache_tokens=self.cache_tokens,
            sequences=self._sequences,
            flash_attention=self.flash_attention,
            kv_cache_f32=self.settings.kv_cache_f32,
        )
        return Native(self._lib, path, settings)

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
        outside = params.token_ids_outside(self.vocab_size)  # the gateway refuses these; direct callers too
        if outside is not None:
            field, token = outside
            raise InvalidRequest(f"{field} names token {token}, outside the vocabulary", param=field)
        grammar = self.grammar_text(constraint) if constraint is not None else None
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[object] = asyncio.Queue()
        cancel = threading.Event()

        def emit(item: object) -> None:
            with contextlib.suppress(RuntimeError):  # the caller's event loop is closed: nobody listens
                loop.call_soon_threadsafe(queue.put_nowait, item)

        room = self.context_length - len(prompt)
        generation = Generation(
            tokens=list(prompt),
            params=params,
            rng=np.random.default_rng(sampling_salt.salted_seed(seed)),
            session=session_id,
            grammar=grammar,
            cancel=cancel,
            emit=emit,
            stop_ids=self._end_of_turn | frozenset(params.stop_token_ids),
            limit=room if params.max_tokens is None else min(params.max_tokens, room),
            mode=logprob_mode(params, scaled=True),  # the sampler records logits / temperature, untruncated
            shaper=LogitShaper(params, prompt, self.vocab_size) if LogitShaper.needed(params) else None,
        )
        with self._counting:
            self.waiting += 1
        self._batcher.submit(generation)
        try:
            while True:
                try:
                    async with asyncio.timeout(_WORKER_CHECK_SECONDS):
                        item = await queue.get()
                except TimeoutError:
                    self._batcher.ensure_alive()  # a revived worker fails what the dead one held
                    continue
                if item is DONE:
                    break
                if isinstance(item, (InvalidRequest, Overloaded)):  # the request's own (its grammar), not the engine's
                    raise item
                if isinstance(item, BaseException):
                    raise EngineFailure(f"the embedded engine failed: {item}") from item
                assert isinstance(item, SampledToken)
                # counted as it is handed over, as the remote engines count: a token the worker sampled
                # while this generation was being closed reaches nobody, so no tape is one short of it
                self.tokens_generated += 1
                yield item
        finally:
            cancel.set()  # the worker drops it before its next step

    def _finished(self, generation: Generation) -> None:
        generation.emit(DONE)
        with self._counting:  # counted here, not on the caller's loop, which may be gone by now
            self.waiting -= 1

    async def _on_worker(self, run: Callable[[], Any]) -> Any:
        """Run `run` on the worker thread once every generation submitted before it has ended."""
        return await asyncio.wrap_future(self._batcher.call(run))

    def set_threads(self, threads: int) -> None:
        """Threads for the steps from the next one on (e.g. every core while nothing else computes)."""
        self.threads = max(1, threads)
        self._batcher.request_threads(self.threads)

    @staticmethod
    def grammar_text(constraint: Constraint) -> str:
        """The constraint as a llama.cpp grammar (JSON schemas through llama.cpp's own converter)."""
        if constraint.kind == "grammar":
            try:  # built by the gateway from schemas already checked; a direct caller's is checked here
                check_grammar(constraint.value)
            except ValueError as exc:
                raise InvalidRequest(f"the grammar cannot be enforced: {exc}", param="tools") from exc
            return constraint.value
        if constraint.kind == "json_schema":
            try:
                return schema_grammar({"": json.loads(constraint.value)})
            except (ValueError, KeyError, TypeError, RecursionError) as exc:
                raise InvalidRequest(f"the JSON schema cannot be enforced: {exc}", param="response_format") from exc
        raise InvalidRequest(
            f"the embedded engine cannot constrain output by {constraint.kind.replace('_', ' ')}",
            param="response_format",
        )

    def describe(self) -> dict[str, Any]:
        batcher = self._batcher
        return {
            "kind": "llama.cpp",
            "model": self.model_id,
            "context_length": self.context_length,
            "flash_attention": self.flash_attention,
            "parallel": self.parallel,
            "cache_tokens": self.cache_tokens,
            "threads": self._batcher.threads,  # what the last step ran with
            "threads_tuned": None
            if self._batcher.tuner is None
            else [self._batcher.tuner.low, self._batcher.tuner.high],
            "waiting": self.waiting,
            "running": len(batcher.active),
            "tokens_generated": self.tokens_generated,
            "tokens_sampled": self.tokens_sampled,
            # prompt tokens of every generation, and how many of them a cached slot spared computing
            "prompt_tokens": batcher.prompt_tokens,
            "prefill_tokens_saved": batcher.prefill_tokens_saved,
            "steps": batcher.steps,
            "mean_batch": round(batcher.batched_sequences / batcher.steps, 2) if batcher.steps else 0.0,
            "preempted": batcher.preempted,
            # idle sessions' KV moved to host memory while a long prompt was read, and put back
            "kv_offloaded": batcher.offloaded,
            "kv_restored": batcher.restored,
            "worker_faults": batcher.faults,
            "worker_restarts": batcher.restarts,
            "weights_version": self.weights_version,
            "adapter": None if self.adapter_path is None else str(self.adapter_path),
            "model_file": str(self.model_path),
        }

    # -- weight updates (engines.weights.UpdatableEngine) -----------------------------------------------
    _ADAPTER_KEYS = frozenset({"general.architecture", "general.type", "adapter.type", "adapter.lora.alpha"})
    _MODEL_KEYS = frozenset({"general.architecture", "general.type", "tokenizer.ggml.tokens"})

    async def check_weights(self, source: WeightSource, in_flight: InFlight) -> None:
        """Refuse, naming the problem, what this engine cannot load; reads headers only."""
        if source.kind == "engine_managed":
            raise WeightUpdateRefused("the embedded engine loads its weights itself: send a lora or a model path")
        if source.path is None:
            raise WeightUpdateRefused(f"a {source.kind} update needs a path")
        path = Path(source.path)
        if not path.is_file():
            raise WeightUpdateRefused(f"{path} does not exist or is not a file")
        await asyncio.to_thread(self._check_file, path, source.kind)

    def _base_header(self) -> GGUFHeader:
        if self._model_header is None:
            self._model_header = read_header(self.model_path, self._MODEL_KEYS)
        return self._model_header

    def _check_file(self, path: Path, kind: str) -> None:
        base = self._base_header()
        architecture = base.metadata.get("general.architecture")
        try:
            header = read_header(path, self._ADAPTER_KEYS | self._MODEL_KEYS)
        except (ValueError, OSError) as exc:
            raise WeightUpdateRefused(str(exc)) from exc
        meta = header.metadata
        if meta.get("general.architecture") != architecture:
            raise WeightUpdateRefused(
                f"{path} is for architecture {meta.get('general.architecture')!r}; the model is {architecture!r}"
            )
        if kind == "lora":
            if meta.get("general.type") != "adapter" or meta.get("adapter.type") != "lora":
                raise WeightUpdateRefused(f"{path} is not a LoRA adapter (general.type = adapter, adapter.type = lora)")
            _check_adapter_tensors(path, header, base)
            return
        if meta.get("general.type", "model") != "model":
            raise WeightUpdateRefused(f"{path} is not a model (general.type = {meta.get('general.type')!r})")
        if meta.get("tokenizer.ggml.tokens") != base.metadata.get("tokenizer.ggml.tokens"):
            raise WeightUpdateRefused(f"{path} has another vocabulary than the loaded model")

    @property
    def start_source(self) -> WeightSource:
        """The weights it started with, for a rollback to version 0."""
        return WeightSource("model", str(self.settings.model_path))

    async def pause_generation(self, in_flight: InFlight) -> None:
        """The gateway has closed every running generation; wait until the worker has dropped them
        (a command runs once every generation submitted before it has ended)."""
        await self._on_worker(lambda: None)

    async def load_weights(self, source: WeightSource, version: int) -> None:
        await self._on_worker(lambda: self._load_blocking(source, version))

    async def resume_generation(self, *, fresh_kv: bool) -> None:
        # keep: the prefixes the old weights computed may be reused under the new ones; else they go
        await self._on_worker(self._batcher.drop_stale if fresh_kv else self._batcher.adopt_cache)

    async def probe_weights(self) -> None:
        """One forward pass of the loaded weights on a scratch context (the model and the adapter the
        main context uses), so that the main context's cached prefixes survive for `keep`."""
        await self._on_worker(self._probe_blocking)

    def _probe_blocking(self) -> None:
        lib = self._lib
        ctx = self._probe_context()
        lib.llama_set_n_threads(ctx, self.threads, self.threads)
        lib.llama_memory_clear(lib.llama_get_memory(ctx), True)  # the last probe's token
        try:
            if self._adapter:
                adapters = (lib.llama_adapter_lora_p_ctypes * 1)(self._adapter)
                if lib.llama_set_adapters_lora(ctx, adapters, 1, (ctypes.c_float * 1)(1.0)) != 0:
                    raise WeightUpdateFailed("llama.cpp could not set the adapter on the probe's context")
            token = (lib.llama_token * 1)(min(self._end_of_turn))
            if lib.llama_decode(ctx, lib.llama_batch_get_one(token, 1)) != 0:
                raise WeightUpdateFailed("llama.cpp could not run the probe")
            pointer = lib.llama_get_logits_ith(ctx, -1)
            logits = np.ctypeslib.as_array(pointer, shape=(self.vocab_size,))
            if not np.isfinite(logits).all():
                raise WeightUpdateFailed("the new weights give logits that are not finite")
        finally:  # between probes it refers to no adapter: the next update frees this one
            lib.llama_set_adapters_lora(ctx, None, 0, None)

    def _probe_context(self) -> Any:
        """The scratch context of the loaded model, made on its first probe and kept for the next ones
        (making one cost about as much CPU as the forward pass itself)."""
        if self._probe_ctx is None:
            lib = self._lib
            params = lib.llama_context_default_params()
            params.n_ctx = params.n_batch = params.n_ubatch = 8
            params.n_threads = params.n_threads_batch = self.threads
            ctx = lib.llama_init_from_model(self._batcher.native.model, params)
            if not ctx:
                raise WeightUpdateFailed("llama.cpp could not create a context for the probe")
            self._probe_ctx = ctx
        return self._probe_ctx

    def _free_probe_context(self) -> None:
        if self._probe_ctx is not None:
            self._lib.llama_free(self._probe_ctx)
            self._probe_ctx = None

    def _load_blocking(self, source: WeightSource, version: int) -> None:
        started = time.perf_counter()
        assert source.path is not None  # checked
        path = Path(source.path)
        if source.kind == "lora":
            self._swap_adapter(path)
        elif source.kind == "model":
            self._swap_model(path)
        else:
            raise WeightUpdateFailed(f"the embedded engine cannot load {source.kind} weights")
        self.weights_version = self._batcher.version = version
        self.swap_seconds = time.perf_counter() - started

    def _swap_adapter(self, path: Path) -> None:
        lib, native = self._lib, self._batcher.native
        adapter = lib.llama_adapter_lora_init(native.model, str(path).encode())
        if not adapter:
            raise WeightUpdateFailed(f"llama.cpp could not load the adapter {path}")
        adapters = (lib.llama_adapter_lora_p_ctypes * 1)(adapter)
        scales = (ctypes.c_float * 1)(1.0)
        if lib.llama_set_adapters_lora(native.ctx, adapters, 1, scales) != 0:
            lib.llama_adapter_lora_free(adapter)
            raise WeightUpdateFailed(f"llama.cpp could not set the adapter {path} on the context")
        old, self._adapter, self.adapter_path = self._adapter, adapter, path
        if old:  # the context no longer refers to it
            lib.llama_adapter_lora_free(old)

    def _swap_model(self, path: Path) -> None:
        try:
            native = self._open(path)
        except (ValueError, RuntimeError, OSError) as exc:
            raise WeightUpdateFailed(f"llama.cpp could not load the model {path}: {exc}") from exc
        if native.n_vocab != self.vocab_size:
            native.close()
            raise WeightUpdateFailed(f"{path} loaded with another vocabulary size")
        self._free_probe_context()  # made on the old model, freed before it
        old, self._batcher.native = self._batcher.native, native
        self._batcher.threads = self.threads  # what the new context was made with
        self._batcher.reset_slots()  # the new context's cache is empty
        self._free_adapter()  # belongs to the old model, freed before it
        self._batcher.when_grammars_done(old.close)  # a failed generation's grammar may still read it
        self.model_path, self._model_header = path, None

    def _free_adapter(self) -> None:
        if self._adapter:
            self._lib.llama_adapter_lora_free(self._adapter)
        self._adapter, self.adapter_path = None, None

    async def close(self) -> None:
        await asyncio.to_thread(self._batcher.close)
        self._free_probe_context()
        self._free_adapter()
        self._batcher.when_grammars_done(self._batcher.native.close)


def _check_adapter_tensors(path: Path, adapter: GGUFHeader, base: GGUFHeader) -> None:
    """Every factor pair names a tensor of the model and fits it: A is [in, r], B is [r, out]."""
    pairs: dict[str, dict[str, Any]] = {}
    for name, info in adapter.tensors.items():
        target, _, part = name.rpartition(".")
        if part not in ("lora_a", "lora_b"):
            raise WeightUpdateRefused(f"{path}: tensor {name} is not a LoRA factor (.lora_a / .lora_b)")
        if info.type not in FLOAT_TYPES:
            raise WeightUpdateRefused(f"{path}: tensor {name} has ggml type {info.type}; F32, F16 or BF16 expected")
        pairs.setdefault(target, {})[part] = info
    if not pairs:
        raise WeightUpdateRefused(f"{path} holds no LoRA tensors")
    for target, factors in pairs.items():
        weight = base.tensors.get(target)
        if weight is None:
            raise WeightUpdateRefused(f"{path}: the model has no tensor {target}")
        a, b = factors.get("lora_a"), factors.get("lora_b")
        if a is None or b is None:
            raise WeightUpdateRefused(f"{path}: {target} needs both lora_a and lora_b")
        if len(a.shape) != 2 or len(b.shape) != 2 or a.shape[1] != b.shape[0]:
            raise WeightUpdateRefused(f"{path}: {target}'s factors {a.shape} and {b.shape} do not multiply")
        if a.shape[0] != weight.shape[0] or b.shape[1] != weight.shape[1]:
            raise WeightUpdateRefused(
                f"{path}: {target}'s factors {a.shape} x {b.shape} do not fit its shape {weight.shape}"
            )


class _GrammarMask:
    """llama.cpp's grammar sampler used as a mask only: it sets the logit of every token that would
    leave the grammar to -inf, and our own sampler draws from what is left (so the recorded logprob is
    the constrained distribution's). After the grammar is complete only end-of-turn tokens remain."""

    def __init__(self, lib: Any, native: Native, grammar: str) -> None:
        self._lib = lib
        vocab = lib.llama_model_get_vocab(native.model)
        self._sampler = lib.llama_sampler_init_grammar(vocab, grammar.encode(), b"root")
        if not self._sampler:
            raise InvalidRequest("the grammar does not parse", param="grammar")
        self._data = (lib.llama_token_data * native.n_vocab)()
        self._view = np.ctypeslib.as_array(self._data)  # a structured view: id, logit, p
        self._ids = np.arange(native.n_vocab, dtype=np.int32)
        self._array = lib.llama_token_data_array(data=self._data, size=native.n_vocab, selected=-1, sorted=False)

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
