"""Gateway CPU per call at the request shapes and sizes today's coding-agent harnesses send.

Four harnesses, each as it speaks on the wire (captured from Claude Code 2.1.328, Codex CLI 0.169.0,
opencode 1.18.33 and mini-swe-agent 2.4.6): its route, headers, session identity, streaming, system
and developer prompts, tool list and the shape in which it echoes each assistant turn and its tool's
result. The texts are filler of the captured lengths and structure (block counts, roles, tools with
their parameters and schema sizes, as many non-ASCII characters as the captured texts hold), not the
harnesses' own prompts: runs of words from a few standard library modules' docstrings.

- Claude Code: `POST /v1/messages?beta=true`, streamed; `system` as 3 text blocks (2 with
  cache_control), a `system` message inside `messages` (blocks with cache_control on the first
  call, a plain string after), 12 tools (~32 KB of JSON, one deferred), thinking adaptive,
  context_management, output_config, its session in `X-Claude-Code-Session-Id` and
  `metadata.user_id`; each reply echoed as a `tool_use` block, its result a `tool_result` string
  carrying the cache_control that moves to the last block.
- Codex: `POST /v1/responses`, streamed; no instructions: a 17k-char developer message, a second
  developer message of 2 parts, 2 user messages, every item with an id; 9 tools (a namespace of 5
  functions, a hosted web_search); store false, include reasoning.encrypted_content,
  prompt_cache_key, client_metadata, session-id headers; each reply echoed as a `function_call`
  item, its result a `function_call_output` item.
- opencode: `POST /v1/chat/completions`, streamed with usage; a 9.5k-char system message, 9 tools,
  `X-Session-ID`; replies echoed with `content: ""` and compact arguments.
- mini-swe-agent: `POST /sessions/{id}/v1/chat/completions` (it sends no session id), not
  streamed, 1 tool, a 2.9k-char user message; replies echoed with no `content` key, its result a
  JSON string.

Each request goes through the whole ASGI app in-process (guard, dialect, gateway, tape, store,
response bytes) over Qwen2.5's real tokenizer and chat template (tests/support/models.py) and a
scripted instant engine that answers every turn with a Hermes tool call
(`<tool_call>\\n{"name": .., "arguments": {..}}\\n</tool_call>`, as Qwen samples it), so the figures
are the server's own work; the collector settled as in `tokentape serve`. The client reads the
reply (untimed), echoes it in its dialect's shape with a 1-2 KB tool result, and the history grows
turn by turn to 40 turns. CPU time (all threads: the response waits for the store's commit) of the
calls at turns 1, 10 and 40; the harnesses take turns call by call, a fresh episode each round, the
median over rounds. Beside it, one full re-render and re-tokenization of the same conversation (the
renderer's whole-prompt path on the chat call the dialect made, what a gateway that keeps no tape
pays every call), median of the same number of runs. A measured turn whose prompt differs from that
re-render is flagged; a refused call (any status but 200) stops the run with the gateway's answer.

    python benchmarks/harness_calls.py [--rounds 9] [--warmup 1] [--turns 1 10 40]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar, NamedTuple

import orjson

from tokentape.core.sampling import SamplingParams
from tokentape.engines.base import Constraint, SampledToken
from tokentape.engines.scripted import ScriptedEngine
from tokentape.gateway.service import ChatCall, Gateway
from tokentape.render.renderer import Renderer
from tokentape.runtime import hf_renderer
from tokentape.served import ServeSpec, build_served
from tokentape.server.heap import settle_for_serving

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.support.models import materialise

MODEL = "qwen"
HARNESSES = ("claude-code", "codex", "opencode", "mini-swe-agent")


# -- filler text of a given length --------------------------------------------------------------------
def _corpus() -> list[str]:
    """Words of running English technical prose: the docstrings of a few standard library modules
    and their public classes and functions (ASCII words only)."""
    import contextlib
    import logging
    import shutil
    import subprocess
    import tarfile
    import textwrap
    import unittest

    docs = []
    for module in (argparse, subprocess, json, logging, unittest, textwrap, shutil, tarfile, contextlib, tempfile):
        docs.append(module.__doc__ or "")
        for name, value in sorted(vars(module).items()):
            if not name.startswith("_") and getattr(value, "__module__", None) == module.__name__:
                docs.append(getattr(value, "__doc__", None) or "")
    return [word for word in " ".join(docs).split() if word.isascii()]


WORDS = _corpus()
UNICODE = "\u2014\u2013\u2192\u2026\u00d7\u2264\u2019\u201c\u201d"  # dashes, arrow, quotes, as the prompts hold a few


def filler(length: int, seed: int, *, lines: bool = True, unicode: int = 0) -> str:
    """Text of exactly `length` characters: runs of words from WORDS, in lines of ~60-110 with a
    heading or a bullet now and then when `lines`; `unicode` of its spaces made typographic
    characters (not ASCII). The same for the same seed."""
    rng = random.Random(seed)
    parts: list[str] = []
    size = 0
    line = 0
    at, run = 0, 0
    while size < length:
        if run == 0:
            at, run = rng.randrange(len(WORDS)), rng.randint(5, 30)
        if lines and line > 20 and rng.random() < 0.02:
            heading = " ".join(WORDS[(at + i) % len(WORDS)] for i in range(rng.randint(2, 4))).capitalize()
            piece, line = f"\n\n# {heading}\n", 0
        elif lines and line > 20 and rng.random() < 0.03:
            piece, line = "\n-", 1
        elif lines and line > rng.randint(60, 110):
            piece, line = "\n", 0
        else:
            piece = (" " if line else "") + WORDS[at % len(WORDS)]
            at, run = at + 1, run - 1
            line += len(piece)
        parts.append(piece)
        size += len(piece)
    text = list("".join(parts)[:length])
    for at in rng.sample([i for i, c in enumerate(text) if c == " "], min(unicode, text.count(" "))):
        text[at] = rng.choice(UNICODE)
    return "".join(text)


# -- tool lists: each tool's name, description and schema JSON sizes (characters), its parameters (name,
# type, description characters), the ones required, and how many non-ASCII characters its texts hold
class ToolSpec(NamedTuple):
    name: str
    description: int
    schema: int
    params: list[tuple[str, str, int]]
    required: list[str]
    unicode: int = 0


# fmt: off
CLAUDE_TOOLS = [
    ToolSpec("Agent", 3225, 2010, [("description", "string", 42), ("prompt", "string", 33),
             ("subagent_type", "string", 50), ("model", "enum", 358), ("effort", "enum", 341),
             ("run_in_background", "boolean", 286), ("isolation", "enum", 221)], ["description", "prompt"], 13),
    ToolSpec("Bash", 2110, 1783, [("command", "string", 22), ("timeout", "number", 70), ("description", "string", 926),
             ("run_in_background", "boolean", 181), ("dangerouslyDisableSandbox", "boolean", 90)], ["command"], 7),
    ToolSpec("Edit", 360, 584, [("file_path", "string", 39), ("old_string", "string", 19),
             ("new_string", "string", 63), ("replace_all", "boolean", 53)],
             ["file_path", "old_string", "new_string"], 1),
    ToolSpec("ListAgents", 1433, 499, [("channel", "string", 41), ("q", "string", 41), ("cursor", "string", 96)],
             [], 5),
    ToolSpec("Read", 790, 1112, [("file_path", "string", 37), ("offset", "integer", 92), ("limit", "integer", 83),
             ("pages", "string", 113), ("allow_large", "boolean", 281)], ["file_path"], 2),
    ToolSpec("ReportFindings", 574, 1896, [("level", "enum", 30), ("findings", "array", 60)], ["findings"], 2),
    ToolSpec("ScheduleWakeup", 3396, 1423, [("delaySeconds", "number", 98), ("reason", "string", 136),
             ("prompt", "string", 355), ("stop", "boolean", 154), ("noop", "boolean", 307)], [], 19),
    ToolSpec("Skill", 1417, 345, [("skill", "string", 71), ("args", "string", 32)], ["skill"], 4),
    ToolSpec("ToolSearch", 952, 427, [("query", "string", 99), ("max_results", "number", 48)],
             ["query", "max_results"], 5),
    ToolSpec("Workflow", 3496, 2150, [("script", "string", 207), ("name", "string", 105),
             ("description", "string", 68), ("title", "string", 62), ("args", "object", 280),
             ("scriptPath", "string", 329), ("resumeFromRunId", "string", 568)], [], 14),
    ToolSpec("DeferredToolPlaceholder", 83, 36, [], []),  # defer_loading, an empty schema
    ToolSpec("Write", 240, 367, [("file_path", "string", 71), ("content", "string", 32)], ["file_path", "content"]),
]

CODEX_TOOLS = [
    ToolSpec("exec_command", 82, 1457, [("cmd", "string", 25), ("justification", "string", 70),
             ("login", "boolean", 80), ("max_output_tokens", "number", 87), ("prefix_rule", "array", 118),
             ("sandbox_permissions", "enum", 107), ("shell", "string", 61), ("tty", "boolean", 72),
             ("workdir", "string", 60), ("yield_time_ms", "number", 83)], ["cmd"]),
    ToolSpec("write_stdin", 80, 644, [("chars", "string", 72), ("max_output_tokens", "number", 87),
             ("session_id", "number", 47), ("yield_time_ms", "number", 128)], ["session_id"]),
    ToolSpec("request_user_input", 120, 1203, [("questions", "array", 56)], ["questions"]),
    ToolSpec("view_image", 124, 173, [("path", "string", 39)], ["path"]),
    # here the namespace of CODEX_NAMESPACE's functions; then these, then the hosted web_search
    ToolSpec("get_goal", 122, 83, [], []),
    ToolSpec("create_goal", 265, 424, [("objective", "string", 151), ("token_budget", "integer", 73)], ["objective"]),
    ToolSpec("update_goal", 1541, 551, [("status", "enum", 370)], ["status"]),
]
CODEX_NAMESPACE = [
    ToolSpec("close_agent", 298, 175, [("target", "string", 37)], ["target"]),
    ToolSpec("resume_agent", 89, 149, [("id", "string", 19)], ["id"]),
    ToolSpec("send_input", 215, 1356, [("interrupt", "boolean", 98), ("items", "array", 96),
             ("message", "string", 76), ("target", "string", 39)], ["target"]),
    ToolSpec("spawn_agent", 5033, 1518, [("fork_context", "boolean", 111), ("items", "array", 96),
             ("message", "string", 71), ("model", "string", 77), ("reasoning_effort", "string", 79)], []),
    ToolSpec("wait_agent", 252, 418, [("targets", "array", 77), ("timeout_ms", "number", 120)], ["targets"]),
]

OPENCODE_TOOLS = [
    ToolSpec("bash", 4628, 519, [("command", "string", 22), ("timeout", "integer", 32), ("workdir", "string", 114)],
             ["command"]),
    ToolSpec("edit", 1369, 526, [("filePath", "string", 39), ("oldString", "string", 19),
             ("newString", "string", 62), ("replaceAll", "boolean", 52)], ["filePath", "oldString", "newString"]),
    ToolSpec("glob", 517, 526, [("pattern", "string", 39), ("path", "string", 268)], ["pattern"]),
    ToolSpec("grep", 657, 452, [("pattern", "string", 48), ("path", "string", 70), ("include", "string", 65)],
             ["pattern"]),
    ToolSpec("read", 1158, 508, [("filePath", "string", 50), ("offset", "integer", 49), ("limit", "integer", 54)],
             ["filePath"]),
    ToolSpec("skill", 399, 205, [("name", "string", 43)], ["name"]),
    ToolSpec("task", 3019, 757, [("description", "string", 43), ("prompt", "string", 33),
             ("subagent_type", "string", 50), ("task_id", "string", 187), ("command", "string", 36)],
             ["description", "prompt", "subagent_type"]),
    ToolSpec("todowrite", 2012, 570, [("todos", "array", 21)], ["todos"]),
    ToolSpec("write", 623, 334, [("content", "string", 32), ("filePath", "string", 71)], ["content", "filePath"]),
]

MSWEA_TOOLS = [ToolSpec("bash", 22, 136, [("command", "string", 27)], ["command"])]
# fmt: on

DRAFT = "https://json-schema.org/draft/2020-12/schema"


def schema(spec: ToolSpec, seed: int, *, draft: bool, closed: bool) -> dict[str, Any]:
    """A JSON schema with the spec's parameters, their descriptions of the spec's lengths, padded
    (the longest description grows) to the spec's JSON size."""
    properties: dict[str, Any] = {}
    for index, (param, kind, chars) in enumerate(spec.params):
        prop: dict[str, Any] = {"description": filler(chars, seed + index, lines=False)}
        if kind == "enum":
            prop |= {"type": "string", "enum": [f"{param}_{i}" for i in range(4)]}
        elif kind == "array":
            prop |= {"type": "array", "items": {"type": "object", "properties": {"text": {"type": "string"}}}}
        elif kind != "object":
            prop["type"] = kind
        properties[param] = prop
    out: dict[str, Any] = {"$schema": DRAFT} if draft and properties else {}
    out |= {"type": "object", "properties": properties}
    if spec.required or (closed and properties):
        out["required"] = spec.required
    if closed and properties:
        out["additionalProperties"] = False
    if properties:
        longest = max(properties.values(), key=lambda p: len(p["description"]))
        missing = spec.schema - len(json.dumps(out))
        longest["description"] = filler(max(0, len(longest["description"]) + missing), seed, lines=False)
    return out


def function(spec: ToolSpec, seed: int, *, draft: bool, closed: bool) -> dict[str, Any]:
    """name, description, parameters"""
    description = filler(spec.description, seed, unicode=spec.unicode)
    return {"name": spec.name, "description": description, "parameters": schema(spec, seed, draft=draft, closed=closed)}


def claude_tools() -> list[dict[str, Any]]:
    tools = []
    for index, spec in enumerate(CLAUDE_TOOLS):
        tool = function(spec, 100 * (index + 1), draft=True, closed=True)
        tool["input_schema"] = tool.pop("parameters")
        if not spec.params:  # the deferred tools' placeholder
            tool["defer_loading"] = True
        tools.append(tool)
    return tools


def codex_tools() -> list[dict[str, Any]]:
    def codex_function(spec: ToolSpec, seed: int) -> dict[str, Any]:
        tool = function(spec, seed, draft=False, closed=True)
        return {
            "type": "function",
            "name": spec.name,
            "description": tool["description"],
            "strict": False,
            "parameters": tool["parameters"],
        }

    head = [codex_function(spec, 2000 + 100 * i) for i, spec in enumerate(CODEX_TOOLS[:4])]
    inner = [codex_function(spec, 3000 + 100 * i) for i, spec in enumerate(CODEX_NAMESPACE)]
    namespace = {"type": "namespace", "name": "multi_agent_v1", "description": filler(43, 2999), "tools": inner}
    tail = [codex_function(spec, 4000 + 100 * i) for i, spec in enumerate(CODEX_TOOLS[4:])]
    return [*head, namespace, *tail, {"type": "web_search", "external_web_access": True}]


def chat_tools(specs: list[ToolSpec], seed: int, *, draft: bool) -> list[dict[str, Any]]:
    tools = [function(spec, seed + 100 * i, draft=draft, closed=False) for i, spec in enumerate(specs)]
    return [{"type": "function", "function": tool} for tool in tools]


# -- what the client does between calls ------------------------------------------------------------
def command(turn: int) -> str:
    return f"grep -rn 'handler_{turn}' src/module_{turn % 7}/ | head -n 40"


def tool_output(turn: int, seed: int) -> str:
    """A command's output: lines of `path:line: text`, 1-2 KB by the turn (the same in every
    episode), their text by the episode."""
    rng = random.Random(seed * 1000 + turn)
    size = 1000 + (turn * 397) % 1000
    lines: list[str] = []
    while sum(map(len, lines)) + len(lines) < size:
        text = filler(rng.randint(30, 90), rng.randrange(1 << 30), lines=False)
        lines.append(f"src/module_{turn % 7}/file_{rng.randint(1, 60)}.py:{rng.randint(1, 900)}: {text}")
    return "\n".join(lines)[:size]


def hermes(name: str, arguments: dict[str, Any]) -> str:
    """A tool call as Qwen2.5 samples it."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def sse_events(body: bytes) -> list[dict[str, Any]]:
    return [orjson.loads(line[6:]) for line in body.split(b"\n") if line.startswith(b"data: {")]


Request = tuple[str, bytes, list[tuple[bytes, bytes]], bytes]  # path, query, headers, body


class Episode:
    """One harness's conversation: its next request, and what it appends from each reply."""

    path = ""
    tool = ""  # its shell tool
    argument = "command"

    def __init__(self, seed: int) -> None:
        self.seed = seed  # the episode's: its session id and its tools' outputs
        self.id = str(uuid.UUID(int=random.Random(seed).getrandbits(128)))
        self.turn = 1

    def answer(self) -> str:
        """The text the engine samples this turn."""
        return hermes(self.tool, {self.argument: command(self.turn)})

    def output(self) -> str:
        return tool_output(self.turn, self.seed)

    def request(self) -> Request:
        raise NotImplementedError

    def reply(self, body: bytes) -> None:
        """Echo the reply and the tool's result into the history, as the harness does."""
        raise NotImplementedError


class ClaudeCode(Episode):
    path, tool = "/v1/messages", "Bash"
    tools = claude_tools()
    headers: ClassVar = [
        (b"user-agent", b"claude-cli/2.1.328 (external, sdk-cli)"),
        (b"anthropic-version", b"2023-06-01"),
        (b"anthropic-beta", b"claude-code-20250219,interleaved-thinking-2025-05-14,context-management-2025-06-27"),
        (b"x-api-key", b"sk-ant-unused"),
        (b"x-app", b"cli"),
        (b"x-stainless-retry-count", b"0"),
        (b"x-stainless-timeout", b"600"),
    ]

    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        cache = {"type": "ephemeral"}
        self.system = [
            {"type": "text", "text": filler(74, 1, lines=False)},
            {"type": "text", "text": filler(62, 2, lines=False), "cache_control": cache},
            {"type": "text", "text": filler(7026, 3, unicode=11), "cache_control": cache},
        ]
        self.environment = filler(9198, 4, unicode=14)
        prompt = [{"type": "text", "text": filler(580, 5, unicode=1)}, {"type": "text", "text": filler(56, 6)}]
        environment = [{"type": "text", "text": self.environment, "cache_control": cache}]
        self.messages: list[dict[str, Any]] = [
            {"role": "user", "content": prompt},
            {"role": "system", "content": environment, "output_config": {"effort": "medium"}},
        ]
        user_id = {"device_id": "0" * 64, "account_uuid": "", "session_id": self.id}
        self.metadata = {"user_id": json.dumps(user_id, separators=(",", ":"))}

    def request(self) -> Request:
        body = {
            "model": MODEL,
            "messages": self.messages,
            "system": self.system,
            "tools": self.tools,
            "metadata": self.metadata,
            "max_tokens": 128000,
            "thinking": {"type": "adaptive", "display": "omitted"},
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
            "output_config": {"effort": "medium"},
            "stream": True,
        }
        headers = [*self.headers, (b"x-claude-code-session-id", self.id.encode())]
        return self.path, b"beta=true", headers, orjson.dumps(body)

    def reply(self, body: bytes) -> None:
        call: dict[str, Any] = {}
        arguments = ""
        for event in sse_events(body):
            if event["type"] == "content_block_start" and event["content_block"]["type"] == "tool_use":
                call = event["content_block"]
            elif event["type"] == "content_block_delta" and event["delta"]["type"] == "input_json_delta":
                arguments += event["delta"]["partial_json"]
        block = {"type": "tool_use", "id": call["id"], "name": call["name"], "input": json.loads(arguments)}
        if self.turn > 1:  # cache_control moves to the last block
            self.messages[-1]["content"][-1].pop("cache_control")
        self.messages[1]["content"] = self.environment  # re-sent as a plain string after the first call
        self.messages.append({"role": "assistant", "content": [block]})
        result = {
            "tool_use_id": call["id"],
            "type": "tool_result",
            "content": self.output(),
            "is_error": False,
            "cache_control": {"type": "ephemeral"},
        }
        self.messages.append({"role": "user", "content": [result]})
        self.turn += 1


class Codex(Episode):
    path, tool, argument = "/v1/responses", "exec_command", "cmd"
    tools = codex_tools()

    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        rng = random.Random(seed)

        def message(role: str, *texts: str) -> dict[str, Any]:
            content = [{"type": "input_text", "text": text} for text in texts]
            item_id = f"msg_{uuid.UUID(int=rng.getrandbits(128))}"
            return {"type": "message", "id": item_id, "role": role, "content": content}

        self.input: list[dict[str, Any]] = [
            message("developer", filler(16979, 11, unicode=70)),
            message("developer", filler(2126, 12), filler(362, 13)),
            message("user", filler(355, 14)),
            message("user", filler(56, 15)),
        ]
        turn = {"session_id": self.id, "thread_id": self.id, "request_kind": "turn", "more": filler(560, 16)}
        metadata = json.dumps(turn, separators=(",", ":"))
        window = f"{self.id}:0"
        self.metadata = {
            "x-codex-turn-metadata": metadata,
            "session_id": self.id,
            "thread_id": self.id,
            "x-codex-installation-id": str(uuid.UUID(int=rng.getrandbits(128))),
            "x-codex-window-id": window,
            "turn_id": self.id,
            "root_turn_id": self.id,
        }
        self.headers = [
            (b"user-agent", b"codex_exec/0.169.0 (Debian 12.0.0; x86_64) dumb (codex_exec; 0.169.0)"),
            (b"originator", b"codex_exec"),
            (b"accept", b"text/event-stream"),
            (b"authorization", b"Bearer unused"),
            (b"session-id", self.id.encode()),
            (b"thread-id", self.id.encode()),
            (b"x-client-request-id", self.id.encode()),
            (b"x-codex-window-id", window.encode()),
            (b"x-codex-beta-features", b"remote_compaction_v2"),
            (b"x-codex-turn-metadata", metadata.encode()),
        ]

    def request(self) -> Request:
        body = {
            "model": MODEL,
            "stream": True,
            "input": self.input,
            "tools": self.tools,
            "tool_choice": "auto",
            "parallel_tool_calls": True,
            "reasoning": {"summary": "auto"},
            "store": False,
            "include": ["reasoning.encrypted_content"],
            "prompt_cache_key": self.id,
            "client_metadata": self.metadata,
        }
        return self.path, b"", self.headers, orjson.dumps(body)

    def reply(self, body: bytes) -> None:
        done = [event["item"] for event in sse_events(body) if event["type"] == "response.output_item.done"]
        (call,) = [item for item in done if item["type"] == "function_call"]
        fields = ("id", "name", "arguments", "call_id")
        self.input.append({"type": "function_call", "status": "completed", **{k: call[k] for k in fields}})
        head = f"Chunk ID: {self.turn:06x}\nWall time: 0.0100 seconds\nProcess exited with code 0\nOutput:\n"
        output_id = f"fco_{uuid.UUID(int=random.Random(self.seed + self.turn).getrandbits(128))}"
        output = head + self.output()
        self.input.append(
            {"type": "function_call_output", "id": output_id, "call_id": call["call_id"], "output": output}
        )
        self.turn += 1


def chat_tool_call(body: bytes, streamed: bool) -> dict[str, Any]:
    """The reply's one tool call, as chat completions' message holds it."""
    if not streamed:
        (call,) = orjson.loads(body)["choices"][0]["message"]["tool_calls"]
        return dict(call)
    id_, name, arguments = None, None, ""
    for event in sse_events(body):
        for choice in event.get("choices") or ():
            for delta in choice["delta"].get("tool_calls") or ():
                id_, name = id_ or delta.get("id"), name or delta.get("function", {}).get("name")
                arguments += delta.get("function", {}).get("arguments") or ""
    return {"id": id_, "type": "function", "function": {"name": name, "arguments": arguments}}


class Opencode(Episode):
    path, tool = "/v1/chat/completions", "bash"
    tools = chat_tools(OPENCODE_TOOLS, 5000, draft=True)

    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        self.id = f"ses_{self.id.replace('-', '')[:26]}"
        self.messages: list[dict[str, Any]] = [
            {"role": "system", "content": filler(9534, 21)},
            {"role": "user", "content": filler(58, 22, lines=False)},
        ]
        self.headers = [
            (b"user-agent", b"opencode/1.18.33 ai-sdk/provider-utils/4.0.23 runtime/bun/1.3.14"),
            (b"authorization", b"Bearer unused"),
            (b"x-session-id", self.id.encode()),
            (b"x-session-affinity", self.id.encode()),
        ]

    def request(self) -> Request:
        body = {
            "model": MODEL,
            "max_tokens": 32000,
            "messages": self.messages,
            "tools": self.tools,
            "tool_choice": "auto",
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        return self.path, b"", self.headers, orjson.dumps(body)

    def reply(self, body: bytes) -> None:
        call = chat_tool_call(body, streamed=True)
        function = call["function"]
        arguments = json.dumps(json.loads(function["arguments"]), separators=(",", ":"))  # re-serialised
        echoed = {"id": call["id"], "type": "function", "function": {"name": function["name"], "arguments": arguments}}
        self.messages.append({"role": "assistant", "content": "", "tool_calls": [echoed]})
        self.messages.append({"role": "tool", "tool_call_id": call["id"], "content": self.output()})
        self.turn += 1


class MiniSweAgent(Episode):
    tool = "bash"
    tools = chat_tools(MSWEA_TOOLS, 6000, draft=False)
    headers: ClassVar = [
        (b"user-agent", b"OpenAI/Python 3.57.0"),
        (b"authorization", b"Bearer unused"),
        (b"x-stainless-retry-count", b"0"),
        (b"x-stainless-raw-response", b"true"),
    ]

    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        self.path = f"/sessions/mini-swe-agent-{self.id}/v1/chat/completions"  # it sends no session id
        self.messages: list[dict[str, Any]] = [
            {"role": "system", "content": filler(62, 31, lines=False)},
            {"role": "user", "content": filler(2895, 32)},
        ]

    def request(self) -> Request:
        body = {"model": MODEL, "messages": self.messages, "tools": self.tools}
        return self.path, b"", self.headers, orjson.dumps(body)

    def reply(self, body: bytes) -> None:
        call = chat_tool_call(body, streamed=False)
        function = call["function"]
        arguments = json.dumps(json.loads(function["arguments"]))
        echoed = {"function": {"arguments": arguments, "name": function["name"]}, "id": call["id"], "type": "function"}
        self.messages.append({"role": "assistant", "tool_calls": [echoed]})  # no content key
        result = json.dumps({"returncode": 0, "output": self.output()}, indent=2)
        self.messages.append({"content": result, "tool_call_id": call["id"], "role": "tool"})
        self.turn += 1


EPISODES: dict[str, Callable[[int], Episode]] = {
    "claude-code": ClaudeCode,
    "codex": Codex,
    "opencode": Opencode,
    "mini-swe-agent": MiniSweAgent,
}


# -- the server, in-process ---------------------------------------------------------------------------
class AnsweringEngine(ScriptedEngine):
    """The scripted engine (its answers pushed before each call), keeping the last prompt it was sent."""

    def __init__(self, renderer: Renderer) -> None:
        super().__init__([], renderer.tokenizer.encode(renderer.turn_close)[0])
        self.renderer = renderer
        self.prompt: Sequence[int] = ()

    async def generate(
        self,
        prompt: Sequence[int],
        params: SamplingParams,
        *,
        seed: int | None,
        session_id: str | None = None,
        constraint: Constraint | None = None,
        whole: bool = False,
    ) -> AsyncGenerator[SampledToken, None]:
        self.prompt = prompt
        async for token in super().generate(prompt, params, seed=seed, session_id=session_id, constraint=constraint):
            yield token


async def post(app: Any, path: str, query: bytes, headers: list[tuple[bytes, bytes]], body: bytes) -> tuple[int, bytes]:
    """One request through the ASGI app: its status and response body (the SSE stream, if streamed)."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": query,
        "root_path": "",
        "headers": [
            (b"host", b"127.0.0.1:8000"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            *headers,
        ],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 8000),
    }
    sent = False
    status = 0
    chunks: list[bytes] = []

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.sleep(3600)  # no disconnect while the answer is written
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    await app(scope, receive, send)
    return status, b"".join(chunks)


class Refused(Exception):
    pass


async def call(app: Any, engine: AnsweringEngine, episode: Episode) -> tuple[float, int]:
    """One turn: the request (built untimed), the call (timed: CPU seconds of all threads), the
    echo (untimed). The CPU seconds and the request's bytes."""
    path, query, headers, body = episode.request()
    engine.push([*engine.renderer.tokenizer.encode(episode.answer()), engine.end_of_turn])
    began = time.process_time()
    status, answer = await post(app, path, query, headers, body)
    spent = time.process_time() - began
    if status != 200:
        raise Refused(f"{type(episode).__name__} turn {episode.turn}: {status} {answer.decode(errors='replace')}")
    episode.reply(answer)
    return spent, len(body)


async def measure(
    args: argparse.Namespace, renderer: Renderer
) -> tuple[dict[tuple[str, int], list[float]], dict[tuple[str, int], tuple[ChatCall, list[int], int]]]:
    """CPU seconds of each measured call over the counted rounds, and from the first round the chat
    call the dialect made at each measured turn, the prompt the engine was sent and the request's
    bytes."""
    engine = AnsweringEngine(renderer)
    served = build_served(ServeSpec(served_model_name=MODEL), engine=engine, renderer=renderer)
    gateway: Gateway = served.gateway
    app = served.app
    await gateway.start()
    noted: dict[tuple[str, int], tuple[ChatCall, list[int], int]] = {}
    made: list[ChatCall] = []
    serve = gateway.run

    def noting(chat_call: ChatCall, *, streamed: bool = True) -> Any:
        made.append(chat_call)
        return serve(chat_call, streamed=streamed)

    gateway.run = noting  # type: ignore[method-assign,assignment]  # the first round only
    settle_for_serving()  # the collector as `tokentape serve` sets it
    spent: dict[tuple[str, int], list[float]] = {}
    try:
        for round_ in range(args.warmup + args.rounds):
            episodes = {name: EPISODES[name](1000 * round_ + i) for i, name in enumerate(HARNESSES)}
            for turn in range(1, max(args.turns) + 1):
                for name, episode in episodes.items():  # the harnesses take turns, call by call
                    took, size = await call(app, engine, episode)
                    if turn in args.turns and round_ == 0:
                        noted[(name, turn)] = (made[-1], list(engine.prompt), size)
                    elif turn in args.turns and round_ >= args.warmup:
                        spent.setdefault((name, turn), []).append(took)
            if round_ == 0:
                del gateway.run  # the class's own method again
    finally:
        await gateway.aclose()
    return spent, noted


def rerender(
    renderer: Renderer, noted: dict[tuple[str, int], tuple[ChatCall, list[int], int]], repeats: int
) -> dict[tuple[str, int], list[float]]:
    """CPU seconds of rendering and tokenizing each noted call's whole conversation, the calls
    taking turns."""
    spent: dict[tuple[str, int], list[float]] = {key: [] for key in noted}
    for _ in range(repeats):
        for key, (chat_call, _, _) in noted.items():
            began = time.process_time()
            renderer.prompt(chat_call.messages, chat_call.options)
            spent[key].append(time.process_time() - began)
    return spent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=9, help="episodes per harness counted")
    parser.add_argument("--warmup", type=int, default=1, help="episodes per harness run first, not counted (>= 1)")
    parser.add_argument("--turns", type=int, nargs="+", default=[1, 10, 40], help="the turns measured")
    args = parser.parse_args()
    args.warmup = max(1, args.warmup)
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as scratch:
        renderer = hf_renderer(materialise("qwen2.5", Path(scratch)))
        try:
            ours, noted = asyncio.run(measure(args, renderer))
        except Refused as refused:
            sys.exit(f"refused: {refused}")
        theirs = rerender(renderer, noted, args.rounds)
        same = {key: renderer.prompt(c.messages, c.options).tokens == tape for key, (c, tape, _) in noted.items()}
    calls = len(HARNESSES) * max(args.turns) * (args.warmup + args.rounds)
    took = time.monotonic() - started
    print(f"median of {args.rounds} rounds after {args.warmup} ({calls} calls), {took:.0f} s in all")
    print(f"load average {os.getloadavg()[0]:.1f}\n")
    print("| harness | turn | request KB | prompt tokens | gateway ms CPU per call | full re-render ms | ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name in HARNESSES:
        for turn in args.turns:
            _, tape, size = noted[(name, turn)]
            ours_ms = statistics.median(ours[(name, turn)]) * 1e3
            theirs_ms = statistics.median(theirs[(name, turn)]) * 1e3
            mark = "" if same[(name, turn)] else " (the re-render's tokens differ from the tape's)"
            cells = [name, str(turn), f"{size / 1024:.0f}", f"{len(tape):,}", f"{ours_ms:.2f}", f"{theirs_ms:.2f}"]
            print(f"| {' | '.join(cells)} | {theirs_ms / ours_ms:.2f}x{mark} |")


if __name__ == "__main__":
    main()
