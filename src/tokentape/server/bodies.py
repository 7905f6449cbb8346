"""Reading a request's JSON body: the one parser of every route that takes an object (generation,
sessions, admin), with the same 400s everywhere."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson
from starlette.requests import Request

from tokentape.errors import InvalidRequest

__all__ = ["MAX_DEPTH", "json_object"]

# How deep a body may nest: far past any tool schema or content list, and short of where the steps
# that walk a request recursively (digests, templates, transformers' renderer) would run out of stack
# at about a thousand levels, which orjson still parses.
MAX_DEPTH = 128


async def json_object(
    request: Request,
    *,
    optional: bool = False,
    parse: Callable[[bytes], Any] = orjson.loads,
    first: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """The body as a JSON object. `parse`: orjson's, or one that raises as it does (`Reparser`).
    `first`: a refusal read from the top-level keys alone, raised before the body is walked, so that
    a body refused by it costs its parse and no walk of what it carries (its errors then come first)."""
    body = await request.body()
    if not body.strip():
        if optional:
            return {}
        raise InvalidRequest("the request body is empty; send a JSON object")
    try:
        data = parse(body)  # rejects lone surrogates, which would break templates later
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"the request body is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise InvalidRequest("the request body must be a JSON object")
    if first is not None:
        first(data)
    if _deeper_than(data, MAX_DEPTH):
        raise InvalidRequest(f"the request body nests deeper than {MAX_DEPTH} levels")
    return data


def _deeper_than(data: dict[str, Any], limit: int) -> bool:
    """Whether objects and arrays nest more than `limit` deep (the body itself is level 1); a walk
    with a stack of its own, so no depth can exhaust this one (about 20 us for a 70 KB agent body)."""
    stack: list[tuple[Any, int]] = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > limit:
            return True
        for child in value.values() if type(value) is dict else value:
            if type(child) is dict or type(child) is list:
                stack.append((child, depth + 1))
    return False
