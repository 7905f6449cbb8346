"""vLLM's two token routes: the OpenAI server's `/v1/completions` with a token-ID prompt, and its
token endpoint `/inference/v1/generate`. Answers are streamed, so closing
the generation closes the upstream request and vLLM aborts it; for a caller that reads only the result
(`whole`) the answer comes in one piece, and closing that still closes the request. Sampled token IDs
and logprobs are read from the response, never from text."""

from __future__ import annotations

import contextlib
import functools
import json
import uuid
from collections.abc import AsyncGenerator, Sequence
from typing import Any

from tokentape.core.bounded import BoundedCache
from tokentape.core.sampling import SamplingParams
from tokentape.engines.base import (
    Constraint,
    LogprobMode,
    PromptImage,
    SampledToken,
    came_together,
    vllm_logprob_mode,
)
from tokentape.engines.remote.updates import Need, UpdatableRemote
from tokentape.engines.remote.vllm_images import (
    RENDER_ROUTE,
    RenderedImage,
    SentImages,
    features,
    render_body,
    render_cache,
    rendered_image,
)
from tokentape.engines.remote.wire import (
    best_first,
    listed,
    logprob,
    logprob_list,
    quote,
    sampling_fields,
    token_text_id,
    wire_ids,
)
from tokentape.engines.weights import InFlight, WeightSource
from tokentape.errors import EngineFailure, EngineProtocolError, InvalidRequest

__all__ = ["LORA_NAME", "VLLMEngine", "VLLMGenerateEngine"]

# One adapter per engine, replaced in place at each update (`load_inplace`), which generations name as
# their model once it is loaded: a paused (`keep`) generation goes on under the new adapter's weights.
LORA_NAME = "tokentape-policy"

DEV_MODE = "vLLM served with VLLM_SERVER_DEV_MODE=1"
PAUSE = Need("/pause", "pausing", DEV_MODE)
PAUSE_KEEP = Need("/pause", "pausing in place (keep)", f"{DEV_MODE}, a version whose /pause takes mode", query="mode")
RESUME = Need("/resume", "resuming", DEV_MODE)
RESET = Need("/reset_prefix_cache", "dropping the prefix cache computed under the old weights", DEV_MODE)
LOAD_LORA = Need(
    "/v1/load_lora_adapter",
    "loading a LoRA adapter",
    "vLLM served with --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True",
)
RELOAD = Need("/collective_rpc", "reloading whole weights", DEV_MODE)


def _vllm_structured_outputs(constraint: Constraint) -> dict[str, Any]:
    """vLLM's `structured_outputs` (StructuredOutputsParams): json, regex or grammar."""
    if constraint.kind == "json_schema":
        try:
            schema = json.loads(constraint.value)
        except ValueError as exc:
            raise InvalidRequest(f"the JSON schema is not JSON: {exc}", param="response_format") from exc
        return {"json": schema}
    return {"regex" if constraint.kind == "regex" else "grammar": constraint.value}


class VLLMEngine(UpdatableRemote):
    """vLLM's OpenAI server: `/v1/completions`, streamed, prompt as token IDs.

    `logprobs_mode` is the server's `--logprobs-mode`: raw_logprobs (vLLM's default: the model's own
    distribution, no temperature, no truncation) or processed_logprobs (after temperature and the
    top-k/top-p/min-p cut, renormalized).

    New weights: pause with `/pause` (`mode=keep` for keep, `abort` otherwise: the gateway has closed
    its generations already); a LoRA adapter through `/v1/load_lora_adapter` under `LORA_NAME`, in
    place, after which every generation names it as its model; whole weights reloaded in place from a
    directory (`/collective_rpc` `reload_weights` with `weights_path`); `/reset_prefix_cache` unless
    the update keeps the old KV; `/resume`.
    """

    kind = "vllm"
    logprobs_modes = ("raw_logprobs", "processed_logprobs")
    constraint_kinds = frozenset({"json_schema", "regex", "grammar"})
    path = "/v1/completions"
    cache_route, resume_route = RESET.route, RESUME.route

    async def check_weights(self, source: WeightSource, in_flight: InFlight) -> None:
        self._check_kept_adapter(source, in_flight, swaps_in_place=True)
        needs = [PAUSE_KEEP if in_flight == "keep" else PAUSE, RESUME]
        if in_flight != "keep":
            needs.append(RESET)
        needs += {"lora": [LOAD_LORA], "model": [RELOAD], "engine_managed": []}[source.kind]
        await self._require(needs, source)

    async def pause_generation(self, in_flight: InFlight) -> None:
        # a /pause without `mode` (older vLLM) takes it as abort, which is what every mode but keep asks
        await self._step("pause", "/pause", params={"mode": "keep" if in_flight == "keep" else "abort"})
        self.paused = in_flight

    def _served(self, models: list[Any]) -> None:
        # vLLM lists its loaded adapters among its models: ours, loaded before this gateway started
        if any(isinstance(model, dict) and model.get("id") == LORA_NAME for model in models):
            self.adapter = LORA_NAME

    async def load_weights(self, source: WeightSource, version: int) -> None:
        if source.kind == "lora":
            body = {"lora_name": LORA_NAME, "lora_path": source.path, "load_inplace": True}
            await self._step(f"load the LoRA adapter {source.path}", "/v1/load_lora_adapter", body=body)
            self.adapter = LORA_NAME
        elif source.kind == "model":
            # reloaded in place from the new path (vLLM points its model config there itself)
            reload = {"method": "reload_weights", "kwargs": {"weights_path": source.path}}
            await self._step(f"reload its weights from {source.path}", "/collective_rpc", body=reload)
            self.adapter = None  # new base weights; an adapter trained on the old ones is not applied
        self.weight_version = version

    def logprob_mode(self, params: SamplingParams) -> LogprobMode:
        return vllm_logprob_mode(params, self.logprobs_mode)  # one of `logprobs_modes`

    def _body(
        self,
        prompt: Sequence[int],
        params: SamplingParams,
        seed: int | None,
        constraint: Constraint | None,
        whole: bool,
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.adapter or self.model_id,
            "prompt": wire_ids(prompt, to_engine=True),
            **sampling_fields(prompt, params, self.context_length, length_key="max_tokens"),
            "stream": not whole,
            "logprobs": params.top_logprobs,
            # the sampled IDs come back as the logprobs' tokens ("token_id:N"); not `return_token_ids`,
            # with which vLLM also echoes the whole prompt's IDs, parsed on every call for nothing
            "return_tokens_as_token_ids": True,
        }
        if not whole:  # the prompt's length as vLLM counted it, in a last event (checked in e2e-vllm)
            body["stream_options"] = {"include_usage": True}
        if seed is not None:
            body["seed"] = seed % 2**63
        if constraint is not None:
            body["structured_outputs"] = _vllm_structured_outputs(constraint)
        return body

    def generate(
        self,
        prompt: Sequence[int],
        params: SamplingParams,
        *,
        seed: int | None,
        session_id: str | None = None,
        constraint: Constraint | None = None,
        whole: bool = False,
        images: Sequence[PromptImage] = (),
    ) -> AsyncGenerator[SampledToken, None]:
        # the generator that reads the answer itself, not one more that passes each token on: a
        # request the engine cannot take is refused here, before anything is sent
        self._check_constraint(constraint)
        body = self._body(prompt, params, seed, constraint, whole)
        if images:
            return self._with_images(body, prompt, images, session_id, params)
        return self._sampled(body, session_id, params)

    async def _sampled(
        self, body: dict[str, Any], session_id: str | None, params: SamplingParams
    ) -> AsyncGenerator[SampledToken, None]:
        """The tokens of one generation request, as the engine streams them."""
        mode = self.logprob_mode(params)
        streamed = bool(body.get("stream"))
        events = self._events(self.path, body, session_id, _choice_finished)
        try:
            async for event, ahead in events:
                tokens = self._tokens(event, params, mode)
                for token in came_together(tokens, ahead) if streamed else tokens:
                    self.tokens_generated += 1
                    yield token
        finally:
            await events.aclose()

    def _with_images(
        self,
        body: dict[str, Any],
        prompt: Sequence[int],
        images: Sequence[PromptImage],
        session_id: str | None,
        params: SamplingParams,
    ) -> AsyncGenerator[SampledToken, None]:
        """The tokens of a generation whose prompt holds images. The completions route takes token IDs
        without images."""
        raise InvalidRequest(
            f"the {self.kind} engine (vLLM's /v1/completions) takes no images with token IDs; serve the model "
            "behind vLLM's token route (--engine vllm-generate=URL)",
            param="messages",
            code="images_not_supported",
        )

    def _tokens(self, event: dict[str, Any], params: SamplingParams, mode: LogprobMode) -> list[SampledToken]:
        """The sampled tokens of one completions event, checked against the wire format."""
        choices = event.get("choices")
        if not isinstance(choices, list):
            raise EngineProtocolError(f"the engine sent an event without choices: {quote(event)}")
        out: list[SampledToken] = []
        for choice in choices:
            if not isinstance(choice, dict):
                raise EngineProtocolError(f"the engine sent a choice that is not an object: {quote(choice)}")
            logprobs = choice.get("logprobs") or {}
            if not isinstance(logprobs, dict):
                raise EngineProtocolError(f"the engine sent logprobs of an unexpected shape: {quote(logprobs)}")
            ids = self._token_ids(listed(choice.get("token_ids"), "token_ids"))
            spelled = listed(logprobs.get("tokens"), "tokens")
            # vLLM spells the IDs in `tokens` (`token_id:N`) and sends `token_ids` only when asked, which
            # tokentape is not: then the spelled ones are read; where both come, one comparison checks them
            if spelled and (not ids or spelled != [f"token_id:{t}" for t in ids]):
                named = self._token_ids([token_text_id(t) for t in spelled])
                if ids and named != ids:
                    raise EngineProtocolError(f"the engine's token_ids {quote(ids)} and tokens {quote(named)} differ")
                ids = named
            values = logprob_list(listed(logprobs.get("token_logprobs"), "token_logprobs"))
            tops = listed(logprobs.get("top_logprobs"), "top_logprobs") or [None] * len(ids)
            if len(values) != len(ids) or len(tops) != len(ids):
                raise EngineProtocolError(
                    f"the engine sent {len(ids)} token IDs with {len(values)} logprobs and {len(tops)} top_logprobs"
                )
            keep = params.top_logprobs
            if not keep:  # alternatives nobody asked for (vLLM lists the sampled token) are not read
                out += [SampledToken(token, value, (), mode) for token, value in zip(ids, values, strict=True)]
                continue
            for token, value, top in zip(ids, values, tops, strict=True):
                if top is not None and not isinstance(top, dict):
                    raise EngineProtocolError(f"the engine sent top_logprobs of an unexpected shape: {quote(top)}")
                alternatives = [(self._token(token_text_id(t)), logprob(lp)) for t, lp in (top or {}).items()]
                out.append(SampledToken(token, value, best_first(alternatives, keep), mode))
        return out


def _choice_finished(event: dict[str, Any]) -> bool:
    choices = event.get("choices")
    return isinstance(choices, list) and any(isinstance(c, dict) and c.get("finish_reason") for c in choices)


class VLLMGenerateEngine(VLLMEngine):
    """vLLM's token endpoint `/inference/v1/generate` (token IDs in, token IDs out), streamed: each event
    carries new `token_ids` and `logprobs.content[j]` = {token or token_id, logprob, top_logprobs}.
    A server that answers in one piece (no streaming on its side) is read the same way."""

    kind = "vllm-generate"
    path = "/inference/v1/generate"
    takes_images = True  # token IDs with `features` (`vllm_images`)

    image_resends = 0  # generations sent again with every image's tensors after naming one by hash failed

    async def _with_images(
        self,
        body: dict[str, Any],
        prompt: Sequence[int],
        images: Sequence[PromptImage],
        session_id: str | None,
        params: SamplingParams,
    ) -> AsyncGenerator[SampledToken, None]:
        """Images vLLM holds are named by hash alone. vLLM answers one it no longer holds with a bare
        500: before the first token, a request that named any image by hash is sent once more with
        every image's tensors."""
        for resend in (False, True):
            renders = await self._rendered(images, resend=resend)
            body["features"] = features(prompt, images, renders)
            if resend:
                body["request_id"] = uuid.uuid4().hex
            started = False
            try:
                async with contextlib.aclosing(self._taken(body, session_id, params, images, renders)) as tokens:
                    async for token in tokens:
                        started = True
                        yield token
                return
            except (EngineFailure, InvalidRequest):
                if resend or started or all(render.kwargs_data is not None for render in renders):
                    raise
            self._sent.forget()
            self.image_resends += 1

    async def _taken(
        self,
        body: dict[str, Any],
        session_id: str | None,
        params: SamplingParams,
        images: Sequence[PromptImage],
        renders: Sequence[RenderedImage],
    ) -> AsyncGenerator[SampledToken, None]:
        """The generation's tokens; once the first comes, vLLM took the images (`_took`)."""
        first = True
        async with contextlib.aclosing(self._sampled(body, session_id, params)) as tokens:
            async for token in tokens:
                if first:
                    first = False
                    self._took(images, renders)
                yield token

    async def _rendered(self, images: Sequence[PromptImage], *, resend: bool) -> list[RenderedImage]:
        """Each image's render, with its tensors where vLLM is not known to hold them (every one when
        `resend`); vLLM's render route is asked for each image whose render is not kept."""
        renders = []
        for image in images:
            render = self._renders.get(image.run.digest)
            named = render is not None and not resend and render.mm_hash in self._sent
            if render is None or (render.kwargs_data is None and not named):
                answer = await self._call("POST", RENDER_ROUTE, body=render_body(self.adapter or self.model_id, image))
                render = rendered_image(answer)
                self._renders.put(image.run.digest, render)
            renders.append(render.without_tensors() if named else render)
        return renders

    def _took(self, images: Sequence[PromptImage], renders: Sequence[RenderedImage]) -> None:
        """vLLM took the request: the tensors sent are held there, and leave this process's memory."""
        self._sent.took(renders)
        for image, render in zip(images, renders, strict=True):
            if render.kwargs_data is not None:
                self._renders.put(image.run.digest, render.without_tensors())

    @functools.cached_property
    def _renders(self) -> BoundedCache[str, RenderedImage]:
        return render_cache()

    @functools.cached_property
    def _sent(self) -> SentImages:
        return SentImages()

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "image_resends": self.image_resends}

    def _body(
        self,
        prompt: Sequence[int],
        params: SamplingParams,
        seed: int | None,
        constraint: Constraint | None,
        whole: bool,
    ) -> dict[str, Any]:
        sampling: dict[str, Any] = {
            **sampling_fields(prompt, params, self.context_length, length_key="max_tokens"),
            # vLLM lists the sampled token first and cuts the list at `logprobs` entries: one more
            # than asked keeps the k best whether or not the sampled token is among them
            "logprobs": params.top_logprobs + 1,
        }
        if seed is not None:
            sampling["seed"] = seed % 2**63
        if constraint is not None:
            sampling["structured_outputs"] = _vllm_structured_outputs(constraint)
        return {
            "model": self.adapter or self.model_id,
            "request_id": uuid.uuid4().hex,
            "token_ids": wire_ids(prompt, to_engine=True),
            "sampling_params": sampling,
            "stream": not whole,
        }

    def _tokens(self, event: dict[str, Any], params: SamplingParams, mode: LogprobMode) -> list[SampledToken]:
        choices = event.get("choices")
        if not isinstance(choices, list):
            raise EngineProtocolError(f"the engine sent an event without choices: {quote(event)}")
        out: list[SampledToken] = []
        for choice in choices:
            if not isinstance(choice, dict):
                raise EngineProtocolError(f"the engine sent a choice that is not an object: {quote(choice)}")
            ids = [self._token(t) for t in listed(choice.get("token_ids"), "token_ids")]
            logprobs = choice.get("logprobs") or {}
            content = listed(logprobs.get("content") if isinstance(logprobs, dict) else logprobs, "logprobs.content")
            if len(content) != len(ids):
                raise EngineProtocolError(f"the engine sent {len(ids)} token IDs with {len(content)} logprobs")
            for token, entry in zip(ids, content, strict=True):
                if not isinstance(entry, dict):
                    raise EngineProtocolError(f"the engine sent a logprob entry {quote(entry)}")
                if self._entry_token(entry) != token:
                    raise EngineProtocolError(f"the engine's logprob entry {quote(entry)} is not for token {token}")
                alternatives = []
                for alt in listed(entry.get("top_logprobs"), "top_logprobs"):
                    if not isinstance(alt, dict):
                        raise EngineProtocolError(f"the engine sent a top_logprobs entry {quote(alt)}")
                    alternatives.append((self._entry_token(alt), logprob(alt.get("logprob"))))
                top = best_first(alternatives, params.top_logprobs)
                out.append(SampledToken(token, logprob(entry.get("logprob")), top, mode))
        return out

    def _entry_token(self, entry: dict[str, Any]) -> int:
        """An entry names its token as `token_id: N` or as `token: "token_id:N"`, by vLLM version."""
        if "token_id" in entry:
            return self._token(entry["token_id"])
        return self._token(token_text_id(entry.get("token")))
