"""SGLang's native `/generate`, token IDs in (`input_ids`) and out (`output_token_logprobs`),
streamed. Closing the generation closes the request, and SGLang is sent `/abort_request` for it as
well (it does not abort on a closed connection). Sampled token IDs and logprobs are read from the
response, never from text."""

from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator, Sequence
from typing import Any

import aiohttp

from tokentape.core.sampling import SamplingParams
from tokentape.engines.base import Constraint, LogprobMode, SampledToken, logprob_mode
from tokentape.engines.remote.client import RemoteEngine, run_to_completion
from tokentape.engines.remote.wire import best_first, listed, logprob, quote, sampling_fields, wire_ids
from tokentape.errors import EngineProtocolError

__all__ = ["SGLangEngine"]


class SGLangEngine(RemoteEngine):
    """SGLang's native `/generate`, streamed, with `input_ids` and `return_logprob`.

    `logprobs_mode`: default (SGLang's: after temperature and the top-p cut, renormalized; top-k and
    min-p are not applied to the reported values) or original (the server runs with
    SGLANG_RETURN_ORIGINAL_LOGPROB=1: the model's own distribution).
    """

    kind = "sglang"
    logprobs_modes = ("default", "original")
    constraint_kinds = frozenset({"json_schema", "regex", "grammar"})

    def logprob_mode(self, params: SamplingParams) -> LogprobMode:
        if self.logprobs_mode == "original":
            return logprob_mode(params, scaled=False)
        return logprob_mode(params, scaled=True, truncated_by=("top_p",))

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
        self._check_constraint(constraint)
        mode = self.logprob_mode(params)
        rid = uuid.uuid4().hex
        sampling: dict[str, Any] = {
            **sampling_fields(prompt, params, self.context_length, length_key="max_new_tokens"),
            "no_stop_trim": True,  # keep the stop token in the output: it was sampled
        }
        if seed is not None:
            sampling["sampling_seed"] = seed % 2**31
        if constraint is not None:  # SGLang's names: json_schema (text), regex, ebnf
            sampling[{"json_schema": "json_schema", "regex": "regex", "grammar": "ebnf"}[constraint.kind]] = (
                constraint.value
            )
        body = {
            "input_ids": wire_ids(prompt),
            "sampling_params": sampling,
            "return_logprob": True,
            "top_logprobs_num": params.top_logprobs,
            "stream": not whole,
            "rid": rid,
        }
        seen = 0
        finished = False
        events = self._events("/generate", body, session_id, _meta_finished)
        try:
            async for event in events:
                meta = event.get("meta_info")
                if not isinstance(meta, dict):
                    raise EngineProtocolError(f"the engine sent an event without meta_info: {quote(event)}")
                entries = listed(meta.get("output_token_logprobs"), "output_token_logprobs")
                tops = listed(meta.get("output_top_logprobs"), "output_top_logprobs")
                # cumulative by default (each event repeats what came before); a server with incremental
                # output sends only the new part, which its running completion_tokens tells apart
                total = meta.get("completion_tokens")
                incremental = type(total) is int and len(entries) < total
                new = self._sglang_tokens(entries, tops, 0 if incremental else seen, params, mode)
                for token in new:
                    self.tokens_generated += 1
                    seen += 1
                    yield token
                finished = meta.get("finish_reason") is not None
        finally:
            try:
                await events.aclose()
            finally:  # reached even when a cancelled scope cancels the close above
                if not finished:  # the caller left early or it failed: free the engine's slot now
                    await run_to_completion(self._abort(rid))

    def _sglang_tokens(
        self, entries: list[Any], tops: list[Any], start: int, params: SamplingParams, mode: LogprobMode
    ) -> list[SampledToken]:
        out = []
        for k in range(start, len(entries)):
            entry = entries[k]
            if not isinstance(entry, list) or len(entry) < 2:
                raise EngineProtocolError(f"the engine sent a logprob entry of an unexpected shape: {quote(entry)}")
            top = tops[k] if k < len(tops) and tops[k] else []
            if not isinstance(top, list) or not all(isinstance(t, list) and len(t) >= 2 for t in top):
                raise EngineProtocolError(f"the engine sent top logprobs of an unexpected shape: {quote(top)}")
            alternatives = [(self._token(t[1]), logprob(t[0])) for t in top]
            out.append(
                SampledToken(
                    self._token(entry[1]), logprob(entry[0]), best_first(alternatives, params.top_logprobs), mode
                )
            )
        return out

    async def _abort(self, rid: str) -> None:
        try:
            async with self.control.session().post("/abort_request", json={"rid": rid}) as response:
                await response.read()
        except (aiohttp.ClientError, TimeoutError):
            return


def _meta_finished(event: dict[str, Any]) -> bool:
    meta = event.get("meta_info")
    return isinstance(meta, dict) and meta.get("finish_reason") is not None
