"""OpenRLHF's agent executor on tokentape. The whole agent file given to `--train.agent_func_path`:

    from tokentape.integrations.openrlhf import agent_executor
    AgentExecutor = agent_executor("my_pkg.agents:solve")

where `async def solve(client: openai.AsyncOpenAI, prompt: str, label: str) -> float` is an ordinary
agent: it calls `client.chat.completions.create(...)` as often as it likes (tool loops, several
turns, n>1) and returns its reward (or a dict with `reward`, `scores`, `extra_logs`). The model is
served under the tokenizer's `name_or_path` (also `client.models.list()`); the samples of one prompt
share a group.

OpenRLHF builds `AgentExecutor()` and calls `execute(prompt, label, sampling_params, max_length,
hf_tokenizer, llm_engine)` once per sample. Each call runs the agent against its own tokentape
session in this process: the gateway renders with the policy's tokenizer directory
(`hf_tokenizer.name_or_path`, or `tokenizer_dir=`) and samples through `llm_engine` (OpenRLHF's vLLM
actor: token IDs in, token IDs and logprobs out). The result is the session's branch that holds the
agent's last turn, in OpenRLHF's dict: `observation_tokens`, `action_ranges`, `rollout_log_probs`
(0.0 off the actions; None unless `sampling_params.logprobs` is set, as OpenRLHF's executors do),
`truncated`, `reward`, `scores`, `extra_logs`. Unlike OpenRLHF's OpenAI-server example, nothing is
re-tokenized from text and nothing asserts that the prompt prefix stayed stable: a history the agent
edits is handled by the session's rewrite policy.

The agent's requests carry their own sampling fields (the OpenAI contract): pass the trainer's
temperature in them. Logprobs are what vLLM returns (its `logprobs_mode`, as for OpenRLHF's own
executors).
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import importlib
import importlib.util
import inspect
import sys
import types
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import openai

from tokentape.client import InProcessGateway
from tokentape.core.sampling import SamplingParams
from tokentape.engines.base import Constraint, SampledToken, vllm_logprob_mode
from tokentape.engines.remote.wire import engine_top_k
from tokentape.errors import EngineFailure, InvalidRequest
from tokentape.gateway.sessions import MemoryLimits, check_policy
from tokentape.integrations.inprocess import in_process_gateway
from tokentape.integrations.trainer_engine import asks_logprobs
from tokentape.rollout import context_overflow, rendered_prompt
from tokentape.runtime import hf_renderer

__all__ = ["Agent", "VLLMEngine", "agent_executor", "executor_base"]

Agent = Callable[[openai.AsyncOpenAI, Any, Any], Awaitable[Any]]


def executor_base() -> type:
    """OpenRLHF's `AgentExecutorBase`. Where `openrlhf.utils` cannot be imported (its `__init__`
    imports torch and deepspeed, absent on a CPU-only machine), only `openrlhf/utils/agent.py` is
    loaded, under a bare `openrlhf.utils` package that runs no `__init__`."""
    try:
        from openrlhf.utils.agent import AgentExecutorBase
    except ImportError:
        spec = importlib.util.find_spec("openrlhf")
        if spec is None or not spec.submodule_search_locations:
            raise ImportError("OpenRLHF is not installed (pip install openrlhf)") from None
        if not isinstance(sys.modules.get("openrlhf.utils"), types.ModuleType) or not hasattr(
            sys.modules["openrlhf.utils"], "__path__"
        ):
            package = types.ModuleType("openrlhf.utils")
            package.__path__ = [str(Path(next(iter(spec.submodule_search_locations))) / "utils")]
            sys.modules["openrlhf.utils"] = package
        AgentExecutorBase = importlib.import_module("openrlhf.utils.agent").AgentExecutorBase
    base: type = AgentExecutorBase
    return base


class VLLMEngine:
    """OpenRLHF's `llm_engine` (vLLM behind `generate(prompt_token_ids, sampling_params)`) as a
    tokentape engine. vLLM answers with the whole turn at once; cancelling a request cancels the
    engine call, which vLLM aborts."""

    def __init__(
        self,
        llm_engine: Any,
        sampling_params: Any,
        *,
        context_length: int,
        model_id: str,
        end_of_turn_ids: frozenset[int],
    ) -> None:
        self.llm_engine = llm_engine
        self.template = sampling_params  # the trainer's vLLM SamplingParams; each call gets a copy
        self._context_length = context_length
        self._model_id = model_id
        self._end_of_turn = end_of_turn_ids
        self.tokens_generated = 0

    @property
    def model_id(self) -> str:
        return self._model_id

    @property
    def context_length(self) -> int:
        return self._context_length

    def vllm_params(self, prompt_length: int, params: SamplingParams, seed: int | None) -> Any:
        """The trainer's SamplingParams with this request's fields (one choice, token-level stops)."""
        vllm = copy.deepcopy(self.template)
        room = self._context_length - prompt_length
        vllm.n = 1
        vllm.temperature = params.temperature
        vllm.top_p = params.top_p
        vllm.top_k = engine_top_k(params.top_k)  # -1 for no cut, what every vLLM takes as off
        vllm.min_p = params.min_p
        vllm.seed = seed
        vllm.max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        vllm.stop = None  # stop strings are the gateway's: it cuts text, never tokens
        vllm.stop_token_ids = sorted(set(params.stop_token_ids) | self._end_of_turn)
        vllm.logprobs = params.top_logprobs  # vLLM always adds the sampled token's own logprob
        for name, value in params.reshaping().items():  # the request's bias and penalties
            setattr(vllm, name, {int(t): b for t, b in value.items()} if name == "logit_bias" else value)
        return vllm

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
        if constraint is not None:
            raise InvalidRequest("the trainer's engine is not asked for constrained output", param="response_format")
        vllm = self.vllm_params(len(prompt), params, seed)
        # vLLM reports raw logprobs unless the trainer started it with logprobs_mode=processed_logprobs
        mode = vllm_logprob_mode(params, str(getattr(self.llm_engine, "logprobs_mode", "") or ""))
        output = await self.llm_engine.generate(list(prompt), vllm)
        completion = output.outputs[0]
        logprobs = completion.logprobs or []
        self.tokens_generated += len(completion.token_ids)
        for i, token_id in enumerate(completion.token_ids):
            ranked = logprobs[i] if i < len(logprobs) else {}
            own = ranked.get(token_id)
            if own is None:
                raise EngineFailure("the engine returned no logprob for a sampled token (set sampling logprobs)")
            top = sorted(((t, float(lp.logprob)) for t, lp in ranked.items()), key=lambda item: -item[1])
            yield SampledToken(int(token_id), float(own.logprob), tuple(top[: params.top_logprobs]), mode)

    def describe(self) -> dict[str, Any]:
        return {"kind": "openrlhf-vllm", "model": self._model_id, "tokens_generated": self.tokens_generated}

    async def close(self) -> None:
        return None


def _load_agent(agent: Agent | str) -> Agent:
    if not isinstance(agent, str):
        return agent
    module_name, _, name = agent.partition(":")
    if not name:
        raise ValueError(f"name the agent as 'module:function', not {agent!r}")
    function: Agent = getattr(importlib.import_module(module_name), name)
    return function


def agent_executor(
    agent: Agent | str,
    *,
    tokenizer_dir: str | Path | None = None,
    rewrite_policy: str = "tape",
    overflow_reward: float = 0.0,
) -> type:
    """An `AgentExecutor` class for OpenRLHF that runs `agent` (a function or "module:function").

    Each call's `max_length` is the context its episode runs in. As OpenRLHF's own executors do, a
    request whose `max_tokens` passes the room left gets that room (finish `length`), and an episode
    whose next request no longer fits ends there: `execute` returns it marked `truncated`, rewarded
    `overflow_reward`, with `extra_logs["tokentape_context_full"] == 1.0` and the session's metadata
    `status: context_full`. When even the first request does not fit, the sample is the prompt alone
    (as the gateway renders it, kept to `max_length - 1` tokens from the end, as OpenRLHF's own
    executors cut an initial observation), with no action range, so nothing of it is trained on;
    `extra_logs["tokentape_turns"] == 0`. Any other exception the agent raises propagates out of
    `execute`, as an exception in OpenRLHF's own executors' steps does.
    """
    base = executor_base()
    policy = check_policy(rewrite_policy)

    class AgentExecutor(base):  # type: ignore[misc, valid-type]
        """Runs one agent episode per `execute` in a tokentape session; returns OpenRLHF's dict."""

        def __init__(self) -> None:
            self.agent = _load_agent(agent)
            self.gateways: dict[int, InProcessGateway] = {}  # one per max_length: its engine's context
            self.gateway: InProcessGateway | None = None  # the one the latest call ran on
            self._renderer: Any = None
            self._lock = asyncio.Lock()

        async def _gateway_for(
            self, llm_engine: Any, sampling_params: Any, max_length: int, hf_tokenizer: Any
        ) -> InProcessGateway:
            async with self._lock:
                if self._renderer is None:
                    directory = Path(tokenizer_dir or hf_tokenizer.name_or_path)
                    self._renderer = await asyncio.to_thread(hf_renderer, directory)
                gateway = self.gateways.get(max_length)
                if gateway is None:
                    engine = VLLMEngine(
                        llm_engine,
                        sampling_params,
                        context_length=max_length,
                        # the name OpenRLHF's own OpenAI-server example serves under
                        model_id=str(getattr(hf_tokenizer, "name_or_path", "") or Path(tokenizer_dir or "").name),
                        end_of_turn_ids=self._renderer.tokenizer.end_of_turn_ids,
                    )
                    # OpenRLHF's executors clip max_tokens to the room left, as in_process_gateway does;
                    # sessions stay in memory for the default hour, at most 64 requests at once
                    gateway = self.gateways[max_length] = in_process_gateway(
                        engine, self._renderer, rewrite_policy=policy, memory=MemoryLimits(), max_active=64
                    )
                current = gateway.gateway.engine
                assert isinstance(current, VLLMEngine)
                current.llm_engine, current.template = llm_engine, sampling_params
                self.gateway = gateway
                return gateway

        @property
        def engine(self) -> VLLMEngine | None:
            engine = self.gateway.gateway.engine if self.gateway is not None else None
            return engine if isinstance(engine, VLLMEngine) else None

        async def execute(
            self,
            prompt: Any,
            label: Any,
            sampling_params: Any,
            max_length: int,
            hf_tokenizer: Any,
            llm_engine: Any,
            images: Any = None,
        ) -> dict[str, Any]:
            if images:
                raise NotImplementedError("tokentape's OpenRLHF executor takes text prompts only")
            gateway = await self._gateway_for(llm_engine, sampling_params, max_length, hf_tokenizer)
            session_id = f"openrlhf-{uuid.uuid4().hex}"
            group = "prompt-" + hashlib.blake2b(str(prompt).encode(), digest_size=8).hexdigest()
            await gateway.create_session(session_id, group_id=group)
            status = "done"
            try:
                result = self.agent(gateway.client(session_id), prompt, label)
                outcome = await result if inspect.isawaitable(result) else result
            except Exception as exc:
                if not context_overflow(exc):
                    raise
                status, outcome = "context_full", {"reward": overflow_reward}
            reward, scores, extra_logs = _outcome(outcome)
            rewards: dict[str, Any] = {} if reward is None else {"reward": reward}
            await gateway.finish(session_id, metadata={"status": status}, **rewards)
            export = await gateway.export(session_id)
            branches = export["branches"]
            if not branches:  # the first request did not fit: the prompt alone, nothing to train on
                branch = await _prompt_only(gateway, prompt, max_length)
            else:
                branch = max(branches, key=lambda b: max(b["turn_ids"]))  # the one holding the last turn
            logprobs = None
            if asks_logprobs(getattr(sampling_params, "logprobs", None)):  # vLLM's count, 0 included
                logprobs = [0.0 if lp is None else lp for lp in branch["logprobs"]]
            return {
                "prompt": prompt,
                "label": label,
                "images": None,
                "mm_train_inputs": None,
                "reward": reward,
                "scores": scores,
                "observation_tokens": list(branch["tokens"]),
                "action_ranges": [tuple(r) for r in branch["action_ranges"]],
                "rollout_log_probs": logprobs,
                "truncated": status == "context_full" or branch["finish_reasons"][-1] == "length",
                "extra_logs": {
                    **extra_logs,
                    "tokentape_turns": len(branch["turn_ids"]),
                    "tokentape_branches": len(branches),
                    # numbers only: OpenRLHF turns every extra log into a tensor
                    "tokentape_context_full": float(status == "context_full"),
                },
                "session_id": session_id,
            }

    return AgentExecutor


async def _prompt_only(gateway: InProcessGateway, prompt: Any, max_length: int) -> dict[str, Any]:
    """A branch of the prompt's tokens alone (no action), kept to `max_length - 1` from the end, as
    OpenRLHF's own executors cut an initial observation that leaves no room to generate."""
    tokens = (await rendered_prompt(gateway, prompt))[-max(1, max_length - 1) :]
    return {
        "tokens": tokens,
        "action_ranges": [],
        "logprobs": [None] * len(tokens),
        "turn_ids": [],
        "finish_reasons": ["length"],
    }


def _outcome(outcome: Any) -> tuple[float | None, float | None, dict[str, Any]]:
    """(reward, scores, extra_logs) from what the agent returned: a number, None or a dict."""
    if outcome is None:
        return None, None, {}
    if isinstance(outcome, dict):
        reward = outcome.get("reward")
        reward = None if reward is None else float(reward)
        scores = outcome.get("scores", reward)
        return reward, None if scores is None else float(scores), dict(outcome.get("extra_logs") or {})
    reward = float(outcome)
    return reward, reward, {}
