"""An independent computation of what the engine should report: a cold llama.cpp context loaded
with `lora_path=` (llama-cpp-python's own adapter path), fed the same tokens in the same batches."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from pathlib import Path

import llama_cpp
import numpy as np

from tokentape.core.sampling import SamplingParams
from tokentape.engines.llamacpp import default_threads
from tokentape.engines.sampler import sample_token

GREEDY = SamplingParams(temperature=0.0)


def cold_greedy(
    model: Path, prompt: Sequence[int], count: int, *, lora: Path | None = None, stop: frozenset[int] = frozenset()
) -> tuple[list[int], list[float]]:
    """`count` greedy tokens after `prompt` (fewer at a token in `stop`) and their logprobs."""
    threads = default_threads()
    llama = llama_cpp.Llama(
        str(model),
        n_ctx=1024,
        n_threads=threads,
        n_threads_batch=threads,
        n_batch=512,
        lora_path=None if lora is None else str(lora),
        verbose=False,
    )
    try:
        llama.eval(list(prompt))
        return _decode(llama, count, stop)
    finally:
        llama.close()


def _decode(llama: llama_cpp.Llama, count: int, stop: frozenset[int] = frozenset()) -> tuple[list[int], list[float]]:
    """`count` greedy tokens from the context's last logits on (fewer at a token in `stop`)."""
    rng = np.random.default_rng(0)
    tokens: list[int] = []
    logprobs: list[float] = []
    for _ in range(count):
        pointer = llama_cpp.llama_get_logits_ith(llama.ctx, -1)
        logits = np.ctypeslib.as_array(pointer, shape=(llama.n_vocab(),)).copy()
        token, logprob, _ = sample_token(logits, GREEDY, rng)
        tokens.append(token)
        logprobs.append(logprob)
        if token in stop:
            break
        llama.eval([token])
    return tokens, logprobs


def cold_greedy_kept(
    model: Path, prompt: Sequence[int], sampled: Sequence[int], lora: Path, count: int
) -> tuple[list[int], list[float]]:
    """Greedy tokens after `prompt` + `sampled` when the KV of all but the last sampled token was
    computed by the base model, as the engine computed it (the prompt in one batch, then token by
    token), and the adapter came in after (an update under keep): the adapter is set on that context,
    the last sampled token evaluated under it, and decoding goes on."""
    threads = default_threads()
    llama = llama_cpp.Llama(
        str(model), n_ctx=1024, n_threads=threads, n_threads_batch=threads, n_batch=512, verbose=False
    )
    adapter = llama_cpp.llama_adapter_lora_init(llama.model, str(lora).encode())
    try:
        llama.eval(list(prompt))
        for token in sampled[:-1]:
            llama.eval([token])
        adapters = (llama_cpp.llama_adapter_lora_p_ctypes * 1)(adapter)
        scales = (ctypes.c_float * 1)(1.0)
        assert llama_cpp.llama_set_adapters_lora(llama.ctx, adapters, 1, scales) == 0
        llama.eval([sampled[-1]])
        return _decode(llama, count)
    finally:
        llama_cpp.llama_set_adapters_lora(llama.ctx, None, 0, None)
        llama_cpp.llama_adapter_lora_free(adapter)
        llama.close()
