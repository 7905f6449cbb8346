"""GPT-2's byte-level alphabet: each byte spelled as a printable character in byte-level vocabularies."""

from __future__ import annotations

import functools

__all__ = ["byte_decoder"]


@functools.cache
def byte_decoder() -> dict[str, int]:
    """GPT-2's byte <-> printable-character table, inverted (what ByteLevel decoding undoes)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}
