"""Work bounded before it starts: a prompt past the context by the length of its text alone is refused
before the template renders it (and a rendered text before it is tokenized); a forced call of more
tools than a grammar may hold is refused before any schema is converted. Each refusal is the one the
full work would have ended in (400 `context_length_exceeded`), and nothing that fits is refused.

The embedded test engine holds 1,024 tokens; SmolLM2's longest token is 81 bytes, so a text of more
than 1,024 x 81 characters cannot fit, whatever it says."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from tests.conftest import MODEL_NAME
from tests.reliability.loop_probe import many_tools
from tokentape.gateway import constraints
from tokentape.render.renderer import Renderer

CONTEXT = 1024
SPAN = 81


@pytest.fixture
def renders(renderer: Renderer, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The sizes of the texts the template renders and the tokenizer encodes, as they happen."""
    assert renderer.floor is not None  # made once, before the count starts
    seen: list[int] = []
    render_text: Callable[..., str] = renderer.render_text
    encode: Callable[[str], list[int]] = renderer.encode
    encode_prompt: Callable[[str], list[int]] = renderer.encode_prompt_text

    def counted_render(*args: Any, **kwargs: Any) -> str:
        text = render_text(*args, **kwargs)
        seen.append(len(text))
        return text

    def counted_encode(text: str) -> list[int]:
        seen.append(-len(text))
        return encode(text)

    def counted_encode_prompt(text: str) -> list[int]:
        seen.append(-len(text))
        return encode_prompt(text)

    monkeypatch.setattr(renderer, "render_text", counted_render)
    monkeypatch.setattr(renderer, "encode", counted_encode)
    monkeypatch.setattr(renderer, "encode_prompt_text", counted_encode_prompt)
    yield seen


def _chat(content: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": content}], "max_tokens": 2, **extra}


async def test_a_message_past_the_context_by_its_length_is_refused_unrendered(
    http: httpx.AsyncClient, renders: list[int]
) -> None:
    text = "words " * 100_000  # 600,000 characters: at least 7,407 tokens
    response = await http.post("/v1/chat/completions", json=_chat(text))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "messages"
    assert f"at least {len(text) // SPAN} " in error["message"], error["message"]
    assert renders == []  # neither rendered nor tokenized


async def test_ten_thousand_tools_are_refused_unrendered(http: httpx.AsyncClient, renders: list[int]) -> None:
    response = await http.post("/v1/chat/completions", json=many_tools(MODEL_NAME))
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "context_length_exceeded"
    assert renders == []


async def test_text_the_bound_cannot_see_is_refused_before_it_is_tokenized(
    http: httpx.AsyncClient, renders: list[int]
) -> None:
    """An assistant message's text is not counted before rendering (a template may drop it); once
    rendered, its length refuses it before the tokenizer runs."""
    text = "words " * 100_000
    body = _chat("Go on.")
    body["messages"] = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": text}, *body["messages"]]
    response = await http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "context_length_exceeded"
    assert renders and max(renders) > len(text) and all(size >= 0 for size in renders)  # rendered, never encoded


async def test_a_long_prompt_that_fits_is_served(http: httpx.AsyncClient, renders: list[int]) -> None:
    """40,000 spaces are 40,000 characters (past the inline render size) in a few hundred tokens: served."""
    response = await http.post("/v1/chat/completions", json=_chat("Count these:" + " " * 40_000 + "done"))
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] < CONTEXT
    assert renders and min(renders) < 0  # rendered and tokenized


async def test_a_completion_prompt_past_the_context_is_refused_untokenized(
    http: httpx.AsyncClient, renders: list[int]
) -> None:
    prompt = "words " * 100_000
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 2}
    response = await http.post("/v1/completions", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "context_length_exceeded"
    assert renders == []


async def test_a_forced_call_of_too_many_tools_is_refused_before_any_schema_is_converted(
    http: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    converted: list[object] = []
    monkeypatch.setattr(constraints, "schema_grammar", lambda schemas: converted.append(schemas) or "")
    body = many_tools(MODEL_NAME, 1025)
    body["tool_choice"] = "required"
    response = await http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "tool_choice" and "1025 tools" in error["message"], error
    assert converted == []
