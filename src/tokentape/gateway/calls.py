"""What the serving layer hands the gateway (one call per request) and what it gets back (a stream
of events). Every dialect translates its request into a `ChatCall` or a `CompletionCall` and renders
these events in its own wire format."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tokentape.core.images import DecodedImage
from tokentape.core.messages import Message
from tokentape.core.reply import ParsedReply
from tokentape.core.sampling import SamplingParams
from tokentape.core.tape import FinishReason, RewritePolicy
from tokentape.engines.base import Constraint, SampledToken
from tokentape.gateway.sessions import PrefixMatch
from tokentape.render.renderer import RenderOptions

__all__ = ["ChatCall", "CompletionCall", "Call", "Started", "TextDelta", "ChoiceDone", "Event"]


@dataclass(frozen=True, slots=True)
class ChatCall:
    messages: Sequence[Message]
    sampling: SamplingParams
    options: RenderOptions = dataclasses.field(default_factory=RenderOptions)
    session_id: str | None = None
    rewrite_policy: RewritePolicy | None = None
    parse_tool_calls: bool = False  # tools were offered and tool_choice is not "none"
    request_key: bytes | None = None  # names this request's body, for SDK retries
    retry: bool = False  # an SDK retry (x-stainless-retry-count > 0): replay, never sample again
    trace_id: str | None = None  # a second session name the client sent, kept on its turns
    constraint: Constraint | None = None  # what the output must match (tool_choice, response_format)
    images: Mapping[str, DecodedImage] = dataclasses.field(default_factory=dict)  # the request's, by digest
    # its messages hold image parts (set by the dialect that parsed them): only then are images looked for
    has_images: bool = False
    # the agent harness whose id named the session (`core.episodes`): its side calls go to sessions of their own
    harness: str | None = None


@dataclass(frozen=True, slots=True)
class CompletionCall:
    prompt: str | Sequence[int]
    sampling: SamplingParams
    session_id: str | None = None
    echo: bool = False
    request_key: bytes | None = None
    retry: bool = False
    trace_id: str | None = None

    @property
    def rewrite_policy(self) -> RewritePolicy | None:
        return None  # token prompts carry no messages to rewrite


Call = ChatCall | CompletionCall


@dataclass(frozen=True, slots=True)
class Started:
    session_id: str
    prompt_token_ids: Sequence[int]  # an int32 array from the tape, or a list
    prefix_match: PrefixMatch | None = None  # how an unnamed request was placed, in prefix-matching mode


@dataclass(frozen=True, slots=True)
class TextDelta:
    index: int
    text: str  # content (chat) or text (completions)
    tokens: list[SampledToken]
    reasoning: str = ""


@dataclass(frozen=True, slots=True)
class ChoiceDone:
    index: int
    reply: ParsedReply  # for completions: the raw text as content
    text: str  # the generated text, stop strings cut
    tokens: list[SampledToken]
    finish_reason: FinishReason
    turn_id: int


Event = Started | TextDelta | ChoiceDone
