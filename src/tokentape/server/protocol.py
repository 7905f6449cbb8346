"""Request bodies as the OpenAI API defines them (plus the fields vLLM and trainers add), validated
strictly: a string where a number belongs is an error, not a guess. Unknown fields are ignored, as
OpenAI-compatible servers do, so that SDK `extra_body` additions from other servers do not fail."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from tokentape.server.dialects.common import ChatFields, Number, WireRequest

__all__ = [
    "SamplingFields",
    "ChatCompletionRequest",
    "CompletionRequest",
    "TokenizeRequest",
    "DetokenizeRequest",
    "ChatMessage",
]

MAX_MESSAGES = 4096  # far beyond any agent's history, small enough to bound per-request work


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["text"]
    text: StrictStr


class ImagePart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["image_url"]
    image_url: dict[str, Any] | StrictStr


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    name: StrictStr
    arguments: StrictStr | dict[str, Any]


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    id: StrictStr | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart | ImagePart] | None = None
    name: StrictStr | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: StrictStr | None = None


class SamplingFields(WireRequest):
    model: StrictStr
    max_tokens: StrictInt | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: StrictInt | None = None
    min_p: Number | None = None
    n: StrictInt | None = None
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[StrictInt] | None = None
    stream_options: dict[str, Any] | None = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    repetition_penalty: Number | None = None
    logit_bias: dict[StrictStr, Number] | None = None


class ChatCompletionRequest(SamplingFields, ChatFields):
    messages: Annotated[list[ChatMessage], Field(max_length=MAX_MESSAGES)]
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    response_format: dict[str, Any] | None = None


class CompletionRequest(SamplingFields):
    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]
    logprobs: StrictInt | None = None
    echo: StrictBool | None = None
    return_tokens_as_token_ids: StrictBool | None = None


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class TokenizeRequest(_Body):
    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: StrictBool = True
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Body):
    model: StrictStr | None = None
    tokens: list[StrictInt]
