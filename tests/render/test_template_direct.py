"""A conversation made of JSON's own types is rendered without transformers' deep copy of it, and the
text is exactly what transformers' own `render_jinja_template` gives, for every family's template;
inputs of other types (objects, tuples) still take transformers' whole path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers.utils.chat_template_utils import render_jinja_template

import tokentape.render.template as template_module
from tests.support.models import SOURCES
from tokentape.errors import InvalidRequest
from tokentape.render.hf import load_model_dir
from tokentape.render.template import ChatTemplate

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a command.",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
        },
    }
]
CALL = {"id": "call_1", "type": "function", "function": {"name": "bash", "arguments": '{"command": "ls -la"}'}}
CONVERSATIONS: list[tuple[list[dict[str, Any]], list[dict[str, Any]] | None, dict[str, Any]]] = [
    ([{"role": "user", "content": "Hi"}], None, {}),
    (
        [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "List the files."},
            {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "call_1", "content": "a.py\nb.py"},
            {"role": "assistant", "content": "Two files.", "reasoning_content": "I counted them."},
            {"role": "user", "content": [{"type": "text", "text": "Thanks"}]},
        ],
        TOOLS,
        {},
    ),
    (
        [
            {"role": "user", "content": "Think first: 2+2?"},
            {"role": "assistant", "content": "4", "reasoning": "2 and 2 make 4."},
            {"role": "user", "content": "And 3+3?"},
        ],
        None,
        {"enable_thinking": False, "nested": {"depth": [1, 2.5, True, None]}},
    ),
    # reasoning under another name than the template reads, on the turn after the last user message
    ([{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4", "reasoning": "Adding."}], None, {}),
]


@pytest.fixture(scope="module")
def templates(model_dirs: dict[str, Path]) -> dict[str, ChatTemplate]:
    return {name: load_model_dir(directory)[0] for name, directory in model_dirs.items()}


def transformers_text(
    template: ChatTemplate, messages: Any, tools: Any, kwargs: dict[str, Any], generation: bool
) -> str:
    try:
        result = render_jinja_template(
            conversations=[messages],
            tools=tools,
            chat_template=template.source,
            add_generation_prompt=generation,
            **{"bos_token": template.bos_token, "eos_token": template.eos_token, **kwargs},
        )
    except Exception as exc:  # the template refuses this shape: ours must refuse it too
        return f"refused: {type(exc).__name__}"
    return str(result[0][0])


def ours(template: ChatTemplate, messages: Any, tools: Any, kwargs: dict[str, Any], generation: bool) -> str:
    try:
        return template.render(messages, add_generation_prompt=generation, tools=tools, template_kwargs=kwargs)
    except InvalidRequest as exc:
        return f"refused: {type(exc.__cause__).__name__}"


@pytest.mark.parametrize("family", sorted(SOURCES))
def test_json_conversations_render_as_transformers_does(templates: dict[str, ChatTemplate], family: str) -> None:
    template = templates[family]
    rendered = 0
    for messages, tools, kwargs in CONVERSATIONS:
        for generation in (False, True):
            expected = transformers_text(template, messages, tools, kwargs, generation)
            assert ours(template, messages, tools, kwargs, generation) == expected
            rendered += not expected.startswith("refused")
    assert rendered >= 6  # most shapes render under every family's template


def test_json_inputs_skip_the_deep_copy(templates: dict[str, ChatTemplate], monkeypatch: pytest.MonkeyPatch) -> None:
    def whole_path(**_: Any) -> Any:
        raise AssertionError("a JSON conversation took transformers' whole path")

    monkeypatch.setattr(template_module, "render_jinja_template", whole_path)
    messages, tools, _ = CONVERSATIONS[1]
    assert "List the files." in templates["qwen2.5"].render(messages[:-1], add_generation_prompt=True, tools=tools)
    messages, _, kwargs = CONVERSATIONS[2]
    assert "And 3+3?" in templates["qwen3"].render(messages, add_generation_prompt=True, template_kwargs=kwargs)


class Shown:
    """Not a JSON value: transformers shows the template a placeholder naming its type."""


@pytest.mark.parametrize(
    ("messages", "kwargs"),
    [
        ([{"role": "user", "content": [{"type": "text", "text": "Hi", "extra": Shown()}]}], {}),
        ([{"role": "user", "content": ("a", "tuple")}], {}),
        ([{"role": "user", "content": "Hi", 3: "a key that is not a string"}], {}),
        ([{"role": "user", "content": "Hi"}], {"continue_final_message": True}),  # transformers' own parameter
        ([{"role": "user", "content": "Hi"}], {"setting": Shown()}),
    ],
)
def test_other_inputs_take_transformers_whole_path(
    templates: dict[str, ChatTemplate], messages: list[dict[Any, Any]], kwargs: dict[str, Any]
) -> None:
    for family in ("qwen2.5", "llama3.2"):
        template = templates[family]
        for generation in (False, True):
            expected = transformers_text(template, [dict(m) for m in messages], None, kwargs, generation)
            assert ours(template, messages, None, kwargs, generation) == expected
