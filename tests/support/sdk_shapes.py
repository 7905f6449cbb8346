"""The served bodies and stream events checked against the SDKs' own types: the `openai` package's
`Response` and Responses event union, the `anthropic` package's `Message` and stream event union.

A shape an SDK would misread fails in the tests. These checks are the tests' alone: the gateway
never imports the SDK types (the turn is recorded before its answer is shaped, and importing and
building the event unions would add about a second to every `tokentape serve` start)."""

from __future__ import annotations

from typing import Any

import pydantic
from anthropic.types import Message as AnthropicMessage
from anthropic.types import RawMessageStreamEvent
from openai.types.responses import Response, ResponseStreamEvent

__all__ = ["check_anthropic_event", "check_message", "check_response", "check_responses_event"]

_ANTHROPIC_EVENTS: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(RawMessageStreamEvent)
_RESPONSES_EVENTS: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(ResponseStreamEvent)


def check_response(body: dict[str, Any]) -> dict[str, Any]:
    """A whole Responses body checked against the `openai` package's own `Response` type."""
    Response.model_validate(body)
    return body


def check_responses_event(event: dict[str, Any]) -> dict[str, Any]:
    """One Responses stream event checked against the `openai` package's event union."""
    _RESPONSES_EVENTS.validate_python(event)
    return event


def check_message(body: dict[str, Any]) -> dict[str, Any]:
    """A whole Messages body checked against the `anthropic` package's own `Message` type."""
    AnthropicMessage.model_validate(body)
    return body


def check_anthropic_event(event: dict[str, Any]) -> dict[str, Any]:
    """One Messages stream event checked against the `anthropic` package's event union."""
    _ANTHROPIC_EVENTS.validate_python(event)
    return event
