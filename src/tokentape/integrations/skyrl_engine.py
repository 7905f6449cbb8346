"""SkyRL's inference client as a tokentape engine: every token comes from the servers whose weights
SkyRL syncs, through `inference_engine_client.generate(InferenceEngineInput, model=) ->
InferenceEngineOutput` (`RemoteInferenceClient`: vLLM's token route behind SkyRL's router).

- Token IDs in (`prompt_token_ids`, one prompt a call), token IDs and logprobs out; nothing is
  re-tokenized. The session id is SkyRL's `session_ids` entry, so its router keeps an episode on the
  server that holds its prefix; `model` is the name SkyRL's own generator passes (a LoRA adapter's
  name where SkyRL trains one).
- n>1: the gateway runs n choices, each its own call here (SkyRL's client refuses n>1).
- Sampling is the trainer's: the `sampling_params` of the `GeneratorInput` (vLLM's names), whatever
  the agent's request says, because SkyRL's actor recomputes logprobs under the rollout's settings.
  The request brings `max_tokens` (held to `max_generate_length`), its stop tokens and seed;
  `logprobs` is asked for always (0: the sampled token's only). A prompt past `max_input_length`
  is `context_length_exceeded`, where SkyRL's own loop stops with `length`.
- `stop_reasons`: vLLM's `stop`/`length`; the gateway reads which from the tokens. `abort` (servers
  paused in abort mode for a weight sync) is resumed with the tokens so far appended to the prompt,
  for what is left of `max_tokens`; keep-mode pauses need nothing (the call just takes longer).
- Images: a prompt's images go to SkyRL's servers as its own Tinker sample path sends them
  (`RemoteInferenceClient._render_for_sample`): the images alone are rendered by the client's
  `render_chat_completion` (vLLM's render route: its processor's placeholder runs and serialized
  `pixel_values`/`image_grid_thw`), and the call's `mm_features` carry those features with each
  image's placeholder range moved to where the gateway's run of it sits in the prompt. A run the
  servers' processor makes of another length than the gateway's is an `EngineProtocolError`
  (tokentape's and vLLM's processor settings differ). `images_refused` (a reason) refuses images
  with that reason instead (SkyRL's step-wise path carries none).
- Versions: the client's `weight_version` (weight syncs so far), read when a call is sent and when
  it returns; the same both times, it labels every token of the call. A call that spans a sync (a
  keep-mode pause) gets the older version and counts in `straddled_calls`: the client does not say
  where the change fell. A client without `weight_version` labels tokens with the batch's
  `global_step`.
"""

from __future__ import annotations

import asyncio
import numbers
import time
from collections.abc import AsyncGenerator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from tokentape.core.export import data_url
from tokentape.core.sampling import SamplingParams
from tokentape.engines.base import Constraint, LogprobMode, PromptImage, SampledToken, vllm_logprob_mode
from tokentape.engines.verl import CallTimes
from tokentape.errors import ContextOverflow, EngineFailure, EngineProtocolError, InvalidRequest

__all__ = ["InferenceClient", "SkyRLEngine", "skyrl_request"]

ABORTED = frozenset({"abort", "aborted"})
MAX_RESUMES = 64  # an answer aborted this many times in a row is a failure, not a weight sync
DROPPED = ("n", "max_tokens", "max_generate_length", "logprobs", "seed")  # the engine sets these per call


class InferenceClient(Protocol):
    """What tokentape calls of SkyRL's `InferenceEngineInterface` (`RemoteInferenceClient`)."""

    async def generate(self, input_batch: Any, model: str | None = None) -> Any: ...


@dataclass(slots=True)
class _Episode:
    sampling: dict[str, Any]
    version: int | None  # the batch's global_step: the version where the client keeps none
    seconds: float = 0.0  # spent inside the client's generate
    resumed: int = 0  # its calls' aborted answers resumed
    straddled: int = 0  # its calls whose tokens came from more than one weights version


def skyrl_request(
    trainer: Mapping[str, Any], params: SamplingParams, *, max_tokens: int, seed: int | None, stop_ids: frozenset[int]
) -> dict[str, Any]:
    """The `sampling_params` of one call: the trainer's sampling, the request's budget, stop tokens and
    seed, logprobs of the sampled token always (the tape needs them)."""
    request = {k: v for k, v in trainer.items() if k not in DROPPED and v is not None}
    request["max_tokens"] = max_tokens
    request["logprobs"] = 0
    request["stop_token_ids"] = sorted(set(trainer.get("stop_token_ids") or ()) | set(params.stop_token_ids) | stop_ids)
    if seed is not None:
        request["seed"] = seed
    request.update(params.reshaping())  # the request's bias and penalties, vLLM's names
    return request


class SkyRLEngine:
    takes_images = True  # as `mm_features` (`base.takes_images`); refused where `images_refused` says why

    def __init__(
        self,
        client: InferenceClient,
        *,
        model_id: str,
        model: str | None,
        max_input_length: int,
        max_generate_length: int,
        end_of_turn_ids: frozenset[int],
        logprobs_mode: str = "raw_logprobs",
        resume_delay: float = 1.0,
        images_refused: str | None = None,
    ) -> None:
        self.client = client
        self.images_refused = images_refused
        self._model_id = model_id
        self.model = model  # passed as `model=`: SkyRL's policy model name or LoRA adapter (None: the client's)
        self.max_input_length = max_input_length
        self.max_generate_length = max_generate_length
        self._end_of_turn = end_of_turn_ids
        self.logprobs_mode = logprobs_mode  # what SkyRL's vLLM servers report (vLLM's default: raw)
        self.resume_delay = resume_delay
        self._episodes: dict[str, _Episode] = {}
        self.tokens_generated = 0
        self.resumed = 0
        self.straddled_calls = 0
        self.times = CallTimes()

    @property
    def model_id(self) -> str:
        return self._model_id

    @property
    def context_length(self) -> int:
        return self.max_input_length + self.max_generate_length

    def open_episode(self, session_id: str, sampling_params: Mapping[str, Any], version: int | None) -> None:
        """The trainer's sampling parameters and the batch's global_step for this session's calls."""
        self._episodes[session_id] = _Episode(dict(sampling_params), version)

    def close_episode(self, session_id: str) -> float:
        """Forget the session; the seconds its calls spent inside the client's `generate`."""
        episode = self._episodes.pop(session_id, None)
        return 0.0 if episode is None else episode.seconds

    def episode_calls(self, session_id: str) -> tuple[int, int]:
        """The session's own calls so far (while it is open): aborted answers resumed, and calls that
        straddled a weight sync. `resumed` and `straddled_calls` count every call since the start."""
        episode = self._episodes.get(session_id)
        return (0, 0) if episode is None else (episode.resumed, episode.straddled)

    def _version(self, episode: _Episode | None) -> int | None:
        value = getattr(self.client, "weight_version", None)
        if isinstance(value, numbers.Integral) and not isinstance(value, bool):
            return int(value)
        return None if episode is None else episode.version

    async def generate(
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
        if constraint is not None:
            raise InvalidRequest(
                "SkyRL's inference servers are not asked for constrained output", param="response_format"
            )
        if len(prompt) > self.max_input_length:
            raise ContextOverflow(
                f"the prompt has {len(prompt)} tokens, past SkyRL's max_input_length of {self.max_input_length}",
                param="messages",
            )
        features = await self.features(prompt, images, session_id) if images else None
        episode = self._episodes.get(session_id or "")
        trainer = episode.sampling if episode is not None else {}
        wanted = (
            self.max_generate_length if params.max_tokens is None else min(params.max_tokens, self.max_generate_length)
        )
        mode = self._mode(trainer)
        sampled: list[int] = []
        for _ in range(MAX_RESUMES):
            request = skyrl_request(
                trainer, params, max_tokens=wanted - len(sampled), seed=seed, stop_ids=self._end_of_turn
            )
            before = self._version(episode)
            output = await self._call(session_id, [*prompt, *sampled], request, episode, features)
            after = self._version(episode)
            tokens = [int(t) for t in output["response_ids"][0]]
            logprobs = (output.get("response_logprobs") or [None])[0]
            if tokens and (logprobs is None or len(logprobs) != len(tokens)):
                raise EngineProtocolError("SkyRL's inference client returned no logprob for every sampled token")
            if before != after:
                self.straddled_calls += 1
                if episode is not None:
                    episode.straddled += 1
            version = after if before is None else before if after is None else min(before, after)
            self.tokens_generated += len(tokens)
            for token, logprob in zip(tokens, logprobs or (), strict=True):
                sampled.append(token)
                yield SampledToken(token, float(logprob), (), mode, version)
            reason = str(output["stop_reasons"][0])
            ended = bool(sampled) and sampled[-1] in request["stop_token_ids"]
            if reason not in ABORTED or ended or len(sampled) >= wanted:
                return
            self.resumed += 1  # SkyRL paused its servers in abort mode: go on where it stopped
            if episode is not None:
                episode.resumed += 1
            await asyncio.sleep(self.resume_delay)
        raise EngineFailure(f"SkyRL's inference client aborted the request {MAX_RESUMES} times in a row")

    def _mode(self, trainer: Mapping[str, Any]) -> LogprobMode:
        params = SamplingParams(
            temperature=float(trainer.get("temperature", 1.0)),
            top_p=float(trainer.get("top_p", 1.0)),
            top_k=max(int(trainer.get("top_k", 0) or 0), 0),
            min_p=float(trainer.get("min_p", 0.0) or 0.0),
        )
        return vllm_logprob_mode(params, self.logprobs_mode)

    async def features(
        self, prompt: Sequence[int], images: Sequence[PromptImage], session_id: str | None
    ) -> dict[str, Any]:
        """SkyRL's `MultiModalFeatures` of a prompt's images: rendered by the client, placed at the
        gateway's runs (the pad tokens between each run's vision markers)."""
        if self.images_refused:
            raise InvalidRequest(self.images_refused, param="messages", code="images_not_supported")
        render = getattr(self.client, "render_chat_completion", None)
        if render is None:
            raise InvalidRequest(
                "SkyRL's inference client has no render_chat_completion: its servers cannot be given images",
                param="messages",
                code="images_not_supported",
            )
        ordered = sorted(images, key=lambda image: image.run.start)
        parts = [{"type": "image_url", "image_url": {"url": data_url(image.image)}} for image in ordered]
        body: dict[str, Any] = {"messages": [{"role": "user", "content": parts}]}
        if self.model is not None:
            body["model"] = self.model
        if session_id:
            body["session_id"] = session_id  # routed where the session's calls go
        try:
            rendered: Mapping[str, Any] = await render({"json": body})
        except (asyncio.CancelledError, InvalidRequest):
            raise
        except Exception as exc:
            raise EngineFailure(f"SkyRL's inference_engine_client.render_chat_completion failed: {exc!r}") from exc
        features = rendered.get("features") or {}
        rendered_ids = list(rendered.get("token_ids") or ())
        placeholders = list((features.get("mm_placeholders") or {}).get("image") or ())
        if len(placeholders) != len(ordered):
            raise EngineProtocolError(
                f"SkyRL's render route placed {len(placeholders)} image(s) for the {len(ordered)} sent"
            )
        ranges: list[dict[str, int]] = []
        for image, placed in zip(ordered, placeholders, strict=True):
            offset, length = image.run.start + 1, image.run.length - 2  # the pads inside the markers
            theirs = rendered_ids[int(placed["offset"]) : int(placed["offset"]) + int(placed["length"])]
            if int(placed["length"]) != length or theirs != list(prompt[offset : offset + length]):
                raise EngineProtocolError(
                    f"SkyRL's servers make {placed['length']} placeholder tokens of image {image.image.digest[:12]}, "
                    f"the gateway's processor {length}: give both the same processor settings"
                )
            ranges.append({"offset": offset, "length": length})
        return {
            "mm_hashes": features.get("mm_hashes") or {},
            "mm_placeholders": {"image": ranges},
            "kwargs_data": features.get("kwargs_data"),
        }

    async def _call(
        self,
        session_id: str | None,
        prompt: list[int],
        request: dict[str, Any],
        episode: _Episode | None,
        features: dict[str, Any] | None = None,
    ) -> Mapping[str, Any]:
        batch: dict[str, Any] = {"prompt_token_ids": [prompt], "sampling_params": request, "session_ids": [session_id]}
        if features is not None:
            batch["mm_features"] = [features]
        started = time.perf_counter()
        try:
            output: Mapping[str, Any] = await self.client.generate(batch, model=self.model)
            return output
        except (asyncio.CancelledError, InvalidRequest):
            raise
        except Exception as exc:  # a server, router or Ray failure: the gateway's engine error
            raise EngineFailure(f"SkyRL's inference_engine_client.generate failed: {exc!r}") from exc
        finally:
            spent = time.perf_counter() - started
            self.times.record(spent)
            if episode is not None:
                episode.seconds += spent

    def describe(self) -> dict[str, Any]:
        return {
            "kind": "skyrl",
            "model": self._model_id,
            "tokens_generated": self.tokens_generated,
            "resumed": self.resumed,
            "straddled_calls": self.straddled_calls,
            "episodes_open": len(self._episodes),
        }

    async def close(self) -> None:
        return None
