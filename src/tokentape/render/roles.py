"""Which message roles a chat template renders, and what becomes of the instruction roles it does not.

Agents send instructions under roles not every template knows: OpenAI's `developer` (Codex sends its
whole base prompt and its skills that way), and system messages after the conversation has started.
Qwen2.5's and Qwen3's templates render only system, user, assistant and tool, and a system message only
where they look for one: a `developer` message is left out of the prompt without a word. Here every
instruction reaches the model or the request is refused:

- `developer` renders as `developer` where the template knows that role (OpenAI's gpt-oss/harmony
  templates); everywhere else (Qwen, Llama, DeepSeek, GLM, MiniMax, SmolLM2) it renders as `system`, as
  OpenAI maps it for models without a developer role.
- Several system messages before the first other message are merged into one (their texts joined
  by a blank line) where the template renders only the first of them in place.
- A system (or mapped developer) message after the conversation started, on a template that does not
  render it in place, is refused (400, naming the role and its position), never dropped or moved.

What a template renders is probed once per template (`RoleSupport.probe`) with marker texts: a
developer message at the root, a developer and a system message mid-conversation, two leading system
messages, and a role no template knows (a template that writes any role's name as its header, as
SmolLM2's and Llama 3's do, does not know `developer`: it only echoes the word). The mapping is a pure
function of the message list and the template (`map_roles`), applied to every render, so a session's
history renders the same every turn and the tape stays exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tokentape.core.messages import Message
from tokentape.errors import InvalidRequest
from tokentape.render.template import ChatTemplate

__all__ = ["RoleSupport", "map_roles", "INSTRUCTION_ROLES"]

INSTRUCTION_ROLES = ("system", "developer")
_JOIN = "\n\n"  # between merged leading system messages (DeepSeek's templates join theirs so)
_UNKNOWN_ROLE = "tokentape_probe_role"


@dataclass(frozen=True, slots=True)
class RoleSupport:
    """What one chat template renders of the instruction roles."""

    developer: bool = False  # renders `developer` as a role of its own (not merely echoing the word)
    leading_systems: bool = True  # renders a second leading system message in place (else: merged)
    system_later: bool = True  # renders a system message after the conversation started, in place
    developer_later: bool = False  # the same for `developer` (read only where `developer` is True)

    @classmethod
    def probe(cls, template: ChatTemplate) -> RoleSupport:
        """The template's support, learned by rendering marker messages once."""
        user, reply, later = "tokentape-probe-user", "tokentape-probe-reply", "tokentape-probe-later"
        unknown = _render(template, [{"role": _UNKNOWN_ROLE, "content": "tokentape-probe-unknown"}, _user(user)])
        echoes = "tokentape-probe-unknown" in unknown and _UNKNOWN_ROLE in unknown  # writes any role's name
        developer_root = _renders_in_place(
            template,
            [{"role": "developer", "content": "tokentape-probe-dev"}, _user(user)],
            "",
            "tokentape-probe-dev",
            user,
        )

        def later_in_place(role: str) -> bool:
            marker = f"tokentape-probe-{role}-later"
            messages: list[Message] = [
                _user(user),
                {"role": "assistant", "content": reply},
                {"role": role, "content": marker},
                _user(later),
            ]
            return _renders_in_place(template, messages, reply, marker, later)

        developer = developer_root and not echoes
        return cls(
            developer=developer,
            leading_systems=_renders_in_place(
                template,
                [
                    {"role": "system", "content": "tokentape-probe-first"},
                    {"role": "system", "content": "tokentape-probe-second"},
                    _user(user),
                ],
                "tokentape-probe-first",
                "tokentape-probe-second",
                user,
            ),
            system_later=later_in_place("system"),
            developer_later=developer and later_in_place("developer"),
        )

    def describe(self) -> str:
        """One line: what becomes of the instruction roles on this template."""
        developer = "rendered as developer" if self.developer else "rendered as system"
        leading = "each rendered" if self.leading_systems else "merged into one"
        later = "rendered in place" if self.system_later else "refused"
        return f"developer: {developer}; leading system messages: {leading}; a system message later on: {later}"


def _user(text: str) -> Message:
    return {"role": "user", "content": text}


def _render(template: ChatTemplate, messages: list[Message]) -> str:
    try:
        return template.render(messages, add_generation_prompt=False)
    except InvalidRequest:
        return ""


def _renders_in_place(template: ChatTemplate, messages: list[Message], before: str, marker: str, after: str) -> bool:
    """Whether the template renders `marker` after `before` and ahead of `after` (where each is)."""
    text = _render(template, messages)
    at = text.find(marker)
    if at < 0:
        return False
    if before and not 0 <= text.find(before) < at:
        return False
    return at < text.find(after)


def map_roles(messages: Sequence[Message], support: RoleSupport) -> Sequence[Message]:
    """`messages` with the instruction roles as this template renders them (see the module docstring);
    the list itself where nothing changes. Raises InvalidRequest for an instruction message after the
    conversation started that the template cannot render in place."""
    if not _needs_mapping(messages, support):
        return messages
    out: list[Message] = []
    leading = True
    for index, message in enumerate(messages):
        sent = message.get("role")
        if sent not in INSTRUCTION_ROLES:
            leading = False
            out.append(message)
            continue
        role = "developer" if sent == "developer" and support.developer else "system"
        mapped = message if role == sent else {**message, "role": role}
        if leading:
            if out and role == "system" and out[-1].get("role") == "system" and not support.leading_systems:
                out[-1] = {**out[-1], "content": _joined(out[-1].get("content"), mapped.get("content"))}
            else:
                out.append(mapped)
            continue
        renders = support.developer_later if role == "developer" else support.system_later
        if not renders:
            shown = "" if role == sent else f", which this template renders as {role},"
            raise InvalidRequest(
                f"a {sent} message{shown} after the conversation started (message {index}) cannot be rendered "
                "by this model's chat template, which reads instructions only at the start; move it to the "
                "start or send it as a user message",
                param="messages",
                code="unsupported_role_position",
            )
        out.append(mapped)
    return out


def _needs_mapping(messages: Sequence[Message], support: RoleSupport) -> bool:
    """Whether any message needs mapping (the common case, one system message first, needs none)."""
    for index, message in enumerate(messages):
        role = message.get("role")
        if role == "developer" and not support.developer:
            return True
        if role in INSTRUCTION_ROLES and index > 0:
            return True
    return False


def _joined(first: Any, second: Any) -> Any:
    """Two messages' contents as one: text joined by a blank line; text parts kept as parts."""
    if (first is None or isinstance(first, str)) and (second is None or isinstance(second, str)):
        return _JOIN.join(text for text in (first, second) if text)
    return [*_parts(first), {"type": "text", "text": _JOIN}, *_parts(second)]


def _parts(content: Any) -> list[Any]:
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return list(content)
