"""verl's rollout servers as a tokentape engine (`trainer_engine.TrainerEngine`): every token comes
from the servers whose weights verl updates, through the agent loop's `server_manager.generate(
request_id, *, prompt_ids, sampling_params) -> TokenOutput(token_ids, log_probs, stop_reason,
extra_fields)`.

- The session id is verl's `request_id`: its load balancer sends one request id to one server, so
  every turn of an episode lands on the server that holds its prefix in cache (a call outside a
  session gets one id for all its resumes).
- Sampling is the trainer's: temperature, top_p and top_k come from the `sampling_params` verl hands
  the agent loop (`open_episode`). The request brings `max_tokens`, its stop tokens and seed (to
  vLLM's servers only: SGLang's sampling has no `seed`). `max_tokens` is held to the room the
  episode has left in verl's `response_length` (counted from the episode's first prompt, as verl's
  own loops count), and to `response_length` per call as verl's servers do; an episode with no room
  left gets `context_length_exceeded`.
- `stop_reason`: vLLM says `completed` for a stop and for a length alike, SGLang `stop`/`length`;
  the gateway reads which from the tokens. `aborted` (verl pausing its servers to sync weights) is
  resumed as verl's partial rollout resumes.
- Images: a prompt's images go to `generate` as verl's own multimodal loops pass them,
  `image_data` (PIL images, one per placeholder run, in prompt order) beside `prompt_ids` whose runs
  the model's processor already expanded; a text-only prompt's call carries no `image_data`.
- Versions: each call's `extra_fields["global_steps"]` (the weights version of the server that
  answered) becomes the version of every token it sampled, so a turn resumed across a weight sync
  carries two policy spans. A call that itself spans versions (verl's `FullyAsyncLLMServerClient`
  resumes inside `generate` and reports only `min_global_steps`/`max_global_steps`) does not say
  where the change fell: its tokens get the older version, and `straddled_calls` counts them.
"""

from __future__ import annotations

import io
import numbers
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from tokentape.engines.base import PromptImage
from tokentape.errors import ContextOverflow
from tokentape.integrations.trainer_engine import Answer, Episode, TrainerEngine

__all__ = ["ServerManager", "VerlEngine", "pil_images"]


class ServerManager(Protocol):
    """What tokentape calls of verl's `LLMServerClient` (verl/workers/rollout/llm_server.py)."""

    async def generate(
        self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any], **images: Any
    ) -> Any: ...


@dataclass(slots=True)
class VerlEpisode(Episode):
    first_prompt: int | None = None  # the length of the episode's first prompt


class VerlEngine(TrainerEngine[VerlEpisode]):
    kind = "verl"
    servers = "verl's rollout servers"
    server = "verl's server"
    asked_logprobs = True

    def __init__(
        self,
        server_manager: ServerManager,
        *,
        model_id: str,
        prompt_length: int,
        response_length: int,
        end_of_turn_ids: frozenset[int],
        logprobs_mode: str = "processed_logprobs",
        resume_delay: float = 1.0,
        takes_seed: bool = True,
    ) -> None:
        # logprobs_mode: verl's rollout.logprobs_mode; resume_delay: verl waits 1 s before it resumes
        super().__init__(
            model_id=model_id, end_of_turn_ids=end_of_turn_ids, logprobs_mode=logprobs_mode, resume_delay=resume_delay
        )
        self.server_manager = server_manager
        self.prompt_length = prompt_length
        self.response_length = response_length
        self.takes_seed = takes_seed  # verl's vLLM servers take `seed`; SGLang's sampling has no such key

    @property
    def context_length(self) -> int:
        """verl's servers hold prompt_length + response_length tokens (their default budget)."""
        return self.prompt_length + self.response_length

    def _episode(self, sampling: dict[str, Any]) -> VerlEpisode:
        return VerlEpisode(sampling)

    def episode_preempted(self, session_id: str) -> int:
        """The session's own preemptions so far (while it is open): its aborted answers resumed, plus
        those its servers resumed themselves (`TokenOutput.num_preempted`). verl's `num_preempted`
        is per sample; `resumed` counts every call since the start."""
        episode = self._episodes.get(session_id)
        return 0 if episode is None else episode.resumed + episode.preempted

    def room(self, session_id: str | None, prompt_length: int) -> int:
        """Tokens a call may still sample: within `response_length` past the episode's first prompt
        (capped at `prompt_length`, as verl caps a prompt), and at most `response_length` per call."""
        episode = self._episodes.get(session_id or "")
        first = prompt_length if episode is None or episode.first_prompt is None else episode.first_prompt
        return min(self.response_length, min(first, self.prompt_length) + self.response_length - prompt_length)

    def _budget(self, session_id: str | None, prompt_length: int, max_tokens: int | None) -> int:
        episode = self._episodes.get(session_id or "")
        if episode is not None and episode.first_prompt is None:
            episode.first_prompt = prompt_length
        room = self.room(session_id, prompt_length)
        if room <= 0:
            raise ContextOverflow(
                f"the episode has used verl's response_length of {self.response_length} tokens "
                f"({prompt_length} tokens in this prompt)",
                param="messages",
            )
        return room if max_tokens is None else min(max_tokens, room)

    def _call_id(self, session_id: str | None) -> str:
        return session_id or f"tokentape-{id(self):x}-{time.monotonic_ns()}"

    async def _images(self, prompt: Sequence[int], images: Sequence[PromptImage], session_id: str | None) -> Any:
        return pil_images(images)

    async def _sample(
        self,
        call_id: str | None,
        prompt: list[int],
        request: dict[str, Any],
        episode: VerlEpisode | None,
        images: Any,
    ) -> Answer:
        extra = {} if images is None else {"image_data": images}
        output = await self._timed(
            lambda: self.server_manager.generate(str(call_id), prompt_ids=prompt, sampling_params=request, **extra),
            episode,
            "verl's server_manager.generate",
        )
        fields = output.extra_fields or {}
        return Answer(
            tokens=[int(token) for token in output.token_ids],
            logprobs=output.log_probs,
            reason=str(output.stop_reason),
            version=_version(fields),
            straddled=_straddles(fields),
            preempted=int(getattr(output, "num_preempted", None) or 0),
        )


def _version(extra: Mapping[str, Any]) -> int | None:
    """The weights version that sampled a call's tokens; the older one where the call spans two."""
    for key in ("min_global_steps", "global_steps"):
        value = extra.get(key)
        if isinstance(value, numbers.Integral) and not isinstance(value, bool):
            return int(value)
    return None


def _straddles(extra: Mapping[str, Any]) -> bool:
    low, high = extra.get("min_global_steps"), extra.get("max_global_steps")
    return isinstance(low, numbers.Integral) and isinstance(high, numbers.Integral) and low != high


def pil_images(images: Sequence[PromptImage]) -> list[Any]:
    """A prompt's images as verl's loops hand them to its servers and its trainer: PIL images in RGB
    (as verl's dataset opens them), one per placeholder run, in the order of the runs."""
    from PIL import Image

    ordered = sorted(images, key=lambda image: image.run.start)
    return [Image.open(io.BytesIO(image.image.data)).convert("RGB") for image in ordered]
