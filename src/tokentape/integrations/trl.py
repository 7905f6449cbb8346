"""TRL's GRPOTrainer on tokentape: agents run through the gateway, the trainer learns from the tape.

    gateway = InProcessGateway(...)                   # or await GatewayClient.connect(url)
    trainer = GRPOTrainer(
        model=model, args=GRPOConfig(...), train_dataset=dataset, peft_config=LoraConfig(...),
        reward_funcs=[tape_reward],                   # the agent's reward (or any reward function)
        rollout_func=rollout_func("my_pkg.agents:solve", gateway),
        callbacks=[PushLora(gateway, "runs/adapters")],
    )

`async def solve(client: openai.AsyncOpenAI, prompt: Any) -> float | None` is an ordinary agent: as
many calls as it likes, its reward returned. Each prompt TRL hands over (already repeated
`num_generations` times) runs as one session; prompts that are equal form a group. What comes back
per prompt is the branch that holds the agent's last turn, cut TRL's way: `prompt_ids` up to the first
sampled token, `completion_ids` from there to the last sampled token, `env_mask` the tape's loss mask
over the completion (0 on tool results, user turns and turn closes between the agent's turns),
`logprobs` the engine's, from the tape (0.0 off the mask), plus `tokentape_reward` and
`tokentape_session_id` for the reward functions.

What TRL does with the engine's logprobs: only with vLLM (`use_vllm=True` and
`vllm_importance_sampling_correction`) does it weigh each token by the truncated ratio of its own
logprob to the sampler's. Without vLLM, as on this CPU, it reads them and leaves them out of the
loss: its importance ratio is against its own recomputation (`old_per_token_logps`, computed only
when generation and optimisation steps are misaligned), so a mismatch between the engine and the
trainer goes uncorrected and unmeasured there. `tokentape train` measures and corrects it.

`PushLora` writes the LoRA as a llama.cpp adapter GGUF after each optimizer step and pushes it with
`POST /admin/weights`: the next rollouts sample the new policy and record its version.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import inspect
import threading
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import openai

from tokentape.client import GatewayClient
from tokentape.rollout import context_overflow

__all__ = ["PushLora", "branch_for_trl", "rollout_func", "tape_reward"]

Agent = Callable[[openai.AsyncOpenAI, Any], Awaitable[float | None]]
T = TypeVar("T")


class _LoopThread:
    """One event loop in a thread for the gateway's async API: TRL calls `rollout_func` synchronously."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="tokentape-trl", daemon=True)
        self.thread.start()

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()


_LOOP: _LoopThread | None = None


def _loop() -> _LoopThread:
    global _LOOP
    if _LOOP is None:
        _LOOP = _LoopThread()
    return _LOOP


def branch_for_trl(branch: dict[str, Any]) -> dict[str, Any]:
    """An exported branch cut TRL's way (see the module's docstring)."""
    mask = [bool(m) for m in branch["loss_mask"]]
    sampled = [i for i, m in enumerate(mask) if m]
    if not sampled:
        raise ValueError("the branch has no sampled token")
    first, last = sampled[0], sampled[-1] + 1
    return {
        "prompt_ids": list(branch["tokens"][:first]),
        "completion_ids": list(branch["tokens"][first:last]),
        "env_mask": [int(m) for m in mask[first:last]],
        "logprobs": [0.0 if lp is None else float(lp) for lp in branch["logprobs"][first:last]],
    }


def _load(agent: Agent | str) -> Agent:
    if not isinstance(agent, str):
        return agent
    module, _, name = agent.partition(":")
    function: Agent = getattr(importlib.import_module(module), name)
    return function


def rollout_func(agent: Agent | str, gateway: GatewayClient) -> Callable[[list[Any], Any], dict[str, list[Any]]]:
    """A `rollout_func` for GRPOTrainer that runs `agent` (a function or "module:function") once per
    prompt, each in its own tokentape session."""
    run = _load(agent)

    async def one(prompt: Any) -> tuple[dict[str, Any], float | None, str]:
        session_id = f"trl-{uuid.uuid4().hex}"
        group = "prompt-" + hashlib.blake2b(repr(prompt).encode(), digest_size=8).hexdigest()
        await gateway.create_session(session_id, group_id=group, metadata={"max_tokens": "clip"})
        status = "done"
        try:
            result = run(gateway.client(session_id), prompt)
            reward = await result if inspect.isawaitable(result) else result
        except Exception as exc:
            if not context_overflow(exc):
                raise
            status, reward = "context_full", 0.0
        await gateway.finish(session_id, metadata={"status": status}, **({} if reward is None else {"reward": reward}))
        export = await gateway.export(session_id)
        branch = max(export["branches"], key=lambda b: max(b["turn_ids"]))  # the one holding the last turn
        return branch_for_trl(branch), reward, session_id

    async def all_of(prompts: list[Any]) -> list[tuple[dict[str, Any], float | None, str]]:
        return list(await asyncio.gather(*(one(p) for p in prompts)))

    def rollout(prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        results = _loop().run(all_of(prompts))
        output: dict[str, list[Any]] = {key: [r[0][key] for r in results] for key in results[0][0]}
        output["tokentape_reward"] = [r[1] for r in results]
        output["tokentape_session_id"] = [r[2] for r in results]
        return output

    return rollout


def tape_reward(completions: list[Any], tokentape_reward: list[float | None], **_: Any) -> list[float | None]:
    """A reward function for GRPOTrainer: the reward the agent returned for each prompt's episode."""
    return list(tokentape_reward)


def _callback_base() -> type:
    from transformers import TrainerCallback

    base: type = TrainerCallback
    return base


class PushLora(_callback_base()):  # type: ignore[misc]
    """After each optimizer step: the LoRA as an adapter GGUF in `directory`, pushed as version
    `global_step` through `POST /admin/weights`."""

    def __init__(self, gateway: GatewayClient, directory: str | Path) -> None:
        self.gateway = gateway
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.pushed: list[int] = []

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        from tokentape.train.loop import push_adapter
        from tokentape.train.weights import write_lora_gguf

        version = int(state.global_step)
        path = write_lora_gguf(model, self.directory / f"lora-v{version}.gguf")
        _loop().run(push_adapter(self.gateway, version, path))
        self.pushed.append(version)
