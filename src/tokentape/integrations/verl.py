"""verl's agent loop on tokentape: any agent trains through verl, every token from verl's servers.

    # agent_loop.yaml (the file `tokentape verl-config` prints, with your agent)
    - name: tokentape_agent
      _target_: tokentape.integrations.verl.TokentapeAgentLoop
      agent: my_pkg.agents:solve

    actor_rollout_ref.rollout.agent.agent_loop_config_path=agent_loop.yaml
    actor_rollout_ref.rollout.agent.default_agent_loop=tokentape_agent

`async def solve(client: openai.AsyncOpenAI, prompt) -> float | None` is an ordinary agent (the
`tokentape rollout` / TRL contract): `prompt` is the row's `raw_prompt` (chat messages), the return
value its reward (None: verl's reward manager scores the sample). An agent that takes a third
parameter gets the whole dataset row (`reward_model`, `extra_info`, ...) there.

Each verl worker process holds one gateway, started by its first episode, in process (no port): the
agent's client calls its ASGI app directly, the gateway renders with the policy's tokenizer and
samples through the worker's `server_manager` (`tokentape.integrations.verl_engine.VerlEngine`: the
session id is verl's `request_id`, sampling is verl's, each token's version is its server's
`global_steps`).
One episode is one session, named `verl-<pid>-<uuid>` so that two workers never collide.

`run` returns the branch that holds the agent's last turn as one `AgentLoopOutput`:
- `prompt_ids`: the branch up to its first sampled token (at most `prompt_length` tokens: a longer
  prompt's tail goes to the response under mask 0, so nothing verl trains on is re-tokenized),
- `response_ids`, `response_mask` (the tape's loss mask: 1 on sampled tokens; tool results, user
  turns and turn closes 0), `response_logprobs` (the servers', 0.0 off the mask; given when verl
  asks for logprobs, `rollout.calculate_log_probs`, as verl's own loops do), all cut to
  `response_length` as verl's loops cut them,
- `reward_score`: the agent's reward,
- `num_turns`: 2 per assistant turn (verl's tool loop counts the prompt, the assistant turns and the
  observations between them),
- `extra_fields`: `min_global_steps`/`max_global_steps` over the sampled tokens kept (what verl's
  staleness reads), `loss_weight` (the output's share of its episode's one vote: 1 / the episode's
  outputs, so an episode that splits into several counts once), `tokentape_versions` (per response
  token: the version that sampled it, -1 off the mask), `tokentape_session_id`, `tokentape_status`,
  `tokentape_truncated`, `turn_scores` and `tool_rewards` (empty: the keys verl's own loops always
  set).

With `all_branches: true` (for verl's TransferQueue trainer, whose `run` may return a list) every
branch of the session is its own output (a compacted history, a sub-agent, n>1 siblings), ordered by
their last turn, the one holding the agent's last turn last (verl scores that one and copies its
reward to the others).

An episode never raises out of `run`; it ends with `tokentape_status`:
- `done`;
- `context_full`: a request no longer fit (the episode's `response_length` is used up, or the prompt
  passed the servers' `prompt_length + response_length`). The branch so far, truncated, rewarded
  `overflow_reward`;
- `truncated`: the agent returned, but the cut at `response_length` dropped some of what it sampled
  on its last turn (a compacted history whose prompt is shorter than the episode's first: the room
  each call gets is counted from the first prompt, the output from the branch's own). The sample is
  what verl's own loops keep of a response that ran past `response_length`: trained, its reward
  `overflow_reward` (None stays None: verl's reward manager scores the cut text, as for its loops);
- `error` (the agent raised; the error in `tokentape_error`), `refused` (the gateway refused a
  request: its code in `tokentape_error`) and `engine_error` (`server_manager.generate` itself
  failed, a dead server or actor): the branch so far with `response_mask` all 0 (logprobs 0.0,
  versions -1, no `min/max_global_steps`), rewarded `error_reward`, so it adds nothing to the loss
  (`tokentape.integrations.inprocess`).
When no turn was recorded the sample is the prompt as the gateway renders it (left-truncated to
`prompt_length`, as verl caps prompts) and a one-token response (the end-of-sequence token) under
mask 0, which verl pads like any other and trains nothing on.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import inspect
import io
import os
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopMetrics, AgentLoopOutput

from tokentape.client import InProcessGateway
from tokentape.errors import TokentapeError
from tokentape.gateway.sessions import check_policy
from tokentape.integrations.inprocess import TRAINED, in_process_gateway, plain, run_episode
from tokentape.integrations.trainer_engine import asks_logprobs
from tokentape.integrations.verl_engine import VerlEngine
from tokentape.rollout import last_branch, load_agent, rendered_prompt
from tokentape.runtime import hf_renderer

__all__ = ["CONFIG_PATH", "TokentapeAgentLoop", "VerlSample", "verl_sample", "worker_gateway"]

CONFIG_PATH = Path(__file__).with_name("verl_agent_loop.yaml")  # registers `tokentape_agent`
Agent = Callable[..., Awaitable[float | None]]  # (client, prompt) or (client, prompt, row)


@dataclass(frozen=True, slots=True)
class VerlSample:
    """One branch cut verl's way (see the module's docstring)."""

    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    response_logprobs: list[float]
    versions: list[int]  # per response token; -1 where nothing was sampled
    truncated: bool  # cut at response_length
    images: list[str] = field(default_factory=list)  # data: URLs, one per placeholder run kept, in order

    @property
    def global_steps(self) -> tuple[int | None, int | None]:
        sampled = [v for v, m in zip(self.versions, self.response_mask, strict=True) if m and v >= 0]
        return (min(sampled), max(sampled)) if sampled else (None, None)


def verl_sample(branch: Mapping[str, Any], *, prompt_length: int, response_length: int) -> VerlSample:
    """A tokentape branch as verl's prompt and response: split at the first sampled token (at most
    `prompt_length` into the branch), the response cut to `response_length`, and before an image's
    placeholder run that cut would split (verl re-expands every run from its image)."""
    tokens, mask = list(branch["tokens"]), [int(bool(m)) for m in branch["loss_mask"]]
    first = mask.index(1) if 1 in mask else len(tokens)
    split = min(first, prompt_length)
    logprobs = [0.0 if lp is None or not m else float(lp) for lp, m in zip(branch["logprobs"], mask, strict=True)]
    versions = [int(v) if m else -1 for v, m in zip(branch["versions"], mask, strict=True)]
    end = split + response_length
    runs = list(zip(branch.get("image_runs") or (), branch.get("images") or (), strict=True))
    end = min([end, *(run["start"] for run, _ in runs if run["start"] < end < run["end"])])
    return VerlSample(
        prompt_ids=tokens[:split],
        response_ids=tokens[split:end],
        response_mask=mask[split:end],
        response_logprobs=logprobs[split:end],
        versions=versions[split:end],
        truncated=len(tokens) > end,
        images=[url for run, url in runs if run["end"] <= end],
    )


@dataclass(slots=True)
class WorkerGateway:
    """The gateway of one verl worker process and the engine behind it."""

    client: InProcessGateway
    engine: VerlEngine
    keeps_sessions: bool  # a store file: sessions stay there after their episode


_GATEWAYS: dict[tuple[int, str, int, int, str, str], asyncio.Task[WorkerGateway]] = {}


async def worker_gateway(
    server_manager: Any,
    tokenizer_dir: Path,
    *,
    prompt_length: int,
    response_length: int,
    logprobs_mode: str = "processed_logprobs",
    rollout_name: str = "vllm",
    rewrite_policy: str = "tape",
    store: str = ":memory:",
) -> WorkerGateway:
    """This process's gateway for `server_manager`, built once (concurrent first episodes share it)."""
    key = (id(server_manager), str(tokenizer_dir), prompt_length, response_length, rewrite_policy, store)
    task = _GATEWAYS.get(key)
    if task is None:
        check_policy(rewrite_policy)  # an unknown policy fails here, before anything is built

        async def build() -> WorkerGateway:
            renderer = await asyncio.to_thread(hf_renderer, tokenizer_dir)
            engine = VerlEngine(
                server_manager,
                model_id=tokenizer_dir.name,
                prompt_length=prompt_length,
                response_length=response_length,
                end_of_turn_ids=renderer.tokenizer.end_of_turn_ids,
                logprobs_mode=logprobs_mode,
                takes_seed=rollout_name == "vllm",
            )
            client = in_process_gateway(engine, renderer, rewrite_policy=rewrite_policy, store=store)
            return WorkerGateway(client, engine, store != ":memory:")

        task = _GATEWAYS[key] = asyncio.ensure_future(build())
    try:
        return await asyncio.shield(task)
    except Exception:
        _GATEWAYS.pop(key, None)  # a failed build is not kept: the next episode tries again
        raise


class TokentapeAgentLoop(AgentLoopBase):
    """verl's `AgentLoopBase` running a tokentape agent; YAML keys beyond `agent` are optional:
    `tokenizer_dir` (default: the tokenizer's own directory), `rewrite_policy` (tape, fork, strict),
    `overflow_reward`, `error_reward` (0.0), `all_branches` (false), `fail_on_engine_error` (false: an
    `engine_error` episode is an untrained sample; true: it fails verl's step), `store` (a SQLite path
    to keep every tape; default in memory, each session dropped once its episode is exported)."""

    def __init__(
        self,
        trainer_config: Any,
        server_manager: Any,
        tokenizer: Any,
        processor: Any,
        dataset_cls: Any,
        data_config: Any,
        *,
        agent: str | Agent,
        tokenizer_dir: str | None = None,
        rewrite_policy: str = "tape",
        overflow_reward: float = 0.0,
        error_reward: float = 0.0,
        all_branches: bool = False,
        store: str = ":memory:",
        fail_on_engine_error: bool = False,
        **kwargs: Any,
    ) -> None:
        kwargs.pop("tools", None)  # verl's tool list: the agent brings its own tools
        super().__init__(trainer_config, server_manager, tokenizer, processor, dataset_cls, data_config, **kwargs)
        self.agent = load_agent(agent) if isinstance(agent, str) else agent
        self._takes_row = len(inspect.signature(self.agent).parameters) >= 3
        self.tokenizer_dir = Path(str(tokenizer_dir or getattr(tokenizer, "name_or_path", "")))
        self.rewrite_policy = rewrite_policy
        self.overflow_reward, self.error_reward = float(overflow_reward), float(error_reward)
        self.all_branches = bool(all_branches)
        self.fail_on_engine_error = bool(fail_on_engine_error)
        self.store = store
        self.prompt_length = int(self.rollout_config.prompt_length)
        self.response_length = int(self.rollout_config.response_length)
        self.worker: WorkerGateway | None = None  # the gateway the latest episode ran on

    # a list where `all_branches` is set: verl's TransferQueue worker takes one (its base class says one output)
    async def run(  # type: ignore[override]
        self, sampling_params: dict[str, Any], **row: Any
    ) -> AgentLoopOutput | list[AgentLoopOutput]:
        worker = self.worker = await worker_gateway(
            self.server_manager,
            self.tokenizer_dir,
            prompt_length=self.prompt_length,
            response_length=self.response_length,
            logprobs_mode=str(self.rollout_config.get("logprobs_mode", "processed_logprobs")),
            rollout_name=str(self.rollout_config.get("name", "vllm")),
            rewrite_policy=self.rewrite_policy,
            store=self.store,
        )
        gateway, engine = worker.client, worker.engine
        prompt = plain(row["raw_prompt"])
        session_id = f"verl-{os.getpid()}-{uuid.uuid4().hex}"
        group = str(plain(row["uid"])) if "uid" in row else "prompt-" + _digest(prompt)
        started = time.perf_counter()
        engine.open_episode(session_id, sampling_params)
        try:
            extra = (plain(dict(row)),) if self._takes_row else ()
            episode = await run_episode(
                gateway,
                session_id,
                self.agent,
                (prompt, *extra),
                group=group,
                overflow_reward=self.overflow_reward,
                error_reward=self.error_reward,
            )
        finally:
            preempted = engine.episode_preempted(session_id)
            spent = engine.close_episode(session_id)
        status, error, reward, export = episode.status, episode.error, episode.reward, episode.export
        metrics = AgentLoopMetrics(  # this episode's own, as verl's loops report theirs per sample
            generate_sequences=spent, tool_calls=time.perf_counter() - started - spent, num_preempted=preempted
        )
        logprobs = asks_logprobs(sampling_params.get("logprobs"))
        branches = sorted(export.get("branches", ()), key=lambda b: max(b["turn_ids"]))
        if not self.all_branches and branches:
            branches = [last_branch(export)]
        if status == "done" and branches and self._cuts_last_turn(branches[-1]):
            status = "truncated"  # the reward's turn is cut off: not the sample's reward
            reward = None if reward is None else self.overflow_reward
        ending = {"tokentape_session_id": session_id, "tokentape_status": status, "tokentape_error": error}
        # one vote per episode: its outputs' loss weights add up to 1 (verl applies them where its loss reads them)
        outputs = [self._output(b, reward, ending, metrics, logprobs, 1.0 / len(branches)) for b in branches]
        if not outputs:
            outputs = [await self._untrained(gateway, prompt, reward, ending, metrics, logprobs)]
        if not worker.keeps_sessions:
            with contextlib.suppress(TokentapeError):
                await gateway.gateway.sessions.delete(session_id)
        if status == "engine_error" and self.fail_on_engine_error:  # as verl's own loops fail the step
            raise RuntimeError(f"verl's server_manager.generate failed under episode {session_id}: {error}")
        return outputs if self.all_branches else outputs[-1]

    def _cuts_last_turn(self, branch: Mapping[str, Any]) -> bool:
        """Whether the cut at `response_length` drops a token sampled on the branch's last turn."""
        ranges = branch.get("action_ranges") or ()
        if not ranges:
            return False
        sample = verl_sample(branch, prompt_length=self.prompt_length, response_length=self.response_length)
        return int(ranges[-1][1]) > len(sample.prompt_ids) + len(sample.response_ids)

    def _output(
        self,
        branch: Mapping[str, Any],
        reward: float | None,
        ending: dict[str, Any],
        metrics: AgentLoopMetrics,
        logprobs: bool,
        loss_weight: float = 1.0,
    ) -> AgentLoopOutput:
        sample = verl_sample(branch, prompt_length=self.prompt_length, response_length=self.response_length)
        if ending["tokentape_status"] not in TRAINED:  # off the loss: no logprob, no version (staleness skips it)
            n = len(sample.response_ids)
            sample = replace(sample, response_mask=[0] * n, response_logprobs=[0.0] * n, versions=[-1] * n)
        low, high = sample.global_steps
        # as verl's multimodal loops: the images of every run, in order; its worker re-runs the processor
        pictures = [_pil(url) for url in sample.images]
        images: dict[str, Any] = {"multi_modal_data": {"images": pictures}} if pictures else {}
        return AgentLoopOutput(
            prompt_ids=sample.prompt_ids,
            response_ids=sample.response_ids,
            response_mask=sample.response_mask,
            response_logprobs=sample.response_logprobs if logprobs else None,
            **images,
            reward_score=reward,
            num_turns=2 * len(branch["turn_ids"]),
            metrics=metrics,
            extra_fields={
                "min_global_steps": low,
                "max_global_steps": high,
                "loss_weight": loss_weight,
                "tokentape_versions": sample.versions,
                **ending,
                "tokentape_truncated": sample.truncated
                or ending["tokentape_status"] == "context_full"
                or bool(branch["truncated"]),
                "turn_scores": [],
                "tool_rewards": [],
            },
        )

    async def _untrained(
        self,
        gateway: InProcessGateway,
        prompt: Any,
        reward: float | None,
        ending: dict[str, Any],
        metrics: AgentLoopMetrics,
        logprobs: bool,
    ) -> AgentLoopOutput:
        """No turn was recorded: the prompt and one end-of-sequence token, trained on nowhere."""
        try:
            prompt_ids = (await rendered_prompt(gateway, prompt))[-self.prompt_length :]
        except Exception:  # a prompt the gateway cannot render: an empty one, padded by verl
            prompt_ids = []
        eos = getattr(self.tokenizer, "eos_token_id", None)
        return AgentLoopOutput(
            prompt_ids=prompt_ids,
            response_ids=[0 if eos is None else int(eos)],
            response_mask=[0],
            response_logprobs=[0.0] if logprobs else None,
            reward_score=reward,
            num_turns=0,
            metrics=metrics,
            extra_fields={
                "min_global_steps": None,
                "max_global_steps": None,
                "loss_weight": 1.0,
                "tokentape_versions": [-1],
                **ending,
                "tokentape_truncated": ending["tokentape_status"] == "context_full",
                "turn_scores": [],
                "tool_rewards": [],
            },
        )


def _pil(url: str) -> Any:
    """An exported image (a data: URL) as verl's dataset opens images: PIL, RGB."""
    from PIL import Image

    return Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGB")


def _digest(prompt: Any) -> str:
    return hashlib.blake2b(repr(prompt).encode(), digest_size=8).hexdigest()
