"""Messages -> token IDs: the first prompt of a conversation, and the bridge after a sampled reply.

The bridge is rendered in a small anchored context (the system message, the conversation from the
last user message up to the reply, the reply with a sentinel as its content) so its cost does not
grow with the history, where the anchor probe (`probe`) found the template renders the same from
there under the request's settings; else from the first message. What the template renders after
that reply is the new messages and the generation prompt, exactly as in the full conversation; in
front goes the part of the turn close the engine did not sample.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tokentape.core.bridge import REPLY_SENTINEL, strip_sampled_stop, text_after_reply, turn_close_after
from tokentape.core.images import has_images
from tokentape.core.messages import Message, json_or, same_inputs, template_inputs
from tokentape.core.reply import THINK_CLOSE, THINK_OPEN, ToolFormat
from tokentape.errors import InvalidRequest
from tokentape.render.bounds import PromptTooLong, TokenFloor, probe_verbatim
from tokentape.render.probe import AnchorVerdict, AnchorVerdicts, ProbeOptions, anchor
from tokentape.render.quoting import QuotedSpecials
from tokentape.render.roles import RoleSupport, map_roles
from tokentape.render.template import ChatTemplate
from tokentape.render.tokenizer import Tokenizer
from tokentape.render.vision import VisionProcessor

__all__ = ["Renderer", "Bridge", "Prompt", "RenderOptions", "DEFAULT_TOOL_PROMPT", "detect_tool_format"]

_ROOT_ROLES = ("system", "developer")

# For templates that do not read `tools`: the tool list goes into the system prompt, with the call
# syntax the template renders (Hermes-style `<tool_call>` JSON when it renders none, as SmolLM2's).
DEFAULT_TOOL_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, answer in this format:\n{example}"
)
_CALL_EXAMPLES: dict[ToolFormat, str] = {
    "hermes": '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>',
    "deepseek": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜><function-name>\n```json\n"
    "<args-json-object>\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
    "llama3": '{"name": <function-name>, "parameters": <args-json-object>}',
    "glm": "<tool_call><function-name><arg_key><name></arg_key><arg_value><value></arg_value></tool_call>",
    "minimax": '<minimax:tool_call>\n<invoke name="<function-name>">\n<parameter name="<name>"><value></parameter>\n'
    "</invoke>\n</minimax:tool_call>",
    "qwen_xml": "<tool_call>\n<function=<function-name>>\n<parameter=<name>>\n<value>\n</parameter>\n"
    "</function>\n</tool_call>",
}


def detect_tool_format(template_source: str) -> ToolFormat | None:
    """The tool-call syntax a chat template renders, or None if it renders no tool calls."""
    if "<｜tool▁call▁begin｜>" in template_source or "<｜tool▁calls▁begin｜>" in template_source:
        return "deepseek"
    if "<minimax:tool_call>" in template_source or "toolcall_begin_token" in template_source:
        return "minimax"
    if "<function=" in template_source:
        return "qwen_xml"
    if "<arg_key>" in template_source:
        return "glm"
    if "<tool_call>" in template_source:
        return "hermes"
    if "<|start_header_id|>" in template_source and '"parameters"' in template_source:
        return "llama3"
    return None


@dataclass(frozen=True, slots=True)
class RenderOptions:
    """Everything besides the messages that the template sees."""

    tools: Sequence[Mapping[str, Any]] | None = None
    template_kwargs: Mapping[str, Any] | None = None
    notes: tuple[str, ...] = ()  # what the request sent that the template is not given (recorded, not rendered)

    def inputs(self) -> dict[str, Any] | None:
        """These options as a turn records them (`messages.template_inputs`)."""
        return template_inputs(self.tools, self.template_kwargs, self.notes)

    @classmethod
    def of(cls, inputs: Mapping[str, Any] | None) -> RenderOptions:
        """The options a turn recorded."""
        inputs = inputs or {}
        notes = tuple(str(note) for note in inputs.get("notes") or ())
        return cls(tools=inputs.get("tools"), template_kwargs=inputs.get("template_kwargs"), notes=notes)


@dataclass(frozen=True, slots=True)
class Prompt:
    tokens: list[int]
    text: str
    opens_reasoning: bool  # the generation prompt ends inside an open reasoning block


@dataclass(frozen=True, slots=True)
class Bridge:
    tokens: list[int]
    text: str
    template_rewrite: bool  # the recorded history renders differently once the new request follows
    opens_reasoning: bool
    detail: str = ""  # why it is a rewrite
    whole: bool = False  # rendered from the first message, not from the anchor


class Renderer:
    """Pairs a chat template with the tokenizer the engine uses."""

    def __init__(self, template: ChatTemplate, tokenizer: Tokenizer) -> None:
        self.template = template
        self.tokenizer = tokenizer
        self._vision: VisionProcessor | None = None
        self._quoted: QuotedSpecials | None = None
        self.native_tools = "tools" in template.source  # the template lists the tools itself
        detected = detect_tool_format(template.source)
        self.native_tool_calls = detected is not None  # the template renders tool calls in history
        self.tool_format: ToolFormat = detected or "hermes"
        self.reasoning = THINK_CLOSE in template.source
        self.roles = RoleSupport.probe(template)  # developer -> system where the template has no such role
        self.arguments_as_objects = self._takes_object_arguments()
        self.turn_close = self._derive_turn_close()
        # Templates that carry state across messages (DeepSeek-R1 opens its tool outputs once per
        # conversation; Qwen2-VL numbers images under `add_vision_id`) need bridges rendered from the
        # first message; Jinja is cheap beside tokenizing. Learned per template setting (`probe`).
        self._verdicts = AnchorVerdicts(self._bridge_text)
        default = self._verdicts.get(None, images=False)
        self.anchor_safe, self.anchor_difference = default.safe, default.difference

    def anchor_verdict(self, options: RenderOptions, images: bool) -> AnchorVerdict:
        """Whether bridges under `options` (and with image parts, if `images`) may be rendered from
        the anchor; probed the first time a setting is seen."""
        return self._verdicts.get(options.template_kwargs, images)

    def renders_whole(self, messages: Sequence[Message], options: RenderOptions) -> bool | None:
        """Whether a bridge for `messages` renders the whole conversation (None: not known until
        the probe for this setting has run)."""
        verdict = self._verdicts.known(options.template_kwargs, has_images(messages))
        return None if verdict is None else not verdict.safe

    @property
    def vision(self) -> VisionProcessor | None:
        """The model's image processor and placeholder tokens; None: a text-only model, images refused."""
        return self._vision

    @vision.setter
    def vision(self, vision: VisionProcessor | None) -> None:
        self._vision = vision
        # its vision tokens are never taken from message text (`render.quoting`)
        self._quoted = QuotedSpecials(self.tokenizer, vision.vision_token_ids) if vision is not None else None

    def encode(self, text: str) -> list[int]:
        """Token IDs of text this renderer rendered (special tokens parsed, quoted ones as text)."""
        return self.tokenizer.encode(text) if self._quoted is None else self._quoted.encode(text)

    def encode_prompt_text(self, text: str) -> list[int]:
        """A raw prompt's token IDs (completions): as `encode`, its vision-token strings kept as text."""
        if self._quoted is None:
            return self.tokenizer.encode(text)
        return self._quoted.encode(self._quoted.quote_text(text))

    def _shown(self, text: str) -> str:
        return text if self._quoted is None else self._quoted.unquote(text)

    def _takes_object_arguments(self) -> bool:
        """Whether the template wants tool-call arguments as objects (it iterates or `tojson`s them,
        as Llama's and GLM's do) rather than the JSON text OpenAI clients send (DeepSeek's concatenates)."""
        call = {"type": "function", "function": {"name": "f", "arguments": {"x": 1}}}
        probe: list[Message] = [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
        ]
        try:
            self.template.render(probe, add_generation_prompt=False)
        except InvalidRequest:
            return False
        return True

    def _derive_turn_close(self) -> str:
        probe: list[Message] = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": REPLY_SENTINEL}]
        close = turn_close_after(self.template.render(probe, add_generation_prompt=False))
        followed = self.template.render([*probe, {"role": "user", "content": "Go on"}], add_generation_prompt=True)
        if REPLY_SENTINEL + close not in followed:
            raise ValueError("cannot derive the turn close from this chat template")
        return close

    # -- bounds ------------------------------------------------------------------------------------
    @functools.cached_property
    def floor(self) -> TokenFloor | None:
        """Lower bounds on token counts from text lengths (`render.bounds`); None where the tokenizer
        has none. Made once, in tenths of a second (the vocabulary is read and the template probed):
        the gateway asks for it off the event loop."""
        span: int | None = getattr(self.tokenizer, "longest_token_bytes", None)
        if span is None:
            return None
        if self._quoted is not None:  # a quoted vision-token string is a marker of about 23 characters
            span = max(span, 32)
        return TokenFloor(span, probe_verbatim(lambda m, tools: self.render_text(m, True, RenderOptions(tools))))

    def _check_room(self, text: str, room: int | None) -> None:
        """Refuse, before tokenizing it, a rendered text that holds more than `room` tokens by its length alone."""
        floor = self.floor if room is not None else None
        if floor is not None and room is not None and floor.of_text(text) > room:
            raise PromptTooLong(floor.of_text(text))

    # -- whole prompts -----------------------------------------------------------------------------
    def prompt(self, messages: Sequence[Message], options: RenderOptions, room: int | None = None) -> Prompt:
        """The whole conversation rendered with a generation prompt, tokenized once. `room`: the
        most tokens it may hold; a text longer than that by its length alone raises PromptTooLong
        before it is tokenized."""
        text = self.render_text(messages, True, options)
        self._check_room(text, room)
        return Prompt(self.encode(text), self._shown(text), _opens_reasoning(text))

    # -- bridges -----------------------------------------------------------------------------------
    def bridge(
        self,
        messages: Sequence[Message],
        reply_index: int,
        reply: Message,
        stop_token: int | None,
        options: RenderOptions,
        recorded: RenderOptions | None = None,
        room: int | None = None,
    ) -> Bridge:
        """Tokens to append after the sampled reply that `messages[reply_index]` echoes.

        `reply` is the reply as it was returned (reasoning and tool calls included); `stop_token` is
        the end-of-turn token the engine sampled last, or None if the turn ended another way;
        `recorded` the options the recorded history was rendered with (default: `options`); `room`
        the most tokens the bridge may hold (PromptTooLong past it, as `prompt`).

        The bridge is the template's rendering of the whole request cut right after the reply's turn
        close. It is rendered from the anchor when the probe found this template renders the same
        from there under these options (`anchor_verdict`), else from the first message (the whole
        conversation, the recorded history checked as its prefix), and always when the options changed.
        """
        recorded = options if recorded is None else recorded
        changed = not same_inputs(recorded.inputs(), options.inputs())
        from_start = changed or not self.anchor_verdict(options, has_images(messages)).safe
        prefix = list(messages[:reply_index]) if from_start else anchor(messages, reply_index)
        new = list(messages[reply_index + 1 :])
        before = self.render_text([*prefix, reply], False, recorded)
        with_new = self.render_text([*prefix, reply, *new], True, options)
        rewrite = not with_new.startswith(before)
        close, after = self._after_reply(prefix, reply, new, options, before, with_new, rewrite)
        stop_text = self.tokenizer.special_text(stop_token) if stop_token is not None else None
        text = strip_sampled_stop(close + after, stop_text)
        self._check_room(text, room)
        detail = ""
        if rewrite:
            detail = (
                f"the template renders the recorded history differently with the new {_what_changed(recorded, options)}"
                if changed and self.render_text([*prefix, reply], False, options) != before
                else "the chat template renders an earlier reply differently once new messages follow"
            )
        return Bridge(
            self.encode(text),
            self._shown(text),
            template_rewrite=rewrite,
            opens_reasoning=_opens_reasoning(with_new),
            detail=detail,
            whole=from_start,
        )

    def _after_reply(
        self,
        prefix: list[Message],
        reply: Message,
        new: list[Message],
        options: RenderOptions,
        before: str,
        with_new: str,
        rewrite: bool,
    ) -> tuple[str, str]:
        """(the close the template writes after this reply, what it renders after that: the new
        messages and the generation prompt)."""
        if not rewrite:
            # DeepSeek-V3 writes no close after a lone tool call: then none is bridged either
            close = self.turn_close if before.endswith(self.turn_close) else ""
            return close, with_new[len(before) :]
        # The reply renders differently once new messages follow: find its close by a sentinel.
        sentinel = {**_without_reasoning(reply), "content": REPLY_SENTINEL}
        reply_only = self.render_text([*prefix, sentinel], False, options)
        followed = self.render_text([*prefix, sentinel, *new], True, options)
        if followed.startswith(reply_only) and reply_only.endswith(self.turn_close):
            return self.turn_close, followed[len(reply_only) :]
        return self.turn_close, text_after_reply(followed, self.turn_close)

    def _bridge_text(self, messages: Sequence[Message], index: int, prefix: list[Message], probe: ProbeOptions) -> str:
        options = RenderOptions(tools=probe.tools, template_kwargs=probe.template_kwargs)
        reply = messages[index]
        new = list(messages[index + 1 :])
        before = self.render_text([*prefix, reply], False, options)
        with_new = self.render_text([*prefix, reply, *new], True, options)
        rewrite = not with_new.startswith(before)
        close, after = self._after_reply(prefix, reply, new, options, before, with_new, rewrite)
        return close + after

    # -- rendering ---------------------------------------------------------------------------------
    def render_text(self, messages: Sequence[Message], generation: bool, options: RenderOptions) -> str:
        """The template's text for `messages`, as this renderer prepares them."""
        prepared, tools = self.prepare(messages, options)
        return self.template.render(
            prepared, add_generation_prompt=generation, tools=tools, template_kwargs=options.template_kwargs
        )

    def prepare(
        self, messages: Sequence[Message], options: RenderOptions
    ) -> tuple[list[Message], Sequence[Mapping[str, Any]] | None]:
        """Messages as templates expect them (instruction roles as the template renders them,
        `render.roles`); tool-less templates get the default tool format."""
        prepared = [_for_template(m, self.arguments_as_objects) for m in map_roles(messages, self.roles)]
        if self._quoted is not None:
            prepared = [self._quoted.quote_message(m) for m in prepared]
        if self.native_tools or not (options.tools or any(_uses_tools(m) for m in prepared)):
            return prepared, options.tools
        if not self.native_tool_calls:
            prepared = _tool_calls_as_text(prepared)
        return _with_tool_list(prepared, options.tools or (), self._call_example()), None

    def _call_example(self) -> str:
        if self.tool_format == "deepseek" and "```json" not in self.template.source:
            # DeepSeek-V3.1 writes the arguments right after the name, with no type and no fence
            return (
                "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜><function-name><｜tool▁sep｜><args-json-object>"
                "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
            )
        return _CALL_EXAMPLES[self.tool_format]


def _opens_reasoning(text: str) -> bool:
    tail = text.rstrip()
    return tail.endswith(THINK_OPEN)


def _without_reasoning(message: Message) -> dict[str, Any]:
    return {k: v for k, v in message.items() if k not in ("reasoning_content", "reasoning")}


def _for_template(message: Message, object_arguments: bool) -> Message:
    """Drop null fields (templates test `'tool_calls' in message`) and give tool-call arguments in
    the form the template handles."""
    cleaned = {k: v for k, v in message.items() if v is not None or k == "content"}
    calls = cleaned.get("tool_calls")
    if calls:
        cleaned["tool_calls"] = [_arguments_as(call, object_arguments) for call in calls]
    return cleaned


def _arguments_as(call: Mapping[str, Any], objects: bool) -> dict[str, Any]:
    function = dict(call.get("function") or {})
    arguments = function.get("arguments")
    if objects and isinstance(arguments, str):
        parsed = json_or(arguments, None)
        if isinstance(parsed, dict):
            function["arguments"] = parsed
    elif not objects and not isinstance(arguments, str):
        function["arguments"] = json.dumps(arguments, ensure_ascii=False)
    return {**call, "function": function}


def _uses_tools(message: Message) -> bool:
    return message.get("role") == "tool" or bool(message.get("tool_calls"))


def _tool_calls_as_text(messages: list[Message]) -> list[Message]:
    """Tool calls and results as plain text, for templates that render neither."""
    out: list[Message] = []
    for message in messages:
        role = message.get("role")
        if role == "assistant" and message.get("tool_calls"):
            calls = [
                "<tool_call>\n"
                + json.dumps({"name": c["function"]["name"], "arguments": _as_object(c["function"].get("arguments"))})
                + "\n</tool_call>"
                for c in message["tool_calls"]
            ]
            text = message.get("content") or ""
            out.append({"role": "assistant", "content": "\n".join(([text] if text else []) + calls)})
        elif role == "tool":
            content = message.get("content")
            if isinstance(content, list):  # a result with images: its parts, wrapped the same way
                wrapped = [
                    {"type": "text", "text": "<tool_response>\n"},
                    *content,
                    {"type": "text", "text": "\n</tool_response>"},
                ]
                out.append({"role": "tool", "content": wrapped})
                continue
            out.append({"role": "tool", "content": f"<tool_response>\n{content or ''}\n</tool_response>"})
        else:
            out.append(message)
    return out


def _as_object(arguments: Any) -> Any:
    """Arguments as the format's instructions show them: a JSON object, not JSON text inside a string
    (a model copies the longer, escaped form it sees in its history)."""
    if isinstance(arguments, str):
        return json_or(arguments, arguments)
    return {} if arguments is None else arguments


def _with_tool_list(messages: list[Message], tools: Sequence[Mapping[str, Any]], example: str) -> list[Message]:
    out = list(messages)
    if tools:
        listing = DEFAULT_TOOL_PROMPT.format(tools="\n".join(json.dumps(t) for t in tools), example=example)
        if out and out[0].get("role") in _ROOT_ROLES:
            out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{listing}"}
        else:
            out.insert(0, {"role": "system", "content": listing})
    return out


def _what_changed(recorded: RenderOptions, options: RenderOptions) -> str:
    parts = []
    if not same_inputs(template_inputs(recorded.tools, None), template_inputs(options.tools, None)):
        parts.append("tools")
    if not same_inputs(template_inputs(None, recorded.template_kwargs), template_inputs(None, options.template_kwargs)):
        parts.append("chat_template_kwargs")
    return " and ".join(parts) or "options"
