"""A conversation made of JSON's own types is rendered without transformers' deep copy of it, and the
text is exactly what transformers' own `render_jinja_template` gives, for every family's template;
inputs of other types (objects, tuples) still take transformers' whole path. Its `tojson` filter
remembers what it wrote, and writes exactly what transformers' writes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from transformers.utils.chat_template_utils import _compile_jinja_template, render_jinja_template

import tokentape.render.template as template_module
from tests.support.models import SOURCES
from tokentape.errors import InvalidRequest
from tokentape.render.renderer import Renderer
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
def templates(model_dirs: dict[str, Path], renderers: dict[str, Renderer]) -> dict[str, ChatTemplate]:
    """The templates of the session's renderers (each `load_model_dir` of its directory): building them
    again here would read every tokenizer again."""
    return {name: renderers[name].template for name in model_dirs}


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


def _written_by_json(value: Any, *args: Any) -> str:
    """transformers' tojson, written out independently: the standard library with its options."""
    ensure_ascii, indent, separators, sort_keys = (list(args) + [False, None, None, False][len(args) :])[:4]
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


# values orjson writes alike or that differ only where json.dumps tells them apart, each after the other
LOOKALIKES: list[tuple[Any, tuple[Any, ...]]] = [
    ({"a": 1}, ()),
    ({"a": 1.0}, ()),
    ({"a": True}, ()),
    ({"a": float("nan")}, ()),  # orjson writes NaN as null
    ({"a": None}, ()),
    ({"a": float("inf")}, ()),
    ({"a": -0.0}, ()),
    ({"a": 0.0}, ()),
    ({"b": 1, "a": 2}, ()),
    ({"a": 2, "b": 1}, ()),
    ({"b": 1, "a": 2}, (False, None, None, True)),  # sort_keys
    ({"a": [1, "é"]}, ()),
    ({"a": [1, "é"]}, (True,)),  # ensure_ascii
    ({"a": [1, "é"]}, (False, 2)),  # indent
    ({"a": [1, "é"]}, (False, None, (",", ":"))),
    ({"a": [1, "é"]}, (False, None, [",", ":"])),  # an unhashable option
    ({"a": 2**70}, ()),  # past orjson's integers
    ([{"x": "\ud800"}], ()),  # a lone surrogate orjson refuses
    ("a string", ()),
    (12, ()),
]


def test_the_json_memo_writes_what_the_standard_library_writes() -> None:
    memo = template_module._JSONMemo(_written_by_json)
    for _ in range(2):  # the second pass answers from what the first remembered
        for value, options in LOOKALIKES:
            assert memo(value, *options) == _written_by_json(value, *options), (value, options)


def test_options_equal_in_python_but_taken_apart_by_json_dumps_stay_apart() -> None:
    memo = template_module._JSONMemo(_written_by_json)
    value = {"a": [1, 2]}
    assert memo(value, False, True) == _written_by_json(value, False, True)  # True is 1 as a key
    with pytest.raises(TypeError):  # json.dumps refuses a float indent
        _written_by_json(value, False, 1.0)
    with pytest.raises(TypeError):
        memo(value, False, 1.0)
    assert memo(value, 1, 2) == _written_by_json(value, 1, 2)


def test_the_json_memo_writes_each_value_once() -> None:
    written: list[Any] = []

    def counting(value: Any, *options: Any) -> str:
        written.append(value)
        return _written_by_json(value, *options)

    memo = template_module._JSONMemo(counting)
    tool = TOOLS[0]
    for _ in range(3):
        assert memo(json.loads(json.dumps(tool))) == json.dumps(tool, ensure_ascii=False)
    assert len(written) == 1
    memo({"a": None})
    memo({"a": None})
    assert len(written) == 3  # a value with a null is written every time


def test_the_json_memo_holds_a_bounded_amount(monkeypatch: pytest.MonkeyPatch) -> None:
    memo = template_module._JSONMemo(_written_by_json)
    for i in range(3_000):
        memo({"id": i, "schema": "x" * 1_000})
    assert memo._written.held_bytes <= template_module._JSON_MEMO_BYTES
    assert len(memo._written) <= 1_024
    large = {"schema": "y" * (template_module._JSON_MEMO_LARGEST + 1)}
    assert memo(large) == json.dumps(large)
    assert all(len(written) <= template_module._JSON_MEMO_LARGEST for written, _ in memo._written._items)


def test_tools_that_differ_only_in_a_number_render_as_transformers_does(templates: dict[str, ChatTemplate]) -> None:
    whole = json.loads(json.dumps(TOOLS))
    whole[0]["function"]["parameters"]["properties"]["command"]["maxLength"] = 1
    real = json.loads(json.dumps(whole))
    real[0]["function"]["parameters"]["properties"]["command"]["maxLength"] = 1.0
    messages = CONVERSATIONS[1][0][:2]
    for family in ("qwen2.5", "qwen3", "llama3.2"):
        template = templates[family]
        for tools in (whole, real, whole, real):
            expected = transformers_text(template, messages, tools, {}, True)
            assert ours(template, messages, tools, {}, True) == expected
        assert "1.0" in ours(template, messages, real, {}, True)


def test_transformers_own_environment_keeps_its_own_filter(templates: dict[str, ChatTemplate]) -> None:
    template = templates["qwen2.5"]
    template.render(CONVERSATIONS[1][0][:2], add_generation_prompt=True, tools=TOOLS)
    theirs = _compile_jinja_template(template.source).environment.filters["tojson"]
    assert not isinstance(theirs, template_module._JSONMemo)
    ours_filter = template_module._compiled(template.source).environment.filters["tojson"]
    assert isinstance(ours_filter, template_module._JSONMemo)


# a template that reads keys named like dict's methods, keys that are missing, and nested keys
_LOOKUPS = (
    "{% for m in messages %}{{ m.role }}|{{ m.items is string }}|{{ m.get is callable }}|{{ m.keys is defined }}|"
    "{{ m.missing is defined }}|{{ m.meta.items is string }}|{{ m.meta.depth.x }}|{{ m.get('role') }}\n{% endfor %}"
)


def test_a_key_named_like_a_dicts_method_reads_as_the_sandbox_reads_it() -> None:
    """Keys are looked up first only for names that are none of dict's attributes: `m.items` stays the
    method, as Jinja's sandbox gives it, even where the message has an `items` key."""
    messages: list[dict[str, Any]] = [
        {"role": "user", "items": "a key", "get": "a key", "keys": 1, "meta": {"items": "x", "depth": {"x": 3}}},
        {"role": "assistant", "meta": {"depth": {}}},
    ]
    template = ChatTemplate(_LOOKUPS)
    expected = render_jinja_template(conversations=[messages], chat_template=_LOOKUPS)[0][0]
    assert template.render(messages, add_generation_prompt=False) == expected
    assert expected.splitlines() == [
        "user|False|True|True|False|False|3|user",
        "assistant|False|True|True|False|False||assistant",
    ]
