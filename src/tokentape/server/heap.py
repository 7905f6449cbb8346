"""Garbage collection and malloc in a process that serves the gateway.

CPython's cycle collector walks every tracked object of a generation each time it runs. A serving
process holds a few hundred thousand objects that live as long as it does (the modules, the chat
template and tokenizer, pydantic's schemas, the sessions reloaded at start) and, under load, many
requests' objects young enough to reach the older generations: with the default thresholds a
full collection came every ~850 requests at 64 concurrent sessions and took 15-200 ms each, with
the event loop stopped. The request path makes no reference cycles (the collections of a run of
chat turns free nothing), and neither do session trees (turns link to their parent only), so what
a request or a finished session held goes back by reference counting and the collector has little
to do but walk:

- what the process holds once it serves is frozen (`gc.freeze`): never walked again; reference
  counting still frees it when it goes;
- the young generation is collected after 50,000 net allocations instead of 700, the older ones
  after 20 collections of the one below instead of 10;
- glibc's malloc serves every block of 1 MB or more with a mapping of its own, given back to the
  system when it is freed. By default it does so from 128 KB, but each time such a block is freed it
  raises that size to the block's (up to 32 MB): a request's few-MB body is then carved from the heap,
  where much of what is freed stays in the process. Twenty 8 MB template values (64 MB held by the
  budget) grew the resident set by 90-114 MB from run to run; with the size fixed, by 74 MB each time.

Only for a process that is a server; a library embedding the gateway leaves its host's collector and
allocator alone.
"""

from __future__ import annotations

import ctypes
import gc
import sys

__all__ = ["MMAP_THRESHOLD", "SERVING_THRESHOLDS", "settle_for_serving"]

SERVING_THRESHOLDS = (50_000, 20, 20)
MMAP_THRESHOLD = 1 << 20
_M_MMAP_THRESHOLD = -3  # mallopt's parameter (glibc's malloc.h)


def settle_for_serving() -> None:
    """Freeze what the process holds now and make the collector run less often. Call once, when the
    process is about to serve (everything it keeps for its lifetime is loaded)."""
    gc.collect()  # what is garbage now is not frozen
    gc.freeze()
    gc.set_threshold(*SERVING_THRESHOLDS)
    _fix_mmap_threshold()


def _fix_mmap_threshold() -> None:
    """Where the C library is glibc (or has its `mallopt`), large blocks are mapped from a fixed size."""
    if not sys.platform.startswith("linux"):
        return
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library the process already loaded
    except (OSError, AttributeError):
        return
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
