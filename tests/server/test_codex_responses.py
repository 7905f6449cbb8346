"""A Codex-shaped Responses session through a served gateway, driven by the real `openai` SDK on Qwen3's
real tokenizer and template (a scripted engine stands in for the model).

Codex CLI 0.169.0 sends its base prompt and skills as `developer` messages, function tools beside a
`namespace` tool and the hosted `web_search`, `reasoning`, `include: ["reasoning.encrypted_content"]`,
`store: false` (the whole history resent every turn), `prompt_cache_key`, `client_metadata` and
`parallel_tool_calls`. The prompt the engine is sent is compared with the template's own rendering
of what the model must see; the model's call of a namespaced function comes back as the SDK's
`function_call` item with its namespace, and the resent history extends the tape."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.support.fake_engines import serving
from tests.support.models import materialise
from tests.support.sdk_shapes import check_responses_event
from tests.support.served import build
from tokentape.engines.scripted import ScriptedEngine
from tokentape.render.renderer import Renderer
from tokentape.runtime import hf_renderer
from tokentape.server.dialects import responses_input, responses_tools

BASE_PROMPT = "You are a coding agent running in the Codex CLI, a terminal-based coding assistant."
SKILLS = "<skills_instructions>\n## Skills\nA skill is a set of local instructions.\n</skills_instructions>"
ENVIRONMENT = "<environment_context>\n  <cwd>/tmp/work</cwd>\n  <shell>bash</shell>\n</environment_context>"
TASK = "Ask a helper agent to list the files."
EXEC_PARAMETERS = {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}
SPAWN_PARAMETERS = {"type": "object", "properties": {"message": {"type": "string"}}, "required": ["message"]}
WAIT_PARAMETERS = {"type": "object", "properties": {"timeout_ms": {"type": "number"}}}
TOOLS: list[Any] = [
    {
        "type": "function",
        "name": "exec_command",
        "description": "Runs a command in a PTY.",
        "strict": False,
        "parameters": EXEC_PARAMETERS,
    },
    {
        "type": "namespace",
        "name": "multi_agent_v1",
        "description": "Tools for spawning and managing sub-agents.",
        "tools": [
            {
                "type": "function",
                "name": "spawn_agent",
                "description": "Spawn a sub-agent.",
                "strict": False,
                "parameters": SPAWN_PARAMETERS,
            },
            {
                "type": "function",
                "name": "wait_agent",
                "description": "Wait for agents.",
                "strict": False,
                "parameters": WAIT_PARAMETERS,
            },
        ],
    },
    {"type": "web_search", "external_web_access": True},
]
# what the model must be shown: the functions, the namespaced ones under their flat names, no web_search
SHOWN_TOOLS = [
    {"type": "function", "function": {"name": name, "parameters": schema, "description": description}}
    for name, schema, description in (
        ("exec_command", EXEC_PARAMETERS, "Runs a command in a PTY."),
        ("multi_agent_v1__spawn_agent", SPAWN_PARAMETERS, "Spawn a sub-agent."),
        ("multi_agent_v1__wait_agent", WAIT_PARAMETERS, "Wait for agents."),
    )
]
SESSION = "01a23507-9b82-7680-9b69-9296e970cc3a"
CALL_REPLY = (
    "<think>\nA helper should do it.\n</think>\n\n"
    '<tool_call>\n{"name": "multi_agent_v1__spawn_agent", "arguments": {"message": "list the files"}}\n</tool_call>'
)
FINAL_REPLY = "<think>\nThe helper is running.\n</think>\n\nA helper is listing the files."


def _message(role: str, text: str) -> dict[str, Any]:
    return {"type": "message", "role": role, "content": [{"type": "input_text", "text": text}]}


def _codex_fields(turn_id: str) -> dict[str, Any]:
    """Everything but `input` that Codex sends with every request."""
    return {
        "model": "qwen",
        "tools": TOOLS,
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "reasoning": {"summary": "auto"},
        "store": False,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": SESSION,
        "extra_body": {
            "client_metadata": {"session_id": SESSION, "thread_id": SESSION, "turn_id": turn_id},
            "text": {"verbosity": "medium"},
        },
    }


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[openai.AsyncOpenAI, ScriptedEngine, Renderer, str]]:
    renderer = hf_renderer(materialise("qwen3", tmp_path))
    end = renderer.tokenizer.encode("<|im_end|>")[0]
    engine = ScriptedEngine([], end)
    app = build(engine, renderer, model="qwen").app
    with serving(app) as base:
        sdk = openai.AsyncOpenAI(base_url=f"{base}/sessions/codex/v1", api_key="x", max_retries=0)
        yield sdk, engine, renderer, base


async def _streamed(sdk: openai.AsyncOpenAI, **fields: Any) -> Any:
    """One streamed call, as Codex makes it: the final Response of its stream."""
    stream = await sdk.responses.create(stream=True, **fields)
    final = None
    async for event in stream:
        check_responses_event(event.model_dump(exclude_none=True))
        if event.type == "response.completed":
            final = event.response
    assert final is not None
    return final


async def test_a_codex_session_runs_and_every_instruction_reaches_the_model(
    served: tuple[openai.AsyncOpenAI, ScriptedEngine, Renderer, str],
) -> None:
    sdk, engine, renderer, base = served
    end = renderer.tokenizer.encode("<|im_end|>")[0]
    engine.push([*renderer.tokenizer.encode(CALL_REPLY), end])
    engine.push([*renderer.tokenizer.encode(FINAL_REPLY), end])
    history: list[Any] = [
        _message("developer", BASE_PROMPT),
        _message("developer", SKILLS),
        _message("user", ENVIRONMENT),
        _message("user", TASK),
    ]
    first = await _streamed(sdk, input=history, **_codex_fields("turn-1"))

    # the model saw the developer messages as system blocks, the namespaced functions under their
    # flat names, and no web_search: the template's own rendering of exactly that
    shown = [
        {"role": "system", "content": BASE_PROMPT},
        {"role": "system", "content": SKILLS},
        {"role": "user", "content": ENVIRONMENT},
        {"role": "user", "content": TASK},
    ]
    expected = renderer.tokenizer.encode(renderer.template.render(shown, add_generation_prompt=True, tools=SHOWN_TOOLS))
    prompt = (first.model_extra or {})["prompt_token_ids"]
    assert prompt == expected
    text = renderer.tokenizer.decode_all(prompt)
    assert f"<|im_start|>system\n{BASE_PROMPT}" in text and f"<|im_start|>system\n{SKILLS}<|im_end|>" in text
    assert "web_search" not in text and "developer" not in text

    # the call of a namespaced function comes back as OpenAI answers it: its own name and its namespace
    reasoning, call = first.output
    assert reasoning.type == "reasoning" and call.type == "function_call"
    assert (call.name, call.namespace) == ("spawn_agent", "multi_agent_v1")
    assert json.loads(call.arguments) == {"message": "list the files"}
    assert reasoning.encrypted_content == responses_input.carried_reasoning("A helper should do it.")
    assert [t.type for t in first.tools] == ["function", "namespace", "web_search"]

    # Codex resends the whole history (store: false): its reasoning item without `content`, the call
    # with its namespace, the call's output
    echoed_reasoning = {"type": "reasoning", "summary": [], "encrypted_content": reasoning.encrypted_content}
    echoed_call = call.model_dump(exclude_none=True)
    history += [
        echoed_reasoning,
        echoed_call,
        {"type": "function_call_output", "call_id": call.call_id, "output": "ok"},
    ]
    second = await _streamed(sdk, input=history, **_codex_fields("turn-2"))
    assert second.output_text == "A helper is listing the files."
    head = prompt + (first.model_extra or {})["token_ids"]
    assert (second.model_extra or {})["prompt_token_ids"][: len(head)] == head
    summary = httpx.get(f"{base}/sessions/codex").json()
    assert (summary["turns"], summary["branches"], summary["rewrites"]) == (2, 1, 0)
    # each turn records that the model was not shown web_search
    (branch,) = httpx.get(f"{base}/sessions/codex/export").json()["branches"]
    note = "hosted tools left out of the prompt (no engine here runs them): tools[2] (web_search)"
    assert branch["notes"] == [[note], [note]]


async def test_what_cannot_be_honoured_is_refused_by_name(
    served: tuple[openai.AsyncOpenAI, ScriptedEngine, Renderer, str],
) -> None:
    sdk, engine, _, _ = served
    user = [_message("user", TASK)]
    cases: list[tuple[dict[str, Any], str]] = [
        ({"extra_body": {"text": {"verbosity": "low"}}}, "text.verbosity"),
        ({"truncation": "auto"}, "truncation"),
        ({"background": True}, "background"),
        ({"max_tool_calls": 3}, "max_tool_calls"),
        ({"tools": [{"type": "custom", "name": "apply_patch"}]}, "tools[0]"),
        ({"tools": TOOLS, "tool_choice": {"type": "web_search"}}, "tool_choice"),
    ]
    for fields, param in cases:
        with pytest.raises(openai.BadRequestError) as caught:
            await sdk.responses.create(model="qwen", input=user, **fields)
        assert caught.value.param == param, (fields, caught.value.message)
    assert engine.calls == 0


def test_resent_items_are_read_back_as_the_model_wrote_them() -> None:
    """A reasoning item this gateway wrote gives its text back from `encrypted_content` alone (Codex
    drops `content`); one another server encrypted falls back to its summary. A call echoed with its
    namespace, or without it where only one namespace has that name, gets its flat name back."""
    table = responses_tools.tool_table(TOOLS)
    call = {"type": "function_call", "call_id": "c1", "arguments": "{}"}
    items: list[Any] = [
        _message("user", TASK),
        {"type": "reasoning", "summary": [], "encrypted_content": responses_input.carried_reasoning("Plan: ask.")},
        {**call, "name": "spawn_agent", "namespace": "multi_agent_v1"},
        {**call, "call_id": "c2", "name": "wait_agent"},
        {**call, "call_id": "c3", "name": "exec_command"},
        {"type": "function_call_output", "call_id": "c1", "output": "ok"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Sum."}], "encrypted_content": "gAAAA"},
        {"role": "assistant", "content": "Done."},
    ]
    messages = responses_input.chat_messages(items, tools=table)
    turn = messages[1]
    assert turn["reasoning_content"] == "Plan: ask."
    names = [c["function"]["name"] for c in turn["tool_calls"]]
    assert names == ["multi_agent_v1__spawn_agent", "multi_agent_v1__wait_agent", "exec_command"]
    assert messages[3] == {"role": "assistant", "content": "Done.", "reasoning_content": "Sum."}
    assert table.left_out == [(2, "web_search")]
    assert table.call_name("multi_agent_v1__wait_agent") == ("multi_agent_v1", "wait_agent")
