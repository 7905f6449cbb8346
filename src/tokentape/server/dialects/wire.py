"""What every dialect writes the same way: a sampled token as text and bytes, a logprob entry
(OpenAI's `{token, logprob, bytes, top_logprobs}`, plus `token_id`), and server-sent-event framing."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson

from tokentape.engines.base import SampledToken
from tokentape.render.tokenizer import Tokenizer

__all__ = ["DONE", "TokenText", "named_sse", "sse"]

DONE = b"data: [DONE]\n\n"  # OpenAI's (and vLLM's) end of stream


def sse(payload: dict[str, Any]) -> bytes:
    """One unnamed event (OpenAI chat and completions, vLLM)."""
    return b"data: " + orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n\n"


def named_sse(event: dict[str, Any]) -> bytes:
    """One event named by its `type` (Responses, Anthropic Messages)."""
    return (
        b"event: "
        + str(event["type"]).encode()
        + b"\ndata: "
        + orjson.dumps(event, option=orjson.OPT_SERIALIZE_NUMPY)
        + b"\n\n"
    )


class TokenText:
    """How one response spells its sampled tokens. `as_ids`: every token as `token_id:N`, as vLLM's
    `return_tokens_as_token_ids` (and its token route) does, so that no token is lost to decoding."""

    __slots__ = ("as_ids", "tokenizer")

    def __init__(self, tokenizer: Tokenizer | None, as_ids: bool = False) -> None:
        self.tokenizer = tokenizer  # None: tokens by ID only, without bytes (vLLM's token route)
        self.as_ids = as_ids or tokenizer is None

    def piece(self, token_id: int) -> bytes:
        """The token's bytes; a special token's text, which has none."""
        assert self.tokenizer is not None
        return self.tokenizer.token_bytes(token_id) or self.tokenizer.special_text(token_id).encode()

    def decoded(self, token_id: int) -> str:
        """The token's text as it reads in the output (never `token_id:N`)."""
        assert self.tokenizer is not None
        piece = self.tokenizer.token_bytes(token_id)
        return piece.decode("utf-8", "replace") if piece else self.tokenizer.special_text(token_id)

    def text(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self.as_ids else self.decoded(token_id)

    def entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        if self.tokenizer is None:
            return {"token": f"token_id:{token_id}", "logprob": logprob, "bytes": None, "token_id": token_id}
        piece = self.piece(token_id)  # read once: the bytes, and (decoded) the text
        text = f"token_id:{token_id}" if self.as_ids else piece.decode("utf-8", "replace")
        return {"token": text, "logprob": logprob, "bytes": list(piece), "token_id": token_id}

    def entries(self, tokens: Sequence[SampledToken], top: int, floor: float | None = None) -> list[dict[str, Any]]:
        """One logprob entry per sampled token with its `top` alternatives. `floor`: the lowest
        logprob reported (vLLM clamps there)."""
        out = []
        for sample in tokens:
            entry = self.entry(sample.token_id, _floored(sample.logprob, floor))
            entry["top_logprobs"] = [self.entry(t, _floored(lp, floor)) for t, lp in sample.top_logprobs[:top]]
            out.append(entry)
        return out


def _floored(logprob: float, floor: float | None) -> float:
    return logprob if floor is None else max(logprob, floor)
