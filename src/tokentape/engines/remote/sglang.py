"""SGLang's native `/generate`, token IDs in (`input_ids`) and out (`output_token_logprobs`),
streamed. Closing the generation closes the request, and SGLang is sent `/abort_request` for it as
well (it does not abort on a closed connection). Sampled token IDs and logprobs are read from the
response, never from text."""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncGenerator, Sequence
from typing import Any

import aiohttp

from tokentape.core.sampling import SamplingParams
from tokentape.engines.base import Constraint, LogprobMode, SampledToken, came_together, logprob_mode
from tokentape.engines.remote.client import run_to_completion
from tokentape.engines.remote.updates import Need, UpdatableRemote
from tokentape.engines.remote.wire import best_first, listed, logprob, quote, sampling_fields, wire_ids
from tokentape.engines.weights import InFlight, WeightSource, WeightUpdateFailed
from tokentape.errors import EngineProtocolError

__all__ = ["SGLangEngine"]

log = logging.getLogger("tokentape.engines")

PAUSE = Need("/pause_generation", "pausing", "SGLang with /pause_generation")
PAUSE_IN_PLACE = Need(
    "/pause_generation", "pausing in place (keep)", "SGLang newer than 0.5.5, whose pause takes a mode", body=True
)
CONTINUE = Need("/continue_generation", "resuming", "SGLang with /continue_generation")
FLUSH = Need("/flush_cache", "dropping the radix cache computed under the old weights", "SGLang")
LOAD_LORA = Need("/load_lora_adapter", "loading a LoRA adapter", "SGLang with dynamic LoRA loading")
FROM_DISK = Need("/update_weights_from_disk", "loading whole weights", "SGLang")


class SGLangEngine(UpdatableRemote):
    """SGLang's native `/generate`, streamed, with `input_ids` and `return_logprob`.

    `logprobs_mode`: default (SGLang's: after temperature and the top-p cut, renormalized; top-k and
    min-p are not applied to the reported values) or original (the server runs with
    SGLANG_RETURN_ORIGINAL_LOGPROB=1: the model's own distribution).

    New weights: `/pause_generation` (`in_place` for keep, `abort` otherwise: the gateway has closed
    its generations already); a LoRA adapter through `/load_lora_adapter` under a name of its version
    (SGLang loads no adapter twice under one name), which generations then name as their `lora_path`,
    and the one before it unloaded; whole weights through `/update_weights_from_disk`; `/flush_cache`
    unless the update keeps the old KV; `/continue_generation`.
    """

    kind = "sglang"
    logprobs_modes = ("default", "original")
    constraint_kinds = frozenset({"json_schema", "regex", "grammar"})
    version_path = "/get_server_info"  # its server arguments and `version`
    cache_route, resume_route = FLUSH.route, CONTINUE.route

    async def check_weights(self, source: WeightSource, in_flight: InFlight) -> None:
        # SGLang loads no adapter twice under one name: each version's is a new one, never swapped in place
        self._check_kept_adapter(source, in_flight, swaps_in_place=False)
        needs = [PAUSE_IN_PLACE if in_flight == "keep" else PAUSE, CONTINUE]
        if in_flight != "keep":
            needs.append(FLUSH)
        needs += {"lora": [LOAD_LORA], "model": [FROM_DISK], "engine_managed": []}[source.kind]
        reported = await self._require(needs, source)
        if source.kind == "lora" and reported.get("enable_lora") is False:
            raise self._refused("it was started without --enable-lora")

    async def pause_generation(self, in_flight: InFlight) -> None:
        await self._step("pause", "/pause_generation", body={"mode": "in_place" if in_flight == "keep" else "abort"})
        self.paused = in_flight

    async def load_weights(self, source: WeightSource, version: int) -> None:
        if source.kind == "lora":
            name = f"tokentape-v{version}"
            body = {"lora_name": name, "lora_path": source.path}
            await self._step(f"load the LoRA adapter {source.path}", "/load_lora_adapter", body=body)
            previous, self.adapter = self.adapter, name
            if previous is not None:  # nothing runs under it any more (the update did not keep them)
                try:
                    await self._step(
                        f"unload the LoRA adapter {previous}", "/unload_lora_adapter", body={"lora_name": previous}
                    )
                except WeightUpdateFailed as exc:  # the new one is in; the old one only holds a slot
                    log.warning("%s", exc)
        elif source.kind == "model":
            # stay paused until /continue_generation; flushing under requests paused in place fails
            update = {"model_path": source.path, "weight_version": str(version)}
            await self._step(
                f"load the weights at {source.path}",
                "/update_weights_from_disk",
                body={**update, "keep_pause": True, "flush_cache": self.paused != "keep"},
            )
            self.adapter = None  # new base weights; an adapter trained on the old ones is not applied
        self.weight_version = version

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
            "input_ids": wire_ids(prompt, to_engine=True),
            "sampling_params": sampling,
            "return_logprob": True,
            "top_logprobs_num": params.top_logprobs,
            "stream": not whole,
            "rid": rid,
        }
        if self.adapter is not None:
            body["lora_path"] = self.adapter  # the loaded adapter, by its name
        seen = 0
        finished = False
        events = self._events("/generate", body, session_id, _meta_finished)
        try:
            async for event, ahead in events:
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
                for token in came_together(new, ahead) if not whole else new:
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
