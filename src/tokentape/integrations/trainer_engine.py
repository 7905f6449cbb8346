"""A trainer's own servers as a tokentape engine: every token comes from the servers whose weights the
trainer updates, through the trainer's generate call. This module holds what every such adapter
shares; `verl_engine` (verl's `server_manager`) and `skyrl_engine` (SkyRL's inference client) say
only how their trainer is called, what a call's budget is, how images go and where a call's weights
version is read.

- Token IDs in, token IDs and the servers' logprobs out; nothing is re-tokenized.
- n>1: the gateway runs n choices, each its own call. Constrained output is refused.
- Sampling is the trainer's: the `sampling_params` dict it hands an episode (`open_episode`), read
  by `trainer_sampling`, whatever the agent's request says, because the trainer's actor recomputes
  logprobs under the rollout's own settings. The request brings `max_tokens` (held to the trainer's
  budget), its stop tokens, seed, bias and penalties; logprobs are always asked for (the tape needs
  them).
- An answer the servers abort (the trainer pausing them to sync weights) is resumed as the trainers'
  own partial rollouts resume: the same call again with the tokens so far appended to the prompt,
  for what is left of `max_tokens`, until it completes; `MAX_RESUMES` aborts in a row are a failure.
  The gateway reads a stop from a length by the tokens (an end-of-turn or stop token last: stop).
- Versions: every token of a call carries the weights version its adapter reads for the call; a
  call that spans a sync gets the older one and counts in `straddled_calls` (the trainer does not say
  where the change fell).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar

from tokentape.core.sampling import SamplingParams, request_top_k
from tokentape.engines.base import Constraint, PromptImage, SampledToken, vllm_logprob_mode
from tokentape.errors import EngineFailure, EngineProtocolError, InvalidRequest

__all__ = [
    "ABORTED",
    "MAX_RESUMES",
    "Answer",
    "CallTimes",
    "Episode",
    "TrainerEngine",
    "TrainerSampling",
    "asks_logprobs",
    "trainer_call",
    "trainer_sampling",
]

ABORTED = frozenset({"abort", "aborted"})
MAX_RESUMES = 64  # an answer aborted this many times in a row is a failure, not a weight sync
# what the engine sets on every call: the budget (verl's `max_tokens`/SGLang's `max_new_tokens`,
# SkyRL's `max_generate_length`), one choice, logprobs, the request's seed and the stop tokens
SET_PER_CALL = frozenset(
    {"n", "max_tokens", "max_new_tokens", "max_generate_length", "logprobs", "seed", "stop_token_ids"}
)


def asks_logprobs(value: Any) -> bool:
    """Whether a trainer's `logprobs` setting asks for the rollout's logprobs: verl's is a bool
    (`rollout.calculate_log_probs`), SkyRL's vLLM's count of top logprobs (0: the sampled token's
    own); None or False asks for none."""
    return value is not None and value is not False


@dataclass(frozen=True, slots=True)
class TrainerSampling:
    """A trainer's `sampling_params` dict, read once (`trainer_sampling`)."""

    params: SamplingParams  # temperature, top_p, top_k (0: off), min_p and stop_token_ids
    logprobs: bool  # whether the trainer takes the rollout's logprobs back
    passed: dict[str, Any]  # every other key set (not None), sent to the servers as it is: stop, penalties, ...


def trainer_sampling(sampling: Mapping[str, Any]) -> TrainerSampling:
    """verl's and SkyRL's sampling dicts (vLLM's names; SGLang's `max_new_tokens`) as tokentape's
    sampling. A key that is missing or None takes vLLM's default; `top_k` -1 and 0 are both no top-k
    cut (`request_top_k`, as in a request). The keys in `SET_PER_CALL` are the engine's to set per
    call and dropped; any other key the trainer sets goes to its servers untouched. A value out of
    range is an `InvalidRequest`."""

    def number(name: str, default: float) -> float:
        value = sampling.get(name)
        try:
            return default if value is None else float(value)
        except (TypeError, ValueError):
            raise InvalidRequest(f"the trainer's sampling {name} is not a number: {value!r}", param=name) from None

    params = SamplingParams(
        temperature=number("temperature", 1.0),
        top_p=number("top_p", 1.0),
        top_k=request_top_k(int(number("top_k", 0.0))),
        min_p=number("min_p", 0.0),
        stop_token_ids=tuple(sorted({int(t) for t in sampling.get("stop_token_ids") or ()})),
    )
    passed = {k: v for k, v in sampling.items() if k not in SET_PER_CALL and v is not None}
    return TrainerSampling(params, asks_logprobs(sampling.get("logprobs")), passed)


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


@dataclass(slots=True)
class Episode:
    """What the engine keeps per session: the trainer's sampling and the session's own counts."""

    sampling: dict[str, Any]
    seconds: float = 0.0  # spent inside the trainer's generate call
    resumed: int = 0  # its calls' aborted answers resumed
    straddled: int = 0  # its calls whose tokens came from more than one weights version
    preempted: int = 0  # preemptions its servers reported resuming themselves


@dataclass(frozen=True, slots=True)
class Answer:
    """One call's answer, in the trainer's terms read out."""

    tokens: list[int]
    logprobs: Sequence[float] | None
    reason: str  # the trainer's stop reason (`ABORTED`: resumed)
    version: int | None  # the weights version of its tokens (the older one where it straddles)
    straddled: bool = False  # its tokens came from more than one weights version
    preempted: int = 0  # preemptions the server resumed inside the call


@contextlib.contextmanager
def trainer_call(what: str) -> Iterator[None]:
    """A trainer's call failing (a server, router or Ray failure) as the gateway's engine error."""
    try:
        yield
    except (asyncio.CancelledError, InvalidRequest):
        raise
    except Exception as exc:
        raise EngineFailure(f"{what} failed: {exc!r}") from exc


E = TypeVar("E", bound=Episode)
T = TypeVar("T")


class TrainerEngine(ABC, Generic[E]):
    """The resume loop, the episodes, the counts and the description; a trainer's adapter names its
    servers and gives `_episode`, `_budget`, `_images` and `_sample`."""

    kind: ClassVar[str]  # `describe()["kind"]`
    servers: ClassVar[str]  # the servers, as errors name them: "verl's rollout servers"
    server: ClassVar[str]  # one answering a call: "verl's server"
    asked_logprobs: ClassVar[bool | int]  # the `logprobs` of every call: the sampled token's own
    takes_images = True  # (`base.takes_images`)
    takes_seed = True  # whether a call carries the request's seed

    def __init__(
        self, *, model_id: str, end_of_turn_ids: frozenset[int], logprobs_mode: str, resume_delay: float
    ) -> None:
        self._model_id = model_id
        self._end_of_turn = end_of_turn_ids
        self.logprobs_mode = logprobs_mode  # what the trainer's vLLM servers report (their logprobs_mode)
        self.resume_delay = resume_delay  # seconds before an aborted call is resumed
        self._episodes: dict[str, E] = {}
        self.tokens_generated = 0
        self.resumed = 0  # aborted answers resumed
        self.straddled_calls = 0  # calls whose tokens came from more than one weights version
        self.times = CallTimes()

    @property
    def model_id(self) -> str:
        return self._model_id

    @property
    @abstractmethod
    def context_length(self) -> int: ...

    def open_episode(self, session_id: str, sampling_params: Mapping[str, Any]) -> None:
        """The trainer's sampling parameters for this session's calls."""
        self._episodes[session_id] = self._episode(dict(sampling_params))

    def close_episode(self, session_id: str) -> float:
        """Forget the session; the seconds its calls spent inside the trainer's generate call."""
        episode = self._episodes.pop(session_id, None)
        return 0.0 if episode is None else episode.seconds

    def request(
        self, trainer: TrainerSampling, params: SamplingParams, *, max_tokens: int, seed: int | None
    ) -> dict[str, Any]:
        """The `sampling_params` of one call: the trainer's sampling, the request's budget, stop tokens
        and seed (where the servers take one), logprobs always, the request's bias and penalties."""
        request = dict(trainer.passed)
        request["max_tokens"] = max_tokens
        request["logprobs"] = self.asked_logprobs
        stops = set(trainer.params.stop_token_ids) | set(params.stop_token_ids) | self._end_of_turn
        request["stop_token_ids"] = sorted(stops)
        if seed is not None and self.takes_seed:
            request["seed"] = seed
        request.update(params.reshaping())  # vLLM's and SGLang's names
        return request

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
            raise InvalidRequest(f"{self.servers} are not asked for constrained output", param="response_format")
        episode = self._episodes.get(session_id or "")
        wanted = self._budget(session_id, len(prompt), params.max_tokens)
        extra = await self._images(prompt, images, session_id) if images else None
        trainer = trainer_sampling(episode.sampling if episode is not None else {})
        mode = vllm_logprob_mode(trainer.params, self.logprobs_mode)
        call_id = self._call_id(session_id)
        sampled: list[int] = []
        for _ in range(MAX_RESUMES):
            request = self.request(trainer, params, max_tokens=wanted - len(sampled), seed=seed)
            answer = await self._sample(call_id, [*prompt, *sampled], request, episode, extra)
            if answer.tokens and (answer.logprobs is None or len(answer.logprobs) != len(answer.tokens)):
                raise EngineProtocolError(f"{self.server} returned no logprob for every sampled token")
            self._count(answer, episode)
            for token, logprob in zip(answer.tokens, answer.logprobs or (), strict=True):
                sampled.append(token)
                yield SampledToken(token, float(logprob), (), mode, answer.version)
            ended = bool(sampled) and sampled[-1] in request["stop_token_ids"]
            if answer.reason not in ABORTED or ended or len(sampled) >= wanted:
                return
            self.resumed += 1  # the trainer paused its servers for a weight sync: go on where it stopped
            if episode is not None:
                episode.resumed += 1
            await asyncio.sleep(self.resume_delay)
        raise EngineFailure(f"{self.server} aborted the request {MAX_RESUMES} times in a row")

    def _count(self, answer: Answer, episode: E | None) -> None:
        self.tokens_generated += len(answer.tokens)
        if answer.straddled:
            self.straddled_calls += 1
        if episode is not None:
            episode.preempted += answer.preempted
            episode.straddled += int(answer.straddled)

    async def _timed(self, call: Callable[[], Awaitable[T]], episode: E | None, what: str) -> T:
        """The trainer's generate call, its seconds counted (and the episode's), its failure an engine error."""
        started = time.perf_counter()
        try:
            with trainer_call(what):
                return await call()
        finally:
            spent = time.perf_counter() - started
            self.times.record(spent)
            if episode is not None:
                episode.seconds += spent

    @abstractmethod
    def _episode(self, sampling: dict[str, Any]) -> E:
        """A new episode of the adapter's own type."""

    def _call_id(self, session_id: str | None) -> str | None:
        """What names every call of one generation to the trainer (its routing key)."""
        return session_id

    @abstractmethod
    def _budget(self, session_id: str | None, prompt_length: int, max_tokens: int | None) -> int:
        """Tokens this generation may sample (`ContextOverflow` where none)."""

    @abstractmethod
    async def _images(self, prompt: Sequence[int], images: Sequence[PromptImage], session_id: str | None) -> Any:
        """A prompt's images as the trainer's servers take them (given to every `_sample`)."""

    @abstractmethod
    async def _sample(
        self, call_id: str | None, prompt: list[int], request: dict[str, Any], episode: E | None, images: Any
    ) -> Answer:
        """One call to the trainer's servers (through `_timed`), its answer read out."""

    def describe(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "model": self._model_id,
            "tokens_generated": self.tokens_generated,
            "resumed": self.resumed,
            "straddled_calls": self.straddled_calls,
            "episodes_open": len(self._episodes),
        }

    async def close(self) -> None:
        return None
