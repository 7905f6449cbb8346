"""One generation the batching worker runs (`engines.batching`): its tokens, its sampling state and
where it stands in the KV cache, and what its listener is told."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tokentape.core.sampling import SamplingParams
from tokentape.engines.base import LogprobMode
from tokentape.engines.sampler import LogitShaper

__all__ = ["DONE", "Generation", "WorkerFault"]

DONE = object()  # the last item a generation's listener gets


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
