"""Histories in every shape each generation route takes, sent as an agent resends them, with a check
that no route changes in place the parsed elements that a session's later parses share
(`server/reparse.py`)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import orjson
import pytest

from tokentape.server.reparse import Reparser

PIXEL_PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR4nGNgYGD4DwABBAEAwS2OUAAAAABJRU5ErkJggg=="


def _bash_call(i: int) -> dict[str, Any]:
    arguments = json.dumps({"command": f"cat file_{i}.py"})
    call = {"id": f"call_{i}", "type": "function", "function": {"name": "bash", "arguments": arguments}}
    return {"role": "assistant", "content": None, "tool_calls": [call]}


def rich_histories(image: str = PIXEL_PNG) -> dict[str, tuple[str, dict[str, Any], list[list[Any]]]]:
    """By route (under a session's base URL): the history field, the body's other fields, and what
    each of three calls appends to the history: text parts, tool calls and their results, content
    blocks, an image (base64 PNG `image`), each route's own item kinds."""
    url = f"data:image/png;base64,{image}"
    chat = [
        [
            {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
            {"role": "user", "content": [{"type": "text", "text": "List "}, {"type": "text", "text": "files."}]},
        ],
        [_bash_call(1), {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "a.py"}]}],
        [
            {"role": "assistant", "content": [{"type": "text", "text": "One file."}], "name": "agent"},
            {
                "role": "user",
                "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "?"}],
            },
        ],
    ]
    blocks = [
        [
            {
                "role": "user",
                "content": [{"type": "text", "text": "List files.", "cache_control": {"type": "ephemeral"}}],
            }
        ],
        [
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "tu_1", "name": "bash", "input": {"c": "ls"}}],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "tu_1", "content": [{"type": "text", "text": "a.py"}]},
                    {"type": "text", "text": "Go on."},
                ],
            },
        ],
        [
            {"role": "assistant", "content": "One file."},
            {
                "role": "user",
                "content": [
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": image}},
                    {"type": "text", "text": "?"},
                ],
            },
        ],
    ]
    items = [
        [{"role": "user", "content": [{"type": "input_text", "text": "List files."}]}],
        [
            {"type": "function_call", "call_id": "fc_1", "name": "bash", "arguments": '{"c":"ls"}'},
            {"type": "function_call_output", "call_id": "fc_1", "output": "a.py"},
        ],
        [
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "One file."}]},
            {
                "role": "user",
                "content": [{"type": "input_image", "image_url": url}, {"type": "input_text", "text": "?"}],
            },
        ],
    ]
    schema = {"type": "object", "properties": {"c": {"type": "string"}}}
    return {
        "chat/completions": (
            "messages",
            {"max_tokens": 3, "tools": [{"type": "function", "function": {"name": "bash", "parameters": schema}}]},
            chat,
        ),
        "messages": ("messages", {"max_tokens": 3, "tools": [{"name": "bash", "input_schema": schema}]}, blocks),
        "responses": (
            "input",
            {"max_output_tokens": 16, "tools": [{"type": "function", "name": "bash", "parameters": schema}]},
            items,
        ),
    }


async def shared_parses_unchanged(
    http: httpx.AsyncClient,
    monkeypatch: pytest.MonkeyPatch,
    model: str,
    accepted: tuple[int, ...] = (200,),
    image: str = PIXEL_PNG,
) -> None:
    """Each route, three calls of one session: every history element parsed is written afterwards as
    it was written when parsed, and the later bodies did share the earlier ones' elements."""
    parsed: list[tuple[Any, bytes]] = []
    read = Reparser.read

    def watched(self: Reparser, key: str | None, body: bytes, field: str) -> tuple[Any, Callable[[], None]]:
        self.min_bytes = 0  # every body, however small
        got, keep = read(self, key, body, field)
        parsed.extend((item, orjson.dumps(item)) for item in got[field])
        return got, keep

    monkeypatch.setattr(Reparser, "read", watched)
    shared = 0
    for route, (field, extra, steps) in rich_histories(image).items():
        history: list[Any] = []
        kept = 0  # the elements of the route's last accepted body: a refused body's parse is not kept
        for step in steps:
            history += step
            body = orjson.dumps({"model": model, field: history, **extra})  # written as the SDKs write it
            path = f"/sessions/shared-{route.replace('/', '-')}/v1/{route}"
            response = await http.post(path, content=body, headers={"content-type": "application/json"})
            assert response.status_code in accepted, response.text
            # each body resends what the last accepted one sent: those elements are shared
            shared += kept
            if response.status_code == 200:
                kept = len(history)
    assert [written for _, written in parsed] == [orjson.dumps(item) for item, _ in parsed]
    assert len(parsed) - len({id(item) for item, _ in parsed}) == shared
