"""The harness of the conformance corpus: an agent-like driver of the real gateway (a scripted engine
stands in for the model, as a test instrument) and the independent check of every turn.

The check does not use the renderer's anchors, sentinels or derived turn closes. For every later
turn it renders the *whole* conversation with the template (as recorded, with the options each turn
was sent with) and asks:
- is the engine prompt of turn k+1 exactly prompt k + the tokens sampled in turn k + a bridge?
- does the bridge decode to what the full rendering emits after the reply (the turn close the engine
  did not sample, the new messages, the generation prompt), and is it that text tokenized as one piece?
- is a rewrite reported exactly where the full rendering of the recorded history changes?
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from tokentape.core.export import export_session
from tokentape.core.reply import ToolFormat
from tokentape.core.sampling import SamplingParams
from tokentape.engines.scripted import ScriptedEngine
from tokentape.gateway.service import ChatCall, ChoiceDone, Gateway, Started
from tokentape.gateway.sessions import SessionRegistry
from tokentape.render.renderer import Renderer, RenderOptions
from tokentape.store.sqlite import SqliteStore

# The text each template writes right after an assistant reply, read off the templates by hand.
CLOSES = {
    "qwen2.5": "<|im_end|>\n",
    "qwen3": "<|im_end|>\n",
    "qwen3.5": "<|im_end|>\n",
    "qwen3.6": "<|im_end|>\n",
    "deepseek-r1": "<｜end▁of▁sentence｜>",
    "deepseek-v3": "<｜end▁of▁sentence｜>",
    "deepseek-v3.1": "<｜end▁of▁sentence｜>",
    "glm-4.5": "",  # the next role's opener ends a reply
    "glm-4.7": "",
    "glm-5": "",
    "minimax-m2": "[e~[\n",
    "llama3.2": "<|eot_id|>",
    "smollm2": "<|im_end|>\n",
}
# Another end-of-turn token the engine may sample instead of the template's close.
OTHER_ENDS = {
    "qwen2.5": "<|endoftext|>",
    "qwen3": "<|endoftext|>",
    "qwen3.5": "<|endoftext|>",
    "qwen3.6": "<|endoftext|>",
    "glm-4.5": "<|endoftext|>",
    "glm-4.7": "<|endoftext|>",
    "glm-5": "<|endoftext|>",
    "llama3.2": "<|eom_id|>",
    "smollm2": "<|endoftext|>",
}
# Templates that render several calls in one assistant message (Llama 3.2's rejects them).
PARALLEL_CALLS = {"qwen2.5", "qwen3", "qwen3.5", "qwen3.6", "deepseek-r1", "deepseek-v3", "deepseek-v3.1"} | {
    "glm-4.5",
    "glm-4.7",
    "glm-5",
    "minimax-m2",
    "smollm2",
}

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Local time in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
UNICODE = "Café naïve 東京 — emoji 🎉, combining é, RTL שלום"


def call_text(fmt: ToolFormat, calls: list[tuple[str, dict[str, Any]]], template: str) -> str:
    """What a model of the family samples to call `calls` (name, arguments)."""
    if fmt == "qwen_xml":
        return "\n".join(
            f"<tool_call>\n<function={name}>\n"
            + "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in args.items())
            + "</function>\n</tool_call>"
            for name, args in calls
        )
    if fmt == "glm":
        return "".join(
            f"<tool_call>{name}"
            + "".join(f"<arg_key>{k}</arg_key><arg_value>{v}</arg_value>" for k, v in args.items())
            + "</tool_call>"
            for name, args in calls
        )
    if fmt == "llama3":
        ((name, args),) = calls
        return json.dumps({"name": name, "parameters": args})
    if fmt == "deepseek":
        if "```json" in template:
            parts = [f"function<｜tool▁sep｜>{n}\n```json\n{json.dumps(a)}\n```" for n, a in calls]
        else:  # DeepSeek-V3.1
            parts = [f"{n}<｜tool▁sep｜>{json.dumps(a)}" for n, a in calls]
        body = "\n".join(f"<｜tool▁call▁begin｜>{p}<｜tool▁call▁end｜>" for p in parts)
        return f"<｜tool▁calls▁begin｜>{body}<｜tool▁calls▁end｜>"
    if fmt == "minimax":
        invokes = "".join(
            f'<invoke name="{name}">\n'
            + "".join(f'<parameter name="{k}">{v}</parameter>\n' for k, v in args.items())
            + "</invoke>\n"
            for name, args in calls
        )
        return f"<minimax:tool_call>\n{invokes}</minimax:tool_call>"
    return "\n".join(
        f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>" for name, args in calls
    )


def echo(reply: dict[str, Any]) -> dict[str, Any]:
    """What an agent sends back: content only (reasoning dropped), arguments re-serialised."""
    message: dict[str, Any] = {"role": "assistant", "content": reply.get("content")}
    if reply.get("tool_calls"):
        message["tool_calls"] = [
            {
                **call,
                "function": {
                    "name": call["function"]["name"],
                    "arguments": json.dumps(
                        json.loads(call["function"]["arguments"]), separators=(",", ":"), sort_keys=True
                    ),
                },
            }
            for call in reply["tool_calls"]
        ]
    return message


@dataclass
class Episode:
    """Drives one session as an agent would; `check` compares every turn with the full rendering."""

    family: str
    renderer: Renderer
    gateway: Gateway
    engine: ScriptedEngine
    session: str = "episode"
    tools: list[dict[str, Any]] | None = None
    template_kwargs: dict[str, Any] | None = None
    messages: list[dict[str, Any]] = field(default_factory=list)
    replies: list[dict[str, Any]] = field(default_factory=list)  # each turn's reply, as returned
    reply_at: list[int] = field(default_factory=list)  # each turn's reply position in `messages`
    options: list[RenderOptions] = field(default_factory=list)  # what each turn was sent with
    calls: list[tuple[list[int], list[int]]] = field(default_factory=list)  # (engine prompt, sampled)
    stops: list[int | None] = field(default_factory=list)
    expected_rewrites: list[int] = field(default_factory=list)

    @classmethod
    def of(cls, renderer: Renderer, family: str, *, tools: bool = False, policy: str = "tape") -> Episode:
        engine = ScriptedEngine([], 0)
        gateway = Gateway(engine, renderer, SessionRegistry(SqliteStore(":memory:"), default_policy=policy))  # type: ignore[arg-type]
        return cls(family, renderer, gateway, engine, tools=[WEATHER] if tools else None)

    # -- sampling ------------------------------------------------------------------------------------
    @property
    def opens_reasoning(self) -> bool:
        return self.renderer.prompt([{"role": "user", "content": "x"}], self.current).opens_reasoning

    @property
    def current(self) -> RenderOptions:
        return RenderOptions(tools=self.tools, template_kwargs=self.template_kwargs)

    def end(self, calls_tool: bool = False) -> int:
        """The end-of-turn token the model samples: the close's first token, or GLM's next opener."""
        close = CLOSES[self.family]
        text = close or ("<|observation|>" if calls_tool else "<|user|>")
        return self.renderer.tokenizer.encode(text)[0]

    def sample(self, answer: str, *, reasoning: str | None = None, calls_tool: bool = False) -> list[int]:
        """Tokens of a reply as the model would sample it (with reasoning where the family reasons)."""
        text = answer
        if self.renderer.reasoning and (reasoning is not None or self.opens_reasoning):
            thought = reasoning or "Let me think."
            text = (
                f"{thought}\n</think>\n\n{answer}"
                if self.opens_reasoning
                else f"<think>\n{thought}\n</think>\n\n{answer}"
            )
        return [*self.renderer.tokenizer.encode(text), self.end(calls_tool)]

    def calling(self, calls: list[tuple[str, dict[str, Any]]], reasoning: str | None = None) -> list[int]:
        text = call_text(self.renderer.tool_format, calls, self.renderer.template.source)
        return self.sample(text, reasoning=reasoning, calls_tool=True)

    # -- turns ---------------------------------------------------------------------------------------
    def render(self, messages: list[dict[str, Any]], generation: bool, options: RenderOptions) -> str:
        return self.renderer.render_text(messages, generation, options)

    async def turn(
        self, new: list[dict[str, Any]], sampled: list[int], *, max_tokens: int = 512, stop: list[str] | None = None
    ) -> ChoiceDone:
        first_new = len(self.messages)
        self.messages += new
        if self.replies:
            self._expect_rewrite(first_new)
        self.engine.push(sampled)
        call = ChatCall(
            messages=list(self.messages),
            sampling=SamplingParams(max_tokens=max_tokens, stop=stop or []),
            options=self.current,
            session_id=self.session,
            parse_tool_calls=self.tools is not None,
        )
        # every other turn as a client that reads only the result: one delta, the same reply
        events = [event async for event in self.gateway.chat(call, streamed=len(self.calls) % 2 == 0)]
        started, done = events[0], events[-1]
        assert isinstance(started, Started) and isinstance(done, ChoiceDone)
        ids = [t.token_id for t in done.tokens]
        if not self.calls:
            whole = self.renderer.tokenizer.encode(self.render(self.messages, True, self.current))
            assert list(started.prompt_token_ids) == whole, "the first prompt is not the template's rendering"
        self.calls.append((list(started.prompt_token_ids), ids))
        self.options.append(self.current)
        self.stops.append(ids[-1] if ids and ids[-1] in self.renderer.tokenizer.end_of_turn_ids else None)
        self.replies.append(done.reply.message())
        self.reply_at.append(len(self.messages))
        self.messages.append(echo(done.reply.message()))
        return done

    def _expect_rewrite(self, first_new: int) -> None:
        """Whether the full rendering of the recorded history changes with this request."""
        recorded = [*self.messages[: first_new - 1], self.replies[-1]]
        head = self.render(recorded, False, self.options[-1])
        if not self.render([*recorded, *self.messages[first_new:]], True, self.current).startswith(head):
            self.expected_rewrites.append(first_new - 1)

    # -- the check -----------------------------------------------------------------------------------
    def bridges(self) -> list[tuple[list[int], list[dict[str, Any]]]]:
        """Each later turn's bridge tokens and the new messages it renders."""
        out = []
        for k in range(1, len(self.calls)):
            (prompt, ids), (next_prompt, _) = self.calls[k - 1], self.calls[k]
            r = self.reply_at[k - 1]
            out.append((next_prompt[len(prompt) + len(ids) :], self.messages[r + 1 : self.reply_at[k]]))
        return out

    def check(self) -> None:
        tokenizer = self.renderer.tokenizer
        close = CLOSES[self.family]
        for k in range(1, len(self.calls)):
            (prompt, ids), (next_prompt, _) = self.calls[k - 1], self.calls[k]
            assert next_prompt[: len(prompt) + len(ids)] == prompt + ids, f"turn {k}: prompt != tape so far"
            bridge = next_prompt[len(prompt) + len(ids) :]
            text = tokenizer.decode_all(bridge)
            assert bridge == tokenizer.encode(text), f"turn {k}: the bridge is not its text tokenized as one piece"
            r = self.reply_at[k - 1]
            recorded = [*self.messages[:r], self.replies[k - 1]]
            new = self.messages[r + 1 : self.reply_at[k]]
            head = self.render(recorded, False, self.options[k - 1])
            full = self.render([*recorded, *new], True, self.options[k])
            stop = self.stops[k - 1]
            stop_text = tokenizer.special_text(stop) if stop is not None else ""
            if full.startswith(head):
                closed = head.endswith(close)
                # DeepSeek-V3's template writes no close after a lone tool call
                assert closed or (self.family == "deepseek-v3" and self.replies[k - 1].get("tool_calls")), f"turn {k}"
                expected = full[len(head) - len(close) if closed else len(head) :]
                if stop_text and expected.startswith(stop_text):
                    expected = expected[len(stop_text) :]  # sampled: never doubled
                assert text == expected, f"turn {k}: bridge {text!r} != the full rendering's {expected!r}"
            else:  # the template renders the history differently now: compare what follows the reply
                # the sampled stop counts as template text when it starts the close or is the next opener
                counts = close.startswith(stop_text) if close else stop_text in ("<|user|>", "<|observation|>")
                sampled = stop_text if stop_text and counts else ""
                joined = sampled + text
                assert joined.startswith(close), f"turn {k}: the close is dropped or doubled"
                after = joined[len(close) :]
                assert full.endswith(after) and full[: len(full) - len(after)].endswith(close), f"turn {k}"
                for message in new:
                    content = message.get("content")
                    if isinstance(content, str) and message["role"] == "user":
                        assert content.strip() in after, f"turn {k}: a new message is missing from the bridge"
        session = self.gateway.sessions.in_memory(self.session)
        assert session is not None
        tree = session.tree
        (branch,) = [b for b in export_session(tree)["branches"] if b["turn_ids"] == list(range(len(self.calls)))]
        last_prompt, last_ids = self.calls[-1]
        assert branch["tokens"] == last_prompt + last_ids, "the export is not the tape the engine saw"
        found = [r["at_message"] for r in branch["rewrites"]]
        assert found == self.expected_rewrites, (found, self.expected_rewrites)

    def naive_equals_tape(self) -> bool:
        """The naive method: render the whole conversation so far and tokenize it again."""
        last_prompt, _ = self.calls[-1]
        naive = self.renderer.tokenizer.encode(self.render(self.messages[:-1], True, self.current))
        return naive == last_prompt
