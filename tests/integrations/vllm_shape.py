"""Test instruments shaped like what OpenRLHF hands an agent executor: vLLM's `SamplingParams`, and
`llm_engine.generate(prompt_token_ids, sampling_params)` returning a vLLM `RequestOutput` (vLLM
itself needs a GPU build). The embedded llama.cpp engine does the sampling; every call is recorded
so a second executor can be given exactly the same model outputs (`ReplayLLM`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokentape.core.sampling import SamplingParams as TapeSampling
from tokentape.engines.base import Constraint
from tokentape.engines.llamacpp import LlamaCppEngine
from tokentape.render.tokenizer import Tokenizer


@dataclass
class SamplingParams:
    """The fields of vLLM's SamplingParams that OpenRLHF's executors and tokentape's adapter use."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    logprobs: int | None = None
    skip_special_tokens: bool = True


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True


@dataclass
class Call:
    prompt: list[int]
    output: CompletionOutput
    params: SamplingParams | None = None


@dataclass
class EmbeddedLLM:
    """`llm_engine` as OpenRLHF's rollout actor exposes it, sampling with the embedded engine.
    `first_reply`: the first call of each episode (a prompt that continues no earlier call) gets
    these token IDs instead, with logprob -0.5 each: a scripted turn, to make a tool call certain.
    `grammar`: every sampled turn is held to this llama.cpp grammar, and once it is complete only
    `close` may follow (every other end-of-turn token banned): the turn certainly ends on its close
    within the grammar's length, whatever the model would have sampled."""

    engine: LlamaCppEngine
    tokenizer: Tokenizer
    first_reply: list[int] | None = None
    grammar: str | None = None
    close: int | None = None
    calls: list[Call] = field(default_factory=list)

    def _opens_episode(self, prompt: list[int]) -> bool:
        return not any(
            prompt[: len(c.prompt) + len(c.output.token_ids)] == c.prompt + c.output.token_ids for c in self.calls
        )

    async def generate(
        self, prompt_token_ids: list[int], sampling_params: SamplingParams, multi_modal_data: Any = None
    ) -> RequestOutput:
        sp = sampling_params
        stops = set(sp.stop_token_ids or ()) | set(self.tokenizer.end_of_turn_ids)
        tokens: list[int] = []
        ranked: list[dict[int, Logprob]] = []
        if self.first_reply is not None and self._opens_episode(list(prompt_token_ids)):
            tokens = list(self.first_reply)
            ranked = [{t: Logprob(-0.5, 1)} for t in tokens]
        else:
            params = TapeSampling(
                max_tokens=sp.max_tokens,
                temperature=sp.temperature,
                top_p=sp.top_p,
                top_k=max(sp.top_k, 0),
                min_p=sp.min_p,
                seed=sp.seed,
                stop_token_ids=tuple(sp.stop_token_ids or ()),
                logprobs=True,
                top_logprobs=min(sp.logprobs or 0, 20),
                banned_token_ids=tuple(sorted(self.tokenizer.end_of_turn_ids - {self.close})) if self.close else (),
            )
            constraint = Constraint("grammar", self.grammar) if self.grammar is not None else None
            generation = self.engine.generate(list(prompt_token_ids), params, seed=sp.seed, constraint=constraint)
            async for sample in generation:
                tokens.append(sample.token_id)
                ranked.append(
                    {
                        sample.token_id: Logprob(sample.logprob, 1),
                        **{t: Logprob(lp) for t, lp in sample.top_logprobs if t != sample.token_id},
                    }
                )
        finish = "stop" if tokens and tokens[-1] in stops else "length"
        output = CompletionOutput(0, self.tokenizer.decode(tokens), tokens, None, ranked, finish)
        self.calls.append(Call(list(prompt_token_ids), output, sampling_params))
        return RequestOutput(f"req-{len(self.calls)}", list(prompt_token_ids), [output])


@dataclass
class ReplayLLM:
    """Answers each prompt with what `EmbeddedLLM` answered for the same prompt tokens; a prompt it
    never saw fails the test (the two executors then built different prompts)."""

    calls: list[Call]

    async def generate(
        self, prompt_token_ids: list[int], sampling_params: SamplingParams, multi_modal_data: Any = None
    ) -> RequestOutput:
        for call in self.calls:
            if call.prompt == list(prompt_token_ids):
                return RequestOutput("replay", call.prompt, [call.output])
        raise AssertionError(f"no recorded call for this prompt of {len(prompt_token_ids)} tokens")


class NoTorchTokenizer:
    """A transformers tokenizer that answers `return_tensors="pt"` with numpy arrays (torch is not
    installed here); OpenRLHF's executors only call `.tolist()` on the result."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("return_tensors") == "pt":
            kwargs["return_tensors"] = "np"
        return self._tokenizer(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)
