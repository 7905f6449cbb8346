"""An independent computation of what the engine should report: a cold llama.cpp context loaded
with `lora_path=` (llama-cpp-python's own adapter path), fed the same tokens in the same batches."""

from __future__ import annotations

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
        rng = np.random.default_rng(0)
        llama.eval(list(prompt))
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
    finally:
        llama.close()
