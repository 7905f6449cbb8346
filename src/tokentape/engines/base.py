"""The engine seam: one async method that streams sampled tokens for a token-ID prompt."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from tokentape.core.images import DecodedImage, ImageRun
from tokentape.core.sampling import SamplingParams

__all__ = [
    "Constraint",
    "ConstraintKind",
    "Engine",
    "EnginePool",
    "LogprobMode",
    "PromptImage",
    "SampledToken",
    "came_together",
    "logprob_mode",
    "takes_images",
    "vllm_logprob_mode",
]

# What a recorded logprob is a log-probability under; the trainer's importance ratio is only right
# when it recomputes the same thing.
#   raw                            log_softmax(logits): temperature and truncation ignored (greedy
#                                  requests report this on every engine)
#   temperature_scaled_untruncated log_softmax(logits / temperature), before top-k/top-p/min-p
#   temperature_scaled_truncated   after temperature and (some of) the request's top-k/top-p/min-p
#                                  cut, renormalized over what was kept: 0.0 where one token was left
LogprobMode = Literal["raw", "temperature_scaled_untruncated", "temperature_scaled_truncated"]

ConstraintKind = Literal["json_schema", "regex", "grammar"]


@dataclass(frozen=True, slots=True)
class Constraint:
    """Constrained decoding: only tokens that keep the output inside `value` may be sampled.

    json_schema: a JSON schema, serialized as JSON text; regex: a regular expression the whole output
    matches; grammar: an EBNF grammar (GBNF for llama.cpp, the engine's EBNF dialect for remote
    engines). Logprobs of a constrained turn are those of the masked distribution.
    """

    kind: ConstraintKind
    value: str


@dataclass(frozen=True, slots=True)
class PromptImage:
    """An image of a prompt: its bytes and where its placeholder run sits in the prompt's token IDs."""

    run: ImageRun
    image: DecodedImage


def takes_images(engine: object) -> bool:
    """Whether `engine` takes images with a prompt: an engine that does has `takes_images = True` and
    a `generate` with an `images` keyword (a sequence of `PromptImage`). The Engine protocol leaves
    it out so that text-only engines need not know about images."""
    return bool(getattr(engine, "takes_images", False))


@dataclass(frozen=True, slots=True)
class SampledToken:
    token_id: int
    logprob: float  # what kind of log-probability: `logprob_mode`
    top_logprobs: tuple[tuple[int, float], ...] = ()  # most likely tokens at this position, best first
    logprob_mode: LogprobMode = "temperature_scaled_untruncated"  # one value for the whole generation
    # the weights version that sampled it, where the engine knows it (weights the trainer updates
    # behind the gateway's back, as verl's servers); None: the version the gateway dispatched under
    version: int | None = None
    # another token of this generation came with it (one engine event, or events read together): a
    # stream passes their text on in one delta. A hint for the stream alone, never recorded or compared.
    follows: bool = field(default=False, compare=False)


def came_together(tokens: list[SampledToken], more: bool) -> list[SampledToken]:
    """The tokens of one streamed event, each but the last marked as followed by another; the last
    too when `more` (another event was read with this one). An answer in one piece needs no marks."""
    last = len(tokens) - 1
    if last < 0 or (last == 0 and not more):
        return tokens
    return [
        SampledToken(t.token_id, t.logprob, t.top_logprobs, t.logprob_mode, t.version, True) if i < last or more else t
        for i, t in enumerate(tokens)
    ]


def logprob_mode(params: SamplingParams, *, scaled: bool, truncated_by: Sequence[str] = ()) -> LogprobMode:
    """The mode of the logprobs an engine reports for `params`, given whether it applies the temperature
    before reporting (`scaled`) and which of "top_k", "top_p", "min_p" it applies before reporting."""
    if params.temperature == 0.0:
        return "raw"
    if not scaled:  # raw values ignore truncation too: at temperature 1 they are the untruncated ones
        return "temperature_scaled_untruncated" if params.temperature == 1.0 else "raw"
    cut = {"top_k": params.top_k > 0, "top_p": params.top_p < 1.0, "min_p": params.min_p > 0.0}
    if any(cut[name] for name in truncated_by):
        return "temperature_scaled_truncated"
    return "temperature_scaled_untruncated"


def vllm_logprob_mode(params: SamplingParams, setting: str) -> LogprobMode:
    """The mode of the logprobs vLLM reports under its `logprobs_mode` `setting`: the processed ones
    ("processed_logprobs", "processed_logits") after the temperature and its three truncations, the
    raw ones before all of them."""
    if setting.startswith("processed"):
        return logprob_mode(params, scaled=True, truncated_by=("top_k", "top_p", "min_p"))
    return logprob_mode(params, scaled=False)


class Engine(Protocol):
    """Generates one choice at a time. Closing the iterator early aborts the generation."""

    @property
    def model_id(self) -> str: ...

    @property
    def context_length(self) -> int: ...

    def generate(
        self,
        prompt: Sequence[int],
        params: SamplingParams,
        *,
        seed: int | None,
        session_id: str | None = None,
        constraint: Constraint | None = None,
        whole: bool = False,
    ) -> AsyncGenerator[SampledToken, None]:
        """Stream sampled tokens. Stops after an end-of-turn token or one of `params.stop_token_ids`
        (included in the stream), after `params.max_tokens`, or at the end of the context. An engine
        that cannot honour `constraint` raises InvalidRequest before it generates anything.

        `whole`: the caller reads the tokens only once the generation is over, so an engine may fetch
        them in one answer instead of a stream (a remote engine: one response instead of an event per
        token). Closing the iterator still stops the generation. Engines that gain nothing ignore it."""
        ...

    def describe(self) -> dict[str, Any]:
        """The engine's own account of itself for status pages: at least `kind` and `tokens_generated`."""
        ...

    async def close(self) -> None: ...


@runtime_checkable
class EnginePool(Protocol):
    """An engine over members that come and go while it serves (the router over remote engines): what
    the gateway asks of it beyond the `Engine` protocol, to start it and to manage its members."""

    async def start(self) -> None:
        """Learn each member's model and context length, then check their health in the background."""
        ...

    def describe(self) -> dict[str, Any]:
        """As `Engine.describe`, with `engines`: each member described."""
        ...

    async def add_member(self, spec: str, admit: Callable[[], None]) -> None:
        """Add the engine `spec` names (`KIND=URL[,OPTION]`) once it answers its health check; `admit()`
        is called right before it is routed to, and what it raises refuses the engine."""
        ...

    def drain_member(self, url: str) -> Coroutine[Any, Any, None]:
        """Place no new work on the member at `url` from now on (NotFound if there is none); the
        coroutine returned forgets it once its requests finish."""
        ...
