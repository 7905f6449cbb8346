"""The anthropic SDK sending what Claude Code 2.1.328 sends to /v1/messages, through a served gateway on
a scripted engine (the instrument that records every prompt it is given) and real Qwen tokenizers and
templates: a billing-header system block, `cache_control` on blocks, a system message inside
`messages`, adaptive thinking shown as omitted, a clear-thinking context edit, an effort, a
`metadata.user_id` JSON string, twelve tools (one deferred), `max_tokens` 32000, `?beta=true` and the
beta headers. Turn 1 answers with a Hermes tool call, turn 2 with text after a tool_result and a
system reminder; `count_tokens` is checked against the prompt the engine then received."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncGenerator, Iterator, Sequence
from pathlib import Path
from typing import Any

import anthropic
import httpx
import httpx2
import pytest

from tests.support.fake_engines import serving
from tests.support.models import materialise
from tests.support.served import build
from tokentape.core.sampling import SamplingParams
from tokentape.engines.base import SampledToken
from tokentape.engines.scripted import ScriptedEngine
from tokentape.render.renderer import Renderer, RenderOptions
from tokentape.runtime import hf_renderer
from tokentape.server import auth
from tokentape.server.dialects.registry import shape_for_path
from tokentape.server.errors import ANTHROPIC_ERRORS

MODEL = "qwen"
BETAS = [
    "claude-code-20250219",
    "interleaved-thinking-2025-05-14",
    "context-management-2025-06-27",
    "effort-2025-11-24",
    "advanced-tool-use-2025-11-20",
]
BILLING = "x-anthropic-billing-header: cc_version=2.1.328.3c9; cc_entrypoint=sdk-cli;"
INTRO = "You are a Claude agent, built on Anthropic's Claude Agent SDK."
AGENT_PROMPT = "\nYou are an agent working with the user toward their goals.\n" + "Use the tools you are given. " * 240
ENVIRONMENT = "# Environment\n - Primary working directory: /tmp/work\n - Platform: linux\n" + "Skill: x. " * 900
REMINDER = "<system-reminder>\nEnd git commit messages with a co-author line.\n</system-reminder>\n"
TASK = "Create a file out.txt containing hello, using the shell."
LATER_REMINDER = "<system-reminder>\nThe task list is empty.\n</system-reminder>"
TOOL_NAMES = [
    "Agent",
    "Bash",
    "Edit",
    "ListAgents",
    "Read",
    "ReportFindings",
    "ScheduleWakeup",
    "Skill",
    "ToolSearch",
    "Workflow",
    "DeferredToolPlaceholder",
    "Write",
]
CALL = '<tool_call>\n{"name": "Bash", "arguments": {"command": "echo hello > out.txt"}}\n</tool_call>'
ANSWER = "I wrote hello to out.txt."


def _tool(name: str) -> dict[str, Any]:
    schema = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "type": "object",
        "properties": {"command": {"type": "string", "description": f"What {name} runs. " * 20}},
        "required": ["command"],
        "additionalProperties": False,
    }
    tool: dict[str, Any] = {"name": name, "description": f"The {name} tool. " * 120, "input_schema": schema}
    if name == "DeferredToolPlaceholder":
        tool["defer_loading"] = True
    return tool


TOOLS = [_tool(name) for name in TOOL_NAMES]
SYSTEM: list[dict[str, Any]] = [
    {"type": "text", "text": BILLING},
    {"type": "text", "text": INTRO, "cache_control": {"type": "ephemeral"}},
    {"type": "text", "text": AGENT_PROMPT, "cache_control": {"type": "ephemeral"}},
]
FIRST_USER = {"role": "user", "content": [{"type": "text", "text": REMINDER}, {"type": "text", "text": TASK}]}


def _settings(**changes: Any) -> dict[str, Any]:
    """What Claude Code sets on every call, besides messages."""
    settings: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 32000,
        "system": SYSTEM,
        "tools": TOOLS,
        "thinking": {"type": "adaptive", "display": "omitted"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"},
        "metadata": {"user_id": json.dumps({"device_id": "d0", "account_uuid": "", "session_id": "cc-1"})},
        "betas": BETAS,
        "extra_query": {"beta": "true"},  # Claude Code's SDK adds it to every beta call; this one does not
    }
    settings.update(changes)
    return settings


class RecordingEngine(ScriptedEngine):
    """The scripted engine, keeping every prompt it was given."""

    def __init__(self, end_of_turn: int, *, context_length: int = 1 << 20) -> None:
        super().__init__([], end_of_turn, context_length=context_length)
        self.prompts: list[list[int]] = []

    async def generate(
        self, prompt: Sequence[int], params: SamplingParams, **options: Any
    ) -> AsyncGenerator[SampledToken, None]:
        self.prompts.append(list(prompt))
        async for token in super().generate(prompt, params, **options):
            yield token


class Served:
    def __init__(self, url: str, renderer: Renderer, engine: RecordingEngine, end: int) -> None:
        self.url, self.renderer, self.engine, self.end = url, renderer, engine, end
        self.queries: list[str] = []  # the query string of every request the SDK sent

    def push(self, text: str) -> list[int]:
        """The engine's next reply: `text` and the turn close, as token IDs."""
        tokens = [*self.renderer.tokenizer.encode(text), self.end]
        self.engine.push(tokens)
        return tokens

    def client(self, session: str, *, harness_header: bool = True) -> anthropic.Anthropic:
        def seen(request: httpx2.Request) -> None:
            self.queries.append(request.url.query.decode())

        http = httpx2.Client(event_hooks={"request": [seen]})
        headers = {"X-Claude-Code-Session-Id": "cc-1", "x-app": "cli"} if harness_header else {}
        return anthropic.Anthropic(
            base_url=f"{self.url}/sessions/{session}",
            api_key="sk-ant-dummy",
            http_client=http,
            max_retries=0,
            default_headers=headers,
        )

    def summary(self, session: str) -> dict[str, Any]:
        data: dict[str, Any] = httpx.get(f"{self.url}/sessions/{session}").json()
        return data


def _served(tmp_path: Path, family: str, context_length: int = 1 << 20, *, clip: bool = False) -> Iterator[Served]:
    renderer = hf_renderer(materialise(family, tmp_path))
    end = renderer.tokenizer.encode("<|im_end|>")[0]
    engine = RecordingEngine(end, context_length=context_length)
    app = build(engine, renderer, model=MODEL, clip_max_tokens=clip).app
    with serving(app) as url:
        yield Served(url, renderer, engine, end)


@pytest.fixture
def qwen25(tmp_path: Path) -> Iterator[Served]:
    yield from _served(tmp_path, "qwen2.5")


@pytest.fixture
def qwen3(tmp_path: Path) -> Iterator[Served]:
    yield from _served(tmp_path, "qwen3")


def _streamed(client: anthropic.Anthropic, messages: list[Any], **settings: Any) -> tuple[Any, list[str]]:
    """One call as Claude Code makes it (streamed); the final message and the stream's event types."""
    with client.beta.messages.stream(messages=messages, **_settings(**settings)) as stream:
        kinds = [event.delta.type if event.type == "content_block_delta" else event.type for event in stream]
        return stream.get_final_message(), kinds


def _count(client: anthropic.Anthropic, messages: list[Any], **settings: Any) -> int:
    fields = {
        k: v
        for k, v in _settings(**settings).items()
        if k in ("model", "system", "tools", "thinking", "betas", "extra_query")
    }
    counted = client.beta.messages.count_tokens(messages=messages, **fields)
    return counted.input_tokens


def _chat_tools() -> list[dict[str, Any]]:
    """The tools as a chat template is given them, written out here independently of the dialect."""
    return [
        {
            "type": "function",
            "function": {"name": t["name"], "parameters": t["input_schema"], "description": t["description"]},
        }
        for t in TOOLS
    ]


def test_claude_code_episode_extends_the_tape(qwen25: Served) -> None:
    served = qwen25
    client = served.client("cc-episode")
    sampled = served.push(CALL)
    served.push(ANSWER)
    environment_blocks = [{"type": "text", "text": ENVIRONMENT, "cache_control": {"type": "ephemeral"}}]
    # the system message carries its own output_config, as Claude Code's does
    history: list[Any] = [FIRST_USER, {"role": "system", "content": environment_blocks, "output_config": {}}]

    counted = _count(client, history)
    first, kinds = _streamed(client, history)
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert first.stop_reason == "tool_use"
    (use,) = [block for block in first.content if block.type == "tool_use"]
    assert use.name == "Bash" and use.input == {"command": "echo hello > out.txt"}
    prompt = served.engine.prompts[0]
    assert counted == len(prompt) == first.usage.input_tokens
    # what the model saw: the system prompt without the billing line, and the environment as a system
    # turn after the first user turn, rendered by the template from messages written out by hand
    expected = [
        {"role": "system", "content": INTRO + AGENT_PROMPT},
        {"role": "user", "content": REMINDER + TASK},
        {"role": "system", "content": ENVIRONMENT},
    ]
    options = RenderOptions(tools=_chat_tools())
    assert prompt == served.renderer.prompt(expected, options).tokens
    assert "x-anthropic-billing-header" not in served.renderer.tokenizer.decode(prompt)

    # turn 2, as Claude Code resends it: the system message now a plain string, the tool_use echoed,
    # the tool_result (a string, cache_control moved onto it) and a reminder in the same user turn
    history = [
        FIRST_USER,
        {"role": "system", "content": ENVIRONMENT},
        {"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in first.content]},
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": use.id,
                    "content": "(Bash completed with no output)",
                    "is_error": False,
                    "cache_control": {"type": "ephemeral"},
                },
                {"type": "text", "text": LATER_REMINDER},
            ],
        },
    ]
    counted = _count(client, history)
    second, _ = _streamed(client, history)
    assert second.stop_reason == "end_turn" and second.content[-1].text == ANSWER
    second_prompt = served.engine.prompts[1]
    assert counted == len(second_prompt) == second.usage.input_tokens
    assert second_prompt[: len(prompt) + len(sampled)] == prompt + sampled  # the tape extends
    summary = served.summary("cc-episode")
    assert (summary["turns"], summary["branches"], summary["rewrites"]) == (2, 1, 0)
    assert served.queries and all(query == "beta=true" for query in served.queries)


def test_thinking_switch_and_omitted_display(qwen3: Served) -> None:
    """`enabled` and `adaptive` open the template's thinking, `disabled` closes it (Qwen3 then writes an
    empty think block into the generation prompt); `display: omitted` sends thinking blocks with
    empty text while the tape keeps the reasoning the engine sampled."""
    served = qwen3
    client = served.client("cc-thinking")
    closed = "assistant\n<think>\n\n</think>\n\n"  # the special tokens decode to nothing
    cases: list[tuple[dict[str, Any], bool, list[str]]] = [
        ({"type": "enabled", "budget_tokens": 2048}, False, ["Short."]),
        ({"type": "adaptive", "display": "summarized"}, False, ["Short."]),
        ({"type": "adaptive", "display": "omitted"}, False, [""]),
        ({"type": "disabled"}, True, []),
    ]
    for i, (thinking, closes, shown) in enumerate(cases):
        # a model told not to think writes no think block; one that may think does
        sampled = served.push("Hi." if closes else "<think>\nShort.\n</think>\n\nHi.")
        reply, kinds = _streamed(client, [{"role": "user", "content": f"Say hi ({i})"}], thinking=thinking)
        prompt = served.engine.prompts[-1]
        assert served.renderer.tokenizer.decode(prompt).endswith(closed) is closes
        assert [block.thinking for block in reply.content if block.type == "thinking"] == shown
        assert ("thinking_delta" in kinds) is (shown == ["Short."])
        assert reply.content[-1].text == "Hi."
        assert reply.usage.output_tokens == len(sampled)  # every sampled token counted, shown or not


def test_dropped_reasoning_goes_through_the_rewrite_policy(qwen3: Served) -> None:
    """Qwen3's template drops an earlier reply's reasoning once a new user message follows it (the
    reminder beside the tool result is one), and Claude Code's clear-thinking edit lets it drop the
    thinking blocks itself: the history no longer renders as recorded. Under `tape` the engine is
    given the tape (reasoning kept) and the rewrite is counted; under `strict` it is a 409."""
    served = qwen3
    for policy in ("strict", "tape"):
        client = served.client(f"cc-rewrite-{policy}")
        policy_field = {"extra_body": {"rewrite_policy": policy}}
        sampled = served.push("<think>\nI will use the shell.\n</think>\n\n" + CALL)
        history: list[Any] = [FIRST_USER]
        first, _ = _streamed(client, history, **policy_field)
        assert [block.type for block in first.content] == ["thinking", "tool_use"]
        assert first.content[0].thinking == ""  # omitted
        (use,) = [block for block in first.content if block.type == "tool_use"]
        result = {"type": "tool_result", "tool_use_id": use.id, "content": "(Bash completed with no output)"}
        # the client drops the thinking block and adds a reminder after the tool result
        history += [
            {"role": "assistant", "content": [use.model_dump(exclude_none=True)]},
            {"role": "user", "content": [result, {"type": "text", "text": LATER_REMINDER}]},
        ]
        if policy == "strict":
            with pytest.raises(anthropic.ConflictError) as refused:
                _streamed(client, history, **policy_field)
            assert refused.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
            assert len(served.engine.prompts) == 1  # refused before the engine
            continue
        served.push(ANSWER)
        second, _ = _streamed(client, history, **policy_field)
        assert second.content[-1].text == ANSWER
        prompt, after = served.engine.prompts[-2:]
        assert after[: len(prompt) + len(sampled)] == prompt + sampled  # the tape, reasoning and all
        summary = served.summary(f"cc-rewrite-{policy}")
        assert (summary["turns"], summary["branches"], summary["rewrites"]) == (2, 1, 1)


def test_refusals_speak_anthropics_words(qwen25: Served) -> None:
    """Context edits other than clear-thinking are refused in the words Claude Code matches (it then
    stops sending the edit); unknown thinking types and efforts are 400s naming the field."""
    client = qwen25.client("cc-refusals")
    messages: list[Any] = [{"role": "user", "content": "Hi"}]
    edit = {"edits": [{"type": "clear_tool_uses_20250919", "trigger": {"type": "tool_uses", "value": 30}}]}
    with pytest.raises(anthropic.BadRequestError) as refused:
        _streamed(client, messages, context_management=edit)
    message = refused.value.body["error"]["message"]  # type: ignore[index]
    assert re.match(
        r"^\S{1,128} does not support the \W?clear_tool_uses_20250919\W? context management strategy", message
    )
    bad_fields = (
        ("thinking.type", {"thinking": {"type": "sometimes"}}),
        ("effort", {"output_config": {"effort": "huge"}}),
    )
    for field, change in bad_fields:
        with pytest.raises(anthropic.BadRequestError) as bad:
            _streamed(client, messages, **change)
        assert field in bad.value.message
    assert qwen25.engine.prompts == []  # nothing reached the engine


def test_count_tokens_route_errors_and_keys(qwen25: Served) -> None:
    client = qwen25.client("cc-count")
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.count_tokens(model="claude-unknown", messages=[{"role": "user", "content": "Hi"}])
    assert missing.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError) as empty:
        client.messages.count_tokens(model=MODEL, messages=[])
    assert empty.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    assert qwen25.engine.prompts == []
    assert shape_for_path("/sessions/s/v1/messages/count_tokens") is ANTHROPIC_ERRORS
    # a session key may count its own session's tokens, not another's; and counting is not sampling
    assert auth.decide(auth.Kind.SESSION, "/sessions/s/v1/messages/count_tokens", key_session="s") is None
    assert auth.decide(auth.Kind.SESSION, "/v1/messages/count_tokens", key_session="s") is None
    assert auth.decide(auth.Kind.SESSION, "/sessions/t/v1/messages/count_tokens", key_session="s") is not None
    assert not auth.is_generation("/v1/messages/count_tokens")


@pytest.fixture
def small_context(tmp_path: Path) -> Iterator[Served]:
    yield from _served(tmp_path, "qwen2.5", context_length=6000)


def test_max_tokens_past_the_context_in_anthropics_words(small_context: Served) -> None:
    """Claude Code asks for up to 128000 tokens whatever the model. As vLLM does, a request whose prompt
    and max_tokens pass the context is refused, not cut, and nothing is recorded; the refusal is worded
    as Anthropic's API words it, which Claude Code parses and asks again with max_tokens = context -
    input - 1000 (its own rule, replayed here). A prompt that fills the context is Anthropic's
    "prompt is too long", on which Claude Code compacts."""
    served = small_context
    client = served.client("cc-room", harness_header=False)
    history: list[Any] = [FIRST_USER]
    settings = {"tools": [], "max_tokens": 128000}
    counted = _count(client, history, tools=[])
    with pytest.raises(anthropic.BadRequestError) as refused:
        _streamed(client, history, **settings)
    message = refused.value.body["error"]["message"]  # type: ignore[index]
    found = re.search(r"input length and `max_tokens` exceed context limit: (\d+) \+ (\d+) > (\d+)", message)
    assert found is not None, message
    assert tuple(int(n) for n in found.groups()) == (counted, 128000, 6000)
    assert served.engine.prompts == [] and served.summary("cc-room").get("turns", 0) == 0
    served.push(ANSWER)
    answer, _ = _streamed(client, history, tools=[], max_tokens=6000 - counted - 1000)
    assert answer.content[-1].text == ANSWER and len(served.engine.prompts[0]) == counted
    summary = served.summary("cc-room")
    assert (summary["turns"], summary["branches"], summary["rewrites"]) == (1, 1, 0)
    # a prompt longer than the context
    long_history: list[Any] = [{"role": "user", "content": "hello " * 7000}]
    with pytest.raises(anthropic.BadRequestError) as too_long:
        _streamed(client, long_history, tools=[], max_tokens=10)
    assert re.match(r"^prompt is too long: \d+ tokens > 5999 maximum$", too_long.value.body["error"]["message"])  # type: ignore[index]


def test_a_clipped_reply_that_fills_the_context(tmp_path: Path) -> None:
    """Where `max_tokens` past the room left is clipped to it (`clip_max_tokens`, a harness's session),
    a reply that runs to the end of the context stopped for Anthropic's `model_context_window_exceeded`;
    one that runs to a `max_tokens` that fit stopped for `max_tokens`."""
    for served in _served(tmp_path, "qwen2.5", context_length=6000, clip=True):
        client = served.client("cc-clip", harness_header=False)
        served.push("word " * 6000)
        filled, _ = _streamed(client, [FIRST_USER], tools=[], max_tokens=128000)
        assert filled.stop_reason == "model_context_window_exceeded"
        assert filled.usage.input_tokens + filled.usage.output_tokens == 6000
        served.push("word " * 50)
        cut, _ = _streamed(client, [{"role": "user", "content": "Count."}], tools=[], max_tokens=5)
        assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 5
