"""Cutting a sequence at arbitrary points: how streamed bytes and text deltas arrive."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

S = TypeVar("S", str, bytes)


def split_at(whole: S, cuts: Sequence[int]) -> list[S]:
    """`whole` in pieces, cut at each of `cuts` (taken modulo its length + 1); the pieces join back."""
    points = sorted({c % (len(whole) + 1) for c in cuts})
    pieces, last = [], 0
    for point in points:
        pieces.append(whole[last:point])
        last = point
    return [*pieces, whole[last:]]
