"""verl's rollout servers as a tokentape engine: every token comes from the servers whose weights verl
updates, through the agent loop's `server_manager.generate(request_id, *, prompt_ids,
sampling_params) -> TokenOutput(token_ids, log_probs, stop_reason, extra_fields)`.

- Token IDs in, token IDs and the servers' logprobs out; nothing is re-tokenized.
- The session id is verl's `request_id`: its load balancer sends one request id to one server, so
  every turn of an episode lands on the server that holds its prefix in cache.
- n>1: the gateway runs n choices, each its own call here.
- Sampling is the trainer's: temperature, top_p and top_k come from the `sampling_params` verl hands
  the agent loop (`open_episode`), whatever the agent's request says, because verl's actor
  recomputes logprobs under the rollout's own settings. The request brings `max_tokens`, its stop
  tokens and seed. `max_tokens` is held to the room the episode has left in verl's `response_length`
  (counted from the episode's first prompt, as verl's own loops count), and to `response_length`
  per call as verl's servers do; an episode with no room left gets `context_length_exceeded`.
- `stop_reason`: vLLM says `completed` for a stop and for a length alike, SGLang `stop`/`length`;
  the gateway reads which from the tokens (an end-of-turn or stop token last: stop, else length).
  `aborted` (verl pausing its servers to sync weights) is resumed as verl's partial rollout resumes:
  the same request again with the tokens so far appended to the prompt, for what is left of
  `max_tokens`, until it completes.
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

import asyncio
import io
import numbers
import time
from collections.abc import AsyncGenerator, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from tokentape.core.sampling import SamplingParams
from tokentape.engines.base import Constraint, LogprobMode, PromptImage, SampledToken, vllm_logprob_mode
from tokentape.errors import ContextOverflow, EngineFailure, EngineProtocolError, InvalidRequest

__all__ = ["ServerManager", "VerlEngine", "pil_images", "verl_request"]

ABORTED = frozenset({"aborted", "abort"})
MAX_RESUMES = 64  # an answer aborted this many times in a row is a failure, not a weight sync


class ServerManager(Protocol):
    """What tokentape calls of verl's `LLMServerClient` (verl/workers/rollout/llm_server.py)."""

    async def generate(
        self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any], **images: Any
    ) -> Any: ...


@dataclass(slots=True)
class _Episode:
    """What the engine keeps per session: verl's sampling parameters and the episode's budget."""

    sampling: dict[str, Any]
    first_prompt: int | None = None  # the length of the episode's first prompt
    seconds: float = 0.0  # spent inside server_manager.generate
    preempted: int = 0  # its calls' aborted answers resumed, and preemptions its servers reported


@dataclass(slots=True)
class CallTimes:
    """Seconds spent inside the trainer's own generate call, and calls made (for the integration's
    cost): verl's `server_manager.generate`, SkyRL's inference client."""

    calls: int = 0
    seconds: float = 0.0
    per_call: list[float] = field(default_factory=list)

    def record(self, spent: float) -> None:
        self.calls += 1
        self.seconds += spent
        self.per_call.append(spent)
        del self.per_call[:-10_000]  # the latest calls: enough for a median, bounded for a long run


def verl_request(
    trainer: Mapping[str, Any], params: SamplingParams, *, max_tokens: int, seed: int | None, stop_ids: Collection[int]
) -> dict[str, Any]:
    """The `sampling_params` dict verl's servers take for one call: the trainer's sampling, the
    request's budget and stop tokens, logprobs always on (the tape needs them). `seed`: only where
    the server takes one under that name (vLLM's; SGLang's is another)."""
    request = {k: v for k, v in trainer.items() if k not in ("max_tokens", "max_new_tokens", "n")}
    request["max_tokens"] = max_tokens
    request["logprobs"] = True
    stops = set(trainer.get("stop_token_ids") or ()) | set(params.stop_token_ids) | set(stop_ids)
    request["stop_token_ids"] = sorted(stops)
    if seed is not None:
        request["seed"] = seed
    request.update(params.reshaping())  # the request's bias and penalties: vLLM's and SGLang's names
    return request


class VerlEngine:
    takes_images = True  # as `image_data` (`base.takes_images`)

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
        self.server_manager = server_manager
        self._model_id = model_id
        self.prompt_length = prompt_length
        self.response_length = response_length
        self._end_of_turn = end_of_turn_ids
        self.logprobs_mode = logprobs_mode  # verl's rollout.logprobs_mode: what its vLLM servers report
        self.resume_delay = resume_delay  # seconds before an aborted call is resumed (verl waits 1 s)
        self.takes_seed = takes_seed  # verl's vLLM servers take `seed`; SGLang's sampling has no such key
        self._episodes: dict[str, _Episode] = {}
        self.tokens_generated = 0
        self.resumed = 0  # aborted answers resumed
        self.straddled_calls = 0  # calls whose tokens came from more than one weights version
        self.times = CallTimes()

    @property
    def model_id(self) -> str:
        return self._model_id

    @property
    def context_length(self) -> int:
        """verl's servers hold prompt_length + response_length tokens (their default budget)."""
        return self.prompt_length + self.response_length

    def open_episode(self, session_id: str, sampling_params: Mapping[str, Any]) -> None:
        """The trainer's sampling parameters for this session's calls (verl hands them to `run`)."""
        self._episodes[session_id] = _Episode(dict(sampling_params))

    def close_episode(self, session_id: str) -> float:
        """Forget the session; the seconds its calls spent inside `server_manager.generate`."""
        episode = self._episodes.pop(session_id, None)
        return 0.0 if episode is None else episode.seconds

    def episode_preempted(self, session_id: str) -> int:
        """The session's own preemptions so far (while it is open): its aborted answers resumed, plus
        those its servers resumed themselves (`TokenOutput.num_preempted`). verl's `num_preempted`
        is per sample; `resumed` counts every call since the start."""
        episode = self._episodes.get(session_id)
        return 0 if episode is None else episode.preempted

    def room(self, session_id: str | None, prompt_length: int) -> int:
        """Tokens a call may still sample: within `response_length` past the episode's first prompt
        (capped at `prompt_length`, as verl caps a prompt), and at most `response_length` per call."""
        episode = self._episodes.get(session_id or "")
        first = prompt_length if episode is None or episode.first_prompt is None else episode.first_prompt
        return min(self.response_length, min(first, self.prompt_length) + self.response_length - prompt_length)

    def _mode(self, trainer: Mapping[str, Any]) -> LogprobMode:
        top_k = int(trainer.get("top_k", 0) or 0)
        params = SamplingParams(
            temperature=float(trainer.get("temperature", 1.0)),
            top_p=float(trainer.get("top_p", 1.0)),
            top_k=max(top_k, 0),
            min_p=float(trainer.get("min_p", 0.0) or 0.0),
        )
        return vllm_logprob_mode(params, self.logprobs_mode)

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
            raise InvalidRequest("verl's rollout servers are not asked for constrained output", param="response_format")
        extra = {"image_data": pil_images(images)} if images else {}
        episode = self._episodes.get(session_id or "")
        if episode is not None and episode.first_prompt is None:
            episode.first_prompt = len(prompt)
        room = self.room(session_id, len(prompt))
        if room <= 0:
            raise ContextOverflow(
                f"the episode has used verl's response_length of {self.response_length} tokens "
                f"({len(prompt)} tokens in this prompt)",
                param="messages",
            )
        trainer = episode.sampling if episode is not None else {}
        wanted = room if params.max_tokens is None else min(params.max_tokens, room)
        mode = self._mode(trainer)
        request_id = session_id or f"tokentape-{id(self):x}-{time.monotonic_ns()}"
        sampled: list[int] = []
        for _ in range(MAX_RESUMES):
            left = wanted - len(sampled)
            given = seed if self.takes_seed else None
            request = verl_request(trainer, params, max_tokens=left, seed=given, stop_ids=self._end_of_turn)
            output = await self._call(request_id, [*prompt, *sampled], request, episode, extra)
            tokens, logprobs = list(output.token_ids), output.log_probs
            if tokens and (logprobs is None or len(logprobs) != len(tokens)):
                raise EngineProtocolError("verl's server returned no logprob for every sampled token")
            version = _version(output.extra_fields or {})
            if episode is not None:
                episode.preempted += int(getattr(output, "num_preempted", None) or 0)
            if _straddles(output.extra_fields or {}):
                self.straddled_calls += 1
            self.tokens_generated += len(tokens)
            for token, logprob in zip(tokens, logprobs or (), strict=True):
                sampled.append(int(token))
                yield SampledToken(int(token), float(logprob), (), mode, version)
            ended = bool(sampled) and sampled[-1] in request["stop_token_ids"]
            if output.stop_reason not in ABORTED or ended or len(sampled) >= wanted:
                return
            self.resumed += 1  # verl paused its servers for a weight sync: go on where it stopped
            if episode is not None:
                episode.preempted += 1
            await asyncio.sleep(self.resume_delay)
        raise EngineFailure(f"verl's server aborted the request {MAX_RESUMES} times in a row")

    async def _call(
        self,
        request_id: str,
        prompt: list[int],
        request: dict[str, Any],
        episode: _Episode | None,
        extra: Mapping[str, Any],
    ) -> Any:
        started = time.perf_counter()
        try:
            return await self.server_manager.generate(request_id, prompt_ids=prompt, sampling_params=request, **extra)
        except (asyncio.CancelledError, InvalidRequest):
            raise
        except Exception as exc:  # a server or Ray failure: the gateway's engine error, retried once
            raise EngineFailure(f"verl's server_manager.generate failed: {exc!r}") from exc
        finally:
            spent = time.perf_counter() - started
            self.times.record(spent)
            if episode is not None:
                episode.seconds += spent

    def describe(self) -> dict[str, Any]:
        return {
            "kind": "verl",
            "model": self._model_id,
            "tokens_generated": self.tokens_generated,
            "resumed": self.resumed,
            "straddled_calls": self.straddled_calls,
            "episodes_open": len(self._episodes),
        }

    async def close(self) -> None:
        return None


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
