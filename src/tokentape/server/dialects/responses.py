"""OpenAI Responses (`POST /v1/responses`) <-> the gateway's chat turn.

Requests: input items (messages, `function_call`, `function_call_output`, `reasoning`) become chat
messages; `instructions` the system message; flat function tools chat tools; `text.format` the
response format. `previous_response_id` names a recorded turn: its conversation (kept by
`ResponseHistory`) is put in front of the new input, so the turn extends that branch of the tape.
An agent that resends the whole history instead gets the same result: its echoed output items merge
back into the assistant message that was returned, which the session recognises.

Responses: built as the `openai` package's own `Response` and stream-event types (validated, so the
SDK parses what it expects), plus the token data chat completions carry: `prompt_token_ids`,
`token_ids`, `session_id`. With `include=["message.output_text.logprobs"]` the sampled tokens'
logprobs are where the SDK reads them: in each `output_text` part (`output[i].content[j].logprobs`)
and in each `response.output_text.delta`, as OpenAI's `{token, logprob, bytes, top_logprobs}`. A part
lists the tokens of its text; a delta that carries no text hands its tokens to the next one (a token
may end inside a character), and tokens that only made reasoning are in no part. Unstreamed, a reply
comes as one piece, so its part lists every sampled token. `output_logprobs` at the top level keeps
every sampled token (tool-call text included), as earlier versions answered.

This module is the dialect (`OpenAIResponses`); the request is read in `responses_input` (its tools
in `responses_tools`), the answer shaped in `responses_output`, and the conversations
`previous_response_id` continues kept in `responses_history`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import orjson

from tokentape.core.images import has_images
from tokentape.core.messages import Message
from tokentape.errors import InvalidRequest, TokentapeError
from tokentape.gateway.calls import Call, ChatCall, ChoiceDone, Event, Started, TextDelta
from tokentape.server.dialects.common import Caller, chat_call, sampling_from_wire
from tokentape.server.dialects.images import LazyIntake
from tokentape.server.dialects.responses_history import ResponseHistory
from tokentape.server.dialects.responses_input import (
    LOGPROBS_INCLUDE,
    ResponsesRequest,
    chat_messages,
    refuse_unapplied,
    response_format,
)
from tokentape.server.dialects.responses_output import ResponseShaper
from tokentape.server.dialects.responses_tools import chat_tool_choice, tool_table
from tokentape.server.dialects.wire import TokenText, named_sse
from tokentape.server.errors import OPENAI_ERRORS, ErrorShape
from tokentape.server.serving import Dialect, DialectContext

__all__ = ["RESPONSES_ERRORS", "OpenAIResponses"]


def _responses_error_event(exc: TokentapeError) -> bytes:
    event = {"type": "error", "code": exc.code, "message": exc.message, "param": exc.param, "sequence_number": 0}
    return b"event: error\ndata: " + orjson.dumps(event) + b"\n\n"


RESPONSES_ERRORS = ErrorShape("openai-responses", OPENAI_ERRORS.body, _responses_error_event)


class OpenAIResponses(Dialect[ResponsesRequest]):
    """OpenAI Responses: input items (or `previous_response_id` and new input) in, one assistant turn
    sampled and recorded, answered as a `Response` (or its stream events) with the token data."""

    path = "/v1/responses"
    history_field = "input"
    errors = RESPONSES_ERRORS
    request_model = ResponsesRequest

    def __init__(self, context: DialectContext, history: ResponseHistory | None = None) -> None:
        super().__init__(context)
        self.history = history or ResponseHistory(held=context.held)

    def to_call(self, req: ResponsesRequest, raw: dict[str, Any], caller: Caller) -> ChatCall:
        """The conversation `previous_response_id` continues is looked up here, once, before the
        turn: nothing after the turn is recorded can fail for it."""
        session_id = caller.session_id
        earlier: list[Message] = []
        if req.previous_response_id is not None:
            owner, earlier = self.history.recall(req.previous_response_id)
            if session_id is not None and session_id != owner:
                raise InvalidRequest(
                    f"previous_response_id belongs to session '{owner}', not '{session_id}'",
                    param="previous_response_id",
                )
            session_id = owner
        refuse_unapplied(req)
        table = tool_table(req.tools)
        images = LazyIntake(self.context.image_intake)
        messages: list[Message] = [*earlier, *chat_messages(req.input, images, table)]
        if earlier and images.images is None and has_images(earlier):  # the continued conversation's images
            images()
        if not messages:
            raise InvalidRequest("input must not be empty", param="input")
        if req.instructions:
            messages.insert(0, {"role": "system", "content": req.instructions})
        if req.top_logprobs and not req.wants_logprobs:  # as chat answers top_logprobs without logprobs
            raise InvalidRequest(f"top_logprobs requires include=['{LOGPROBS_INCLUDE}']", param="top_logprobs")
        sampling = sampling_from_wire(
            req,
            max_tokens=req.max_output_tokens,
            logprobs=req.wants_logprobs,
            top_logprobs=req.top_logprobs,
            names={"max_tokens": "max_output_tokens"},
        )
        choice, answer_format = chat_tool_choice(req.tool_choice), response_format(req.text)
        effort = (req.reasoning or {}).get("effort")
        return chat_call(
            req,
            caller,
            messages,
            sampling,
            self.tool_format,
            table.chat or None,
            choice,
            answer_format,
            template_kwargs={"reasoning_effort": effort} if isinstance(effort, str) else None,
            session_id=session_id,
            images=images.images,
            notes=(table.note,) if table.note else (),
        )

    def _shaper(self, req: ResponsesRequest, started: Started) -> ResponseShaper:
        tokens = TokenText(self.tokenizer, bool(req.return_tokens_as_token_ids))
        return ResponseShaper(
            req,
            session_id=started.session_id,
            prompt=started.prompt_token_ids,
            tokens=tokens,
            show_prompt=self.shows_prompt(req),
        )

    def _remember(self, req: ResponsesRequest, call: Call, shaper: ResponseShaper, done: ChoiceDone) -> None:
        """Keeps the conversation for a later `previous_response_id` (a dict insert: cannot fail)."""
        if req.store is not False:
            assert isinstance(call, ChatCall)
            conversation = list(call.messages[1:] if req.instructions else call.messages)
            self.history.remember(shaper.id, shaper.session_id, [*conversation, done.reply.message()])

    def respond(self, req: ResponsesRequest, call: Call, started: Started, choices: list[ChoiceDone]) -> dict[str, Any]:
        shaper = self._shaper(req, started)
        (done,) = choices
        self._remember(req, call, shaper, done)
        return shaper.response(done)

    async def stream(
        self, req: ResponsesRequest, call: Call, started: Started, events: AsyncIterator[Event]
    ) -> AsyncIterator[bytes]:
        shaper = self._shaper(req, started)
        for opened in shaper.opening():
            yield named_sse(opened)
        try:
            async for event in events:
                if isinstance(event, TextDelta):
                    for shaped in shaper.delta(event):
                        yield named_sse(shaped)
                elif isinstance(event, ChoiceDone):
                    self._remember(req, call, shaper, event)
                    for shaped in shaper.closing(event):
                        yield named_sse(shaped)
        except TokentapeError as exc:  # after the first byte: an error event with its place in the sequence
            yield named_sse(shaper.error(exc.message, exc.code, exc.param))
