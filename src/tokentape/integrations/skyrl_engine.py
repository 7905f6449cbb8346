"""SkyRL's inference client as a tokentape engine (`trainer_engine.TrainerEngine`): every token comes
from the servers whose weights SkyRL syncs, through `inference_engine_client.generate(InferenceEngineInput, model=) ->
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

import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from tokentape.core.export import data_url
from tokentape.engines.base import PromptImage
from tokentape.errors import ContextOverflow, EngineProtocolError, InvalidRequest
from tokentape.integrations.trainer_engine import Answer, Episode, TrainerEngine, trainer_call

__all__ = ["InferenceClient", "SkyRLEngine"]


class InferenceClient(Protocol):
    """What tokentape calls of SkyRL's `InferenceEngineInterface` (`RemoteInferenceClient`)."""

    async def generate(self, input_batch: Any, model: str | None = None) -> Any: ...


@dataclass(slots=True)
class SkyRLEpisode(Episode):
    version: int | None = None  # the batch's global_step: the version where the client keeps none


class SkyRLEngine(TrainerEngine[SkyRLEpisode]):
    kind = "skyrl"
    servers = "SkyRL's inference servers"
    server = "SkyRL's inference client"
    asked_logprobs = 0  # vLLM's count of top logprobs: the sampled token's own only

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
        # logprobs_mode: what SkyRL's vLLM servers report (vLLM's default: raw)
        super().__init__(
            model_id=model_id, end_of_turn_ids=end_of_turn_ids, logprobs_mode=logprobs_mode, resume_delay=resume_delay
        )
        self.client = client
        self.images_refused = images_refused
        self.model = model  # passed as `model=`: SkyRL's policy model name or LoRA adapter (None: the client's)
        self.max_input_length = max_input_length
        self.max_generate_length = max_generate_length

    @property
    def context_length(self) -> int:
        return self.max_input_length + self.max_generate_length

    def open_episode(self, session_id: str, sampling_params: Mapping[str, Any], version: int | None = None) -> None:
        """The trainer's sampling parameters and the batch's global_step for this session's calls."""
        super().open_episode(session_id, sampling_params)
        self._episodes[session_id].version = version

    def _episode(self, sampling: dict[str, Any]) -> SkyRLEpisode:
        return SkyRLEpisode(sampling)

    def episode_calls(self, session_id: str) -> tuple[int, int]:
        """The session's own calls so far (while it is open): aborted answers resumed, and calls that
        straddled a weight sync. `resumed` and `straddled_calls` count every call since the start."""
        episode = self._episodes.get(session_id)
        return (0, 0) if episode is None else (episode.resumed, episode.straddled)

    def _version(self, episode: SkyRLEpisode | None) -> int | None:
        value = getattr(self.client, "weight_version", None)
        if isinstance(value, numbers.Integral) and not isinstance(value, bool):
            return int(value)
        return None if episode is None else episode.version

    def _budget(self, session_id: str | None, prompt_length: int, max_tokens: int | None) -> int:
        if prompt_length > self.max_input_length:
            raise ContextOverflow(
                f"the prompt has {prompt_length} tokens, past SkyRL's max_input_length of {self.max_input_length}",
                param="messages",
            )
        return self.max_generate_length if max_tokens is None else min(max_tokens, self.max_generate_length)

    async def _images(self, prompt: Sequence[int], images: Sequence[PromptImage], session_id: str | None) -> Any:
        return await self.features(prompt, images, session_id)

    async def _sample(
        self,
        call_id: str | None,
        prompt: list[int],
        request: dict[str, Any],
        episode: SkyRLEpisode | None,
        images: Any,
    ) -> Answer:
        batch: dict[str, Any] = {"prompt_token_ids": [prompt], "sampling_params": request, "session_ids": [call_id]}
        if images is not None:
            batch["mm_features"] = [images]
        before = self._version(episode)
        output: Mapping[str, Any] = await self._timed(
            lambda: self.client.generate(batch, model=self.model),
            episode,
            "SkyRL's inference_engine_client.generate",
        )
        after = self._version(episode)
        return Answer(
            tokens=[int(token) for token in output["response_ids"][0]],
            logprobs=(output.get("response_logprobs") or [None])[0],
            reason=str(output["stop_reasons"][0]),
            version=after if before is None else before if after is None else min(before, after),
            straddled=before != after,
        )

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
        with trainer_call("SkyRL's inference_engine_client.render_chat_completion"):
            rendered: Mapping[str, Any] = await render({"json": body})
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
