"""What the dialects share on the way in: the request fields every one of them has, OpenAI's
sampling defaults and limits (`sampling_from_wire`), and the chat call the chat-like dialects (chat
completions, Responses, Messages) all become (`chat_call`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt, StrictStr

from tokentape.core.images import DecodedImage
from tokentape.core.messages import Message
from tokentape.core.reply import ToolFormat
from tokentape.core.sampling import SamplingParams, request_top_k
from tokentape.errors import InvalidRequest
from tokentape.gateway.calls import ChatCall
from tokentape.gateway.constraints import output_constraint
from tokentape.gateway.sessions import check_policy
from tokentape.render.renderer import RenderOptions

__all__ = [
    "Caller",
    "ChatFields",
    "Number",
    "WireRequest",
    "chat_call",
    "chat_function_tool",
    "sampling_from_wire",
    "UNAPPLIED_FIELDS",
]

Number = StrictInt | StrictFloat


class WireRequest(BaseModel):
    """The fields the serving layer reads from every dialect's request. Strict: a string where a
    number belongs is an error, not a guess; unknown fields are ignored, as OpenAI-compatible servers
    do, so that SDK `extra_body` additions meant for other servers do not fail."""

    model_config = ConfigDict(extra="allow", strict=True)
    model: StrictStr | None = None
    stream: StrictBool | None = None
    session_id: StrictStr | None = None
    # vLLM's name: ask for the prompt's token IDs where the server sends them only when asked
    # (`--prompt-token-ids asked`)
    return_token_ids: StrictBool | None = None


class ChatFields(WireRequest):
    """What trainers add to every chat-like dialect, under the same names as vLLM's chat route."""

    top_k: StrictInt | None = None
    min_p: Number | None = None
    repetition_penalty: Number | None = None
    seed: StrictInt | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    rewrite_policy: StrictStr | None = None
    return_tokens_as_token_ids: StrictBool | None = None


@dataclass(frozen=True, slots=True)
class Caller:
    """Who a request is: the session it belongs to, its retry identity, and a client trace id."""

    session_id: str | None
    request_key: bytes  # names the request by where it went and what it said
    retry: bool  # an SDK retry: replay the recorded answer, never sample again
    trace_id: str | None = None
    harness: str | None = None  # the agent harness whose own id named the session (`server.session_names`)


# Sampling fields OpenAI's or vLLM's APIs define that no engine here applies: each is refused (400, naming
# it) when set to anything but its no-op value, so no client believes it sampled under a setting it did
# not. (field: (its no-op values, why it is refused))
UNAPPLIED_FIELDS: dict[str, tuple[tuple[Any, ...], str]] = {
    "best_of": ((None, 1), "ranking several candidates per choice is not supported; ask for n choices"),
    "use_beam_search": ((None, False), "beam search is not supported"),
    "length_penalty": ((None, 1, 1.0), "length_penalty applies to beam search, which is not supported"),
    "min_tokens": ((None, 0), "min_tokens is not supported"),
    "ignore_eos": ((None, False), "ignore_eos is not supported: the turn ends at the model's end-of-turn token"),
    "allowed_token_ids": ((None, []), "allowed_token_ids is not supported; use logit_bias"),
    "bad_words": ((None, []), "bad_words is not supported; use logit_bias"),
    "prompt_logprobs": ((None,), "prompt_logprobs is not supported"),
    "truncate_prompt_tokens": ((None,), "prompts are never truncated: the tape records every token"),
    "logits_processors": ((None, []), "custom logits processors are not supported"),
    "guided_json": ((None,), "use response_format"),
    "guided_regex": ((None,), "use response_format"),
    "guided_choice": ((None,), "use response_format"),
    "guided_grammar": ((None,), "use response_format"),
    "structured_outputs": ((None,), "use response_format"),
    "suffix": ((None, ""), "completions with a suffix are not supported"),
    "prediction": ((None,), "predicted outputs are not supported"),
    "audio": ((None,), "audio output is not supported"),
    "modalities": ((None, ["text"]), "text is the only output modality"),
    "include_stop_str_in_output": ((None, False), "stop strings are never included in the output"),
}


def _refuse_unapplied(req: BaseModel, names: Mapping[str, str] | None) -> None:
    sent = {**(req.model_extra or {}), **req.__dict__}
    for field, (no_ops, why) in UNAPPLIED_FIELDS.items():
        # a no-op value of its own type only: `true` is not 1, and `1.0` is not `[]`
        if field in sent and not any(sent[field] == v and type(sent[field]) is type(v) for v in no_ops):
            wire = (names or {}).get(field, field)
            raise InvalidRequest(f"{wire} is not applied by this gateway: {why}", param=wire)


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """OpenAI's `logit_bias` (token ID as text -> bias) as (token, bias) pairs by token."""
    if value is None:
        return ()
    pairs = []
    for key, bias in value.items():
        text = str(key).strip()
        if not (text.isascii() and text.lstrip("-").isdigit()) or len(text) > 20:
            raise InvalidRequest(f"logit_bias keys are token IDs, got {str(key)[:40]!r}", param="logit_bias")
        pairs.append((int(text), float(bias)))
    return tuple(sorted(pairs))


def sampling_from_wire(
    req: BaseModel,
    *,
    max_tokens: int | None,
    logprobs: bool = False,
    top_logprobs: int | None = None,
    stop: str | Sequence[str] | None = None,
    names: Mapping[str, str] | None = None,
) -> SamplingParams:
    """The sampling parameters of a request whose fields bear OpenAI's names (`temperature`, `top_p`,
    `top_k`, `min_p`, `seed`, `stop`, `stop_token_ids`, `n`; those it lacks count as left out), with
    OpenAI's defaults for what it leaves out: temperature 1, top_p 1, no top-k or min-p cut, one
    choice. A top_k of -1 is vLLM's "off" (as 0 is); below -1 is refused, as vLLM refuses it.
    `SamplingParams` checks the ranges against its named limits. `stop`: the stop strings, where the
    dialect names them otherwise. `names`: the dialect's own name for a parameter (e.g. `max_tokens`
    -> `max_output_tokens`), so that an error names the field the client sent."""
    fields = req.__dict__  # declared fields only: an undeclared one a client sends (kept as an extra) is not read
    temperature, top_p, top_k = fields.get("temperature"), fields.get("top_p"), fields.get("top_k")
    min_p, n = fields.get("min_p"), fields.get("n")
    presence, frequency = fields.get("presence_penalty"), fields.get("frequency_penalty")
    repetition = fields.get("repetition_penalty")
    stop = fields.get("stop") if stop is None else stop
    _refuse_unapplied(req, names)
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if temperature is None else float(temperature),
            top_p=1.0 if top_p is None else float(top_p),
            top_k=request_top_k(top_k),
            min_p=0.0 if min_p is None else float(min_p),
            seed=fields.get("seed"),
            stop=(stop,) if isinstance(stop, str) else tuple(stop or ()),
            stop_token_ids=tuple(fields.get("stop_token_ids") or ()),
            logprobs=logprobs,
            top_logprobs=top_logprobs or 0,
            n=1 if n is None else n,
            logit_bias=_logit_bias(fields.get("logit_bias")),
            presence_penalty=0.0 if presence is None else float(presence),
            frequency_penalty=0.0 if frequency is None else float(frequency),
            repetition_penalty=1.0 if repetition is None else float(repetition),
        )
    except InvalidRequest as exc:
        wire_name = (names or {}).get(exc.param or "")
        if wire_name is None or exc.param is None:
            raise
        message = exc.message
        if message.startswith(exc.param + " "):  # "max_tokens must be ..." -> "max_output_tokens must be ..."
            message = wire_name + message[len(exc.param) :]
        raise InvalidRequest(message, param=wire_name) from exc


def chat_call(
    req: ChatFields,
    caller: Caller,
    messages: Sequence[Message],
    sampling: SamplingParams,
    tool_format: ToolFormat,
    tools: list[dict[str, Any]] | None,
    tool_choice: str | Mapping[str, Any] | None,
    response_format: Mapping[str, Any] | None,
    *,
    template_kwargs: Mapping[str, Any] | None = None,
    session_id: str | None = None,
    images: Mapping[str, DecodedImage] | None = None,
    notes: Sequence[str] = (),
) -> ChatCall:
    """A chat-like request as the gateway's chat call, its tools and answer format already in chat
    completions' terms: tool calls are parsed when tools are offered and not switched off, and the
    output is constrained to what `tool_choice` and the answer format demand. `template_kwargs` are
    the dialect's own (e.g. Messages' `enable_thinking`); the request's `chat_template_kwargs` win.
    `notes`: what the request sent that the model is not shown, recorded with the turn (`notes` in
    the export)."""
    if req.chat_template_kwargs is not None:
        template_kwargs = {**(template_kwargs or {}), **req.chat_template_kwargs}
    return ChatCall(
        messages=messages,
        sampling=sampling,
        options=RenderOptions(tools=tools, template_kwargs=template_kwargs, notes=tuple(notes)),
        session_id=session_id if session_id is not None else caller.session_id,
        rewrite_policy=check_policy(req.rewrite_policy) if req.rewrite_policy is not None else None,
        parse_tool_calls=bool(tools) and tool_choice != "none",
        request_key=caller.request_key,
        retry=caller.retry,
        trace_id=caller.trace_id,
        constraint=output_constraint(tools, tool_choice, response_format, tool_format),
        images=images or {},
        has_images=images is not None,
        harness=caller.harness,
    )


def chat_function_tool(tool: Mapping[str, Any], schema_field: str) -> dict[str, Any]:
    """A dialect's function tool (its name, description, and parameter schema under `schema_field`)
    as a chat tool."""
    function = {"name": tool["name"], "parameters": tool.get(schema_field) or {"type": "object"}}
    if tool.get("description"):
        function["description"] = tool["description"]
    return {"type": "function", "function": function}
