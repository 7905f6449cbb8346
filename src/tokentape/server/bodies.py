"""Reading a request's JSON body: the one parser of every route that takes an object (generation,
sessions, admin), with the same 400s everywhere."""

from __future__ import annotations

from typing import Any

import orjson
from starlette.requests import Request

from tokentape.errors import InvalidRequest

__all__ = ["json_object"]


async def json_object(request: Request, *, optional: bool = False) -> dict[str, Any]:
    body = await request.body()
    if not body.strip():
        if optional:
            return {}
        raise InvalidRequest("the request body is empty; send a JSON object")
    try:
        data = orjson.loads(body)  # rejects lone surrogates, which would break templates later
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"the request body is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise InvalidRequest("the request body must be a JSON object")
    return data
