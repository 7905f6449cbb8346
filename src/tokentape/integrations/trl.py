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
`tokentape_session_id` for the reward functions, and `tokentape_status`.

`tokentape_status` is `done`, or `context_full` when the episode's next request no longer fit the
context: the episode ends there, rewarded 0.0, and its row is the branch so far. When even its first
request did not fit there is no branch: the row is the prompt as the gateway renders it
(`POST /tokenize`) and a one-token completion (the trainer's end-of-sequence token) under `env_mask`
0, which GRPOTrainer takes as a completion without model tokens: it counts 0 towards completion
lengths and the loss (whose normalisers are clamped at 1), and it is not seen as truncated. TRL's
own generation does the same with an over-long prompt: no prompt length cap, the prompt goes in
whole. Any other exception the agent raises propagates out of the rollout, as an exception in TRL's
own generation does.

What TRL does with the engine's logprobs: only with vLLM (`use_vllm=True` and
`vllm_importance_sampling_correction`) does it weigh each token by the truncated ratio of its own
logprob to the sampler's. Without vLLM, as on this CPU, it reads them and leaves them out of the
loss: its importance ratio is against its own recomputation (`old_per_token_logps`, computed only
when generation and optimisation steps are misaligned), so a mismatch between the engine and the
trainer goes uncorrected and unmeasured there. `tokentape train` measures and corrects it.

`PushLora` writes the LoRA as a llama.cpp adapter GGUF after each optimizer step and pushes it with
`POST /admin/weights`: the next rollouts sample the new policy and record its version. A push that
fails is a warning, not the end of the step (see `PushLora`).
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import inspect
import logging
import threading
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import httpx2
import openai

from tokentape.client import GatewayClient
from tokentape.rollout import context_overflow, rendered_prompt

__all__ = ["PushLora", "branch_for_trl", "rollout_func", "tape_reward"]

Agent = Callable[[openai.AsyncOpenAI, Any], Awaitable[float | None]]
T = TypeVar("T")
log = logging.getLogger(__name__)


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
        # a vision model's images, as TRL's dataset column names them (one per placeholder run)
        **({"images": list(branch["images"])} if branch.get("images") else {}),
    }


def _end_token(trainer: Any) -> int:
    """The trainer's end-of-sequence token (0 without one): the filler of a completion that trains nothing."""
    ids = getattr(trainer, "eos_token_ids", None) or [
        getattr(getattr(trainer, "processing_class", None), "eos_token_id", None)
    ]
    return int(ids[0]) if ids and ids[0] is not None else 0


def _untrained_completion(filler: int) -> dict[str, list[Any]]:
    """A one-token completion under `env_mask` 0: GRPOTrainer reads `completion_ids[-1]` (to tell a
    truncated completion), so an empty one would fail; an end-of-sequence token masked out of the
    loss counts as no model token and adds nothing to the loss."""
    return {"completion_ids": [filler], "env_mask": [0], "logprobs": [0.0]}


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

    async def one(prompt: Any, filler: int) -> tuple[dict[str, Any], float | None, str, str]:
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
        if not export["branches"]:  # the first request did not fit: the prompt, and nothing to train on
            row = {"prompt_ids": await rendered_prompt(gateway, prompt), **_untrained_completion(filler)}
            return row, reward, session_id, status
        branch = max(export["branches"], key=lambda b: max(b["turn_ids"]))  # the one holding the last turn
        return branch_for_trl(branch), reward, session_id, status

    async def all_of(prompts: list[Any], filler: int) -> list[tuple[dict[str, Any], float | None, str, str]]:
        return list(await asyncio.gather(*(one(p, filler) for p in prompts)))

    def rollout(prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        results = _loop().run(all_of(prompts, _end_token(trainer)))
        output: dict[str, list[Any]] = {key: [r[0][key] for r in results] for key in results[0][0]}
        output["tokentape_reward"] = [r[1] for r in results]
        output["tokentape_session_id"] = [r[2] for r in results]
        output["tokentape_status"] = [r[3] for r in results]
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
    `global_step` through `POST /admin/weights`.

    A push the gateway refuses, or cannot be reached for, does not end the training step: the step's
    update is already in the model, and the next step pushes a newer adapter that supersedes this
    one, so a transient refusal (an update already under way, a restarting gateway) costs one
    version, not the run. The failure is logged as a warning with the gateway's words, kept in
    `failures`, and rollouts go on sampling the engine's previous weights (each turn records the
    version it was sampled under, so the lag is visible in the tape). `max_failures` pushes failing
    in a row raise a RuntimeError instead: by then the engine's policy has fallen behind the trainer's
    for good and training would be off-policy without end.
    """

    def __init__(self, gateway: GatewayClient, directory: str | Path, *, max_failures: int = 3) -> None:
        self.gateway = gateway
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_failures = max_failures
        self.pushed: list[int] = []
        self.failures: list[tuple[int, str]] = []  # (version, why), every failed push
        self._in_a_row = 0

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        from tokentape.train.weights import write_lora_gguf

        version = int(state.global_step)
        path = write_lora_gguf(model, self.directory / f"lora-v{version}.gguf")
        try:
            _loop().run(self.gateway.update_weights(version, lora=str(path), in_flight="continue"))
        except (
            RuntimeError,
            httpx2.HTTPError,
            openai.APIError,
        ) as exc:  # the gateway refused it, or could not be reached
            self._in_a_row += 1
            self.failures.append((version, str(exc)))
            if self._in_a_row >= self.max_failures:
                raise RuntimeError(
                    f"{self._in_a_row} weight pushes failed in a row (the engine still samples version "
                    f"{self.pushed[-1] if self.pushed else 'its first'}); the last: {exc}"
                ) from exc
            log.warning("weights version %d not pushed, rollouts keep the engine's previous weights: %s", version, exc)
            return
        self._in_a_row = 0
        self.pushed.append(version)
