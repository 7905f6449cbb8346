"""A test mode of the embedded engine that changes what the model samples from run to run, so that
a test resting on one particular sample goes red on the developer's machine, not only on a machine
whose CPU or llama.cpp build rounds differently. Never on by default.

`TOKENTAPE_SAMPLING_SALT=<integer>` turns it on:

- every seed is mixed with the salt: a seeded request draws another stream in every run, and the
  same stream for the same seed within a run (replays, n > 1 choices and retries stay consistent);
- greedy decoding argmaxes over the logits plus a per-run jitter vector (uniform in +-`scale` nats,
  one value per token, `TOKENTAPE_SAMPLING_JITTER`, default `DEFAULT_JITTER`), and the logprob it
  records is that of the same jittered row: what was sampled is still what the record says.

The salt is printed by the test suite at its start; setting it again reproduces a run.
"""

from __future__ import annotations

import functools
import hashlib
import os

import numpy as np
import numpy.typing as npt

__all__ = ["SALT_ENV", "JITTER_ENV", "DEFAULT_JITTER", "current", "salted_seed", "greedy_jitter"]

SALT_ENV = "TOKENTAPE_SAMPLING_SALT"
JITTER_ENV = "TOKENTAPE_SAMPLING_JITTER"
# Nats. Two builds of llama.cpp (or two batch compositions) move Q4 logits by ~1e-3..1e-2: a jitter of
# this size flips the greedy choice wherever the top two tokens are that close, as another machine would.
DEFAULT_JITTER = 0.05


def current() -> int | None:
    """The run's salt, or None when the mode is off."""
    return _parse(os.environ.get(SALT_ENV, ""))


@functools.cache
def _parse(value: str) -> int | None:
    value = value.strip()
    if not value:
        return None
    try:
        return int(value)
    except ValueError as exc:
        raise ValueError(f"{SALT_ENV} must be an integer, got {value!r}") from exc


def salted_seed(seed: int | None) -> int | None:
    """`seed` mixed with the run's salt (unchanged when the mode is off; None stays None: unseeded)."""
    salt = current()
    if salt is None or seed is None:
        return seed
    digest = hashlib.blake2b(f"{salt}:{seed}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def greedy_jitter(vocab_size: int) -> npt.NDArray[np.float64] | None:
    """The run's jitter over a vocabulary of `vocab_size` tokens, or None when the mode is off."""
    salt = current()
    if salt is None:
        return None
    return _jitter(salt, vocab_size, float(os.environ.get(JITTER_ENV, DEFAULT_JITTER)))


@functools.cache
def _jitter(salt: int, vocab_size: int, scale: float) -> npt.NDArray[np.float64]:
    values = np.random.default_rng(abs(salt)).uniform(-scale, scale, vocab_size)
    values.flags.writeable = False
    return values
