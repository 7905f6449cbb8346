"""Every shipped template x every setting it reads x text, tools and images: each bridge of a
five-turn conversation is what the template's render of the whole conversation emits there.

The oracle is transformers: the tokenizer's own `apply_chat_template` with the same
`chat_template_kwargs`, tokenized by the same tokenizer, sharing no code with the renderer's
anchors, sentinels or probe (the messages are given in the form the renderer hands every template,
`Renderer.prepare`). The settings table is checked against the template sources: a template that
reads a kwarg the table does not try fails `test_the_table_tries_every_kwarg_a_template_reads`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
import jinja2.meta
import pytest
import tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from tests.render.corpus import CLOSES, WEATHER
from tests.support.models import SOURCES, VISION_SOURCES, gguf_tokenizer_dir, materialise
from tokentape.render.probe import AnchorVerdicts
from tokentape.render.renderer import Renderer, RenderOptions
from tokentape.runtime import hf_renderer

# The kwargs each template reads (from its source), each with values that change its output.
SETTINGS: dict[str, list[dict[str, Any]]] = {
    "qwen2.5": [],
    "qwen3": [{"enable_thinking": False}, {"enable_thinking": True}],
    "qwen3.5": [{"enable_thinking": False}, {"add_vision_id": True}, {"add_vision_id": True, "enable_thinking": True}],
    "qwen3.6": [{"enable_thinking": False}, {"add_vision_id": True}],
    "deepseek-r1": [],
    "deepseek-v3": [],
    "deepseek-v3.1": [{"thinking": True}, {"thinking": False}],
    "glm-4.5": [{"enable_thinking": False}],
    "glm-4.7": [{"enable_thinking": False}, {"clear_thinking": False}],
    "glm-5": [{"enable_thinking": False}, {"clear_thinking": False}],
    "minimax-m2": [{"model_identity": "You are a test model."}],
    "llama3.2": [{"tools_in_user_message": False}, {"date_string": "26 Jul 2024"}, {"custom_tools": [WEATHER]}],
    "qwen2-vl": [{"add_vision_id": True}],
    "smollm2": [],
}
# Names a template reads that are no kwargs: its own variables, what every render is given, and the
# tools (a column of the table of their own).
NOT_KWARGS = {
    "messages",
    "add_generation_prompt",
    "bos_token",
    "eos_token",
    "raise_exception",
    "strftime_now",
    "namespace",
    "range",
    "tools",
    "content",
    "reasoning_content",
    "tool_call",
    "first_user_message",
    "system_message",
}
FAMILIES = [*SOURCES, *VISION_SOURCES, "smollm2"]
VISION = {"qwen2-vl", "qwen3.5", "qwen3.6"}  # their templates render image parts as Qwen2-VL's processor expects
TURNS = 5


@dataclass
class Model:
    renderer: Renderer
    tokenizer: PreTrainedTokenizerBase  # its `apply_chat_template` is the oracle's render, its tokens the oracle's
    vocabulary: tokenizers.Tokenizer | None = None  # else tokens from the model's tokenizer.json


@pytest.fixture(scope="module")
def models(
    tmp_path_factory: pytest.TempPathFactory,
    model_dirs: dict[str, Path],
    renderers: dict[str, Renderer],
    model_path: Path,
) -> dict[str, Model]:
    root = tmp_path_factory.mktemp("settings-models")
    built = {}
    for name in [*SOURCES, *VISION_SOURCES]:
        directory = model_dirs.get(name) or materialise(name, root)
        # the models that take images with their vision side (its tokens quoted in message text)
        renderer = hf_renderer(directory) if name in VISION else renderers[name]
        built[name] = Model(renderer, *_oracle(directory))
    built["smollm2"] = Model(renderers["smollm2"], *_oracle(gguf_tokenizer_dir(model_path, root)))
    return built


def _oracle(directory: Path) -> tuple[PreTrainedTokenizerBase, tokenizers.Tokenizer | None]:
    tokenizer = AutoTokenizer.from_pretrained(directory)
    # transformers 5 loads MiniMax-M2's tokenizer as GPT-2's, whose pre-tokenizer splits ".\n\n"
    # where its tokenizer.json does not: tokens from the file itself
    gpt2 = type(tokenizer).__name__ == "GPT2Tokenizer"
    return tokenizer, tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json")) if gpt2 else None


def cells() -> Iterator[Any]:
    for family in FAMILIES:
        kinds = ["text", "tools"] + (["images"] if family in VISION else [])
        for kind in kinds:
            for kwargs in [{}, *SETTINGS[family]]:
                yield pytest.param(family, kind, kwargs, id=f"{family}-{kind}-{json.dumps(kwargs)[:40]}")


def _call(name: str, arguments: dict[str, Any], index: int) -> dict[str, Any]:
    function = {"name": name, "arguments": json.dumps(arguments)}
    return {"id": f"call_{index}", "type": "function", "function": function}


def script(kind: str, parallel: bool) -> list[tuple[list[dict[str, Any]], dict[str, Any]]]:
    """Five turns: (new messages, the reply) each."""
    system = {"role": "system", "content": "Be brief."}
    if kind == "text":
        turns = [
            ([{"role": "user", "content": f"Question {i}?"}], {"role": "assistant", "content": f"Answer {i}."})
            for i in range(TURNS)
        ]
        turns[0] = ([system, *turns[0][0]], turns[0][1])
        return turns
    if kind == "images":
        turns = []
        for i in range(TURNS):
            parts = [{"type": "text", "text": f"Screen {i}?"}, {"type": "image", "image": f"digest-{i}"}]
            if i == 2:  # two images in one message
                parts.append({"type": "image", "image": "digest-2b"})
            turns.append(([{"role": "user", "content": parts}], {"role": "assistant", "content": f"Screen {i}."}))
        turns[0] = ([system, *turns[0][0]], turns[0][1])
        return turns
    cities = [_call("get_weather", {"city": "Oslo"}, 2), _call("get_weather", {"city": "Rome"}, 3)]
    second = cities if parallel else cities[:1]
    return [
        (
            [system, {"role": "user", "content": "Weather in Paris?"}],
            # content "", not None: transformers drops None fields, which DeepSeek-R1's template rejects
            {"role": "assistant", "content": "", "tool_calls": [_call("get_weather", {"city": "Paris"}, 1)]},
        ),
        ([{"role": "tool", "tool_call_id": "call_1", "content": "sunny"}], {"role": "assistant", "content": "Sunny."}),
        (
            [{"role": "user", "content": "And Oslo and Rome?"}],
            {"role": "assistant", "content": "", "tool_calls": second},
        ),
        (
            [{"role": "tool", "tool_call_id": c["id"], "content": f"rain {i}"} for i, c in enumerate(second)],
            {"role": "assistant", "content": "Rain."},
        ),
        ([{"role": "user", "content": "Thanks."}], {"role": "assistant", "content": "Welcome."}),
    ]


def oracle_text(model: Model, messages: list[dict[str, Any]], generation: bool, options: RenderOptions) -> str:
    prepared, tools = model.renderer.prepare(messages, options)
    text: str = model.tokenizer.apply_chat_template(
        prepared,
        tools=list(tools) if tools else None,
        add_generation_prompt=generation,
        tokenize=False,
        **(options.template_kwargs or {}),
    )
    return text


def encode(model: Model, text: str) -> list[int]:
    if model.vocabulary is not None:
        return list(model.vocabulary.encode(text, add_special_tokens=False).ids)
    ids: list[int] = model.tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids


@pytest.mark.parametrize(("family", "kind", "kwargs"), list(cells()))
def test_every_bridge_is_the_full_render(
    models: dict[str, Model], family: str, kind: str, kwargs: dict[str, Any]
) -> None:
    model = models[family]
    renderer = model.renderer
    close = {**CLOSES, "qwen2-vl": "<|im_end|>\n"}[family]
    parallel = family != "llama3.2"  # Llama 3.2's template takes one call per message
    options = RenderOptions(tools=[WEATHER] if kind == "tools" else None, template_kwargs=kwargs or None)
    messages: list[dict[str, Any]] = []
    for turn, (new, reply) in enumerate(script(kind, parallel)):
        if turn == 0:
            messages += new
            full = oracle_text(model, messages, True, options)
            assert renderer.prompt(messages, options).tokens == encode(model, full), "the first prompt"
            messages.append(reply)
            continue
        at = len(messages) - 1
        replied = messages[at]
        messages += new
        head = oracle_text(model, messages[: at + 1], False, options)  # the recorded history
        full = oracle_text(model, messages, True, options)
        # the end-of-turn token sampled last: the close's first, or GLM's next opener
        opener = "<|observation|>" if new[0]["role"] == "tool" else "<|user|>"
        stop = renderer.tokenizer.encode(close or opener)[0]
        stop_text = renderer.tokenizer.special_text(stop)
        bridge = renderer.bridge(messages, at, replied, stop, options)
        where = f"turn {turn + 1}"
        if full.startswith(head):
            assert not bridge.template_rewrite, where
            closed = bool(close) and head.endswith(close)
            expected = full[len(head) - len(close) if closed else len(head) :]
            assert expected.startswith(stop_text), where
            expected = expected[len(stop_text) :]  # sampled: never doubled
            assert bridge.text == expected, f"{where}: bridge {bridge.text!r} != the full render's {expected!r}"
            assert bridge.tokens == encode(model, expected), where
        else:  # the template renders the history otherwise once new messages follow (reasoning dropped)
            assert bridge.template_rewrite, where
            counts = close.startswith(stop_text) if close else True
            joined = (stop_text if counts else "") + bridge.text
            assert joined.startswith(close), f"{where}: the close is dropped or doubled"
            after = joined[len(close) :]
            assert full.endswith(after) and full[: len(full) - len(after)].endswith(close), where
            assert str(replied.get("content") or "\0") not in after, f"{where}: the bridge starts before the reply"
            for message in new:
                content = message["content"]
                texts = [content] if isinstance(content, str) else [p["text"] for p in content if "text" in p]
                assert all(t in after for t in texts), f"{where}: a new message is missing from the bridge"
            assert bridge.tokens == encode(model, bridge.text), where
        messages.append(reply)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_table_tries_every_kwarg_a_template_reads(models: dict[str, Model], family: str) -> None:
    source = models[family].renderer.template.source
    environment = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
    read = jinja2.meta.find_undeclared_variables(environment.parse(source)) - NOT_KWARGS
    tried = {key for setting in SETTINGS[family] for key in setting}
    assert read <= tried, f"{family} reads {sorted(read - tried)}: add them to SETTINGS"


def test_settings_past_the_limit_are_not_probed_and_bridge_the_whole_conversation(models: dict[str, Model]) -> None:
    """Kwargs an agent varies at will cost neither memory nor probing: past the limit a new setting
    gets no verdict from a probe and its bridges render from the first message."""
    renderer = models["qwen3"].renderer
    verdicts = AnchorVerdicts(renderer._bridge_text, limit=2)
    assert verdicts.get({"enable_thinking": False}, images=False).safe
    assert verdicts.get({"enable_thinking": True}, images=False).safe
    past = verdicts.get({"enable_thinking": True, "x": 1}, images=False)
    assert not past.safe and "not probed" in past.difference
    assert verdicts.known({"enable_thinking": False}, images=False) is not None  # the first two are kept
