"""llama-cpp-python, imported once with OpenMP told how long to spin.

ggml's CPU threads meet at an OpenMP barrier after every operation of a step. libgomp's threads
spin there (300,000 rounds by default) before they sleep: on a machine where anything else runs (the
gateway's own event loop, an agent, a test runner), a spinning thread holds the core the thread it
waits for needs, and a step that takes 15 ms alone took seconds (measured: llama-server at 2 threads on
2 busy cores, 8 tokens/s; with threads that sleep at once, 56). libgomp reads its settings when it is
loaded, so they are set for that moment only, and only where the operator has set none.
"""

from __future__ import annotations

import os
from types import ModuleType

__all__ = ["OPENMP_SPIN", "llama_cpp"]

# rounds a thread spins at a barrier before it sleeps: long enough to cover a balanced barrier on an
# idle machine, short enough that a thread waiting for a descheduled one yields within microseconds
OPENMP_SPIN = "10000"
_SETTINGS = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")


def llama_cpp() -> ModuleType:
    """The `llama_cpp` module, its OpenMP runtime loaded with `OPENMP_SPIN` unless the environment
    already says how to wait."""
    import sys

    if "llama_cpp" in sys.modules:
        return sys.modules["llama_cpp"]
    chosen = any(name in os.environ for name in _SETTINGS)
    if not chosen:
        os.environ["GOMP_SPINCOUNT"] = OPENMP_SPIN
    try:
        import llama_cpp as module
    finally:
        if not chosen:  # other OpenMP runtimes loaded later (torch's own) keep their defaults
            del os.environ["GOMP_SPINCOUNT"]
    return module
